"""`python -m bench.cpu_optimizer_rate [--numel N] [--steps K]`: torch's fused CPU AdamW rate on this host.

Why: the baselines and the planner charge a host-side optimizer update at Hardware.cpu_optimizer_gbps, GB/s of
model state updated (weight + gradient + master + two moments: 16 B per parameter for AdamW, fp32 or mixed).
The "this-machine" host presets in hplan.planner.presets quote this script's output, so the number is
measured, not guessed. One fp32 tensor of `numel` elements (large enough to leave the caches), a fixed random
gradient, `steps` timed steps after one warm-up step; the best step is kept (the machine is shared, so the
median is noisier than the minimum), for 1 thread and then 2.
"""

from __future__ import annotations

import argparse
import time

STATE_BYTES_PER_PARAM = 16
"""weight 4 + grad 4 + exp_avg 4 + exp_avg_sq 4 for fp32 AdamW (a mixed recipe's master copy plays the weight)."""


def rate(numel: int, steps: int, threads: int) -> tuple[float, float]:
    """(best seconds per step, parameters per second) of torch.optim.AdamW(fused=True) on the CPU."""
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    param.grad = torch.randn(numel, generator=gen)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    opt.step()
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    return best, numel / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2**24)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, fused AdamW, {args.numel} fp32 parameters, best of {args.steps} steps")
    for threads in (1, 2):
        seconds, per_s = rate(args.numel, args.steps, threads)
        print(f"{threads} thread(s): {seconds * 1e3:.1f} ms/step, {per_s / 1e9:.3f}e9 params/s, "
              f"{per_s * STATE_BYTES_PER_PARAM / 1e9:.1f} GB/s of state")


if __name__ == "__main__":
    main()
