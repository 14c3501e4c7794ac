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
A sequence search stops at the model's context (max_position_embeddings, or the field hplan.models.hf's
CONTEXT_FIELDS names) and a batch search at BATCH_CAP; the table then says the limit, not an infeasible plan.
A model that names no context (BLOOM; MPT and Falcon-RW with ALiBi have no position table) is searched up to
SEQ_CEILING tokens: its answer is still the pair of plans at k and k + one step where the GPU runs out first,
and "≥ SEQ_CEILING (limit: the search's ceiling ...)" where it does not, which claims no context for the model.

[Note: fit screen] A plan of an 8B model takes a minute, a fake trace of it tens of seconds, so the search does
not plan every shape it tries. It first looks for the boundary with a screen: the smallest GPU budget any
schedule of that trace needs (hplan.planner.min_gpu_bytes, the minimum make_plan itself starts from; no
objective is solved), less the GPU's budget. That margin is close to linear in batch and, over a few steps, in
sequence, so the screen's search interpolates: from two traced shapes it guesses the crossing, then tries the
guess and the step after it (`_screen_boundary`), falling back to bisection when a guess does not shrink the
bracket. Only the shapes it lands on are planned: the screen's answer k is then proven by make_plan at k
(feasible) and at k + 1 (infeasible). Where a plan disagrees with the screen (host memory, which the screen
counts only as the model data's total), the plain search above continues from there on plans alone, so every
answer is still a pair of plans. With --gpus N there is no screen: each tried shape is planned.

[Note: a borrowed slope] Each tried shape costs a fake trace (15 s of CPU for an 8B model), and with one measured
point the screen's search doubles the sequence (a far shape, traced only to draw a line). The batch search has
already measured the margin at two batch sizes at the asked sequence: a slope per token. The sequence search at
batch b starts from that slope times b × SEQ_STEP, through its one measured point; attention makes the margin
grow a little faster with sequence than with batch, so the guess lands near the crossing and the line through
the points it then measures takes over. The slope only chooses which shapes to trace: every answer is still
the pair of plans at k and k + 1.

[Note: a first batch step] With one measured point the batch search used to double (batch 1, then 2: a trace
of an 8B-class model, 15 s of CPU, drawn only for its slope). The one trace already says how the margin grows:
the minimum's bottleneck event holds the model data it touches, the slack, and non-model bytes (activations,
temporaries), and only the last grow with the batch, nearly in proportion. Their bytes per sample, as the
borrowed slope above, set the first guess. Some of those bytes do not grow with the batch, so the slope
overstates the growth and the crossing lies at or past the guess: the search tries the step after the guess
first (Phi-3-mini on an RTX 4090, seq 2048: the line crosses at 17.x, batch 18 fits, 19 does not; it traces
batches 1, 18 and 19 where doubling traced 1, 2, 18 and 19). On an exact slope that step fails and the line
through the two points gives the guess itself next: no more tries than before. A guess that misses costs what
doubling did: the line through the two measured points takes over. The guess only chooses which shapes to trace: every answer is still the pair of
plans at k and k + 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hplan.artifacts import Plan, Trace
from hplan.errors import HplanError
from hplan.planner import for_gpu

SEQ_STEP = 128
"""Granularity of the longest-sequence search, tokens: answers are multiples of it."""
SEQ_CEILING = 1 << 20
"""The sequence search's ceiling, tokens, for a model whose config names no context ([Note: fit search]): a
million tokens, past any one-GPU training run's sequence, keeps the search (about 13 doublings from 128 tokens)
within fit's time goal."""
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
        self.screens = True
        """Search on the screen ([Note: fit screen]) and plan only the boundary; False plans every tried shape."""
        self._margins: dict[tuple[str, int, int], int] = {}
        self._grows: dict[tuple[str, int, int], int] = {}
        self._least: dict[tuple[str, int, int], int] = {}

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
                trace = for_gpu(trace, gpu)  # [Note: GEMM workspaces]
                plan = self._planner(trace, self._hardware(gpu, trace))
                reason = "" if plan.summary.feasible else plan.summary.bottleneck
                self._probes[key] = Probe(batch=batch, seq=seq, plan=plan, reason=reason)
        return self._probes[key]

    def margin(self, gpu: str, batch: int, seq: int) -> int:
        """The screen ([Note: fit screen]): the smallest GPU budget of the trace at (batch, seq) less `gpu`'s
        budget; > 0: no plan fits. Needs a trace, never a plan."""
        key = (gpu, batch, seq)
        if key not in self._margins:
            from hplan.planner import min_gpu_bytes

            if self.model_bytes is not None and self._capacity(gpu):
                self._margins[key] = 1 << 62  # no shape fits: as large as can be, and no trace to make
                return self._margins[key]
            trace = self.trace(batch, seq)
            if isinstance(trace, str) or self._capacity(gpu):
                self._margins[key] = 1 << 62  # beyond the context, or no shape fits: as large as can be
            else:
                trace = for_gpu(trace, gpu)
                hardware = self._hardware(gpu, trace)
                smallest = min_gpu_bytes(trace, hardware)
                self._least[key] = smallest.gpu_bytes
                self._margins[key] = smallest.gpu_bytes - hardware.gpu_bytes
                self._grows[key] = smallest.non_model_bytes
        return self._margins[key]

    def batch_slope(self, gpu: str, batch: int, seq: int) -> float | None:
        """The screen's growth per sample guessed from the one trace at (batch, seq): its bottleneck's non-model
        bytes over the batch ([Note: a first batch step]); None when that margin has no trace behind it."""
        self.margin(gpu, batch, seq)
        grows = self._grows.get((gpu, batch, seq), 0)
        return grows / batch if grows > 0 else None

    def least_gpu_bytes(self, gpu: str, batch: int, seq: int) -> int | None:
        """What the job at (batch, seq) needs of `gpu`: the smallest budget any schedule fits (`hplan plan --gpu-mem
        min`'s, CUDA context and slack included), not the budget its plan fills. The screen's figure ([Note: fit
        screen]): the batch search measured it at the asked shape already. None with --gpus N (no screen)."""
        if self.ranks != 1:
            return None
        self.margin(gpu, batch, seq)
        return self._least.get((gpu, batch, seq))

    def measured_least(self, gpu: str) -> dict[tuple[int, int], int]:
        """(batch, seq) -> least_gpu_bytes for the shapes the screen measured on `gpu` (the boundaries' k among
        them, mostly): read, never computed."""
        return {(b, s): v for (g, b, s), v in self._least.items() if g == gpu}

    def seq_slope(self, gpu: str, batch: int, seq: int) -> float | None:
        """The screen's growth per SEQ_STEP tokens at `batch`, borrowed from the margins the batch search measured
        at `seq` ([Note: a borrowed slope]); None when it measured fewer than two batch sizes there."""
        at = sorted((b, m) for (g, b, s), m in self._margins.items() if g == gpu and s == seq and m < 1 << 62)
        if len(at) < 2:
            return None
        nearest = sorted(at, key=lambda bm: abs(bm[0] - batch))[:2]
        (b1, m1), (b2, m2) = sorted(nearest)
        per_token = (m2 - m1) / ((b2 - b1) * seq)
        return per_token * batch * SEQ_STEP if per_token > 0 else None

    def largest_batch(self, gpu: str, batch: int, seq: int) -> Boundary:
        cap_text = f"the search's cap, batch {BATCH_CAP}"
        if self.screens and self.ranks == 1:
            return _screened(lambda n: self.margin(gpu, n, seq), lambda n: self.probe(gpu, n, seq), start=batch,
                             cap=BATCH_CAP, cap_text=cap_text, slope=self.batch_slope(gpu, batch, seq), up=True)
        return _boundary(lambda n: self.probe(gpu, n, seq), start=batch, cap=BATCH_CAP, cap_text=cap_text)

    def longest_seq(self, gpu: str, batch: int, seq: int) -> Boundary:
        units = max(1, seq // SEQ_STEP)
        if self.context is None:
            cap = SEQ_CEILING // SEQ_STEP
            cap_text = f"the search's ceiling, {SEQ_CEILING:,} tokens: the config names no context"
        else:
            cap = self.context // SEQ_STEP
            cap_text = f"the model's context, {self.context} tokens"
        if cap < 1:
            raise HplanError(f"the model's context ({self.context}) is shorter than the search step {SEQ_STEP}")
        if self.screens and self.ranks == 1:
            return _screened(lambda n: self.margin(gpu, batch, n * SEQ_STEP),
                             lambda n: self.probe(gpu, batch, n * SEQ_STEP), start=min(units, cap), cap=cap,
                             cap_text=cap_text, slope=self.seq_slope(gpu, batch, seq))
        return _boundary(lambda n: self.probe(gpu, batch, n * SEQ_STEP), start=min(units, cap), cap=cap,
                         cap_text=cap_text)


def _screened(margin: Callable[[int], int], probe: Callable[[int], Probe], *, start: int, cap: int,
              cap_text: str, slope: float | None = None, up: bool = False) -> Boundary:
    """The screen's boundary k, proven by the plans at k and k + 1; where a plan disagrees with the screen, the
    plain search continues from there on plans alone ([Note: fit screen])."""
    k = _screen_boundary(margin, start=start, cap=cap, slope=slope, up=up)
    if k == 0:
        first = probe(1)
        return Boundary(best=None, next=first) if not first.fits else \
            _boundary(probe, start=1, cap=cap, cap_text=cap_text)
    best = probe(k)
    if not best.fits:
        return _boundary(probe, start=k, cap=cap, cap_text=cap_text)
    if k >= cap:
        return Boundary(best=best, next=None, limit=cap_text)
    nxt = probe(k + 1)
    if nxt.fits:
        return _boundary(probe, start=k + 1, cap=cap, cap_text=cap_text)
    return Boundary(best=best, next=nxt)


def _screen_boundary(margin: Callable[[int], int], *, start: int, cap: int, slope: float | None = None,
                     up: bool = False) -> int:
    """The largest n in 1..cap whose margin is <= 0 (0: none), for a margin that grows with n, nearly linearly
    ([Note: fit screen]): guesses by the line through the two measured points nearest the crossing, and tries the
    step after a passing guess at once; a guess that does not halve the bracket is followed by a bisection.
    `slope`: the margin's growth per step of n estimated elsewhere ([Note: a borrowed slope]); with one measured
    point it sets the first guess, where the search would otherwise double or halve."""
    seen: dict[int, int] = {}
    lo, hi = 0, cap + 1  # margin(lo) <= 0 and margin(hi) > 0; 0 and cap + 1 are not measured
    n, last = min(max(start, 1), cap), ""
    ref, since = hi - lo, 0  # the bracket's width two tries ago, and tries since it was taken
    while True:
        seen[n] = margin(n)
        passed = seen[n] <= 0
        if passed:
            lo = max(lo, n)
        else:
            hi = min(hi, n)
        if hi - lo <= 1:
            return lo
        since += 1
        if since >= 2 and last != "double":
            halved = 2 * (hi - lo) <= ref
            ref, since = hi - lo, 0
            if not halved and hi <= cap and lo >= 1:
                n, last = (lo + hi) // 2, "bisect"
                continue
        if passed and last == "guess" and n + 1 < hi:
            n, last = n + 1, "next"  # the guess passed: the step after it may be the boundary
            continue
        n, last = _guess(seen, lo, hi, cap, slope, up)


def _guess(seen: dict[int, int], lo: int, hi: int, cap: int, borrowed: float | None = None,
           up: bool = False) -> tuple[int, str]:
    """The next n strictly between lo and hi: where the line through the measured points nearest the crossing
    (those at lo and hi, else the two nearest on one side) reaches 0; with one point, the line of the `borrowed`
    slope through it, else doubling or halving."""
    below = sorted(n for n in seen if seen[n] <= 0)
    above = sorted(n for n in seen if seen[n] > 0)
    if below and above:
        a, b = below[-1], above[0]
    elif len(below) >= 2:
        a, b = below[-2], below[-1]
    elif len(above) >= 2:
        a, b = above[0], above[1]
    elif borrowed is not None and borrowed > 0 and len(seen) == 1:
        a = b = (below or above)[0]
    elif below:
        return min(2 * lo, hi - 1, cap), "double"
    else:
        return max(hi // 2, lo + 1), "halve"
    slope = (seen[b] - seen[a]) / (b - a) if b != a else float(borrowed or 0)
    if slope <= 0:
        x = float(2 * lo if not above else (lo + hi) // 2)
    else:
        x = a - seen[a] / slope
    limit_hi = hi - 1 if above else min(hi - 1, 64 * max(lo, 1))  # an extrapolation goes at most 64x further
    if up and borrowed is not None and a == b and below:  # a slope that overstates the growth: look one further
        x = int(x) + 1.0  # ([Note: a first batch step])
    n = int(min(max(int(x), lo + 1), limit_hi))
    return n, "guess" if n == int(x) and not (up and a == b) else "reach"  # a guess cut short is no boundary to try the next step of


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
