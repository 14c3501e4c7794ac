"""Run one function on N ranks, so a failure anywhere is one clear error here, never a hang.

Two ways in, one contract (`launch(fn, *args) -> [result of rank 0, …, result of rank N-1]`):
- **Spawn** (`nprocs=N`, no torchrun variables in the environment): N processes started with
  `torch.multiprocessing.start_processes(start_method="spawn")`, rendezvous through a `TCPStore` this
  process opens on a port the OS picks (port 0) and holds until the ranks are gone, so no other job can
  take the port between choosing and binding it.
- **torchrun** (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set): this process is one rank; it
  joins the group with `env://`, runs `fn`, and all ranks exchange results with `all_gather_object`.

[Note: launch failure handling] Three layers stop a broken run:
1. the process group's `timeout` bounds every collective (gloo raises "Timed out waiting …" and closes
   the pair), so a rank waiting on a peer that stopped calling collectives fails by itself;
2. a peer that dies makes gloo fail the survivors' collectives at once ("Connection reset/closed by peer");
3. the parent's watchdog (hplan.executor.ranks.watchdog) waits on the ranks' process sentinels: at the first
   non-zero exit it gives the others a short grace period, then SIGTERM, then SIGKILL; at `timeout_s` it stops
   everyone. Each rank also asks the kernel to SIGKILL it if this process dies (`PR_SET_PDEATHSIG`), so no rank
   outlives it.
The error names the rank that failed *first*: a rank that died without raising (signal, `os._exit`), else
the earliest recorded exception — the survivors' "connection closed by peer" errors come after the cause.

[Note: launch workdir] Spawned ranks hand their results back as typed JSON ([Note: checkpoint state as JSON]:
None, bool, int, float, str, lists, tuples, dicts; each tensor as a raw file of its bytes beside it, named in the
JSON with its dtype and shape) and their errors as JSON records, in a folder `_private_workdir` creates for this
call alone (mkdtemp: a new random name, mode 0700, owned by this user; never a path from the user or the
environment besides TMPDIR) and removes afterwards. hplan never unpickles what it reads, even from there: the
parent parses the JSON with hplan's bounded reader and reads each tensor file once, checked against its size. The ranks' rendezvous (a TCPStore on 127.0.0.1, or
MASTER_ADDR under torchrun) is torch.distributed's and has no authentication: run ranks on hosts you trust.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import pickle  # only to word spawn's failure to send `fn` (spawn pickles what it sends)
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hplan.errors import HplanError
from hplan.executor.ranks.rank_results import read_result, result_path, write_result
from hplan.executor.ranks.watchdog import DEBUG_HINT, failure_message, stop_ranks, supervise

__all__ = ["DEBUG_HINT", "MAX_RANKS", "RENDEZVOUS_S", "TORCHRUN_VARS", "RankInfo", "env_world_size", "launch",
           "torchrun_env", "under_torchrun"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RENDEZVOUS_S = 120.0
"""Seconds every spawned rank may take to start (import torch) before the run is abandoned; the parent's
watchdog (`timeout_s`) still bounds the whole call."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInfo:
    """Who this process is in the run; passed as `fn`'s first argument."""

    rank: int
    world_size: int
    local_rank: int
    """Index on this machine (torchrun's LOCAL_RANK; the rank itself under spawn)."""
    backend: str


def under_torchrun() -> bool:
    """True when the environment describes this process as one rank of a torchrun job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(fn: Callable[..., Any], *args: Any, nprocs: int | None = None, backend: str = "gloo",
           timeout_s: float = 300.0, collective_timeout_s: float = 60.0, threads: int | None = 1) -> list[Any]:
    """Run `fn(RankInfo, *args)` on every rank and return the per-rank results, rank order: spawned ranks hand them
    back as JSON ([Note: launch workdir]), so a result is made of None, bool, int, float, str, lists, tuples, dicts
    and tensors (`fn`'s arguments travel to the ranks as spawn's pickles, from this process).

    `timeout_s` bounds the whole call (watchdog; spawn only: torchrun has its own agent); `collective_timeout_s`
    bounds each collective once all ranks have started (spawned ranks first wait up to RENDEZVOUS_S for each
    other). `threads` sets `torch.set_num_threads` in every rank (None leaves torch's default, one thread per
    core: N ranks × all cores oversubscribes the machine). `fn` must be importable (a module-level function).
    """
    for name, value in (("timeout_s", timeout_s), ("collective_timeout_s", collective_timeout_s)):
        if not value > 0:
            raise HplanError(f"launch {name} must be positive seconds, got {value}")
    if under_torchrun():
        return _run_in_place(fn, args, nprocs=nprocs, backend=backend, collective_timeout_s=collective_timeout_s,
                             threads=threads)
    if nprocs is None or isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise HplanError(f"launch needs nprocs ≥ 1 ranks (or run under torchrun), got {nprocs!r}")
    return _spawn(fn, args, nprocs=nprocs, backend=backend, timeout_s=timeout_s,
                  collective_timeout_s=collective_timeout_s, threads=threads)


def torchrun_env() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) of a torchrun (env://) rank, each variable checked first: decimal integers,
    0 ≤ RANK, LOCAL_RANK < WORLD_SIZE, MASTER_PORT a TCP port, MASTER_ADDR a host name. `MASTER_PORT=99999` was
    a ValueError deep in torch's rendezvous; a one-line HplanError naming the variable instead."""
    env = os.environ
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise HplanError(f"RANK is set but {', '.join(missing)} is not: launch under torchrun, or unset RANK "
                         "to let launch spawn the ranks")
    world = env_world_size()
    rank = _env_int("RANK", 0, world - 1, f"a rank of the {world}")
    local = _env_int("LOCAL_RANK", 0, world - 1, f"a local rank of the {world}") if "LOCAL_RANK" in env else rank
    _env_int("MASTER_PORT", 1, 65535, "a TCP port")
    addr = env["MASTER_ADDR"]
    if not addr or len(addr) > 253 or not addr.isascii() or any(c.isspace() or c in "/@?#" for c in addr):
        raise HplanError(f"MASTER_ADDR={_shown(addr)} is not a host name or address: set it to rank 0's host "
                         "(torchrun: --master-addr)")
    return rank, world, local


def env_world_size() -> int:
    """WORLD_SIZE, checked as `torchrun_env` does."""
    return _env_int("WORLD_SIZE", 1, MAX_RANKS, "a number of ranks")


MAX_RANKS = 1 << 20
"""More ranks than any job runs; a WORLD_SIZE beyond it is a typo."""


def _env_int(name: str, low: int, high: int, what: str) -> int:
    text = os.environ[name]
    stripped = text.strip()
    if not (stripped.isascii() and stripped.isdigit() and len(stripped) <= 12) or not low <= int(stripped) <= high:
        raise HplanError(f"{name}={_shown(text)} is not {what} ({low} to {high}): set {name} as torchrun does, or "
                         "unset RANK and WORLD_SIZE to run one process")
    return int(stripped)


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:30]) + f"… ({len(text)} characters)"


def _run_in_place(fn: Callable[..., Any], args: tuple[Any, ...], *, nprocs: int | None, backend: str,
                  collective_timeout_s: float, threads: int | None) -> list[Any]:
    """torchrun: this process is one rank; results are exchanged so every rank returns the same list."""
    import torch
    import torch.distributed as dist

    rank, world, local = torchrun_env()
    if nprocs is not None and nprocs != world:
        raise HplanError(f"launch asked for {nprocs} ranks but torchrun started {world}; use --nproc-per-node "
                         f"{nprocs} or drop nprocs")
    info = RankInfo(rank=rank, world_size=world, local_rank=local, backend=backend)
    if threads is not None:
        torch.set_num_threads(threads)
    owned = not dist.is_initialized()
    if owned:
        try:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=collective_timeout_s))
        except (dist.DistNetworkError, dist.DistStoreError) as exc:
            raise HplanError(_rendezvous_failure(exc, rank)) from None
    try:
        try:
            result = fn(info, *args)
        except HplanError:
            raise
        except Exception as exc:
            raise HplanError(f"rank {rank} of {world} failed: {_one_line(exc)}") from exc
        gathered: list[Any] = [None] * world
        try:
            dist.all_gather_object(gathered, result)
        except Exception as exc:
            raise HplanError(f"rank {rank} of {world}: exchanging results failed, a peer probably failed first "
                             f"({_one_line(exc)}); see the other ranks' errors") from exc
        return gathered
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _rendezvous_failure(exc: Exception, rank: int) -> str:
    """One line for an env:// rendezvous that failed: the port taken (rank 0 binds MASTER_PORT) or unreachable."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
        return (f"MASTER_PORT {port} on {addr} is already in use by another process, so rank 0 cannot listen on it; "
                "set MASTER_PORT to a free port (torchrun: --master-port, or --standalone to pick one)")
    return (f"rank {rank} could not join the process group at {addr}:{port} ({_text(exc)}); check MASTER_ADDR and "
            "MASTER_PORT and that rank 0 is running")


def _private_workdir() -> Path:
    """A folder only this run (this user) can write: rank results come back through it (as JSON), so it must be
    new and ours — mkdtemp creates it 0700 with a random name under the temp folder, never a path a user names —
    and the check below refuses one that is not (a temp folder on a file system that ignores modes)."""
    workdir = Path(tempfile.mkdtemp(prefix="hplan-launch-"))
    st = os.lstat(workdir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        shutil.rmtree(workdir, ignore_errors=True)
        raise HplanError(f"the temp folder {workdir.parent} does not keep new folders private (mode "
                         f"{oct(st.st_mode & 0o777)}); point TMPDIR at a local folder of yours")
    return workdir


def _spawn(fn: Callable[..., Any], args: tuple[Any, ...], *, nprocs: int, backend: str, timeout_s: float,
           collective_timeout_s: float, threads: int | None) -> list[Any]:
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=RENDEZVOUS_S),
                          wait_for_workers=False)
    workdir = _private_workdir()
    config = _Config(world=nprocs, port=store.port, workdir=str(workdir), backend=backend,
                     collective_timeout_s=collective_timeout_s, threads=threads, parent=os.getpid())
    procs: list[Any] = []
    try:
        try:
            context = tmp.start_processes(_rank_main, args=(fn, args, config), nprocs=nprocs, join=False,
                                          start_method="spawn")
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise HplanError(f"launch could not send the function or its arguments to the ranks ({_one_line(exc)}); "
                             "pass a module-level function and picklable arguments") from None
        procs = list(context.processes)
        failed, stopped = supervise(procs, timeout_s, lambda rank: result_path(workdir, rank).exists())
        if stopped and failed is None:
            raise HplanError(f"ranks {stopped} of {nprocs} still running after {timeout_s:g} s (launch watchdog); "
                             "find the hang or raise timeout_s")
        if failed is not None:
            raise HplanError(failure_message(procs, workdir, stopped))
        return [read_result(workdir, rank, procs[rank].exitcode) for rank in range(nprocs)]
    finally:
        stop_ranks(procs)
        shutil.rmtree(workdir, ignore_errors=True)
        del store


@dataclass(frozen=True, kw_only=True, slots=True)
class _Config:
    """What every spawned rank needs to join the group and report back."""

    world: int
    port: int
    workdir: str
    backend: str
    collective_timeout_s: float
    threads: int | None
    parent: int


def _rank_main(rank: int, fn: Callable[..., Any], args: tuple[Any, ...], config: _Config) -> None:
    """A spawned rank: die with the parent, join the group, run `fn`, leave a result or an error record."""
    _die_with_parent(config.parent)
    import torch
    import torch.distributed as dist

    workdir = Path(config.workdir)
    try:
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        store = dist.TCPStore("127.0.0.1", config.port, config.world, False,
                              datetime.timedelta(seconds=RENDEZVOUS_S))
        _arrive(store, config.world)
        timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        dist.init_process_group(config.backend, store=store, rank=rank, world_size=config.world, timeout=timeout)
        result = fn(RankInfo(rank=rank, world_size=config.world, local_rank=rank, backend=config.backend), *args)
        write_result(workdir, rank, result, _write_atomic)
        dist.destroy_process_group()
    except BaseException as exc:
        record = {"time": time.time(), "error": _one_line(exc)}
        _write_atomic(workdir / f"rank{rank}.err", json.dumps(record).encode())
        if os.environ.get("HPLAN_DEBUG"):  # one line by default (the parent's); HPLAN_DEBUG=1 adds tracebacks
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a broken process group can block it
    # The result is on disk and the group is gone: skip interpreter teardown here too. Destroying gloo's C++
    # threads at exit aborted a finished rank now and then ("terminate called without an active exception",
    # SIGABRT), which the launcher rightly reports as a dead rank although it trained to the end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _arrive(store: Any, world: int) -> None:
    """Wait (up to RENDEZVOUS_S) until every rank has started, so a short collective timeout is not spent on
    a peer still importing torch: on a busy machine rank start-up differs by many seconds."""
    store.add("hplan/arrived", 1)
    deadline = time.monotonic() + RENDEZVOUS_S
    while int(store.add("hplan/arrived", 0)) < world:
        if time.monotonic() > deadline:
            raise HplanError(f"not all {world} ranks started within {RENDEZVOUS_S:g} s; the machine is overloaded "
                             "or a rank failed to start (see its stderr)")
        time.sleep(0.05)


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this rank when the launching process dies (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:  # not glibc/Linux: the parent's watchdog still stops us
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)



def _one_line(exc: BaseException) -> str:
    from hplan.blame import describe_user_error, located

    if isinstance(exc, HplanError):  # hplan's own refusals already speak to the user (and say where, if theirs)
        return located(" ".join(str(exc).split()), exc)
    blamed = describe_user_error(exc)
    if blamed is not None:  # the user's workload raised it: say where, as the one-process CLI does
        return blamed if len(blamed) <= 400 else blamed[:397] + "..."
    return _text(exc)


def _text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
