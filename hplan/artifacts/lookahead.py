"""How far ahead a rank issues each weight gather, and how long each gradient reduction may run, within the room
the plan leaves below its budget.

[Note: collectives ahead within the plan's room] [Note: collectives in flight] (hplan.artifacts.shard) issues a
gather one step ahead and waits a reduction at the latest when the step after its own begins: the memory the plan
counts for them. On a model whose events differ a lot in cost that overlap is short exactly where it matters: the
gather of the next block of chunks goes out during a layer norm, the reduce-scatter of a block's gradients must
end beside one small backward step, and the rank waits on the wire (2 gloo ranks at 2/2/2 on gpt:small: most of
the time hplan's step spent beyond FSDP2's). FSDP2 issues the next module group's all-gather when the current
group's forward begins and lets reduce-scatters run until the next one needs the stream. So, where the plan's
windows have room for the extra full copy or full gradient, the executor does the same:
- a gather bucket needed at step t is issued at the earliest step e < t - 1 such that, at every step in (e, t],
  its regions are neither moved nor host-updated nor the subject of another call before it, its chunks are not
  read (their full buffers are closed when e begins), e is not before the previous gather step (the run being
  read now: at most one run ahead, as FSDP2), and every window in [e, t - 2] has room for the bucket's full
  copies and staging after what is already reserved there; otherwise one step ahead, as before;
- a reduction bucket issued after step i's event (it runs in window i + 1) may stay in flight through window
  d ≥ i + 1 when every window in (i + 1, d] has room for its full gradients and staging (counted twice: the
  full buffer and a staging copy the call may make), d before the next step that reads, moves or calls on its
  regions (it would be waited there anyway) and before the optimizer step (which waits for everything). Calls
  still go out in the plan's order on every rank, so several may be in flight on one group: gloo and NCCL run
  them in turn. Where gradients are written back a few steps after their last write ([Note: deferred gradient
  write-back] in hplan.planner.ranks.defer), a reduction thus runs beside the next few backward steps, and a
  rank whose peer is descheduled for a step keeps computing instead of waiting at the next event (at `--gpu-mem
  min` on gpt:small, the README's 2-rank example: each all-reduce had one layer norm's backward to hide behind).
The room is the plan's own (hplan.artifacts.buckets.step_totals: regions + non-model + gathered + slack below the
budget, less the buckets' staging), so every measured window stays within the budget the plan certifies, and
every rank decides alike from the plan alone. It is decided here, from the plan's steps alone (no torch), because
the executor (hplan.executor.ranks.distributed) and the many-rank step-time model (hplan.planner.ranks.shard_time,
`CommSchedule.lookahead`) both take it from `lookahead_steps`: the plan prices the order the ranks run.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Iterable, Sequence

from hplan.artifacts.buckets import Bucket, step_totals
from hplan.artifacts.plan import Plan, Region, Step
from hplan.artifacts.replay import OPTIMIZER_EVENT
from hplan.artifacts.shard import prefetchable

Buckets = list[tuple[tuple[Bucket, ...], tuple[Bucket, ...]]]
"""Per step, (before-event buckets, after-event buckets): hplan.artifacts.buckets.step_buckets."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Lookahead:
    """Per plan step: the gather buckets issued at its end (with the step that reads them), and how long the
    reductions issued after it may run."""

    issue: dict[int, tuple[tuple[int, Bucket], ...]]
    """Step e → (t, bucket) gathers issued at the end of step e's event, waited at step t."""
    deadline: dict[int, int]
    """Step i → the last window its `after` reductions may run in (i + 1 when there is no room for more)."""


def _bytes(bucket: Bucket) -> int:
    return sum(c.numel * c.itemsize for c in bucket.calls) + bucket.staging_bytes


def lookahead(plan: Plan, buckets: Buckets) -> Lookahead:
    """The schedule of [Note: collectives ahead within the plan's room] of a many-rank plan."""
    return lookahead_steps(plan.steps, plan.regions, plan.initial_resident, plan.hardware.gpu_bytes,
                           plan.hardware.slack_bytes, buckets)


def lookahead_steps(steps: Sequence[Step], regions: Iterable[Region], initial: Iterable[int], budget: int,
                    slack: int, buckets: Buckets) -> Lookahead:
    """The schedule of [Note: collectives ahead within the plan's room] from the plan's parts (steps with their
    collectives, regions, initially resident regions, budget and slack) and the steps' buckets."""
    steps, regions = tuple(steps), tuple(regions)
    n = len(steps)
    opt = next((t for t, s in enumerate(steps) if s.event == OPTIMIZER_EVENT), None)
    room = [budget - x for x in step_totals(steps, {r.id: r.bytes for r in regions}, initial, slack)]
    for t, (early, late) in enumerate(buckets):  # the buckets' staging, where [Note: collective buckets] puts it
        for w in (t - 1, t):
            if w >= 0:
                room[w] -= sum(b.staging_bytes for b in early)
        room[min(t + 1, n - 1)] -= sum(b.staging_bytes for b in late)
    chunk_of = {r.id: r.chunk for r in regions}
    weights = {r.chunk: r.id for r in regions if r.kind == "param"}
    touched = [set(s.evict) | set(s.fetch) | set(s.alloc) for s in steps]
    reads_at = [set(s.reads) if s.event != OPTIMIZER_EVENT else set() for s in steps]
    issue: dict[int, list[tuple[int, Bucket]]] = {}
    previous_gather = 0
    for t in range(n):
        for bucket in buckets[t][0]:
            if bucket.first.purpose != "gather":
                continue
            if prefetchable(t, opt) and _ahead_at_t(bucket, steps[t], touched[t]):
                e = _earliest(t, bucket, previous_gather, steps, touched, reads_at, room, chunk_of, weights)
                issue.setdefault(e, []).append((t, bucket))
        if any(b.first.purpose == "gather" for b in buckets[t][0]):
            previous_gather = t
    deadline: dict[int, int] = {}
    for i, (_, late) in enumerate(buckets):
        mine = [b for b in late if b.first.purpose in ("scatter", "sync")]
        need = sum(2 * _bytes(b) for b in mine)
        regions = {r for b in mine for r in b.regions}
        used = next((k for k in range(i + 2, n) if regions & (touched[k] | reads_at[k])
                     or any(c.region in regions for c in steps[k].collectives)), n)
        last = min(used - 1, opt - 1) if opt is not None else i + 1
        d = i + 1
        while need and d + 1 <= last and room[d + 1] >= need:
            d += 1
            room[d] -= need
        deadline[i] = d
    return Lookahead(issue={e: tuple(v) for e, v in issue.items()}, deadline=deadline)


def _ahead_at_t(bucket: Bucket, step: Step, touched: set[int]) -> bool:
    """The one-step-ahead conditions of [Note: collectives in flight] at the step itself: its regions not moved
    there, and no call before the gather on its region there (an updated-piece gather)."""
    if any(r in touched for r in bucket.regions):
        return False
    before = [c for c in step.collectives if c.before]
    return all(not any(c.region == call.region for c in before[:before.index(call)]) for call in bucket.calls)


def _earliest(t: int, bucket: Bucket, floor: int, steps: tuple[Step, ...], touched: list[set[int]],
              reads_at: list[set[int]], room: list[int], chunk_of: dict[int, int], weights: dict[int, int]) -> int:
    """The earliest step ≥ `floor` the gather may be issued at (t - 1 at the latest); reserves its room."""
    regions = set(bucket.regions)
    chunks = {chunk_of[r] for r in regions}
    params = {weights[c] for c in chunks}
    need, e = _bytes(bucket), t - 1
    while e - 1 >= floor:
        k = e  # moving the issue from step e to e - 1 adds window e - 1 and step e's event in between
        if regions & touched[k] or params & reads_at[k] or params & reads_at[k - 1] or \
                chunks & set(steps[k].host_updates) or chunks & set(steps[k - 1].host_updates) or \
                any(c.region in regions for c in steps[k].collectives) or \
                any(c.region in regions and not c.before for c in steps[k - 1].collectives) or room[k - 1] < need:
            break
        e -= 1
    for w in range(e, t - 1):
        room[w] -= need
    return e
