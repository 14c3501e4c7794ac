"""State that leaves or enters a running plan through the ordinary APIs: optimizer and model state dicts.

Inside a block the optimizer's state and the offloaded weights live in regions; the parameters of an evicted
chunk are one-element placeholders. So that a checkpoint taken inside the block (`torch.save(model.state_dict())`,
`optimizer.state_dict()`) holds what plain PyTorch would, and a rollback (`load_state_dict`) lands where the plan
reads it, `StateSync` answers these calls from the regions:
- optimizer.state_dict(): the state materialized from regions (fresh tensors), released again after;
- optimizer.load_state_dict(): the loaded state adopted into regions;
- model.state_dict(): each managed parameter's current value, copied (any module of the model);
- model.load_state_dict(): managed parameters written into their regions (host copy, and fast copy when
  resident), the rest (buffers) loaded by torch; strict keys are checked as torch checks them. Refused with a
  master recipe (the fp32 masters would disagree) and in the middle of an iteration.

[Note: state dict copies in host memory] The copies these answers make of what lives in host memory (an evicted
weight, the optimizer's state and masters, which `materialize` returns on the host) are host memory: on CUDA the
allocator never sees them, so on the CPU twin they run in `WindowMeter.host_work` ([Note: host work off the fast
tier] in hplan.executor.measure). Counted, a checkpoint saved after an evaluation forward (whose last window stays
open until training resumes) put Mixtral's least plan 217 KB over its budget, exit 2, where the same save after a
step passed (the gap between iterations is not guarded). A resident weight's copy is the fast tier's, counted.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hplan.errors import HplanError
from hplan.executor.state import RegionState

if TYPE_CHECKING:
    from hplan.executor.regions import RegionStore
    from hplan.executor.update import ChunkUpdate


class StateSync:
    """Mixin of PlanRun: optimizer and model state dicts read from and written to the regions."""

    optimizer: torch.optim.Optimizer
    updates: dict[int, ChunkUpdate]
    store: RegionStore | None
    master: bool
    cursor: int
    _loaded: dict[str, Any] | None
    host: Any
    """hplan.executor.tiers.host.TieredStore or NoHostTier."""
    speculation: Any
    """hplan.executor.speculate.Speculation or None."""

    # -- optimizer -------------------------------------------------------------------------------------
    def sync_state(self) -> None:
        """Fill the user's optimizer.state with the state torch would hold (fresh tensors)."""
        if self.speculation is not None:  # [Note: speculative fp16 updates]
            self.speculation.abandon()
        self.optimizer.state.clear()
        with self._host_copies(True):  # [Note: state dict copies in host memory]
            for update in self.updates.values():
                self.optimizer.state.update(update.materialize())

    def release_state(self) -> None:
        """state_dict post-hook: the returned dict holds the fresh tensors; the optimizer holds none again."""
        self.optimizer.state.clear()

    def stash_loaded_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """load_state_dict pre-hook: keep the dict as given (torch then casts state to each parameter's dtype)."""
        self._loaded = state_dict

    def adopt_loaded_state(self) -> None:
        """load_state_dict post-hook: the loaded state (full precision, from the stashed dict) moves into regions."""
        loaded, self._loaded = self._loaded, None
        if self.speculation is not None:
            self.speculation.abandon()
        if loaded is not None:
            by_index = {i: p for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
            for index, state in loaded.get("state", {}).items():
                p = by_index.get(int(index))
                if p is not None:
                    self.optimizer.state[p] = dict(state)
        for update in self.updates.values():
            self.host.stage_chunk(update.chunk.id)
            update.adopt()
            self.host.settle_chunk(update.chunk.id)
        self.optimizer.state.clear()

    # -- model -----------------------------------------------------------------------------------------
    def model_state_hooks(self, model: nn.Module, stack: contextlib.ExitStack) -> None:
        """Hooks on every module owning a managed parameter, removed with the stack."""
        managed = self.store.params
        by_id = {id(p): name for name, p in managed.items()}
        for module in model.modules():
            local = {key: by_id[id(p)] for key, p in module._parameters.items() if p is not None and id(p) in by_id}
            if not local:
                continue
            loaded: list[str] = []
            stack.callback(module.register_state_dict_pre_hook(self._quiet_detach).remove)
            stack.callback(module.register_state_dict_post_hook(self._state_dict_hook(local)).remove)
            stack.callback(module.register_load_state_dict_pre_hook(self._load_pre_hook(local, loaded)).remove)
            stack.callback(module.register_load_state_dict_post_hook(_forget_missing(loaded)).remove)

    def _quiet_detach(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """torch's state_dict detaches each parameter, an offloaded one too: not a read of its value (the post-hook
        answers with the value), so no copy ([Note: offloaded parameter reads] in hplan.executor.offloaded)."""
        self.store.quiet[0] = True

    def _state_dict_hook(self, local: dict[str, str]) -> Any:
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            self.store.quiet[0] = False
            if self.speculation is not None:
                self.speculation.abandon()
            store = self.store
            for key, name in local.items():
                if prefix + key in state_dict:
                    slot = store.param_slot(name)
                    with self._host_copies(slot.state is RegionState.HOST):  # [Note: state dict copies in host ...]
                        state_dict[prefix + key] = store.param_value(name)

        return hook

    def _host_copies(self, on_host: bool) -> contextlib.AbstractContextManager[None]:
        meter = getattr(self, "meter", None)
        return meter.host_work() if on_host and meter is not None else contextlib.nullcontext()

    def _load_pre_hook(self, local: dict[str, str], loaded: list[str]) -> Any:
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                 missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
            loaded.clear()
            for key, name in local.items():
                value = state_dict.get(prefix + key)
                if value is None:
                    continue
                if self.host.phased:
                    raise HplanError("model.load_state_dict() inside an attach block with a disk tier is not "
                                     "supported (its regions are staged by the plan's phases); load before the block")
                if self.master:
                    raise HplanError("model.load_state_dict() inside an attach block with a mixed-precision recipe "
                                     "would leave the fp32 master weights behind; load the weights before the block")
                if self.cursor != 0:
                    raise HplanError("model.load_state_dict() in the middle of an iteration (after its forward "
                                     "began); load weights before the forward or after optimizer.step()")
                shape = tuple(self.store.current_shape(name))
                if tuple(value.shape) != shape:
                    error_msgs.append(f"size mismatch for {prefix + key}: copying a param with shape "
                                      f"{tuple(value.shape)} from checkpoint, the shape in current model is {shape}.")
                    continue
                self.store.write_param(name, value)
                del state_dict[prefix + key]
                loaded.append(prefix + key)

        return hook


def _forget_missing(loaded: list[str]) -> Any:
    """load_state_dict post-hook: the parameters written into regions are not missing (torch saw no key)."""

    def hook(module: nn.Module, incompatible: Any) -> None:
        for key in loaded:
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)
        loaded.clear()

    return hook
