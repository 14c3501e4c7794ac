"""Many-rank runs keep one process's promises (issue 22): the checkpoint folder's lock, every output checked before
step 1, hostile checkpoints refused on ranks too, and the launch mistakes a user makes (a taken MASTER_PORT, a world
of one, --nproc with a disk-tier plan) in one line. (No non-finite state saved: tests/ranks/test_dist_nonfinite.py.)

Most refusals happen in the launching process before any rank starts, so they cost no spawn; the runs that train
(a real lock race, torchrun) spawn 2 gloo ranks with timeouts, so a dead rank never hangs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dist_hplan
from dist_hplan import error_lines, finite_everywhere, hplan_cli
import hostile
from hplan.cli import app
from hplan.errors import HplanError
from hplan.executor import run_training
from hplan.executor.checkpoints.checkpoint_dir import CheckpointDir, verify
from hplan.executor.ranks import dist_checkpoint
from hplan.executor.ranks.dist_train import run_distributed
from hplan.executor.ranks.launch import launch
from hplan.specs import load_workload
from hplan.tracer import trace_workload

SPEC = "gpt:tiny"
runner = CliRunner()



@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A 2-rank plan of gpt:tiny (1/2/2), a one-GPU plan, one with a disk tier, and a 2-rank checkpoint of 2
    steps."""
    root = tmp_path_factory.mktemp("dist-guards")
    trace = trace_workload(load_workload(SPEC), device="cpu", iters=3)
    dist_hplan.plan_at(trace, (1, 2, 2)).save(root / "p2.json")
    from hplan.artifacts import Hardware
    from hplan.planner import PlanOptions, default_slack, make_plan, min_gpu_bytes

    floor, slack = min_gpu_bytes(trace, activations="keep").gpu_bytes, default_slack(trace)
    make_plan(trace, Hardware(gpu="cpu", gpu_bytes=floor + trace.model_bytes // 4, slack_bytes=slack,
                              overlap=False)).save(root / "p1.json")
    disk = make_plan(trace, Hardware(gpu="cpu", gpu_bytes=floor, slack_bytes=slack, overlap=False,
                                     host_bytes=trace.model_bytes // 5, nvme_bytes=10**9), PlanOptions(solver="fast"))
    assert disk.nvme_chunks()
    disk.save(root / "p3.json")
    run_distributed(SPEC, _plan(root), nproc=2, steps=2, checkpoint_dir=root / "ck", timeout_s=300)
    assert dist_checkpoint.read_pointer(root / "ck")["latest"] == "step-000002"
    return root


def _plan(root: Path, name: str = "p2.json"):
    from hplan.artifacts import Plan

    return Plan.load(root / name)


def _copy(root: Path, tmp_path: Path) -> Path:
    shutil.copytree(root / "ck", tmp_path / "ck")
    return tmp_path / "ck"


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else "dir" for p in folder.rglob("*")}


# -- the folder's lock and outputs ------------------------------------------------------------------------------

def test_a_folder_locked_by_a_one_process_run_is_refused_before_any_rank_starts(root, tmp_path):
    ck = _copy(root, tmp_path)
    before = _snapshot(ck)
    with CheckpointDir(ck, resume=False, overwrite=True):
        for resume, overwrite in ((False, True), (True, False)):
            with pytest.raises(HplanError, match=r"checkpoint directory .* is in use by another hplan run"):
                run_distributed(SPEC, _plan(root), nproc=2, steps=3, checkpoint_dir=ck, resume=resume,
                                overwrite=overwrite, timeout_s=1)  # 1 s: spawning would fail the test
    assert _snapshot(ck) == before


def test_a_many_rank_claim_holds_the_one_lock_against_one_process_runs(root, tmp_path):
    """The claim of a many-rank run is DIR/.lock itself: a one-process run reaching the lock (with --overwrite, or
    fresh in an empty folder) is refused while it is held, and proceeds once it is released."""
    ck, empty = _copy(root, tmp_path), tmp_path / "empty"
    before = _snapshot(ck)
    held = [dist_checkpoint.claim(ck, _plan(root), 2, resume=True, overwrite=False),
            dist_checkpoint.claim(empty, _plan(root), 2, resume=False, overwrite=False)]
    try:
        assert held[0].resume_from == "step-000002" and held[0].warning is None and held[1].resume_from is None
        for folder, options in ((ck, {"overwrite": True}), (empty, {})):
            with pytest.raises(HplanError, match="is in use by another hplan run"):
                CheckpointDir(folder, resume=False, **options)
    finally:
        for claim in held:
            claim.close()
    assert _snapshot(ck) == before and sorted(p.name for p in empty.iterdir()) == [".lock"]
    CheckpointDir(ck, resume=False, overwrite=True).close()
    CheckpointDir(empty, resume=False).close()


@pytest.mark.slow
def test_a_running_many_rank_run_and_a_one_process_run_never_share_a_folder(root, tmp_path):
    """The race of issue 22, both ways, with real runs: while a 2-rank --overwrite run trains in the folder, a
    one-process --overwrite run and a second 2-rank run exit 2 naming the lock, and the 2-rank run's checkpoints
    stay intact (it is then killed: what it committed verifies). And while a one-process run trains there, a
    2-rank --overwrite run exits 2."""
    ck = _copy(root, tmp_path)
    many = [sys.executable, "-c", "from hplan.cli import main; main()", "run", SPEC, "--plan", str(root / "p2.json"),
            "--steps", "100000", "--nproc", "2", "--checkpoint", str(ck), "--overwrite"]
    proc = subprocess.Popen(many, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while dist_checkpoint.read_pointer(ck)["global_step"] != 1 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        one = hplan_cli("run", SPEC, "--plan", str(root / "p1.json"), "--steps", "2", "--checkpoint", str(ck),
                   "--overwrite")
        assert one.returncode == 2 and "is in use by another hplan run" in one.stderr, one.stderr
        other = hplan_cli("run", SPEC, "--plan", str(root / "p2.json"), "--steps", "2", "--nproc", "2", "--checkpoint",
                     str(ck), "--overwrite")
        assert other.returncode == 2 and "is in use by another hplan run" in other.stderr, other.stderr
        assert proc.poll() is None, proc.communicate()  # still training: the refusals were its lock's
    finally:
        proc.kill()
        proc.wait()
    time.sleep(2)  # its ranks die with it (PR_SET_PDEATHSIG)
    pointer = dist_checkpoint.read_pointer(ck)
    assert pointer["global_step"] > 1 and pointer["previous"] == f"step-{pointer['global_step'] - 1:06d}"
    for name in (pointer["latest"], pointer["previous"]):
        assert verify(ck / name).info["world_size"] == 2
    # The other way round: a one-process run holds the folder while it trains.
    one_ck = tmp_path / "one"
    slow = {"HPLAN_TEST_SAVE_PAUSE_S": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "from hplan.cli import main; main()", "run", SPEC, "--plan",
                             str(root / "p1.json"), "--steps", "6", "--checkpoint", str(one_ck)],
                            env={**os.environ, **slow}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not list(one_ck.glob("step-*")) and proc.poll() is None:
            time.sleep(0.1)
        done = hplan_cli("run", SPEC, "--plan", str(root / "p2.json"), "--steps", "2", "--nproc", "2", "--checkpoint",
                    str(one_ck), "--overwrite")
        assert done.returncode == 2 and "is in use by another hplan run" in done.stderr, done.stderr
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    finally:
        proc.kill()
    assert verify(one_ck / "step-000006").global_step == 6


def test_a_stopped_many_rank_run_removes_an_unfinished_save_under_its_lock_then_releases_it(root, tmp_path,
                                                                                             monkeypatch):
    """[Note: stopped many-rank runs] without spawning: the ranks are "stopped" (launch raises what `hplan run`
    raises on SIGTERM, a BaseException) after one left half a save; the launching process removes its temp folder
    while it still holds the lock, keeps the committed folders, and releases the lock."""
    import hplan.executor.ranks.launch as launch_module
    from hplan.cli.run_cmd import Stopped
    from hplan.executor.checkpoints.checkpoint_dir import lock

    ck = _copy(root, tmp_path)
    committed = _snapshot(ck)

    def stopped(*args, **kwargs):
        with pytest.raises(HplanError, match="is in use by another hplan run"):
            lock(ck)  # the launching process holds the folder while its ranks run
        (ck / ".step-000003.abc123.tmp").mkdir()  # rank 0 was writing step 3 when the ranks were stopped
        (ck / ".step-000003.abc123.tmp" / "__0_0.distcp").write_bytes(b"half a shard")
        (ck / ".model.pt.xyz.tmp").write_bytes(b"half the final weights")
        raise Stopped(15)

    monkeypatch.setattr(launch_module, "launch", stopped)
    with pytest.raises(Stopped):
        run_distributed(SPEC, _plan(root), nproc=2, steps=4, checkpoint_dir=ck, resume=True)
    assert _snapshot(ck) == committed
    os.close(lock(ck))  # released


@pytest.mark.slow
@pytest.mark.parametrize("signum", [15, 1], ids=["SIGTERM", "SIGHUP"])
def test_hplan_run_nproc_stopped_by_a_signal_stops_every_rank_and_leaves_nothing_behind(root, tmp_path, signum):
    """`hplan run --nproc 2` signalled while rank 0 is inside a save (HPLAN_TEST_SAVE_PAUSE_S holds it between the
    shards and the manifest): one line, exit 128 + the signal, both ranks gone, the half-written step folder
    removed, the last committed checkpoint intact and finite, the lock released and launch's private folder
    removed; the run then resumes from it."""
    import signal

    ck, tmp = tmp_path / "ck", tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-c", "from hplan.cli import main; main()", "run", SPEC, "--plan", str(root / "p2.json"),
           "--steps", "100000", "--nproc", "2", "--checkpoint", str(ck)]
    env = {**os.environ, "COLUMNS": "300", "TMPDIR": str(tmp), "HPLAN_TEST_SAVE_PAUSE_S": "2"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (ck.is_dir() and list(ck.glob(".step-000002.*.tmp"))) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        ranks = _ranks_of(proc.pid)
        assert len(ranks) == 2, ranks
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signum, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith(f"stopped by {signal.Signals(signum).name} (every rank stopped): "
                                                   "nothing of the step under way was saved"), stderr
    assert not [pid for pid in ranks if _alive(pid)]
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "step-000001"]
    assert verify(ck / "step-000001").global_step == 1 and finite_everywhere(ck / "step-000001")
    assert list(tmp.iterdir()) == []  # launch's private folder (rank results) is gone too
    report = run_distributed(SPEC, _plan(root), nproc=2, steps=2, checkpoint_dir=ck, resume=True, timeout_s=300)
    assert report.first_step == 1 and dist_checkpoint.read_pointer(ck)["latest"] == "step-000002"


def _ranks_of(pid: int) -> list[int]:
    """The spawned ranks of process `pid` (its children running multiprocessing's spawn entry point, not its
    resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    ranks = []
    for child in children:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            ranks.append(child)
    return ranks


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_model_pt_that_cannot_be_written_is_refused_before_step_1(root, tmp_path):
    """DIR/model.pt, written at the end, is checked before any rank starts (before issue 22: after training)."""
    ck = tmp_path / "ck"
    (ck / "model.pt").mkdir(parents=True)
    with pytest.raises(HplanError, match=r"model\.pt is a directory, where this run writes its final weights"):
        run_distributed(SPEC, _plan(root), nproc=2, steps=2, checkpoint_dir=ck, timeout_s=1)
    (ck / "model.pt").rmdir()
    os.mkfifo(ck / "model.pt")
    with pytest.raises(HplanError, match=r"model\.pt is a FIFO"):
        run_distributed(SPEC, _plan(root), nproc=2, steps=2, checkpoint_dir=ck, timeout_s=1)
    assert sorted(p.name for p in ck.iterdir()) == ["model.pt"]  # nothing created, not even the lock
    (ck / "model.pt").unlink()
    (ck / "model.pt").write_bytes(b"weights of an earlier run")
    with pytest.raises(HplanError, match=r"model\.pt holds the final weights of an earlier run: pass `overwrite`"):
        run_distributed(SPEC, _plan(root), nproc=2, steps=2, checkpoint_dir=ck, timeout_s=1)


# -- hostile checkpoints on ranks ([Note: safe DCP metadata]) -----------------------------------------------------

@pytest.mark.parametrize("kind", ["size_of_400000_dims", "region_counted_per_reference", "item_outside_the_folder"])
def test_a_sharded_checkpoint_with_a_forged_index_is_refused_before_any_rank_starts(root, tmp_path, kind):
    ck = _copy(root, tmp_path)
    hostile.plant_index_attack(ck / "step-000002", kind)
    result = runner.invoke(app, ["run", SPEC, "--plan", str(root / "p2.json"), "--steps", "3", "--nproc", "2",
                                 "--checkpoint", str(ck), "--resume"])
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(ck / "step-000002" / "dcp.json") in message and hostile.INDEX_ATTACKS[kind][1] in message, message


def test_a_sharded_checkpoint_without_the_index_is_refused_before_any_rank_starts(root, tmp_path):
    ck = _copy(root, tmp_path)
    (ck / "step-000002" / "dcp.json").unlink()
    hostile.reseal(ck / "step-000002")
    result = runner.invoke(app, ["run", SPEC, "--plan", str(root / "p2.json"), "--steps", "3", "--nproc", "2",
                                 "--checkpoint", str(ck), "--resume"])
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "has no dcp.json in its manifest" in message, message


@pytest.mark.slow
def test_a_sharded_checkpoint_whose_metadata_pickle_runs_code_resumes_without_opening_it(root, tmp_path):
    """Every rank reads the JSON index and raw bytes: a code-running `.metadata` (proved) is never opened; the
    2-rank resume continues from step 2 and no code runs."""
    ck = _copy(root, tmp_path)
    marker = tmp_path / "ran-code"
    hostile.plant_pickle(ck / "step-000002", marker)
    hostile.prove_hostile(ck / "step-000002", marker)
    report = run_distributed(SPEC, _plan(root), nproc=2, steps=3, checkpoint_dir=ck, resume=True, timeout_s=300)
    assert report.first_step == 2 and not marker.exists()


def _load_on_rank(info, plan: dict, folder: str) -> str:
    """A rank loading `folder` directly (past the launcher's checks): what stops it, in words."""
    from hplan.executor.ranks.distributed import DistRun

    workload = load_workload(SPEC)
    model = workload.build_model()

    def setup(run: DistRun) -> None:
        dist_checkpoint.load(str(Path(folder).parent), run, Path(folder).name)

    try:
        with DistRun(model, workload.optimizer(model.parameters()), dist_hplan.Plan.from_dict(plan),
                     batch_example=workload.batch(0), on_setup=setup):
            return "loaded"
    except HplanError as exc:
        return str(exc)


@pytest.mark.slow
def test_a_rank_loading_a_hostile_folder_itself_refuses_it_too(root, tmp_path):
    """The ranks read the same checked index: a forged one loaded directly is refused on each rank."""
    ck = _copy(root, tmp_path)
    hostile.plant_index_attack(ck / "step-000002", "size_of_2_to_the_40")
    results = launch(_load_on_rank, _plan(root).to_dict(), str(ck / "step-000002"), nprocs=2, timeout_s=300,
                     collective_timeout_s=120)
    assert all("holds more elements than the data files'" in r for r in results), results


# -- launching ---------------------------------------------------------------------------------------------------

def test_an_env_launch_on_a_taken_master_port_is_exit_2_naming_the_port(root, monkeypatch):
    """RANK/WORLD_SIZE/MASTER_* set by hand with MASTER_PORT taken: rank 0 cannot listen (torch's DistNetworkError
    EADDRINUSE was exit 1 before issue 22)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)):
            monkeypatch.setenv(name, str(value))
        result = runner.invoke(app, ["run", SPEC, "--plan", str(root / "p2.json"), "--steps", "1"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert f"MASTER_PORT {port} on 127.0.0.1 is already in use" in lines[0], lines[0]


@pytest.mark.parametrize("how", ["env", pytest.param("nproc", marks=pytest.mark.slow)])
def test_a_world_of_one_with_a_one_gpu_plan_runs_in_one_process(root, tmp_path, monkeypatch, how):
    """RANK=0 WORLD_SIZE=1 (or --nproc 1) and a one-GPU plan: one process trains it, as without them."""
    args = ["run", SPEC, "--plan", str(root / "p1.json"), "--steps", "2", "--json", "--checkpoint",
            str(tmp_path / "ck")]
    if how == "env":
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    else:
        args += ["--nproc", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    expected = run_training(load_workload(SPEC), _plan(root, "p1.json"), steps=2).losses
    assert json.loads(result.stdout)["losses"] == list(expected)
    assert verify(tmp_path / "ck" / "step-000002").info["world_size"] == 1


def test_a_one_gpu_plan_asked_for_ranks_says_to_drop_nproc(root, tmp_path):
    """--nproc 2 with a one-GPU plan: the fix is dropping --nproc — also for a 3-tier plan with --nvme-dir, where
    before issue 22 the message said to leave --nvme-dir out."""
    (tmp_path / "nv").mkdir()
    nvme = ["--nvme-dir", str(tmp_path / "nv")]
    for plan, extra, expected in (
            ("p1.json", [], "is a plan for one GPU but --nproc 2 asks for 2 ranks: drop --nproc, or re-plan with "
                            "--gpus 2"),
            ("p3.json", nvme, "is a one-process plan with a disk tier (--nvme) but --nproc 2 asks for 2 ranks: drop "
                              "--nproc and keep --nvme-dir"),
            ("p3.json", [], "with a disk tier (--nvme) but --nproc 2 asks for 2 ranks: drop --nproc")):
        result = runner.invoke(app, ["run", SPEC, "--plan", str(root / plan), "--steps", "2", "--nproc", "2", *extra])
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert expected in " ".join(result.stderr.split()), result.stderr
    # A many-rank plan with --nvme-dir keeps its own advice.
    result = runner.invoke(app, ["run", SPEC, "--plan", str(root / "p2.json"), "--steps", "2", "--nproc", "2",
                                 "--nvme-dir", str(tmp_path / "nv")])
    assert result.exit_code == 2 and "leave --nvme-dir out" in result.stderr


@pytest.mark.slow
def test_under_torchrun_rank_0_claims_the_folder(root, tmp_path):
    """torchrun has no launching process of ours: rank 0 takes the lock and every rank refuses together."""
    ck = _copy(root, tmp_path)
    hplan_script = os.path.join(os.path.dirname(sys.executable), "hplan")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", hplan_script,
           "run", SPEC, "--plan", str(root / "p2.json"), "--steps", "3", "--checkpoint", str(ck), "--resume", "--json"]
    with CheckpointDir(ck, resume=False, overwrite=True):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0 and done.stderr.count("is in use by another hplan run") == 2, done.stderr[-3000:]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report["first_step"] == 2 and dist_checkpoint.read_pointer(ck)["latest"] == "step-000003"
