"""`python -m bench.gloo_rate [--reps K]`: gloo collectives between 2 ranks on this host, latency and bandwidth.

Why: a many-rank plan for the CPU fast tier prices its collectives with the "gloo-loopback" network preset
(hplan.planner.presets), and the chunk size the planner picks depends on what one call costs. The preset quotes
this script's output. Two ranks (hplan.executor.ranks.launch, one thread each, as `hplan run --nproc 2` runs them)
time all_gather_into_tensor and reduce_scatter_tensor of fp32 buffers from 4 KiB to 16 MiB, best of `reps`
after a warm-up (the machine is shared); a least-squares line through (buffer bytes, seconds) gives the
latency per call (intercept) and the algorithm bandwidth (1 / slope) of a 2-rank ring, one step each.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

SIZES = tuple(2**k for k in range(12, 25, 2))
"""Full-buffer bytes: 4 KiB to 16 MiB."""


def rank_times(info: Any, reps: int) -> dict[str, list[tuple[int, float]]]:
    """(buffer bytes, best seconds) per op on this rank."""
    import torch
    import torch.distributed as dist

    out: dict[str, list[tuple[int, float]]] = {"all_gather": [], "reduce_scatter": []}
    n = info.world_size
    for size in SIZES:
        full = torch.zeros(size // 4)
        shard = torch.zeros(size // 4 // n)
        for op in out:
            best = float("inf")
            for i in range(reps + 1):
                dist.barrier()
                start = time.perf_counter()
                if op == "all_gather":
                    dist.all_gather_into_tensor(full, shard)
                else:
                    dist.reduce_scatter_tensor(shard, full)
                if i:
                    best = min(best, time.perf_counter() - start)
            out[op].append((size, best))
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per call, bytes per second) of the least-squares line seconds = a + bytes / bw."""
    xs, ys = [float(b) for b, _ in points], [s for _, s in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1 / slope


def main() -> None:
    from hplan.executor.ranks.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    times = launch(rank_times, args.reps, nprocs=2, timeout_s=900)[0]
    for op, points in times.items():
        latency, bandwidth = fit(points)
        print(f"{op}: {latency * 1e6:.0f} µs per call, {bandwidth / 1e9:.2f} GB/s; "
              + ", ".join(f"{b // 1024} KiB {s * 1e6:.0f} µs" for b, s in points))


if __name__ == "__main__":
    main()
