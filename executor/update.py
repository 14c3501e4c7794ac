"""Per-chunk optimizer updates, where the plan runs them, with the user's optimizer as it is configured now.

Each chunk's update is the user's optimizer class stepping over per-parameter views of the chunk's regions (the
fast tier's for a GPU update, the host copies' for a host update), with each user param group's options. That
keeps torch's own semantics: per-parameter step counters, parameters without a gradient skipped (their state
untouched), the group's hyperparameters — copied from the user's `optimizer.param_groups` before every update,
so LR schedulers work unchanged. A ChunkUpdate holds the views, the options and the per-parameter state;
`hplan.executor.batch.UpdateBatch` runs the optimizer calls, one per place and group for all chunks updated at
the same step. Element-wise optimizers
(hplan.optimizers) make per-chunk steps the same arithmetic as one `optimizer.step()`.
Mixed precision: the update runs on the fp32 master with the gradient upcast (unscaled and clipped there, as
the reference does), then every weight of the chunk is rewritten from its master (rounded) — a skipped
parameter's weight already equals its rounded master, so the region's weights are wholly defined afterwards.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from hplan.executor.regions import RegionStore

from hplan.artifacts import Chunk
from hplan.optimizers import initial_state, scalar_tensor, state_spec

IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
"""Group options about how an update runs, not what it computes: hplan chooses them per place."""


def host_options(options: dict[str, Any]) -> dict[str, Any]:
    """Optimizer options for host-side updates: torch's fused CPU kernel unless the user chose an implementation
    (the hybrid optimizer of issue 5; the bench's same-kernel reference uses it too)."""
    out = dict(options)
    if "fused" in out and out.get("foreach") is None and out["fused"] is None:
        out["fused"] = True
    return out


class ChunkUpdate:
    """The optimizer update of one chunk's trainable parameters, on the fast tier ("gpu") or the host ("cpu")."""

    def __init__(self, store: RegionStore, chunk: Chunk, *, where: str, optimizer: torch.optim.Optimizer,
                 opt_name: str, master: bool, group_of: dict[str, int]) -> None:
        self.store, self.chunk, self.where, self.user, self.opt_name = store, chunk, where, optimizer, opt_name
        self.master = master
        self.names = chunk.trainable
        views = "fast_views" if where == "gpu" else "host_views"
        regions = store.by_chunk[chunk.id]

        def view(kind: str, key: Any) -> torch.Tensor:
            return getattr(store.slots[regions[kind]], views)[key]

        self.weight = {n: view("param", n) for n in self.names}
        self.grad = {n: view("grad", n) for n in self.names}
        self.master_of = {n: view("master", n) for n in self.names} if master else {}
        self.work = self.master_of if master else self.weight
        self.groups: dict[int, list[str]] = {}
        for n in self.names:
            self.groups.setdefault(group_of[n], []).append(n)
        self.specs = {n: state_spec(opt_name, optimizer.param_groups[group_of[n]]) for n in self.names}
        self.state_views = {n: {s: view("state", (n, s)) for s in self.specs[n].tensors} for n in self.names}
        self.options = {g: self._options(g, [self.work[n] for n in names]) for g, names in self.groups.items()}
        """Per user param group: the constructor options an update runs with (the place's implementation)."""
        self.group_of = {n: g for g, names in self.groups.items() for n in names}
        self.states: dict[str, dict[str, Any]] = {n: {} for n in self.names}
        """Per parameter: its optimizer state as torch keeps it, per-element tensors being region views."""
        self.written_regions = tuple(regions[k] for k in ("param", "master", "state") if k in regions) \
            if where == "gpu" else ()
        """The fast-tier regions a GPU-placed update writes (dirty afterwards); none for a host update."""
        self.written_slots = tuple(store.slots[r] for r in self.written_regions)
        self.slots = tuple(store.slots[r] for r in regions.values())
        """The Slots of written_regions and of every region of the chunk (the update's checks, no lookups)."""
        self.settling: set[str] = set(self.names)
        """Parameters whose optimizer state may still hold a per-element tensor outside the regions (torch creates
        SGD's momentum at the first update): keep_lazy_state runs for these only, and drops a name once every state
        tensor is its region's view; adopt() puts them all back."""
        self.started: set[str] = set()
        """Parameters with optimizer state, as torch would have it: updated once, or adopted from the user."""
        self.shown: set[str] = set()
        """Parameters whose work tensor's `.grad` is their gradient view now ([Note: gradients left on the work
        tensors] in hplan.executor.batch); the others' is None."""

    def _options(self, group: int, works: list[torch.Tensor]) -> dict[str, Any]:
        """The group's options for this place, checked by constructing the optimizer once over the views."""
        cls = type(self.user)
        accepted = inspect.signature(cls).parameters
        options = {k: v for k, v in self.user.param_groups[group].items()
                   if k in accepted and k != "params" and k not in IMPLEMENTATION}
        options |= {k: self.user.param_groups[group].get(k) for k in IMPLEMENTATION if k in accepted}
        if self.where == "cpu":
            options = host_options(options)
        try:
            cls(works, **options)
        except (RuntimeError, ValueError):  # no fused kernel for this optimizer or device: torch's default one
            options = {**options, "fused": None} if "fused" in options else options
        return options

    # -- state ----------------------------------------------------------------------------------------
    def adopt(self) -> None:
        """Fill the regions' current copies from the user's optimizer state (a previous block, a loaded
        state_dict, Adagrad's eager init), or start fresh as torch would; a master starts as the weights."""
        store = self.store
        for g, names in self.groups.items():
            group = self.options[g]
            for n in names:
                p = store.params[n]
                work = self.work[n]
                given = self.user.state.get(p)
                host = {s: store.current(self._region("state"), (n, s)) for s in self.specs[n].tensors}
                if self.master:
                    source = given.get("master") if given else None
                    store.current(self._region("master"), n).copy_(
                        source if source is not None else store.current(self._region("param"), n))
                state = initial_state(self.opt_name, group, work, host)
                self.started.discard(n)
                if given:
                    self._take(n, given, state, host, group)
                    self.started.add(n)
                views = {s: self.state_views[n][s] for s in self.specs[n].tensors if s in state}
                self.states[n].clear()
                self.states[n].update({**state, **views})
                self.settling.add(n)

    def _take(self, n: str, given: dict[str, Any], state: dict[str, Any], host: dict[str, torch.Tensor],
              group: dict[str, Any]) -> None:
        for key, value in given.items():
            if key == "master" or not torch.is_tensor(value):
                continue
            if key in host:
                if value.dtype != host[key].dtype and value.dtype.itemsize < host[key].dtype.itemsize:
                    warnings.warn(f"optimizer state {key} of {n} was cast to {value.dtype} (load_state_dict outside "
                                  "an hplan.attach block casts state to the parameter's dtype); load it inside the "
                                  "block to keep full precision", stacklevel=4)
                host[key].copy_(value.reshape(host[key].shape))
                state[key] = host[key]
            else:
                state[key] = scalar_tensor(float(value), self.work[n].device, group)

    def _region(self, kind: str) -> int:
        return self.store.by_chunk[self.chunk.id][kind]

    def materialize(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The state torch would hold for this chunk's parameters, as fresh tensors keyed by parameter."""
        out = {}
        for g, names in self.groups.items():
            for n in names:
                if n not in self.started:
                    continue
                state = self.states[n]
                entry: dict[str, Any] = {}
                for key, value in state.items():
                    if key in self.state_views[n]:
                        entry[key] = self.store.current(self._region("state"), (n, key)).detach().clone().cpu()
                    elif torch.is_tensor(value):
                        entry[key] = value.detach().clone()
                if self.master:
                    entry["master"] = self.store.current(self._region("master"), n).detach().clone().cpu()
                out[self.store.params[n]] = entry
        return out

    # -- the update -----------------------------------------------------------------------------------
    def fp32_grads(self, written: set[str], inv_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Master-precision gradients of the written parameters (unscaled with the loss scale's inverse, as
        torch.amp.GradScaler does), computed from the current copies."""
        out = {}
        found = torch.zeros((), dtype=torch.float32)
        for n in self.names:
            if n in written:
                g = self.store.current(self._region("grad"), n).float()
                if inv_scale is not None:
                    torch._amp_foreach_non_finite_check_and_unscale_([g], found.to(g.device), inv_scale.to(g.device))
                out[n] = g
        return out

    def copy_masters(self) -> None:
        """Every weight of the chunk := its master, rounded (a skipped step needs it too: the plan has dropped
        the weights a mixed-precision update rewrites)."""
        with torch.no_grad():
            for n in self.names:
                self.weight[n].copy_(self.master_of[n])

    def keep_lazy_state(self, n: str) -> None:
        """State torch created from the first gradient (SGD momentum with dampening) moves into the region."""
        state = self.states[n]
        settled = True
        for key, view in self.state_views[n].items():
            value = state.get(key)
            if value is not None and value is not view:
                view.copy_(value)
                state[key] = view
            settled = settled and state.get(key) is view
        if settled:
            self.settling.discard(n)
