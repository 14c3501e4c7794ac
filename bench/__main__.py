"""`python -m bench [--quick] [--out BENCHMARKS.md] [--only KEYS]`: run the suite, write BENCHMARKS.md.

Each table runs in its own section: a failure prints "FAILED: reason" in its place and the suite
goes on, but the process exits 1 so CI notices. Without --quick each section runs in a process of its own
(`bench/isolate.py`), so the sections' memory does not add up. The markdown is written atomically; figures go to
`bench-figures/` beside it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.context import Context
from bench.harness import REPO_ROOT, SectionOutput, render_document, run_section
from bench.machine import machine_description, utc_now

SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("accuracy", "1. Tracer accuracy", "bench.accuracy"),
    ("tracer", "2. Tracer cost", "bench.tracer_cost"),
    ("movement", "3. Movement: bytes per iteration vs baselines", "bench.movement"),
    ("planner", "4. Planner cost", "bench.planner_cost"),
    ("optimality", "4b. Optimality of the default plan", "bench.optimality"),
    ("executor", "5. Executor", "bench.executor_bench"),
    ("headline", "6. The seed's headline, replayed as plans (not GPU measurements)", "bench.headline"),
    ("plot", "7. Report cost", "bench.plot_cost"),
    ("multigpu", "8. Many GPUs: AMSP's evaluation replayed (plans) and `hplan run --nproc 2` vs FSDP2 (measured)",
     "bench.multigpu"),
    ("nvme", "9. Third tier: NVMe", "bench.nvme"),
    ("slack", "10. Allocator slack at the budget (plans)", "bench.slack"),
    ("activations", "11. Activations: auto against the forced choices and transformers' checkpointing",
     "bench.activations"),
    ("published", "12. Published single-GPU offload results, replayed (plans, not GPU measurements)",
     "bench.published"),
    ("speed", "13. Executor speed: per-event cost, where a step's time goes, step time against plain PyTorch",
     "bench.executor_speed"),
    ("deepspeed", "14. DeepSpeed ZeRO beside hplan and plain PyTorch (measured, CPU)", "bench.deepspeed_bench"),
    ("regimes", "15. Activations: auto's certificate at every budget, each plan's own slack (plans)", "bench.regimes"),
    ("nested", "16. Activations: segments finer than the outermost siblings (ConvNeXt's blocks) against transformers' "
     "checkpointing", "bench.nested"),
    ("fit", "17. Will it fit? Fake-trace and `hplan fit` time on public configs, the Llama-3-8B row (plans)",
     "bench.fit_cost"),
    ("gpu", "18. The CUDA path on a real GPU: one H200 (measured, 2026-11-28, rendered from bench/gpu_runs/)",
     "bench.gpu_runs"),
)


def section_fn(module: str, ctx: Context) -> Callable[[], SectionOutput]:
    def call() -> SectionOutput:
        import importlib

        return importlib.import_module(module).run(ctx)

    return call


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models, fewer repeats, skip gpt:6.7b–18b (≤ 3 min)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "BENCHMARKS.md", help="markdown file to write")
    p.add_argument("--only", default="", help="comma-separated section keys: " + ",".join(k for k, _, _ in SECTIONS))
    p.add_argument("--update", type=Path, default=None,
                   help="with --only: re-run those sections and splice them into this existing BENCHMARKS.md, "
                        "stamped with date, command, commit and load (bench/splice.py); other sections stay as they are")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    keys = [k for k in args.only.split(",") if k]
    unknown = set(keys) - {k for k, _, _ in SECTIONS}
    if unknown:
        print(f"unknown section(s) {', '.join(sorted(unknown))}: use {', '.join(k for k, _, _ in SECTIONS)}",
              file=sys.stderr)
        return 2
    if args.update is not None and not keys:
        print("--update re-runs only the sections named by --only: add --only KEYS", file=sys.stderr)
        return 2
    if args.update is not None and not args.update.is_file():
        print(f"--update {args.update}: no such file; run without --update to write it whole", file=sys.stderr)
        return 2
    out = (args.update if args.update is not None else args.out).resolve()
    if not out.parent.is_dir():
        print(f"cannot write {out}: folder {out.parent} does not exist; create it first", file=sys.stderr)
        return 2
    machine = machine_description()
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}" if msg.startswith("[bench]") else msg, file=sys.stderr,
              flush=True)

    ctx = Context(quick=args.quick, out_dir=out.parent, fig_dir=out.parent / "bench-figures", log=log)
    chosen = [(key, title, module) for key, title, module in SECTIONS if not keys or key in keys]
    if args.quick:  # one process: section 14 reuses section 13's runs, and CI's time is short
        results = [run_section(key, title, section_fn(module, ctx), log=log) for key, title, module in chosen]
    else:
        from bench.isolate import run_isolated

        results = [run_isolated(key, title, quick=False, out_dir=ctx.out_dir, fig_dir=ctx.fig_dir,
                                work_dir=ctx.work_dir, log=log) for key, title, _ in chosen]
    command = "python -m bench " + " ".join(shlex.quote(a) for a in argv)
    text = render_document(command=command.strip(), machine=machine, date=utc_now(), sections=results,
                           quick=args.quick, total_seconds=time.perf_counter() - t0)
    if args.update is not None:
        from bench.splice import splice

        stamp = (f"{utc_now()} by `{command.strip()}`{' (--quick)' if args.quick else ''}, hplan commit "
                 f"{machine['hplan commit']}, load average {machine['load average (1 min) at start']} at start")
        try:
            text = splice(out.read_text(), text, order=[t for _, t, _ in SECTIONS], stamp=stamp)
        except ValueError as exc:
            print(f"--update {out}: {exc}", file=sys.stderr)
            return 2
    from hplan.artifacts import atomic_path

    with atomic_path(out) as tmp:
        tmp.write_text(text)
    failed = [r for r in results if not r.ok]
    log(f"[bench] wrote {out} in {time.perf_counter() - t0:.0f} s; "
        + (f"{len(failed)} section(s) FAILED: {', '.join(r.key for r in failed)}" if failed else "all sections ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
