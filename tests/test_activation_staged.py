"""Issue 31 §3: an offloaded block whose children come back one at a time ([Note: staged offload]). The tracer gives
each child its part of its block's offload (checked against a hand count), the planner offers the staged offload as
one more mode of the block's item (the bound and the mix replay see it), and the executor routes each child's packs
to its own holder, brought back at the child's own backward: parity exact, bytes as planned, and the bytes a child's
part holds are measured gone where the plan says."""

from __future__ import annotations

import dataclasses
import json
import math

import pandas as pd
import pytest

from hplan.artifacts.activations import activation_problems
from hplan.artifacts.plan import Plan
from hplan.artifacts.choice_log import mix_log
from hplan.artifacts.replay import validate
from hplan.artifacts.segments import effects
from hplan.executor import run_training
from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.planner.activation_items import build_items
from hplan.planner.activations import Decision
from hplan.planner.core import plan_decisions
from hplan.planner.slack import mix_figure
from hplan.tracer import trace_workload
from hplan.training import plain_losses
from test_activation_children import ROW, _workload


@pytest.fixture(scope="module")
def traced():
    workload = _workload()
    return workload, trace_workload(workload, device="cpu")


def _by(trace):
    return {s.module: s for s in trace.segments + trace.nested}


def test_a_child_is_traced_with_its_part_of_its_blocks_offload(traced):
    """Backward runs q, then p: p's two saved rows (its input and x * w, 3 packs with w's) wait while q runs
    backward, so p stages them: the block's first three packs' moved ones, from the block's backward start; q starts
    the block's backward and stages nothing."""
    _, trace = traced
    by = _by(trace)
    for i in range(3):
        block, p, q = by[f"blocks.{i}"], by[f"blocks.{i}.p"], by[f"blocks.{i}.q"]
        assert block.offload_bytes == 4 * ROW and block.backward_events[0] < p.backward_events[0]
        assert p.stage_bytes == 2 * ROW and p.stage_from == block.backward_events[0]
        assert p.stage_packs == tuple(k for k in block.offload_packs if k < 3) and len(p.stage_packs) == 2
        assert not q.stage_packs and not q.stage_bytes and q.backward_events[0] == block.backward_events[0]
        assert effects(p, "stage") == ((block.backward_events[0], p.backward_events[0] - 1, -2 * ROW),)


def _staged(trace, i):
    """Block i offloaded, staged by its child p; the others kept."""
    by = _by(trace)
    blocks = tuple(Decision(segment=by[f"blocks.{k}"], choice="offload" if k == i else "keep") for k in range(3))
    return blocks + (Decision(segment=by[f"blocks.{i}.p"], choice="stage"),)


def test_a_staged_offload_trains_as_plain_pytorch_with_the_childs_part_back_at_its_own_backward(traced, tmp_path):
    """Block 1 offloaded, staged by p: the plan validates, lists p's stage (down with the block, back at p's
    backward), moves the block's bytes each way, and 3 steps give plain PyTorch's losses exactly, moving the planned
    bytes. Measured from the block's backward start to before p's, the staged plan holds p's 2 rows fewer than
    the plain offload of the same block, as planned."""
    workload, trace = traced
    hw = make_hardware("cpu", gpu_bytes=1 << 30, **trace_slack(trace))
    staged = plan_decisions(trace, hw, PlanOptions(activations="auto"), _staged(trace, 1))
    plain = plan_decisions(trace, hw, PlanOptions(activations="auto"), _staged(trace, 1)[:3])
    assert staged.summary.feasible and plain.summary.feasible
    validate(staged)
    by = {c.module: c for c in staged.activations}
    block, p = by["blocks.1"], by["blocks.1.p"]
    assert p.stage and p.choice == "offload" and p.moved_bytes == 2 * ROW and block.moved_bytes == 2 * ROW
    assert p.d2h_step == block.d2h_step and p.prefetch_step == p.backward_step > block.backward_step
    assert staged.summary.activation_bytes_moved_per_iter == plain.summary.activation_bytes_moved_per_iter \
        == 2 * 4 * ROW
    assert Plan.from_dict(json.loads(json.dumps(staged.to_dict()))) == staged  # a plan file keeps its stages
    assert all("stage" not in c for c in plain.to_dict()["activations"])  # and one without reads as before
    gap = range(block.backward_step, p.backward_step)
    for t, (a, b) in enumerate(zip(staged.steps, plain.steps)):
        assert a.non_model_bytes == b.non_model_bytes - (2 * ROW if t in gap else 0), t
    runs = {}
    for name, plan in (("staged", staged), ("plain", plain)):
        path = tmp_path / f"{name}.parquet"
        report = run_training(workload, plan, steps=3, metrics_path=path)
        assert list(report.losses) == list(plain_losses(workload, 3)), name
        assert report.activation_bytes_moved_per_iter == plan.summary.activation_bytes_moved_per_iter, name
        runs[name] = pd.read_parquet(path)
    beside = run_training(workload, staged, steps=3, measure=False, overlap=True)  # copies on the copier's thread
    assert list(beside.losses) == list(plain_losses(workload, 3))  # [Note: offload beside the forward]
    assert beside.activation_bytes_moved_per_iter == staged.summary.activation_bytes_moved_per_iter
    cols = list(runs["plain"].columns)
    step, index = cols[0], cols[1]
    measured = {k: (d[d[step] == d[step].max()].set_index(index).resident_bytes
                    - d[d[step] == d[step].max()].set_index(index).model_resident_bytes) for k, d in runs.items()}
    for t in gap:
        assert measured["staged"][t] == measured["plain"][t] - 2 * ROW, t


def test_stage_rules_are_checked(traced):
    """A stage lives only inside an offloaded block, goes down with it and takes packs of its own; an edited plan
    breaking one is named."""
    _, trace = traced
    hw = make_hardware("cpu", gpu_bytes=1 << 30, **trace_slack(trace))
    plan = plan_decisions(trace, hw, PlanOptions(activations="auto"), _staged(trace, 1))
    assert not activation_problems(plan)

    def edit(module, **change):
        return dataclasses.replace(plan, activations=tuple(
            dataclasses.replace(c, **change) if c.module == module else c for c in plan.activations))

    block = next(c for c in plan.activations if c.module == "blocks.1")
    assert any("inside an offloaded block" in p for p in activation_problems(
        edit("blocks.1", choice="keep", moved_bytes=0, prefetch_step=-1, effects=(), offload_packs=())))
    assert any("names packs neither" in p for p in activation_problems(
        edit("blocks.1.p", offload_packs=block.offload_packs[:1])))
    assert any("moves down with its block" in p for p in activation_problems(
        edit("blocks.1.p", d2h_step=block.d2h_step - 1)))
    assert any("frees more than" in p for p in activation_problems(
        edit("blocks.1.p", stage=False, choice="keep", moved_bytes=0, prefetch_step=-1, effects=(),
             offload_packs=())))


def test_the_staged_offload_is_a_mode_the_bound_and_the_replay_see(traced):
    """In the regimes mixing keep and offload each block's item has a staged offload beside the plain one: the same
    cost, p's part gone until p's backward; a mix with it replays its own log (the stage's allocations at p's
    backward, none of them at the block's); the offload-alone regime has none (its figure did not replay it)."""
    _, trace = traced
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    items = build_items(trace, hw)
    by = _by(trace)
    for s, modes in enumerate(items.decisions):
        kids = [items.children[s][j] for j, d in enumerate(modes) if d.choice == "offload"]
        assert [tuple(d.choice for d in k) for k in kids] == [(), ("stage",)]
        first = int(items.first[s])
        off, staged = (first + j for j, d in enumerate(modes) if d.choice == "offload")
        assert items.cost[off] == items.cost[staged] == 2 * 4 * ROW
        p = by[f"blocks.{s}.p"]
        diff = items.effect[staged] - items.effect[off]
        assert list(diff.nonzero()[0]) == list(range(p.stage_from, p.backward_events[0]))
        assert set(diff[diff != 0]) == {-2 * ROW}
    assert not build_items(trace, hw, ("offload",)).children
    segments = trace.segments + trace.nested
    modes = ["offload" if s.module == "blocks.1" else "stage" if s.module == "blocks.1.p" else "keep"
             for s in segments]
    log = trace.choice_log
    plain = mix_log(log, [m if m != "stage" else "keep" for m in modes])
    staged = mix_log(log, modes)
    assert sorted(plain) == sorted(staged) and plain != staged  # the same calls, p's part allocated later
    again = {(ins.entries[j], ins.entries[j + 1]) for ins in log.inserts if ins.mode == "stage" and ins.order == 1
             and segments[ins.segment].module == "blocks.1.p" for j in range(0, len(ins.entries), 2)}
    differ = [i for i, (a, b) in enumerate(zip(plain, staged)) if a != b]
    assert len(again) == 2 and differ  # the block's prefetch of p's part is where they first differ, p's the last
    assert plain[differ[0]] in again and staged[differ[-1]] in again and plain[differ[-1]] not in again
    assert mix_figure(trace, hw, dict(zip((s.key for s in segments), modes))) is not None


def _unstaged(trace):
    """The trace with its stages removed (as a tracer without them would give)."""
    return dataclasses.replace(trace, nested=tuple(dataclasses.replace(c, stage_packs=(), stage_bytes=0, stage_from=0)
                                                   for c in trace.nested))


@pytest.mark.slow
def test_auto_stages_where_it_pays_and_trains_there_as_plain_pytorch():
    """A 3-layer OPT (hidden 64, batch 2 × seq 256, CPU trace): its smallest budget is set where an offloaded
    block's activations come back; with staged offloads auto's is lower than without them, its plan there stages,
    validates, and trains at plain PyTorch's losses exactly with the planned bytes moved."""
    from hplan.specs import load_workload

    workload = load_workload("hf:OPTForCausalLM", overrides={
        "num_hidden_layers": 3, "hidden_size": 64, "ffn_dim": 256, "num_attention_heads": 4, "word_embed_proj_dim": 64,
        "vocab_size": 256, "max_position_embeddings": 256}, batch_size=2, seq_len=256)
    trace = trace_workload(workload, device="cpu")
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    low = min_gpu_bytes(trace, hw).gpu_bytes
    assert low < min_gpu_bytes(_unstaged(trace), hw).gpu_bytes
    plan = make_plan(trace, dataclasses.replace(hw, gpu_bytes=low))
    assert plan.summary.feasible and any(c.stage for c in plan.activations)
    validate(plan)
    report = run_training(workload, plan, steps=2)
    assert list(report.losses) == list(plain_losses(workload, 2))
    assert report.activation_bytes_moved_per_iter == plan.summary.activation_bytes_moved_per_iter


def test_autos_bound_covers_forced_staged_plans(traced):
    """From auto's minimum to all-resident every auto plan validates, and its objective and bound are at most every
    forced staged plan's objective."""
    _, trace = traced
    hw = make_hardware("cpu", gpu_bytes=1, **trace_slack(trace))
    low = min_gpu_bytes(trace, hw).gpu_bytes
    high = min_gpu_bytes(trace, hw, activations="keep").gpu_bytes + trace.model_bytes
    link = hw.h2d_gbps * 1e9
    checked = 0
    for k in range(5):
        at = dataclasses.replace(hw, gpu_bytes=low + (high - low) * k // 4)
        auto = make_plan(trace, at)
        assert auto.summary.feasible
        validate(auto)
        for i in range(3):
            forced = plan_decisions(trace, at, PlanOptions(activations="auto"), _staged(trace, i))
            if forced.summary.feasible:
                theirs = forced.summary.bytes_moved_per_iter + sum(
                    2 * c.moved_bytes if c.choice == "offload" else math.ceil(c.recompute_seconds * link)
                    for c in forced.activations)
                assert auto.summary.lower_bound_bytes <= theirs and \
                    auto.summary.bytes_moved_per_iter + auto.summary.activation_cost_bytes <= theirs, (k, i)
                checked += 1
    assert checked >= 6, checked


def test_stages_round_trip_and_are_validated_on_load(traced, tmp_path):
    """A trace file's stages load as saved; a stage naming packs its block does not move, or a block's backward
    start other than its block's, is refused with the field named and the command that regenerates the file."""
    from hplan.artifacts import Trace
    from hplan.errors import HplanError

    _, trace = traced
    path = tmp_path / "t.parquet"
    trace.save(path)
    assert Trace.load(path).nested == trace.nested
    meta = trace.metadata()
    i = next(k for k, c in enumerate(meta["nested"]) if c["stage_packs"])
    for edit, message in (({"stage_packs": [999]}, "packs its block's offload moves"),
                          ({"stage_from": 0}, "from its block's backward start"),
                          ({"stage_bytes": 0}, "both be empty or both be set")):
        child = dict(meta["nested"][i], **edit)
        nested = [*meta["nested"][:i], child, *meta["nested"][i + 1:]]
        with pytest.raises(HplanError, match=rf"field nested\[{i}\]: .*{message}.*regenerate"):
            Trace.from_metadata({**meta, "nested": nested})
    log = meta["choice_log"]
    k = next(j for j, ins in enumerate(log["inserts"]) if ins["mode"] == "stage")
    other = (log["inserts"][k]["parent"] + 1) % len(meta["segments"])
    for edit, message in (({"parent": -1}, r"choice_log\.inserts\[\d+\]"),
                          ({"parent": other}, r"a stage must be a child segment's, inside its block")):
        inserts = [*log["inserts"][:k], dict(log["inserts"][k], **edit), *log["inserts"][k + 1:]]
        with pytest.raises(HplanError, match=rf"{message}.*regenerate"):
            Trace.from_metadata({**meta, "choice_log": {**log, "inserts": inserts}})
