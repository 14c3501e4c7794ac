"""More misbehaving workloads (issue 30): each trains at parity with plain PyTorch or is refused in one line, exit 2.
Cases beyond the issue's list: a loss without a gradient, AdamW replaced globally, a float64 default dtype, hooks
that move or convert parameters, reseeding every step, parameters deleted or replaced while tracing or after."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from test_workload_misbehaves import one_line
from typer.testing import CliRunner

from hplan.cli import app

runner = CliRunner()

# More misbehaving workloads: each trains at parity with plain PyTorch or is refused in one line, exit 2

ODD = textwrap.dedent('''
    import torch
    from torch import nn
    import hplan


    def workload(mode: str = "ok", at: int = 3) -> hplan.Workload:
        if mode == "default_dtype":
            torch.set_default_dtype(torch.float64)
        if mode == "patched_adamw":
            class MyAdamW(torch.optim.AdamW):
                pass
            torch.optim.AdamW = MyAdamW

        def model():
            net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
            if mode == "hook_to_meta":
                def to_meta(mod, args):
                    mod.weight.data = mod.weight.data.to("meta")
                net[0].register_forward_pre_hook(to_meta)
            if mode == "hook_to_double":
                def to_double(mod, args):
                    mod.to(torch.float64)
                    return tuple(a.double() for a in args)
                net[3].register_forward_pre_hook(to_double)
            return net

        def batch(step):
            return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))

        calls = []

        def loss(m, x):
            calls.append(1)
            if mode == "seed_per_step":
                torch.manual_seed(1000 + len(calls))
            if mode == "no_grad":
                return m(x).pow(2).mean().detach()
            if mode == "delete_param" and len(calls) > at:
                del m[0].bias
                m[0].register_parameter("bias", None)
            if mode == "replace_param" and len(calls) > at:
                m[0].bias = nn.Parameter(torch.zeros(16))
            return m(x).pow(2).mean()

        return hplan.Workload(model=model, batch=batch, loss=loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                              name="odd")
''')


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> Path:
    a = tmp_path_factory.mktemp("odd")
    (a / "odd.py").write_text(ODD)
    for argv in (["trace", f"{a / 'odd.py'}:workload", "-o", a / "t.parquet"],
                 ["plan", a / "t.parquet", "--gpu-mem", "min", "-o", a / "p.json"]):
        result = runner.invoke(app, [str(x) for x in argv])
        assert result.exit_code == 0, result.output
    return a


@pytest.fixture
def default_dtype_restored():
    import torch

    before = torch.get_default_dtype()
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("command,mode,fragment", [
    ("run", "no_grad", "does not require a gradient"),
    ("trace", "patched_adamw", "MyAdamW is not supported"),
    ("run", "hook_to_meta", "parameter 0.weight is written (.data =) inside the attach block"),
    ("run", "hook_to_double", "parameter 3.weight became float64 before the forward of 3"),
    ("trace", "delete_param --set at=1", "parameters changed during iteration 2 (gone or replaced: 0.bias)"),
    ("trace", "replace_param --set at=0", "parameters changed during iteration 1 (gone or replaced: 0.bias; new: 0.bias)"),
], ids=["loss-without-grad", "adamw-patched-globally", "hook-moves-to-meta", "hook-converts-dtype",
        "param-deleted-while-tracing", "param-replaced-while-tracing"])
def test_a_misbehaving_workload_is_refused_in_one_line(odd, tmp_path, default_dtype_restored, command, mode,
                                                       fragment):
    import torch

    adamw = torch.optim.AdamW
    spec = f"{odd / 'odd.py'}:workload"
    mode, *more = mode.split()
    argv = (["trace", spec, "-o", str(tmp_path / "t.parquet")] if command == "trace" else
            ["run", spec, "--plan", str(odd / "p.json"), "--steps", "4", "--metrics", str(tmp_path / "m.parquet")])
    try:
        result = runner.invoke(app, [*argv, "--set", f"mode={mode}", *more])
    finally:
        torch.optim.AdamW = adamw
    assert result.exit_code == 2, result.output
    assert fragment in one_line(result)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("mode,extra", [("seed_per_step", 0.0), ("seed_per_step", 5.0), ("default_dtype", 0.0),
                                        ("delete_param", 0.0), ("delete_param", 5.0), ("replace_param", 5.0)])
def test_a_misbehaving_workload_the_plan_allows_trains_at_parity(odd, default_dtype_restored, mode, extra):
    """Reseeding torch every step (dropout), a float64 default dtype, and a parameter deleted or replaced after the
    trace (the optimizer keeps the old one, as in plain PyTorch) train exactly as plain PyTorch does."""
    from loops import plan_for

    from hplan.executor import run_training
    from hplan.specs import load_workload
    from hplan.training import plain_losses

    def fresh():
        return load_workload(f"{odd / 'odd.py'}:workload", overrides={"mode": mode if mode == "default_dtype" else
                                                                              "ok"})

    plan = plan_for(fresh(), extra=extra)

    def again():
        return load_workload(f"{odd / 'odd.py'}:workload", overrides={"mode": mode})

    assert list(run_training(again(), plan, steps=6).losses) == plain_losses(again(), 6)
