"""DistRun's updates: this rank's pieces updated at the plan's steps, one optimizer call per place and param group,
and the non-finite verdicts the ranks agree on before anything of an iteration is updated ([Note: ranks stop
together] in hplan.executor.ranks.dist_comm; [Note: replicated verdicts] in hplan.executor.ranks.distributed). A
mixin of hplan.executor.ranks.distributed.DistRun, kept apart to keep that file readable (as
hplan.executor.update_steps is for PlanRun).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from hplan.executor.batch import UpdateBatch
from hplan.executor.gradients import Clip, first_nonfinite, nonfinite_message
from hplan.executor.measure import WindowMeter
from hplan.executor.ranks.dist_comm import stop_together
from hplan.executor.ranks.in_flight import InFlight
from hplan.executor.ranks.shard_store import ShardStore
from hplan.executor.update import ChunkUpdate

from hplan.artifacts import Step
from hplan.artifacts.replay import OPTIMIZER_EVENT
from hplan.errors import HplanError


class DistUpdates:
    """Update methods of DistRun (which sets every attribute declared here)."""

    store: ShardStore
    flight: InFlight
    tier: Any
    rank: int
    world: int
    nonfinite: str
    meter: WindowMeter | None
    updates: dict[int, ChunkUpdate]
    written: set[str]
    iteration: int
    first_step: int
    _updated: set[int]
    _batches: dict[tuple[int, ...], UpdateBatch]
    _agreement: tuple[Any, torch.Tensor, str | None] | None
    _replicated_grads: bool
    master: bool
    clips: list[Clip]

    def agree_before_update(self, problem: str | None) -> None:
        """[Note: ranks stop together], without the wait: this rank's verdict (`problem` in words, or None) goes out
        in an all-reduce now, and the run waits for it only before the iteration first updates anything (the first
        host update, else the optimizer step), where every rank raises the lowest finder's words or all go on.
        hplan run checks each loss this way (hplan.executor.ranks.dist_train): the backward runs beside the call
        instead of behind a rendezvous per step, and nothing is updated or saved either way."""
        self._settle_agreement()
        flag = torch.tensor([self.rank if problem is not None else self.world], device=self.tier.device)
        self._agreement = (dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True), flag, problem)

    def _settle_agreement(self) -> None:
        if self._agreement is None:
            return
        work, flag, problem = self._agreement
        self._agreement = None
        work.wait()
        finder = int(flag)
        if finder != self.world:
            message = [problem]
            dist.broadcast_object_list(message, src=finder)
            raise HplanError(str(message[0]))

    def _update(self, chunks: tuple[int, ...] | list[int], step: Step) -> None:
        """These chunks' updates together: one optimizer call per place and param group (UpdateBatch)."""
        self._settle_agreement()  # before anything of this iteration is updated
        self._updated.update(chunks)
        for c in chunks:  # a host update reads the chunk's reduced gradient
            self.flight.settle(self.store.region(c, "grad"))
        mine = tuple(c for c in chunks if c in self.updates)  # a piece that is padding only has no update
        parts = [(part, where) for where in ("cpu", "gpu")
                 if (part := tuple(c for c in mine if (self.updates[c].where == "cpu") == (where == "cpu")))]
        if self.nonfinite == "stop" and (chunks or step.event == OPTIMIZER_EVENT):
            # every rank reaches this point at this step (the plan's chunks, not this rank's pieces, decide)
            problem = None
            for part, where in parts:  # every part checked before any is stepped
                with self._memory_of(where):
                    problem = problem or self._nonfinite_problem(part, step)
            if not self._replicated_grads:
                stop_together(problem, rank=self.rank, world=self.world, device=self.tier.device)
            elif problem is not None:  # every rank found it ([Note: replicated verdicts])
                raise HplanError(problem)
        for part, where in parts:  # host updates' temporaries are host memory ([Note: host work off the fast tier])
            batch = self._batches.get(part)
            if batch is None:
                batch = self._batches[part] = UpdateBatch([self.updates[c] for c in part])
            with self._memory_of(where):
                batch.step(self.written, clip=tuple(self.clips) if self.master else ())
        for c in mine:
            if self.updates[c].where == "gpu":
                for kind in ("param", "master", "state"):
                    rid = self.store.region(c, kind)
                    if rid is not None:
                        self.store.mark_dirty(rid)

    def _memory_of(self, where: str) -> contextlib.AbstractContextManager[None]:
        """Where an update's temporaries live: the host's memory for a host update, else the fast tier's."""
        if where == "cpu" and self.meter is not None:
            return self.meter.host_work()
        return contextlib.nullcontext()

    def _nonfinite_problem(self, chunks: tuple[int, ...], step: Step) -> str | None:
        """The first of this rank's gradient pieces about to be used that holds an inf or NaN, in words naming the
        parameter, the training step and this rank — or None. Each rank checks only its own pieces; the ranks then
        agree in one collective ([Note: ranks stop together]), so all stop at this step with the same message
        before any rank updates anything of it. A rank stopping alone would leave the others to fail in their next
        collective ("connection closed by peer") or wait out the timeout. Only under nonfinite="stop": "ignore"
        makes no extra collective, as plain PyTorch."""
        names, grads = [], []
        for c in chunks:
            u = self.updates[c]
            written = [n for n in u.names if n in self.written]
            names += written
            grads += list(u.fp32_grads(set(written), None).values()) if u.master else [u.grad[n] for n in written]
        bad = first_nonfinite(names, grads)
        if bad is None:
            return None
        seen = 0 if self._replicated_grads else self.rank  # [Note: replicated verdicts]: every rank sees it
        return nonfinite_message(bad, self.first_step + self.iteration, step, f" on rank {seen}")
