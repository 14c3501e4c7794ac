"""GPU memory a CPU or fake trace cannot see: the CUDA context and the BLAS library's workspaces.

[Note: GEMM workspaces] PyTorch gives each cuBLAS handle a workspace from the caching allocator at its first
matrix product and keeps it for the life of the process (`aten/src/ATen/cuda/CublasHandlePool.cpp`: 32 MiB on
compute capability 9.0, else ":4096:2:16:8" = 8 MiB + 128 KiB; a cuBLASLt workspace of `CUBLASLT_WORKSPACE_SIZE`,
1024 KiB by default). Handles are per thread, and a training step multiplies matrices on two: the caller's (the
forward) and autograd's device thread (the backward). So the GPU holds 2 workspaces + the Lt one for the whole
step, memory that counts against the budget like the allocator's slack. Measured on an H200 with torch 2.11
(`python -m bench.cuda_check`): 32 MiB at a thread's first product, 32 MiB more on a second thread, and a
CUDA trace of gpt:small 65 MiB above the CPU trace of the same step (temporaries 72.35 MB against 4.19 MB). A
CUDA trace measures them; a CPU or fake trace gets them added here, for the GPU being planned.

[Note: CUDA context] Each process that touches the GPU also holds memory outside the caching allocator: the CUDA
context (the runtime's state, the kernel images it loads, cuBLAS/cuDNN handles' own buffers). PyTorch's
out-of-memory message prints it as "Including non-PyTorch memory, this process has X in use. Of the allocated
memory Y is allocated by PyTorch, and Z is reserved by PyTorch but unallocated": X - Y - Z. Public messages give
RTX 4090 0.46 and 0.49 GiB (pinokiofactory/flux-webui#11, 3DTopia/Phidias-Diffusion#8), RTX 5090 0.58 GiB
(Wan-Video/Wan2.1#465), L40S 0.50 GiB (huggingface/sentence-transformers#3214), RTX A6000 0.26 GiB
(black-forest-labs/flux2#23): median 0.49 GiB, kept as CONTEXT_BYTES = 512 MiB for every GPU but the Hopper ones.
Measured on this project's H200 run (bench/gpu_runs/h200-run3.json, torch 2.11 + CUDA 13.0): the resident plan of
the CUDA trace of gpt:small peaks 1,432,223,744 B above the trace's peak, its overhead (NVML used - allocator
reserved); NVML's used counts the driver's reserve outside CUDA's total (143,771 MiB in nvidia-smi - 150,109,880,320
B = 645,939,200 B), leaving 786,284,544 B (750 MiB) for the context: HOPPER_CONTEXT_BYTES. A CPU or fake trace gets
the context with the workspaces; a CUDA trace measured it. The preset's total is CUDA's (hplan.planner.presets,
[Note: GPU memory totals]), so the context is the only non-framework memory left to reserve; a `--gpu-mem` budget
holds it too.
"""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts import Trace

MIB = 2**20
SM90 = frozenset({"h100-80gb", "h200"})
"""Presets of compute capability 9.0, where PyTorch's cuBLAS workspace is 32 MiB."""
ROCM = frozenset({"mi300x"})
"""hipBLASLt's default workspace is 76 MiB (CublasHandlePool.cpp's ROCm branch), in place of cuBLASLt's 1 MiB."""
CONTEXT_BYTES = 512 * MIB
"""A process's CUDA context on the GPU ([Note: CUDA context]): public PyTorch OOM messages, median 0.49 GiB."""
HOPPER_CONTEXT_BYTES = 786_284_544
"""The context measured on this project's H200 run ([Note: CUDA context]), for the compute-capability-9.0 presets."""
GEMM_THREADS = 2
"""The training loop's thread (forward) and autograd's device thread (backward): one cuBLAS handle each."""


def gemm_workspace_bytes(gpu: str) -> int:
    """Workspace bytes a training step holds on `gpu` (a preset name; 0 for hplan's CPU fast tier)."""
    if gpu == "cpu":
        return 0
    per_thread = 32 * MIB if gpu in SM90 else 8 * MIB + 128 * 1024
    lt = 76 * MIB if gpu in ROCM else MIB
    return GEMM_THREADS * per_thread + lt


def context_bytes(gpu: str) -> int:
    """The CUDA context a process holds on `gpu` ([Note: CUDA context]; 0 for hplan's CPU fast tier)."""
    if gpu == "cpu":
        return 0
    return HOPPER_CONTEXT_BYTES if gpu in SM90 else CONTEXT_BYTES


def reserve_bytes(gpu: str) -> int:
    """What a CPU or fake trace cannot see on `gpu`: the CUDA context and the GEMM workspaces."""
    return context_bytes(gpu) + gemm_workspace_bytes(gpu)


def for_gpu(trace: Trace, gpu: str) -> Trace:
    """`trace` with the CUDA context and the workspaces of `gpu` in its non-framework overhead, unless it was
    measured on CUDA (its peaks and overhead hold them already) or `gpu` is the CPU tier. Every slack figure adds
    the overhead, so each plan's budget grows by the same bytes and its schedule stays the same."""
    extra = 0 if trace.device == "cuda" else reserve_bytes(gpu)
    return replace(trace, overhead_bytes=trace.overhead_bytes + extra) if extra else trace
