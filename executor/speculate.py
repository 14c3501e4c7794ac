"""fp16 host updates beside the backward, speculatively: run as soon as a chunk's gradient is final, rolled back
when the step turns out to be skipped.

[Note: speculative fp16 updates] With dynamic loss scaling every update waits for `optimizer.step()`, since only
then is it known whether any gradient overflowed (GradScaler skips the whole step then). That leaves the host's
update work serial after the backward. As SuperOffload does (speculation, then validation), a plan whose host
updates are deferred only by the loss scale runs each host-placed chunk's update on the worker thread
([Note: overlapped host updates]) at the first backward step after its gradient's last write, once all its
regions are on the host: the chunk's own gradients are checked first (an overflow there updates nothing), then
its master, weight and state regions and its scalar state are copied aside and the update runs with this
step's loss scale, the same `UpdateBatch` call the optimizer step would make. At `optimizer.step()`, after the
global check plain PyTorch's GradScaler makes:
- no overflow, and nothing the updates read changed (hyperparameters, a speculated chunk's gradients, clipping
  asked for after backward, a region moved off the host): the speculated chunks are done, the rest update as
  before; the same element-wise arithmetic on the same inputs, bit for bit the deferred run;
- otherwise every speculated chunk is put back from its copies, bytes and scalars, and the step runs as the
  deferred run would: skipped (overflow, or a step the loop skipped), or all updates redone.
A backward of a loss that did not go through `run.scale(loss)` (an fp32 loop's habit) speculates nothing: each
chunk's update starts in the iteration's last micro-step, when every micro-step should have called `scale()`, so
fewer calls by then leave every update to `optimizer.step()`, which refuses the iteration as without speculation
([Note: an unscaled fp16 backward]) before any weight changed (before, every host chunk was updated with gradients
2**16 times too small on the worker, and rolled back only when the loop went on or the block ended).
The copies are host memory (the chunk's master, weights and state once more), kept between iterations, and a
copy costs a memcpy of those bytes per update, so only a run with the worker speculates: in line it would add
work to the backward and save none. It is opt-in (`attach(..., speculate=True)`): on a loaded 2-core machine
(load average 6.5-8.5) gpt:small at its minimum fp16 budget stepped 1.3-1.5x slower with it than deferred, even
with the step's overflow check skipping the chunks the worker checked (`checked`): the worker had no free core,
and its copies cost more than they hid. Why, measured on a quiet machine, is next.
"""

from __future__ import annotations

from typing import Any

import torch
from hplan.executor.state import RegionState
from hplan.executor.tripwires import EagerWatch

from hplan.artifacts.replay import OPTIMIZER_EVENT
from hplan.errors import HplanError

_HOST = RegionState.HOST


class Speculation:
    """Which chunks a run updates early under a loss scale, where, and the copies that roll them back."""

    def __init__(self, run: Any) -> None:
        self.run = run
        plan, store = run.plan, run.store
        final = next(s for s in plan.steps if s.event == OPTIMIZER_EVENT)
        self.at: dict[int, list[int]] = {}
        """Plan step index → the host chunks whose update may start at that step's event."""
        for c in final.host_updates:
            if run.updates[c].where != "cpu":
                continue
            rid = store.region(c, "grad")
            writes = [i for i, m in enumerate(run._moves) if rid in m.writes]
            start = writes[-1] + 1 if writes else None
            if start is not None and start < len(plan.steps) and plan.steps[start].event.startswith("backward:"):
                self.at.setdefault(start, []).append(c)
        self.done: list[int] = []
        """Chunks updated speculatively this iteration (their copies hold the state before)."""
        self.copies: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """Per chunk: (region's host tensor, its copy) for master, weights and state; allocated once."""
        self.scalars: dict[int, dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]]] = {}
        self.started: dict[int, set[str]] = {}
        self.settling: dict[int, set[str]] = {}
        self.versions: dict[int, tuple[torch.Tensor, int]] = {}
        """Per speculated chunk: its gradient region's host tensor and version when the update read it."""
        self.overflow = False
        self.watch = EagerWatch(run.optimizer)

    def at_step(self, index: int) -> None:
        """The event of plan step `index` began: hand its chunks' updates to the worker."""
        run = self.run
        if run._scaled < run.plan.accumulate:
            return  # an unscaled backward: nothing is speculated, optimizer.step() refuses it (see the Note)
        for c in self.at.get(index, ()):
            update = run.updates[c]
            if self.overflow or any(slot.state is not _HOST for slot in update.slots):
                continue  # left to the optimizer step, as without speculation
            names = [n for n in update.names if n in run.written]
            batch = run._batch([c])
            grad = run.store.slots[run.store.region(c, "grad")].host
            self.versions[c] = (grad, grad._version)
            self.watch.updated_early(1)
            self.done.append(c)
            written, inverse = frozenset(run.written), run.loss_scale.inverse()

            def work(c: int = c, update: Any = update, names: list[str] = names, batch: Any = batch,
                     written: frozenset[str] = written, inverse: torch.Tensor = inverse) -> None:
                if run._first_nonfinite(names) is not None:
                    self.overflow = True
                    self.done.remove(c)
                    return
                self._save(c, update)
                batch.step(written, inv_scale=inverse)

            run._beside(work, batch.regions)

    def _save(self, c: int, update: Any) -> None:
        store = self.run.store
        pairs = self.copies.get(c)
        if pairs is None:
            regions = store.by_chunk[c]
            pairs = self.copies[c] = [(store.slots[regions[k]].host, torch.empty_like(store.slots[regions[k]].host))
                                      for k in ("param", "master", "state") if k in regions]
        for host, copy in pairs:
            copy.copy_(host)
        self.scalars[c] = {n: (dict(update.states[n]), {k: v.clone() for k, v in update.states[n].items()
                                                        if torch.is_tensor(v) and k not in update.state_views[n]})
                           for n in update.names}
        self.started[c] = set(update.started)
        self.settling[c] = set(update.settling)

    def keep(self, iteration: int, skip: bool) -> frozenset[int]:
        """At the optimizer step, after the worker finished and the global check (`skip`: the step is skipped):
        the chunks whose speculated updates stand (see the Note); the others are rolled back. A run that clips
        speculates no more (its updates would be redone every step)."""
        if not self.done:
            self.end()
            return frozenset()
        run = self.run
        if run.clips:
            self.at = {}
        valid = not skip and not self.overflow and not run.clips
        for c in self.done:
            grad, version = self.versions[c]
            valid = valid and grad._version == version and all(s.state is _HOST for s in run.updates[c].slots)
        try:
            self.watch.check_hyper(iteration)
        except HplanError:
            valid = False
        self.watch.reset()
        if not valid:
            self.rollback()
            return frozenset()
        done = frozenset(self.done)
        self.end()
        return done

    def checked(self) -> set[str]:
        """Written parameters of the speculated chunks whose gradients the worker found finite and which have not
        changed since: the step's overflow check need not read them again."""
        out: set[str] = set()
        for c in self.done:
            grad, version = self.versions[c]
            if grad._version == version:
                out.update(n for n in self.run.updates[c].names if n in self.run.written)
        return out

    def abandon(self) -> None:
        """The optimizer's or the model's state is read or loaded in the middle of an iteration: plain PyTorch has
        updated nothing yet, so the speculated updates are rolled back and the step makes them as without
        speculation."""
        if self.run.worker.busy:
            self.run.worker.drain()
        if self.done:
            self.rollback()

    def rollback(self) -> None:
        """Every speculated chunk back to its state before its update (bytes and scalars)."""
        for c in self.done:
            for host, copy in self.copies[c]:
                host.copy_(copy)
            update = self.run.updates[c]
            for n, (entries, scalars) in self.scalars[c].items():
                state = update.states[n]
                state.clear()
                state.update(entries)
                for k, value in scalars.items():
                    state[k].copy_(value)
            update.started.clear()
            update.started.update(self.started[c])
            update.settling.clear()
            update.settling.update(self.settling[c])
        self.end()

    def end(self) -> None:
        self.done, self.versions, self.overflow = [], {}, False
        self.scalars.clear()
        self.watch.reset()
