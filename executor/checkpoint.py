"""Full training state, saved atomically after each step and restored exactly.

Saved: every chunk's host copy and, for resident chunks, its fast-tier contents (so dirty data is
never lost), the per-chunk optimizer step counts, model buffers, RNG states and the global step.
Parameters, gradients, master weights and moments all live in chunks, so this is everything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from hplan.executor.runtime import PlanRun

from hplan.artifacts import atomic_path
from hplan.errors import HplanError

STATE_FILE = "state.pt"


def save_checkpoint(directory: str | os.PathLike[str], run: PlanRun, *, global_step: int) -> None:
    """Write DIR/state.pt through a temp file and a rename: a kill leaves the previous one intact."""
    store = run.store
    state: dict[str, Any] = {
        "global_step": global_step,
        "fingerprint": run.plan.fingerprint,
        "host": {cid: s.host.clone() for cid, s in store.slots.items()},
        "fast": {cid: s.fast.detach().cpu().clone() for cid, s in store.slots.items() if s.state.on_fast_tier},
        "opt_steps": {pid: u.step_count().clone() for pid, u in run.updates.items() if u.step_count() is not None},
        "buffers": {name: b.detach().cpu().clone() for name, b in run.model.named_buffers()},
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    Path(directory).mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(directory) / STATE_FILE) as tmp:
        torch.save(state, tmp)


def load_checkpoint(directory: str | os.PathLike[str], run: PlanRun) -> int:
    """Restore `run` (already entered) from DIR; returns the global step to continue from."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise HplanError(f"no checkpoint at {path}: run once with --checkpoint {directory} before --resume")
    state = torch.load(path, weights_only=True)
    if state["fingerprint"] != run.plan.fingerprint:
        raise HplanError(f"checkpoint {path} was written for another workload or plan; resume with the same ones")
    store = run.store
    if set(state["fast"]) != store.resident():
        raise HplanError(f"checkpoint {path} was written with another plan (other resident chunks); use the same plan")
    with torch.no_grad():
        for cid, slot in store.slots.items():
            slot.host.copy_(state["host"][cid])
        for cid, data in state["fast"].items():
            with torch.autograd._unsafe_preserve_version_counter(store.slots[cid].fast):
                store.slots[cid].fast.copy_(data)
        for pid, count in state["opt_steps"].items():
            run.updates[pid].step_count().copy_(count)
        buffers = dict(run.model.named_buffers())
        for name, value in state["buffers"].items():
            buffers[name].copy_(value)
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["global_step"])
