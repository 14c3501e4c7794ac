"""PlanRun's updates and the global checks before them: the plan's host and fast-tier updates as UpdateBatch
calls (phased per chunk where a host tier stages them), clipping by global norm, loss scaling and the
non-finite checks. A mixin of hplan.executor.runtime.PlanRun, kept apart to keep that file readable; see
[Note: executor step] there for when each runs."""

from __future__ import annotations

from typing import Any

import torch
from hplan.executor.batch import UpdateBatch
from hplan.executor.regions import RegionStore
from hplan.executor.scale import LossScale
from hplan.executor.update import ChunkUpdate

from hplan.artifacts import Plan, Step
from hplan.errors import HplanError


class UpdateSteps:
    """Update and check methods of PlanRun (which sets every attribute declared here)."""

    plan: Plan
    store: RegionStore | None
    updates: dict[int, ChunkUpdate]
    host: Any
    """hplan.executor.tiers.TieredStore or NoHostTier."""
    written: set[str]
    clips: list[torch.Tensor]
    master: bool
    loss_scale: LossScale | None
    nonfinite: str
    skipped: int
    _batches: dict[tuple[int, ...], UpdateBatch]
    _updated: set[int]
    _names: dict[int, str]

    def _update(self, chunks: tuple[int, ...] | list[int], step: Step) -> None:
        """The updates of these chunks, together (one optimizer call per place and param group). With a host
        tier each host update runs in its own plan phase (its regions staged, then written back), so those
        chunks are stepped one at a time; the same element-wise arithmetic either way."""
        for c in chunks:
            if self.updates[c].where == "cpu" and set(self.store.by_chunk[c].values()) & self.store.resident():
                raise HplanError(f"plan step {step.index} updates chunk {c} on the host while it is on the fast tier")
        phased = sorted(c for c in chunks if self.host.phased and self.updates[c].where == "cpu")
        for c in phased:
            self.host.begin_update(step, c)
            self._step_batch([c], step)
            self.host.end_update(step, c)
        rest = [c for c in chunks if c not in phased]
        if rest:
            self._step_batch(rest, step)

    def _step_batch(self, chunks: list[int], step: Step) -> None:
        """Check (unless deferred) and step these chunks' updates as one UpdateBatch; fast-tier regions dirty."""
        if self.nonfinite != "ignore" and not self.plan.defer_updates:
            self._check_finite(chunks, step)
        key = tuple(chunks)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = UpdateBatch([self.updates[c] for c in chunks])
        batch.step(self.written, inv_scale=self.loss_scale.inverse() if self.loss_scale else None,
                   clip=tuple(self.clips) if self.master else ())
        self._updated.update(chunks)
        for c in chunks:
            if self.updates[c].where == "gpu":
                for kind in ("param", "master", "state"):
                    rid = self.store.region(c, kind)
                    if rid is not None:
                        self.store.mark_dirty(rid)

    def _optimizer_updates(self, step: Step) -> None:
        """The optimizer step: deferred host updates and every fast-tier update, after the global checks."""
        skip = False
        if self.plan.defer_updates and (self.loss_scale is not None or self.nonfinite != "ignore"):
            skip = self._any_nonfinite()
            if skip and self.loss_scale is None and self.nonfinite == "stop":
                raise HplanError("a gradient is not finite (inf or NaN); stopping before any update of this step")
        if self.loss_scale is not None:
            self.loss_scale.update(skip)
        if skip:
            self.skipped += 1
            for c in sorted(step.host_updates):  # the host tier still stages and writes as planned
                self.host.begin_update(step, c)
                self.host.end_update(step, c)
            for c, update in self.updates.items():
                if update.where == "gpu" and self.master:
                    update.copy_masters()
                    self.store.mark_dirty(self.store.region(c, "param"))
            return
        chunks = sorted(step.host_updates) + sorted(c for c, u in self.updates.items() if u.where == "gpu")
        if chunks:
            self._update(chunks, step)

    # -- clipping, loss scaling, non-finite values ----------------------------------------------------
    def manages(self, params: list[torch.Tensor]) -> bool:
        store = self.store
        return store is not None and any(id(p) in self._names and self._names[id(p)] in store.chunk_of for p in params)

    def clip_grad_norm_(self, max_norm: float, *, params: list[torch.Tensor] | None = None, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Plain PyTorch's clip_grad_norm_ over the gradients written this iteration (the given parameters'),
        computed where the gradients are; returns the total norm. With a master recipe the norm is of the fp32
        master gradients (unscaled) and the clip applies to them at the update, as the reference does."""
        if self._updated:
            raise HplanError(f"clip_grad_norm_ was called after chunks {sorted(self._updated)[:3]} were already "
                             "updated this iteration; re-trace with max_grad_norm set (Workload.max_grad_norm, or "
                             "Workload.defer_updates=True to only read the norm) so the plan defers updates until the "
                             "norm is known")
        wanted = [self._names[id(p)] for p in (params or self.store.params.values()) if id(p) in self._names]
        names = [n for n in wanted if n in self.written]
        grads = self._grads(names)
        if not grads:
            return torch.zeros(())
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise HplanError(f"the total norm of the gradients is {float(total)}; it cannot be clipped")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self.master:
            self.clips.append(coef)
        else:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef.to(g.device))
        return total

    def _grads(self, names: list[str]) -> list[torch.Tensor]:
        """Current gradients in the given order: region views, or fp32 master gradients (unscaled, clipped by
        earlier calls) with a master recipe."""
        store = self.store
        if not self.master:
            return [store.current(store.region(store.chunk_of[n], "grad"), n) for n in names]
        inv = self.loss_scale.inverse() if self.loss_scale else None
        out = []
        for n in names:
            g = self.updates[store.chunk_of[n]].fp32_grads({n}, inv)[n]
            for c in self.clips:
                g.mul_(c.to(g.device))
            out.append(g)
        return out

    def _any_nonfinite(self, names: list[str] | None = None) -> bool:
        """Is any written gradient inf or NaN? One norm per gradient, in one foreach call (a finite gradient's
        norm overflows only beyond 1e38 in fp32 or bf16, far past any gradient worth stepping with)."""
        grads = self._grads(sorted(self.written) if names is None else names)
        if not grads:
            return False
        norms = torch._foreach_norm(grads)
        return not bool(torch.isfinite(torch.stack([n.float().cpu() for n in norms])).all())

    def _check_finite(self, chunks: tuple[int, ...] | list[int], step: Step) -> None:
        names = [n for c in chunks for n in self.updates[c].names if n in self.written]
        if self._any_nonfinite(names):
            raise HplanError(f"a gradient is not finite (inf or NaN) at plan step {step.index} ({step.event}); "
                             "stopping before updating with it")

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (fp16-mixed), or the loss itself; call `.backward()` on it."""
        return loss if self.loss_scale is None else self.loss_scale.scale(loss)
