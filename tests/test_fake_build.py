"""`--device fake` on models whose constructor fake tensors cannot run ([Note: fake model build]): ViT's weight
init and peft's LoRA build on the meta device and trace exactly as on the CPU; an operator with no fake kernel is
refused in one line naming it (Mixtral's expert operator, once such a case, fake-traces now); a model that fails on every device is the user's error,
and `hplan --debug` shows the user's frame."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hplan
from hplan.cli import app
from hplan.specs import load_workload
from hplan.tracer import trace_workload

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()


def _vit() -> hplan.Workload:
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, num_labels=10)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.randint(10, (2,), generator=g)}

    return hplan.Workload(model=lambda: transformers.ViTForImageClassification(cfg), batch=batch, name="vit",
                          loss=lambda m, b: m(**b).loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


def _lora() -> hplan.Workload:
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    def model() -> nn.Module:
        return peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                   peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def batch(step: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids.clone()}

    return hplan.Workload(model=model, batch=batch, loss=lambda m, b: m(**b).loss, name="llama-lora",
                          optimizer=lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad], lr=1e-3))


@pytest.mark.parametrize("make", [_vit, _lora], ids=["ViTForImageClassification", "peft-LoRA-Llama"])
def test_a_model_fake_tensors_cannot_construct_is_built_on_meta_and_traces_as_on_the_cpu(make):
    from torch._subclasses.fake_tensor import FakeTensorMode

    workload = make()
    with pytest.raises(Exception), FakeTensorMode():  # what plain fake construction does with this model
        workload.model()
    fake = trace_workload(workload, device="fake")
    cpu = trace_workload(workload, device="cpu")
    assert fake.peak_bytes == cpu.peak_bytes and fake.peak_by_category == cpu.peak_by_category
    assert [e.non_model_peak_bytes for e in fake.events] == [e.non_model_peak_bytes for e in cpu.events]
    assert [(p.name, p.bytes, p.trainable) for p in fake.params] == [(p.name, p.bytes, p.trainable) for p in cpu.params]
    has_buffers = any(True for _ in workload.model().buffers())
    # peft's LoRA failed plain fake construction at a `.to()` that changes nothing (torch swaps fake parameters):
    # hplan's fake mode keeps such a module as it is (hplan.tracer.fake_python), so LoRA builds on fake tensors
    on_meta = has_buffers and workload.name != "llama-lora"
    assert any("built on the meta device" in w for w in fake.warnings) == on_meta


MIXTRAL = ["--set", "num_hidden_layers=1", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
           "num_key_value_heads=2", "vocab_size=256", "num_local_experts=4", "--seq-len", "16"]


NO_FAKE_KERNEL = """
import torch, hplan
from torch import nn


@torch.library.custom_op("hplan_test_nofake::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:  # a CPU kernel only: no fake kernel registered
    return x * 2.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled(self.fc(x))


def workload() -> hplan.Workload:
    return hplan.Workload(model=Net, batch=lambda s: torch.ones(2, 4), loss=lambda m, b: m(b).sum(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="nofake")
"""


def test_an_operator_without_a_fake_kernel_is_one_line_naming_it(tmp_path, caplog):
    """A custom operator with a CPU kernel and no fake kernel (Mixtral's aten::_grouped_mm was this case until
    hplan's own fake correction for it): one line naming the operator in its own namespace, no torch log."""
    (tmp_path / "wl.py").write_text(NO_FAKE_KERNEL)
    out = tmp_path / "t.parquet"
    with caplog.at_level(logging.WARNING):
        result = runner.invoke(app, ["trace", f"{tmp_path / 'wl.py'}:workload", "--device", "fake", "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "fake tensors cannot run hplan_test_nofake::scaled in forward of Net" in lines[0]
    assert "the real kernel runs it: trace with --device cpu" in lines[0] and not out.exists()
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    assert logging.getLogger("torch._subclasses.fake_tensor").level == logging.NOTSET  # given back


def test_mixtral_fake_traces_with_hplans_grouped_mm_correction(tmp_path):
    """Mixtral's experts run aten::_grouped_mm in float32, which torch's fake kernel refuses (bf16 only, as on CUDA):
    hplan's fake correction runs it as the CPU kernel does, so the fake trace succeeds."""
    out = tmp_path / "t.parquet"
    result = runner.invoke(app, ["trace", "hf:MixtralForCausalLM", "--device", "fake", *MIXTRAL, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists()


@pytest.mark.slow
def test_mixtral_traces_on_the_cpu_as_the_fake_error_says(tmp_path):
    result = runner.invoke(app, ["trace", "hf:MixtralForCausalLM", "--device", "cpu", *MIXTRAL,
                                 "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 0, result.output


class _ReadsValues(nn.Module):
    """A constructor that reads a value: fake tensors cannot answer, the meta device refuses too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = float(self.fc.weight.abs().max())


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m.fc(x).sum() * m.scale


def test_a_constructor_no_fake_build_can_run_names_the_module_and_the_cpu():
    w = hplan.Workload(model=_ReadsValues, batch=lambda s: torch.ones(2, 4), loss=_loss,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="reads")
    with pytest.raises(hplan.HplanError) as err:
        trace_workload(w, device="fake")
    message = str(err.value)
    assert "with fake tensors failed in _ReadsValues (DataDependentOutputException" in message
    assert "trace with `device` cpu" in message  # the CLI says --device (hplan.cli.common.cli_terms)
    assert trace_workload(w, device="cpu").n_ops > 0


FAILING = """
import torch, hplan


def build():
    raise ValueError("no such layer size")


def workload() -> hplan.Workload:
    return hplan.Workload(model=build, batch=lambda s: torch.ones(2, 4), loss=lambda m, b: m(b).sum(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
"""


def test_a_factory_that_fails_on_every_device_is_the_users_error_and_debug_shows_its_frame(tmp_path: Path):
    (tmp_path / "wl.py").write_text(FAILING)
    argv = ["trace", f"{tmp_path / 'wl.py'}:workload", "--device", "fake", "-o", str(tmp_path / "t.parquet")]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: building the model of 'workload' failed: ValueError: no such layer size "
                                     "(wl.py:6)")
    result = runner.invoke(app, ["--debug", *argv])
    assert result.exit_code == 2 and 'wl.py", line 6, in build' in result.stderr


def test_debug_shows_the_users_frame_of_a_failing_step(tmp_path: Path):
    (tmp_path / "wl.py").write_text(FAILING.replace('raise ValueError("no such layer size")',
                                                    "return torch.nn.Linear(4, 3)")
                                    .replace("loss=lambda m, b: m(b).sum()", "loss=lambda m, b: m(b.t()).sum()"))
    argv = ["trace", f"{tmp_path / 'wl.py'}:workload", "-o", str(tmp_path / "t.parquet")]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(app, ["--debug", *argv])
    assert result.exit_code == 2 and "wl.py\", line 10, in <lambda>" in result.stderr, result.stderr
    assert load_workload(f"{tmp_path / 'wl.py'}:workload").name == "workload"


def test_a_call_wrong_on_every_device_is_the_models_error_not_a_missing_fake_kernel(tmp_path: Path):
    """The fake kernel of aten::mm refuses a shape mismatch, and so does the real one (hplan tries it on zeros of
    the same shapes): the error is the model's, reported as a cpu trace reports it, without sending to the cpu."""
    (tmp_path / "wl.py").write_text(FAILING.replace('raise ValueError("no such layer size")',
                                                    "return torch.nn.Linear(4, 3)")
                                    .replace("torch.ones(2, 4)", "torch.ones(2, 5)"))
    for device in ("fake", "cpu"):
        result = runner.invoke(app, ["trace", f"{tmp_path / 'wl.py'}:workload", "--device", device,
                                     "-o", str(tmp_path / "t.parquet")])
        line = result.stderr.strip()
        assert result.exit_code == 2 and len(line.splitlines()) == 1
        assert line.startswith("error: the training step failed in forward of Linear") and "(wl.py:10)" in line
        assert "fake tensors cannot run" not in line
