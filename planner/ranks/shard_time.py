"""Predicted step time of a many-rank plan: compute, host links, host optimizer and collectives, overlapped.

The one-rank model (`planner.schedule.predict_seconds`) with two more resources, each its own FIFO queue: the
rank's intra-node link (NVLink / PCIe) and its node's network. A collective's phases
(`planner.ranks.collectives.CollectiveCost.phases`, timed by NCCL's α-β model) queue on the link they use: a flat call
across nodes holds both, a hierarchical one holds NVLink, then the network, then NVLink again, so one call's
network phase overlaps another's NVLink phase. How collectives are issued is a `CommSchedule`:
- `prefetch` (modules ahead): a step's weight all-gathers are issued when the compute of the step `prefetch`
  before it starts — in the forward *and* the backward pass, as FSDP (BackwardPrefetch.BACKWARD_PRE, forward
  prefetch) and DeepSpeed ZeRO-3 (its trace-based prefetcher) issue them. Issued before that step's
  reduce-scatter, the gather is queued before it (the reduce-scatter comes at the step's end), so it never
  waits behind it. A gather whose input shard is fetched from the host at its own step is not prefetched;
- `overlap_reductions`: gradient reduce-scatters and syncs run on their queues beside the next compute
  (FSDP, DeepSpeed with overlap_comm) — or block the compute stream (DeepSpeed ZeRO-1/2's default);
- `blocking`: every collective blocks the compute stream;
- `settle_next`: a reduction issued after step t completes before step t + 2 starts (and all of them before the
  optimizer step), and a reduction of a region another reduction of the same step still writes waits for it on
  the compute stream (hplan's executor: [Note: collectives in flight] in hplan.artifacts.shard; its gloo twin
  cannot order two calls on different groups without waiting);
- `lookahead`: further ahead where the plan's windows have room, from the executor's own schedule ([Note:
  collectives ahead within the plan's room] in hplan.artifacts.lookahead): a gather bucket goes out as the step it
  names starts (else at its own step), a reduction after step t is waited after its deadline, not t + 1;
- `packed`: the calls one step makes alike go as one flat call where the plan's headroom allows (hplan's
  executor: [Note: collective buckets] in hplan.artifacts.buckets, the same function deciding), so a bucket pays
  one call's latency for its members' bytes;
- `bucket_bytes`: gradient reductions (and the updated-weight gathers after the optimizer) are coalesced in
  buckets of this many bytes, issued when a bucket fills and at the end of the pass (DeepSpeed's
  reduce_bucket_size / allgather_bucket_size); 0 = one call per chunk, as the plan lists them;
- `update_gather_bytes`: the updated-weight gathers' own bucket where it differs (None: `bucket_bytes`;
  `WHOLE`: one call for all of them, as DeepSpeed's stage 1/2 all-gathers a parameter group's flat buffer).
- `one_reduce_stream`: gradient reductions share one stream ([Note: one reduction stream]): a bucket fills with
  the reduce-scatter's input and goes whole, its reduce-scatter and then its replicas' all-reduce, each bucket
  after the one before.
A gradient's write-back, the host update reading it and the GPU update at the optimizer step wait for its
sync. The iteration ends when compute, the host optimizer and both links are done. Without
`hardware.overlap` (the CPU fast tier) nothing overlaps: the step is the sum of everything.

[Note: exposed time] The split tells why a step takes as long as it does: `compute` (busy) plus each stretch
the compute stream waits, charged to what it waited for — `exposed_host` (a fetch from the host),
`exposed_intra` / `exposed_inter` (a collective: a flat call across nodes is charged to the network, within a
node to NVLink; a hierarchical call to the link of its last phase), `exposed_cpu_optimizer` (the host update
running past the last compute) — sums to `step` exactly. Busy seconds per link and per collective op follow.

[Note: one reduction stream] DeepSpeed's stage 3 (ZeRO-3, ZeRO++ and MiCS alike) reduces gradients in one flat
IPG bucket of reduce_bucket_size elements of full gradients, and issues everything for a bucket inside one
`with stream(reduce_and_partition_stream)` (runtime/zero/stage3.py, v0.11.1 lines 1134-1170: the bucket's
reduce-scatter over the partition group, then `partition_grads`); MiCS's `partition_grads` all-reduces that
bucket's partitions over the replica group right there (runtime/zero/mics.py, v0.11.1 lines 397-432:
allreduce_mics_shard_grads, at the accumulation boundary; all_reduce_coalesced = one ncclAllReduce per partition
in one NCCL group, which NCCL's tuning model prices as the summed bytes with a latency per op on a ring, per batch
of ops on a tree: tuning.cc ncclTopoGetAlgoTime, latCount; priced here as one call, a few ms a step short at
most). So the replicas' all-reduce of a bucket goes with that bucket, sized by the bucket's full gradients (not by
its own bytes), and the next bucket's reduce-scatter waits behind it on the stream, on whatever link each uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Region, Step
from hplan.artifacts.buckets import Bucket, region_dtypes, step_buckets
from hplan.artifacts.lookahead import Lookahead, lookahead_steps
from hplan.artifacts.shard import Collective, Sharding, derive
from hplan.artifacts.trace import Trace
from hplan.planner.ranks.collectives import CollectiveCost, World, block_group, collective_cost, strided_group
from hplan.planner.ranks.piece_update import piece_update_bytes
from hplan.planner.schedule import TRANSFER_LATENCY_S, busy_split, event_seconds, with_device_updates
from hplan.planner.search import Finished, Scored, finish

REDUCTIONS = ("scatter", "sync")


@dataclass(frozen=True, kw_only=True, slots=True)
class CommSchedule:
    """How a system issues its collectives (module docstring)."""

    prefetch: int = 0
    overlap_reductions: bool = True
    blocking: bool = False
    bucket_bytes: int = 0
    gather_algorithm: str | None = None
    """Algorithm for weight gathers (None: the hardware's), e.g. MiCS's hierarchical all-gather."""
    settle_next: bool = False
    packed: bool = False
    update_gather_bytes: int | None = None
    """Bucket of the updated-weight gathers (None: `bucket_bytes`; `WHOLE`: all in one call)."""
    one_reduce_stream: bool = False
    """Reductions on one stream, a bucket's reduce-scatter then its all-reduce ([Note: one reduction stream])."""
    lookahead: bool = False
    """Gathers and reductions as far ahead as the plan's room allows (module docstring; needs `regions`)."""


WHOLE = 1 << 62
"""A bucket no step fills: its calls go as one at the end of the pass."""
STREAM = ("reductions",)
"""The bucket key of every reduction under `one_reduce_stream`."""


EXECUTOR = CommSchedule(prefetch=1, overlap_reductions=True, settle_next=True, packed=True, lookahead=True)
"""hplan's executor (executor/ranks/distributed.py, [Note: collectives in flight]): weight gathers issued one step
ahead, reductions asynchronous, each waited where its result is read and at the latest one step later — further
where the plan's windows have room ([Note: collectives ahead within the plan's room]); a step's alike calls packed
into one where the headroom allows ([Note: collective buckets])."""
ONE_STEP_AHEAD = replace(EXECUTOR, lookahead=False)
"""Every gather one step ahead, every reduction settled a step later: the price before the lookahead."""


def call_cost(call: Collective, world: World, algorithm: str = "nccl") -> CollectiveCost:
    """One call on this world's links."""
    group = block_group(call.size, world) if call.stride == 1 else strided_group(call.size, call.stride, world)
    return collective_cost(call.op, call.numel * call.itemsize, group, world, algorithm=algorithm,
                           itemsize=call.itemsize)


def call_seconds(call: Collective, world: World, algorithm: str = "nccl") -> float:
    """Seconds of one call on this world's links."""
    return call_cost(call, world, algorithm).seconds


class _Links:
    """The two link queues and what each call waited on."""

    def __init__(self, world: World, hardware: Hardware, schedule: CommSchedule) -> None:
        self.world, self.schedule = world, schedule
        self.algorithm = hardware.collectives
        self.free = {"intra": 0.0, "inter": 0.0}
        self.busy = {"intra": 0.0, "inter": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
        self._costs: dict[tuple, CollectiveCost] = {}

    def cost(self, call: Collective) -> CollectiveCost:
        algo = self.schedule.gather_algorithm if call.purpose == "gather" and self.schedule.gather_algorithm \
            else self.algorithm
        key = (call.op, call.size, call.stride, call.numel, call.itemsize, algo)
        if key not in self._costs:
            self._costs[key] = call_cost(call, self.world, algo)
        return self._costs[key]

    def run(self, call: Collective, at: float) -> tuple[float, str]:
        """Queue the call's phases from `at`; (end, link charged when compute waits for it)."""
        cost = self.cost(call)
        t, label = at, "intra"
        for link, secs in cost.phases:
            links = ("intra", "inter") if link == "both" else (link,)
            t = max([t] + [self.free[x] for x in links]) + secs
            for x in links:
                self.free[x] = t
                self.busy[x] += secs
            label = "inter" if link in ("both", "inter") else "intra"
        self.busy[call.op] += cost.seconds
        return t, label


def _merge(calls: list[Collective]) -> Collective:
    """One bucket: the calls' buffers as one call of the same kind (the last call's region)."""
    c = calls[-1]
    return Collective.make(c.op, c.purpose, c.region, c.before, c.size, c.stride, sum(x.numel for x in calls),
                           c.itemsize)


def predict_shard_seconds(steps: tuple[Step, ...] | list[Step], sizes: dict[int, int], initial: frozenset[int],
                          seconds: list[float], hardware: Hardware, host_bytes: dict[int, int],
                          grad_of: dict[int, int], *, schedule: CommSchedule = EXECUTOR,
                          dtypes: dict[int, str] | None = None,
                          regions: Sequence[Region] | None = None) -> dict[str, float]:
    """One steady-state iteration's time ("step") and its split ([Note: exposed time]) under `schedule`.
    `dtypes` (region → element type, as hplan.artifacts.buckets.plan_buckets keys them): needed for `packed`;
    without it every call goes alone. `regions` (the plan's): needed for `lookahead`; without them every gather
    and reduction is priced one step ahead."""
    world = World.from_hardware(hardware)
    if schedule.packed and dtypes is not None:
        groups = step_buckets(steps, sizes, initial, hardware.gpu_bytes, hardware.slack_bytes, dtypes)
    else:
        groups = [(tuple(Bucket(calls=(c,)) for c in s.collectives if c.before),
                   tuple(Bucket(calls=(c,)) for c in s.collectives if not c.before)) for s in steps]
    links = _Links(world, hardware, schedule)
    h2d_bps, d2h_bps = hardware.h2d_gbps * 1e9, hardware.d2h_gbps * 1e9
    cpu_bps = hardware.cpu_optimizer_gbps * 1e9
    split = busy_split(steps, sizes, seconds, hardware, host_bytes)
    if not hardware.overlap:  # everything in turn: every second is exposed
        exposed = {"exposed_host": split["h2d"] + split["d2h"], "exposed_intra": 0.0, "exposed_inter": 0.0,
                   "exposed_cpu_optimizer": split["cpu_optimizer"]}
        for early, late in groups:
            for call in (b.merged for b in (*early, *late)):
                cost = links.cost(call)
                links.busy[call.op] += cost.seconds
                for link, secs in cost.phases:
                    exposed["exposed_intra" if link == "intra" else "exposed_inter"] += secs
                    for x in (("intra", "inter") if link == "both" else (link,)):
                        links.busy[x] += secs
        total = sum(split.values()) + sum(links.busy[op] for op in ("all_gather", "reduce_scatter", "all_reduce"))
        return {**split, **links.busy, **exposed, "step": total}
    ahead = lookahead_steps(steps, regions, initial, hardware.gpu_bytes, hardware.slack_bytes, groups) \
        if schedule.lookahead and regions is not None else None
    return _timeline(steps, groups, initial, seconds, host_bytes, grad_of, schedule, links, split,
                     (h2d_bps, d2h_bps, cpu_bps), sizes, ahead)


def _timeline(steps: tuple[Step, ...] | list[Step], groups: list[tuple[tuple[Bucket, ...], tuple[Bucket, ...]]],
              initial: frozenset[int], seconds: list[float], host_bytes: dict[int, int], grad_of: dict[int, int],
              schedule: CommSchedule, links: _Links, split: dict[str, float], rates: tuple[float, float, float],
              sizes: dict[int, int], ahead: Lookahead | None = None) -> dict[str, float]:
    """The overlapped iteration (module docstring): one pass over the steps, issuing each call on its links
    (`ahead`: the executor's lookahead schedule; None: `prefetch` steps ahead, reductions a step later)."""
    h2d_bps, d2h_bps, cpu_bps = rates
    exposed = {"host": 0.0, "intra": 0.0, "inter": 0.0, "cpu_optimizer": 0.0}
    up_free = down_free = compute_end = cpu_free = 0.0
    ready: dict[int, float] = {r: 0.0 for r in initial}
    synced: dict[int, tuple[float, str]] = {}
    written: dict[int, float] = {}
    gathered: dict[int, tuple[float, str]] = {}
    starts: list[float] = []
    buckets: dict[tuple, list[Collective]] = {}
    inflight: list[tuple[int, float, str]] = []
    """(last step it may run beside, end, link) of reductions the executor settles then (`settle_next`)."""
    early: dict[int, list[tuple[float, str]]] = {}  # step → ends of its gather buckets issued ahead (`ahead`)
    sent: set[int] = set()  # id() of those buckets
    n = len(steps)

    def gate(t: int, at: float, only: Iterable[Bucket] | None = None) -> tuple[float, str]:
        """Issue step t's weight gathers (or `only` these) at `at`; when the last is done, and on which link."""
        end, label = at, "intra"
        for bucket in groups[t][0] if only is None else only:
            done, lab = links.run(bucket.merged, max([at] + [ready.get(r, 0.0) for r in bucket.regions]))
            if done >= end:
                end, label = done, lab
        return end, label

    stream_free = 0.0
    """When the one reduction stream is free (`one_reduce_stream`)."""

    def flush(key: tuple, at: float) -> tuple[float, str]:
        """Issue a bucket at `at`: one merged call, or under STREAM its calls of each kind in turn."""
        nonlocal stream_free
        calls = buckets.pop(key)
        kinds: dict[tuple, list[Collective]] = {}
        for c in calls:
            kinds.setdefault((c.op, c.purpose, c.size, c.stride, c.itemsize) if key == STREAM else key, []).append(c)
        end, label = at, "intra"
        for group in kinds.values():
            end, label = links.run(_merge(group), max(end, stream_free) if key == STREAM else at)
            for c in group:
                if c.purpose in REDUCTIONS:
                    synced[c.region] = (end, label)
        if key == STREAM:
            stream_free = end
        return end, label

    for t, (step, secs) in enumerate(zip(steps, seconds)):
        issue = compute_end
        kind = step.event.split(":", 1)[0]
        if buckets and kind != "backward":  # the pass ended: what is left in the buckets goes now
            for key in list(buckets):
                done, label = flush(key, issue)
                if schedule.blocking or not schedule.overlap_reductions:
                    exposed[label] += max(0.0, done - issue)
                    issue = max(issue, done)
        for r in step.writeback:
            down_free = max(down_free, issue, synced.get(r, (0.0, ""))[0]) + TRANSFER_LATENCY_S + sizes[r] / d2h_bps
            written[r] = down_free
        for r in step.fetch:
            up_free = max(up_free, issue) + TRANSFER_LATENCY_S + sizes[r] / h2d_bps
            ready[r] = up_free
        if ahead is not None:  # the buckets not issued ahead go now, at the step's event
            gathered[t] = max([gate(t, issue, [b for b in groups[t][0] if id(b) not in sent])] + early.get(t, []))
        elif t not in gathered:
            gathered[t] = gate(t, issue)
        waits = [(issue, "none"), gathered[t]]
        waits += [(ready.get(r, 0.0), "host") for r in step.needs]
        waits += [synced.get(r, (0.0, "none")) for r in step.reads]
        if schedule.settle_next:
            last_step = kind == "optimizer"
            waits += [(end, lab) for until, end, lab in inflight if last_step or until < t]
            inflight = [x for x in inflight if not (last_step or x[0] < t)]
        start, why = max(waits, key=lambda w: w[0])
        if start > issue and why in exposed:
            exposed[why] += start - issue
        compute_end = start + secs
        starts.append(start)
        nxt_t = t + schedule.prefetch
        if ahead is not None:  # [Note: collectives ahead within the plan's room]: issued as compute starts
            for u, bucket in ahead.issue.get(t, ()):
                early.setdefault(u, []).append(gate(u, start, [bucket]))
                sent.add(id(bucket))
        elif schedule.prefetch and not schedule.blocking and nxt_t < n and nxt_t not in gathered:
            nxt = steps[nxt_t]
            if not any(c.before and (c.region in nxt.fetch or schedule.settle_next and c.purpose == "update_gather")
                       for c in nxt.collectives):  # the executor gathers fresh host-updated pieces at their step
                gathered[nxt_t] = gate(nxt_t, start)
        reducing: dict[int, tuple[float, str]] = {}
        for bucket in groups[t][1]:
            call = bucket.merged
            held = [reducing[r] for r in bucket.regions if r in reducing]
            if schedule.settle_next and held:  # the executor waits for the earlier call
                end, lab = max(held)
                exposed[lab] += max(0.0, end - compute_end)
                compute_end = max(compute_end, end)
            limit = schedule.bucket_bytes if call.purpose in REDUCTIONS else _gather_bucket(schedule, call)
            if limit and schedule.one_reduce_stream and call.purpose in REDUCTIONS:
                buckets.setdefault(STREAM, []).append(call)  # weighed with the step's other reductions below
                continue
            if limit:
                key = (call.op, call.purpose, call.size, call.stride, call.itemsize)
                buckets.setdefault(key, []).append(call)
                if sum(c.numel for c in buckets[key]) * call.itemsize < limit:
                    continue
                done, label = flush(key, compute_end)
            else:
                done, label = links.run(call, compute_end)
                if call.purpose in REDUCTIONS:
                    for r in bucket.regions:
                        synced[r] = (done, label)
                        reducing[r] = (done, label)
                    if schedule.settle_next:
                        inflight.append((ahead.deadline[t] if ahead is not None else t + 1, done, label))
            if schedule.blocking or (call.purpose in REDUCTIONS and not schedule.overlap_reductions):
                exposed[label] += max(0.0, done - compute_end)
                compute_end = max(compute_end, done)
        if STREAM in buckets and _stream_filled(buckets[STREAM], schedule.bucket_bytes):
            done, label = flush(STREAM, compute_end)
            if schedule.blocking or not schedule.overlap_reductions:
                exposed[label] += max(0.0, done - compute_end)
                compute_end = max(compute_end, done)
        for c in step.host_updates:
            g = grad_of.get(c, -1)
            begin = max(issue, cpu_free, written.get(g, 0.0), synced.get(g, (0.0, ""))[0])
            cpu_free = begin + host_bytes[c] / cpu_bps
    for key in list(buckets):
        flush(key, compute_end)
    end = max(compute_end, cpu_free, links.free["intra"], links.free["inter"])
    if end > compute_end:
        tails = {"cpu_optimizer": cpu_free, "inter": links.free["inter"], "intra": links.free["intra"]}
        exposed[max(tails, key=tails.get)] += end - compute_end
    out = {**split, **links.busy, "step": end}
    out.update({f"exposed_{k}": v for k, v in exposed.items()})
    return out


def _stream_filled(calls: list[Collective], limit: int) -> bool:
    """Whether one reduction stream's bucket is full: its reduce-scatters' input (the full gradients of DeepSpeed's
    IPG bucket) reaches `limit` bytes, or, with no reduce-scatter, its calls' own bytes do."""
    scatters = [c for c in calls if c.purpose == "scatter"] or calls
    return sum(c.numel * c.itemsize for c in scatters) >= limit


def _gather_bucket(schedule: CommSchedule, call: Collective) -> int:
    """Bucket bytes of a call that is no reduction: updated-weight gathers only (0: not bucketed)."""
    if call.purpose != "update_gather":
        return 0
    return schedule.bucket_bytes if schedule.update_gather_bytes is None else schedule.update_gather_bytes


def with_collectives(steps: tuple[Step, ...], scored: Scored, sharding: Sharding, ranks: int) -> tuple[Step, ...]:
    """The plan steps with each one's collectives and transient bytes ([Note: plan collectives])."""
    s = scored.structure
    calls, gathered = derive(steps, s.chunks, s.regions, s.optimizer, sharding, ranks)
    return tuple(replace(st, collectives=calls[t], gathered_bytes=gathered[t]) for t, st in enumerate(steps))


def step_seconds(trace: Trace, hardware: Hardware, scored: Scored, done: Finished, steps: tuple[Step, ...],
                 sharding: Sharding) -> dict[str, float]:
    s = scored.structure
    sizes = {r.id: r.bytes for r in s.regions}
    grad_of = {c: regs["grad"] for c, regs in s.by_chunk.items() if "grad" in regs}
    state = piece_update_bytes(s.regions, sharding)
    return predict_shard_seconds(steps, sizes, done.schedule.initial,
                                 with_device_updates(event_seconds(trace, hardware), trace, hardware, steps, state,
                                                     grad_of), hardware, state, grad_of,
                                 dtypes=region_dtypes(s.chunks, s.regions), regions=s.regions)


def shard_step_seconds(trace: Trace, hardware: Hardware, scored: Scored, sharding: Sharding) -> float:
    """Predicted many-rank step of a scored candidate (its schedule with the collectives it implies)."""
    done = finish(trace, hardware, scored)
    return step_seconds(trace, hardware, scored, done, with_collectives(done.steps, scored, sharding,
                                                                       hardware.ranks), sharding)["step"]
