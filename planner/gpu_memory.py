"""GPU memory as the cost model reads it, per GPU preset: how many bytes a process may allocate (MEMORY_TOTALS)
and how fast device memory is read (MEMORY_GBPS), each with the public source it was read from. Kept apart from
the presets' datasheet table (hplan.planner.presets) because the totals are not datasheet figures: they are what
CUDA reports to a process, read from out-of-memory messages and measurements ([Note: GPU memory totals]).
"""

from __future__ import annotations

GIB = 2**30
MEMORY_TOTALS: dict[str, tuple[int, str]] = {
    # [Note: GPU memory totals] The bytes CUDA (or HIP) lets a process allocate: cudaMemGetInfo's total, which
    # PyTorch reports as "GPU 0 has a total capacity of X GiB" in every out-of-memory error and as
    # get_device_properties().total_memory. A datasheet's "24 GB" is neither 24e9 nor 24 GiB: the card holds 24 GiB
    # (nvidia-smi's total, e.g. 24,564 MiB on an RTX 4090) and the driver keeps part of it outside CUDA's total
    # (RTX 4090: 24,564 MiB in nvidia-smi, 23.64 GiB = 24,207 MiB to PyTorch). Out-of-memory messages print two
    # decimals of GiB (10 MiB). The CUDA context and the GEMM workspaces come off as a CPU trace's overhead
    # (hplan.planner.workspace, [Note: CUDA context]); a CUDA trace measured them. Each total below names the
    # public thread it was read from (owner/repo#N, or a file of a named repository) or our own measurement; an
    # exact-string search of public code and logs (2026-11-29) found each of 22.03 (L4), 31.37 (RTX 5090), 44.52
    # (L40S), 47.53 (RTX A6000), 178.35 (B200) and 191.98 GiB (MI300X) again in several other files, where they
    # name the card with no other value for it but one (178.36 GiB in an 8 x B200 log, 10 MiB apart).
    "rtx3090": (round(23.70 * GIB), "PyTorch OOM on an RTX 3090: \"23.70 GiB total capacity\" (github.com/Lightning-AI/"
                                    "lit-llama/issues/137, GaoLii/DSP#10); nvidia-smi 24,576 MiB (noonghunna/club-3090#1127)"),
    "rtx2060": (round(5.79 * GIB), "PyTorch OOM on an RTX 2060: \"5.79 GiB total capacity\" (facebookresearch/meshrcnn#92)"),
    "v100-32gb": (round(31.74 * GIB), "PyTorch OOM on a V100 32GB: \"31.74 GiB total capacity\" (liucongg/ChatGLM-"
                                      "Finetuning#73); nvidia-smi 32,510 MiB (bench.published)"),
    "a100-40gb": (round(39.43 * GIB), "PyTorch OOM on an A100 40GB: \"total capacity of 39.43 GiB\" (pytorch/pytorch#126766)"),
    "a100-80gb": (round(79.15 * GIB), "PyTorch OOM on an A100 80GB: \"total capacty of 79.15 GiB\" (pytorch/pytorch#111363)"),
    "a800-80gb": (round(79.15 * GIB), "as a100-80gb (the same board's 80 GB HBM2e; no A800 figure found)"),
    "h100-80gb": (round(79.11 * GIB), "PyTorch OOM on an H100 80GB: \"total capacity of 79.11 GiB\" (vllm-project/"
                                      "vllm#27508); nvidia-smi 81,559 MiB"),
    "rtx4090": (round(23.64 * GIB), "PyTorch OOM on an RTX 4090: \"total capacity of 23.64 GiB\" (ali-vilab/VGen#104, "
                                    "3DTopia/Phidias-Diffusion#8); nvidia-smi 24,564 MiB (RLinf/RLinf#255)"),
    "rtx5090": (round(31.37 * GIB), "PyTorch OOM on an RTX 5090: \"total capacity of 31.37 GiB\" (Wan-Video/Wan2.1#465)"),
    "l4": (round(22.03 * GIB), "PyTorch OOM on an L4: \"total capacity of 22.03 GiB\" (ArcInstitute/evo2#190); "
                               "nvidia-smi 23,034 MiB (lmstudio-ai/lmstudio-bug-tracker#1638), so the driver keeps "
                               "475 MiB"),
    "l40s": (round(44.52 * GIB), "PyTorch OOM on an L40S: \"total capacity of 44.52 GiB\" (huggingface/sentence-"
                                 "transformers#3214; ECC on, as shipped)"),
    "a6000": (round(47.53 * GIB), "PyTorch OOM on an RTX A6000: \"total capacity of 47.53 GiB\" (black-forest-labs/flux2#23)"),
    "h200": (150_109_880_320, "measured: torch.cuda.get_device_properties().total_memory on an H200, torch 2.11 + CUDA "
                              "13.0 (bench/gpu_runs/h200-run1.json, env.total_bytes); nvidia-smi 143,771 MiB"),
    "b200": (round(178.35 * GIB), "CUDA totalGlobalMem on a B200: \"Total Global Memory: 178.35 GB\" (GiB, "
                                  "pytorch/ao#4002); nvidia-smi 183,359 MiB (NVIDIA/TensorRT-LLM#10278)"),
    "mi300x": (round(191.98 * GIB), "PyTorch (ROCm) OOM on an MI300X: \"total capacity of 191.98 GiB\" (vllm-project/"
                                    "vllm#7951, 8 x MI300X; AMD's ROCm/rocm-blogs, blogs/artificial-intelligence/gptq/"
                                    "README.md, 2025-04-09, one MI300X)"),
}

MEMORY_GBPS: dict[str, tuple[float, str]] = {
    # Device memory bandwidth, GB/s (10^9 B/s), from the datasheets and whitepapers GPU_PRESETS cites: what a
    # device-side optimizer step is bound by ([Note: device optimizer step] in hplan.planner.kernel_size).
    "rtx3090": (936.0, "NVIDIA Ampere GA102 whitepaper, Appendix A: RTX 3090 memory bandwidth 936 GB/s"),
    "rtx2060": (336.0, "NVIDIA Turing TU106 whitepaper: RTX 2060, 14 Gbps GDDR6 on 192 bits, 336 GB/s"),
    "v100-32gb": (900.0, "NVIDIA Tesla V100 datasheet (SXM2): HBM2 bandwidth 900 GB/s"),
    "a100-40gb": (1555.0, "NVIDIA A100 datasheet: A100 40GB, GPU memory bandwidth 1,555 GB/s"),
    "a100-80gb": (2039.0, "NVIDIA A100 datasheet: A100 80GB SXM, GPU memory bandwidth 2,039 GB/s"),
    "a800-80gb": (2039.0, "NVIDIA A800 80GB SXM datasheet: GPU memory bandwidth 2,039 GB/s"),
    "h100-80gb": (3350.0, "NVIDIA H100 datasheet (SXM): GPU memory bandwidth 3.35 TB/s"),
    "rtx4090": (1008.0, "NVIDIA Ada Lovelace (AD102) whitepaper, Appendix A: RTX 4090 memory bandwidth 1,008 GB/s"),
    "rtx5090": (1792.0, "NVIDIA RTX Blackwell (GB202) whitepaper, Appendix A: RTX 5090 memory bandwidth 1,792 GB/s"),
    "l4": (300.0, "NVIDIA L4 datasheet: GPU memory bandwidth 300 GB/s"),
    "l40s": (864.0, "NVIDIA L40S datasheet: GPU memory bandwidth 864 GB/s"),
    "a6000": (768.0, "NVIDIA RTX A6000 datasheet: GPU memory bandwidth 768 GB/s"),
    "h200": (4800.0, "NVIDIA H200 datasheet (SXM): GPU memory bandwidth 4.8 TB/s"),
    "b200": (8000.0, "NVIDIA HGX B200 datasheet: 64 TB/s total memory bandwidth / 8 GPUs"),
    "mi300x": (5300.0, "AMD Instinct MI300X data sheet: peak theoretical memory bandwidth 5.3 TB/s"),
}
