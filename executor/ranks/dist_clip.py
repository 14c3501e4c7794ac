"""DistRun's loop habits between backward() and optimizer.step(): clipping by global norm and by value over the
gradient pieces spread across ranks. A mixin of hplan.executor.ranks.distributed.DistRun, kept apart to keep that
file readable (as hplan.executor.gradients is for PlanRun).

[Note: the global norm over ranks] `clip_grad_norm_` returns torch's total norm of the global batch's gradients and
scales every rank's pieces by torch's coefficient, clamp(max_norm / (total + 1e-6), max=1), before any update — as
FSDP2 clips its DTensor shards. After the iteration's last backward (the previous step's reductions issued now,
every one waited, ÷N applied), rank r holds the final, reduced gradient of its optimizer piece of every trainable
chunk ([Note: shard layout] in hplan.artifacts.shard); the OS pieces partition each chunk and the N/OS replicas of a
piece hold equal values. So:
- OS = 1 (G = 1: DDP-like, every rank holds every gradient, bitwise alike: [Note: replicated verdicts]): each rank
  computes torch's own formula — a norm per parameter, in the caller's order, then the norm of those — and no
  collective is made; the total is plain PyTorch's bit for bit where the gradients are;
- OS > 1: each rank sums |g|^p over the elements of its pieces (per-piece norms raised to p, summed in float64),
  only the first replica (ranks r < OS) counts its sum, so no element counts twice; one all_reduce (SUM; MAX of the
  per-piece maxima for p = inf, where replicas may count twice) over every rank, then the p-th root. Padding lies
  outside every parameter's view and frozen parameters have no piece, so neither counts. The sum's order differs
  from torch's: the total differs by rounding (float32 ulps).
A non-finite gradient makes the total NaN or inf on every rank alike, and the clip multiplies by that coefficient as
torch does (`error_if_nonfinite` raises on every rank at once: they hold the same total). With a master recipe the
norm is of the fp32 gradients and the clip is recorded and applied to them at the update (hplan.executor.gradients'
Clip), as in one process. `clip_grad_value_` clamps each rank's pieces: element-wise, no collective.
A call before the iteration's last backward (the gradients not yet reduced) is refused, as is one after a chunk
was updated (a plan without deferred updates).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from hplan.executor.gradients import Clip, _subset, apply_clips, clip_coefficient
from hplan.executor.ranks.shard_store import ShardStore
from hplan.executor.tripwires import FIX
from hplan.executor.update import ChunkUpdate

from hplan.artifacts import Plan, Step
from hplan.errors import HplanError

EARLY = ("{what} on many ranks needs the iteration's final gradients: call it after the last backward() of the "
         "iteration, right before optimizer.step()")


class DistClip:
    """Clipping methods of DistRun (which sets every attribute declared here)."""

    plan: Plan
    store: ShardStore
    tier: Any
    rank: int
    world: int
    master: bool
    cursor: int
    written: set[str]
    updates: dict[int, ChunkUpdate]
    clips: list[Clip]
    flight: Any
    _names: dict[int, str]
    _updated: set[int]
    _opt_index: int | None
    _previous: Step | None

    def _final_pieces(self, params: list[torch.Tensor] | None, what: str) -> tuple[list[str], list[str]]:
        """(the written parameters asked for, in the caller's order; those of them with a piece on this rank), once
        every reduction of the iteration is in ([Note: the global norm over ranks])."""
        if self._updated:
            raise HplanError(f"{what} was called after chunks {sorted(self._updated)[:3]} were already updated this "
                             f"iteration; {FIX}")
        if self.cursor != self._opt_index:
            raise HplanError(EARLY.format(what=what))
        if self._previous is not None:  # the last backward step's reductions, as the optimizer event would start them
            self._close_window()  # type: ignore[attr-defined]
            self._finish_previous(self.plan.steps[self.cursor])  # type: ignore[attr-defined]
        self.flight.settle_all()  # every reduction waited, ÷N applied
        store = self.store
        wanted = [self._names[id(p)] for p in (params or store.params.values()) if id(p) in self._names]
        names = [n for n in wanted if n in self.written]
        mine = [n for n in names if store.chunk_of[n] in self.updates and n in self.updates[store.chunk_of[n]].names]
        return names, mine

    def _piece(self, name: str) -> torch.Tensor:
        """This rank's current gradient piece of `name` (1-D): the region's view, or its fp32 copy with the
        iteration's clips applied (a master recipe)."""
        store = self.store
        u = self.updates[store.chunk_of[name]]
        rid = store.region(u.chunk.id, "grad")
        if self.master:
            g = u.fp32_grads({name}, None)[name]
            apply_clips(self.clips, name, g)
            return g
        if store.slots[rid].state.on_fast_tier:
            self.tier.wait(store.slots[rid].fast)
        return store.current(rid, name)

    def _host_memory(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self._memory_of(self.updates[self.store.chunk_of[name]].where)  # type: ignore[attr-defined]

    def clip_grad_norm_(self, max_norm: float, *, params: list[torch.Tensor] | None = None, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every rank's pieces: the total norm ([Note: the global norm over
        ranks]), every piece scaled by the same coefficient before any update."""
        p = float(norm_type)
        if not (p > 0 or p == math.inf):
            raise HplanError(f"clip_grad_norm_ with norm_type={norm_type} on many ranks: use a positive norm_type "
                             "(2.0, or inf)")
        names, mine = self._final_pieces(params, "clip_grad_norm_")
        norms = []
        for n in mine:  # a master recipe's fp32 copy made, measured and dropped one parameter at a time
            with self._host_memory(n):
                norms.append(torch.linalg.vector_norm(self._piece(n), p).to(self.tier.device))
        if self.plan.sharding.OS == 1:  # every rank holds every gradient, alike: torch's formula, no collective
            total = torch.linalg.vector_norm(torch.stack(norms), p) if norms else \
                torch.zeros((), device=self.tier.device)
        else:
            counted = norms if self.rank < self.plan.sharding.OS or p == math.inf else []
            dtype = norms[0].dtype if norms else torch.float32
            if p == math.inf:
                local = torch.stack(counted).max().double() if counted else torch.zeros((), dtype=torch.float64)
            else:
                local = torch.stack([x.double() ** p for x in counted]).sum() if counted else \
                    torch.zeros((), dtype=torch.float64)
            local = local.to(self.tier.device).reshape(1)
            dist.all_reduce(local, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM)
            total = (local[0] if p == math.inf else local[0] ** (1.0 / p)).to(dtype)
        coef = clip_coefficient(total, max_norm, error_if_nonfinite)
        if self.master:
            self.clips.append(Clip(_subset(names, self.written), lambda g: g.mul_(coef.to(g.device))))
        else:
            self._edit(mine, lambda g: g.mul_(coef.to(g.device)))
        return total

    def clip_grad_value_(self, clip_value: float, *, params: list[torch.Tensor] | None = None) -> None:
        """torch.nn.utils.clip_grad_value_ on this rank's pieces (element-wise: the same on the whole gradient)."""
        names, mine = self._final_pieces(params, "clip_grad_value_")
        value = float(clip_value)
        if self.master:
            self.clips.append(Clip(_subset(names, self.written), lambda g: g.clamp_(-value, value)))
        else:
            self._edit(mine, lambda g: g.clamp_(-value, value))

    def _edit(self, names: list[str], op: Any) -> None:
        """An in-place edit of these pieces; a resident region is marked dirty so an eviction keeps the edit."""
        with torch.no_grad():
            for n in names:
                op(self._piece(n))
                self.store.mark_dirty(self.store.region(self.store.chunk_of[n], "grad"))

    def check_user_unscale(self) -> None:
        raise HplanError("a GradScaler on many ranks: the gradients live in the plan's shards, not in `.grad`, and "
                         "fp16 loss scaling is not supported on many ranks yet; train in bf16-mixed or fp32 without "
                         "a GradScaler")
