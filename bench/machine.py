"""What the benchmark numbers were measured on: the CPU, cores, memory, software, commit and time, and whether this
CPU's bf16 is fast enough to train in.

Its own module because it describes the machine, not a measurement: every figure in BENCHMARKS.md is a ratio or
time on one machine, and the header this module writes is what makes two runs comparable (or shows they are not).
Like bench.harness it imports no torch at module level.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import time
from pathlib import Path

from bench.harness import REPO_ROOT, fmt_bytes

BF16_TOO_SLOW = 8.0
"""A CPU whose bf16 matmul is this many times slower than fp32 has no bf16 units (torch falls back to a scalar
kernel for some layouts): a bf16-mixed gpt:350m step then takes minutes, so the full runs train fp32 instead."""


def bf16_matmul_slowdown() -> float:
    """bf16 ÷ fp32 seconds of the matmul a linear layer's backward runs (grad_out @ W, 64×1024 @ 1024×1024, both
    row-major) on this CPU: far above 1 where the CPU has no bf16 units and torch falls back to a scalar kernel."""
    import torch

    def seconds(dtype: torch.dtype) -> float:
        a, b = torch.randn(64, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        a @ b
        start = time.perf_counter()
        for _ in range(3):
            a @ b
        return (time.perf_counter() - start) / 3

    return seconds(torch.bfloat16) / seconds(torch.float32)


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, falling back to platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_description() -> dict[str, str]:
    """What the numbers were measured on; printed at the top of BENCHMARKS.md."""
    import psutil

    try:
        import torch

        torch_version = torch.__version__
        threads = str(torch.get_num_threads())
    except ImportError:  # the helpers stay usable without torch
        torch_version, threads = "not installed", "—"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = psutil.cpu_count(logical=True) or 0
    return {
        "CPU": cpu_model(),
        "cores": f"{psutil.cpu_count(logical=False) or '?'} physical / {psutil.cpu_count(logical=True) or '?'} logical "
                 f"({affinity} usable, torch threads {threads})",
        "RAM": fmt_bytes(psutil.virtual_memory().total) + f" ({psutil.virtual_memory().total / 2**30:.1f} GiB)",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "torch": torch_version,
        "hplan commit": git_commit(),
        "load average (1 min) at start": f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "—",
    }


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], check=False, cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
