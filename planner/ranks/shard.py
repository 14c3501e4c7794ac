"""make_shard_plan: one rank's placement plan for N data-parallel ranks, with the shard factors that run fastest.

Trace once, plan for N: the trace is one rank's micro-batch. Every rank runs the same model on its own
micro-batch, so the world size and the factors (P, G, OS) fix each rank's regions ([Note: shard layout] in
hplan.artifacts.shard) and the collectives its steps need ([Note: plan collectives]); no multi-rank trace is
needed, and every rank holds exactly as many bytes at every step.

What it minimises: for each factor choice the usual one-rank problem (`planner.ranks.shard_build`) is searched and
solved as `make_plan` does — fewest host↔GPU bytes per iteration, then shortest predicted many-rank step — and
among the factor choices that fit each rank's GPU (and host) budget it keeps the shortest predicted step time
(`planner.ranks.shard_time`, as hplan's executor runs it: compute, host links, host optimizer and
collectives issued one step ahead or beside the next step), then the fewest collective bytes per rank, then the fewest host↔GPU bytes. When a choice fits
all-resident, its chunk size is chosen by step time too (`plan_factors`, REFINED_CHOICES): each chunk is one
call whose latency is paid per chunk. AMSP (arXiv 2311.00257) chooses its factors by minimising communication
under a memory limit; hplan prices communication in time, beside compute and offload. The winner's schedule then gets the larger
branch-and-bound budget `make_plan` gives its winner, and the plan reports that bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Plan, PlanSummary, Step
from hplan.artifacts.replay import replay
from hplan.artifacts.shard import Sharding, factor_choices
from hplan.artifacts.trace import Trace
from hplan.errors import HplanError
from hplan.planner.core import SEARCH_NODES, _improve, host_bytes_needed
from hplan.planner.options import PlanOptions
from hplan.planner.problem import MODULE_CHUNKS, PARAM_CHUNKS, group_params, placement_rule
from hplan.planner.search import Finished, Scored, chunk_targets, finish
from hplan.planner.ranks.defer import defer_writebacks
from hplan.planner.ranks.shard_build import ShardSearch, shard_build
from hplan.planner.ranks.shard_time import step_seconds, with_collectives
from hplan.sizes import format_size

Progress = Callable[[int, int, str], None]


@dataclass(kw_only=True, slots=True)
class Candidate:
    """One factor choice, planned: its search (for the final solve), winner, steps and predicted time."""

    factors: Sharding
    search: ShardSearch
    scored: Scored
    sharding: Sharding
    steps: tuple[Step, ...]
    seconds: dict[str, float]
    collective_bytes: int

    def key(self) -> tuple[float, int, int]:
        return (round(self.seconds["step"], 12), self.collective_bytes, self.scored.moved)


COARSE_CHUNKS_PER_MODEL = (8, 4, 2)
"""Many ranks add chunkings coarser than the one-rank search's: a collective's latency is paid per chunk, so
fewer, larger chunks can win when the model fits (FSDP wraps a whole block per all-gather)."""


def many_rank_targets(trace: Trace, options: PlanOptions) -> list[int]:
    """The one-rank chunk targets plus the coarse ones (bytes of weights per chunk)."""
    total = sum(p.bytes for p in trace.params)
    coarse = {max(2, total // m) for m in COARSE_CHUNKS_PER_MODEL}
    base = chunk_targets(trace, options)
    return base + sorted(coarse - set(base))


def plan_factors(trace: Trace, hardware: Hardware, options: PlanOptions, factors: Sharding, nodes: int,
                 targets: list[int] | None = None) -> Candidate | None:
    """The best schedule for one factor choice, or None when no schedule fits.

    When everything fits resident, chunk size still matters on many ranks: each chunk is a collective call, and
    a call's latency is paid per chunk ([Note: collective latency model]). So each of `targets` (default: the
    given chunk size, else one chunk per module) is tried all-resident and the shortest predicted step kept
    (make_shard_plan tries the other sizes on its best factor choices); otherwise the search runs, ties in bytes
    broken by the many-rank step time (ShardSearch.better)."""
    search = ShardSearch(trace, hardware, options, factors, nodes=nodes)
    if targets is None:
        targets = [options.chunk_bytes if options.chunk_bytes is not None else MODULE_CHUNKS]
    best: Candidate | None = None
    for target in targets:
        scored = search.all_resident(target)
        if scored is not None:
            cand = _candidate(trace, hardware, factors, search, scored, finish(trace, hardware, scored))
            best = cand if best is None or cand.key() < best.key() else best
    if best is not None:
        return best
    scored = search.run()
    if scored is None:
        return None
    return _candidate(trace, hardware, factors, search, scored, finish(trace, hardware, scored))


REFINED_CHOICES = 4
"""Factor choices whose all-resident plans are re-planned at every chunk size: each choice is first planned at
the finest (one chunk per module) and the coarsest size, the best few then at the sizes between — each size
costs a problem build, and latency-bound choices show at the coarse end."""


def _candidate(trace: Trace, hardware: Hardware, factors: Sharding, search: ShardSearch, scored: Scored,
               done: Finished) -> Candidate:
    sharding = search.shardings[scored.chunk_target]
    steps = with_collectives(done.steps, scored, sharding, hardware.ranks)
    later = defer_writebacks(done.steps, steps, scored.structure.regions, done.schedule.initial, hardware.gpu_bytes,
                             hardware.slack_bytes)  # [Note: deferred gradient write-back]
    if later != done.steps:
        steps = with_collectives(later, scored, sharding, hardware.ranks)
    return Candidate(factors=factors, search=search, scored=scored, sharding=sharding, steps=steps,
                     seconds=step_seconds(trace, hardware, scored, done, steps, sharding),
                     collective_bytes=sum(c.sent_bytes for st in steps for c in st.collectives))


def make_shard_plan(trace: Trace, hardware: Hardware, options: PlanOptions | None = None, *,
                    factors: Sharding | None = None, on_progress: Progress | None = None) -> Plan:
    """The plan for `hardware.ranks` ranks; `factors` forces a choice (else every supported one is planned).
    Infeasible budgets give summary.feasible False, never raise."""
    options = options or PlanOptions()
    if not trace.events:
        raise HplanError("the trace has no events: re-run `hplan trace` on a workload with parameters")
    ranks, gpn = hardware.ranks, hardware.gpus_per_node
    if factors is not None:
        factors.check(ranks, gpn)
    choices = [factors] if factors is not None else factor_choices(ranks, gpn)
    effort = 0 if options.solver == "fast" else options.effort
    nodes = SEARCH_NODES[effort] if options.solver != "exact" else SEARCH_NODES[1]
    found: list[Candidate] = []
    sizes = many_rank_targets(trace, options)
    first = None if options.chunk_bytes is not None else [MODULE_CHUNKS, sizes[-1]]
    for i, f in enumerate(choices):
        if on_progress is not None:
            on_progress(i, len(choices) + 1, f"shard factors P={f.P} G={f.G} OS={f.OS}")
        cand = plan_factors(trace, hardware, options, f, nodes, first)
        if cand is not None:
            found.append(cand)
    found.sort(key=Candidate.key)
    best = found[0] if found else None
    if options.chunk_bytes is None:  # the best all-resident choices at every other chunk size
        others = [t for t in sizes if t not in (MODULE_CHUNKS, sizes[-1])]
        for cand in [c for c in found if c.scored.moved == 0][:REFINED_CHOICES]:
            refined = plan_factors(trace, hardware, options, cand.factors, nodes, others)
            if refined is not None and best is not None and refined.key() < best.key():
                best = refined
    opts = {k: v for k, v in asdict(options).items() if k != "compare"}
    opts["shard"] = "given" if factors is not None else "searched"
    if best is None:
        return _infeasible(trace, hardware, choices, opts)
    if on_progress is not None:
        on_progress(len(choices), len(choices) + 1, "exact solve of the winner")
    winner, done, solver, bound, optimal = _improve(best.search, best.scored, options)
    final = _candidate(trace, hardware, best.factors, best.search, winner, done)
    return _plan(trace, hardware, final, done, solver, bound, optimal, opts)


def _plan(trace: Trace, hardware: Hardware, cand: Candidate, done: Finished, solver: str, bound: int,
          optimal: bool, opts: dict) -> Plan:
    s = cand.scored.structure
    smallest = min_gpu_sharded(trace, hardware, cand.factors)
    placeholder = PlanSummary(feasible=True, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0, lower_bound_bytes=0,
                              predicted_peak_bytes=0, min_gpu_bytes=smallest, predicted_step_seconds=0.0,
                              solver=solver, collective_bytes_per_rank=cand.collective_bytes,
                              shard=cand.factors.factors)
    plan = Plan(workload=trace.workload, hardware=hardware, chunks=s.chunks, regions=s.regions, steps=cand.steps,
                optimizer=dict(s.optimizer), fingerprint=trace.fingerprint, summary=placeholder,
                initial_resident=tuple(sorted(done.schedule.initial)), initial_dirty=tuple(sorted(done.initial_dirty)),
                accumulate=trace.accumulate, defer_updates=trace.defer_updates, input_shapes=trace.input_shapes,
                max_grad_norm=trace.max_grad_norm, options={**opts, "chunk_bytes": cand.scored.chunk_target},
                sharding=cand.sharding, placement=placement_rule(trace, cand.scored.groups, flips=False))
    rep = replay(plan)
    if not rep.ok:
        raise AssertionError(f"hplan made an invalid many-rank plan ({rep.violations[0]}): an hplan bug, please "
                             "report it")
    host_need = host_bytes_needed(plan, rep)
    if hardware.host_bytes is not None and host_need > hardware.host_bytes:
        return _infeasible(trace, hardware, [cand.factors], opts,
                           f"needs {format_size(host_need)} of host memory per rank for the model data off the GPU, "
                           f"more than the {format_size(hardware.host_bytes)} given (--cpu-mem)")
    moved = rep.h2d_bytes + rep.d2h_bytes
    if moved != done.moved:
        raise AssertionError(f"replay moves {moved} bytes, the plan steps {done.moved}: an hplan bug, please report it")
    lb = min(bound, moved)
    seconds = dict(cand.seconds)
    summary = replace(placeholder, h2d_bytes=rep.h2d_bytes, d2h_bytes=rep.d2h_bytes, bytes_moved_per_iter=moved,
                      lower_bound_bytes=lb, predicted_peak_bytes=rep.peak_bytes,
                      predicted_step_seconds=seconds.pop("step"), gap=(moved - lb) / max(moved, 1),
                      optimal=optimal, seconds=seconds)
    return replace(plan, summary=summary)


def min_gpu_sharded(trace: Trace, hardware: Hardware, factors: Sharding) -> int:
    """Smallest per-rank budget with any schedule under these factors: one chunk per parameter, every update on
    the host; each step then holds what it touches, its transient copies, its non-model bytes and the slack."""
    _, problem, _ = shard_build(trace, group_params(trace, PARAM_CHUNKS), frozenset(), hardware, factors)
    room = problem.room()
    return max(1, hardware.gpu_bytes - int(room.min())) if len(room) else max(1, hardware.slack_bytes)


def _infeasible(trace: Trace, hardware: Hardware, choices: list[Sharding], opts: dict, why: str = "") -> Plan:
    sizes = sorted((min_gpu_sharded(trace, hardware, f), i) for i, f in enumerate(choices))
    least, i = sizes[0]
    f = choices[i]
    bottleneck = why or (f"no shard factors fit {format_size(hardware.gpu_bytes)} per rank: the least any needs is "
                         f"{format_size(least)} (P={f.P}, G={f.G}, OS={f.OS}, {hardware.ranks} ranks)")
    summary = PlanSummary(feasible=False, h2d_bytes=0, d2h_bytes=0, bytes_moved_per_iter=0, lower_bound_bytes=0,
                          predicted_peak_bytes=0, min_gpu_bytes=least, predicted_step_seconds=0.0, solver="none",
                          bottleneck=bottleneck, shard=f.factors)
    return Plan(workload=trace.workload, hardware=hardware, chunks=(), regions=(), steps=(), optimizer={},
                summary=summary, fingerprint=trace.fingerprint, accumulate=trace.accumulate,
                defer_updates=trace.defer_updates, input_shapes=trace.input_shapes,
                max_grad_norm=trace.max_grad_norm, options=opts)


def parse_shard(text: str) -> Sharding:
    """`P=1,G=8,OS=64` (any order, all three) → factors; one-line errors for anything else."""
    values: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().upper()
        if not sep or key not in ("P", "G", "OS") or not value.strip().isdigit() or key in values:
            raise HplanError(f"invalid --shard {text!r}: use P=k,G=k,OS=k with positive integers, e.g. P=1,G=8,OS=64")
        values[key] = int(value)
    if set(values) != {"P", "G", "OS"} or min(values.values()) < 1:
        raise HplanError(f"invalid --shard {text!r}: give all three factors, each ≥ 1, e.g. P=1,G=8,OS=64")
    return Sharding(P=values["P"], G=values["G"], OS=values["OS"])
