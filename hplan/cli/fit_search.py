"""`hplan fit`'s search: trace and plan each tried shape, find the largest batch and the longest sequence.

[Note: fit search] Every answer `hplan fit` gives is a plan: a shape "fits" a GPU when `make_plan` (or the
many-rank planner for `--gpus N`) returns a feasible plan for a fake trace of the workload at that batch size
and sequence length. Nothing is scaled from another shape's trace: activation and allocator figures are not
linear in batch or sequence (attention, the allocator's rounding, the loss's logits), so each tried shape is
traced (fake tensors, 2 iterations) and the traces are kept for every GPU of one command. The largest batch is
searched in steps of 1 and the longest sequence in steps of SEQ_STEP tokens: doubling from the given value
until a plan is infeasible (or halving until one is feasible), then bisecting; the answer k comes with the
plan at k (feasible) and the plan at k + one step (infeasible), so the boundary itself is proven by two plans
whatever the search assumed. One verdict needs no plan: when the model data (the same bytes at every shape)
exceeds the GPU, host and disk together, no shape fits anywhere (the plan would have to keep more bytes than
all tiers hold), so such a probe is answered from that count, naming it, without tracing or planning.
A sequence search stops at the model's context (max_position_embeddings) and a
batch search at BATCH_CAP; the table then says the limit, not an infeasible plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hplan.artifacts import Plan, Trace
from hplan.errors import HplanError

SEQ_STEP = 128
"""Granularity of the longest-sequence search, tokens: answers are multiples of it."""
BATCH_CAP = 4096
"""The batch search stops here (a plan that fits at it says so)."""
FIT_ITERS = 2
"""Iterations each tried shape is traced for: the fewest that create the optimizer state."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One tried shape on one GPU: its plan, or why there is none."""

    batch: int
    seq: int
    plan: Plan | None
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.summary.feasible


@dataclass(frozen=True, kw_only=True, slots=True)
class Boundary:
    """A search's answer: the last fitting probe (None: nothing fits) and the probe one step larger (None: the
    search reached its limit, named in `limit`)."""

    best: Probe | None
    next: Probe | None
    limit: str = ""


class Fitter:
    """Traces a spec at tried shapes (cached) and plans each on the GPUs asked for."""

    def __init__(self, *, spec: str, precision: str | None, overrides: dict[str, Any],
                 hardware: Callable[[str, Trace], Any], planner: Callable[[Trace, Any], Plan],
                 on_shape: Callable[[int, int], None] | None = None) -> None:
        self.spec, self.precision, self.overrides = spec, precision, overrides
        self._hardware, self._planner, self._on_shape = hardware, planner, on_shape
        self._traces: dict[tuple[int, int], Trace | str] = {}
        self._probes: dict[tuple[str, int, int], Probe] = {}
        self.context: int | None = None
        self.model_bytes: int | None = None
        """The model data's bytes (weights, gradients, optimizer state): the same at every shape."""
        self.ranks = 1
        """Data-parallel ranks the model data may be sharded over."""
        self.capacity: Callable[[str], tuple[int, int | None, int | None]] | None = None
        """gpu -> (GPU bytes, host bytes or None = unbounded, disk bytes or None = no disk) of its hardware."""

    def _capacity(self, gpu: str) -> str:
        """Why no shape can fit `gpu` (its model data exceeds GPU + host + disk together), else ""."""
        if self.capacity is None or self.model_bytes is None:
            return ""
        from hplan.sizes import format_size

        gpu_bytes, host, disk = self.capacity(gpu)
        if host is None:
            return ""
        room = gpu_bytes + host + (disk or 0)
        share = -(-self.model_bytes // self.ranks)  # sharded over data-parallel ranks at best evenly
        if share <= room:
            return ""
        return (f"model data {format_size(share)}{' per rank' if self.ranks > 1 else ''} (weights, gradients, "
                "optimizer state) exceeds the "
                f"GPU{', host and disk' if disk else ' and host'} together ({format_size(room)}); add host memory "
                f"(--cpu-mem) or a disk tier (--nvme)")

    def trace(self, batch: int, seq: int) -> Trace | str:
        """The fake trace at (batch, seq), or the reason it cannot be made (the model's context)."""
        key = (batch, seq)
        if key not in self._traces:
            from hplan.specs import load_workload
            from hplan.tracer import trace_workload

            if self.context is not None and seq > self.context:
                self._traces[key] = f"beyond the model's context ({self.context} tokens)"
                return self._traces[key]
            if self._on_shape is not None:
                self._on_shape(batch, seq)
            try:
                workload = load_workload(self.spec, batch_size=batch, seq_len=seq, overrides=dict(self.overrides),
                                         precision=self.precision)
            except HplanError as exc:
                if "exceeds" not in str(exc) or "context" not in str(exc):
                    raise
                self._traces[key] = f"beyond the model's context ({exc})"
                return self._traces[key]
            traced = trace_workload(workload, device="fake", iters=FIT_ITERS)
            self._traces[key] = traced
            self.model_bytes = traced.model_bytes
        return self._traces[key]

    def load(self, batch: int, seq: int) -> Any:
        """The workload at the asked shape (bad specs fail here, before any trace); learns the model's context."""
        from hplan.specs import load_workload

        workload = load_workload(self.spec, batch_size=batch, seq_len=seq, overrides=dict(self.overrides),
                                 precision=self.precision)
        context = getattr(workload.model, "hplan_context", None)
        self.context = context if isinstance(context, int) and not isinstance(context, bool) else None
        return workload

    def probe(self, gpu: str, batch: int, seq: int) -> Probe:
        key = (gpu, batch, seq)
        if key not in self._probes and self.model_bytes is None:
            self.trace(batch, seq)  # learns the model data's bytes (traced once per shape in any case)
        if key not in self._probes and self.model_bytes is not None:
            short = self._capacity(gpu)
            if short:  # no shape fits: no trace or plan needed (see [Note: fit search])
                self._probes[key] = Probe(batch=batch, seq=seq, plan=None, reason=short)
        if key not in self._probes:
            trace = self.trace(batch, seq)
            if isinstance(trace, str):
                self._probes[key] = Probe(batch=batch, seq=seq, plan=None, reason=trace)
            else:
                plan = self._planner(trace, self._hardware(gpu, trace))
                reason = "" if plan.summary.feasible else plan.summary.bottleneck
                self._probes[key] = Probe(batch=batch, seq=seq, plan=plan, reason=reason)
        return self._probes[key]

    def largest_batch(self, gpu: str, batch: int, seq: int) -> Boundary:
        return _boundary(lambda n: self.probe(gpu, n, seq), start=batch, cap=BATCH_CAP,
                         cap_text=f"the search's cap, batch {BATCH_CAP}")

    def longest_seq(self, gpu: str, batch: int, seq: int) -> Boundary:
        units = max(1, seq // SEQ_STEP)
        cap = (self.context // SEQ_STEP) if self.context else 1 << 20
        if cap < 1:
            raise HplanError(f"the model's context ({self.context}) is shorter than the search step {SEQ_STEP}")
        return _boundary(lambda n: self.probe(gpu, batch, n * SEQ_STEP), start=min(units, cap), cap=cap,
                         cap_text=f"the model's context, {self.context} tokens")


def _boundary(probe: Callable[[int], Probe], *, start: int, cap: int, cap_text: str) -> Boundary:
    """The largest n in 1..cap whose probe fits and the probe at n + 1 (see [Note: fit search])."""
    first = probe(start)
    best: Probe | None
    if first.fits:
        best, n = first, start
        while True:
            if n >= cap:
                return Boundary(best=best, next=None, limit=cap_text)
            m = min(2 * n, cap)
            nxt = probe(m)
            if not nxt.fits:
                lo, hi = n, m
                break
            best, n = nxt, m
    else:
        best, lo, hi, nxt = None, 0, start, first
        while hi > 1:
            m = hi // 2
            p = probe(m)
            if p.fits:
                best, lo = p, m
                break
            hi, nxt = m, p
        if best is None:
            return Boundary(best=None, next=nxt)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = probe(mid)
        if p.fits:
            best, lo = p, mid
        else:
            nxt, hi = p, mid
    return Boundary(best=best, next=nxt)
