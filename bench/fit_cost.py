"""Section — will it fit? (issue 33): fake-trace time and peak RSS of the five public configs and gpt:18b, the
time `hplan fit` takes for one GPU on each, its boundaries (each a feasible plan and an infeasible one a step
larger), and the Llama-3-8B full fine-tune row beside the published figures for that job.

Each measurement runs in a fresh process (`bench.worker`), so its peak RSS is its own; the load average is
written beside every time, and CPU seconds beside wall seconds, since this machine is shared (CPU time is what a
quiet machine's wall time would be). GPU figures are plans, not measurements. --quick keeps one row of each
table (gpt:18b's trace and its fit, which answers from one trace); the full run covers all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.context import Context
from bench.harness import REPO_ROOT, SectionOutput, Table, fmt_bytes, run_worker

CONFIGS = ("llama-3-8b", "qwen2.5-7b", "mistral-7b-v0.1", "gemma-2-9b", "phi-3-mini-4k")
SPECS = tuple(f"hf:examples/configs/{c}" for c in CONFIGS) + ("gpt:18b",)
TRACE_GOAL_S, RSS_GOAL, FIT_GOAL_S = 60.0, 2 * 10**9, 120.0
"""Issue 33: fake trace ≤ 60 s and ≤ 2 GB RSS; `fit` for one GPU ≤ 2 min."""
SEQ = 2048
PUBLISHED = (
    ("torchtune: Llama 3.1 8B full finetune, 1× RTX 4090", "18.9 GiB peak, 1,650 tokens/s",
     "batch 2, seq 2048 (packed), torch.compile; the recipe's config keeps bf16 weights (no fp32 master copy), "
     "bitsandbytes PagedAdamW8bit (8-bit state, paged to host), optimizer in backward, activation checkpointing",
     "github.com/pytorch/torchtune README.md, 'Memory and training speed'; "
     "recipes/configs/llama3_1/8B_full_single_device.yaml"),
    ("FlexTrain: Llama-3.1-8B-Instruct full fine-tune, 1× RTX 5090", "26.8 GiB peak reserved, 3,723 tokens/s",
     "RTX 5090 (31.3 GiB) with 192 GiB of host memory at FlexTrain's auto budget, seq 2048; its planner offloads "
     "and recomputes within the GPU and host budgets",
     "github.com/als244/flextrain docs/verified_runs.md, 'RTX 5090 (31.3 GiB, 192 GiB host) — full sweep'"),
)


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def fit_json(spec: str, *args: str, timeout: float) -> tuple[float, dict[str, Any] | None, str, str, float]:
    """`hplan fit SPEC ARGS --json` in a fresh process: (wall seconds, its JSON, error, load before, CPU s)."""
    cmd = [sys.executable, "-c", "import sys; from hplan.cli import main; sys.argv = ['hplan'] + sys.argv[1:]; main()",
           "fit", spec, *args, "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    load = _load()
    before = os.times()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, None, f"timed out after {timeout:.0f} s", load, 0.0
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    if proc.returncode != 0:
        return wall, None, f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-200:]}", load, cpu
    return wall, json.loads(proc.stdout), "", load, cpu


def boundary_cell(b: dict[str, Any] | None, what: str) -> tuple[str, bool]:
    """The boundary in words and whether it is proven (a feasible plan at k and an infeasible one at k + 1, or a
    named limit, or nothing fits with the first step infeasible)."""
    if b is None:
        return "-", True
    key = "batch" if what == "batch" else "seq"
    if b["best"] is None:
        return f"none ({what} {b['next'][key]} infeasible: {b['next']['reason'][:60]})", not b["next"]["fits"]
    best = b["best"][key]
    if b["next"] is None:
        return f"≥ {best} ({b['limit']})", b["best"]["fits"]
    ok = b["best"]["fits"] and not b["next"]["fits"] and b["next"][key] == best + (1 if key == "batch" else 128)
    return f"{best} ({b['best'].get('tokens_per_s', 0):,.0f} tok/s); {b['next'][key]} infeasible", ok


def run(ctx: Context) -> SectionOutput:
    out = SectionOutput()
    specs = SPECS[-1:] if ctx.quick else SPECS  # every row traces a 3.8B-18B model: the full run takes minutes
    if ctx.quick:
        out.text.append("--quick: `hplan fit` on gpt:18b only (the cheapest row; the command traces it itself, so the "
                        "separate fake-trace row is skipped); the full run adds the five public configs' traces and "
                        "fits and the Llama-3-8B row with a disk tier.")
    traces = Table(headers=["workload (batch 1, AdamW, bf16-mixed)", "fake trace wall (CPU) time", "peak RSS",
                            "load avg", "goal (≤ 60 s, ≤ 2 GB)"],
                   caption="**Fake traces** of the public configs (seq 2048) and gpt:18b (its context, 1024): trace "
                           "time in the worker (imports excluded) and the worker's peak RSS; the goal is judged on "
                           "CPU seconds, what a quiet machine's wall time would be.")
    if ctx.quick:
        traces.add(specs[0], "skipped in --quick", "—", _load(), "—")
    for spec in () if ctx.quick else specs:
        seq = "-" if spec.startswith("gpt:") else str(SEQ)
        load = _load()
        res = run_worker(["fake-trace", spec, str(ctx.work_dir / "fit.parquet"), "1", seq, "bf16-mixed"],
                         timeout=1800)
        if not res.ok:
            out.failures.append(f"fake trace {spec}: {res.error}")
            traces.add(spec, "FAILED", res.error, load, "")
            continue
        secs, rss = res.payload["trace_seconds"], res.peak_rss_bytes
        cpu = res.payload.get("trace_cpu_seconds", secs)
        met = "met" if cpu <= TRACE_GOAL_S and rss <= RSS_GOAL else "missed"
        traces.add(spec, f"{secs:.1f} s ({cpu:.1f} s)", fmt_bytes(rss), load, met)
    out.tables.append(traces)

    fits = Table(headers=["workload", "`hplan fit` wall (CPU) time", "load avg", "b1×s2048", "largest batch",
                          "longest seq", "boundary proven", "goal ≤ 120 s"],
                 caption="**`hplan fit SPEC --gpu rtx4090 --cpu-mem 64GB --seq-len 2048`** (one GPU, the search on): "
                         "each boundary is a feasible plan and an infeasible one a step larger ([Note: fit screen]); "
                         "the time is the whole command's, imports included; the goal is judged on CPU seconds. "
                         "Model data is 16 bytes a parameter (bf16 weights and gradients, fp32 master weights and "
                         "AdamW state), so only Phi-3-mini's fits 24 GB + 64 GB; the others are answered from "
                         "that count after one trace.")
    answers: dict[str, tuple[float, dict[str, Any] | None, str, str, float]] = {}
    for spec in specs:
        args = ["--gpu", "rtx4090", "--cpu-mem", "64GB", "--seq-len", str(SEQ if not spec.startswith("gpt:") else 1024)]
        wall, data, err, load, cpu = answers[spec] = fit_json(spec, *args, timeout=1800)
        if data is None:
            out.failures.append(f"fit {spec}: {err}")
            fits.add(spec, "FAILED", load, err, "", "", "", "")
            continue
        row = data["gpus_rows"][0]
        at = row["at"]
        verdict = "fits" if at["fits"] else f"does not fit ({at['reason']})"
        b, bok = boundary_cell(row["largest_batch"], "batch")
        s, sok = boundary_cell(row["longest_seq"], "seq")
        fits.add(spec, f"{wall:.0f} s ({cpu:.0f} s)", load, verdict, b, s, "yes" if bok and sok else "NO",
                 "met" if cpu <= FIT_GOAL_S else "missed")
        if not (bok and sok):
            out.failures.append(f"fit {spec}: a boundary is not proven by plans")
    out.tables.append(fits)
    if not ctx.quick:
        out.tables.append(_llama(out, answers.get(SPECS[0])))
    return out


def _llama(out: SectionOutput, without_disk: tuple[float, dict[str, Any] | None, str, str, float] | None) -> Table:
    """The Llama-3-8B full fine-tune on one 24 GB card with 64 GB of host memory, beside the published figures."""
    table = Table(headers=["source", "job", "memory", "tokens/s", "setting"],
                  caption="**Llama-3-8B, full fine-tune, bf16-mixed (fp32 master weights and AdamW state), seq 2048, "
                          "one 24 GB card with 64 GB of host memory** (hplan's rows are plans), beside the published "
                          "figures for an 8B full fine-tune on one card.")
    spec = "hf:examples/configs/llama-3-8b"
    for extra, label in (([], "64 GB host"), (["--nvme", "2TB"], "64 GB host + 2 TB NVMe")):
        if not extra and without_disk is not None:  # the same command as the fit table's first row
            wall, data, err, load, cpu = without_disk
        else:
            wall, data, err, load, cpu = fit_json(spec, "--gpu", "rtx4090", "--cpu-mem", "64GB", "--seq-len",
                                                  str(SEQ), *extra, timeout=3000)
        if data is None:
            out.failures.append(f"llama-3-8b {label}: {err}")
            table.add("hplan fit (plan)", label, "FAILED", err, "")
            continue
        row = data["gpus_rows"][0]
        b = row["largest_batch"]
        if b is None or b["best"] is None:
            reason = (row["at"]["reason"] if not row["at"]["fits"] else "")[:160]
            table.add("hplan fit (plan)", f"rtx4090, {label}", "does not fit", "-",
                      f"{reason}; fit took {wall:.0f} s ({cpu:.0f} s CPU) at load {load}")
            continue
        best = b["best"]
        table.add("hplan fit (plan)", f"rtx4090, {label}: largest batch {best['batch']}",
                  (f"GPU needs {fmt_bytes(best['least_gpu_bytes'])} (its plan at the card's budget peaks at "
                   f"{fmt_bytes(best['gpu_bytes'])}), " if best.get("least_gpu_bytes") else
                   f"GPU {fmt_bytes(best['gpu_bytes'])}, ") + f"host {fmt_bytes(best['host_bytes'])}, "
                  f"disk {fmt_bytes(best['nvme_bytes'])}", f"{best['tokens_per_s']:,.0f}",
                  f"batch {best['batch'] + 1} infeasible ({(b['next'] or {}).get('reason', b.get('limit', ''))[:80]}); "
                  f"fit took {wall:.0f} s ({cpu:.0f} s CPU) at load {load}")
    for source, memory_speed, setting, cite in PUBLISHED:
        mem, speed = memory_speed.split(", ")
        table.add(source, "published measurement", mem, speed.replace(" tokens/s", ""), f"{setting} ({cite})")
    return table
