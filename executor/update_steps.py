"""PlanRun's updates: the plan's host and fast-tier updates as UpdateBatch calls, phased per chunk where a host
tier stages them, and the optimizer step's global checks (loss scale, non-finite gradients, a skipped step). A
mixin of hplan.executor.runtime.PlanRun, kept apart to keep that file readable; see [Note: executor step] there
for when each runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from hplan.executor.batch import UpdateBatch
from hplan.executor.gradients import Clip
from hplan.executor.overlap import UpdateWorker
from hplan.executor.scale import LossScale
from hplan.executor.speculate import Speculation
from hplan.executor.state import RegionState
from hplan.executor.tripwires import EagerWatch
from hplan.executor.update import ChunkUpdate

from hplan.artifacts import Plan, Step
from hplan.artifacts.replay import OPTIMIZER_EVENT
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.executor.measure import WindowMeter

_PROFILER = torch.autograd.profiler
_HOST, _DIRTY = RegionState.HOST, RegionState.RESIDENT_DIRTY


class UpdateSteps:
    """Update methods of PlanRun (which sets every attribute declared here)."""

    plan: Plan
    store: Any
    updates: dict[int, ChunkUpdate]
    host: Any
    """hplan.executor.tiers.host.TieredStore or NoHostTier."""
    written: set[str]
    clips: list[Clip]
    master: bool
    loss_scale: LossScale | None
    nonfinite: str
    skipped: int
    watch: EagerWatch | None
    meter: WindowMeter | None
    """The run's non-model probe's meter, None without one."""
    _batches: dict[tuple[int, ...], UpdateBatch]
    _split: dict[tuple[int, ...], list[tuple[UpdateBatch, str]]]
    _fast_updates: list[int]
    """The chunks updated on the fast tier (at the optimizer step), sorted."""
    _updated: set[int]
    _skip_next: bool
    worker: UpdateWorker | None
    speculation: Speculation | None

    def _update(self, chunks: tuple[int, ...] | list[int], step: Step) -> None:
        """The updates of these chunks, together (one optimizer call per place and param group). With a host
        tier each host update runs in its own plan phase (its regions staged, then written back), so those
        chunks are stepped one at a time; the same element-wise arithmetic either way."""
        updates = self.updates
        for c in chunks:
            if updates[c].where == "cpu":
                for slot in updates[c].slots:
                    if slot.state is not _HOST:
                        raise HplanError(f"plan step {step.index} updates chunk {c} on the host while it is on the "
                                         "fast tier")
        phased = sorted(c for c in chunks if updates[c].where == "cpu") if self.host.phased else []
        for c in phased:
            with self._memory_of("cpu"):  # type: ignore[attr-defined]  (GradientOps)
                self.host.begin_update(step, c)
            self._step_batch([c], step)
            with self._memory_of("cpu"):  # type: ignore[attr-defined]  (GradientOps)
                self.host.end_update(step, c)
        rest = [c for c in chunks if c not in phased] if phased else chunks
        if rest:
            self._step_batch(rest, step)
        watch = self.watch
        if watch is not None and step.event != OPTIMIZER_EVENT:
            if watch.hyper is None:
                watch.updated_early(len(chunks))
            else:  # updated_early's count, inline: the options were read at this iteration's first early update
                watch.early += len(chunks)

    def _step_batch(self, chunks: list[int], step: Step) -> None:
        """Check (unless deferred) and step these chunks' updates, one UpdateBatch per place; fast-tier regions
        dirty. Host updates run as host work ([Note: host work off the fast tier]): their fp32 gradients are host
        memory, which the plan counts in the host phase, not in the fast tier's budget. A backward step's host
        updates go to the worker thread when the run overlaps them ([Note: overlapped host updates])."""
        parts = self._split.get(tuple(chunks))  # _parts' cache, read inline
        if parts is None:
            parts = self._parts(chunks)
        check = self.nonfinite != "ignore" and not self.plan.defer_updates
        if self.worker is not None and step.event.startswith("backward:") and not self.host.phased \
                and self.loss_scale is None and not self.clips and (not parts or parts[-1][1] == "cpu"):
            self._step_beside(chunks, step, check)
            return
        if check:
            self._check_finite(chunks, step)  # type: ignore[attr-defined]  (GradientOps)
        inv_scale = self.loss_scale.inverse() if self.loss_scale else None
        clip = tuple(self.clips) if self.master else ()
        for batch, where in parts:
            if self.meter is None:  # _memory_of's no-probe case (no context), inline
                if getattr(_PROFILER, "_is_profiler_enabled", True):
                    batch.step(self.written, inv_scale=inv_scale, clip=clip)
                else:  # batch.step's own case without a profiler, without its frame (about 27 an iteration)
                    batch._step(self.written, inv_scale, clip)
                continue
            with self._memory_of(where):  # type: ignore[attr-defined]  (GradientOps)
                batch.step(self.written, inv_scale=inv_scale, clip=clip)
        self._updated.update(chunks)
        for c in chunks:
            for slot in self.updates[c].written_slots:  # store.mark_dirty, inline
                if slot.state is not _HOST:
                    slot.state = _DIRTY

    def _parts(self, chunks: list[int] | tuple[int, ...]) -> list[tuple[UpdateBatch, str]]:
        """The UpdateBatch of these chunks' host updates ("cpu") and of their fast-tier ones ("gpu"), the parts
        that exist, host first; the same chunk sets recur every iteration, so they are split once."""
        key = tuple(chunks)
        parts = self._split.get(key)
        if parts is None:
            parts = self._split[key] = [
                (self._batch(part), where) for where in ("cpu", "gpu")
                if (part := [c for c in chunks if (self.updates[c].where == "cpu") == (where == "cpu")])]
        return parts

    def _batch(self, chunks: list[int]) -> UpdateBatch:
        key = tuple(chunks)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = UpdateBatch([self.updates[c] for c in chunks])
        return batch

    def _step_beside(self, chunks: list[int], step: Step, check: bool) -> None:
        """[Note: overlapped host updates] in hplan.executor.overlap: the host updates of `chunks` (every one
        host-placed) on the worker thread, the same body as in line; this thread goes on with the backward."""
        assert self.worker is not None
        batch = self._batch(chunks)
        written = frozenset(self.written)  # these chunks' gradients are final: later writes are refused

        def work() -> None:
            if check:
                self._check_finite(chunks, step)  # type: ignore[attr-defined]  (GradientOps)
            batch.step(written)

        self._beside(work, batch.regions)
        self._updated.update(chunks)

    def _beside(self, work: Callable[[], None], regions: frozenset[int]) -> None:
        """`work` on the worker thread; the first one queued in a backward has the backward's end wait for all."""
        assert self.worker is not None
        if not self.worker.busy:
            torch.autograd.Variable._execution_engine.queue_callback(self._drain_updates)
        self.worker.submit(work, regions)

    def _drain_updates(self) -> None:
        """Wait for the worker's updates (the end of a backward, an event that is not a backward step, a move of
        a region they use)."""
        if self.worker is not None and self.worker.busy:
            self.worker.drain()

    def _optimizer_updates(self, step: Step) -> None:
        """The optimizer step: deferred host updates and every fast-tier update, after the global checks. A step
        the loop skipped (or one with non-finite gradients) updates nothing; the host tier still stages and
        writes as planned."""
        skip = by_user = self._skip_next
        self._skip_next = False
        if not skip and self.plan.defer_updates and (self.loss_scale is not None or self.nonfinite != "ignore"):
            checked = self.speculation.checked() if self.speculation is not None else set()
            names = sorted(self.written - checked) if checked else None  # the worker read the rest already
            skip = self._any_nonfinite(names)  # type: ignore[attr-defined]  (GradientOps)
            if skip and self.loss_scale is None and self.nonfinite == "stop":
                at = self.training_step()  # type: ignore[attr-defined]  (PlanRun)
                raise HplanError(f"a gradient is not finite (inf or NaN) at step {at}; stopped before any update of "
                                 "this step")
        done = self.speculation.keep(self.iteration, skip) if self.speculation is not None else frozenset()
        """Host chunks already updated beside the backward ([Note: speculative fp16 updates])."""
        if self.loss_scale is not None and not by_user:
            self.loss_scale.update(skip)
        if skip:
            self.skipped += 1
            for c in sorted(step.host_updates):
                self.host.begin_update(step, c)
                self.host.end_update(step, c)
            for c, update in self.updates.items():
                if update.where == "gpu" and self.master:
                    update.copy_masters()
                    self.store.mark_dirty(self.store.region(c, "param"))
            return
        chunks = sorted(c for c in step.host_updates if c not in done) + self._fast_updates
        if chunks:
            self._update(chunks, step)
