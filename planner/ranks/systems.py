"""Published sharded data-parallel systems, priced by hplan's many-rank model on the same trace and hardware.

Each system is its shard factors ([Note: shard layout]) plus how it issues collectives (a
`planner.ranks.shard_time.CommSchedule`), each setting taken from the system's defaults in its code or paper:
- ZeRO-3 (DeepSpeed, deepspeed/runtime/zero/config.py defaults): P = G = OS = all ranks; weights gathered
  per module and prefetched one module ahead in both passes (stage3_prefetch_bucket_size 5e7 elements, the
  trace-based prefetcher of partitioned_param_coordinator.py); gradient reduce-scatters beside the backward
  (overlap_comm defaults to True for stage 3) in buckets of reduce_bucket_size = 5e8 elements;
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
- ZeRO-3, ZeRO++ and MiCS share stage3.py's one reduce stream ([Note: one reduction stream]);
- ZeRO-1 (DeepSpeed stage 1, runtime/zero/stage_1_and_2.py): P = G = 1, OS = all ranks; gradients reduced once
  per step after the backward (engine.allreduce_gradients -> reduce_gradients: no hooks below stage 2 without
  overlap_comm, which defaults to False there) in buckets of 5e8 elements on the compute stream, each bucket
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
    zero3 = CommSchedule(prefetch=1, bucket_bytes=ds, one_reduce_stream=True)  # stage3.py's one reduce stream
    out = [System(name="ZeRO-3", kind="zero3", schedule=zero3),
           System(name="ZeRO++ (hpZ)", kind="zero++hpz", schedule=zero3),
           System(name="MiCS", kind="mics", schedule=zero3),
           System(name="ZeRO-1", kind="zero1",
                  schedule=CommSchedule(overlap_reductions=False, bucket_bytes=ds, update_gather_bytes=WHOLE))]
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
                                 grad_of, schedule=schedule, dtypes=region_dtypes(plan.chunks, plan.regions))


def system_steps(system: System, plan: Plan) -> tuple[Step, ...]:
    """The plan's steps as the system runs them (hpZ rewrites backward gathers)."""
    if system.kind == "zero++hpz":
        return hpz_steps(plan.steps, plan.hardware.gpus_per_node)
    if system.kind == "zero1":
        return allreduce_steps(plan.steps)
    return plan.steps
