"""Bench section 16's middle row (issue 31): an 8-layer Llama at a middle budget with host memory for the model data
alone; auto with sub-block choices against auto on whole blocks and against blocks with selective checkpointing,
priced at this machine's rates measured in the run and measured in pinned lockstep rounds of fresh processes.

[Note: the host-limited middle budget] With host memory unbounded, this CPU's rates (bench.cpu_rates) make
offloading a block's activations cheaper than recomputing any part of it, so choices inside a block change little
(0.4% predicted, section 16 on 2026-11-30). With `--cpu-mem` = the trace's model bytes (a rule fixed before
measuring: host memory holds the model data hplan moves there and nothing more, so auto cannot offload
activations), auto keeps or recomputes, and what it can recompute decides the step. Three plans at one budget, from
three fake traces of the same workload:
- sub-block choices: hplan's auto as it is, a block kept, recomputed whole, recomputed selectively (its cheap ops;
  the matmul outputs kept: [Note: selective segments] in hplan.artifacts.segments) or with a child segment (its MLP
  or attention) recomputed alone — the op groups and nested segments of issue 31's §3;
- whole blocks: the tracer patched (bench.nested `_whole_blocks`) so a block is kept or recomputed whole, the unit
  auto chose before §3 ("block-level auto", the issue's baseline);
- blocks with selective: child segments patched away only (bench.nested `_blocks_only`), so the ratio against it
  is the child segments' own share.
Fresh processes run one after the other spread ±10% a round on this shared 2-core VM, so each round here is the
three plans' processes (bench.speed_runs' `hplan` children, each loading its saved plan and the workload from this
file's `middle_workload`) in lockstep on one core ([Note: lockstep rounds], [Note: one core for both] in
bench.lockstep). The rules, fixed before the rounds were run:
- budget: of MIDDLE_SCAN budgets evenly spaced strictly between auto's minimum (sub-block choices, host-limited)
  and keep's, the one where sub-block choices predict the largest gain over whole blocks (the first of equals);
- rounds: MIDDLE_ROUNDS, who goes first rotating through the three, the next round on the next core (18 = each
  order on each core three times); a round's ratio: the median steady step (the first left out) of one plan's
  process over another's, same round, same core;
- verdict, per ratio: on the rounds' log ratios, the 95% Student-t interval of their mean. "signs agree" (or
  "signs differ") only when the interval excludes 0 and its sign is (is not) that of the predicted log ratio;
  otherwise "not readable", with the rounds the measured spread would need for the predicted gain to stand 1.96
  standard errors from 1;
- each child's losses must equal plain PyTorch's (LOSS_TOLERANCE, relative) and its bytes moved per iteration the
  plan's, or the row fails: a faster step that trains differently or moves other bytes measures nothing.
History: the row's first rule (session 16, 2026-11-30) compared only child segments with blocks with selective, at
that pair's largest predicted gain (262.22 MB: `7.self_attn` recomputed alone, 1.6% predicted): 16 rounds measured
0.997× (95%: 0.979–1.016×), not readable. That share is still read here, now beside the comparison the issue names.
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
MIDDLE_ROUNDS, MIDDLE_STEPS = 18, 5
"""Lockstep rounds (each of the three orders on each of the two cores three times), and steps per process (the
first left out). A round costs three processes' start-up on one core (~15 s) and 3 × MIDDLE_STEPS steps of ~2 s.
At the spread session 16's quiet run showed (sd 0.034 of a round's log ratio), 18 rounds put a 3.4% gain ~4
standard errors from 1 and a 1.6% gain ~2."""
SUB, WHOLE, BLOCKS = "sub-block choices", "whole blocks", "blocks with selective"
"""The three plans ([Note: the host-limited middle budget]); SUB ÷ WHOLE is issue 31's number, SUB ÷ BLOCKS the
child segments' own share."""
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
    """(predicted step of the first trace's plan ÷ the second's, budget, plans by key) at each scanned budget where
    both plans fit; the budgets run from the first trace's auto minimum to the second's keep minimum."""
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
    """The budget where sub-block choices predict the largest gain, the first of equal gains (fixed before
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
    at the measured spread `sd` of the rounds' log ratios (`predicted` may be the measured mean: a gain that size)."""
    gain = abs(math.log(predicted))
    return math.ceil((1.96 * sd / gain) ** 2) if gain > 0 else 0


def verdict(predicted: float, ratios: Sequence[float]) -> str:
    """[Note: the host-limited middle budget]'s rule: readable only when the interval of the mean log ratio
    excludes 1."""
    if predicted == 1:
        return "same predicted step"
    mean, lo, hi, sd = interval(ratios)
    if hi < 1 or lo > 1:
        return "signs agree" if (predicted < 1) == (hi < 1) else "signs differ"
    measured = (f"~{rounds_needed(mean, sd)} the measured one" if (mean < 1) == (predicted < 1) and mean != 1
                and rounds_needed(mean, sd) <= 1000 else "the measured one is too small or of the other sign")
    return (f"not readable: the {CONFIDENCE:.0%} interval holds 1 (predicted gain {(1 - predicted) * 100:.1f}%, "
            f"measured {(1 - mean) * 100:.1f}%; at this spread ~{rounds_needed(predicted, sd)} rounds resolve the "
            f"predicted gain, {measured})")


def ratio(res: dict[str, dict[str, Any]], a: str, b: str) -> float:
    """A round's ratio: plan `a`'s process's median steady step over plan `b`'s (the rule above)."""
    return steady_median(res[a]) / steady_median(res[b])


def lockstep_rounds(ctx: Context, paths: dict[str, Path], *, n: int, steps: int) -> list[dict[str, dict[str, Any]]]:
    """`n` rounds: the plans' `speed-run` children in lockstep on one core, the next round on the next core, who
    goes first rotating through the keys; each round's payloads by key. A failed round raises, naming it."""
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
            res = lockstep(cmds, steps=steps, first=r % len(keys), timeout=600, env=env, cwd=str(REPO_ROOT),
                           cores=frozenset({cores[r % len(cores)]}))
        except RuntimeError as exc:
            raise RuntimeError(f"middle round {r + 1}: {exc}") from None
        out.append(res)
        ratios = ", ".join(f"{k} {ratio(res, keys[0], k):.3f}" for k in keys[1:])
        ctx.log(f"[bench]   middle round {r + 1}/{n} on core {cores[r % len(cores)]}: {keys[0]} ÷ {ratios} "
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


def middle_table(ctx: Context) -> tuple[Table, str]:
    """The middle row ([Note: the host-limited middle budget]): the scan, the rounds, the table and its headline."""
    import torch

    from bench.cpu_rates import cpu_rates
    from bench.nested import BATCH, SEQ, H, _blocks_only, _hardware, _whole_blocks
    from hplan.planner import PlanOptions, make_plan
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload
    from hplan.training import plain_losses

    w = load_workload(SPEC)
    traces = {SUB: trace_workload(w, device="fake")}
    with _whole_blocks():
        traces[WHOLE] = trace_workload(w, device="fake")
    with _blocks_only():
        traces[BLOCKS] = trace_workload(w, device="fake")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the children run: one torch thread
    try:
        rates = cpu_rates(w, traces[SUB])
        plain = plain_losses(w, MIDDLE_STEPS)
    finally:
        torch.set_num_threads(threads)
    host = host_limit(traces[SUB])
    t0 = time.perf_counter()
    scanned = scan({k: traces[k] for k in (SUB, WHOLE)}, rates, host)
    ctx.log(f"[bench]   middle scan: {len(scanned)} budgets in {time.perf_counter() - t0:.0f} s")
    predicted, budget, plans = pick(scanned)
    plans[BLOCKS] = make_plan(traces[BLOCKS], _hardware(traces[BLOCKS], budget, rates, host),
                              PlanOptions(activations="auto"))
    paths = {}
    for i, (k, plan) in enumerate(plans.items()):
        paths[k] = ctx.work_dir / f"middle-{i}.plan"
        plan.save(paths[k])
    rounds = lockstep_rounds(ctx, paths, n=MIDDLE_ROUNDS, steps=MIDDLE_STEPS)
    worst = checked(rounds, plans, plain)
    loads = [p["load1"] for res in rounds for p in res.values()]
    table = Table(headers=[f"auto at {fmt_bytes(budget)}, host {fmt_bytes(host)}", "choices inside blocks",
                           "block choices (k/o/r/s)", "predicted step (plan)", "measured CPU step (median)",
                           "bytes moved per iter: run / plan", "load", "verdict"],
                  caption=f"**Middle budget, 8-layer Llama, host memory for the model data alone** (hidden {H}, "
                          f"batch {BATCH} × seq {SEQ}, `--cpu-mem` = the trace's model bytes, so auto cannot offload "
                          f"activations; plans priced at this machine's rates measured in this run with one torch "
                          f"thread: {rates['tflops_32'] * 1e3:.0f} GFLOP/s of model FLOPs, link "
                          f"{rates['h2d_gbps']:.1f} GB/s, host AdamW {rates['cpu_optimizer_gbps']:.1f} GB/s. Auto "
                          f"with {SUB} (selective checkpointing of a block's cheap ops, a child segment recomputed "
                          f"alone) against auto on {WHOLE} and on {BLOCKS} but no child segments (the tracer "
                          f"patched); the budget is the one of {MIDDLE_SCAN}, evenly spaced strictly between auto's "
                          f"minimum and keep's, where {SUB} predict the largest gain over {WHOLE}; {MIDDLE_ROUNDS} "
                          f"lockstep rounds of three fresh processes pinned to one core, the next round the next "
                          f"core, who goes first rotating, {MIDDLE_STEPS} steps each, the first left out; each "
                          f"verdict reads the {CONFIDENCE:.0%} interval of the rounds' mean log ratio, a rule fixed "
                          f"before measuring).")
    for k, plan in plans.items():
        inner = [c for c in plan.activations if c.module.count(".") > 2 and c.choice != "keep"]
        kinds = [c.choice for c in plan.activations if c.module.count(".") <= 2]
        s = plan.summary
        moved = {p[k]["moved_bytes"] for p in rounds}
        table.add(k, ", ".join(f"{c.module.split('.', 2)[-1]} {c.choice}" for c in inner) or "none",
                  "/".join(str(kinds.count(c)) for c in ("keep", "offload", "recompute", "selective")),
                  f"{s.predicted_step_seconds * 1e3:.1f} ms (certified gap {s.gap:.1%})",
                  f"{statistics.median(steady_median(p[k]) for p in rounds) * 1e3:.0f} ms",
                  f"{' / '.join(fmt_bytes(m) for m in sorted(moved))} / "
                  f"{fmt_bytes(s.bytes_moved_per_iter + s.activation_bytes_moved_per_iter)}",
                  f"{statistics.mean(loads):.1f}", "")
    read = {}
    for base in (WHOLE, BLOCKS):
        ratios = [ratio(res, SUB, base) for res in rounds]
        guess = plans[SUB].summary.predicted_step_seconds / plans[base].summary.predicted_step_seconds
        mean, lo, hi, sd = interval(ratios)
        read[base] = (guess, mean, lo, hi, verdict(guess, ratios))
        table.add(f"{SUB} ÷ {base}", "", "", f"{guess:.3f}×",
                  f"{mean:.3f}× ({CONFIDENCE:.0%}: {lo:.3f}–{hi:.3f}×; rounds {min(ratios):.3f}–{max(ratios):.3f}×, "
                  f"sd {statistics.stdev(ratios):.3f})", f"losses within {worst:.1e} of plain PyTorch",
                  f"{statistics.mean(loads):.1f}", read[base][4])
    table.notes.append(f"Predicted {SUB} ÷ {WHOLE} over the scan: " + ", ".join(
        f"{fmt_bytes(bud)} {r:.3f}×" for r, bud, _ in scanned) + f"; the largest predicted gain is "
        f"{(1 - predicted) * 100:.1f}%. Without the host limit this CPU's rates make offload cheaper than any "
        "recompute and choices inside a block change little ([Note: the host-limited middle budget] in "
        "bench/nested_middle.py).")
    guess, mean, lo, hi, said = read[WHOLE]
    headline = (f"8-layer Llama at a middle budget ({fmt_bytes(budget)}, host memory for the model data alone): "
                f"auto with {SUB} ÷ auto on {WHOLE}, predicted {guess:.3f}×, measured CPU step {mean:.3f}× "
                f"({CONFIDENCE:.0%}: {lo:.3f}–{hi:.3f}×, {MIDDLE_ROUNDS} pinned lockstep rounds): {said}; "
                f"÷ {BLOCKS} (child segments' share) predicted {read[BLOCKS][0]:.3f}×, measured "
                f"{read[BLOCKS][1]:.3f}×: {read[BLOCKS][4]}")
    return table, headline
