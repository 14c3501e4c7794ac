"""`hf:PATH/config.json` and `hf:org/name`: real model shapes from their config, bad configs refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fit_configs import TINY_LLAMA, write_config
from hplan.cli import app
from hplan.errors import HplanError
from hplan.models.hf import hf_workload

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
PUBLISHED = {  # parameter counts on the models' cards / from their safetensors index
    "llama-3-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512, "mistral-7b-v0.1": 7_241_732_096,
    "gemma-2-9b": 9_241_705_984, "phi-3-mini-4k": 3_821_079_552,
}
runner = CliRunner()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_build_the_published_parameter_count(name):
    workload = hf_workload(str(CONFIGS / name))
    assert workload.model.hplan_param_count == PUBLISHED[name]


def test_config_file_folder_and_class_all_work(tmp_path):
    path = write_config(tmp_path)
    for spec in (str(path), str(tmp_path)):
        workload = hf_workload(spec, batch_size=2, seq_len=16)
        model = workload.build_model()
        assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
        loss = workload.loss(model, workload.batch(0))
        assert loss.ndim == 0 and loss.requires_grad


def test_small_config_traces_on_cpu_and_large_defaults_to_fake(tmp_path):
    path = write_config(tmp_path)
    out = tmp_path / "t.parquet"
    result = runner.invoke(app, ["trace", f"hf:{path}", "-o", str(out), "--json", "--iters", "2",
                                 "--seq-len", "16", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["device"] == "cpu"
    from hplan.cli.trace_cmd import default_device

    assert default_device(hf_workload(str(CONFIGS / "phi-3-mini-4k"))) == "fake"
    assert default_device(hf_workload(str(path))) == "cpu"


def test_encoder_seq2seq_and_vision_configs_pick_their_task(tmp_path):
    bert = {"model_type": "bert", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 64}
    t5 = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 128, "d_model": 32,
          "d_ff": 64, "num_layers": 1, "num_heads": 2, "d_kv": 16, "decoder_start_token_id": 0, "pad_token_id": 0}
    vit = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64, "image_size": 32,
           "patch_size": 8, "num_labels": 3}
    for data, cls in ((bert, "BertForMaskedLM"), (t5, "T5ForConditionalGeneration"), (vit, "ViTForImageClassification")):
        path = write_config(tmp_path, data, name=f"{data['model_type']}.json")
        workload = hf_workload(str(path), batch_size=2, seq_len=8)
        model = workload.build_model()
        assert type(model).__name__ == cls
        assert workload.loss(model, workload.batch(0)).requires_grad


BAD = [
    ({"hidden_size": 4}, "no `model_type` field"),
    ({"model_type": "no-such-model"}, "`model_type` 'no-such-model' is unknown"),
    (dict(TINY_LLAMA, architectures=["LlamaForTimeTravel"]), "'LlamaForTimeTravel', a class the installed"),
    (dict(TINY_LLAMA, architectures="LlamaForCausalLM"), "`architectures` must be a list"),
    (dict(TINY_LLAMA, num_attention_heads=5), "transformers refuses it"),
    ([1, 2], "holds a JSON list"),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_bad_configs_are_one_line_exit_2(tmp_path, data, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    before = path.read_bytes()
    result = runner.invoke(app, ["trace", f"hf:{path}", "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output
    assert path.read_bytes() == before and not (tmp_path / "t.parquet").exists()


def test_not_json_and_links_are_refused(tmp_path):
    (tmp_path / "junk.json").write_bytes(b"\x00\xffnot json")
    with pytest.raises(HplanError, match="not valid JSON"):
        hf_workload(str(tmp_path / "junk.json"))
    target = write_config(tmp_path, name="real.json")
    os.symlink(target, tmp_path / "link.json")
    with pytest.raises(HplanError, match="not a regular file"):
        hf_workload(str(tmp_path / "link.json"))


def test_hub_id_offline_and_not_cached_says_a_path_works(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    import huggingface_hub.constants as hub_constants
    import transformers.utils.hub as tf_hub

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    if hasattr(tf_hub, "TRANSFORMERS_CACHE"):
        monkeypatch.setattr(tf_hub, "TRANSFORMERS_CACHE", str(tmp_path / "hf" / "hub"))
    result = runner.invoke(app, ["trace", "hf:meta-llama/Meta-Llama-3-8B", "-o", str(tmp_path / "t.parquet")])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "not in the local Hugging Face cache" in line and "hf:path/to/config.json" in line


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    """transformers' own resolution: a config.json in the hub cache layout is found offline."""
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-llama" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    write_config(snap)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("0" * 40)
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    workload = hf_workload("acme/tiny-llama", batch_size=1, seq_len=8)
    assert workload.model.hplan_param_count == sum(p.numel() for p in workload.build_model().parameters())
