import textwrap
from pathlib import Path

import pytest
import torch

import hplan
from hplan.specs import load_workload


def test_file_spec_loads_and_passes_batch_size():
    w = load_workload("examples/mlp_workload.py:workload", batch_size=8)
    assert isinstance(w, hplan.Workload) and w.name == "mlp"
    model = w.build_model()
    loss = w.loss(model, w.batch(0))
    assert loss.ndim == 0 and w.batch(0)[0].shape[0] == 8


def test_batches_are_deterministic_per_step():
    w = load_workload("gpt:tiny")
    a, b, c = w.batch(3), w.batch(3), w.batch(4)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_model_factory_is_seeded():
    w = load_workload("gpt:tiny")
    m1, m2 = w.build_model(), w.build_model()
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))


def test_gpt_options_reach_the_batch():
    w = load_workload("gpt:tiny", batch_size=2, seq_len=16)
    idx, targets = w.batch(0)
    assert idx.shape == (2, 16) and targets.shape == (2, 16)


def test_precision_override():
    w = load_workload("gpt:tiny", precision="bf16-mixed")
    assert next(w.build_model().parameters()).dtype == torch.bfloat16


def test_hf_spec_builds_from_config_without_download():
    pytest.importorskip("transformers")
    w = load_workload("hf:GPT2LMHeadModel", overrides={"n_layer": "1", "n_embd": "32", "n_head": "2", "vocab_size": "100"},
                      batch_size=2, seq_len=8)
    model = w.build_model()
    assert w.loss(model, w.batch(0)).ndim == 0


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("missing.py:workload", "not found"),
        ("examples/mlp_workload.py:nope", "no function 'nope'"),
        ("gpt:7t", "unknown gpt preset"),
        ("resnet", "unknown workload spec"),
        ("hf:NoSuchModel", "no model class"),
    ],
)
def test_bad_specs_are_one_line_errors(spec, fragment):
    with pytest.raises(hplan.HplanError) as err:
        load_workload(spec)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_wrong_return_type_and_bad_option(tmp_path):
    path = tmp_path / "w.py"
    path.write_text(textwrap.dedent("""
        def workload():
            return 42
    """))
    with pytest.raises(hplan.HplanError, match="not hplan.Workload"):
        load_workload(f"{path}:workload")
    with pytest.raises(hplan.HplanError, match="does not take option 'seq_len'"):
        load_workload(f"{path}:workload", seq_len=8)


def test_broken_file_and_bad_sizes(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise ValueError('boom')\n")
    with pytest.raises(hplan.HplanError, match="importing .* failed: ValueError: boom"):
        load_workload(f"{path}:workload")
    with pytest.raises(hplan.HplanError, match="positive"):
        load_workload("gpt:tiny", batch_size=0)
    with pytest.raises(hplan.HplanError, match="exceeds"):
        load_workload("gpt:tiny", seq_len=4096)


def test_workload_fields_must_be_callables():
    with pytest.raises(hplan.HplanError, match="Workload.model must be callable"):
        hplan.Workload(model=1, batch=lambda s: s, loss=lambda m, b: b, optimizer=lambda p: p)
    with pytest.raises(hplan.HplanError, match="unknown precision"):
        hplan.Workload(model=list, batch=list, loss=max, optimizer=list, precision="fp8")


def test_set_values_are_typed_by_the_workload_functions_annotations_and_defaults(tmp_path):
    path = tmp_path / "typed.py"
    path.write_text(textwrap.dedent("""
        from typing import Optional
        import torch, hplan

        SEEN = {}

        def workload(use_bias: bool = True, width: int = 8, lr: Optional[float] = None, tag="x", flag=False):
            SEEN.update(use_bias=use_bias, width=width, lr=lr, tag=tag, flag=flag)
            return hplan.Workload(model=lambda: torch.nn.Linear(2, 2), batch=lambda s: torch.ones(1, 2),
                                  loss=lambda m, b: m(b).sum(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    """))
    import sys

    load_workload(f"{path}:workload", overrides={"use_bias": "FALSE", "width": "16", "lr": "0.5", "tag": "y",
                                                 "flag": "yes"})
    seen = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(path)).SEEN
    assert seen == {"use_bias": False, "width": 16, "lr": 0.5, "tag": "y", "flag": True}
    for key, value, expected in (("use_bias", "maybe", "bool"), ("width", "1.5", "int"), ("lr", "fast", "float")):
        with pytest.raises(hplan.HplanError, match=f"invalid {key}={value} in `overrides`: {key} expects {expected}"):
            load_workload(f"{path}:workload", overrides={key: value})


def test_a_non_scalar_loss_is_named_where_it_returns():
    import dataclasses

    from hplan.workload import with_contract_checks

    w = load_workload("gpt:tiny")
    bad = with_contract_checks(dataclasses.replace(w, loss=lambda m, b: m(b[0])))
    with pytest.raises(hplan.HplanError, match="not a scalar tensor"):
        bad.loss(bad.build_model(), bad.batch(0))


def test_hf_options_are_typed_and_checked_before_any_work():
    pytest.importorskip("transformers")
    for overrides, message in (({"n_head": "5"}, "refuses these options: ValueError"), ({"__class__": "x"}, "no option"),
                               ({"n_layer": "abc"}, "expects int"), ({"n_layer": "0"}, "must be positive")):
        with pytest.raises(hplan.HplanError, match=message):
            load_workload("hf:GPT2LMHeadModel", overrides=overrides)


WORKLOAD_WITH_SIZES = """
import torch, hplan
from helper_beside import make_model

SEEN = {}


def workload(batch_size: int = 4, seq_len: int = 8) -> hplan.Workload:
    SEEN.update(batch_size=batch_size, seq_len=seq_len)

    def loss(model, x):
        import lazy_beside  # a factory may import a helper module only when it runs
        return model(x).pow(2).mean() * lazy_beside.SCALE

    return hplan.Workload(model=lambda: make_model(seq_len), loss=loss,
                          batch=lambda s: torch.randn(batch_size, seq_len, generator=torch.Generator().manual_seed(s)),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=batch_size, seq_len=seq_len)
"""


@pytest.fixture
def project(tmp_path):
    """A workload file with helper modules beside it, as a user's project folder has them."""
    (tmp_path / "helper_beside.py").write_text("import torch\n\ndef make_model(width):\n"
                                               "    return torch.nn.Linear(width, 2)\n")
    (tmp_path / "lazy_beside.py").write_text("SCALE = 2.0\n")
    (tmp_path / "sized.py").write_text(WORKLOAD_WITH_SIZES)
    return tmp_path


def _seen(path):
    import sys

    return next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(path)).SEEN


def test_set_seq_len_and_batch_size_reach_a_function_that_takes_them(project):
    """`--set seq_len=32` means `--seq-len 32` (it used to pass seq_len twice: a TypeError)."""
    spec = f"{project / 'sized.py'}:workload"
    w = load_workload(spec, overrides={"seq_len": "32", "batch_size": "2"})
    assert _seen(project / "sized.py") == {"batch_size": 2, "seq_len": 32} and w.batch(0).shape == (2, 32)
    load_workload(spec, seq_len=16, batch_size=3)
    assert _seen(project / "sized.py") == {"batch_size": 3, "seq_len": 16}
    with pytest.raises(hplan.HplanError, match="seq_len is given twice, as 16 and as the override seq_len=32"):
        load_workload(spec, seq_len=16, overrides={"seq_len": "32"})
    with pytest.raises(hplan.HplanError, match="batch_size must be positive"):
        load_workload(spec, overrides={"batch_size": "0"})
    assert load_workload("gpt:tiny", overrides={"seq_len": "16"}).seq_len == 16


def test_a_workload_file_imports_modules_beside_it_from_any_folder(project, monkeypatch, tmp_path_factory):
    """As `python sized.py` would: the file's folder is on the import path while hplan runs the file and its
    factories, and only then (the caller's sys.path is left as it was)."""
    import sys

    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    for name in ("helper_beside", "lazy_beside"):
        sys.modules.pop(name, None)
    before = list(sys.path)
    w = load_workload(f"{project / 'sized.py'}:workload")
    assert sys.path == before
    model = w.build_model()
    loss = w.loss(model, w.batch(0))  # imports lazy_beside now
    assert loss.requires_grad and sys.path == before and "lazy_beside" in sys.modules


def test_the_workload_loss_evaluates_under_no_grad(project):
    """`load_workload(...).loss` is the user's loss: reusable for evaluation under torch.no_grad()."""
    for spec in (f"{project / 'sized.py'}:workload", "gpt:tiny"):
        w = load_workload(spec)
        model = w.build_model()
        with torch.no_grad():
            loss = w.loss(model, w.batch(0))
        assert loss.ndim == 0 and not loss.requires_grad
        assert torch.equal(loss, w.loss(model, w.batch(0)).detach())
    detached = load_workload(f"{project / 'sized.py'}:workload")
    import dataclasses

    from hplan.workload import with_contract_checks

    bad = with_contract_checks(dataclasses.replace(detached, loss=lambda m, b: m(b).sum().detach()))
    with pytest.raises(hplan.HplanError, match="does not require a gradient"):
        bad.loss(bad.build_model(), bad.batch(0))


def test_trace_set_seq_len_on_the_command_line(project, tmp_path):
    from typer.testing import CliRunner

    from hplan.cli import app

    result = CliRunner().invoke(app, ["trace", f"{project / 'sized.py'}:workload", "--set", "seq_len=32", "--json",
                                      "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 0, result.output
    assert _seen(project / "sized.py")["seq_len"] == 32 and '"float32[4,32]"' in result.stdout


def test_set_takes_several_pairs_in_either_form(project, tmp_path):
    """The help shows `--set KEY=VALUE`; `--set a=1 b=2` and `--set a=1 --set b=2` both give both."""
    from typer.testing import CliRunner

    from hplan.cli import app
    from hplan.cli.base import expand_set_values

    spec = f"{project / 'sized.py'}:workload"
    for argv in (["trace", spec, "--set", "seq_len=24", "batch_size=3"],
                 ["trace", "--set", "seq_len=24", "batch_size=3", spec],
                 ["trace", spec, "--set=seq_len=24", "batch_size=3"],
                 ["trace", spec, "--set", "seq_len=24", "--set", "batch_size=3"]):
        result = CliRunner().invoke(app, [*argv, "-o", str(tmp_path / "t.parquet")])
        assert result.exit_code == 0, result.output
        assert _seen(project / "sized.py") == {"batch_size": 3, "seq_len": 24}
    assert expand_set_values(["run", "--set", "a=1", "b=2", "gpt:tiny", "c=3"]) == \
        ["run", "--set", "a=1", "--set", "b=2", "gpt:tiny", "c=3"]
    assert expand_set_values(["x", "--", "--set", "a=1", "b=2"]) == ["x", "--", "--set", "a=1", "b=2"]
    help_text = CliRunner().invoke(app, ["trace", "--help"]).output
    assert "KEY=VALUE" in help_text and "list[str]" not in help_text


def test_checkpointing_is_enabled_by_the_name_the_installed_transformers_offers():
    """transformers 5.24 renamed gradient_checkpointing_enable to activation_checkpointing_enable (the old name warns,
    and goes in v6): the helper calls the new name where it exists, the old one before it."""
    import warnings

    from hplan.models.hf import enable_checkpointing

    calls = []

    class Before:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **layers):
            calls.append(("gradient", gradient_checkpointing_kwargs, layers))

    class After(Before):
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **layers):
            calls.append(("activation", activation_checkpointing_kwargs, layers))

    enable_checkpointing(Before(), {"use_reentrant": False})
    enable_checkpointing(After(), {"use_reentrant": True}, every_n_layers=2)
    assert calls == [("gradient", {"use_reentrant": False}, {}), ("activation", {"use_reentrant": True},
                                                                  {"every_n_layers": 2})]
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated name would warn here
        enable_checkpointing(model, {"use_reentrant": False})
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_nothing_in_the_repository_calls_the_deprecated_checkpointing_name_directly():
    root = Path(__file__).resolve().parent.parent
    allowed = {root / "hplan" / "models" / "hf.py", Path(__file__).resolve()}
    callers = [str(path.relative_to(root)) for folder in ("hplan", "tracer", "planner", "executor", "reports", "bench",
                                                         "tests", "examples")
               for path in (root / folder).rglob("*.py")
               if path not in allowed and ".gradient_checkpointing_enable(" in path.read_text()]
    assert callers == [], f"call hplan.models.hf.enable_checkpointing instead: {callers}"
