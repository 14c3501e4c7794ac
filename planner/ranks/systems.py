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
What no system here models: their engines' per-module CPU overhead (hooks, bookkeeping), kernels slowed by
communication running beside them, and network congestion beyond each node's link.

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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hplan.artifacts.buckets import region_dtypes
from hplan.artifacts.plan import Plan, Step
from hplan.artifacts.shard import Collective, Sharding
from hplan.artifacts.trace import Trace
from hplan.planner.schedule import event_seconds, with_device_updates
from hplan.planner.ranks.shard_time import EXECUTOR, WHOLE, CommSchedule, piece_update_bytes, predict_shard_seconds

DEEPSPEED_BUCKET_ELEMENTS = 5 * 10**8
"""reduce_bucket_size and allgather_bucket_size defaults (deepspeed/runtime/zero/config.py)."""
INTERNEVO_BUCKET_BYTES = 512 * 1024 * 1024
"""hybrid_zero_optimizer.reduce_bucket_size in InternEvo's configs/7B_sft.py."""


@dataclass(frozen=True, kw_only=True, slots=True)
class System:
    """A published system: its factors for a world and how it issues collectives."""

    name: str
    kind: str
    """"zero3", "zero++hpz", "mics", "zero1", "amsp" or "hplan"."""
    schedule: CommSchedule
    factors: tuple[int, int, int] | None = None
    """AMSP's published (P, G, OS); None: the system's rule for the world."""

    def sharding(self, ranks: int, gpus_per_node: int) -> Sharding | None:
        """The factors on this world (None for hplan: it searches them)."""
        n, g = ranks, gpus_per_node
        rule = {"zero3": (n, n, n), "zero++hpz": (n, n, n), "mics": (g, g, g), "zero1": (1, 1, n)}
        f = self.factors if self.factors is not None else rule.get(self.kind)
        return None if f is None else Sharding(P=f[0], G=f[1], OS=f[2])


def deepspeed_bucket(itemsize: int) -> int:
    return DEEPSPEED_BUCKET_ELEMENTS * itemsize


def systems(grad_itemsize: int, amsp: tuple[int, int, int] | None = None) -> list[System]:
    """The systems of AMSP's comparison (and hplan), for gradients of `grad_itemsize` bytes."""
    ds = deepspeed_bucket(grad_itemsize)
    # stage3.py's one reduce stream, holding the compute stream as AMSP measured it ([Note: the paper's baselines])
    zero3 = CommSchedule(prefetch=1, bucket_bytes=ds, one_reduce_stream=True, overlap_reductions=False)
    out = [System(name="ZeRO-3", kind="zero3", schedule=zero3),
           System(name="ZeRO++ (hpZ)", kind="zero++hpz", schedule=zero3),
           System(name="MiCS", kind="mics", schedule=zero3),
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
    sizes = {r.id: r.bytes for r in plan.regions}
    per_chunk = piece_update_bytes(plan.regions, plan.sharding)  # [Note: piece updates] in shard_time
    grad_of = {r.chunk: r.id for r in plan.regions if r.kind == "grad"}
    steps = steps if steps is not None else plan.steps
    times = with_device_updates(event_seconds(trace, plan.hardware), trace, plan.hardware, steps, per_chunk, grad_of)
    return predict_shard_seconds(steps, sizes, frozenset(plan.initial_resident), times, plan.hardware, per_chunk,
                                 grad_of, schedule=schedule, dtypes=region_dtypes(plan.chunks, plan.regions),
                                 regions=plan.regions)


def system_steps(system: System, plan: Plan) -> tuple[Step, ...]:
    """The plan's steps as the system runs them (hpZ rewrites backward gathers)."""
    if system.kind == "zero++hpz":
        return hpz_steps(plan.steps, plan.hardware.gpus_per_node)
    if system.kind == "zero1":
        return allreduce_steps(plan.steps)
    return plan.steps
