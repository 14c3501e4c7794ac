"""The search over chunkings; per chunking, each chunk's optimizer placement and the schedule, solved together.

What it minimises, in order: bytes moved per iteration (the plan's promise: move the fewest bytes), then the
predicted step time. A finer chunking never needs more bytes in principle, but only module chunks and a few
coarser sizes are searched: coarser chunks mean fewer, larger transfers at equal traffic.

Per chunking (effort >= 1), where each trainable chunk's update runs (GPU or host) is a binary of the exact
model itself ([Note: placement in the model] in `planner.placement`): one branch and bound per chunking under a
node limit, so its bound and gap cover every placement of that chunking. Its fallback is the interval greedy on
two placements (every update on the host; every update on the GPU, when that fits). Chunkings are solved from
the least LP bound up, and one whose bound exceeds the traffic already found is not solved.

Effort 0 (heuristics only) and many-rank plans search placements instead: a number k of GPU-updated chunks
(the first-used trainable ones: their backward runs last, so they are resident at the optimizer step), with
two cheap facts keeping the number of solves small:
- k is at most what fits at the optimizer step and can stay resident elsewhere (see `Search._limits`);
- a CPU-updated chunk moves at least its weights (fetched after the host rewrites them) and its gradients
  (written back before the host reads them) every iteration, so a placement whose CPU chunks alone force more
  than the best traffic found so far is skipped without solving it.
There a candidate is scored by the better of cyclic Belady and the greedy (both in normal form), or by branch
and bound with a small node limit (many ranks). Heuristic scores mislead: over every candidate the search
scored on 6 traces x 5 budgets, Belady was 19% above the candidate's optimum on average (worst 2.73x) and the
greedy 10% (1.63x), while 50 nodes of branch and bound came within 0.04% everywhere at about 2.5x Belady's time.
Predicted time only breaks ties in bytes, so the prefetch pass and the time model run only on tied candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.plan import Step
from hplan.artifacts.trace import ParamInfo, Trace
from hplan.planner.belady import Schedule, solve_fast
from hplan.planner.exact import (
    ExactResult, Multipliers, Rows, lagrangian_bound, lp_bound, lp_multipliers, memory_rows, solve_milp,
)
from hplan.planner.intervals import IntervalModel, build_intervals
from hplan.planner.options import PlanOptions
from hplan.planner.chunking import chunk_targets
from hplan.planner.placement import Joint, build_joint, cpu_split
from hplan.planner.problem import Problem, Structure, build, group_params, make_regions
from hplan.planner.schedule import (drop_dead, event_seconds, hoist_fetches, predict_seconds, to_steps,
                                    with_device_updates)

REFINE_ROUNDS = 6
"""Bisection rounds refining the number of GPU-updated chunks around the best power of two."""
WINDOW_AT_EFFORT: tuple[int, ...] = (0, 0, 0, 4)
"""After bisection, also score every k this close to the best (effort 3 only)."""

Progress = Callable[[int, int, str], None]
"""on_progress(done, total, message)."""


@dataclass(kw_only=True, slots=True)
class Scored:
    """One (chunking, placement): its problem and a schedule in interval normal form with the bytes it moves."""

    chunk_target: int
    groups: list[list[ParamInfo]]
    gpu_chunks: frozenset[int]
    structure: Structure
    problem: Problem
    model: IntervalModel
    keep: np.ndarray
    moved: int
    result: ExactResult | None = None
    """Branch and bound's answer for `keep` (None when scored by heuristics only); with `joint`, the joint
    model's, whose bound covers every placement of the chunking."""
    finished: Finished | None = field(default=None)
    """The plan steps for `keep`, made on demand (ties in bytes, and the winner)."""
    joint: Joint | None = None
    """The chunking's joint placement model, when placement was solved inside it."""
    joint_keep: np.ndarray | None = None
    """`keep` as the joint model's gap columns; the placement is `joint.x_of(gpu_chunks)`."""
    act: tuple[int, ...] = ()
    """With activation items ([Note: auto activations]): each segment call's mode; `moved` then also counts
    their link bytes (`act_cost`)."""
    act_cost: int = 0

    def adopt(self, trace: Trace, hardware: Hardware, result: ExactResult, *, flips: bool) -> None:
        """Take a joint solution (its placement may differ from the current one) as this candidate's schedule."""
        assert self.joint is not None and result.keep is not None and result.x is not None
        placed, keep = self.joint.settle(trace, hardware, result.keep, result.x, flips=flips)
        self.gpu_chunks, self.structure, self.problem, self.model = (placed.gpu_chunks, placed.structure,
                                                                     placed.problem, placed.model)
        self.act, self.act_cost = placed.act, self.joint.act_cost(result.x)
        self.keep, self.finished = keep, None
        self.moved, self.joint_keep = placed.model.cost(keep) + self.act_cost, result.keep


@dataclass(frozen=True, kw_only=True, slots=True)
class Finished:
    """Plan steps of a schedule: prefetched, with derived write-backs, and the predicted step time."""

    schedule: Schedule
    steps: tuple[Step, ...]
    initial_dirty: frozenset[int]
    seconds: dict[str, float]
    moved: int


def host_update_bytes(structure: Structure) -> dict[int, int]:
    """Model-state bytes a host update of each chunk reads and writes: weights, gradients, master, state."""
    sizes = {r.id: r.bytes for r in structure.regions}
    return {c: sum(sizes[r] for r in regs.values()) for c, regs in structure.by_chunk.items()}


def finish(trace: Trace, hardware: Hardware, scored: Scored, keep: np.ndarray | None = None) -> Finished:
    """Plan steps for the candidate's schedule (or for `keep`, another schedule of the same problem)."""
    if keep is None and scored.finished is not None:
        return scored.finished
    problem, structure = scored.problem, scored.structure
    schedule = hoist_fetches(problem, drop_dead(problem, scored.model.schedule(scored.keep if keep is None else keep)))
    steps, initial_dirty = to_steps(trace, structure, problem, schedule)
    sizes = {r.id: r.bytes for r in structure.regions}
    state = host_update_bytes(structure)
    grad_of = {c: regs["grad"] for c, regs in structure.by_chunk.items() if "grad" in regs}
    seconds = predict_seconds(steps, sizes, schedule.initial,
                              with_device_updates(event_seconds(trace, hardware), trace, hardware, steps, state,
                                                  grad_of), hardware, state, grad_of)
    moved = sum(sizes[r] for s in steps for r in (*s.fetch, *s.writeback))
    done = Finished(schedule=schedule, steps=steps, initial_dirty=initial_dirty, seconds=seconds, moved=moved)
    if keep is None:
        scored.finished = done
    return done


class Search:
    """Scores placements for one trace and hardware, remembering the least traffic found (for pruning)."""

    def __init__(self, trace: Trace, hardware: Hardware, options: PlanOptions,
                 on_progress: Progress | None = None, total: int = 1, nodes: int = 0, acts: Any = None,
                 act0: tuple[int, ...] = ()) -> None:
        self.trace, self.hardware, self.options = trace, hardware, options
        self.acts, self.act0 = acts, act0
        """Activation items joined to every chunking's joint model, and the modes `trace` carries
        ([Note: auto activations])."""
        self.targets: list[int] | None = None
        """Chunk targets to search (default: `chunk_targets`)."""
        self.nodes = nodes
        """Branch-and-bound nodes per candidate; 0 scores with the fast heuristics only."""
        self.on_progress, self.total, self.done = on_progress, total, 0
        self.best_moved: float = float("inf")
        """The least traffic found, or an incumbent's from elsewhere (auto's other regimes): chunkings whose LP
        bound exceeds it are not solved."""
        self.staged: dict[int, tuple[IntervalModel, Rows, Multipliers]] = {}
        """Per chunking staged for a joint solve: its model, rows and LP multipliers (auto prices its other
        regimes with them, [Note: auto regimes])."""
        self.ready: dict[int, tuple[int, list[list[ParamInfo]], Joint, Rows, int]] = {}
        """Per chunking staged: what `_stage` returned (a pure function of the chunking)."""
        self.pruned = False
        """Whether a chunking was left unsolved because its LP bound exceeds `best_moved`."""
        self.searched: list[int] = []
        """The chunk targets `run` searched."""
        self.solved: list[Scored] = []
        """Every candidate scored, in scoring order."""
        self.all_host: dict[int, tuple[Structure, Problem]] = {}
        """Chunk target → its problem with every update on the host, as the joint models built it."""

    def tick(self, message: str, steps: int = 1) -> None:
        self.done = min(self.total, self.done + steps)
        if self.on_progress is not None:
            self.on_progress(self.done, self.total, message)

    def score(self, target: int, groups: list[list[ParamInfo]], gpu_chunks: frozenset[int]) -> Scored | None:
        """Build and solve (see the module doc); None when it cannot fit."""
        structure, problem = build(self.trace, groups, gpu_chunks, self.hardware, flips=self.options.flips)
        return self.solve(target, groups, gpu_chunks, structure, problem)

    def solve(self, target: int, groups: list[list[ParamInfo]], gpu_chunks: frozenset[int], structure: Structure,
              problem: Problem) -> Scored | None:
        """Solve one built problem (exact with an LP-bound prune, or the fast heuristics); None when it cannot fit."""
        if np.any(problem.room() < 0):
            return None
        model = build_intervals(problem)
        keep, result = model.greedy(), None
        if self.nodes:
            rows = memory_rows(model)
            bound = lp_bound(model, rows)
            if bound > self.best_moved:  # cannot beat a schedule already found: keep the greedy's score
                result = ExactResult(keep=keep, cost=model.cost(keep), lower_bound=bound, optimal=False,
                                     status="pruned by the LP bound")
            else:
                result = solve_milp(model, keep, max_nodes=self.nodes, rows=rows)
                keep = result.keep if result.keep is not None else keep
        else:
            belady = model.keep_of(solve_fast(problem))
            keep = belady if model.cost(belady) < model.cost(keep) else keep
        scored = Scored(chunk_target=target, groups=groups, gpu_chunks=gpu_chunks, structure=structure,
                        problem=problem, model=model, keep=keep, moved=model.cost(keep), result=result)
        if self.acts is not None:  # activation modes fixed at those `trace` carries
            scored.act, scored.act_cost = self.act0, self.acts.cost_of(self.act0)
            scored.moved += scored.act_cost
        self.best_moved = min(self.best_moved, scored.moved)
        self.solved.append(scored)
        return scored

    def better(self, a: Scored | None, b: Scored | None) -> Scored | None:
        """The better of two candidates: fewer bytes, then a shorter predicted step (then the first)."""
        if a is None or b is None:
            return a or b
        if a.moved != b.moved:
            return a if a.moved < b.moved else b
        ta = round(finish(self._trace_of(a), self.hardware, a).seconds["step"], 12)
        tb = round(finish(self._trace_of(b), self.hardware, b).seconds["step"], 12)
        return b if tb < ta else a

    def _trace_of(self, scored: Scored) -> Trace:
        """The trace a candidate's step time is predicted on: with activation items, its own modes' (their
        recompute seconds)."""
        if self.acts is None or not scored.act or scored.act == self.act0:
            return self.trace
        return self.acts.relaxed(scored.act)

    joint_placement = True
    """Solve placement inside the exact model when branch and bound runs (see the module doc)."""

    def best_placement(self, target: int) -> Scored | None:
        """The best placement and schedule of one chunking."""
        if self.nodes and self.joint_placement:
            return self.best_joint(target)
        return self.best_prefix(target)

    def best_joint(self, target: int) -> Scored | None:
        """Placement and schedule of one chunking by one branch and bound on its joint model."""
        staged = self._stage(target)
        return staged if not isinstance(staged, tuple) else self._solve_joint(*staged)

    def staged_lp(self, target: int) -> tuple[IntervalModel, Rows, Multipliers] | None:
        """A chunking's joint model, its rows and LP multipliers (`staged`), staged without solving; None where
        nothing is placed or no placement fits."""
        return self.staged[target] if isinstance(self._stage(target), tuple) else None

    def _stage(self, target: int) -> Scored | None | tuple[int, list[list[ParamInfo]], Joint, Rows, int]:
        """A chunking's joint model and LP bound, ready to solve; a chunking without trainable chunks is scored
        at once (nothing to place), and one where no placement fits is None. A chunking staged already is
        answered from `ready` (auto stages the selective mix's before its search, [Note: a mix priced by a
        larger mix] in hplan.planner.activation_bounds)."""
        if target in self.ready:
            return self.ready[target]
        groups = group_params(self.trace, target)
        joint = build_joint(self.trace, groups, self.hardware, flips=self.options.flips, acts=self.acts,
                            act0=self.act0)
        if joint is None:
            out = self.score(target, groups, frozenset())
            self.tick(f"chunks of {target or 'one module'} B")
            return out
        host = joint.extremes["cpu"]
        self.all_host[target] = (host.structure, host.problem)
        if np.any(host.problem.room() < 0):
            self.tick(f"chunks of {target or 'one module'} B: no placement fits")
            return None
        rows = memory_rows(joint.model)
        multipliers = lp_multipliers(joint.model, rows)
        bound = lagrangian_bound(joint.model, rows, *multipliers)
        self.staged[target] = (joint.model, rows, multipliers)
        self.tick(f"chunks of {target or 'one module'} B: LP bound over every placement")
        self.ready[target] = (target, groups, joint, rows, bound)
        return self.ready[target]

    def _solve_joint(self, target: int, groups: list[list[ParamInfo]], joint: Joint, rows: Rows, bound: int
                     ) -> Scored | None:
        if bound > self.best_moved:  # no placement of this chunking can beat a schedule already found
            self.pruned = True
            self.tick(f"chunks of {target or 'one module'} B: cannot beat the best found")
            return None
        keep, x = self._fallback(joint)
        result = solve_milp(joint.model, keep, max_nodes=self.nodes, rows=rows, fallback_x=x)
        if result.keep is None:  # the fallback breaks host memory's row and branch and bound found none
            self.tick(f"chunks of {target or 'one module'} B: no schedule found that host memory holds")
            return None
        assert result.x is not None
        cpu = joint.extremes["cpu"]
        scored = Scored(chunk_target=target, groups=groups, gpu_chunks=cpu.gpu_chunks, structure=cpu.structure,
                        problem=cpu.problem, model=cpu.model, keep=np.zeros(0, dtype=bool), moved=0, result=result,
                        joint=joint)
        scored.adopt(self.trace, self.hardware, result, flips=self.options.flips)
        self.best_moved = min(self.best_moved, scored.moved)
        self.solved.append(scored)
        self.tick(f"chunks of {target or 'one module'} B, placement and schedule")
        return scored

    def _fallback(self, joint: Joint) -> tuple[np.ndarray, np.ndarray]:
        """A feasible joint solution, should branch and bound find none better: the interval greedy with every
        update on the host, or on the GPU when that fits, whichever moves less (both problems are built)."""
        options = [joint.to_joint(p, p.model.greedy()) for p in joint.extremes.values()
                   if not np.any(p.problem.room() < 0)]
        return min(options, key=lambda kx: joint.model.cost(*kx))

    def best_prefix(self, target: int) -> Scored | None:
        """Best number k of GPU-updated chunks: none first, then powers of two up to what can stay resident,
        largest first (more GPU updates usually move less), then bisection around the best."""
        groups = group_params(self.trace, target)
        trainable = [c for c, ps in enumerate(groups) if ps[0].trainable]
        scored: dict[int, Scored | None] = {}

        def score(k: int) -> None:
            if k in scored:
                return
            if forced[k] > self.best_moved:  # its CPU updates alone move more than a known schedule
                scored[k] = None
                return
            scored[k] = self.score(target, groups, frozenset(trainable[:k]))
            self.tick(f"chunks of {target or 'one module'} B, {k} updated on the GPU")

        forced = [0] * (len(trainable) + 1)
        score(0)
        if scored[0] is None:
            return None
        k_max, forced = self._limits(groups, trainable, scored[0].problem)
        for k in sorted({k_max} | {2**j for j in range(k_max.bit_length()) if 2**j < k_max}, reverse=True):
            score(k)
        best = self._best(scored)
        for _ in range(REFINE_ROUNDS):
            if best is None:
                break
            ks = sorted(scored)
            i = ks.index(len(best.gpu_chunks))
            for j in (i - 1, i + 1):
                if 0 <= j < len(ks):
                    score((len(best.gpu_chunks) + ks[j]) // 2)
            best = self._best(scored)
        window = WINDOW_AT_EFFORT[self.options.effort]
        if best is not None and window:
            k = len(best.gpu_chunks)
            for j in range(max(0, k - window), min(len(trainable), k + window) + 1):
                score(j)
            best = self._best(scored)
        return best

    def _best(self, scored: dict[int, Scored | None]) -> Scored | None:
        best = None
        for _, cand in sorted(scored.items()):
            best = self.better(best, cand)
        return best

    def _limits(self, groups: list[list[ParamInfo]], trainable: list[int], cpu_only: Problem
                ) -> tuple[int, list[int]]:
        """The most GPU-updated chunks worth trying, and per k the bytes the CPU-updated chunks force.

        A GPU update needs the chunk's weights, gradients, master and state at the optimizer step, and its
        master and state should stay resident throughout: moving them costs 24 B per parameter per iteration
        in mixed precision (16 in fp32), more than a CPU update's 4 (8). So k is capped by both the room at
        the optimizer step and the least room any other step leaves beside what it needs with every update
        on the CPU (`cpu_only`). A CPU-updated chunk moves at least its weights (fetched after the host
        rewrites them) and its gradients (written back before the host reads them), when they are read and
        written in the iteration."""
        master = self.trace.precision != "fp32"
        _, regions = make_regions(groups, master)
        per_chunk: dict[int, dict[str, int]] = {}
        for r in regions:
            per_chunk.setdefault(r.chunk, {})[r.kind] = r.bytes
        return cpu_split(self.trace, self.hardware, cpu_only, trainable, groups, per_chunk)

    def run(self) -> Scored | None:
        """The best candidate over every chunking. With placement in the model, every chunking's LP bound comes
        first and they are solved from the least bound up, so a chunking that cannot beat the best schedule
        found is skipped (a skipped one could not have won; among exact ties the first solved wins)."""
        targets = self.targets if self.targets is not None else chunk_targets(self.trace, self.options)
        self.searched = list(targets)
        if not (self.nodes and self.joint_placement):
            best = None
            for target in targets:
                best = self.better(best, self.best_prefix(target))
            return best
        best, ready = None, []
        for k, target in enumerate(targets):
            staged = self._stage(target)
            if isinstance(staged, tuple):
                ready.append((staged[-1], k, staged))
            else:
                best = self.better(best, staged)
        for _, _, staged in sorted(ready, key=lambda item: item[:2]):
            best = self.better(best, self._solve_joint(*staged))
        return best


def planned_evaluations(trace: Trace, options: PlanOptions, *, joint: bool = False) -> int:
    """An upper estimate of solver runs, for progress totals: an LP and a branch and bound per chunking when
    placement is solved inside the model."""
    return len(chunk_targets(trace, options)) * (2 if joint else 8 + 2 * REFINE_ROUNDS)
