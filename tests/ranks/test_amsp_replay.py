"""AMSP's evaluation replayed by the many-rank model (hplan.planner.ranks.amsp_replay), torch-free, on LLaMA-shaped
synthetic traces: what the model must reproduce of the paper's measurements at 1,024 A800s.

Asserted: for 7B, with the baselines run as the paper states ([Note: the paper's baselines]: overlap settings on in
all of them, DeepSpeed's stage 3 reduce-scatter holding the compute as its traces show), the paper's order — AMSP,
ZeRO-1, MiCS, then ZeRO-3 and ZeRO++ (measured at about 4%; the model's stage 3 host loop takes them to about a
fifth, not to 4%: BENCHMARKS.md, section 8); AMSP's predicted MFU within ±20% of the measured 51%; MiCS's
replicas all-reduce each bucket right after its reduce-scatter on one stream, as DeepSpeed's stage 3 does; ZeRO-1
priced as DeepSpeed's stage 1/2 reduces, each bucket all-reduced whole, and gathers the updated weights in one
call; ZeRO-1's all-reduce and MiCS's put the same bytes on each node's network (what separates them is how each
hides it: bench/multigpu_ranking.py); at each size the paper reports, every pair it measured apart in its order
(13B: AMSP, MiCS, ZeRO++, ZeRO-3); the stage 3 host loop grows with the group and spares MiCS; from fewer GPUs to
1,024 the ZeRO-3 MFU falls and AMSP's lead over it grows, the paper's direction.
"""

from __future__ import annotations

from functools import cache

import pytest

from hplan.planner.ranks.amsp_replay import PAPER_MFU, micro_batches, replay
from hplan.planner.synthetic import llama_trace


@cache
def _rows(size: str, ranks: int) -> dict[str, object]:
    rows = replay(llama_trace(size, micro_batches=micro_batches(ranks)), ranks, size, with_hplan=False)
    assert all(r.mfu is not None for r in rows), [r.note for r in rows]
    return {r.system: r for r in rows}


def _ranked(rows: dict) -> list[str]:
    return sorted(rows, key=lambda name: -rows[name].mfu)


def test_7b_at_1024_gpus_ranked_as_the_paper_ranks_them():
    """AMSP 51% > ZeRO-1 36% > MiCS 35% > ZeRO-3 ≈ ZeRO++ ≈ 4% (arXiv 2311.00257 v2 §VI.B.1), with each baseline run
    as the paper says it ran them ([Note: the paper's baselines]): ZeRO-1 with overlap_comm, hiding its all-reduce
    behind the backward; ZeRO-3, ZeRO++ and MiCS with their reduce-scatter holding the compute. AMSP's published
    1/1/8 within ±20% of its measured 51%."""
    rows = _rows("7b", 1024)
    order = _ranked(rows)
    assert order[:3] == ["AMSP", "ZeRO-1", "MiCS"] and rows["AMSP"].factors == "1/1/8"
    assert set(order[3:]) == {"ZeRO-3", "ZeRO++ (hpZ)"}
    measured = PAPER_MFU[("7b", 1024)]["AMSP"]
    assert 0.8 * measured <= rows["AMSP"].mfu <= 1.2 * measured


def test_mics_all_reduces_each_bucket_after_its_reduce_scatter_on_one_stream():
    """DeepSpeed's MiCS reduce-scatters each IPG bucket (5e8 elements of full gradients) over the node and, in the
    same `with stream(reduce_and_partition_stream)`, all-reduces that bucket's eighths over the 128 replicas
    (stage3.py __reduce_and_partition_ipg_grads -> mics.py partition_grads -> allreduce_mics_shard_grads): the
    all-reduce goes with its bucket. Held until its own eighths filled a bucket (eight of DeepSpeed's), most of it
    waited for the end of the backward and was exposed there. ZeRO-3 (reduce-scatters only) is not moved."""
    from dataclasses import replace

    from hplan.planner.ranks.systems import price, system_steps, systems

    rows = _rows("7b", 1024)
    trace = llama_trace("7b", micro_batches=micro_batches(1024))
    by_kind = {s.kind: s for s in systems(2)}
    assert by_kind["mics"].schedule.one_reduce_stream and by_kind["zero3"].schedule.one_reduce_stream
    mics = rows["MiCS"]
    overlapped = replace(by_kind["mics"].schedule, overlap_reductions=True)  # as the code reads: on its own stream
    one = price(mics.plan, trace, overlapped)
    own = price(mics.plan, trace, replace(overlapped, one_reduce_stream=False))
    assert one["exposed_inter"] < own["exposed_inter"] - 0.05
    # the same bytes in 14 calls of an eighth of a bucket, not 2: more latency, NCCL's tree correction for medium sizes
    assert own["all_reduce"] < one["all_reduce"] < 1.25 * own["all_reduce"]
    assert one["all_reduce"] == pytest.approx(mics.split["all_reduce"])
    z3 = rows["ZeRO-3"]
    alone = price(z3.plan, trace, replace(by_kind["zero3"].schedule, one_reduce_stream=False),
                  system_steps(by_kind["zero3"], z3.plan))
    assert alone["step"] == pytest.approx(z3.split["timeline"], rel=1e-9)


@pytest.mark.parametrize("size", ["7b", "13b"])
def test_each_size_ranked_as_the_paper_ranks_it(size):
    """Every pair of systems the paper measured apart at 1,024 GPUs (arXiv 2311.00257 v2 §I, §VI.B.1: 7B AMSP 51%,
    ZeRO-1 36%, MiCS 35%, ZeRO-3 and ZeRO++ about 4%; 13B AMSP 52%, MiCS 33%, ZeRO++ 6%, ZeRO-3 4%) comes out in
    the paper's order. At 13B MiCS leads ZeRO++ by DeepSpeed's stage 3 host loop over all 1,024 ranks, which MiCS's
    gather handle does not run ([Note: the stage 3 host loop]); without it ZeRO++ led MiCS. ZeRO-1 has no 13B row
    in the paper (Table IV), so it is not ranked there. AMSP's 4/4/8 for 13B is the published factors."""
    rows = _rows(size, 1024)
    paper = PAPER_MFU[(size, 1024)]
    wrong = [(a, b) for a in paper for b in paper if paper[a] > paper[b] and not rows[a].mfu > rows[b].mfu]
    assert not wrong, {s: round(rows[s].mfu, 3) for s in paper}
    assert rows["AMSP"].factors == {"7b": "1/1/8", "13b": "4/4/8"}[size]


def test_stage3_host_loop_grows_with_the_group_and_spares_mics():
    """DeepSpeed's stage 3 host work per parameter and rank of the group (a narrow and a record_stream per gather,
    a slice per reduce-scatter) is priced at PyTorch's measured per-op cost beyond each step's compute: over
    1,024 ranks it adds seconds to ZeRO-3, less to ZeRO++ (backward gathers over the node), next to nothing to
    MiCS (gathers without the loop, reduce-scatters over 8); AMSP and ZeRO-1 have none."""
    from hplan.planner.ranks.systems import HOST_OP_S, STAGE3_HOST_OPS

    rows = _rows("7b", 1024)
    host = {name: r.split["host_loop"] for name, r in rows.items()}
    assert host["AMSP"] == host["ZeRO-1"] == 0.0
    assert host["MiCS"] < 0.05 < host["ZeRO++ (hpZ)"] < host["ZeRO-3"]
    # forward and backward gathers of the 226 tensors stage 3 does not persist (65 RMSNorm weights of 4,096 elements
    # are kept whole: stage3_param_persistence_threshold), a reduce-scatter of all 291 gradients
    ops = 1024 * (226 * 2 * STAGE3_HOST_OPS[0] + 291 * STAGE3_HOST_OPS[1])
    assert ops * HOST_OP_S - rows["ZeRO-3"].split["compute"] <= host["ZeRO-3"] <= ops * HOST_OP_S
    assert rows["ZeRO-3"].step_seconds == pytest.approx(rows["ZeRO-3"].split["timeline"] + host["ZeRO-3"])


def test_zero1_all_reduces_each_bucket_as_deepspeed_stage_1_does():
    """DeepSpeed's stage 1/2 (use_multi_rank_bucket_allreduce, on by default) all-reduces each gradient bucket
    whole over the data-parallel group and keeps its own slice: twice a reduce-scatter's bytes. With the reduction
    held on the compute stream, the same plan priced with reduce-scatters instead has a shorter step by the
    difference."""
    from dataclasses import replace

    from hplan.planner.ranks.systems import price, system_steps, systems

    rows = _rows("7b", 1024)
    z1 = rows["ZeRO-1"]
    trace = llama_trace("7b", micro_batches=micro_batches(1024))
    assert z1.split["reduce_scatter"] == 0 and z1.split["all_reduce"] > 0
    zero1 = next(s for s in systems(2) if s.kind == "zero1")
    assert zero1.schedule.overlap_reductions  # overlap_comm, as AMSP ran it ([Note: the paper's baselines])
    serial = replace(zero1.schedule, overlap_reductions=False)
    whole = price(z1.plan, trace, serial, system_steps(zero1, z1.plan))
    scattered = price(z1.plan, trace, serial)
    assert whole["all_reduce"] == pytest.approx(z1.split["all_reduce"])
    assert scattered["reduce_scatter"] > 0 and scattered["all_reduce"] == 0
    assert whole["step"] - scattered["step"] == pytest.approx(whole["all_reduce"] - scattered["reduce_scatter"],
                                                              rel=0.05)
    assert whole["step"] > scattered["step"] + 0.1
    assert z1.step_seconds < whole["step"] - 0.1  # overlapped, most of it hides behind the backward
    # before DeepSpeed 0.12.4 (a reading): the reduction at DeepSpeed's measured 1.2 s / 0.36 s, weights in shards
    from hplan.planner.ranks.systems import PER_RANK_REDUCE_SLOWDOWN, system_price, zero1_before_0_12_4

    old = system_price(zero1_before_0_12_4(zero1), z1.plan, trace)
    assert old["all_reduce"] == pytest.approx(PER_RANK_REDUCE_SLOWDOWN * z1.split["all_reduce"], rel=0.05)
    assert old["all_gather"] > z1.split["all_gather"] and old["step"] > z1.step_seconds + 0.2


def test_zero3_falls_behind_amsp_as_ranks_grow():
    few, many = _rows("7b", 512), _rows("7b", 1024)
    assert many["ZeRO-3"].mfu < few["ZeRO-3"].mfu
    lead = {n: rows["AMSP"].mfu / rows["ZeRO-3"].mfu for n, rows in ((512, few), (1024, many))}
    assert lead[1024] > lead[512] > 1


@pytest.mark.slow
def test_the_paper_scale_from_128_gpus():
    few, many = _rows("7b", 128), _rows("7b", 1024)
    lead = {n: rows["AMSP"].mfu / rows["ZeRO-3"].mfu for n, rows in ((128, few), (1024, many))}
    assert many["ZeRO-3"].mfu < few["ZeRO-3"].mfu and lead[1024] > lead[128]


def test_published_factors_outside_the_layout_are_reported_not_planned():
    rows = replay(llama_trace("7b", micro_batches=1), 1024, "30b", with_hplan=False)
    amsp = next(r for r in rows if r.system == "AMSP")
    assert amsp.step_seconds is None and "OS=32" in amsp.note


def test_hplan_at_amsp_factors_is_priced_as_its_executor_runs_near_the_paper():
    """`hplan plan --gpus 8 --nodes 128 --shard P=1,G=1,OS=8` on AMSP's setting: the plan is priced as hplan's
    executor runs it ([Note: collectives in flight]: gathers one step ahead, reductions beside the next step, one
    call per chunk), which lands within ±20% of AMSP's measured 51% at AMSP's factors, above MiCS, ZeRO-3 and
    ZeRO++ as the paper ranks AMSP, and no faster than AMSP's own bucketed schedule on the same plan. (Below ZeRO-1
    run with overlap_comm as the paper ran it: bench section 8 reports that miss.) Blocking calls (the executor
    before issue 32) priced it at 40.6%."""
    from hplan.planner.ranks.shard_time import EXECUTOR
    from hplan.planner.ranks.systems import price

    rows = _rows("7b", 1024)
    plan = rows["AMSP"].plan
    trace = llama_trace("7b", micro_batches=micro_batches(1024))
    split = price(plan, trace, EXECUTOR)
    assert plan.summary.predicted_step_seconds == pytest.approx(split["step"])
    mfu = rows["AMSP"].mfu * rows["AMSP"].step_seconds / split["step"]
    measured = PAPER_MFU[("7b", 1024)]["AMSP"]
    assert 0.8 * measured <= mfu <= 1.2 * measured
    assert mfu <= rows["AMSP"].mfu
    assert all(mfu > rows[s].mfu for s in ("MiCS", "ZeRO-3", "ZeRO++ (hpZ)"))


def test_zero1_gathers_the_updated_weights_in_one_call_as_deepspeed_does_with_nccl():
    """DeepSpeed 0.19.8's stage 1/2 step ends in all_gather_dp_groups, which with a backend that has
    all_gather_into_tensor (NCCL) issues one call per parameter group's flat buffer (runtime/utils.py
    all_gather_into_tensor_dp_groups); allgather_bucket_size only shapes the fallback. One call over 1,024 ranks
    of the whole bf16 weights, not a call per 5e8 elements."""
    from hplan.planner.ranks.amsp_replay import hardware_for
    from hplan.planner.ranks.collectives import World, block_group, collective_cost

    z1 = _rows("7b", 1024)["ZeRO-1"]
    trace = llama_trace("7b", micro_batches=micro_batches(1024))
    world = World.from_hardware(hardware_for(trace, 1024))
    weights = sum(p.bytes for p in trace.params)
    one = collective_cost("all_gather", weights, block_group(1024, world), world, itemsize=2)
    assert z1.split["all_gather"] == pytest.approx(one.seconds, rel=0.01)


def test_zero1_and_mics_put_the_same_gradient_bytes_on_each_node_network():
    """A flat ring all-reduce over 128 nodes × 8 GPUs crosses each node's network once per channel, so a node
    sends 2(n−1)/n of the buffer (nccl-tests doc/PERFORMANCE.md: bus bandwidth = the node's network), as MiCS's
    8 concurrent all-reduces of an eighth over the 128 nodes do: priced alike, in bytes and seconds. What
    separates ZeRO-1 from MiCS in the replay is not this volume but ZeRO-1's all-gather of the updated weights
    across the nodes and its reduction after the backward (BENCHMARKS.md, section 8)."""
    from hplan.planner.ranks.amsp_replay import hardware_for
    from hplan.planner.ranks.collectives import World, block_group, collective_cost, strided_group

    trace = llama_trace("7b", micro_batches=micro_batches(1024))
    world = World.from_hardware(hardware_for(trace, 1024))
    grads = sum(p.bytes for p in trace.params)
    flat = collective_cost("all_reduce", grads, block_group(1024, world), world)
    mics = collective_cost("all_reduce", grads // 8, strided_group(128, 8, world), world)
    assert mics.group.concurrent == 8 and flat.group.per_node == 8
    assert mics.inter_node_bytes == pytest.approx(flat.inter_node_bytes, rel=0.01)
    assert mics.seconds == pytest.approx(flat.seconds, rel=0.05)


def test_zero1_against_mics_as_section_8_says():
    """Section 8's account (bench/multigpu_ranking.py): run as the paper ran them ZeRO-1 leads MiCS; as DeepSpeed's
    code reads by default (ZeRO-1 reducing after the backward, stage 3 overlapping on its reduce stream) MiCS leads;
    with nothing overlapped anywhere ZeRO-1 is ahead by about two points, a reading no system runs; and MiCS's
    measured 35% lies below MiCS with every collective blocking. If the model moves, the notes' claims must move
    with it."""
    from bench.multigpu_ranking import host_loop_note, host_loop_views, mics_note, readings, zero1_vs_mics
    from hplan.planner.ranks.amsp_replay import hardware_for

    rows = _rows("7b", 1024)
    trace = llama_trace("7b", micro_batches=micro_batches(1024))
    hw = hardware_for(trace, 1024)
    read = readings(trace, rows, hw)
    assert "not a mechanism found in the code" in zero1_vs_mics(trace, rows, hw, read)
    assert "Modelled: DeepSpeed's stage 3 engine loops" in host_loop_note(trace, rows, 1024, 8, rate=1e6)
    assert "unexplained" in mics_note(trace, rows, hw, read)
    assert rows["ZeRO-1"].mfu - rows["MiCS"].mfu > 0.05
    assert read["stage3_overlapped"]["MiCS"] - read["zero1_default"] > 0.05
    assert 0 < read["blocking"]["ZeRO-1"] - read["blocking"]["MiCS"] < 0.03
    assert read["blocking"]["MiCS"] > PAPER_MFU[("7b", 1024)]["MiCS"] + 0.03
    assert read["mics_own_buckets"] < read["stage3_overlapped"]["MiCS"] - 0.02
    assert host_loop_views(trace, 1024) == 291 * 3 * 1024 and host_loop_views(trace, 8) == 291 * 3 * 8


@pytest.mark.slow
def test_amsp_overlap_ablation_lands_near_the_papers_table_v():
    """AMSP's Table V (7B on 64 GPUs, M = 1 and 2, its Broadcast not overlapped): the replay's AMSP schedule and the
    same with its all-reduce held on the compute stream, each within 5 points of the measured MFU — the model is
    not fitted to these figures, so this checks it where the paper measured AMSP's own overlap."""
    import re

    from bench.multigpu_ranking import TABLE_V, ablation_note

    note = ablation_note()
    got = [float(x) / 100 for x in re.findall(r"([\d.]+)% against", note)]
    want = [v for m in TABLE_V for v in TABLE_V[m]]
    assert len(got) == len(want) == 4
    assert all(abs(g - w) < 0.05 for g, w in zip(got, want)), (got, want)
