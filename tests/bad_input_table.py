"""The bad-input table's machinery: rows, their setups, the shared inputs and the check every row must pass.

Bad input, as a table: every row must exit 2 with exactly one line on stderr, no traceback, nothing
written anywhere (no output, no temp file, no folder) and every input byte-identical afterwards.

A row is data: a name, the command line (placeholders below) and an optional setup that prepares the
row's own folder. To cover a new case, add a row to the test file of its subject (tests/test_bad_inputs*.py:
trace; plan and the commands that write reports; run; many ranks and disk tiers; hostile artifacts and
checkpoints). Placeholders: {A} the shared artifacts folder, {D} the row's scratch folder, {T} a trace, {P} its
plan, {M} run metrics, {W} the workload spec (a file whose `--set mode=...` makes one of its factories fail),
{WF} that file.

Kept apart from the tables so each subject's file holds rows only, and so the shared inputs (a trace, a plan and
a run of the workload) are made once per test process, not once per file (`artifacts`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hplan.cli import app

runner = CliRunner()
ROW_TIMEOUT_S = 120
"""A row that blocks (a FIFO opened by mistake) fails after this long instead of hanging the suite."""
Setup = Callable[[Path, Path], None]
"""setup(artifacts_dir, row_dir): make the files a row needs inside row_dir."""

WORKLOAD = '''
import torch
from torch import nn
import hplan


def workload(mode: str = "ok", use_bias: bool = True, width: int = 8) -> hplan.Workload:
    if mode == "function":
        raise ValueError("the workload function failed")

    def model():
        if mode == "model":
            raise ValueError("model factory failed")
        return nn.Sequential(nn.Linear(8, width, bias=use_bias), nn.Linear(width, 4))

    def batch(step):
        if mode == "batch":
            raise KeyError("batch factory failed")
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))

    def loss(m, x):
        if mode == "loss":
            raise ZeroDivisionError("loss failed")
        out = m(x)
        return out if mode == "nonscalar" else out.pow(2).mean()

    def optimizer(params):
        if mode == "optimizer":
            raise TypeError("optimizer factory failed")
        return torch.optim.AdamW(params, lr=1e-3)

    return hplan.Workload(model=model, batch=batch, loss=loss, optimizer=optimizer, name="bad-inputs")
'''


@dataclass(frozen=True)
class Row:
    name: str
    argv: str
    """The command line after `hplan`, with the placeholders of the module docstring."""
    setup: Setup | None = None
    process: bool = False
    """Run as a real `hplan` process (real stderr) instead of in-process with CliRunner."""
    needs: str | None = None
    """A module the row needs (skipped without it)."""
    unprivileged: bool = False
    """Relies on permission bits, which do not stop root: skipped when running as root."""


# Setups: each makes one thing in the row's folder.
def fifo(name: str) -> Setup:
    return lambda a, d: os.mkfifo(d / name)


def folder(name: str, mode: int | None = None) -> Setup:
    def make(a: Path, d: Path) -> None:
        (d / name).mkdir(parents=True)
        if mode is not None:
            (d / name).chmod(mode)
    return make


def link(name: str, target: str) -> Setup:
    return lambda a, d: (d / name).symlink_to(target.format(A=a, D=d, T=a / "t.parquet", P=a / "p.json"))


def text(name: str, content: str | bytes) -> Setup:
    def make(a: Path, d: Path) -> None:
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return make


def truncated(name: str, source: str) -> Setup:
    def make(a: Path, d: Path) -> None:
        data = (a / source).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])
    return make


def hardlink(name: str, source: str) -> Setup:
    return lambda a, d: os.link(a / source, d / name)


def edited_plan(name: str, edit: Callable[[dict], None]) -> Setup:
    def make(a: Path, d: Path) -> None:
        plan = json.loads((a / "p.json").read_text())
        edit(plan)
        (d / name).write_text(json.dumps(plan))
    return make


def checkpointed(name: str, damage: Callable[[Path], None] | None = None) -> Setup:
    """A real one-step checkpoint in folder `name` (so only one: no fallback), then `damage` on its step folder."""
    def make(a: Path, d: Path) -> None:
        argv = ["run", f"{a / 'wl.py'}:workload", "--plan", str(a / "p.json"), "--steps", "1", "--checkpoint",
                str(d / name)]
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.stderr
        if damage is not None:
            damage(d / name / "step-000001")
    return make


def _flip_shard_byte(folder: Path) -> None:
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _link_aside(path: Path) -> None:
    """The file moved beside the checkpoint folder, a symbolic link left in its place (checksums still match)."""
    aside = path.parent.parent.parent / path.name
    path.rename(aside)
    path.symlink_to(aside)


def _step_negative(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["global_step"] = -5
    (folder / "manifest.json").write_text(json.dumps(manifest))


_HELD: list[int] = []
"""Lock file descriptors a row's setup holds; closed after the row (see `_release_locks`)."""


def locked(name: str) -> Setup:
    """Folder `name` whose DIR/.lock this test process holds, as a concurrent `hplan run` would."""
    def make(a: Path, d: Path) -> None:
        import fcntl

        (d / name).mkdir()
        fd = os.open(d / name / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _HELD.append(fd)
    return make


def both(*setups: Setup) -> Setup:
    def make(a: Path, d: Path) -> None:
        for setup in setups:
            setup(a, d)
    return make


def two_rank_plan(name: str) -> Setup:
    """A plan of the shared trace for 2 CPU ranks (hplan plan --gpus 2), in the row's folder."""
    def make(a: Path, d: Path) -> None:
        result = runner.invoke(app, ["plan", str(a / "t.parquet"), "--gpu-mem", "1GB", "--gpu", "cpu", "--gpus", "2",
                                     "-o", str(d / name)])
        assert result.exit_code == 0, result.output
    return make


def sharded_checkpoint(name: str, *, world: int) -> Setup:
    """A sharded checkpoint folder whose pointer says it was written by `world` ranks."""
    def make(a: Path, d: Path) -> None:
        (d / name / "step-000001").mkdir(parents=True)
        (d / name / "latest.json").write_text(json.dumps({"schema": "hplan.dist-checkpoint/1", "latest": "step-000001",
                                                          "world_size": world, "global_step": 1}))
    return make


def _unknown_chunk(plan: dict) -> None:
    plan["steps"][0]["reads"] = [*plan["steps"][0]["reads"], 9999]


def _nan_budget(plan: dict) -> None:
    plan["hardware"]["gpu_bytes"] = float("nan")


def _smaller_budget(plan: dict) -> None:
    plan["hardware"]["gpu_bytes"] = plan["hardware"]["gpu_bytes"] // 2


def _huge_step(plan: dict) -> None:
    plan["steps"][1]["non_model_bytes"] = 10**15


def _host_update_dropped(plan: dict) -> None:
    step = next(s for s in plan["steps"] if s["host_updates"])
    step["host_updates"] = step["host_updates"][1:]


def _placement_flipped(plan: dict) -> None:
    chunk = next(iter(plan["optimizer"]))
    plan["optimizer"][chunk] = "gpu" if plan["optimizer"][chunk] == "cpu" else "cpu"


def _initial_unknown(plan: dict) -> None:
    plan["initial_resident"] = [*plan["initial_resident"], 4242]


def _negative_bytes(plan: dict) -> None:
    plan["regions"][0]["bytes"] = -5


def _float_ids(plan: dict) -> None:
    plan["steps"][0]["reads"] = [0.5]


def nvme_plan(name: str, edit: Callable[[dict], None] | None = None) -> Setup:
    """A plan of the shared trace with a disk tier (issue 16): host memory for one chunk's update, the rest on
    NVMe; `edit` changes its JSON."""
    def make(a: Path, d: Path) -> None:
        argv = ["plan", a / "t.parquet", "--gpu-mem", "min", "--cpu-mem", "16KB", "--nvme", "1GB", "-o", d / name]
        result = runner.invoke(app, [str(x) for x in argv])
        assert result.exit_code == 0, result.output
        if edit is not None:
            plan = json.loads((d / name).read_text())
            edit(plan)
            (d / name).write_text(json.dumps(plan))
    return make


def _host_peak_huge(plan: dict) -> None:
    plan["hardware"]["host_bytes"] = 10**15
    plan["summary"]["predicted_host_peak_bytes"] = 10**15


def _read_dropped(plan: dict) -> None:
    step = next(s for s in plan["steps"] if any(ph["nvme_read"] for ph in s["host"]))
    phase = next(ph for ph in step["host"] if ph["nvme_read"])
    phase["nvme_read"] = phase["nvme_read"][1:]


P = "--plan {P} --steps 2"
NV = "--plan {D}/n.json --steps 2"
TRACE_OUT = "-o {D}/t.parquet"


_SHARED: list[Path] = []
"""The shared inputs once made in this process (every row checks it leaves them byte-identical)."""


@pytest.fixture(scope="module", autouse=True)
def _one_click_command():
    """Build the click command once: CliRunner rebuilds it from the Typer app on every call (~0.1 s)."""
    import typer.main
    import typer.testing

    if not hasattr(typer.testing, "_get_command"):  # another Typer: keep its own behaviour
        yield
        return
    command = typer.main.get_command(app)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(typer.testing, "_get_command", lambda _app: command)
        yield


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    while _HELD:
        os.close(_HELD.pop())


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """The shared inputs: the workload file, its trace, a plan for it and one step's metrics."""
    if _SHARED:
        return _SHARED[0]
    a = tmp_path_factory.mktemp("inputs")
    (a / "wl.py").write_text(WORKLOAD)
    spec = f"{a / 'wl.py'}:workload"
    for argv in (["trace", spec, "-o", a / "t.parquet"], ["plan", a / "t.parquet", "--gpu-mem", "min", "-o", a / "p.json"],
                 ["run", spec, "--plan", a / "p.json", "--steps", "1", "--metrics", a / "m.parquet"]):
        result = runner.invoke(app, [str(x) for x in argv])
        assert result.exit_code == 0, result.output
    _SHARED.append(a)
    return a


def snapshot(*folders: Path) -> dict[str, tuple]:
    """Every entry under the folders: regular files by sha256, links by target, others by kind."""
    out: dict[str, tuple] = {}
    for top in folders:
        for root, dirs, files in os.walk(top):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for name in dirs + files:
                path = Path(root, name)
                st = path.lstat()
                if path.is_symlink():
                    out[str(path)] = ("link", os.readlink(path))
                elif path.is_file():
                    out[str(path)] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
                else:
                    out[str(path)] = ("other", st.st_mode >> 12)
    return out


def invoke(argv: list[str], *, process: bool, cwd: Path) -> tuple[int, str]:
    """(exit code, stderr) of `hplan argv`, in-process or as a real process."""
    if not process:
        def hung(signum: int, frame: object) -> None:  # e.g. a FIFO opened by mistake would block forever
            raise TimeoutError(f"hplan {' '.join(argv)} did not finish in {ROW_TIMEOUT_S} s")

        previous = signal.signal(signal.SIGALRM, hung)
        signal.alarm(ROW_TIMEOUT_S)
        try:
            result = runner.invoke(app, argv)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        assert not isinstance(result.exception, TimeoutError), result.exception
        return result.exit_code, result.stderr
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-c", "from hplan.cli import main; main()", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    return done.returncode, done.stderr


def check_row(row: Row, artifacts: Path, tmp_path: Path) -> None:
    """Run one row: exit 2, one line on stderr, no traceback, nothing written, removed or changed."""
    if row.needs:
        pytest.importorskip(row.needs)
    if row.unprivileged and os.geteuid() == 0:
        pytest.skip("permission bits do not stop root")
    d = tmp_path / "row"
    d.mkdir()
    if row.setup is not None:
        row.setup(artifacts, d)
    names = {"A": artifacts, "D": d, "T": artifacts / "t.parquet", "P": artifacts / "p.json",
             "M": artifacts / "m.parquet", "WF": artifacts / "wl.py", "W": f"{artifacts / 'wl.py'}:workload"}
    argv = [part.format(**names) for part in shlex.split(row.argv)]
    before = snapshot(artifacts, d)
    try:
        code, stderr = invoke(argv, process=row.process, cwd=d)
    finally:
        for path in d.rglob("*"):  # give back write permission so the tmp folder can be removed
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
    lines = stderr.strip().splitlines()
    assert code == 2, f"exit {code}: {stderr}"
    assert len(lines) == 1 and lines[0].strip(), f"not one line: {stderr!r}"
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    assert snapshot(artifacts, d) == before, "a file was written, removed or changed"
