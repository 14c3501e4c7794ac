"""Bench section 13's step-time plumbing (bench.executor_speed, bench.speed_steps, bench.speed_runs,
bench.lockstep): rounds, lockstep turns, paired steps, page faults; no timing assertions on the figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` lives at the repo root, not in hplan


def test_speed_round_ratios_pair_runs_of_the_same_round() -> None:
    from bench.executor_speed import round_ratios

    runs = {"a": [{"step_seconds": [9.0, 2.0, 2.0]}, {"step_seconds": [9.0, 6.0, 6.0]}],
            "b": [{"step_seconds": [1.0, 1.0, 1.0]}, {"step_seconds": [1.0, 3.0, 3.0]}]}
    assert round_ratios(runs, "a", "b") == [2.0, 2.0]  # first step (warm-up) left out, rounds never mixed


def test_speed_rounds_run_every_system_each_round_and_keep_each_systems_runs_apart(monkeypatch, tmp_path) -> None:
    """Each round runs every system once, in the order given; results stay per system, in round order; a failed run
    raises naming the system and the round."""
    from bench import executor_speed
    from bench.context import Context
    from bench.harness import ChildResult

    order: list[str] = []

    def fake(args, *, timeout):
        order.append(args[1])
        if args[1] == "fail" and order.count("fail") == 2:
            return ChildResult(ok=False, wall_seconds=0.0, peak_rss_bytes=0, payload={}, error="exit 1: boom")
        return ChildResult(ok=True, wall_seconds=0.0, peak_rss_bytes=0, payload={"system": args[1], "n": len(order)})

    monkeypatch.setattr(executor_speed, "run_worker", fake)
    ctx = Context(quick=True, out_dir=tmp_path, fig_dir=tmp_path, log=lambda m: None)
    runs = executor_speed.rounds(ctx, {"a": ("a",), "b": ("b",), "c": ("c",)}, steps=1, n=3)
    assert order == ["a", "b", "c"] * 3
    assert [[(p["system"], p["n"]) for p in runs[k]] for k in "abc"] == [[("a", 1), ("a", 4), ("a", 7)],
                                                                        [("b", 2), ("b", 5), ("b", 8)],
                                                                        [("c", 3), ("c", 6), ("c", 9)]]
    with pytest.raises(RuntimeError, match=r"^f \(round 2\): exit 1: boom$"):
        executor_speed.rounds(ctx, {"f": ("fail",)}, steps=1, n=3)


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> Path:
    """gpt:tiny's plan with room to spare, saved (planning is most of these tests' time: made once)."""
    from loops import plan_for
    from hplan.specs import load_workload

    path = tmp_path_factory.mktemp("speed") / "tiny.plan"
    plan_for(load_workload("gpt:tiny"), extra=3.0).save(path)
    return path


def test_paired_speed_steps_alternate_plain_and_hplan_on_the_same_batches(tiny_plan: Path) -> None:
    """Section 13's paired steps: both loops train, step for step, to the same losses (all-resident: bit for bit),
    each step timed once; the quartiles of the step ratios are those of the inclusive method."""
    from bench.speed_runs import _paired
    from bench.speed_steps import quartiles
    from hplan.specs import load_workload

    out = _paired(load_workload("gpt:tiny"), 3, str(tiny_plan))
    assert len(out["step_seconds"]) == len(out["plain_seconds"]) == 3
    assert out["losses"] == out["plain_losses"] and out["worker"] is False
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0) and quartiles([1.5]) == (1.5, 1.5)


LOCKSTEP_CHILD = """
import json, sys, time
from bench.lockstep import Turns
mode, steps = sys.argv[1], int(sys.argv[2])
turns = Turns.from_env()
if mode != "early":
    turns.hand_over()  # set-up done
if mode == "quit":
    import os
    os.close(turns.go)  # gone before its turn comes back: the parent's write to it fails
    os.write(turns.back, b"t")
    sys.exit(0)
spans = []
for i in range(steps):
    t0 = time.monotonic()
    if i == 1 and mode == "die":
        sys.exit("died on purpose")
    if i == 1 and mode == "hang":
        time.sleep(60)
    time.sleep(0.003)
    spans.append((t0, time.monotonic()))
    turns.hand_over()
print(json.dumps({"turns": turns.count, "spans": spans}))
"""


def _lockstep(modes: dict[str, str], *, steps: int = 3, first: int = 0, timeout: float = 30.0) -> dict:
    from bench.harness import REPO_ROOT
    from bench.lockstep import lockstep

    cmds = {name: [sys.executable, "-c", LOCKSTEP_CHILD, mode, str(steps)] for name, mode in modes.items()}
    return lockstep(cmds, steps=steps, first=first, timeout=timeout, cwd=str(REPO_ROOT))


@pytest.mark.parametrize("first", [0, 1])
def test_lockstep_children_take_turns_one_step_at_a_time(first: int) -> None:
    """[Note: lockstep rounds]: one process computes at any moment, a step of each in turn, the child at `first`
    first; each takes the same number of steps and hands the turn over set-up + steps times."""
    out = _lockstep({"a": "ok", "b": "ok"}, first=first)
    assert [p["turns"] for p in out.values()] == [4, 4] and [len(p["spans"]) for p in out.values()] == [3, 3]
    spans = sorted((t0, t1, name) for name, p in out.items() for t0, t1 in p["spans"])
    assert "".join(name for _, _, name in spans) == ("ab" if first == 0 else "ba") * 3
    assert all(t1 <= nxt for (_, t1, _), (nxt, _, _) in zip(spans, spans[1:]))  # no two steps at once


@pytest.mark.parametrize("mode, match", [("die", "b exited 1 \\(step 2 of 3\\): died on purpose"),
                                         ("hang", "b: no hand-over within 1 s \\(step 2 of 3\\)"),
                                         ("early", "b exited 0 \\(step 3 of 3\\)"),
                                         ("quit", "b exited 0 \\(step 2 of 3\\)")])
def test_lockstep_round_fails_fast_naming_a_child_that_dies_hangs_or_skips_a_turn(mode: str, match: str) -> None:
    """A crash never hangs the bench: a dead child is seen at once (its pipe closes, or the parent's write to it
    fails), a hung one after the timeout, one that ran its first step without waiting for its turn when it runs
    out of steps; both are killed."""
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=match):
        _lockstep({"a": "ok", "b": mode}, timeout=1.0)
    assert time.monotonic() - t0 < 5


def test_lockstep_pins_every_child_of_a_round_to_the_cores_given() -> None:
    """[Note: one core for both]: the children start (before exec) on the round's cores only; unpinned, on all."""
    import os

    from bench.harness import REPO_ROOT
    from bench.lockstep import lockstep

    child = ("import json, os\nfrom bench.lockstep import Turns\nt = Turns.from_env()\nt.hand_over()\n"
             "t.hand_over()\nprint(json.dumps({'turns': t.count, 'cores': sorted(os.sched_getaffinity(0))}))")
    core = max(os.sched_getaffinity(0))
    for cores, want in ((frozenset({core}), [core]), (None, sorted(os.sched_getaffinity(0)))):
        out = lockstep({n: [sys.executable, "-c", child] for n in "ab"}, steps=1, timeout=30, cwd=str(REPO_ROOT),
                       cores=cores)
        assert [p["cores"] for p in out.values()] == [want, want]


def test_speed_runs_hand_the_turn_over_after_set_up_and_each_step_outside_its_timing(tiny_plan: Path) -> None:
    """bench.speed_runs' plain and hplan children under a lockstep parent: set-up + one hand-over per step, none
    inside a step's timing (the hand-over between steps 2 and 3 here takes 0.3 s; one torch thread, as the
    children run)."""
    import time

    import torch

    from bench.speed_runs import _hplan, _plain
    from hplan.specs import load_workload

    class Turns:
        count = 0

        def hand_over(self) -> None:
            self.count += 1
            time.sleep(0.3 if self.count == 3 else 0.0)

    torch.set_num_threads(1)  # put back by conftest's _torch_threads_given_back
    workload = load_workload("gpt:tiny")
    for run in (lambda t: _plain(workload, 4, t), lambda t: _hplan(workload, 4, str(tiny_plan), turns=t)):
        turns = Turns()
        out = run(turns)
        assert turns.count == 5 and len(out["step_seconds"]) == 4 and max(out["step_seconds"][1:]) < 0.3


def test_deepspeed_configs_use_the_client_optimizer_and_offload_as_named() -> None:
    from bench.speed_runs import DS_SYSTEMS, ds_config

    assert set(DS_SYSTEMS) == {"ds-z2", "ds-z3", "ds-z2-offload", "ds-z3-offload"}
    z3 = ds_config("ds-z3-offload", 4)["zero_optimization"]
    assert z3 == {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    z2 = ds_config("ds-z2", 4)
    assert z2["zero_optimization"] == {"stage": 2} and z2["zero_force_ds_cpu_optimizer"] is False


def test_speed_page_faults_are_the_median_over_rounds_of_each_runs_steady_mean() -> None:
    from bench.executor_speed import steady_faults

    runs = [{"step_faults": [9000, 10, 30]}, {"step_faults": [5000, 100, 300]}, {"step_faults": [1, 50, 50]}]
    assert steady_faults(runs) == 50  # steady means 20, 200 and 50: the first step (set-up) is left out
