"""Bench section 16's middle row (issue 31): an 8-layer Llama at a middle budget with host memory for the model data
alone, auto with child segments against auto on blocks only, priced at this machine's rates measured in the run and
measured in pinned lockstep rounds of fresh processes.

[Note: the host-limited middle budget] With host memory unbounded, this CPU's rates (bench.cpu_rates) make
offloading a block's activations cheaper than recomputing any part of it, so child segments choose nothing inside a
block and the plans differ by at most one block kept (0.4% predicted, section 16 on 2026-11-30): nothing a measured
step can read. With `--cpu-mem` = the trace's model bytes (a rule fixed before measuring: host memory holds the
model data hplan moves there and nothing more, so auto cannot offload activations), block-level auto recomputes
whole blocks or their cheap ops (selective), and a child segment can recompute a block's MLP or attention alone:
1.6% predicted at best over the scan (hand-checked on 2026-11-30). Fresh processes run one after the other spread
±10% a round on this shared 2-core VM, so each round here is two fresh processes (bench.speed_runs' `hplan`
children, each loading its saved plan and the workload from this file's `middle_workload`) in lockstep on one core
([Note: lockstep rounds], [Note: one core for both] in bench.lockstep), who goes first alternating, the next round
on the next core. The rules, fixed before the rounds were first run:
- budget: of MIDDLE_SCAN budgets evenly spaced strictly between auto's minimum (child segments, host-limited) and
  keep's (blocks only), the one where child segments predict the largest gain (the first of equal gains);
- a round's ratio: the median steady step (the first left out) of the child-segment plan's process over that of
  the blocks-only one, same round, same core;
- verdict: on the rounds' log ratios, the 95% Student-t interval of their mean. "signs agree" (or "signs differ")
  only when the interval excludes 0 and its sign is (is not) that of the predicted log ratio; otherwise "not
  readable", with the rounds that the measured spread would need for the predicted gain to stand 1.96 standard
  errors from 1;
- each child's losses must equal plain PyTorch's (LOSS_TOLERANCE, relative) and its bytes moved per iteration the
  plan's, or the row fails: a faster step that trains differently or moves other bytes measures nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.context import Context
from bench.executor_speed import steady_median
from bench.harness import REPO_ROOT, Table, fmt_bytes, rel_diff, worker_command

SPEC = f"{Path(__file__).resolve()}:middle_workload"
"""The workload both the parent and each round's children load: the spec alone reaches the child."""
LAYERS = 8
MIDDLE_SCAN = 7
"""Budgets scanned: eighths of the way from auto's minimum to keep's ([Note: the host-limited middle budget])."""
MIDDLE_ROUNDS, MIDDLE_STEPS = 16, 5
"""Lockstep rounds, and steps per process (the first left out). A round costs the two processes' start-up on one
core (~10 s) and 2 × MIDDLE_STEPS steps of ~1 s; at the per-round sd the pinned rounds showed on gpt:small (~0.024),
16 rounds would put a 1.6% gain ~2.7 standard errors from 1. Here, at load 3-10 on 2026-11-30 (other jobs on
both cores, so on the pinned one too), the rounds' sd was 0.068 and 0.057 in two runs of the section: the verdict
asked for ~42 and ~62 rounds."""
SYSTEM = "hplan"
"""bench.speed_runs' system: hplan's default (`overlap="auto"`: in line on one core; gradients checked)."""
LOSS_TOLERANCE = 1e-5
CONFIDENCE = 0.95


def middle_workload() -> Any:
    """Section 16's Llama at 8 layers, batch 2 × seq 512, AdamW without foreach (the rounds' children load it)."""
    from hplan.specs import load_workload

    from bench.nested import BATCH, MODELS, SEQ, _adamw

    spec, config = MODELS["Llama"]
    return dataclasses.replace(load_workload(spec, overrides={**config, "num_hidden_layers": LAYERS},
                                             batch_size=BATCH, seq_len=SEQ), optimizer=_adamw)


def host_limit(trace: Any) -> int:
    """Host memory for the model data alone ([Note: the host-limited middle budget])."""
    return int(trace.model_bytes)


def scan(traces: dict[str, Any], rates: dict[str, Any], host: int) -> list[tuple[float, int, dict[str, Any]]]:
    """(predicted step with ÷ without, budget, plans by key) at each scanned budget where both plans fit; the first
    trace of `traces` has child segments, the second not."""
    from hplan.errors import HplanError
    from hplan.planner import PlanOptions, make_plan

    from bench.nested import _hardware, _min

    (a, ta), (b, tb) = traces.items()
    low, keep = _min(ta, rates=rates, host=host).gpu_bytes, _min(tb, "keep", rates, host).gpu_bytes
    out = []
    for i in range(1, MIDDLE_SCAN + 1):
        budget = low + (keep - low) * i // (MIDDLE_SCAN + 1)
        try:
            plans = {k: make_plan(t, _hardware(t, budget, rates, host), PlanOptions(activations="auto"))
                     for k, t in traces.items()}
        except HplanError:  # blocks only may not fit where child segments do: no ratio at this budget
            continue
        out.append((plans[a].summary.predicted_step_seconds / plans[b].summary.predicted_step_seconds, budget, plans))
    return out


def pick(scanned: Sequence[tuple[float, int, dict[str, Any]]]) -> tuple[float, int, dict[str, Any]]:
    """The budget where child segments predict the largest gain, the first of equal gains (fixed before
    measuring)."""
    if not scanned:
        raise RuntimeError("no scanned budget fits both plans")
    return min(scanned, key=lambda s: s[0])


def interval(ratios: Sequence[float]) -> tuple[float, float, float, float]:
    """Mean of the rounds' log ratios as a ratio, its CONFIDENCE Student-t interval (as ratios) and the log ratios'
    standard deviation."""
    from scipy.special import stdtrit  # Student's t quantile (scipy.stats would import far more)

    logs = [math.log(r) for r in ratios]
    mean, sd = statistics.mean(logs), statistics.stdev(logs)
    half = float(stdtrit(len(logs) - 1, (1 + CONFIDENCE) / 2)) * sd / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half), sd


def rounds_needed(predicted: float, sd: float) -> int:
    """Rounds at which a true log ratio of log(`predicted`) would stand 1.96 standard errors of the mean from 0,
    at the measured spread `sd` of the rounds' log ratios."""
    gain = abs(math.log(predicted))
    return math.ceil((1.96 * sd / gain) ** 2) if gain > 0 else 0


def verdict(predicted: float, ratios: Sequence[float]) -> str:
    """[Note: the host-limited middle budget]'s rule: readable only when the interval of the mean log ratio
    excludes 1."""
    if predicted == 1:
        return "same predicted step"
    _, lo, hi, sd = interval(ratios)
    if hi < 1 or lo > 1:
        return "signs agree" if (predicted < 1) == (hi < 1) else "signs differ"
    return (f"not readable: the {CONFIDENCE:.0%} interval holds 1 (predicted gain {(1 - predicted) * 100:.1f}%; "
            f"~{rounds_needed(predicted, sd)} rounds at this spread)")


def lockstep_rounds(ctx: Context, paths: dict[str, Path], *, n: int, steps: int) -> list[dict[str, dict[str, Any]]]:
    """`n` rounds: the plans' `speed-run` children in lockstep on one core, the next round on the next core, who
    goes first alternating; each round's payloads by key. A failed round raises, naming it."""
    from bench.lockstep import lockstep

    cores = sorted(os.sched_getaffinity(0))
    keys = list(paths)
    out = []
    for r in range(n):
        t0 = time.perf_counter()
        cmds, env = {}, None
        for k in keys:
            cmds[k], env = worker_command(["speed-run", SYSTEM, SPEC, str(steps), str(paths[k])])
        try:
            res = lockstep(cmds, steps=steps, first=r % 2, timeout=600, env=env, cwd=str(REPO_ROOT),
                           cores=frozenset({cores[r % len(cores)]}))
        except RuntimeError as exc:
            raise RuntimeError(f"middle round {r + 1}: {exc}") from None
        out.append(res)
        ratio = steady_median(res[keys[0]]) / steady_median(res[keys[1]])
        ctx.log(f"[bench]   middle round {r + 1}/{n} on core {cores[r % len(cores)]}: with ÷ without {ratio:.3f} "
                f"({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f})")
    return out


def checked(rounds: Sequence[dict[str, dict[str, Any]]], plans: dict[str, Any], plain: Sequence[float]) -> float:
    """The largest loss difference against plain PyTorch over every child; raises when one trains differently
    or moves other bytes per iteration than its plan."""
    worst = 0.0
    for r, res in enumerate(rounds):
        for k, payload in res.items():
            diff = max(rel_diff(a, b) for a, b in zip(payload["losses"], plain, strict=True))
            s = plans[k].summary
            planned = s.bytes_moved_per_iter + s.activation_bytes_moved_per_iter
            if diff > LOSS_TOLERANCE or payload["moved_bytes"] != planned:
                raise RuntimeError(f"middle round {r + 1}, {k}: loss difference {diff:.1e} against plain PyTorch, "
                                   f"{payload['moved_bytes']} bytes moved per iteration against the plan's {planned}")
            worst = max(worst, diff)
    return worst


def middle_table(ctx: Context) -> Table:
    """The middle row ([Note: the host-limited middle budget]): the scan, the rounds, the table."""
    import torch

    from bench.cpu_rates import cpu_rates
    from bench.nested import BATCH, SEQ, H, _blocks_only
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload
    from hplan.training import plain_losses

    w = load_workload(SPEC)
    traces = {"with child segments": trace_workload(w, device="fake")}
    with _blocks_only():
        traces["blocks only"] = trace_workload(w, device="fake")
    (a, ta), (b, _) = traces.items()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the children run: one torch thread
    try:
        rates = cpu_rates(w, ta)
        plain = plain_losses(w, MIDDLE_STEPS)
    finally:
        torch.set_num_threads(threads)
    host = host_limit(ta)
    t0 = time.perf_counter()
    scanned = scan(traces, rates, host)
    ctx.log(f"[bench]   middle scan: {len(scanned)} budgets in {time.perf_counter() - t0:.0f} s")
    predicted, budget, plans = pick(scanned)
    paths = {}
    for i, (k, plan) in enumerate(plans.items()):
        paths[k] = ctx.work_dir / f"middle-{i}.plan"
        plan.save(paths[k])
    rounds = lockstep_rounds(ctx, paths, n=MIDDLE_ROUNDS, steps=MIDDLE_STEPS)
    worst = checked(rounds, plans, plain)
    ratios = [steady_median(res[a]) / steady_median(res[b]) for res in rounds]
    loads = [p["load1"] for res in rounds for p in res.values()]
    table = Table(headers=[f"auto at {fmt_bytes(budget)}, host {fmt_bytes(host)}", "choices inside blocks",
                           "block choices (k/o/r/s)", "predicted step (plan)", "measured CPU step (median)",
                           "bytes moved per iter: run / plan", "load", "verdict"],
                  caption=f"**Middle budget, 8-layer Llama, host memory for the model data alone** (hidden {H}, "
                          f"batch {BATCH} × seq {SEQ}, `--cpu-mem` = the trace's model bytes, so auto cannot offload "
                          f"activations; plans priced at this machine's rates measured in this run with one torch "
                          f"thread: {rates['tflops_32'] * 1e3:.0f} GFLOP/s of model FLOPs, link "
                          f"{rates['h2d_gbps']:.1f} GB/s, host AdamW {rates['cpu_optimizer_gbps']:.1f} GB/s; the "
                          f"budget is the one of {MIDDLE_SCAN}, evenly spaced strictly between auto's minimum and "
                          f"keep's, where child segments predict the largest gain; {MIDDLE_ROUNDS} lockstep rounds "
                          f"of two fresh processes pinned to one core, the next round the next core, who goes first "
                          f"alternating, {MIDDLE_STEPS} steps each, the first left out; the verdict reads the "
                          f"{CONFIDENCE:.0%} interval of the rounds' mean log ratio, a rule fixed before measuring).")
    for k, plan in plans.items():
        inner = [c for c in plan.activations if c.module.count(".") > 2 and c.choice != "keep"]
        kinds = [c.choice for c in plan.activations if c.module.count(".") <= 2]
        s = plan.summary
        moved = {p[k]["moved_bytes"] for p in rounds}
        table.add(k, ", ".join(f"{c.module.split('.', 2)[-1]} {c.choice}" for c in inner) or "none",
                  "/".join(str(kinds.count(c)) for c in ("keep", "offload", "recompute", "selective")),
                  f"{s.predicted_step_seconds * 1e3:.1f} ms",
                  f"{statistics.median(steady_median(p[k]) for p in rounds) * 1e3:.0f} ms",
                  f"{' / '.join(fmt_bytes(m) for m in sorted(moved))} / "
                  f"{fmt_bytes(s.bytes_moved_per_iter + s.activation_bytes_moved_per_iter)}",
                  f"{statistics.mean(loads):.1f}", "")
    mean, lo, hi, sd = interval(ratios)
    table.add("with ÷ without", "", "", f"{predicted:.3f}×",
              f"{mean:.3f}× ({CONFIDENCE:.0%}: {lo:.3f}–{hi:.3f}×; rounds {min(ratios):.3f}–{max(ratios):.3f}×, "
              f"sd {statistics.stdev(ratios):.3f})", f"losses within {worst:.1e} of plain PyTorch",
              f"{statistics.mean(loads):.1f}", verdict(predicted, ratios))
    table.notes.append("Predicted with ÷ without over the scan: " + ", ".join(
        f"{fmt_bytes(bud)} {r:.3f}×" for r, bud, _ in scanned) + f"; the largest predicted gain is "
        f"{(1 - predicted) * 100:.1f}%. Without the host limit this CPU's rates make offload cheaper than any "
        "recompute and child segments choose nothing inside a block ([Note: the host-limited middle budget] in "
        "bench/nested_middle.py).")
    return table
