"""Compute calibration: the share of its datasheet 16-bit TFLOPS a GPU was measured to sustain on a transformer
training step, per GPU and, where the code changed the figure, per kernel generation. Kept apart from the
datasheet presets (hplan.planner.presets) because these numbers are measurements of GPU + kernels, with their own
sources and their own rule for which one applies; `make_hardware` picks one per Hardware.

[Note: compute calibration] A predicted step divides each event's model FLOPs ([Note: FLOPs are model FLOPs] in
hplan.tracer.flops) by datasheet 16-bit TFLOPS × the GPU's efficiency: the model-FLOPs utilisation (MFU) a
transformer training step was measured to sustain on that GPU, with FlashAttention where the source used it.
It is a property of GPU + kernels, not of the parallel scheme: sources are one-node or per-GPU figures where
communication is small, so the many-rank model adds its own communication on top. fp32 steps (no tensor cores)
have no published calibration and keep DEFAULT_EFFICIENCY.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """A GPU's measured share of its datasheet 16-bit TFLOPS on a transformer training step."""

    gpu: str
    efficiency: float
    source: str
    width: int = 0
    """Model width (hidden size) the source measured at: other widths scale by [Note: efficiency by width]
    (hplan.planner.kernel_size); 0 = the source spans many widths, no size correction."""
    kernels: str = ""
    """The code generation the source measured ([Note: kernel generations]); "" = not tied to one."""


DEFAULT_EFFICIENCY = 0.30
"""Share of datasheet TFLOPS a single-GPU GPT training step sustains where nothing better is published: Megatron-LM's
single-V100 baseline, 39 TFLOPS = 30% of peak (Shoeybi et al. 2019, arXiv 1909.08053, abstract).
hplan.artifacts.hardware.Hardware uses the same default."""
MEGATRON_WIDTH = 1536
"""Hidden size of that baseline (Megatron-LM, arXiv 1909.08053, Table 1: the 1.2B model, 40 layers × 1536): every
calibration that borrows the 30% is measured at this width ([Note: efficiency by width])."""

CALIBRATION: dict[str, Calibration] = {c.gpu: c for c in (
    Calibration(gpu="a100-80gb", efficiency=205 / 312,
                source="FlashAttention-2 (Dao 2023, arXiv 2307.08691) §4.2 Table 1: GPT3-2.7B, 2k context, 8×A100 "
                       "80GB SXM, 205 TFLOPs/s per GPU (the 8k-context row reaches 225 = 72%); d 2560 (GPT-3 "
                       "paper, Table 2.1)", width=2560),
    Calibration(gpu="a100-40gb", efficiency=205 / 312, source="as a100-80gb (same chip and clocks)", width=2560),
    Calibration(gpu="a800-80gb", efficiency=0.63,
                source="AMSP (arXiv 2311.00257 v2): LLaMA-7B on one node of 8 A800-80GB, 63% MFU (as quoted in "
                       "hplan issue 25; AMSP's factors move almost nothing on one node's NVLink); LLaMA-7B's d 4096 "
                       "(Touvron et al. 2023, Table 2)", width=4096),
    Calibration(gpu="h100-80gb", efficiency=0.47,
                source="NVIDIA Megatron-LM README: up to 47% MFU on H100 clusters (GPT models, 4096-token sequences)"),
    Calibration(gpu="v100-32gb", efficiency=DEFAULT_EFFICIENCY, kernels="megatron-2019",
                source="Megatron-LM (arXiv 1909.08053) abstract: 39 TFLOPS on one V100, 30% of peak; its 1.2B "
                       "single-GPU baseline has hidden size 1536 (Table 1)", width=MEGATRON_WIDTH),
    Calibration(gpu="rtx3090", efficiency=DEFAULT_EFFICIENCY,
                source="no published training MFU for this card: Megatron-LM's single-GPU 30%", width=MEGATRON_WIDTH),
    Calibration(gpu="rtx2060", efficiency=DEFAULT_EFFICIENCY,
                source="no published training MFU for this card: Megatron-LM's single-GPU 30%", width=MEGATRON_WIDTH),
    Calibration(gpu="h200", efficiency=0.47, source="as h100-80gb (the same GH100 chip and clocks, more memory)"),
    *(Calibration(gpu=name, efficiency=DEFAULT_EFFICIENCY,
                  source="no calibrated training MFU in hplan for this GPU yet: Megatron-LM's single-GPU 30%",
                  width=MEGATRON_WIDTH)
      for name in ("rtx4090", "rtx5090", "l4", "l40s", "a6000", "b200", "mi300x")),
)}


KERNEL_GENERATIONS: dict[str, dict[str, Calibration]] = {
    "v100-32gb": {
        "megatron-2019": CALIBRATION["v100-32gb"],
        "megatron-v1": Calibration(
            gpu="v100-32gb", efficiency=0.48, kernels="megatron-v1", width=MEGATRON_WIDTH,
            source="NVIDIA ADLR, \"MegatronLM's Supercharged V1.0\" (nv-adlr.github.io/MegatronLMV1): the same 1.2B "
                   "baseline reaches 62.4 TFLOPS, 48% of the theoretical peak of one V100 of a DGX-2H, after v1.0's "
                   "software optimizations (39 TFLOPS before); Table 1 there: 1288 ms per iteration on one GPU"),
    },
}
"""[Note: kernel generations] A GPU's calibration is a property of GPU + kernels, and the kernels change with the
code. On the V100 the same Megatron-LM 1.2B model (40 × 1536) went from 39 TFLOPS (the 2019 paper) to 62.4
(Megatron-LM v1.0's fused kernels and software optimizations), 1.6× on the same chip: more than any ±25% band.
Where a run's source states which code it ran, `make_hardware(kernels=...)` prices it with the calibration of
that code's generation: "megatron-2019" for NVIDIA's 2019 Megatron-LM code and forks of it (DeepSpeedExamples'
Megatron-LM, 2020), "megatron-v1" for Megatron-LM v1.0 and later (DeepSpeedExamples' Megatron-LM-v1.1.5-ZeRO3,
2021) and for code newer than both. Without `kernels` a preset keeps its CALIBRATION entry."""
