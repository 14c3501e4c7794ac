"""Test helpers: plans for a workload at a chosen offload, and the plain-PyTorch user loop run with or without
`hplan.attach` — the same code both ways, so any difference is hplan's."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

import torch

import hplan
from hplan.artifacts import Plan, replay
from hplan.planner import PlanOptions, make_hardware, make_plan, min_gpu_bytes, trace_slack
from hplan.tracer import trace_workload

BLOW = '''class Blow(torch.autograd.Function):
    """Identity forward; an infinite gradient backward (the loss itself stays finite)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * math.inf
'''
"""Source of an autograd function for the workload files tests write (which import `math` and `torch`): a finite
loss with an infinite gradient, the non-finite case a run must stop at without saving it."""


def plan_for(workload: hplan.Workload, *, extra: float = 0.0, solver: str = "fast", iters: int = 3,
             trace: Any = None, activations: str = "keep") -> Plan:
    """A plan at the smallest fast tier any schedule fits, plus `extra` × the model data (with every checkpointable
    segment's activations kept, offloaded or recomputed: `activations`), planned as `hplan plan --gpu cpu` plans:
    the trace's slack for each activation choice, not the keep step's for all."""
    trace = trace if trace is not None else trace_workload(workload, device="cpu", iters=iters)
    slack = trace_slack(trace)
    floor = min_gpu_bytes(trace, make_hardware("cpu", gpu_bytes=1, **slack), activations=activations).gpu_bytes
    hardware = make_hardware("cpu", gpu_bytes=floor + int(extra * trace.model_bytes), **slack)
    plan = make_plan(trace, hardware, PlanOptions(solver=solver, activations=activations))
    assert plan.summary.feasible, plan.summary.bottleneck
    return plan


def offloaded_share(plan: Plan) -> float:
    """The least share of model data off the fast tier at any step."""
    total = sum(r.bytes for r in plan.regions)
    return 1 - max(s.resident_bytes for s in replay(plan).states) / total


def user_loop(workload: hplan.Workload, steps: int, plan: Plan | None = None, *, optimizer: Any = None,
              model: Any = None, scheduler: Any = None, **attach: Any) -> dict[str, Any]:
    """The loop a user writes — micro-batches (loss ÷ accumulate), clipping, step, scheduler, zero_grad — in plain
    PyTorch, or inside `hplan.attach(model, optimizer, plan)` when a plan is given. Returns losses, final weights,
    the optimizer, the model and the run records."""
    model = model if model is not None else workload.build_model()
    optimizer = optimizer if optimizer is not None else workload.optimizer(model.parameters())
    if scheduler is None and workload.scheduler is not None:
        scheduler = workload.scheduler(optimizer)
    ctx = hplan.attach(model, optimizer, plan, **attach) if plan is not None else contextlib.nullcontext()
    losses, records = [], []
    with ctx as run:
        for step in range(steps):
            total = 0.0
            for i in range(workload.accumulate):
                loss = workload.loss(model, workload.micro_batch(step, i))
                (loss / workload.accumulate).backward()
                total += loss.item()
            if workload.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), workload.max_grad_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
            losses.append(total / workload.accumulate)
            if run is not None:
                records.append(run.last_records)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "optimizer": optimizer, "model": model, "records": records}


def train_eval_loop(workload: hplan.Workload, plan: Plan | None, *, eval_step: int,
                    steps: int = 3) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """A user's train/eval loop: each step trains (train(), loss, backward, step, zero_grad), then evaluates batch
    `eval_step` under no_grad in eval mode; in plain PyTorch, or inside `hplan.attach` when a plan is given.
    Returns the training losses, the evaluation losses and the final state_dict."""
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    losses, evals = [], []
    with hplan.attach(model, optimizer, plan) if plan is not None else contextlib.nullcontext():
        for step in range(steps):
            model.train()
            loss = workload.loss(model, workload.batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            model.eval()
            with torch.no_grad():
                evals.append(workload.loss(model, workload.batch(eval_step)).item())
    return losses, evals, {k: v.detach().clone() for k, v in model.state_dict().items()}


def rel(a: list[float], b: list[float]) -> float:
    return _nan_max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return _nan_max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _nan_max(values: Any) -> float:
    """max() that returns NaN when any value is NaN (Python's max keeps or drops a NaN depending on its position,
    so a NaN weight could pass a `<= tol` check)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def measured(records: list[Any], plan: Plan) -> tuple[int, int]:
    """(peak fast-tier bytes measured, bytes moved in the last step) from run records."""
    peak = max(r.resident_bytes for step in records for r in step)
    moved = sum(r.h2d_bytes + r.d2h_bytes for r in records[-1])
    return peak, moved


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for an `hplan` CLI run in a subprocess whose losses are compared bitwise to a run in this
    process: the same torch thread count (OMP_NUM_THREADS), since a different count splits matmul reductions
    differently and moves losses by an ulp (bf16-mixed gpt:tiny: 5.5459003 with two threads, 5.5459514 with one)."""
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), **extra}


def kill_after_save(cmd: list[str], checkpoint: Path, *, step: int, timeout_s: float) -> int:
    """Start the CLI `cmd`, `kill -9` it once `checkpoint` holds a save of at least `step`, and return the step
    saved when it died (asserting it was killed, not finished)."""
    import signal
    import subprocess
    import time

    from hplan.executor.checkpoints.checkpoint_dir import saved_step

    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while saved_step(checkpoint) < step and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return saved_step(checkpoint)
