"""GPU memory a CPU or fake trace cannot see: the BLAS library's workspaces in PyTorch's caching allocator.

[Note: GEMM workspaces] PyTorch gives each cuBLAS handle a workspace from the caching allocator at its first
matrix product and keeps it for the life of the process (`aten/src/ATen/cuda/CublasHandlePool.cpp`: 32 MiB on
compute capability 9.0, else ":4096:2:16:8" = 8 MiB + 128 KiB; a cuBLASLt workspace of `CUBLASLT_WORKSPACE_SIZE`,
1024 KiB by default). Handles are per thread, and a training step multiplies matrices on two: the caller's (the
forward) and autograd's device thread (the backward). So the GPU holds 2 workspaces + the Lt one for the whole
step, memory that counts against the budget like the allocator's slack. Measured on an H200 with torch 2.11
(`python -m bench.cuda_check`): 32 MiB at a thread's first product, 32 MiB more on a second thread, and a
CUDA trace of gpt:small 65 MiB above the CPU trace of the same step (temporaries 72.35 MB against 4.19 MB). A
CUDA trace measures them; a CPU or fake trace gets them added here, for the GPU being planned.
"""

from __future__ import annotations

from dataclasses import replace

from hplan.artifacts import Trace

MIB = 2**20
SM90 = frozenset({"h100-80gb", "h200"})
"""Presets of compute capability 9.0, where PyTorch's cuBLAS workspace is 32 MiB."""
ROCM = frozenset({"mi300x"})
"""hipBLASLt's default workspace is 76 MiB (CublasHandlePool.cpp's ROCm branch), in place of cuBLASLt's 1 MiB."""
GEMM_THREADS = 2
"""The training loop's thread (forward) and autograd's device thread (backward): one cuBLAS handle each."""


def gemm_workspace_bytes(gpu: str) -> int:
    """Workspace bytes a training step holds on `gpu` (a preset name; 0 for hplan's CPU fast tier)."""
    if gpu == "cpu":
        return 0
    per_thread = 32 * MIB if gpu in SM90 else 8 * MIB + 128 * 1024
    lt = 76 * MIB if gpu in ROCM else MIB
    return GEMM_THREADS * per_thread + lt


def for_gpu(trace: Trace, gpu: str) -> Trace:
    """`trace` with the workspaces of `gpu` in its non-framework overhead, unless it was measured on CUDA (its
    peaks hold them already) or `gpu` is the CPU tier. Every slack figure adds the overhead, so each plan's budget
    grows by the same bytes and its schedule stays the same."""
    extra = 0 if trace.device == "cuda" else gemm_workspace_bytes(gpu)
    return replace(trace, overhead_bytes=trace.overhead_bytes + extra) if extra else trace
