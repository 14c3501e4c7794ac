"""FLOPs of an operator as the planner needs them: model FLOPs, attention scores included.

[Note: FLOPs are model FLOPs] Every predicted step time divides an event's FLOPs by an achieved rate, and that
rate is calibrated from published model-FLOPs utilisation (MFU: hplan.planner.presets, [Note: compute
calibration]). So FLOPs here are *model* FLOPs as MFU counts them (PaLM, Chowdhery et al. 2022, arXiv 2204.02311,
Appendix B: 6N + 12·L·H·Q·T per token): every matmul of the model once forward and twice backward, attention
scores over the whole s_q × s_k square (a causal mask halves the work a kernel does, not the count), no
recomputation. torch.utils.flop_counter's registry gives this for matmuls and convolutions; for attention it:
- has no entry for the CPU kernels `scaled_dot_product_attention` selects (`_scaled_dot_product_flash_attention_
  for_cpu` and its backward), so CPU and fake traces counted QKᵀ and AV as zero — for LLaMA-7B at 4,096 tokens
  that is 16% of the step's FLOPs;
- counts a fused backward as five matmuls (it recomputes the scores, a hardware FLOP), not the model's four.
`attention_flops` covers every `_scaled_dot_product_*` kernel (query, key, value laid out (batch, heads, seq,
dim), grouped-query heads allowed): forward 2·b·h·s_q·s_k·(d_qk + d_v), backward twice that. A transformers
model on its eager attention path runs plain matmuls, which the registry already counts the same way.
"""

from __future__ import annotations

from typing import Any

import torch

_aten = torch.ops.aten
_FORWARD = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_fused_attention_overrideable")
"""Fused attention kernels whose first three arguments are query, key, value."""
_BACKWARD = tuple(f"{name}_backward" for name in _FORWARD)
"""Their backwards, whose arguments are grad_out, query, key, value."""


def _packets(names: tuple[str, ...]) -> set[Any]:
    return {getattr(_aten, n) for n in names if hasattr(_aten, n)}


FORWARD_PACKETS = _packets(_FORWARD)
BACKWARD_PACKETS = _packets(_BACKWARD)


def sdpa_forward_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> int:
    """QKᵀ and the weighted sum of V over the full score square: 2·b·h_q·s_q·s_k·(d_qk + d_v)."""
    *batch_q, s_q, d_qk = q
    *_, s_k, d_v = v
    if len(q) != 4 or len(k) != 4 or len(v) != 4 or k[-2] != s_k:
        raise ValueError(f"attention shapes q={q}, k={k}, v={v} are not (batch, heads, seq, dim)")
    b, h = batch_q
    return 2 * b * h * s_q * s_k * (d_qk + d_v)


def attention_flops(func: Any, args: tuple, out: Any) -> int | None:
    """Model FLOPs of a fused attention kernel, or None when `func` is not one (see the module docstring)."""
    packet = func.overloadpacket
    if packet in FORWARD_PACKETS:
        q, k, v = args[:3]
        return sdpa_forward_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    if packet in BACKWARD_PACKETS:
        _, q, k, v = args[:4]
        return 2 * sdpa_forward_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    return None
