"""Bench section 16's middle row (bench.nested_middle): its rules fixed before measuring (budget, verdict), its
lockstep rounds (pinned, who goes first alternating; tiny children) and its checks that each child trains exactly
and moves its plan's bytes; no timing assertions on the figures."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` lives at the repo root, not in hplan


def test_middle_budget_is_the_largest_predicted_gain_the_first_of_equals() -> None:
    from bench.nested_middle import pick

    scanned = [(1.0, 10, {}), (0.98, 20, {}), (0.99, 30, {}), (0.98, 40, {})]
    assert pick(scanned)[1] == 20
    with pytest.raises(RuntimeError, match="no scanned budget"):
        pick([])


def test_middle_verdict_reads_the_interval_of_the_rounds_mean_log_ratio() -> None:
    """Readable only when the 95% interval of the mean log ratio excludes 1; then the signs agree or differ with
    the prediction's; otherwise not readable, with the rounds the spread would need."""
    from bench.nested_middle import interval, rounds_needed, verdict

    below, above = [0.97, 0.98, 0.96, 0.975, 0.985], [1.03, 1.02, 1.04, 1.025, 1.015]
    straddle = [0.95, 1.04, 0.99, 1.03, 0.97]
    assert verdict(0.984, below) == "signs agree" and verdict(1.02, above) == "signs agree"
    assert verdict(0.984, above) == "signs differ" and verdict(1.02, below) == "signs differ"
    assert verdict(1.0, below) == "same predicted step"
    _, lo, hi, sd = interval(straddle)
    assert lo < 1 < hi and verdict(0.984, straddle).startswith("not readable: the 95% interval holds 1")
    mean = interval(straddle)[0]
    assert f"~{rounds_needed(0.984, sd)} rounds resolve the predicted gain, ~{rounds_needed(mean, sd)} the " \
        "measured one" in verdict(0.984, straddle)
    assert verdict(0.98, [0.99, 1.03, 1.01, 0.98, 1.02]).endswith("the measured one is too small or of the other sign)")
    assert rounds_needed(0.984, 0.02) == 6 and rounds_needed(0.984, 0.04) == 24  # (1.96 sd / |log 0.984|)²
    mean, lo, hi, _ = interval([0.9, 1.0])
    assert lo < mean < hi and abs(mean - (0.9 * 1.0) ** 0.5) < 1e-12  # the geometric mean


CHILD = """
import json, os, sys, time
from bench.lockstep import Turns
turns = Turns.from_env()
steps = int(sys.argv[1])
turns.hand_over()
spans = []
for _ in range(steps):
    t0 = time.monotonic()
    time.sleep(0.002)
    spans.append((t0, time.monotonic()))
    turns.hand_over()
print(json.dumps({"turns": turns.count, "argv": sys.argv[2:], "cores": sorted(os.sched_getaffinity(0)),
                  "spans": spans, "step_seconds": [b - a for a, b in spans], "load1": 0.0}))
"""


def test_middle_rounds_pin_a_round_to_one_core_and_rotate_who_goes_first(monkeypatch, tmp_path) -> None:
    """Each round: the three plans' children in lockstep on one core (the next round the next core), each given
    its own plan file and the workload spec, the first to step rotating through the three."""
    import os

    from bench import nested_middle
    from bench.context import Context

    def command(args):
        return [sys.executable, "-c", CHILD, args[3], *args], dict(os.environ)

    monkeypatch.setattr(nested_middle, "worker_command", command)
    ctx = Context(quick=False, out_dir=tmp_path, fig_dir=tmp_path, log=lambda m: None, work_dir=tmp_path)
    keys = (nested_middle.SUB, nested_middle.WHOLE, nested_middle.BLOCKS)
    paths = {k: tmp_path / f"{i}.plan" for i, k in enumerate(keys)}
    rounds = nested_middle.lockstep_rounds(ctx, paths, n=4, steps=2)
    cores = sorted(os.sched_getaffinity(0))
    for r, res in enumerate(rounds):
        assert [res[k]["cores"] for k in paths] == [[cores[r % len(cores)]]] * 3
        assert [res[k]["argv"] for k in paths] == [
            ["speed-run", nested_middle.SYSTEM, nested_middle.SPEC, "2", str(paths[k])] for k in paths]
        spans = sorted((t0, k) for k, p in res.items() for t0, _ in p["spans"])
        assert spans[0][1] == keys[r % 3]


def test_whole_blocks_trace_offers_neither_selective_nor_child_segments() -> None:
    """The middle row's baseline ([Note: the host-limited middle budget]): the tracer patched so every block is
    kept, offloaded or recomputed whole; as traced without the patch the same blocks offer both."""
    from bench.nested import _whole_blocks
    from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    w = load_workload("gpt:tiny")  # two blocks, each with child segments and selective priced
    full = trace_workload(w, device="fake")
    with _whole_blocks():
        whole = trace_workload(w, device="fake")
    assert full.nested and any(not s.selective_reason for s in full.segments)
    assert "selective" in full.allocator_slack_by_choice
    assert [s.module for s in whole.segments] == [s.module for s in full.segments] and not whole.nested
    assert all("whole blocks only" in s.selective_reason for s in whole.segments)
    assert "selective" not in whole.allocator_slack_by_choice
    hardware = make_hardware("cpu", gpu_bytes=1, **trace_slack(whole))
    low = min_gpu_bytes(whole, hardware, activations="auto").gpu_bytes
    plan = make_plan(whole, dataclasses.replace(hardware, gpu_bytes=low), PlanOptions(activations="auto"))
    assert {c.choice for c in plan.activations} <= {"keep", "offload", "recompute"}
    assert {c.module for c in plan.activations} <= {s.module for s in whole.segments}


def test_middle_rounds_refuse_a_child_that_trains_differently_or_moves_other_bytes() -> None:
    from bench.nested_middle import checked

    summary = SimpleNamespace(bytes_moved_per_iter=100, activation_bytes_moved_per_iter=20)
    plans = {"with": SimpleNamespace(summary=summary)}
    good = {"with": {"losses": [2.0, 1.5], "moved_bytes": 120}}
    assert checked([good], plans, [2.0, 1.5]) == 0.0
    with pytest.raises(RuntimeError, match="round 1, with: loss difference 1.0e-04"):
        checked([good], plans, [2.0, 1.50015])
    with pytest.raises(RuntimeError, match="round 2, with: .* 121 bytes moved per iteration against the plan's 120"):
        checked([good, {"with": {"losses": [2.0, 1.5], "moved_bytes": 121}}], plans, [2.0, 1.5])


def test_middle_workload_reaches_a_child_through_its_spec_alone() -> None:
    """The children load the workload from bench.nested_middle's spec: section 16's Llama, batch 2 × seq 512,
    AdamW without foreach (as the parent traces it; its model is not built here: seconds)."""
    import torch

    from bench.nested_middle import SPEC
    from hplan.specs import load_workload

    w = load_workload(SPEC)
    assert (w.batch_size, w.seq_len, w.name) == (2, 512, "hf:LlamaForCausalLM")
    assert w.optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults["foreach"] is False
