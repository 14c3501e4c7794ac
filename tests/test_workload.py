import textwrap

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
        with pytest.raises(hplan.HplanError, match=f"invalid --set {key}={value}: {key} expects {expected}"):
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
