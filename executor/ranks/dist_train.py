"""run_distributed: a workload trained on N ranks with a many-rank plan — `hplan run --nproc N`, or torchrun.

Rank r trains step s on the workload's micro-batches `batch((s·N + r)·k + i)`, i < k (k = accumulate; k = 1 gives
`batch(s·N + r)`), each loss ÷ k before backward; the plan's gradient syncs sum over ranks and divide by N, and
the workload's `max_grad_norm` clips by the global norm over every rank's pieces (hplan.executor.ranks.dist_clip).
So the reference is one process accumulating the N·k micro-batches of step s (each loss ÷ N·k), clipping, then one
optimizer step, and the loss reported per step is the mean over ranks (an all-reduce outside the plan's calls,
not counted in its bytes). Every number in the report is measured per rank ([Note: distributed executor step]).
Ranks start through hplan.executor.ranks.launch: a rank that fails or dies makes the run fail with one line naming it;
checkpoints are saved after each step (hplan.executor.ranks.dist_checkpoint), so a failed run loses at most a step. A
non-finite loss on any rank stops every rank at that micro-batch, before its backward, with one message naming the
step and the rank ([Note: ranks stop together] in hplan.executor.ranks.dist_comm).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hplan.artifacts import Plan, RunReport
from hplan.errors import HplanError

DIE_ENV = "HPLAN_TEST_DIE_AT"
"""Tests only: "RANK:STEP" makes that rank exit abruptly (os._exit) at that step, as a crashed process would."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """Everything a rank needs, picklable."""

    spec: str
    load: dict[str, Any]
    """Keyword arguments of hplan.specs.load_workload besides the spec."""
    plan: dict[str, Any]
    steps: int
    device: str
    checkpoint: str | None
    resume_from: str | None
    """The step folder to resume from (chosen and verified before the ranks start), or None for a fresh run."""
    measure: bool
    budget_guard: str
    claim_on_rank0: tuple[bool, bool] | None = None
    """Under torchrun (no launching process of ours): (resume, overwrite) for rank 0 to claim the checkpoint
    folder itself and tell every rank what it found (`_claim_on_rank0`); None when the launcher holds it."""


def run_distributed(spec: str, plan: Plan, *, nproc: int | None, steps: int, device: str = "cpu",
                    load: dict[str, Any] | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
                    resume: bool = False, overwrite: bool = False, measure: bool = True, budget_guard: str = "stop",
                    timeout_s: float = 3600.0, collective_timeout_s: float = 300.0,
                    on_warning: Callable[[str], None] | None = None) -> RunReport:
    """Train `spec` to global step `steps` on the plan's ranks (spawned, or this torchrun job's).

    With `checkpoint_dir`, the folder is claimed (hplan.executor.ranks.dist_checkpoint.claim: its lock, then every check
    of what the run will write) before any rank starts — by this process for spawned ranks, by rank 0 under
    torchrun — and held until the ranks are done.

    [Note: stopped many-rank runs] When the spawned ranks end any other way than all finishing — one failed, the
    watchdog fired, or this process was interrupted (`hplan run` turns SIGTERM/SIGHUP into an exception,
    hplan.cli.run_cmd.stops_cleanly) — launch stops every rank (SIGTERM, then SIGKILL) and removes its private
    folder before the exception reaches here; then, still under the lock, the temp and trash folders of a save the
    ranks did not finish are removed (what the next start would remove: hplan.executor.checkpoints.checkpoint_dir's
    leftovers,
    ours by name), and only then is the lock released. A save commits by renames, so the pointer names the last
    committed step folder, intact, whatever moment the ranks were stopped at."""
    from hplan.executor.checkpoints.checkpoint_dir import remove_leftovers
    from hplan.executor.ranks.dist_checkpoint import claim
    from hplan.executor.ranks.distributed import check_world
    from hplan.executor.ranks.launch import launch, under_torchrun

    if steps <= 0:
        raise HplanError(f"steps must be positive, got {steps}")
    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else nproc
    if world is None:
        raise HplanError(f"the plan is for {plan.hardware.ranks} ranks: give `nproc` {plan.hardware.ranks} or launch "
                         "under torchrun")
    check_world(plan, world)
    if resume and overwrite:
        raise HplanError("`resume` continues the checkpoint and `overwrite` replaces it: pass only one")
    if resume and checkpoint_dir is None:
        raise HplanError("`resume` needs `checkpoint_dir` DIR (where the state was saved)")
    held = None
    if checkpoint_dir is not None and not torchrun:
        held = claim(checkpoint_dir, plan, world, resume=resume, overwrite=overwrite)
        if held.warning and on_warning is not None:
            on_warning(held.warning)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    job = Job(spec=spec, load=load or {}, plan=plan.to_dict(), steps=steps, device=device,
              checkpoint=None if checkpoint_dir is None else str(checkpoint_dir),
              resume_from=held.resume_from if held else None, measure=measure, budget_guard=budget_guard,
              claim_on_rank0=(resume, overwrite) if torchrun and checkpoint_dir is not None else None)
    try:
        results = launch(rank_main, job, on_warning if torchrun else None, nprocs=None if torchrun else world,
                         backend=backend, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s)
    except BaseException:  # a rank failed, or this process was stopped (SIGTERM in `hplan run`, Ctrl-C)
        if held is not None:
            with contextlib.suppress(OSError):  # the run's own error is the one to report
                remove_leftovers(held.root)  # [Note: stopped many-rank runs]
        raise
    finally:
        if held is not None:
            held.close()
    return report(spec, plan, results, device)


def rank_main(info: Any, job: Job, on_warning: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One rank's training loop (module level: spawned ranks import it)."""
    plan = Plan.from_dict(job.plan)
    held, resume_from = None, job.resume_from
    if job.claim_on_rank0 is not None:
        held, resume_from = _claim_on_rank0(info, job, plan, on_warning)
    try:
        return _train(info, job, plan, resume_from)
    finally:
        if held is not None:  # rank 0 releases the folder after its last write (model.pt)
            held.close()


def _claim_on_rank0(info: Any, job: Job, plan: Plan, on_warning: Callable[[str], None] | None) -> tuple[Any, Any]:
    """Under torchrun: rank 0 claims the checkpoint folder; every rank learns the folder to resume from, or the
    refusal, which every rank then raises (no rank starts training on a folder it may not use)."""
    import torch.distributed as dist
    from hplan.executor.ranks.dist_checkpoint import claim

    held, outcome, failure = None, [None], None
    if info.rank == 0:
        try:
            resume, overwrite = job.claim_on_rank0
            held = claim(job.checkpoint, plan, info.world_size, resume=resume, overwrite=overwrite)
            outcome = [{"folder": held.resume_from}]
            if held.warning and on_warning is not None:
                on_warning(held.warning)
        except Exception as exc:  # told to every rank first, so none waits for a rank 0 that has stopped
            failure, outcome = exc, [{"error": str(exc) if isinstance(exc, HplanError) else
                                      f"rank 0 could not claim the checkpoint folder ({type(exc).__name__})"}]
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if "error" in outcome[0]:
        raise HplanError(outcome[0]["error"])
    return held, outcome[0]["folder"]


def _train(info: Any, job: Job, plan: Plan, resume_from: str | None) -> dict[str, Any]:
    """The training loop of one rank (see the module docstring), from `resume_from` when given."""
    import torch
    import torch.distributed as dist
    from hplan.executor.ranks import dist_checkpoint
    from hplan.executor.checkpoints.checkpoint_dir import folder_name
    from hplan.executor.ranks.dist_comm import stop_together
    from hplan.executor.ranks.distributed import DistRun
    from hplan.executor.train import to_device

    from hplan.blame import at_step
    from hplan.specs import load_workload
    from hplan.training import build_optimizer, check_loss

    workload = load_workload(job.spec, **job.load)
    if workload.accumulate != plan.accumulate:
        raise HplanError(f"the plan was traced with {plan.accumulate} micro-batches per step, the workload uses "
                         f"{workload.accumulate}; re-trace with the same `accumulate`")
    device = f"cuda:{info.local_rank}" if job.device == "cuda" else job.device
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    model = workload.build_model()
    optimizer = build_optimizer(workload, model)
    scheduler = workload.scheduler(optimizer) if workload.scheduler is not None else None
    resumed: dict[str, Any] = {}

    def setup(run: DistRun) -> None:
        if resume_from is not None:
            resumed.update(dist_checkpoint.load(job.checkpoint, run, resume_from))

    n, r, k = info.world_size, info.rank, workload.accumulate
    die = os.environ.get(DIE_ENV, "")
    local: list[torch.Tensor] = []
    seconds: list[float] = []
    fallback = resume_from
    with DistRun(model, optimizer, plan, device=device, batch_example=workload.batch(0), measure=job.measure,
                 budget_guard=job.budget_guard, nonfinite="stop", on_setup=setup) as run:
        first = run.first_step = resumed.get("global_step", 0)
        if scheduler is not None and resumed.get("scheduler") is not None:
            scheduler.load_state_dict(resumed["scheduler"])
        if first >= job.steps:
            raise HplanError(f"the checkpoint is already at step {first}; ask for more `steps` than that")
        for step in range(first, job.steps):
            if die == f"{r}:{step}":
                os._exit(3)
            start = time.perf_counter()
            micro = []
            for i in range(k):
                with at_step(step):  # an error in the workload's code names the step
                    batch = to_device(workload.batch((step * n + r) * k + i), device)
                    loss = check_loss(workload, workload.loss(run.model, batch))
                value = float(loss.detach())
                problem = None if math.isfinite(value) else (
                    f"the loss is {value} at step {step} on rank {r} (micro-batch {i}); every rank stopped before "
                    "updating or saving anything of this step — the last checkpoint holds the state before it")
                if i + 1 < k:
                    stop_together(problem, rank=r, world=n, device=run.tier.device)  # before backward
                else:  # the last micro-batch's: agreed before the first update, its backward running meanwhile
                    run.agree_before_update(problem)
                (loss / k if k > 1 else loss).backward()
                micro.append(loss.detach())
            if workload.max_grad_norm is not None:  # [Note: the global norm over ranks]
                run.clip_grad_norm_(workload.max_grad_norm)
            last = run.step()
            if scheduler is not None:
                scheduler.step()
            seconds.append(time.perf_counter() - start)
            local.append(torch.stack(micro).mean())
            if job.checkpoint is not None:
                dist_checkpoint.save(job.checkpoint, run, global_step=step + 1, scheduler=scheduler,
                                     fallback=fallback)
                fallback = folder_name(step + 1)
    totals = torch.stack(local).to(device)  # the mean loss over ranks, one call for the run (not a wait per step)
    dist.all_reduce(totals)
    losses = [float(x) / n for x in totals]
    if job.checkpoint is not None and r == 0:
        dist_checkpoint.save_weights(job.checkpoint, model, global_step=job.steps)
    return {"rank": r, "first_step": first, "losses": losses, "seconds": seconds,
            "peak_resident_bytes": run.peak, "h2d_bytes_per_iter": last.h2d_bytes, "d2h_bytes_per_iter": last.d2h_bytes,
            "collective_bytes_per_iter": last.collective_bytes, "collective_wire_bytes_per_iter": last.wire_bytes}


def report(spec: str, plan: Plan, results: list[dict[str, Any]], device: str) -> RunReport:
    """One report: losses and times of rank 0 (every rank computes the same global mean), and a per-rank entry."""
    head = results[0]
    planned = plan.summary.collective_bytes_per_rank
    ranks = tuple({"rank": x["rank"], "peak_resident_bytes": x["peak_resident_bytes"],
                   "bytes_moved_per_iter": x["h2d_bytes_per_iter"] + x["d2h_bytes_per_iter"],
                   "h2d_bytes_per_iter": x["h2d_bytes_per_iter"], "d2h_bytes_per_iter": x["d2h_bytes_per_iter"],
                   "collective_bytes_per_iter": x["collective_bytes_per_iter"],
                   "collective_wire_bytes_per_iter": x["collective_wire_bytes_per_iter"],
                   "planned_collective_bytes_per_iter": planned,
                   "planned_bytes_moved_per_iter": plan.summary.bytes_moved_per_iter,
                   "budget_bytes": plan.gpu_bytes} for x in results)
    return RunReport(workload=spec, device=device, steps=len(head["losses"]), first_step=head["first_step"],
                     losses=tuple(head["losses"]), step_seconds=tuple(head["seconds"]),
                     peak_resident_bytes=max(x["peak_resident_bytes"] for x in results), budget_bytes=plan.gpu_bytes,
                     bytes_moved_per_iter=head["h2d_bytes_per_iter"] + head["d2h_bytes_per_iter"],
                     planned_bytes_moved_per_iter=plan.summary.bytes_moved_per_iter,
                     h2d_bytes_per_iter=head["h2d_bytes_per_iter"], d2h_bytes_per_iter=head["d2h_bytes_per_iter"],
                     world_size=len(results), planned_collective_bytes_per_iter=planned, ranks=ranks)
