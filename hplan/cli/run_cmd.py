"""`hplan run`: a thin shell over hplan.executor.run_training; progress bar, or a JSON summary."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hplan.cli.base import HplanCommand, SET_HELP
from hplan.errors import HplanError

if TYPE_CHECKING:
    from hplan.artifacts import Plan

EPILOG = ("Example: hplan run gpt:tiny --plan plan.json --steps 20 --checkpoint ckpt/ --metrics m.parquet  "
          "(a plan for another workload, or too big for this device, exits 2 before any step)")


def register(app: typer.Typer) -> None:
    @app.command("run", epilog=EPILOG, cls=HplanCommand)
    def run_command(
        spec: Annotated[str, typer.Argument(help="Workload: file.py:function, gpt:<size> or hf:<Class>.")],
        plan: Annotated[Path, typer.Option("--plan", help="Plan JSON written by `hplan plan`.")],
        steps: Annotated[int, typer.Option("--steps", help="Train until this global step (resumed runs too).")],
        device: Annotated[str, typer.Option("--device", help="cpu, or cuda (run on one H200; NCCL unverified).")] = "cpu",
        metrics: Annotated[Path | None, typer.Option("--metrics", help="Per-event metrics Parquet to write.")] = None,
        checkpoint: Annotated[Path | None, typer.Option("--checkpoint", help="Save full, checksummed state here "
                                                         "each step (locked while the run lasts).")] = None,
        resume: Annotated[bool, typer.Option("--resume", help="Continue from --checkpoint's newest good state "
                                             "(a damaged one falls back to the previous, with a warning).")] = False,
        overwrite: Annotated[bool, typer.Option("--overwrite", help="Start afresh in a --checkpoint folder that "
                                                "holds checkpoints; the first save replaces them.")] = False,
        batch_size: Annotated[int | None, typer.Option("--batch-size", help="Override the batch size.")] = None,
        seq_len: Annotated[int | None, typer.Option("--seq-len", help="Override the sequence length.")] = None,
        precision: Annotated[str | None, typer.Option("--precision", help="fp32, bf16-mixed or fp16-mixed; "
                                                                    "default: the plan's (another is refused).")
                             ] = None,
        overrides: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help=SET_HELP)] = None,
        budget_guard: Annotated[str, typer.Option("--budget-guard", help="stop (default): a step measuring more than "
                                                  "the plan's budget stops the run, exit 2; warn: only warn.")] = "stop",
        on_nonfinite: Annotated[str, typer.Option("--on-nonfinite", help="stop (default): an inf/NaN loss or gradient "
                                                  "stops the run, naming the step; skip: skip that step (plans that "
                                                  "defer updates, e.g. with clipping).")] = "stop",
        as_json: Annotated[bool, typer.Option("--json", help="Print the run summary as JSON on stdout.")] = False,
        nproc: Annotated[int | None, typer.Option("--nproc", help="Ranks to spawn for a many-rank plan (gloo on "
                                                  "CPU, NCCL on CUDA); under torchrun, leave it out.")] = None,
        nvme_dir: Annotated[Path | None, typer.Option("--nvme-dir", help="Directory on the disk where a plan made "
                                                      "with --nvme keeps its NVMe-homed model data (needed then).")
                            ] = None,
    ) -> None:
        """Train on a plan, doing its fetches, evictions and updates at the planned events."""
        from hplan.cli.common import guarded
        from hplan.cli.world import many_rank_run, one_process_plan_on_ranks

        if guarded(lambda: many_rank_run(nproc, plan)):  # many ranks: hplan.cli.world → executor.ranks.dist_train
            refusal = guarded(lambda: one_process_plan_on_ranks(plan, nproc, nvme_dir=nvme_dir is not None))
            if refusal is not None:
                guarded(lambda: _refuse(refusal))
            if nvme_dir is not None:
                guarded(lambda: _refuse("--nvme-dir is for one-process plans made with --nvme; a many-rank plan "
                                        "keeps no disk tier: leave --nvme-dir out"))
            from hplan.executor.ranks.launch import under_torchrun

            # The launching process of spawned ranks stops them and its own clean-up runs, as one process's run
            # does ([Note: stopped many-rank runs]); under torchrun each process is a rank, which torchrun stops.
            with stops_cleanly(ranks=True) if not under_torchrun() else contextlib.nullcontext():
                guarded(lambda: _run_many(spec=spec, plan=plan, steps=steps, device=device, metrics=metrics,
                                          checkpoint=checkpoint, resume=resume, overwrite=overwrite,
                                          batch_size=batch_size, seq_len=seq_len,
                                          precision=precision, overrides=overrides, as_json=as_json,
                                          budget_guard=budget_guard, on_nonfinite=on_nonfinite, nproc=nproc))
            return
        with stops_cleanly():
            guarded(lambda: _run(spec=spec, plan=plan, steps=steps, device=device, metrics=metrics,
                                 checkpoint=checkpoint, resume=resume, overwrite=overwrite, batch_size=batch_size,
                                 seq_len=seq_len,
                                 precision=precision, overrides=overrides, as_json=as_json, budget_guard=budget_guard,
                                 on_nonfinite=on_nonfinite, nvme_dir=nvme_dir))


class Stopped(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread so that every `finally` and `with` on the way out runs: the
    disk tier removes its region files, the checkpoint folder's lock and temporaries go. A BaseException, like
    KeyboardInterrupt, so that a workload's `except Exception` does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stops_cleanly(*, ranks: bool = False) -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into a clean exit: the run unwinds, then one line and exit 128 + the signal's number
    (143 for SIGTERM, as a process killed by it would report). Further signals are ignored while it unwinds, so
    the clean-up is not cut short; `kill -9` still stops it at once (the next run cleans up after it). `ranks`:
    this process launched ranks, which the unwinding stops (hplan.executor.ranks.launch) — the line says so."""
    from hplan.cli.common import err_console

    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        if _in_finalizer(frame):  # Python would print the exception and drop it, and the run would go on
            main = threading.main_thread().ident
            threading.Timer(0.05, signal.pthread_kill, (main, signum)).start()  # say it again, outside
            return
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    except Stopped as stopped:
        name = signal.Signals(stopped.signum).name
        who = " (every rank stopped)" if ranks else ""
        err_console.print(f"stopped by {name}{who}: nothing of the step under way was saved; the last checkpoint (if "
                          "any) holds the state, and --resume continues from it", highlight=False, soft_wrap=True)
        raise typer.Exit(128 + stopped.signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _in_finalizer(frame: Any) -> bool:
    """Did the signal arrive inside a finalizer (a weakref callback, `weakref.finalize`, `__del__`, run by the
    garbage collector at any allocation)? An exception raised there is printed as "Exception ignored in …" and
    dropped, so `stop` re-sends the signal to the main thread a moment later instead (seen in
    tests/tiers/test_executor_nvme.py: a SIGTERM lost in a finalizer left a run training on)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith(("weakref.py", "_weakrefset.py")):
            return True
        frame = frame.f_back
    return False


def _run(*, spec: str, plan: Path, steps: int, device: str, metrics: Path | None, checkpoint: Path | None,
         resume: bool, overwrite: bool, batch_size: int | None, seq_len: int | None, precision: str | None,
         overrides: list[str] | None, as_json: bool, budget_guard: str = "stop", on_nonfinite: str = "stop",
         nvme_dir: Path | None = None) -> None:
    from hplan.artifacts import Plan
    from hplan.cli.common import (absolute, check_outputs, emit_json, err_console, parse_device, parse_overrides,
                                  plan_precision, progress_bar, warn_line)

    from hplan.errors import HplanError

    parse_device(device, kinds=("cpu", "cuda"), indexed=("cuda",))
    _check_cuda_index(device)  # before anything is built or read
    if budget_guard not in ("stop", "warn") or on_nonfinite not in ("stop", "skip"):
        raise HplanError("--budget-guard takes stop or warn, --on-nonfinite takes stop or skip")
    if overwrite and checkpoint is None:
        raise HplanError("--overwrite replaces the checkpoints of --checkpoint DIR: pass --checkpoint too")
    check_outputs(spec=spec, plan=plan, metrics=metrics, checkpoint=checkpoint)
    the_plan = Plan.load(plan)
    _check_nvme_dir(the_plan, plan, nvme_dir)
    plan, metrics, checkpoint, nvme_dir = absolute(plan, metrics, checkpoint, nvme_dir)  # before the workload's code
    from hplan.executor import run_training
    from hplan.specs import load_workload

    workload = load_workload(spec, batch_size=batch_size, seq_len=seq_len, overrides=parse_overrides(overrides),
                             precision=plan_precision(the_plan, precision), accumulate=the_plan.accumulate,
                             max_grad_norm=the_plan.max_grad_norm)
    with progress_bar(f"training {workload.name}", quiet=as_json) as on_progress:
        report = run_training(workload, the_plan, steps=steps, device=device, metrics_path=metrics,
                              checkpoint_dir=checkpoint, resume=resume, overwrite=overwrite,
                              on_progress=on_progress, on_warning=warn_line, budget_guard=budget_guard,
                              nonfinite=on_nonfinite, nvme_dir=nvme_dir)
    if as_json:
        emit_json(report.to_dict())
        return
    bad = sum(loss is None for loss in report.losses)  # --on-nonfinite skip trained past them
    final = "not finite" if report.losses[-1] is None else f"{report.losses[-1]:.4f}"
    err_console.print(f"{report.steps} steps from step {report.first_step}"
                      f"{f' ({bad} with a non-finite loss)' if bad else ''}: final loss {final}, "
                      f"peak resident {report.peak_resident_bytes} B (budget {report.budget_bytes} B), "
                      f"moved {report.bytes_moved_per_iter} B/iter (planned {report.planned_bytes_moved_per_iter})",
                      highlight=False)
    if report.planned_activation_bytes_moved_per_iter or report.activation_bytes_moved_per_iter:
        err_console.print(f"activations moved {report.activation_bytes_moved_per_iter} B/iter (planned "
                          f"{report.planned_activation_bytes_moved_per_iter})", highlight=False)
    if report.host_budget_bytes:
        err_console.print(f"host model data peak {report.peak_host_model_bytes} B (budget {report.host_budget_bytes} "
                          f"B); disk read/write {report.nvme_read_bytes_per_iter}/{report.nvme_write_bytes_per_iter} "
                          f"B/iter (planned {report.planned_nvme_read_bytes_per_iter}/"
                          f"{report.planned_nvme_write_bytes_per_iter})", highlight=False)


def _refuse(message: str) -> None:
    raise HplanError(message)


def _check_nvme_dir(plan: Plan, path: Path, nvme_dir: Path | None) -> None:
    """Before any work: a plan with NVMe-homed chunks needs --nvme-dir, a directory (issue 16)."""
    from hplan.executor.tiers.host import needs_nvme_dir

    if nvme_dir is None and needs_nvme_dir(plan):
        raise HplanError(f"{path} keeps {len(plan.nvme_chunks())} chunks on NVMe (planned with --nvme): pass "
                         "--nvme-dir DIR, a directory on the disk to use")
    if nvme_dir is not None and not nvme_dir.is_dir():
        raise HplanError(f"--nvme-dir {nvme_dir} is not a directory: create it (mkdir -p {nvme_dir}) or pass another")


def _check_cuda_index(device: str) -> None:
    """A CUDA `device` must be one this machine has (torch only fails at the first allocation otherwise), checked
    before the model is built (hplan.probe.check_device)."""
    from hplan.probe import check_device

    check_device(device)


def _run_many(*, spec: str, plan: Path, steps: int, device: str, metrics: Path | None, checkpoint: Path | None,
              resume: bool, overwrite: bool, batch_size: int | None, seq_len: int | None, precision: str | None,
              overrides: list[str] | None, as_json: bool, budget_guard: str, on_nonfinite: str,
              nproc: int | None) -> None:
    """`hplan run --nproc N` / under torchrun (hplan.cli.world)."""
    from hplan.cli.world import run_many

    if overwrite and checkpoint is None:
        raise HplanError("--overwrite replaces the checkpoints of --checkpoint DIR: pass --checkpoint too")
    run_many(spec=spec, plan=plan, steps=steps, device=device, metrics=metrics, checkpoint=checkpoint, resume=resume,
             overwrite=overwrite,
             batch_size=batch_size, seq_len=seq_len, precision=precision, overrides=overrides, as_json=as_json,
             budget_guard=budget_guard, on_nonfinite=on_nonfinite, nproc=nproc)
