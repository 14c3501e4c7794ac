"""Many-rank plans (issue 17), torch-free: per-rank sizes and collective bytes by hand, the cost model agrees,
the chosen factors are the fastest, trace once plan for N, and the validator refuses tampered plans."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from hplan.artifacts import Plan
from hplan.artifacts.replay import replay, validate
from hplan.artifacts.shard import Sharding, factor_choices, group_ranks
from hplan.errors import HplanError
from hplan.planner import PlanOptions, make_hardware, make_plan
from hplan.planner.ranks.collectives import CommOptions, ShardFactors, StateBytes, World, iteration_collectives
from hplan.planner.ranks.shard import make_shard_plan, parse_shard
from hplan.planner.synthetic import chain_trace, gpt_trace

MODULE = PlanOptions(chunk_bytes=0)


def hw(ranks_per_node: int, nodes: int = 1, gpu_bytes: int = 10**9, **kw):
    return make_hardware("a100-80gb", gpu_bytes=gpu_bytes, gpus_per_node=ranks_per_node, nodes=nodes, slack_bytes=0,
                         **kw)


def plan_for(trace, hardware, p, g, os_):
    plan = make_shard_plan(trace, hardware, MODULE, factors=Sharding(P=p, G=g, OS=os_))
    assert plan.summary.feasible, plan.summary.bottleneck
    validate(plan)
    return plan


def test_planner_and_cli_world_are_pure():
    code = "import sys, hplan.planner.ranks.shard, hplan.cli.world; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_per_rank_region_bytes_and_collective_bytes_by_hand():
    """Chain m0, m1, m2 of 10, 7 and 4 fp32 elements (AdamW: two state tensors), 4 ranks, P=1, G=2, OS=4.
    Pieces s = ⌈n/4⌉ = 3, 2, 1; per rank: weights 4s, gradients 2s, state 2s elements of 4 bytes."""
    trace = chain_trace((10, 7, 4), precision="fp32")
    plan = plan_for(trace, hw(4), 1, 2, 4)
    sizes = {(r.chunk, r.kind): r.bytes for r in plan.regions}
    for c, s in enumerate((3, 2, 1)):
        assert sizes[(c, "param")] == 4 * s * 4
        assert sizes[(c, "grad")] == 2 * s * 4
        assert sizes[(c, "state")] == 2 * s * 4
    # per chunk: gradient reduce-scatter over 2 ranks of 4s elements sends 2s·4 B; the sync reduce-scatter over
    # the 2 holders of the same gradient shard (stride 2) sends s·4; no all-reduce (OS = all ranks); the updated
    # pieces gather back over stride 2 (s·4) then over the gradient pair (2s·4): 6s·4 B per chunk
    assert plan.summary.collective_bytes_per_rank == sum(6 * s * 4 for s in (3, 2, 1)) == 144
    calls = [(st.event, c.purpose, c.op, c.size, c.stride) for st in plan.steps for c in st.collectives
             if plan.region_map()[c.region].chunk == 0]
    assert calls == [("backward:m0", "scatter", "reduce_scatter", 2, 1),
                     ("backward:m0", "sync", "reduce_scatter", 2, 2),
                     ("optimizer:optimizer", "update_gather", "all_gather", 2, 2),
                     ("optimizer:optimizer", "update_gather", "all_gather", 2, 1)]
    # the full gradient of m0 (4s = 12 elements) lives in its backward step, with the sync's staging piece; m1's
    # (8, and its staging piece 2) are still being reduced there, issued asynchronously after backward:m1
    backward_m0 = next(st for st in plan.steps if st.event == "backward:m0")
    assert backward_m0.gathered_bytes == (12 + 3) * 4 + (8 + 2) * 4
    optimizer = plan.steps[-1]
    assert optimizer.gathered_bytes >= (12 + 3) * 4  # m0's reductions run into the optimizer step


def test_a_rank_updates_only_its_optimizer_piece():
    """[Note: piece updates]: the chain above at P=1, G=2, OS=4 — a rank's update reads and writes its piece s of the
    weights, of the gradients and its 2s of state: 16s bytes per chunk, 96 in all, not the 192 its regions hold
    (the executor's update views). The device step is priced over those bytes; fully sharded it is the whole."""
    from hplan.planner.kernel_size import device_update_seconds
    from hplan.planner.ranks.piece_update import piece_update_bytes

    trace = chain_trace((10, 7, 4), precision="fp32")
    plan = plan_for(trace, hw(4), 1, 2, 4)
    assert piece_update_bytes(plan.regions, plan.sharding) == {0: 48, 1: 32, 2: 16}
    assert sum(plan.chunk_bytes().values()) == 192
    assert all(e.seconds == 0 for e in trace.events)  # fake trace: compute is the device update alone
    assert plan.summary.seconds["compute"] == pytest.approx(device_update_seconds(96, plan.hardware), rel=1e-12)
    full = plan_for(trace, hw(4), 4, 4, 4)
    assert piece_update_bytes(full.regions, full.sharding) == full.chunk_bytes()
    assert piece_update_bytes(plan.regions, None) == plan.chunk_bytes()


def test_full_sharding_gathers_weights_before_each_use():
    """ZeRO-3 on 2 ranks: each run of consecutive steps reading a chunk all-gathers it once (⌈n/2⌉·4 B sent), the
    gradient is reduce-scattered once: per chunk 3·⌈n/2⌉·4 B, ZeRO's 3Ψ·(N-1)/N — except the last module, whose
    forward and backward are consecutive steps and share one gather (as FSDP keeps the root gathered)."""
    trace = chain_trace((10, 7), precision="fp32")
    plan = plan_for(trace, hw(2), 2, 2, 2)
    assert plan.summary.collective_bytes_per_rank == 3 * 5 * 4 + 2 * 4 * 4
    backward_m1 = next(st for st in plan.steps if st.event == "backward:m1")
    assert [c.purpose for c in backward_m1.collectives] == ["scatter"] and backward_m1.gathered_bytes >= 8 * 4
    forward_m1 = next(st for st in plan.steps if st.event == "forward:m1")
    assert [(c.purpose, c.before, c.numel) for c in forward_m1.collectives] == [("gather", True, 8)]
    assert forward_m1.gathered_bytes == 8 * 4
    # m1's gather is issued one step ahead ([Note: collectives in flight]): forward:m0 holds both full copies
    forward_m0 = next(st for st in plan.steps if st.event == "forward:m0")
    assert forward_m0.gathered_bytes == (10 + 8) * 4
    assert {r.kind: r.bytes for r in plan.regions if r.chunk == 1} == {"param": 16, "grad": 16, "state": 32}


@pytest.mark.parametrize("gpn,nodes", [(8, 1), (8, 2)])
def test_collective_bytes_agree_with_the_cost_model(gpn, nodes):
    """planner.ranks.collectives prices whole states; per-chunk plans must send the same when nothing pads — but for the
    last module, whose forward and backward are consecutive steps sharing one gather."""
    numels = (64 * 16, 32 * 16, 128 * 16)
    trace = chain_trace(numels, precision="fp32")
    hardware = hw(gpn, nodes)
    world = World.from_hardware(hardware)
    total = sum(numels) * 4
    for f in factor_choices(hardware.ranks, gpn):
        plan = plan_for(trace, hardware, f.P, f.G, f.OS)
        want, _, _ = iteration_collectives(ShardFactors(P=f.P, G=f.G, OS=f.OS),
                                           StateBytes(params=total, grads=total, optim=2 * total), world,
                                           CommOptions())
        shared = (f.P - 1) * (numels[-1] // f.P) * 4 if f.P > 1 else 0
        assert plan.summary.collective_bytes_per_rank == want - shared, f


def test_the_chosen_factors_are_the_fastest_that_fit():
    trace = gpt_trace(n_layer=2, d_model=256, vocab=1024, n_ctx=128, seq=128, n_head=4, precision="fp32")
    hardware = hw(4, gpu_bytes=60 * 10**6)
    chosen = make_shard_plan(trace, hardware, PlanOptions(chunk_bytes=0, solver="fast"))
    assert chosen.summary.feasible
    times = {}
    for f in factor_choices(4, 4):
        forced = make_shard_plan(trace, hardware, PlanOptions(chunk_bytes=0, solver="fast"), factors=f)
        if forced.summary.feasible:
            times[(f.P, f.G, f.OS)] = forced.summary.predicted_step_seconds
    best = min(times.values())
    assert chosen.summary.predicted_step_seconds == pytest.approx(best, rel=1e-12)
    s = chosen.summary
    assert times[(s.shard["P"], s.shard["G"], s.shard["OS"])] == pytest.approx(best, rel=1e-12)
    assert set(s.seconds) >= {"compute", "h2d", "d2h", "cpu_optimizer", "all_gather", "reduce_scatter", "all_reduce"}


def test_trace_once_plan_for_n():
    """One rank's trace, the world size and the factors fix every rank's memory: sizes ÷ factors (padded), the
    same on every rank, and the predicted peak is the replayed one."""
    trace = chain_trace((1000, 300, 77), precision="fp32")
    one = make_plan(trace, hw(1), MODULE)
    n1 = plan_for(trace, hw(1), 1, 1, 1)  # one rank: the one-GPU plan's regions exactly
    assert [(r.kind, r.bytes) for r in n1.regions] == [(r.kind, r.bytes) for r in one.regions]
    assert n1.summary.collective_bytes_per_rank == 0
    for n in (2, 4, 8):
        plan = plan_for(trace, hw(n), n, n, n)
        for c, numel in enumerate((1000, 300, 77)):
            s = -(-numel // n)
            assert {r.kind: r.bytes for r in plan.regions if r.chunk == c} == {"param": 4 * s, "grad": 4 * s,
                                                                              "state": 8 * s}
        rep = replay(plan)
        assert rep.peak_bytes == plan.summary.predicted_peak_bytes
        assert all(st.total_bytes == st.resident_bytes + s.non_model_bytes + s.gathered_bytes
                   for st, s in zip(rep.states, plan.steps))


def test_offload_and_sharding_combine_under_a_tight_budget():
    """Below what full residency needs, the plan offloads shards and still validates; the host↔GPU bytes are
    those of the shards."""
    trace = chain_trace((4000, 4000, 4000), precision="fp32")
    roomy = plan_for(trace, hw(2), 1, 2, 2)
    tight = make_shard_plan(trace, hw(2, gpu_bytes=roomy.summary.predicted_peak_bytes - 20_000), MODULE,
                            factors=Sharding(P=1, G=2, OS=2))
    assert roomy.summary.bytes_moved_per_iter == 0
    assert tight.summary.feasible and tight.summary.bytes_moved_per_iter > 0
    validate(tight)


def test_plan_json_carries_shard_and_round_trips(tmp_path):
    plan = plan_for(chain_trace((10, 7), precision="fp32"), hw(2), 1, 2, 2)
    plan.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["summary"]["shard"] == {"P": 1, "G": 2, "OS": 2}
    assert data["summary"]["collective_bytes_per_rank"] == plan.summary.collective_bytes_per_rank
    assert Plan.load(tmp_path / "p.json") == plan


def test_validator_refuses_tampered_collectives_and_sizes():
    plan = plan_for(chain_trace((10, 7), precision="fp32"), hw(2), 2, 2, 2)
    dropped = replace(plan, steps=tuple(replace(s, collectives=()) for s in plan.steps))
    with pytest.raises(HplanError, match="collectives or gathered bytes"):
        validate(dropped)
    shrunk = replace(plan, regions=tuple(replace(r, bytes=r.bytes // 2) if r.kind == "state" else r
                                         for r in plan.regions))
    with pytest.raises(HplanError, match="shard layout"):
        validate(shrunk)
    other_world = replace(plan, hardware=replace(plan.hardware, gpus_per_node=3))
    with pytest.raises(HplanError, match="shard factor"):
        validate(other_world)


def test_groups_and_factor_choices():
    assert group_ranks(5, 2, 1) == (4, 5)
    assert group_ranks(5, 2, 4) == (1, 5)  # the holders of one shard index across 4-rank groups
    assert group_ranks(6, 4, 2) == (0, 2, 4, 6)
    assert {(f.P, f.G, f.OS) for f in factor_choices(2, 2)} == {(1, 1, 1), (1, 1, 2), (1, 2, 2), (2, 2, 2)}
    assert all(f.P in (1, f.G) and f.OS % f.G == 0 for f in factor_choices(1024, 8))


@pytest.mark.parametrize("text,match", [
    ("P=1,G=2", "all three"), ("P=1,G=2,OS=x", "positive integers"), ("P=1,P=1,OS=2", "positive integers"),
    ("Q=1,G=1,OS=1", "positive integers"), ("P=0,G=1,OS=1", "each ≥ 1"),
])
def test_shard_option_is_parsed_or_refused(text, match):
    with pytest.raises(HplanError, match=match):
        parse_shard(text)
    assert parse_shard(" os=8, g=8 ,p=1") == Sharding(P=1, G=8, OS=8)


@pytest.mark.parametrize("p,g,os_,match", [(1, 3, 3, "divisor"), (2, 4, 8, "must be 1 or equal G"),
                                          (1, 4, 2, "divide the next"), (16, 16, 16, "divisor")])
def test_factors_that_do_not_fit_the_world_are_refused(p, g, os_, match):
    with pytest.raises(HplanError, match=match):
        make_shard_plan(chain_trace((8,), precision="fp32"), hw(8), MODULE, factors=Sharding(P=p, G=g, OS=os_))


def _prefetch_case():
    """4 modules of 10⁶ fp16 weights on 2 ranks of one node, 1 GB/s, no latency: every all-gather and
    reduce-scatter of a module's 2·10⁶ B takes g = 2·10⁶ B / (1 GB/s · k/(k−1) = 2) = 1 ms (NCCL's ring
    algorithm bandwidth); a forward 2 ms, a backward 4 ms (10¹² FLOP/s); device memory so fast that the
    optimizer step on the GPU ([Note: device optimizer step]) takes no measurable time."""
    trace = chain_trace((10**6,) * 4, precision="fp16-mixed", flops=2 * 10**9)
    hardware = hw(2, gpu_bytes=10**11, tflops_16=1.0, efficiency=1.0, intra_gbps=1.0, intra_latency_us=0.0,
                  inter_latency_us=0.0, device_memory_gbps=1e9)
    return trace, plan_for(trace, hardware, 2, 2, 2)


def test_prefetch_in_both_passes_exposes_only_the_first_gather_and_the_last_reduce_scatter():
    """ZeRO-3 / FSDP order: a module's gather is issued when the previous module's compute starts, in forward
    and backward, so it is queued ahead of that module's reduce-scatter (issued when its compute ends): with
    g = 1 ms per call under 2–4 ms of compute, only the first forward gather and the last backward
    reduce-scatter (the optimizer waits for it) are exposed. hplan's executor blocks on every call instead."""
    from hplan.planner.ranks.shard_time import CommSchedule
    from hplan.planner.ranks.systems import price

    trace, plan = _prefetch_case()
    g, compute = 1e-3, 4 * 2e-3 + 4 * 4e-3
    fsdp = price(plan, trace, CommSchedule(prefetch=1))
    assert fsdp["compute"] == pytest.approx(compute)
    assert fsdp["step"] == pytest.approx(compute + 2 * g)
    assert fsdp["exposed_intra"] == pytest.approx(2 * g) and fsdp["exposed_inter"] == 0
    blocking = price(plan, trace, CommSchedule(blocking=True))
    # 7 gathers (the last module's forward and backward are consecutive and share one) and 4 reduce-scatters
    assert blocking["step"] == pytest.approx(compute + 11 * g)
    # hplan's executor ([Note: collectives in flight]) issues as FSDP does here: the plan is priced so
    assert plan.summary.predicted_step_seconds == pytest.approx(fsdp["step"])


def test_the_executor_schedule_waits_for_reductions_one_step_later_and_for_chained_syncs():
    """hplan's executor settles each reduction before the step after the next begins, and a sync of a gradient
    shard waits for its scatter on the compute stream (on 4 ranks at P=1, G=2, OS=4 each chunk's 1 ms scatter is
    followed by a 0.5 ms sync): the executor's step exposes each scatter, so it is longer than FSDP's prefetch
    schedule that lets reductions queue freely (only the last is exposed), and shorter than blocking on every
    call."""
    from dataclasses import replace as dc_replace

    from hplan.planner.ranks.shard_time import EXECUTOR, CommSchedule
    from hplan.planner.ranks.systems import price

    trace = chain_trace((10**6,) * 4, precision="fp16-mixed", flops=2 * 10**9)
    hardware = hw(4, gpu_bytes=10**11, tflops_16=1.0, efficiency=1.0, intra_gbps=1.0, intra_latency_us=0.0,
                  inter_latency_us=0.0)
    plan = plan_for(trace, hardware, 1, 2, 4)  # scatter then sync per chunk: a chained reduction
    free = price(plan, trace, CommSchedule(prefetch=1))["step"]
    executor = price(plan, trace, EXECUTOR)["step"]
    blocking = price(plan, trace, CommSchedule(blocking=True))["step"]
    assert free < executor < blocking, (free, executor, blocking)
    assert plan.summary.predicted_step_seconds == pytest.approx(executor)
    assert dc_replace(EXECUTOR, settle_next=False, packed=False, lookahead=False) == CommSchedule(prefetch=1)


def test_step_split_sums_to_the_step_and_the_cli_shows_it(tmp_path):
    from typer.testing import CliRunner

    from hplan.cli import app

    trace = gpt_trace(n_layer=2, d_model=256, vocab=1000, seq=128, n_head=4)
    plan = make_shard_plan(trace, hw(8, nodes=2, gpu_bytes=10**10), MODULE)
    s = plan.summary.seconds
    parts = ("compute", "exposed_intra", "exposed_inter", "exposed_host", "exposed_cpu_optimizer")
    assert sum(s[k] for k in parts) == pytest.approx(plan.summary.predicted_step_seconds)
    trace.save(tmp_path / "t.parquet")
    args = ["plan", str(tmp_path / "t.parquet"), "--gpu", "a100-80gb", "--gpu-mem", "10GB", "--gpus", "8",
            "--nodes", "2", "--chunk-size", "module", "--solver", "fast"]
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    split = json.loads(out.stdout)["step_split"]
    assert set(split) == {*parts, "step"} and sum(split[k] for k in parts) == pytest.approx(split["step"])
    text = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "p.json")])
    assert text.exit_code == 0 and "step per rank" in text.output and "exposed inter" in text.output
    slow = CliRunner().invoke(app, [*args, "--json", "--inter-latency-us", "1000", "--network", "pcie4-100gbe"])
    assert json.loads(slow.stdout)["step_split"]["step"] > split["step"]


@pytest.mark.parametrize("precision, defer, refused", [("fp16-mixed", False, "fp16 loss scaling"),
                                                       ("bf16-mixed", True, None),
                                                       ("bf16-mixed", False, None)])
def test_plan_warns_of_what_a_many_rank_run_refuses(tmp_path, precision, defer, refused):
    """`hplan plan --gpus 2` writes a plan the run then refuses (fp16 loss scaling): one warning line naming it and
    the fix, exit 0 (the plan still prices the choice); nothing for a plan the run accepts (deferred updates and
    clipping: tests/ranks/test_dist_clip.py)."""
    from typer.testing import CliRunner

    from hplan.cli import app

    trace = replace(gpt_trace(n_layer=2, d_model=64, vocab=100, seq=32, n_head=4, precision=precision),
                    defer_updates=defer)
    trace.save(tmp_path / "t.parquet")
    out = CliRunner().invoke(app, ["plan", str(tmp_path / "t.parquet"), "--gpu", "a100-80gb", "--gpu-mem", "1GB",
                                   "--gpus", "2", "--solver", "fast", "-o", str(tmp_path / "p.json")])
    assert out.exit_code == 0, out.output
    warnings = [line for line in out.output.splitlines() if line.startswith("warning:")]
    if refused is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and refused in warnings[0] and "re-trace" in warnings[0], out.output
