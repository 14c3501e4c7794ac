"""Correctness references for data-parallel training on N ranks (issue 17), importable by tests and bench.

The contract every distributed hplan run must meet: with N ranks, rank r trains step s on the workload's
micro-batch `batch(s·N + r)`, and the loss reported for step s is the mean over ranks. Three references
train that way from the workload's seed and return the same record (`RefRun`):

- `accumulated`: one process, plain PyTorch, accumulating the N micro-batches (each loss ÷ N) before one
  optimizer step — the definition of the right answer;
- `fsdp2`: N ranks with `torch.distributed.fsdp.fully_shard` (FSDP2) on CPU/gloo, one `fully_shard` per
  transformer block and one for the root (which then owns the tied vocabulary, used at both ends);
- `replicated`: N ranks keeping full replicas, gradients flattened into one bucket, all-reduced (sum) then
  ÷ N — what DDP computes, written out so nothing but the all-reduce stands between it and `accumulated`.

[Note: reference determinism] Every process runs torch with one thread (`torch.set_num_threads(1)`):
matmul kernels may split reductions differently with other thread counts, which moves results by an ulp
and would make "equal within 1e-5" a statement about thread counts. With N = 2 the replicated run's
gradient is bitwise (g0 + g1)/2 and the reference's is g0/2 + g1/2: equal, since halving is exact
and a two-term sum is commutative — except for the tied vocabulary, whose second write is a fused
`addmm_` into the first (hplan.grads), so the differences there are rounding, not bugs.
fp32 only: the mixed-precision recipes add master copies these references do not model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hplan.errors import HplanError
from hplan.executor.ranks.launch import RankInfo, launch
from hplan.specs import load_workload
from hplan.workload import Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class RefRun:
    """What a reference training run produced."""

    losses: list[float]
    """Per step, the mean over the N micro-batches (ranks) of their losses."""
    weights: dict[str, torch.Tensor]
    """Final full (unsharded) parameters by name (`named_parameters`, tied weights once)."""
    step_seconds: list[float]
    """Wall time of each step (rank 0's for multi-rank runs): forward, backward, gradient sync, update."""
    replicas_agree: bool = True
    """Multi-rank: every rank ended with bitwise the same full weights (checked by checksum)."""
    norms: list[float] = field(default_factory=list)
    """Per step, the total norm clip_grad_norm_ returned (`accumulated` with a norm clip; else empty)."""


def _workload(spec: str) -> Workload:
    return _workload_checked(load_workload(spec))


def _workload_checked(workload: Workload) -> Workload:
    if workload.precision != "fp32":
        raise HplanError(f"the distributed references are fp32 only, {workload.name} is {workload.precision}; "
                         "use an fp32 workload")
    return workload


def accumulated(spec: str, world: int, steps: int, *, threads: int = 1, clip: tuple[str, float] | None = None,
                overrides: dict[str, Any] | None = None) -> RefRun:
    """Single process: per step, N micro-batches `batch(s·N + r)`, each loss ÷ N, one optimizer step (after
    torch.nn.utils.clip_grad_norm_, clip = ("norm", max_norm), or clip_grad_value_, ("value", v), when given; the
    totals clip_grad_norm_ returned in `norms`).
    Runs with `threads` torch threads and gives the caller's count back after: a count left behind changes
    every later run's matmul reductions in this process (and so its losses, by an ulp)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _accumulated(spec, world, steps, clip, overrides)
    finally:
        torch.set_num_threads(before)


def _accumulated(spec: str, world: int, steps: int, clip: tuple[str, float] | None = None,
                 overrides: dict[str, Any] | None = None) -> RefRun:
    workload = _workload_checked(load_workload(spec, overrides=overrides))
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    losses, seconds, norms = [], [], []
    for step in range(steps):
        start = time.perf_counter()
        micro = []
        for r in range(world):
            loss = workload.loss(model, workload.batch(step * world + r))
            (loss / world).backward()
            micro.append(loss.detach())
        if clip is not None and clip[0].startswith("norm"):  # "norm:P": norm_type P
            p = float(clip[0][5:] or 2.0)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip[1], norm_type=p)))
        elif clip is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip[1])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        losses.append(float(sum(micro[1:], micro[0]) / world))
    return RefRun(losses=losses, weights=_full_weights(model), step_seconds=seconds, norms=norms)


def fsdp2(spec: str, world: int, steps: int, *, timeout_s: float = 600.0) -> RefRun:
    """N ranks on gloo with FSDP2 (`fully_shard`): parameters, gradients and AdamW state sharded."""
    return _collect(launch(_fsdp2_rank, spec, steps, nprocs=world, timeout_s=timeout_s))


def replicated(spec: str, world: int, steps: int, *, timeout_s: float = 600.0) -> RefRun:
    """N ranks with full replicas; per parameter, all_reduce(SUM) of its gradient, then ÷ N."""
    return _collect(launch(_replicated_rank, spec, steps, nprocs=world, timeout_s=timeout_s))


def max_abs_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over every element of every parameter (same names required)."""
    if sorted(a) != sorted(b):
        raise HplanError(f"weights differ in names: {sorted(set(a) ^ set(b))[:4]}; compare runs of one model")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def max_rel_loss_diff(a: list[float], b: list[float]) -> float:
    """Largest |a - b| / |b| over steps (b is the reference)."""
    if len(a) != len(b):
        raise HplanError(f"loss lists differ in length ({len(a)} vs {len(b)}); run the same number of steps")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# --- per-rank bodies (module level: spawned ranks import them) ---------------------------------------------


def _fsdp2_rank(info: RankInfo, spec: str, steps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    workload = _workload(spec)
    model = workload.build_model()
    mesh = init_device_mesh("cpu", (info.world_size,))
    for block in getattr(model, "h", []):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = workload.optimizer(model.parameters())

    def sync() -> None:  # FSDP2 reduce-scatters (AVG) in its post-backward hooks
        return None

    losses, seconds = _train(info, workload, model, optimizer, steps, sync)
    # full_tensor() is an all-gather: every rank must call it, in the same order
    weights = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
    return _rank_record(info, losses, seconds, weights)


def _replicated_rank(info: RankInfo, spec: str, steps: int) -> dict[str, Any]:
    workload = _workload(spec)
    model = workload.build_model()
    optimizer = workload.optimizer(model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]

    def sync() -> None:
        """One bucket, as DDP would with a bucket larger than the model: gloo pays ~1 ms per call."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]  # unused: still summed
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(info.world_size)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    losses, seconds = _train(info, workload, model, optimizer, steps, sync)
    return _rank_record(info, losses, seconds, _full_weights(model))


def _train(info: RankInfo, workload: Workload, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           steps: int, sync: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Rank r, step s: micro-batch `batch(s·N + r)`; returns (global mean losses, step seconds)."""
    losses, seconds = [], []
    for step in range(steps):
        start = time.perf_counter()
        loss = workload.loss(model, workload.batch(step * info.world_size + info.rank))
        loss.backward()
        sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / info.world_size)
    return losses, seconds


def _rank_record(info: RankInfo, losses: list[float], seconds: list[float],
                 weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Rank 0 returns the weights; every rank returns a checksum of them, so replicas can be compared."""
    checksum = [float(w.detach().double().sum()) for w in weights.values()]
    checksum += [float(w.detach().double().abs().sum()) for w in weights.values()]
    return {"losses": losses, "seconds": seconds, "checksum": checksum,
            "weights": weights if info.rank == 0 else None}


def _collect(records: list[dict[str, Any]]) -> RefRun:
    first = records[0]
    agree = all(r["checksum"] == first["checksum"] and r["losses"] == first["losses"] for r in records)
    return RefRun(losses=first["losses"], weights=first["weights"], step_seconds=first["seconds"],
                  replicas_agree=agree)


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}
