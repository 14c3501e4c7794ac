"""Traces count model FLOPs, attention scores included ([Note: FLOPs are model FLOPs] in hplan.tracer.flops).

Every predicted step time divides FLOPs by a rate calibrated from published MFU, so a step's FLOPs must be the
analytic count MFU uses: each matmul once forward and twice backward, QKᵀ and AV over the whole score square.
Checked for the bundled GPT and a transformers Llama with grouped-query heads, in fake and cpu traces alike.
"""

from __future__ import annotations

import pytest
from hplan.tracer import trace_workload
from hplan.tracer.flops import attention_flops, sdpa_forward_flops

from hplan.specs import load_workload


def _attention(trace) -> int:
    last = trace.timeline[trace.timeline.iteration == trace.timeline.iteration.max()]
    return int(last[last.op.str.contains("scaled_dot_product")].flops.sum())


@pytest.mark.parametrize("device", ["fake", "cpu"])
def test_gpt_step_flops_equal_the_analytic_count(device):
    workload = load_workload("gpt:tiny")
    b, s = workload.batch(0)[0].shape
    d, layers, vocab = 64, 2, 256  # gpt:tiny (hplan.models.gpt.PRESETS)
    tokens = b * s
    linear = layers * (d * 3 * d + d * d + 2 * d * 4 * d) + d * vocab  # c_attn, c_proj, mlp, tied head
    scores = layers * 2 * b * s * s * (d + d)  # QKᵀ and AV over all heads: 2·b·s²·d each
    trace = trace_workload(workload, device=device, iters=2)
    assert _attention(trace) == 3 * scores
    assert trace.step_flops == 3 * (2 * tokens * linear + scores)


@pytest.mark.parametrize("device", ["fake", "cpu"])
def test_llama_step_flops_equal_the_analytic_count(device):
    pytest.importorskip("transformers")
    from hf_models import SEQ, VOCAB, llama, workload

    d, inter, layers, heads, kv_heads, b = 64, 128, 2, 4, 2, 2  # hf_models.llama, lm_batch
    head_dim = d // heads
    tokens = b * SEQ
    linear = layers * (2 * d * d + 2 * d * kv_heads * head_dim + 3 * d * inter) + d * VOCAB
    scores = layers * 2 * b * heads * SEQ * SEQ * 2 * head_dim  # grouped KV heads serve every query head
    trace = trace_workload(workload("llama", llama), device=device, iters=2)
    assert _attention(trace) == 3 * scores
    assert trace.step_flops == 3 * (2 * tokens * linear + scores)


def test_fused_attention_backward_counts_model_flops_not_the_recomputation():
    import torch

    q = torch.empty(2, 8, 128, 64, device="meta")
    kv = torch.empty(2, 2, 128, 64, device="meta")
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert attention_flops(fwd, (q, kv, kv), None) == 2 * 2 * 8 * 128 * 128 * 128
    assert attention_flops(bwd, (q, q, kv, kv), None) == 2 * sdpa_forward_flops(q.shape, kv.shape, kv.shape)
    assert attention_flops(torch.ops.aten.mm.default, (q, q), None) is None
