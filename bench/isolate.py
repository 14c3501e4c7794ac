"""One bench section in a process of its own: `python -m bench` runs each section this way unless --quick.

Why: run one after another in one process, the sections' memory added up (caches, loaded traces, the
allocator's high-water marks) until the kernel killed the whole suite in section 9 at 17 GB RSS, although
each section alone peaks at a few GB. A child per section starts from a fresh address space, so a
section's figures do not depend on what ran before it, and a section that dies takes only itself down.

The child writes its `SectionResult` as JSON (cells as text, as the markdown renders them); fake traces
are shared through the run's work folder (`Context.fake_run`), so a trace is still made once per run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import REPO_ROOT, SectionOutput, SectionResult, Table, run_section

SECTION_TIMEOUT_S = 3 * 3600.0
"""A section that has not finished in this long is stuck (the slowest takes ~20 min on this machine)."""


def _cell(value: Any) -> str | None:
    return None if value is None else str(value)


def result_to_json(result: SectionResult) -> dict[str, Any]:
    out = result.output
    return {
        "key": result.key, "title": result.title, "error": result.error, "seconds": result.seconds,
        "output": None if out is None else {
            "tables": [{"headers": [str(h) for h in t.headers], "rows": [[_cell(c) for c in r] for r in t.rows],
                        "caption": t.caption, "notes": list(t.notes)} for t in out.tables],
            "text": list(out.text), "figures": [list(f) for f in out.figures],
            "headline": list(out.headline), "failures": list(out.failures)},
    }


def result_from_json(data: dict[str, Any]) -> SectionResult:
    out = data["output"]
    output = None if out is None else SectionOutput(
        tables=[Table(headers=t["headers"], rows=t["rows"], caption=t["caption"], notes=t["notes"])
                for t in out["tables"]],
        text=out["text"], figures=[(c, p) for c, p in out["figures"]], headline=out["headline"],
        failures=out["failures"])
    return SectionResult(key=data["key"], title=data["title"], output=output, error=data["error"],
                         seconds=float(data["seconds"]))


def _died(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = " (killed: most likely out of memory)" if rc == -signal.SIGKILL else ""
        return f"the section's process died of {name}{why}"
    return f"the section's process exited {rc} without a result"


def run_isolated(key: str, title: str, *, quick: bool, out_dir: Path, fig_dir: Path, work_dir: Path,
                 log: Callable[[str], None]) -> SectionResult:
    """Run section `key` in `python -m bench.isolate`; its log goes to our stderr as it runs."""
    fd, name = tempfile.mkstemp(prefix=f"section-{key}-", suffix=".json", dir=work_dir)
    os.close(fd)
    result_path = Path(name)
    cmd = [sys.executable, "-m", "bench.isolate", key, "--out-dir", str(out_dir), "--fig-dir", str(fig_dir),
           "--work-dir", str(work_dir), "--result", str(result_path)] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=False, timeout=SECTION_TIMEOUT_S).returncode
        text = result_path.read_text()
        if rc == 0 and text:
            return result_from_json(json.loads(text))
        error = _died(rc)
    except subprocess.TimeoutExpired:
        error = f"the section's process ran past {SECTION_TIMEOUT_S:.0f} s and was stopped"
    finally:
        result_path.unlink(missing_ok=True)
    log(f"[bench] {title}: FAILED: {error}")
    return SectionResult(key=key, title=title, output=None, error=error, seconds=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.__main__ import SECTIONS, section_fn
    from bench.context import Context

    p = argparse.ArgumentParser(prog="python -m bench.isolate", description="one bench section (internal)")
    p.add_argument("key", choices=[k for k, _, _ in SECTIONS])
    p.add_argument("--quick", action="store_true")
    for flag in ("--out-dir", "--fig-dir", "--work-dir", "--result"):
        p.add_argument(flag, type=Path, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    title, module = next((t, m) for k, t, m in SECTIONS if k == args.key)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}" if msg.startswith("[bench]") else msg, file=sys.stderr,
              flush=True)

    ctx = Context(quick=args.quick, out_dir=args.out_dir, fig_dir=args.fig_dir, log=log, work_dir=args.work_dir)
    result = run_section(args.key, title, section_fn(module, ctx), log=log)
    args.result.write_text(json.dumps(result_to_json(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
