"""DistRun's events: each hook event checked against the plan's next step, and the step done with its collectives
around it ([Note: distributed executor step] in hplan.executor.ranks.distributed): the previous step's `after`
calls and ÷N, this step's moves and `before` calls, weight gathers issued one step ahead ([Note: collectives in
flight] in hplan.artifacts.shard) or further where the plan has room (hplan.artifacts.lookahead). A mixin of
hplan.executor.ranks.distributed.DistRun, kept apart to keep that file readable (as hplan.executor.events is for
PlanRun).
"""

from __future__ import annotations

import torch
from hplan.executor.ranks.collectives import Pending
from hplan.executor.ranks.dist_comm import PlanComm
from hplan.executor.ranks.in_flight import InFlight
from hplan.artifacts.lookahead import Lookahead
from hplan.executor.ranks.shard_store import ShardStore
from hplan.executor.regions import move_regions
from hplan.executor.step_table import Moves
from hplan.executor.update import ChunkUpdate

from hplan.artifacts import Plan, Step
from hplan.artifacts.buckets import Bucket
from hplan.artifacts.replay import OPTIMIZER_EVENT
from hplan.errors import HplanError

_unwatched = torch._C._DisableTorchDispatch
"""The same guard as hplan.executor.ranks.shard_store's: views and in-place work the CPU twin's probe never counts."""


def _divide(pieces: list[torch.Tensor], world: int) -> None:
    """A synced gradient's ÷N in place, one operator for all its pieces, unseen by the probe (it allocates nothing)."""
    with _unwatched():
        torch._foreach_div_(pieces, world)


REDUCTIONS = ("scatter", "sync")
"""Purposes of the calls issued asynchronously after their step ([Note: collectives in flight])."""


EVAL_REFUSED = ("an evaluation forward (under torch.no_grad()) inside a many-rank hplan.attach block is not "
                "supported yet: end the block, evaluate, and attach again (the weights and the optimizer state carry "
                "over exactly)")
"""An evaluation between steps ran the plan's training forward (its gathers included) and the next iteration then
failed on "event mismatch ... expected 'backward:lm_head', got 'forward:model.embed_tokens'; re-trace and
re-plan", a fix that cannot help (Qwen2, 2 gloo ranks). Refused at its first forward, before anything moved, naming
what works: [Note: optimizer state across many-rank blocks] in hplan.executor.ranks.full_state."""


class DistEvents:
    """Event and collective methods of DistRun (which sets every attribute declared here)."""

    plan: Plan
    store: ShardStore
    comm: PlanComm
    flight: InFlight
    world: int
    cursor: int
    buckets: list[tuple[tuple[Bucket, ...], tuple[Bucket, ...]]]
    updates: dict[int, ChunkUpdate]
    _moves: list[Moves]
    _opt_index: int | None
    _previous: Step | None
    _zeroed: bool
    _mark: tuple[int, int, int, int, int]
    _scattered: set[int]
    _gathered: set[int]
    _synced_after: dict[int, list[int]]
    _ahead: Lookahead

    def on_event(self, kind: str, module: str) -> None:
        actual, steps = f"{kind}:{module}", self.plan.steps
        if self.cursor >= len(steps):
            raise HplanError(f"event {actual!r} after the plan's last step; call optimizer.step() once per iteration")
        step = steps[self.cursor]
        if kind == "forward" and not torch.is_grad_enabled() and (self.cursor == 0 or step.event != actual):
            raise HplanError(EVAL_REFUSED)
        if step.event != actual:
            raise HplanError(f"event mismatch at plan step {step.index}: expected {step.event!r}, got {actual!r}; "
                             "re-trace and re-plan this workload")
        if self.cursor == 0 and not self._zeroed:
            raise HplanError("a new iteration began without optimizer.zero_grad() after the last optimizer.step(); "
                             "zero gradients every step")
        if self.cursor == 0:
            self._mark = self._counters()
        if self.store.reads.cache:
            self.store.reads.forget()
        self.flight.settle_older(self.cursor)
        self._close_window()
        self._finish_previous(step)
        self._do_step(step)
        self.cursor += 1

    def _finish_previous(self, following: Step) -> None:
        """The previous step's `after` calls and ÷N, then free the full weight copies it gathered — except those
        the following step reads again: a run of consecutive steps reading a chunk shares one gather
        ([Note: plan collectives])."""
        step, self._previous = self._previous, None
        if step is None:
            return
        self._after(step)
        reads = set(following.reads) if following.event != OPTIMIZER_EVENT else set()
        keep = {c for c in self._gathered if self.store.region(c, "param") in reads}
        for c in sorted(self._gathered - keep):
            self.store.hide_weights(c)
            self.store.close_full(self.store.gather_buf[c])
        self._gathered &= keep

    def _after(self, step: Step) -> None:
        """The step's `after` calls, reductions asynchronous ([Note: collectives in flight]); a call on a region
        whose previous reduction is still running (a sync after its scatter) waits for it first."""
        until = self._ahead.deadline[step.index]
        for bucket in self.buckets[step.index][1]:
            self._call(bucket, async_op=bucket.first.purpose in REDUCTIONS, until=until)
        views: dict[Pending | None, list[torch.Tensor]] = {}
        for r in self._synced_after.get(step.index, ()):
            chunk = self.store.slots[r].region.chunk
            lay = self.store.layouts[chunk]
            at = self.store.pieces.storage_offset(self.store.sharding, chunk, "grad")
            with _unwatched():  # views and an in-place ÷N: nothing for the CPU twin's probe to count
                views.setdefault(self.flight.latest(r), []).append(self.store.typed(r)[at:at + lay.piece])
        for held, pieces in views.items():  # ÷N once the last reduction of each region is in: one operator per call
            if held is not None:
                held.then(lambda v=pieces: _divide(v, self.world))
            else:
                with torch.no_grad():
                    _divide(pieces, self.world)
        self._sample()

    def _call(self, bucket: Bucket, *, async_op: bool = False, until: int | None = None) -> Pending:
        """One bucket's call (the plan's call itself when it is alone), after the reductions still running on its
        regions."""
        chunks = [self.store.slots[r].region.chunk for r in bucket.regions]
        for r in bucket.regions:
            self.flight.settle(r)
        if len(bucket.calls) == 1:
            pending = self.comm.run(bucket.first, self.store, first_scatter=chunks[0] not in self._scattered,
                                    async_op=async_op)
        else:
            pending = self.comm.run_bucket(bucket.calls, self.store, first=lambda c: c not in self._scattered,
                                           async_op=async_op)
        purpose = bucket.first.purpose
        for r, chunk in zip(bucket.regions, chunks):
            if purpose == "scatter":
                self._scattered.add(chunk)
            elif purpose == "gather":
                self._gathered.add(chunk)
            self.flight.reduction(r, self.cursor if until is None else until, pending)
        self._sample()
        return pending

    def _prefetch(self, e: int) -> None:
        """Issue the weight gathers planned ahead at step e ([Note: collectives ahead within the plan's room] in
        hplan.artifacts.lookahead) whose shards are resident now: every rank decides alike from the plan."""
        store = self.store
        for _, bucket in self._ahead.issue.get(e, ()):
            if not all(store.slots[r].state.on_fast_tier for r in bucket.regions):
                continue
            if len(bucket.calls) == 1:
                pending = self.comm.run(bucket.first, store, first_scatter=False, async_op=True)
            else:
                pending = self.comm.run_bucket(bucket.calls, store, first=lambda c: False, async_op=True)
            for r in bucket.regions:
                self.flight.gather_ahead(store.slots[r].region.chunk, pending)
        self._sample()

    def _do_step(self, step: Step) -> None:
        store = self.store
        moves = self._moves[self.cursor]
        if self.flight.reductions:
            for rid in (*(r for r, _ in moves.evict), *moves.fetch, *moves.alloc):
                self.flight.settle(rid)
        move_regions(store, moves)
        store.require(step.needs, f"plan step {step.index} ({step.event})")
        for bucket in self.buckets[self.cursor][0]:
            chunks = [store.slots[r].region.chunk for r in bucket.regions]
            if bucket.first.purpose == "gather" and all([self.flight.take_gather(c) for c in chunks]):
                self._gathered.update(chunks)  # issued ahead, as one bucket
                continue
            self._call(bucket)
            if bucket.first.purpose == "update_gather":
                store.mark_dirty(bucket.first.region)
        if step.event == OPTIMIZER_EVENT:
            self.flight.settle_all()
            self._update(sorted(step.host_updates) + sorted(c for c, u in self.updates.items() if u.where == "gpu"),
                         step)
            self._after(step)
        else:
            self._update(step.host_updates, step)
            self._previous = step
            if self.cursor in self._ahead.issue:
                self._prefetch(self.cursor)
        self._sample()
