"""Workload code that misbehaves (issue 30): sys.exit in a factory, a thread left running, os.chdir, a CUDA device
on a machine without one. Each is an error in the user's code or input: one line, exit 2, and outputs either
complete (the thread) or not written at all."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hplan.cli import app

runner = CliRunner()
TIMEOUT_S = 240
"""A run that hangs (a thread keeping the process alive, a rank waiting on a dead peer) fails the test instead."""

WORKLOAD = textwrap.dedent('''
    import os
    import sys
    import threading
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    import hplan


    def spin():
        while True:
            time.sleep(0.05)


    class Flusher(threading.Thread):
        def run(self):
            while True:
                time.sleep(0.05)


    def workload(where: str = "none", code: int = 0, at: int = 1, rank: int = -1, chdir: str = "",
                 chdir_in: str = "model", thread: str = "") -> hplan.Workload:
        def hit(here):
            return where == here and (rank < 0 or dist.is_initialized() and dist.get_rank() == rank)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(8, 8)

            def forward(self, x):
                if hit("forward"):
                    sys.exit(code)  # LINE forward
                return self.a(x)

        def model():
            if chdir and chdir_in == "model":
                os.chdir(chdir)
            if thread == "target":
                threading.Thread(target=spin, name="spinner").start()
            elif thread == "subclass":
                Flusher(name="flusher").start()
            if hit("model"):
                sys.exit(code)  # LINE model
            return Net()

        def batch(step):
            if hit("batch") and step == at:
                sys.exit(code)  # LINE batch
            return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))

        calls = []

        def loss(m, x):
            calls.append(1)
            if chdir and chdir_in == "loss":
                os.chdir(chdir)
            if hit("loss") and len(calls) > at:
                sys.exit(code)  # LINE loss
            if hit("_exit") and len(calls) > at:
                os._exit(code)
            return m(x).pow(2).mean()

        def optimizer(params):
            if hit("optimizer"):
                sys.exit(code)  # LINE optimizer
            return torch.optim.AdamW(params, lr=1e-3)

        return hplan.Workload(model=model, batch=batch, loss=loss, optimizer=optimizer, name="misbehaves")
''')


def line_of(tag: str) -> int:
    return next(i for i, text in enumerate(WORKLOAD.splitlines(), start=1) if text.endswith(f"# LINE {tag}"))


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """The workload file, its trace, a one-GPU plan and a two-rank plan."""
    a = tmp_path_factory.mktemp("misbehaves")
    (a / "wl.py").write_text(WORKLOAD)
    for argv in (["trace", f"{a / 'wl.py'}:workload", "-o", a / "t.parquet"],
                 ["plan", a / "t.parquet", "--gpu-mem", "min", "-o", a / "p.json"],
                 ["plan", a / "t.parquet", "--gpu-mem", "1GB", "--gpu", "cpu", "--gpus", "2", "-o", a / "p2.json"]):
        result = runner.invoke(app, [str(x) for x in argv])
        assert result.exit_code == 0, result.output
    return a


def one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    return lines[0]


def hplan_process(argv: list, *, cwd: Path, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", "from hplan.cli import main; main()", *map(str, argv)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


# sys.exit in the workload's code ([Note: exits in workload code] in hplan.blame)

STEP_OF = {"loss": 1, "forward": 0, "batch": 1, "model": None, "optimizer": None}


@pytest.mark.parametrize("code", [0, 3])
@pytest.mark.parametrize("where", list(STEP_OF))
def test_sys_exit_in_a_factory_stops_hplan_run_with_exit_2_naming_file_line_and_step(made, tmp_path, where, code):
    metrics = tmp_path / "m.parquet"
    result = runner.invoke(app, ["run", f"{made / 'wl.py'}:workload", "--plan", str(made / "p.json"), "--steps", "4",
                                 "--metrics", str(metrics), "--set", f"where={where}", "--set", f"code={code}"])
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert f"called sys.exit({code})" in line, line
    step = STEP_OF[where]
    assert f"(wl.py:{line_of(where)}{'' if step is None else f', step {step}'})" in line, line
    assert not metrics.exists()


@pytest.mark.parametrize("where", ["loss", "forward", "batch", "model", "optimizer"])
def test_sys_exit_in_a_factory_stops_hplan_trace_with_exit_2(made, tmp_path, where):
    out = tmp_path / "t.parquet"
    result = runner.invoke(app, ["trace", f"{made / 'wl.py'}:workload", "-o", str(out), "--set", f"where={where}"])
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert "called sys.exit(0)" in line and f"wl.py:{line_of(where)}" in line, line
    assert not out.exists()


def test_sys_exit_while_importing_the_workload_file_is_exit_2(tmp_path):
    (tmp_path / "w.py").write_text("import sys\nsys.exit(0)\n")
    result = runner.invoke(app, ["trace", f"{tmp_path / 'w.py'}:workload", "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 2, result.output
    assert "called sys.exit(0)" in one_line(result) and "(w.py:2)" in result.stderr


def test_sys_exit_in_a_hook_outside_the_factories_is_blamed_too(tmp_path):
    """A SystemExit hplan's factory wrappers do not see (raised from a hook torch calls) is caught by the CLI."""
    from hplan.blame import describe_user_error, register_user_file

    (tmp_path / "hook.py").write_text("import sys\n\ndef hook(*args):\n    sys.exit(5)\n")
    register_user_file(tmp_path / "hook.py")
    import importlib.util

    spec = importlib.util.spec_from_file_location("hook_for_exit", tmp_path / "hook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as info:
        module.hook()
    assert describe_user_error(info.value).startswith("error in your workload: it called sys.exit(5)")
    assert "(hook.py:4)" in describe_user_error(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("call", ["loss", "_exit"])
def test_a_rank_that_exits_stops_every_rank_with_one_line(made, tmp_path, call):
    """sys.exit(0) in rank 1's loss, or os._exit(0) (which cannot be caught): one line naming rank 1, exit 2, and no
    hang (the launcher used to take a rank that exited 0 without a result for a finished one)."""
    start = time.monotonic()
    done = hplan_process(["run", f"{made / 'wl.py'}:workload", "--plan", made / "p2.json", "--steps", "3", "--nproc",
                          "2", "--set", f"where={call}", "--set", "rank=1"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: rank 1 of 2 "), lines
    if call == "loss":
        assert "called sys.exit(0)" in lines[0] and f"(wl.py:{line_of('loss')}, step" in lines[0], lines
    else:
        assert "exited with code 0 before returning its result" in lines[0], lines
    assert time.monotonic() - start < 120


# A thread left running (hplan.cli.threads)

@pytest.mark.parametrize("kind,shown", [("target", "'spinner' (running wl.py:"), ("subclass", "'flusher' (running wl.py:")])
def test_a_thread_the_workload_leaves_running_is_named_after_a_complete_run(made, tmp_path, kind, shown):
    metrics = tmp_path / "m.parquet"
    done = hplan_process(["run", f"{made / 'wl.py'}:workload", "--plan", made / "p.json", "--steps", "2", "--metrics",
                          metrics, "--set", f"thread={kind}"], cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error in your workload: it left 1 thread(s) running: ") and shown in last, done.stderr
    assert "outputs are complete" in last
    assert "2 steps from step 0" in done.stderr  # the run's own summary came first
    import pandas as pd

    assert sorted(set(pd.read_parquet(metrics)["step"])) == [0, 1]


@pytest.mark.slow
def test_a_thread_left_running_by_trace_is_named_and_the_trace_written(made, tmp_path):
    out = tmp_path / "t.parquet"
    done = hplan_process(["trace", f"{made / 'wl.py'}:workload", "-o", out, "--json", "--set", "thread=target"],
                         cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "'spinner' (running wl.py:" in done.stderr and "outputs are complete" in done.stderr
    assert '"workload": "misbehaves"' in done.stdout
    from hplan.artifacts import Trace

    assert Trace.load(out).workload == "misbehaves"


def test_threads_are_described_by_their_code():
    import threading

    from hplan.cli.threads import describe, lingering

    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="w1")
    worker.start()
    try:
        assert worker in lingering(grace_s=0.05)
        assert describe(worker).startswith("'w1' (running threading.py:")
    finally:
        stop.set()
        worker.join()
    assert worker not in lingering(grace_s=0.05)


# os.chdir in the workload: every path given is absolute before its code runs

@pytest.mark.parametrize("where", ["model", pytest.param("loss", marks=pytest.mark.slow)])  # CI time: one fast
def test_paths_given_relative_survive_a_workload_that_changes_folder(made, tmp_path, where):
    run_dir = tmp_path / "here"
    elsewhere = tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    for name in ("wl.py", "p.json"):
        (run_dir / name).write_bytes((made / name).read_bytes())
    chdir = ["--set", f"chdir={elsewhere}", "--set", f"chdir_in={where}"]
    done = hplan_process(["run", "wl.py:workload", "--plan", "p.json", "--steps", "2", "--metrics", "m.parquet",
                          "--checkpoint", "ck", *chdir], cwd=run_dir, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (run_dir / "m.parquet").is_file() and (run_dir / "ck" / "latest.json").is_file()
    assert not list(elsewhere.iterdir())
    done = hplan_process(["trace", "wl.py:workload", "-o", "t.parquet", *chdir], cwd=run_dir, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (run_dir / "t.parquet").is_file() and not list(elsewhere.iterdir())


def test_an_error_after_the_workload_changed_folder_is_still_blamed_on_its_line(made, tmp_path):
    """The model factory changes folder, then the optimizer factory raises: still the workload's line, exit 2 (blame
    finds the file by the absolute name importlib gives its code, whatever the current folder)."""
    run_dir, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    (run_dir / "wl.py").write_text(WORKLOAD.replace("sys.exit(code)  # LINE optimizer",
                                                    "raise ValueError('no')  # LINE optimizer"))
    done = hplan_process(["trace", "wl.py:workload", "-o", "t.parquet", "--set", f"chdir={elsewhere}", "--set",
                          "where=optimizer"], cwd=run_dir, timeout=120)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.strip().endswith(f"(wl.py:{line_of('optimizer')})"), done.stderr


def test_nvme_dir_is_made_absolute_before_the_workload_runs(made, tmp_path, monkeypatch):
    """The disk tier's folder (and every other path) reaches the executor absolute."""
    import hplan.executor

    seen = {}

    def fake_run(workload, plan, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(hplan.executor, "run_training", fake_run)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nv").mkdir()
    (tmp_path / "p.json").write_bytes((made / "p.json").read_bytes())
    runner.invoke(app, ["run", f"{made / 'wl.py'}:workload", "--plan", "p.json", "--steps", "1", "--metrics",
                        "m.parquet", "--checkpoint", "ck", "--nvme-dir", "nv"])
    for key in ("metrics_path", "checkpoint_dir", "nvme_dir"):
        assert Path(seen[key]).is_absolute() and Path(seen[key]).parent == tmp_path, (key, seen[key])


# --device cuda on a machine without CUDA: refused before anything is built

@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("argv", [
    ["trace", "{spec}", "-o", "{d}/t.parquet", "--device", "cuda"],
    ["run", "{spec}", "--plan", "{p}", "--steps", "2", "--device", "cuda"],
    ["run", "{spec}", "--plan", "{p}", "--steps", "2", "--device", "cuda:0"],
    ["run", "{spec}", "--plan", "{p2}", "--steps", "2", "--device", "cuda", "--nproc", "2"],
], ids=["trace", "run", "run-index", "run-ranks"])
def test_cuda_without_cuda_is_refused_before_the_workload_is_loaded(made, tmp_path, monkeypatch, argv):
    import hplan.specs
    import hplan.workload

    called = []
    monkeypatch.setattr(hplan.specs, "load_workload", lambda *a, **k: called.append("load") or 1 / 0)
    monkeypatch.setattr(hplan.workload.Workload, "build_model", lambda self: called.append("build") or 1 / 0)
    names = {"spec": f"{made / 'wl.py'}:workload", "d": tmp_path, "p": made / "p.json", "p2": made / "p2.json"}
    result = runner.invoke(app, [a.format(**names) for a in argv])
    assert result.exit_code == 2, result.output
    assert "needs an NVIDIA GPU" in one_line(result) and called == []


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_the_library_refuses_cuda_before_building_the_model(made, monkeypatch):
    import hplan.workload
    from hplan.artifacts import Plan
    from hplan.errors import HplanError
    from hplan.executor import run_training
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    workload = load_workload(f"{made / 'wl.py'}:workload")
    called = []
    monkeypatch.setattr(hplan.workload.Workload, "build_model", lambda self: called.append("build") or 1 / 0)
    with pytest.raises(HplanError, match="needs an NVIDIA GPU"):
        trace_workload(workload, device="cuda")
    with pytest.raises(HplanError, match="needs an NVIDIA GPU"):
        run_training(workload, Plan.load(made / "p.json"), steps=1, device="cuda")
    assert called == []
