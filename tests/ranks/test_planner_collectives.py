"""planner.ranks.collectives and planner.ranks.nccl: per-rank bytes and seconds of each shard-factor choice,
checked against
numbers computed by hand (module docstring formulas). Volumes and bandwidth terms on a 2-node × 4-GPU world
(intra 100 GB/s, inter 10 GB/s, no latency), a model whose parameters and gradients are 800 bytes each (so
shards stay integers); latency terms with NCCL's tuning constants on one DGX node and on AMSP's 128 nodes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hplan.errors import HplanError
from hplan.planner.ranks.collectives import (CommOptions, Group, ShardFactors, StateBytes, World, baseline, block_group,
                                       collective_cost, iteration_collectives, strided_group)
from hplan.planner.ranks.nccl import Latencies, nccl_time

ZERO = Latencies.zero()
WORLD = World(gpus_per_node=4, nodes=2, intra_gbps=100, inter_gbps=10, latencies=ZERO)
BEST = CommOptions(algorithm="best")
STATE = StateBytes(params=800, grads=800, optim=4800)


def run(name_or_factors, options=None, world=WORLD, state=STATE):
    if isinstance(name_or_factors, str):
        factors, opts = baseline(name_or_factors, world)
    else:
        factors, opts = name_or_factors, CommOptions()
    if options is None:
        options = CommOptions(**{**{f: getattr(opts, f) for f in opts.__dataclass_fields__}, "algorithm": "best"})
    return iteration_collectives(factors, state, world, options)


def summary(breakdown):
    return [(c.state, c.phase, c.op, c.group.size, c.sent_bytes, c.count, c.algorithm) for c in breakdown]


def test_planner_collectives_do_not_import_torch():
    code = "import sys, hplan.planner.ranks.collectives; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ddp_all_reduces_gradients_hierarchically():
    # all-reduce of 800 B over 8 ranks: sends 2·7/8·800 = 1400 B. Ring: 14 steps of 100 B paced by the
    # 10 GB/s network = 1.4e-7 s. Two-level: intra RS+AG 2·3/4·800 B at 100 GB/s = 1.2e-8 s, plus the
    # node's network share 2·(1/2)·800 = 800 B at 10 GB/s = 8e-8 s: 9.2e-8 s, the faster.
    total, seconds, parts = run("ddp")
    assert total == 1400
    assert seconds == pytest.approx(9.2e-8)
    assert summary(parts) == [("G", "gradient_sync", "all_reduce", 8, 1400, 1, "hierarchical")]
    assert parts[0].inter_node_bytes == 800
    assert [link for link, _ in parts[0].phases] == ["intra", "inter", "intra"]
    assert [t for _, t in parts[0].phases] == pytest.approx([6e-9, 8e-8, 6e-9])
    ring = iteration_collectives(ShardFactors(P=1, G=1, OS=1), STATE, WORLD, CommOptions(algorithm="ring"))
    assert ring[1] == pytest.approx(1.4e-7) and ring[2][0].inter_node_bytes == 1400
    assert ring[2][0].algorithm == "ring/Simple" and ring[2][0].phases == (("both", pytest.approx(1.4e-7)),)
    # NCCL's own pick (the default) is one flat call: the ring, not the tree (0.92·½·0.9 of the bandwidth)
    assert iteration_collectives(ShardFactors(P=1, G=1, OS=1), STATE, WORLD)[2][0].algorithm == "ring/Simple"


def test_zero3_gathers_twice_and_reduce_scatters():
    # three collectives of 7/8·800 = 700 B each; each two-level: network 1/2·800 B at 10 GB/s (4e-8 s)
    # + intra 3/4·800 B at 100 GB/s (6e-9 s) = 4.6e-8 s
    total, seconds, parts = run("zero3")
    assert total == 2100
    assert seconds == pytest.approx(3 * 4.6e-8)
    assert summary(parts) == [("P", "forward", "all_gather", 8, 700, 1, "hierarchical"),
                              ("P", "backward", "all_gather", 8, 700, 1, "hierarchical"),
                              ("G", "backward", "reduce_scatter", 8, 700, 1, "hierarchical")]
    assert sum(c.inter_node_bytes for c in parts) == 1200  # 3M · (m-1)/m, ZeRO's 3Ψ across nodes


def test_mics_keeps_gathers_in_the_node_and_syncs_gradients_in_two_hops():
    # AG, AG, RS over the node's 4 GPUs: 3/4·800 = 600 B each, 6e-9 s each. Then the 200 B gradient
    # shard is all-reduced between the 2 ranks holding it (one per node, 4 such pairs share the link):
    # 2·1/2·200 = 200 B per rank; 2 steps of 100 B at 10/4 GB/s = 8e-8 s.
    total, seconds, parts = run("mics")
    assert total == 3 * 600 + 200
    assert seconds == pytest.approx(3 * 6e-9 + 8e-8)
    assert parts[-1].group == Group(size=2, per_node=1, nodes=2, concurrent=4)
    assert summary(parts)[-1] == ("G", "gradient_sync", "all_reduce", 2, 200, 1, "ring/Simple")
    assert parts[-1].phases == (("inter", pytest.approx(8e-8)),)  # one rank per node: the network only


def test_amsp_mixed_choice_replicated_params_partial_grads_full_optimizer():
    # P=1, G=4, OS=8: RS of 800 B in the node (600 B, 6e-9 s); RS of the 200 B shard between its 2 holders
    # (100 B, one step of 100 B at 2.5 GB/s = 4e-8 s); after the update, all-gather of the 800 B weights
    # over all 8 ranks (700 B, 4.6e-8 s two-level).
    factors = ShardFactors(P=1, G=4, OS=8)
    total, seconds, parts = run(factors)
    assert total == 600 + 100 + 700
    assert seconds == pytest.approx(6e-9 + 4e-8 + 4.6e-8)
    assert [c.phase for c in parts] == ["backward", "gradient_sync", "after_update"]
    assert STATE.per_rank(factors) == {"P": 800, "G": 200, "OS": 600}


def test_zeropp_cuts_cross_node_bytes_four_times():
    # qwZ: forward AG of 400 B (int8) over 8 → 350 B, network 1/2·400 = 200 B; hpZ: backward AG of 800 B
    # inside the node → 600 B, no network; qgZ: RS of 200 B (int4) over 8 → 175 B, network 100 B.
    total, seconds, parts = run("zero++")
    assert total == 350 + 600 + 175
    assert sum(c.inter_node_bytes for c in parts) == 300  # 0.75M·(m-1)/m: ZeRO++'s "3M → 0.75M"
    assert seconds == pytest.approx((2e-8 + 3e-9) + 6e-9 + (1e-8 + 1.5e-9))
    assert [c.group.nodes for c in parts] == [2, 1, 2]


def test_one_node_reproduces_zero_paper_volumes():
    world = World(gpus_per_node=8, intra_gbps=150, inter_gbps=12.5, latencies=ZERO)
    state = StateBytes(params=8000, grads=8000, optim=48000)
    per = {name: run(name, world=world, state=state)[0] for name in ("ddp", "zero1", "zero2", "zero3")}
    assert per == {"ddp": 14000, "zero1": 14000, "zero2": 14000, "zero3": 21000}  # 2Ψ, 2Ψ, 2Ψ, 3Ψ × 7/8


def test_gradient_accumulation_costs_sharded_gradients_every_micro_batch():
    world = World(gpus_per_node=8, intra_gbps=150, inter_gbps=12.5, latencies=ZERO)
    state = StateBytes(params=8000, grads=8000, optim=48000)
    four = CommOptions(micro_batches=4)
    ddp = iteration_collectives(ShardFactors(P=1, G=1, OS=1), state, world, four)
    zero2 = iteration_collectives(ShardFactors(P=1, G=8, OS=8), state, world, four)
    assert ddp[0] == 14000  # local accumulation, one all-reduce
    assert zero2[0] == 4 * 7000 + 7000  # a reduce-scatter per micro-batch, one all-gather after the update
    zero3 = iteration_collectives(ShardFactors(P=8, G=8, OS=8), state, world, four)
    assert zero3[0] == 4 * 3 * 7000


def test_reshard_after_forward_options():
    keep = iteration_collectives(ShardFactors(P=8, G=8, OS=8), STATE, WORLD, CommOptions(reshard_after_forward=False))
    assert [c.phase for c in keep[2]] == ["forward", "backward"] and keep[0] == 1400
    node = iteration_collectives(ShardFactors(P=8, G=8, OS=8), STATE, WORLD, CommOptions(reshard_after_forward=4))
    assert node[2][1].group == Group(size=4, per_node=4, nodes=1, concurrent=1)
    with pytest.raises(HplanError, match="reshard_after_forward=3"):
        iteration_collectives(ShardFactors(P=8, G=8, OS=8), STATE, WORLD, CommOptions(reshard_after_forward=3))


def test_bad_factors_are_refused_with_the_allowed_values():
    with pytest.raises(HplanError, match=r"P=3 .*pick one of \[1, 2, 4, 8\]"):
        ShardFactors(P=3, G=8, OS=8).check(WORLD)
    with pytest.raises(HplanError, match="P \\| G \\| OS"):
        ShardFactors(P=4, G=2, OS=8).check(WORLD)
    with pytest.raises(HplanError, match="unknown baseline"):
        baseline("zero4", WORLD)
    with pytest.raises(HplanError):
        World(gpus_per_node=0, intra_gbps=1, inter_gbps=1)


def test_nccl_picks_the_protocol_by_size_inside_a_dgx_node():
    """8 ranks on NVLink at 300 GB/s, all-gather, NCCL 2.30's constants (µs): LL base 6.6 + 7 hops of 0.6,
    bandwidth ½·300·8/7; LL128 14 + 7·1.9 at 0.92·300·8/7; Simple 8.4 + 7·3.4 at 300·8/7."""
    def by_hand(nbytes):
        return {"LL": 10.8e-6 + nbytes / (0.5 * 300e9 * 8 / 7), "LL128": 27.3e-6 + nbytes / (0.92 * 300e9 * 8 / 7),
                "Simple": 32.2e-6 + nbytes / (300e9 * 8 / 7)}
    for nbytes, want in ((10**6, "LL"), (64 * 10**6, "Simple")):
        pick = nccl_time("all_gather", nbytes, ranks=8, per_node=8, nodes=1, bus_gbps=300, lat=Latencies())
        times = by_hand(nbytes)
        assert (pick.algorithm, pick.protocol) == ("ring", want)
        assert pick.seconds == pytest.approx(times[want]) == pytest.approx(min(times.values()))


def test_latency_of_1024_ranks_on_128_nodes():
    """AMSP's cluster: 8 A800 per node (NVLink 200 GB/s), 4×HDR per node (100 GB/s). A ring over all 1024 ranks
    has 1023 steps, 127 of them across nodes: Simple 8.4 + 896·3.4 + 127·14 = 4832.8 µs, LL128
    14 + 896·1.9 + 127·4 = 2224.4 µs, LL 6.6 + 896·0.6 + 127·2.7 = 887.1 µs; bus 100 GB/s."""
    world = World(gpus_per_node=8, nodes=128, intra_gbps=200, inter_gbps=100)
    group = block_group(1024, world)
    nbytes = 1024 * 32768  # a 32 KiB shard per rank
    ll = 887.1e-6 + nbytes / (0.5 * 100e9 * 1024 / 1023)
    ll128 = 2224.4e-6 + nbytes / (0.92 * 100e9 * 1024 / 1023)
    simple = 4832.8e-6 + nbytes / (100e9 * 1024 / 1023)
    cost = collective_cost("all_gather", nbytes, group, world)
    assert cost.seconds == pytest.approx(min(ll, ll128, simple)) == pytest.approx(ll)
    assert cost.algorithm == "ring/LL" and cost.phases[0][0] == "both"
    # all-reduce of 1 GB: NCCL's double binary tree with LL128 (14 + 2·(7·1.25 + 7·8.5) µs, bandwidth
    # 0.92·120/128·½·100 GB/s; Simple's 8.4 + 2·(7·4 + 7·14) µs at 0.92·½·0.9·100 GB/s is slower) beats the
    # ring, whose 2046 steps cost 14 + 1792·1.9 + 254·4 µs of latency with LL128 (its best protocol here)
    big = 10**9
    tree = nccl_time("all_reduce", big, ranks=1024, per_node=8, nodes=128, bus_gbps=100, lat=Latencies(),
                     algorithms=("tree",))
    ll128 = 150.5e-6 + big / (0.92 * 120 / 128 * 0.5 * 100e9)
    assert tree.seconds == pytest.approx(ll128) and tree.protocol == "LL128"
    assert ll128 < 260.4e-6 + big / (0.92 * 0.5 * 0.9 * 100e9)
    ring = nccl_time("all_reduce", big, ranks=1024, per_node=8, nodes=128, bus_gbps=100, lat=Latencies(),
                     algorithms=("ring",))
    assert ring.seconds == pytest.approx(4434.8e-6 + big / (0.92 * 100e9 * 1024 / 2046)) and ring.protocol == "LL128"
    assert collective_cost("all_reduce", big, group, world).algorithm == "tree/LL128" and tree.seconds < ring.seconds


def test_strided_groups_share_the_node_network():
    """The all-reduce of a MiCS gradient shard: 128 ranks, one per node, 8 such groups per node share its
    100 GB/s; all 254 steps cross nodes, and NCCL takes the tree's network latency for rings with one rank per
    node: LL128 14 + 254·8.5 µs at 0.92·12.5·128/254 GB/s beats Simple's (8.4 + 254·14)·1.4 µs at full rate."""
    world = World(gpus_per_node=8, nodes=128, intra_gbps=200, inter_gbps=100)
    group = strided_group(128, 8, world)
    assert group == Group(size=128, per_node=1, nodes=128, concurrent=8)
    nbytes = 128 * 10**6
    cost = collective_cost("all_reduce", nbytes, group, world, algorithm="ring")
    simple = (8.4 + 254 * 14) * 1.4e-6 + nbytes / (12.5e9 * 128 / 254)
    ll128 = (14 + 254 * 8.5) * 1e-6 + nbytes / (0.92 * 12.5e9 * 128 / 254)
    assert cost.seconds == pytest.approx(ll128) and ll128 < simple
    assert cost.phases[0][0] == "inter" and cost.algorithm == "ring/LL128"


def test_hierarchical_levels_queue_on_their_own_links():
    """Two-level all-gather of 64 MB over 2 nodes × 4 GPUs, NCCL latencies: the network phase is a ring of 2
    ranks (one per node, tree network latency) on 16 MB with 10/4 GB/s each, then the node's ring on 64 MB."""
    world = World(gpus_per_node=4, nodes=2, intra_gbps=100, inter_gbps=10)
    lat = Latencies()
    cost = collective_cost("all_gather", 64 * 10**6, block_group(8, world), world, algorithm="hierarchical")
    inter = nccl_time("all_gather", 16 * 10**6, ranks=2, per_node=1, nodes=2, bus_gbps=2.5, lat=lat)
    intra = nccl_time("all_gather", 64 * 10**6, ranks=4, per_node=4, nodes=1, bus_gbps=100, lat=lat)
    assert inter.seconds == pytest.approx(8.4e-6 + 14e-6 + 16e6 / (2.5e9 * 2))
    assert [link for link, _ in cost.phases] == ["inter", "intra"]
    assert cost.phases[0][1] == pytest.approx(inter.seconds) and cost.phases[1][1] == pytest.approx(intra.seconds)


def test_latency_flags_scale_nccl_hops_and_zero_is_bandwidth_only():
    world = World(gpus_per_node=4, nodes=1, intra_gbps=100, inter_gbps=10, latencies=Latencies(intra_hop_s=6.8e-6))
    cost = collective_cost("all_gather", 400, block_group(4, world), world)
    # every NVLink row and the base latency scale by 6.8/3.4 = 2: LL 2·(6.6 + 3·0.6) µs at ½·100·4/3 GB/s
    assert cost.seconds == pytest.approx(2 * 8.4e-6 + 400 / (0.5 * 100e9 * 4 / 3))
    bare = World(gpus_per_node=4, nodes=1, intra_gbps=100, inter_gbps=10, latencies=ZERO)
    assert collective_cost("all_reduce", 800, block_group(4, bare), bare).seconds == pytest.approx(6 * 200 / 100e9)


def test_world_from_hardware_artifact():
    from hplan.artifacts.hardware import Hardware

    hw = Hardware(gpu_bytes=80 * 10**9, gpus_per_node=8, nodes=4, intra_gbps=300.0, inter_gbps=25.0,
                  intra_latency_us=1.0, inter_latency_us=0.0, intra_link="pci")
    world = World.from_hardware(hw)
    assert (world.ranks, world.intra_gbps, world.inter_gbps) == (32, 300.0, 25.0)
    assert world.latencies == Latencies(intra_hop_s=1e-6, inter_hop_s=0.0, intra_kind="pci")


def test_executor_counters_equal_the_planned_bytes():
    """Inside one node the executor's ring counters and the planner's per-rank bytes are one formula."""
    from hplan.executor.ranks.collectives import ring_bytes

    world = World(gpus_per_node=4, intra_gbps=100, inter_gbps=10, latencies=ZERO)
    group = Group(size=4, per_node=4, nodes=1, concurrent=1)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        for numel in (4, 5, 12, 1023):  # fp32 elements; uneven sizes pad to a multiple of 4 elements
            padded = 4 * 4 * -(-numel // 4)
            measured = ring_bytes(op, padded_bytes=padded, payload_bytes=4 * numel, group_size=4).sent
            assert collective_cost(op, 4 * numel, group, world, itemsize=4).sent_bytes == measured
