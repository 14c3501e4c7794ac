"""One system's training steps in a fresh process (bench.worker `speed-run`): plain PyTorch, hplan on a saved plan,
or DeepSpeed ZeRO on its torch-optimizer path. Same workload, seed and batches in each, one torch thread.

`python -m bench.worker speed-run SYSTEM SPEC STEPS [PLAN]` prints one JSON line: losses, step seconds, bytes the
system copied per iteration where it reports them, and the 1-minute load average when it finished.
SYSTEM: plain | hplan (hplan's default, `overlap="auto"`: [Note: when the worker pays]) | hplan-inline (a backward
step's host updates in line: one core, as plain PyTorch's one torch thread) | hplan-worker (always on hplan's worker
thread, `overlap=True`) | paired, paired-worker (plain and hplan in one process, a step of each in turn: `_paired`)
| hplan-nocache (the CPU twin's block cache off: every released region's memory goes back to malloc, as before issue
32's cache) | hplan-nocheck, hplan-worker-nocheck (`nonfinite="ignore"`: no check of each gradient for NaN/inf,
which `hplan run` does by default and the plain loop does not) | ds-z2 | ds-z3 | ds-z2-offload | ds-z3-offload
(offload: optimizer, and for ZeRO-3 the parameters, on the CPU; DeepSpeed then runs the client's torch AdamW on the
host copies, no compiled extension).
Started by a lockstep parent (bench.lockstep: its pipes named in the environment), plain and hplan's systems hand
the turn over once set up and after each step, outside the step's timing ([Note: lockstep rounds]).
"""

from __future__ import annotations

import gc
import os
import resource
import time
from typing import Any

from bench.lockstep import Turns

DS_SYSTEMS = ("ds-z2", "ds-z3", "ds-z2-offload", "ds-z3-offload")
HPLAN_SYSTEMS: dict[str, bool | str] = {"hplan": "auto", "hplan-inline": False, "hplan-worker": True,
                                        "hplan-nocache": "auto", "hplan-nocheck": "auto",
                                        "hplan-worker-nocheck": True}
"""hplan's systems → their `overlap`."""


def minor_faults() -> int:
    """Minor page faults this process took so far (pages the kernel handed it again: memory malloc gave back)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def settle_collector() -> None:
    """[Note: the collector before the timed steps] Every system's child collects its garbage once, right before
    its timed steps. Python runs a full collection (every object of the process: hundreds of milliseconds with
    torch loaded) when enough objects have survived into the oldest generation since the last one; the imports
    and the JSON plan an hplan child loads before its steps tip it over in one of its first steady steps
    (gpt:small's minimum budget: its second step in every run seen, 300+ ms at load 6-7), while plain PyTorch's
    child, which imports less, has none in its steps. That is the process's start-up, not a step's work: each
    child now pays it before timing, the same for every system."""
    gc.collect()


def _plain(workload: Any, steps: int, turns: Turns | None = None) -> dict[str, Any]:
    from bench.executor_bench import plain_run

    settle_collector()
    faults: list[int] = []
    if turns is not None:
        turns.hand_over()  # set-up done: wait for the first turn ([Note: lockstep rounds] in bench.lockstep)
    losses, secs = plain_run(workload, steps, faults=faults, after_step=turns.hand_over if turns else None)
    return {"losses": losses, "step_seconds": secs, "step_faults": faults}


def _hplan(workload: Any, steps: int, plan_path: str, *, overlap: bool | str = "auto",
           cache: bool = True, nonfinite: str = "stop", turns: Turns | None = None) -> dict[str, Any]:
    from hplan.artifacts import Plan
    from hplan.executor import run_training
    from hplan.executor.device import FastTier
    from hplan.executor.activations.copier import offload_beside
    from hplan.executor.overlap import use_worker

    from bench.executor_speed import copy_seconds

    FastTier.caches = cache
    plan = Plan.load(plan_path)
    settle_collector()
    if turns is not None:
        turns.hand_over()  # set-up done: wait for the first turn ([Note: lockstep rounds] in bench.lockstep)
    marks = [minor_faults()]

    def after_step(*_: Any) -> None:  # run_training's progress callback: outside the step's timing
        marks.append(minor_faults())
        if turns is not None:
            turns.hand_over()

    report = run_training(workload, plan, steps=steps, device="cpu", measure=False, overlap=overlap,
                          nonfinite=nonfinite, on_progress=after_step)
    moved = report.bytes_moved_per_iter + report.activation_bytes_moved_per_iter
    return {"losses": list(report.losses), "step_seconds": list(report.step_seconds), "moved_bytes": moved,
            "step_faults": [b - a for a, b in zip(marks, marks[1:])],
            "worker": use_worker(overlap, plan, cuda=False), "copier": offload_beside(overlap, measured=False),
            "memcpy_seconds": copy_seconds(moved, fresh=False), "refill_seconds": copy_seconds(moved, fresh=True)}


def _paired(workload: Any, steps: int, plan_path: str, *, overlap: bool | str = "auto") -> dict[str, Any]:
    """Plain PyTorch and hplan (the same loop inside `hplan.attach`) in one process, one step each in turn, who
    goes first alternating: both see the same load from one moment to the next, so the ratio of their step medians
    is far less noisy than that of two processes run seconds apart. Each its own model and optimizer, the same
    seed and batches; losses of both returned (they must agree as in the separate runs). One heap serves both, and
    that reads against hplan: its backward takes fresh pages (450-510 minor faults a step) while plain's takes
    none (section 13's paired table's note)."""
    from hplan.artifacts import Plan
    from hplan.executor import attach
    from hplan.executor.overlap import use_worker
    from hplan.training import build_optimizer

    plan = Plan.load(plan_path)
    models = [workload.build_model(), workload.build_model()]
    opts = [build_optimizer(workload, m) for m in models]
    secs: list[list[float]] = [[], []]
    losses: list[list[float]] = [[], []]

    def one(k: int, i: int) -> None:
        t0 = time.perf_counter()
        opts[k].zero_grad(set_to_none=True)
        loss = workload.loss(models[k], workload.batch(i))
        loss.backward()
        opts[k].step()
        secs[k].append(time.perf_counter() - t0)
        losses[k].append(float(loss.detach()))

    with attach(models[1], opts[1], plan, batch_example=workload.batch(0), precision=workload.precision,
                measure=False, overlap=overlap):
        settle_collector()
        for i in range(steps):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                one(k, i)
    return {"losses": losses[1], "step_seconds": secs[1], "plain_losses": losses[0], "plain_seconds": secs[0],
            "worker": use_worker(overlap, plan, cuda=False)}


def ds_config(system: str, batch_size: int) -> dict[str, Any]:
    """DeepSpeed's config for one of DS_SYSTEMS: ZeRO stage, offloads, the client optimizer allowed with them."""
    stage = 3 if system.startswith("ds-z3") else 2
    zero: dict[str, Any] = {"stage": stage}
    if system.endswith("-offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def ds_engine(workload: Any, system: str) -> Any:
    """DeepSpeed's engine for `system` on the workload's model and optimizer, in the gloo group the caller's
    environment names (one rank here, or the group hplan's launch already made)."""
    import logging

    import deepspeed
    from hplan.training import build_optimizer

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = workload.build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(workload, model),
                                           config=ds_config(system, workload.batch_size))
    return engine


def _deepspeed(workload: Any, steps: int, system: str) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 2000)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    engine = ds_engine(workload, system)
    settle_collector()
    losses, secs = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = workload.loss(engine, workload.batch(i))
        engine.backward(loss)
        engine.step()
        secs.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return {"losses": losses, "step_seconds": secs}


def speed_run(system: str, spec: str, steps: int, plan_path: str | None) -> dict[str, Any]:
    import torch

    from hplan.specs import load_workload

    torch.set_num_threads(1)
    workload = load_workload(spec)
    turns = Turns.from_env()
    if turns is not None and system != "plain" and system not in HPLAN_SYSTEMS:
        raise ValueError(f"speed-run {system} takes no lockstep turns: plain or one of {', '.join(HPLAN_SYSTEMS)}")
    if system == "plain":
        out = _plain(workload, steps, turns)
    elif system in HPLAN_SYSTEMS:
        if plan_path is None:
            raise ValueError(f"speed-run {system} needs a plan file")
        out = _hplan(workload, steps, plan_path, overlap=HPLAN_SYSTEMS[system], cache=system != "hplan-nocache",
                     nonfinite="ignore" if system.endswith("-nocheck") else "stop", turns=turns)
    elif system in ("paired", "paired-worker"):
        if plan_path is None:
            raise ValueError(f"speed-run {system} needs a plan file")
        out = _paired(workload, steps, plan_path, overlap=True if system == "paired-worker" else "auto")
    elif system in DS_SYSTEMS:
        out = _deepspeed(workload, steps, system)
    else:
        raise ValueError(f"unknown system {system!r}: plain, {', '.join(HPLAN_SYSTEMS)} or one of "
                         f"{', '.join(DS_SYSTEMS)}")
    from bench.harness import self_peak_rss_bytes

    if turns is not None:
        out["turns"] = turns.count
    return {**out, "system": system, "load1": os.getloadavg()[0], "peak_rss_bytes": self_peak_rss_bytes()}
