"""`hplan fit` on configs it was not tuned on (tiny BERT, T5, Qwen2, Mixtral and GPT-NeoX shapes written here): its largest batch
and longest sequence agree with plans made by hand (trace, then make_plan) at the boundary and one step past it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fit_configs import write_config
from hplan.cli import app
from hplan.cli.fit_search import SEQ_STEP

runner = CliRunner()

HIDDEN = {
    "bert": {"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": 3000, "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "max_position_embeddings": 1024, "type_vocab_size": 2},
    "t5": {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": 3000, "d_model": 64,
           "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
           "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 3000, "hidden_size": 64,
              "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "tie_word_embeddings": True},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 3000,
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                "max_position_embeddings": 2048},  # MoE: grouped_mm experts (tracer/fake_kernels.py `_grouped_mm`)
    "gpt_neox": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 3000,
                 "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "rotary_pct": 0.25, "use_parallel_residual": True, "max_position_embeddings": 2048},
}


def _hand(path, batch: int, seq: int, gpu_bytes: int) -> bool:
    """The plan a user makes by hand: `hplan trace` (fake) then `hplan plan` at the GPU's budget, which adds the
    GPU's GEMM workspaces to a CPU or fake trace (hplan.cli.plan_cmd, [Note: GEMM workspaces]) as fit does; without
    them a tiny GPT-NeoX's batch 13 fitted by hand where fit, counting them, said it does not."""
    from hplan.planner import PlanOptions, for_gpu, make_hardware, make_plan, trace_slack
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    trace = trace_workload(load_workload(f"hf:{path}", batch_size=batch, seq_len=seq, precision="bf16-mixed"),
                           device="fake", iters=2)
    trace = for_gpu(trace, "rtx4090")
    hardware = make_hardware("rtx4090", gpu_bytes=gpu_bytes, **trace_slack(trace, "release"))
    return make_plan(trace, hardware, PlanOptions(activations="auto")).summary.feasible


def _budget(path) -> int:
    """A GPU budget three times the smallest one at batch 2 × seq 128: the boundary lands a few steps up."""
    from hplan.planner import make_hardware, min_gpu_bytes, trace_slack
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    trace = trace_workload(load_workload(f"hf:{path}", batch_size=2, seq_len=128, precision="bf16-mixed"),
                           device="fake", iters=2)
    return 3 * min_gpu_bytes(trace, make_hardware("rtx4090", **trace_slack(trace, "release"))).gpu_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HIDDEN))
def test_fit_boundary_agrees_with_plans_made_by_hand(tmp_path, name):
    path = write_config(tmp_path, HIDDEN[name])
    gpu_bytes = _budget(path)
    result = runner.invoke(app, ["fit", f"hf:{path}", "--gpu", "rtx4090", "--gpu-mem", f"{gpu_bytes}B",
                                 "--seq-len", "128", "--batch-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["gpus_rows"][0]
    batch, seq = row["largest_batch"], row["longest_seq"]
    assert batch["best"]["fits"] and batch["next"]["batch"] == batch["best"]["batch"] + 1, batch
    assert not batch["next"]["fits"] and batch["best"]["batch"] > 2  # the budget leaves room above batch 2
    checks = [(batch["best"]["batch"], 128, True), (batch["next"]["batch"], 128, False)]
    if seq["next"] is not None:  # else the sequence reached the model's context (said in `limit`)
        assert seq["next"]["seq"] == seq["best"]["seq"] + SEQ_STEP and not seq["next"]["fits"]
        checks += [(2, seq["best"]["seq"], True), (2, seq["next"]["seq"], False)]
    else:
        assert "context" in seq["limit"]
    for b, s, fits in checks:
        assert _hand(path, b, s, gpu_bytes) is fits, (name, b, s)
