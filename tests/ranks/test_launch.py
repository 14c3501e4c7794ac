"""executor.ranks.launch: N ranks that succeed return their results; a rank that raises, dies or hangs fails the
call promptly with one line naming it, and no rank process outlives the call.

"Promptly" is measured from the moment the failing rank fails (it writes a timestamp just before), not from
the call: starting two ranks that import torch takes 3-5 s on an idle 2-core machine and over 20 s when
the machine is shared, which says nothing about failure handling."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from hplan.errors import HplanError
from hplan.executor.ranks.launch import RankInfo, launch

REPO = Path(__file__).resolve().parents[2]


def _rank_processes() -> list[psutil.Process]:
    """Children of this test process that are ranks (multiprocessing's resource tracker may stay: it is ours)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def _sum_ranks(info: RankInfo, scale: float) -> tuple[int, int, float, int]:
    x = torch.tensor([float(info.rank + 1) * scale])
    dist.all_reduce(x)
    return info.rank, info.world_size, float(x.item()), torch.get_num_threads()


DETECT_S = 10.0
"""Failure to HplanError: the survivors' grace period (2 s), SIGTERM/SIGKILL (≤ 1 s) and exits, with room."""


def _fail_on_rank1(info: RankInfo, how: str, stamp: str) -> None:
    x = torch.ones(4)
    dist.all_reduce(x)
    if info.rank == 1:
        Path(stamp).write_text(repr(time.time()))
        if how == "raise":
            raise ValueError("boom on purpose")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(3)
        if how == "hang":
            time.sleep(120)
    for _ in range(100):  # rank 0 keeps calling collectives: it must not hang on the dead peer
        dist.all_reduce(x)
        time.sleep(0.05)


def _hang_on_rank1(info: RankInfo) -> int:
    if info.rank == 1:
        time.sleep(120)
    return info.rank


def _since(stamp: Path) -> float:
    return time.time() - float(stamp.read_text())


def test_two_ranks_return_their_results(monkeypatch):
    """... through a folder of this call's own ([Note: launch workdir]): new, 0700, ours, removed afterwards."""
    from hplan.executor.ranks import launch as module

    made: list[Path] = []

    def recorded() -> Path:
        made.append(original())
        st = made[-1].lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 == 0o700 and st.st_uid == os.geteuid()
        return made[-1]

    original = module._private_workdir
    monkeypatch.setattr(module, "_private_workdir", recorded)
    results = launch(_sum_ranks, 0.5, nprocs=2, timeout_s=60)
    assert results == [(0, 2, 1.5, 1), (1, 2, 1.5, 1)]
    assert _rank_processes() == []
    assert len(made) == 1 and not made[0].exists()


def test_a_temp_folder_that_does_not_keep_folders_private_is_refused(tmp_path, monkeypatch):
    """The rank results are pickles: a workdir others could write is refused before any rank starts."""
    import tempfile

    def shared(prefix: str = "") -> str:
        folder = tmp_path / f"{prefix}shared"
        folder.mkdir(mode=0o777)
        folder.chmod(0o777)
        return str(folder)

    monkeypatch.setattr(tempfile, "mkdtemp", shared)
    with pytest.raises(HplanError, match=r"does not keep new folders private \(mode 0o777\); point TMPDIR"):
        launch(_sum_ranks, 1.0, nprocs=2, timeout_s=30)
    assert _rank_processes() == [] and not (tmp_path / "hplan-launch-shared").exists()


def test_an_env_launch_whose_master_port_is_taken_is_one_line_naming_the_port():
    """RANK/WORLD_SIZE/MASTER_* set by hand (or a scheduler) and MASTER_PORT held by another process: rank 0
    cannot listen there — an HplanError naming the port, not torch's DistNetworkError."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        code = ("from hplan.errors import HplanError\nfrom hplan.executor.ranks.launch import launch\n"
                "try:\n    launch(print, collective_timeout_s=20)\nexcept HplanError as exc:\n    print(exc)\n")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"MASTER_PORT {port} on 127.0.0.1 is already in use by another process, so rank 0 "
                                   "cannot listen on it; set MASTER_PORT to a free port (torchrun: --master-port, or "
                                   "--standalone to pick one)"), done.stdout


# kill and exit each cost a spawn (~6 s): slow; tests/ranks/test_dist_executor.py's dying rank exits in the fast suite
@pytest.mark.parametrize("how, expected", [
    ("raise", "rank 1 of 2 failed: ValueError: boom on purpose"),
    pytest.param("kill", "rank 1 of 2 died from signal SIGKILL without raising", marks=pytest.mark.slow),
    pytest.param("exit", "rank 1 of 2 exited with code 3 without raising", marks=pytest.mark.slow),
])
def test_a_failing_rank_is_named_promptly(how, expected, tmp_path):
    stamp = tmp_path / "failed_at"
    with pytest.raises(HplanError) as err:
        launch(_fail_on_rank1, how, str(stamp), nprocs=2, timeout_s=120, collective_timeout_s=60)
    assert _since(stamp) < DETECT_S
    assert expected in str(err.value)
    assert "\n" not in str(err.value)
    assert _rank_processes() == []


def test_collective_timeout_fails_the_waiting_rank(tmp_path):
    """Rank 1 stops calling collectives (alive, sleeping): rank 0's all_reduce times out after 5 s."""
    stamp = tmp_path / "hung_at"
    with pytest.raises(HplanError, match=r"rank 0 of 2 failed: RuntimeError: .*Timed out waiting 5000ms"):
        launch(_fail_on_rank1, "hang", str(stamp), nprocs=2, timeout_s=120, collective_timeout_s=5)
    assert _since(stamp) < 5 + DETECT_S
    assert _rank_processes() == []


def test_watchdog_stops_a_hung_rank():
    """Rank 1 never returns; at timeout_s the watchdog stops it (and rank 0 too if the machine was too busy
    for it to have finished starting)."""
    before = time.monotonic()
    with pytest.raises(HplanError, match=r"ranks \[(0, )?1\] of 2 still running after 8 s \(launch watchdog\)"):
        launch(_hang_on_rank1, nprocs=2, timeout_s=8)
    assert time.monotonic() - before < 8 + DETECT_S
    assert _rank_processes() == []


def test_bad_requests_are_refused_before_spawning():
    with pytest.raises(HplanError, match="nprocs"):
        launch(_sum_ranks, 1.0, nprocs=0)
    with pytest.raises(HplanError, match="module-level function"):
        launch(lambda info: info.rank, nprocs=2, timeout_s=30)
    with pytest.raises(HplanError, match="collective_timeout_s"):
        launch(_sum_ranks, 1.0, nprocs=2, collective_timeout_s=0)
    assert _rank_processes() == []


@pytest.mark.slow
def test_under_torchrun_every_rank_returns_all_results(tmp_path):
    """torchrun sets RANK/WORLD_SIZE/MASTER_*: launch joins that group instead of spawning."""
    script = tmp_path / "main.py"
    script.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_launch import _sum_ranks\n"
        "from hplan.executor.ranks.launch import launch\n"
        "results = launch(_sum_ranks, 1.0, collective_timeout_s=30)\n"
        "open(f'out{os.environ[\"RANK\"]}.json', 'w').write(json.dumps(results))\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in (0, 1)]
    assert outs[0] == outs[1] == [[0, 2, 3.0, 1], [1, 2, 3.0, 1]]  # every rank gets every result; 1 thread


def _typed_result(info: RankInfo) -> dict:
    weights = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) * (info.rank + 1), "e": torch.empty(0, 4),
               "big": torch.full((300_000,), float(info.rank))}
    return {"rank": info.rank, "betas": (0.9, 0.999), "inf": float("inf"), "none": None, "weights": weights}


def _unencodable_result(info: RankInfo) -> object:
    return {"fine": 1, "bad": RankInfo}


def test_rank_results_come_back_as_json_never_unpickled(monkeypatch):
    """[Note: launch workdir]: results with tensors (raw files), tuples and infinities come back exactly, with every
    unpickling entry point of this process made to fail."""
    import pickle

    def forbidden(*args, **kwargs):
        raise AssertionError("the parent unpickled a rank's result")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    results = launch(_typed_result, nprocs=2, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["rank"] == rank and type(r["betas"]) is tuple and r["inf"] == float("inf") and r["none"] is None
        w = r["weights"]
        assert w["w"].dtype == torch.bfloat16 and torch.equal(w["w"], torch.arange(6).reshape(2, 3).bfloat16() *
                                                               (rank + 1))
        assert w["e"].shape == (0, 4) and torch.equal(w["big"], torch.full((300_000,), float(rank)))


def test_a_result_json_cannot_carry_is_one_line_naming_it():
    with pytest.raises(HplanError, match=r"the result of rank \d\.bad holds a type, and hplan hands it back as JSON"):
        launch(_unencodable_result, nprocs=2, timeout_s=120)
