"""hplan on N ranks, as a user's loop, for the tests and the bench: rank bodies (module level: spawned ranks
import them) and the plans they run. See tests/dist_reference.py for the references they are compared with."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hplan
from hplan.artifacts import Hardware, Plan, Trace
from hplan.artifacts.shard import Sharding
from hplan.executor.ranks.launch import RankInfo
from hplan.specs import load_workload


def plan_at(trace: Trace, factors: tuple[int, int, int], *, ranks: int = 2, room: float = 0.3,
            solver: str = "auto", chunk_bytes: int | None = None) -> Plan:
    """A plan for `ranks` CPU ranks under the factors, at the smallest per-rank budget any schedule needs plus
    `room` × this rank's model data: below full residency for room < 1, so the plan offloads."""
    from hplan.planner import PlanOptions, default_slack
    from hplan.planner.presets import make_hardware
    from hplan.planner.ranks.shard import make_shard_plan, min_gpu_sharded

    f = Sharding(P=factors[0], G=factors[1], OS=factors[2])
    probe = make_hardware("cpu", gpu_bytes=1, gpus_per_node=ranks, slack_bytes=default_slack(trace))
    floor = min_gpu_sharded(trace, probe, f)
    full = make_shard_plan(trace, _with_bytes(probe, 10**12), PlanOptions(chunk_bytes=0), factors=f)
    model_bytes = sum(r.bytes for r in full.regions)
    plan = make_shard_plan(trace, _with_bytes(probe, floor + int(room * model_bytes)),
                           PlanOptions(solver=solver, chunk_bytes=chunk_bytes), factors=f)
    assert plan.summary.feasible, plan.summary.bottleneck
    return plan


def _with_bytes(hardware: Hardware, gpu_bytes: int) -> Hardware:
    from dataclasses import replace

    return replace(hardware, gpu_bytes=gpu_bytes)


def train_attached(info: RankInfo, spec: str, plan: Plan, steps: int, *, first: int = 0,
                   checkpoint: tuple[str, str] | None = None, overrides: dict[str, Any] | None = None,
                   between: Callable[[nn.Module], float | None] | None = None) -> dict[str, Any]:
    """A user's plain loop inside `hplan.attach` on this rank: batch(s·N + r), loss mean over ranks.
    `checkpoint` = ("save", dir) saves after the last step, ("load", dir) resumes from it first. `between`: called
    with the model between backward() and optimizer.step() (a clip), what it returns recorded in "norms"."""
    from hplan.executor.ranks import dist_checkpoint
    from hplan.executor.ranks.distributed import DistRun

    n, r = info.world_size, info.rank
    workload = load_workload(spec, overrides=overrides)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    losses, seconds, iters, norms = [], [], [], []
    setup = (lambda run: dist_checkpoint.load(checkpoint[1], run)) if checkpoint and checkpoint[0] == "load" else None
    run = DistRun(model, optimizer, plan, batch_example=workload.batch(0), on_setup=setup) if setup else \
        hplan.attach(model, optimizer, plan, batch_example=workload.batch(0))
    with run:
        for step in range(first, steps):
            start = time.perf_counter()
            loss = workload.loss(model, workload.batch(step * n + r))
            loss.backward()
            if between is not None and (said := between(model)) is not None:
                norms.append(said)
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - start)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / n)
            iters.append(run.last)
        if checkpoint and checkpoint[0] == "save":
            dist_checkpoint.save(checkpoint[1], run, global_step=steps)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    last = iters[-1]
    return {"losses": losses, "norms": norms, "state": _state_checksum(optimizer), "seconds": seconds,
            "peak": max(i.peak_resident_bytes for i in iters),
            "moved": last.h2d_bytes + last.d2h_bytes, "collective": last.collective_bytes, "wire": last.wire_bytes,
            "ahead": last.gathers_ahead, "in_flight": last.reductions_in_flight, "calls": last.collective_calls,
            "checksum": [float(w.double().sum()) for w in weights.values()],
            "weights": weights if r == 0 else None}


def _state_checksum(optimizer: torch.optim.Optimizer) -> list[list[float]]:
    """Per parameter with state, in the optimizer's order: each state entry's sum (the user's optimizer.state)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [[float(v.double().sum()) for _, v in sorted(optimizer.state[p].items())]
            for p in params if p in optimizer.state]


def train_in_blocks(info: RankInfo, spec: str, plan: Plan, steps: int, per_block: int) -> dict[str, Any]:
    """The loop of `train_attached` in several `hplan.attach` blocks of `per_block` steps on one model and
    optimizer (a user evaluating or saving between blocks): [Note: optimizer state across many-rank blocks]."""
    n, r = info.world_size, info.rank
    workload = load_workload(spec)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    losses = []
    for start in range(0, steps, per_block):
        with hplan.attach(model, optimizer, plan, batch_example=workload.batch(0)):
            for step in range(start, min(steps, start + per_block)):
                loss = workload.loss(model, workload.batch(step * n + r))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(float(total) / n)
    return {"losses": losses, "state": _state_checksum(optimizer),
            "checksum": [float(p.detach().double().sum()) for _, p in model.named_parameters()]}


def _eval_inside(spec: str, plan: Plan) -> str:
    """An evaluation forward inside a many-rank block: the refusal's message."""
    from hplan.errors import HplanError

    workload = load_workload(spec)
    model = workload.build_model()
    try:
        with hplan.attach(model, workload.optimizer(model.parameters()), plan, batch_example=workload.batch(0)):
            model.eval()
            with torch.no_grad():
                workload.loss(model, workload.batch(0))
    except HplanError as error:
        return str(error)
    return "evaluated"


def settings_rank(info: RankInfo, spec: str, plans: list[dict[str, Any]], steps: int, ckpt: str) -> dict[str, Any]:
    """Every check of the executor test in one launch: each plan for `steps` steps, then a stop at half way and a
    resume from a checkpoint under the second plan, then FSDP2 on the same model and seed."""
    import dist_reference

    torch.manual_seed(0)
    out: dict[str, Any] = {"settings": [train_attached(info, spec, Plan.from_dict(p), steps) for p in plans]}
    plan = Plan.from_dict(plans[1])
    half = steps // 2
    train_attached(info, spec, plan, half, checkpoint=("save", ckpt))
    out["resumed"] = train_attached(info, spec, plan, steps, first=half, checkpoint=("load", ckpt))["losses"]
    out["blocks"] = train_in_blocks(info, spec, plan, steps, half)
    out["eval"] = _eval_inside(spec, plan)
    out["fsdp2"] = dist_reference._fsdp2_rank(info, spec, steps)
    out["ckpt_files"] = sorted(p.name for p in Path(ckpt).iterdir()) if info.rank == 0 else []
    return out


def hplan_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`hplan ARGV` as its own process (a many-rank run's launcher, as a user starts it), output captured."""
    return subprocess.run([sys.executable, "-c", "from hplan.cli import main; main()", *argv], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "300", **(env or {})})


def error_lines(stderr: str) -> list[str]:
    """The non-blank lines of a run's stderr: a refusal is exactly one."""
    return [line for line in stderr.splitlines() if line.strip()]


def finite_everywhere(folder: Path) -> bool:
    """Every floating tensor of a many-rank step folder is finite (read with hplan's safe reader)."""
    from hplan.executor.checkpoints.checkpoint import _read
    from hplan.executor.checkpoints.checkpoint_dir import listed_files

    state = _read(folder, listed_files(folder))
    tensors = [t for rank in state.values() for t in rank["regions"].values()]
    return bool(tensors) and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def clip_rank(info: RankInfo, spec: str, plans: list[dict[str, Any]], steps: int, clips: list[tuple[str, float]],
              overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per plan and per (kind, value) of `clips`, `train_attached` with, between backward() and optimizer.step(),
    torch.nn.utils.clip_grad_norm_(model.parameters(), value) ("norm", its totals recorded; "norm:P": norm_type P)
    or clip_grad_value_ ("value"); last, the refusals of `_refusals`."""
    torch.set_num_threads(1)  # [Note: reference determinism]
    out = [train_attached(info, spec, Plan.from_dict(data), steps, overrides=overrides, between=_clip(kind, value))
           for data in plans for kind, value in clips]
    return [*out, _refusals(spec, Plan.from_dict(plans[0]), overrides)]


def _clip(kind: str, value: float) -> Callable[[nn.Module], float | None]:
    """The clip `clip_rank` names: the total norm clip_grad_norm_ returns, or None (clip_grad_value_)."""
    if kind.startswith("norm"):
        p = float(kind[5:] or 2.0)
        return lambda model: float(torch.nn.utils.clip_grad_norm_(model.parameters(), value, norm_type=p))
    return lambda model: torch.nn.utils.clip_grad_value_(model.parameters(), value)


def _refusals(spec: str, plan: Plan, overrides: dict[str, Any] | None) -> dict[str, str]:
    """The one-line refusals of a many-rank block: a clip before the iteration's backward, a user's GradScaler."""
    from hplan.errors import HplanError

    out = {}
    for what in ("early", "scaler"):
        workload = load_workload(spec, overrides=overrides)
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())
        try:
            with hplan.attach(model, optimizer, plan, batch_example=workload.batch(0)):
                loss = workload.loss(model, workload.batch(0))
                if what == "early":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                else:
                    loss.backward()
                    torch.amp.GradScaler("cpu").unscale_(optimizer)
        except HplanError as error:
            out[what] = str(error)
    return out
