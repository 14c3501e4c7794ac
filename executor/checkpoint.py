"""Full training state, saved after each step and restored exactly, in the model's own terms.

Saved by parameter name, not by plan region: weights (their current values wherever they are), the optimizer
state torch would hold (moments, step counters, and the fp32 master with a mixed recipe), buffers, the loss
scale, the LR scheduler, RNG states and the global step. A resume loads it into a fresh model and optimizer
before the plan starts, which then adopts it as it adopts any optimizer state — so a checkpoint resumes under
another plan (another budget) too, and is useful without hplan.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from hplan.executor.runtime import PlanRun
from torch import nn

from hplan.artifacts import Plan, atomic_path
from hplan.errors import HplanError

STATE_FILE = "state.pt"


def save_checkpoint(directory: str | os.PathLike[str], run: PlanRun, *, global_step: int, scheduler: Any = None) -> None:
    """Write DIR/state.pt through a temp file and a rename: a kill leaves the previous one intact."""
    store = run.store
    names = {id(p): n for n, p in store.params.items()}
    optimizer = {names[id(p)]: state for u in run.updates.values() for p, state in u.materialize().items()}
    state: dict[str, Any] = {
        "global_step": global_step,
        "fingerprint": run.plan.fingerprint,
        "params": {n: store.current(store.region(store.chunk_of[n], "param"), n).detach().cpu().clone()
                   for n in store.params},
        "buffers": {name: b.detach().cpu().clone() for name, b in run.model.named_buffers()},
        "optimizer": optimizer,
        "loss_scale": run.loss_scale.state_dict() if run.loss_scale is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    Path(directory).mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(directory) / STATE_FILE) as tmp:
        torch.save(state, tmp)


def load_checkpoint(directory: str | os.PathLike[str], plan: Plan) -> dict[str, Any]:
    """Read DIR/state.pt, refusing one written for another model or precision."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise HplanError(f"no checkpoint at {path}: run once with --checkpoint {directory} before --resume")
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # a damaged file: say which, never a traceback
        raise HplanError(f"checkpoint {path} cannot be read ({type(exc).__name__}); it is damaged — delete it or "
                         "resume from another checkpoint") from None
    mine, theirs = plan.fingerprint, state.get("fingerprint", {})
    if (mine.get("params_sha"), mine.get("precision")) != (theirs.get("params_sha"), theirs.get("precision")):
        raise HplanError(f"checkpoint {path} was written for another model or precision; resume with the same ones")
    return state


def restore(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """Load a checkpoint into a fresh model, optimizer and scheduler; returns the global step to continue from."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["params"].items():
            params[name].copy_(value)
        buffers = dict(model.named_buffers())
        for name, value in state["buffers"].items():
            buffers[name].copy_(value)
    optimizer.state.clear()
    for name, entry in state["optimizer"].items():
        optimizer.state[params[name]] = dict(entry)
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if state.get("cuda_rng"):
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["global_step"])
