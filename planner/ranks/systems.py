"""Published sharded data-parallel systems, priced by hplan's many-rank model on the same trace and hardware.

Each system is its shard factors ([Note: shard layout]) plus how it issues collectives (a
`planner.ranks.shard_time.CommSchedule`), each setting taken from the system's defaults in its code or paper:
- ZeRO-3 (DeepSpeed, deepspeed/runtime/zero/config.py defaults): P = G = OS = all ranks; weights gathered
  per module and prefetched one module ahead in both passes (stage3_prefetch_bucket_size 5e7 elements, the
  trace-based prefetcher of partitioned_param_coordinator.py); gradient reduce-scatters issued on their own stream
  during the backward (overlap_comm defaults to True for stage 3) in buckets of reduce_bucket_size = 5e8
  elements, yet holding the compute as AMSP's traces show ([Note: the paper's baselines]);
- ZeRO++ with hpZ only (arXiv 2306.10209 §3.2; AMSP v2 ran it without qwZ/qgZ): ZeRO-3 whose backward
  gathers come from a secondary copy inside the node (a gather over the node's GPUs); the secondary copy's
  memory (weights / GPUs per node per rank) is not in the plan;
- MiCS (arXiv 2205.00119; DeepSpeed's runtime/zero/mics.py, read at v0.11.1, Oct 2023, and v0.12.3): P = G =
  OS = GPUs per node (mics_shard_size 8 in DeepSpeed's own MiCS example, docs/code-docs/source/zero3.rst; LLaMA-7B's
  and 13B's states fit a node), the ZeRO-3 engine above; each parameter's shard gathered in one NCCL group per
  fetch with no copy-out (mics.py _flat_all_gather_with_coalescing_manager, MiCS_AllGatherCoalescedHandle); each
  IPG bucket's partitions all-reduced over the replicas right after that bucket's reduce-scatter, on the same
  reduce stream, at the accumulation boundary (allreduce_mics_shard_grads: [Note: one reduction stream] in
  planner.ranks.shard_time). Gathers are flat: the hierarchical gather needs mics_hierarchical_params_gather,
  False by default (runtime/zero/config.py), and a group spanning nodes (mics_utils.create_mics_comm_groups);
- ZeRO-3, ZeRO++ and MiCS share stage3.py's one reduce stream ([Note: one reduction stream]), and block the
  compute stream on it as AMSP measured them ([Note: the paper's baselines]);
- ZeRO-1 (DeepSpeed stage 1, runtime/zero/stage_1_and_2.py): P = G = 1, OS = all ranks; gradients reduced in the
  backward with overlap_comm on, as AMSP ran it ([Note: the paper's baselines]; DeepSpeed's default is off below
  stage 3, which reduces after the backward on the compute stream) in buckets of 5e8 elements, each bucket
  all-reduced whole over the data-parallel group (`allreduce_steps`), updated weights all-gathered after the
  step, on the compute stream, one all_gather_into_tensor per parameter group's flat buffer (stage_1_and_2.py
  step -> runtime/utils.py all_gather_dp_groups -> all_gather_into_tensor_dp_groups, DeepSpeed 0.19.8: the
  allgather_bucket_size loop is only the fallback where the backend lacks all_gather_into_tensor, and NCCL has
  it; the replay's trace has one group);
- AMSP (arXiv 2311.00257 v2): the factors its paper reports per model, gathers prefetched, gradient
  synchronisation overlapped with the backward ("AllGather prefetching and ReduceScatter scheduling") in buckets
  of 512 MiB (InternEvo's hybrid_zero_optimizer default, configs/7B_sft.py, the framework AMSP's authors
  build on), each bucket's whole reduction (both hops) issued when the bucket's gradients fill it, one bucket
  after another (InternEvo hybrid_zero_optim.py at commit 0aa6d26: _store_and_try_reduce_grads_by_bucket ->
  _reduce_grads_by_rank, which waits for the bucket in progress before taking the next);
- hplan: its own plan as its executor runs it (`shard_time.EXECUTOR`: gathers one step ahead, reductions
  asynchronous and settled one step later, one call per chunk).
- ZeRO-3, ZeRO++ and MiCS pay stage 3's host loops over each group's ranks ([Note: the stage 3 host loop]).
What no system here models: the rest of their engines' per-module CPU overhead (hooks, bookkeeping), kernels
slowed by communication running beside them, and network congestion beyond each node's link.

[Note: the paper's baselines] AMSP's evaluation (arXiv 2311.00257 v2, 13 Mar 2024, §VI.A and §VI.C) says how it
ran the systems it compares, and the replay runs them so, reading each setting from the paper, none fitted:
- "The communication-computation overlap configurations are consistently enabled in all baselines" (§VI.A.4):
  ZeRO-1 is DeepSpeed's stage 1 with overlap_comm on, which hooks every gradient and all-reduces each full bucket
  on its reduction stream during the backward (stage_1_and_2.py at v0.12.3, Nov 2023: lines 491-492
  create_reduce_and_remove_grad_hooks when `partition_gradients or overlap_comm`, lines 956-964 average_tensor on
  `reduction_stream`): `overlap_reductions=True`, not the compute-stream reduction after the backward of
  DeepSpeed's default;
- "Even when the communication-computation overlap setting is enabled, DeepSpeed-ZeRO3/MiCS/ZeRO++ fails to
  effectively overlap ReduceScatter with computation", and "in DeepSpeed-MiCS, the ReduceScatter operation also
  blocks the concurrent execution of AllReduce" (§VI.C, from their traces, Fig. 14 and Appendix A): stage 3's
  reductions hold the compute stream (`overlap_reductions=False`), each bucket's reduce-scatter then MiCS's
  all-reduce on one stream ([Note: one reduction stream]). This is their measurement, not a reading of the code:
  stage3.py (v0.12.3 lines 1179-1213) issues the bucket on reduce_and_partition_stream and blocks the host only
  past two buckets in flight, and what stalls the compute in their traces is not identified here (the host work of
  reduce_scatter_coalesced on the thread that launches the kernels is one candidate: bench/multigpu_ranking.py);
- "we disabled the overlap between Broadcast and forward computation during the end-to-end system evaluations"
  (§VI.A.4): AMSP's updated-weight exchange after its optimizer step is not hidden behind the next forward — the
  replay's one-iteration timeline already ends the step when that exchange ends;
- the factors (Table IV): MiCS 8×1 (one node) for LLaMA-7B and 13B, ZeRO++'s secondary weights over 8×1 (one
  node) without quantisation, ZeRO-1 and ZeRO-3 over all ranks, AMSP 1/1/8 and 4/4/8 — as `System.sharding`.
The code's own defaults stay a reading in bench section 8 (`bench.multigpu_ranking.readings`).

[Note: the stage 3 host loop] DeepSpeed's stage 3 engine (ZeRO-3, ZeRO++, MiCS) runs Python loops over the ranks of
each collective's group on the thread that launches the kernels, so their cost grows with the group, not the bytes:
- a gather's wait (partition_parameters.py AllGatherCoalescedHandle.wait, v0.12.3 lines 642-656, the same at
  v0.11.1): per parameter and per rank a `narrow` of the rank's piece, then the `torch.cat` of the pieces and a
  `record_stream` per piece — 2 ops per parameter per rank, in the forward and again in the backward (ZeRO++'s hpZ
  backward gathers run over its secondary group, 8 ranks);
- a reduce-scatter (runtime/comm/coalesced_collectives.py reduce_scatter_coalesced, v0.12.3 line 89): a slice per
  rank per gradient, then their interleaving into one `torch.cat` — 1 op per parameter per rank;
- MiCS's gather handle (mics.py MiCS_AllGatherCoalescedHandle.wait, v0.12.3 lines 32-53) marks the parameters
  available with no per-rank loop; its reduce-scatter is the one above over its 8-rank shard group.
Each op is priced at `HOST_OP_S`, PyTorch's own measured host cost of an eager view op (host-bound: its benchmark
timed CPU and CUDA tensors alike; a cited figure, not fitted to AMSP's numbers). The loop for a step's calls runs
while the GPU computes the step before, so a plan step adds only its host time beyond its compute
(`host_loop_seconds`). For LLaMA-7B at 1,024 ranks that is 1,024 ranks × (226 gathered tensors × 4 ops + 291
gradients × 1) ≈ 1.2 M ops, 2.8 s at 2.26 µs (its 65 RMSNorm weights persisted, `persisted_steps`), against 1 s of
compute: ZeRO-3 and ZeRO++ fall with the world size and MiCS does not, the
paper's direction, which bytes and NCCL's latency model alone do not give (their gathers over 1,024 ranks cost
1–2 ms each). Counted on the upper side: a fetch of one parameter
alone takes a path without the loop (AllGatherHandle), which the trace-based prefetcher, coalescing up to
stage3_prefetch_bucket_size (5e7) elements per call, leaves to the first fetches. Not counted: the per-call
narrows of `_all_gather_dtype` and the `torch.cat` of 1,024 × tensors pieces, each O(ranks) too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hplan.artifacts.buckets import region_dtypes
from hplan.artifacts.plan import Plan, Step
from hplan.artifacts.shard import Collective, Sharding
from hplan.artifacts.trace import Trace
from hplan.planner.schedule import event_seconds, with_device_updates
from hplan.planner.ranks.piece_update import piece_update_bytes
from hplan.planner.ranks.shard_time import EXECUTOR, WHOLE, CommSchedule, predict_shard_seconds

DEEPSPEED_BUCKET_ELEMENTS = 5 * 10**8
"""reduce_bucket_size and allgather_bucket_size defaults (deepspeed/runtime/zero/config.py)."""
INTERNEVO_BUCKET_BYTES = 512 * 1024 * 1024
"""hybrid_zero_optimizer.reduce_bucket_size in InternEvo's configs/7B_sft.py."""
HOST_OP_S = 2.26e-6
"""Host seconds of one eager PyTorch op on a small tensor: `split` of an 8×8 tensor in 2 in PyTorch's operator
micro-benchmark, 2.26 µs after pytorch/pytorch PR #32194 (Jan 2020); before it the same benchmark timed the CPU and
CUDA cases alike (3.340 and 3.333 µs: host-bound, the device's kernels not involved), so the cheaper figure is taken
([Note: the stage 3 host loop]). The benchmark's CPU is not stated; the A800 nodes' host is not known either."""


@dataclass(frozen=True, kw_only=True, slots=True)
class System:
    """A published system: its factors for a world and how it issues collectives."""

    name: str
    kind: str
    """"zero3", "zero++hpz", "mics", "zero1", "amsp" or "hplan" ("zero1<0.12.4": a reading, `zero1_before_0_12_4`)."""
    schedule: CommSchedule
    factors: tuple[int, int, int] | None = None
    """AMSP's published (P, G, OS); None: the system's rule for the world."""
    host_ops: tuple[int, int] = (0, 0)
    """Host ops per rank of the group per parameter tensor in (a weight gather, a gradient reduce-scatter)
    ([Note: the stage 3 host loop]); (0, 0): none modelled."""

    def sharding(self, ranks: int, gpus_per_node: int) -> Sharding | None:
        """The factors on this world (None for hplan: it searches them)."""
        n, g = ranks, gpus_per_node
        rule = {"zero3": (n, n, n), "zero++hpz": (n, n, n), "mics": (g, g, g), "zero1": (1, 1, n)}
        f = self.factors if self.factors is not None else rule.get(self.kind)
        return None if f is None else Sharding(P=f[0], G=f[1], OS=f[2])


PER_RANK_REDUCE_SLOWDOWN = 1.2 / 0.36
"""DeepSpeed stage 1/2's gradient reduction before v0.12.4, against after: DeepSpeed's blogs/comm-opt/README.md
Table 1, a dense 7B on 1,024 A100s, AllReduce time 1.2 s a step as one dist.reduce per destination rank's slice
(stage_1_and_2.py v0.11.1 average_tensor, lines 1036-1043), 0.36 s with multi-rank bucketing (PR #4695, in v0.12.4,
released 2023-11-30; AMSP's v1 is dated 2023-11-01). A ratio, since the replay's own price of that all-reduce
(bench section 8 prints it) is near the 0.36 s already."""
STAGE3_HOST_OPS = (2, 1)
"""DeepSpeed stage 3 (v0.11.1-v0.12.3): per parameter and rank of the group, a gather's wait makes a narrow and a
record_stream (partition_parameters.py AllGatherCoalescedHandle.wait, v0.12.3 lines 642-656) and a reduce-scatter a
slice (runtime/comm/coalesced_collectives.py reduce_scatter_coalesced, v0.12.3 line 89)."""
MICS_HOST_OPS = (0, 1)
"""MiCS: its gather handle returns the gathered buffers with no per-rank loop (mics.py MiCS_AllGatherCoalescedHandle,
v0.12.3 lines 32-53); its reduce-scatter is stage 3's reduce_scatter_coalesced over the shard group."""


PERSISTENCE_THRESHOLD = 10**5
"""stage3_param_persistence_threshold's default (DeepSpeed runtime/zero/config.py, v0.12.3 line 192)."""


def deepspeed_bucket(itemsize: int) -> int:
    return DEEPSPEED_BUCKET_ELEMENTS * itemsize


def systems(grad_itemsize: int, amsp: tuple[int, int, int] | None = None) -> list[System]:
    """The systems of AMSP's comparison (and hplan), for gradients of `grad_itemsize` bytes."""
    ds = deepspeed_bucket(grad_itemsize)
    # stage3.py's one reduce stream, holding the compute stream as AMSP measured it ([Note: the paper's baselines])
    zero3 = CommSchedule(prefetch=1, bucket_bytes=ds, one_reduce_stream=True, overlap_reductions=False)
    out = [System(name="ZeRO-3", kind="zero3", schedule=zero3, host_ops=STAGE3_HOST_OPS),
           System(name="ZeRO++ (hpZ)", kind="zero++hpz", schedule=zero3, host_ops=STAGE3_HOST_OPS),
           System(name="MiCS", kind="mics", schedule=zero3, host_ops=MICS_HOST_OPS),
           System(name="ZeRO-1", kind="zero1",
                  schedule=CommSchedule(overlap_reductions=True, bucket_bytes=ds, update_gather_bytes=WHOLE))]
    if amsp is not None:
        out.append(System(name="AMSP", kind="amsp", factors=amsp,
                          schedule=CommSchedule(prefetch=1, bucket_bytes=INTERNEVO_BUCKET_BYTES,
                                                one_reduce_stream=True)))
    out.append(System(name="hplan", kind="hplan", schedule=EXECUTOR))
    return out


def hpz_steps(steps: tuple[Step, ...], gpus_per_node: int) -> tuple[Step, ...]:
    """ZeRO++'s hpZ on a ZeRO-3 plan: every backward weight gather runs over the node's GPUs (the secondary
    partition) instead of all ranks; forward gathers and reductions are unchanged."""
    out = []
    for st in steps:
        if not st.event.startswith("backward:"):
            out.append(st)
            continue
        calls = tuple(Collective.make(c.op, c.purpose, c.region, c.before, min(gpus_per_node, c.size), 1, c.numel,
                                      c.itemsize) if c.purpose == "gather" else c for c in st.collectives)
        out.append(replace(st, collectives=calls))
    return tuple(out)


def allreduce_steps(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """DeepSpeed stage 1/2's gradient reduction on a ZeRO-1 plan: each reduce-scatter of gradients becomes an
    all-reduce of the same buffer. Its default (`use_multi_rank_bucket_allreduce`, runtime/zero/config.py)
    packs every destination rank's slices of a bucket into one flat tensor and all-reduces it over the
    data-parallel group (stage_1_and_2.py: average_tensor -> allreduce_and_scatter -> allreduce_bucket ->
    dist.all_reduce); each rank then keeps its own slice, so twice a reduce-scatter's bytes cross the links.
    Before DeepSpeed 0.12.4 (PR #4695) a bucket went as one dist.reduce per destination rank's slice: a
    reduce-scatter's bytes in about one call per rank, whose all-reduce time for a dense 7B grew by 1 and 2 s
    from 256 to 512 and 1,024 A100s (DeepSpeed's blogs/comm-opt/README.md, the reason for the change)."""
    out = []
    for st in steps:
        calls = tuple(Collective.make("all_reduce", c.purpose, c.region, c.before, c.size, c.stride, c.numel,
                                      c.itemsize) if c.op == "reduce_scatter" and c.purpose == "sync" else c
                      for c in st.collectives)
        out.append(replace(st, collectives=calls))
    return tuple(out)


def price(plan: Plan, trace: Trace, schedule: CommSchedule, steps: tuple[Step, ...] | None = None
          ) -> dict[str, float]:
    """The step-time split of a plan's steps (or of other steps over its regions) under a schedule."""
    steps = steps if steps is not None else plan.steps
    return _priced(plan, schedule, steps, *_event_times(plan, trace, steps))


def _event_times(plan: Plan, trace: Trace, steps: tuple[Step, ...]
                 ) -> tuple[list[float], dict[int, int], dict[int, int]]:
    """Per step its compute seconds with the device updates, the chunks' update bytes and each chunk's gradient
    region: what `price` and the stage 3 host loop (`system_price`) both read."""
    per_chunk = piece_update_bytes(plan.regions, plan.sharding)  # [Note: piece updates] in piece_update
    grad_of = {r.chunk: r.id for r in plan.regions if r.kind == "grad"}
    times = with_device_updates(event_seconds(trace, plan.hardware), trace, plan.hardware, steps, per_chunk, grad_of)
    return times, per_chunk, grad_of


def _priced(plan: Plan, schedule: CommSchedule, steps: tuple[Step, ...], times: list[float],
            per_chunk: dict[int, int], grad_of: dict[int, int]) -> dict[str, float]:
    return predict_shard_seconds(steps, {r.id: r.bytes for r in plan.regions}, frozenset(plan.initial_resident),
                                 times, plan.hardware, per_chunk, grad_of, schedule=schedule,
                                 dtypes=region_dtypes(plan.chunks, plan.regions), regions=plan.regions)


def persisted_steps(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """Stage 3 without the gathers of parameters it persists: a parameter of at most
    stage3_param_persistence_threshold elements (1e5 by default, runtime/zero/config.py v0.12.3 line 192) is marked
    ds_persist (partition_parameters.py v0.12.3 line 1030) and never released after use (partitioned_param_coordinator
    .py v0.12.3 line 476), so it is gathered once, not per module use: LLaMA's RMSNorm weights (hidden elements). A
    chunk is dropped when its whole gathered buffer is that small. Their gradients are still reduce-scattered."""
    out = []
    for st in steps:
        calls = tuple(c for c in st.collectives if not (c.purpose == "gather" and c.numel <= PERSISTENCE_THRESHOLD))
        out.append(replace(st, collectives=calls) if len(calls) != len(st.collectives) else st)
    return tuple(out)


def system_steps(system: System, plan: Plan) -> tuple[Step, ...]:
    """The plan's steps as the system runs them (hpZ rewrites backward gathers; stage 3 keeps its small parameters)."""
    if system.kind in ("zero3", "mics"):
        return persisted_steps(plan.steps)
    if system.kind == "zero++hpz":
        return hpz_steps(persisted_steps(plan.steps), plan.hardware.gpus_per_node)
    if system.kind == "zero1":
        return allreduce_steps(plan.steps)
    if system.kind == "zero1<0.12.4":
        return _slowed_reduce(allreduce_steps(plan.steps), PER_RANK_REDUCE_SLOWDOWN)
    return plan.steps


def host_loop_seconds(system: System, plan: Plan, steps: tuple[Step, ...], compute: list[float]) -> float:
    """Seconds the stage 3 host loop adds to a step ([Note: the stage 3 host loop]): per plan step, the host ops of
    its gathers and reduce-scatters (ops per rank × ranks in the call's group × parameter tensors of the chunk)
    beyond that step's compute, which the GPU runs meanwhile."""
    gather_ops, scatter_ops = system.host_ops
    if not gather_ops and not scatter_ops:
        return 0.0
    tensors = {r.id: len(plan.chunks[r.chunk].tensors) for r in plan.regions}
    extra = 0.0
    for st, busy in zip(steps, compute):
        ops = sum((gather_ops if c.purpose == "gather" else scatter_ops if c.op == "reduce_scatter" else 0)
                  * c.size * tensors[c.region] for c in st.collectives)
        extra += max(0.0, ops * HOST_OP_S - busy)
    return extra


def system_price(system: System, plan: Plan, trace: Trace) -> dict[str, float]:
    """A system's step-time split: `price` of its steps under its schedule, plus its host loop ("host_loop", in
    "step"; "timeline" is the step without it)."""
    steps = system_steps(system, plan)
    times, per_chunk, grad_of = _event_times(plan, trace, steps)
    split = _priced(plan, system.schedule, steps, times, per_chunk, grad_of)
    host = host_loop_seconds(system, plan, steps, times)
    return {**split, "timeline": split["step"], "host_loop": host, "step": split["step"] + host}


def zero1_before_0_12_4(system: System) -> System:
    """ZeRO-1 as DeepSpeed ran it before v0.12.4, the releases AMSP's experiments predate (a reading, not the
    replay's row: bench section 8): its gradient reduction priced at `PER_RANK_REDUCE_SLOWDOWN` times the bucket's
    all-reduce, its updated weights all-gathered in shards of allgather_bucket_size elements (runtime/utils.py
    v0.11.1 all_gather_dp_groups, lines 950-971: numel × ranks // 5e8 calls of dist.all_gather into 1,024 views)."""
    return replace(system, kind="zero1<0.12.4",
                   schedule=replace(system.schedule, update_gather_bytes=system.schedule.bucket_bytes))


def _slowed_reduce(steps: tuple[Step, ...], factor: float) -> tuple[Step, ...]:
    """Each gradient all-reduce priced as `factor` times its bytes (the bandwidth term dominates a 1 GB bucket)."""
    out = []
    for st in steps:
        calls = tuple(Collective.make(c.op, c.purpose, c.region, c.before, c.size, c.stride, round(c.numel * factor),
                                      c.itemsize) if c.op == "all_reduce" and c.purpose == "sync" else c
                      for c in st.collectives)
        out.append(replace(st, collectives=calls))
    return tuple(out)
