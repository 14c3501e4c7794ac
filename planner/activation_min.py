"""`--gpu-mem min` under `--activations auto`: the smallest budget over every choice per segment, in each of the
allocator-slack regimes ([Note: auto activations] in hplan.planner.activation_auto; hplan.planner.slack).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import highspy
import numpy as np
from scipy.sparse import coo_matrix

from hplan.artifacts.hardware import Hardware
from hplan.artifacts.trace import Trace
from hplan.planner.activation_items import Items, build_items
from hplan.planner.activations import Decision, decide, min_gpu_with, slack_figure, with_slack
from hplan.planner.problem import PARAM_CHUNKS, MinGpu, Problem, Structure, build, group_params, min_gpu
from hplan.planner.slack import SELECTIVE_MIX, counted, regimes


def minimax(items: Items, need: np.ndarray) -> tuple[int, tuple[int, ...]]:
    """The least max_t need_t + chosen effects over every choice (exact, HiGHS), then the cheapest choice there."""
    n_seg = len(items.first)
    if not n_seg:
        return int(need.max(initial=0)), ()
    if items.n_modes == n_seg:  # one mode per segment (a regime of one choice): nothing to choose
        return int((need + items.effect.sum(axis=0)).max()), items.keep()
    m = items.n_modes
    varies = np.flatnonzero(np.any(items.effect != items.effect[items.first[items.item]], axis=0))
    base = need + items.effect[items.first].sum(axis=0)  # everything kept
    fixed = np.delete(base, varies)
    floor = float(fixed.max()) if len(fixed) else 0.0
    rel = items.effect[:, varies] - items.effect[items.first[items.item]][:, varies]  # vs keep, per segment
    rows, cols, vals = [], [], []
    r, c = np.nonzero(rel.T)
    rows += r.tolist()
    cols += c.tolist()
    vals += rel.T[r, c].astype(float).tolist()
    rows += list(range(len(varies)))
    cols += [m] * len(varies)
    vals += [-1.0] * len(varies)
    one = len(varies)
    rows += (one + items.item).tolist()
    cols += list(range(m))
    vals += [1.0] * m
    a = coo_matrix((vals, (rows, cols)), shape=(one + n_seg, m + 1)).tocsc()
    lo = np.r_[np.full(one, -highspy.kHighsInf), np.ones(n_seg)]
    hi = np.r_[-base[varies].astype(float), np.ones(n_seg)]
    x = _solve(np.r_[np.zeros(m), 1.0], a, lo, hi, np.r_[np.ones(m), np.inf], max(floor, 0.0), m)
    if x is None:
        raise AssertionError("the smallest-budget choice has no solution: an hplan bug")
    chosen = _pick(items, x[:m])
    peak = int((need + items.effect[list(chosen)].sum(axis=0)).max())
    # the cheapest choice with that peak (ties: recompute and offload both reach it)
    x2 = _solve(np.r_[items.cost.astype(float), 0.0], a, lo, hi, np.r_[np.ones(m), float(peak)], 0.0, m)
    if x2 is not None:
        c2 = _pick(items, x2[:m])
        if int((need + items.effect[list(c2)].sum(axis=0)).max()) <= peak:
            chosen = c2
    return peak, chosen


def _pick(items: Items, values: np.ndarray) -> tuple[int, ...]:
    """Per segment the mode HiGHS set (largest value: robust to its tolerance)."""
    best = np.full(len(items.first), -np.inf)
    out = list(items.first)
    for mode, (k, v) in enumerate(zip(items.item, values)):
        if v > best[k]:
            best[k], out[k] = v, mode
    return tuple(int(m) for m in out)


def _solve(cost: np.ndarray, a: Any, lo: np.ndarray, hi: np.ndarray, upper: np.ndarray, b_lower: float, m: int
           ) -> np.ndarray | None:
    """One small MILP (binaries 0..m-1, one continuous column last) by HiGHS on one thread, closed exactly."""
    h = highspy._Highs()  # the public wrapper prints a banner on stdout
    for name, value in (("output_flag", False), ("threads", 1), ("random_seed", 0), ("mip_rel_gap", 0.0)):
        h.setOptionValue(name, value)
    # passModel's array overload ([Note: the model passed as arrays] in hplan.planner.formulation)
    kinds = np.zeros(a.shape[1], dtype=np.int32)
    kinds[:m] = 1  # binaries 0..m-1 (integers within [0, 1]), the last column continuous
    status = h.passModel(a.shape[1], a.shape[0], len(a.data), int(highspy.MatrixFormat.kColwise),
                         int(highspy.ObjSense.kMinimize), 0.0, np.ascontiguousarray(cost, dtype=float),
                         np.r_[np.zeros(m), b_lower], np.ascontiguousarray(upper, dtype=float),
                         np.ascontiguousarray(lo, dtype=float), np.ascontiguousarray(hi, dtype=float),
                         a.indptr[:-1].astype(np.int32), a.indices.astype(np.int32), a.data.astype(float), kinds)
    if status == highspy.HighsStatus.kError:
        raise AssertionError("HiGHS refused the smallest-budget model: an hplan bug")
    h.run()
    if h.getInfo().primal_solution_status != 2:
        return None
    return np.asarray(h.getSolution().col_value)


@dataclass(slots=True)
class Shared:
    """What the regimes of one decision share."""

    built: tuple[Structure, Problem] | None = None
    """The keep problem, whose needs do not depend on the slack."""
    found: dict[tuple, MinGpu] = field(default_factory=dict)
    """Each built choice's true minimum (its slack is its own figure in every regime)."""
    best: int | None = None
    """The smallest budget built so far: a regime's recompute candidates whose relaxed value reaches it are not
    built."""

    def true_min(self, trace: Trace, hardware: Hardware, decisions: tuple[Decision, ...], items: Items) -> MinGpu:
        """`min_gpu_with` of the choices, built once per decision."""
        key = (tuple((d.segment.key, d.choice) for d in decisions), items.shared)
        if key not in self.found:
            self.found[key] = min_gpu_with(trace, hardware, decisions, items.shared, label="auto")
        return self.found[key]


@dataclass(frozen=True, slots=True)
class RegimeMin:
    """A regime's smallest budget (`value`; a lower bound where `exact` is False: every candidate's relaxed value
    reached a smaller budget found in another regime), the choices reaching it (`lean`), and the smallest budget
    with every segment kept (None where keep is not among its choices)."""

    value: int
    lean: tuple[Decision, ...]
    keep: int | None
    exact: bool
    found: MinGpu | None


def min_gpu_auto(trace: Trace, hardware: Hardware, items: Items, shared: Shared | None = None) -> RegimeMin:
    """The smallest budget over the items' choices per segment (module doc). A choice without recompute needs
    exactly the relaxed needs plus its effects; one with recompute is built (weight reads added) only when its
    relaxed value could beat the best so far (in this regime and, through `shared`, in the others)."""
    shared = Shared() if shared is None else shared
    if shared.built is None:
        shared.built = build(trace, group_params(trace, PARAM_CHUNKS), frozenset(), hardware)
    structure, problem = shared.built
    need = np.array([problem.need_bytes(t) - sum(problem.sizes[structure.by_chunk[c]["grad"]]
                                                 for c in structure.flips[t])
                     + problem.non_model[t] + hardware.slack_bytes for t in range(problem.n_steps)], dtype=np.int64)
    _, chosen = minimax(items, need)
    forced = [decide(trace, c) for c in ("keep", "offload", "recompute", "selective")
              if c != "selective" or c in items.allowed]
    candidates = [items.to_decisions(chosen)] + [d for d in forced if _within(d, items.allowed) and items.admits(d)]
    if items.children:  # the blocks' own best too: child modes only add choices ([Note: nested segments])
        blocks = items.blocks_only()
        candidates.insert(1, blocks.to_decisions(minimax(blocks, need)[1]))
    best: tuple[int, tuple[Decision, ...], MinGpu | None] | None = None
    floor: tuple[int, tuple[Decision, ...]] | None = None
    pruned = math.inf
    for decisions in candidates:
        relaxed = int((need + items.effect[list(items.of(decisions))].sum(axis=0)).max()) if decisions else \
            int(need.max())
        if floor is None or relaxed < floor[0]:
            floor = (relaxed, decisions)
        if best is not None and relaxed >= best[0]:
            continue
        value, found = relaxed, None
        if slack_figure(decisions) == "mixed":  # it reserves its own replayed slack, above or below the sample's
            value = relaxed = relaxed + with_slack(hardware, decisions, trace).slack_bytes - hardware.slack_bytes
            if best is not None and relaxed >= best[0]:
                continue
        if any(d.choice in ("recompute", "selective") for d in decisions):  # weight reads added
            if shared.best is not None and relaxed >= shared.best:
                pruned = min(pruned, relaxed)  # its true minimum is at least this, no better than another's
                continue
            found = shared.true_min(trace, hardware, decisions, items)
            value = found.gpu_bytes
        if best is None or value < best[0]:
            best = (value, decisions, found)
    keep = (int(need.max()) if len(need) else 0) if "keep" in items.allowed else None
    if best is None:
        assert floor is not None
        return RegimeMin(value=floor[0], lean=floor[1], keep=keep, exact=False, found=None)
    shared.best = best[0] if shared.best is None else min(shared.best, best[0])
    if pruned < best[0]:  # a lower bound: a candidate left unbuilt might reach below the best built here
        return RegimeMin(value=int(pruned), lean=best[1], keep=keep, exact=False, found=best[2])
    return RegimeMin(value=best[0], lean=best[1], keep=keep, exact=True, found=best[2])


def min_gpu_of(trace: Trace, hardware: Hardware, items: Items, result: RegimeMin, shared: Shared) -> MinGpu:
    """The regime's smallest budget with its bottleneck in words (built only for the one reported)."""
    if result.found is not None:
        return result.found
    if all(d.choice == "keep" for d in result.lean):
        return min_gpu(trace, hardware, shared.built)
    return shared.true_min(trace, hardware, result.lean, items)


def _within(decisions: tuple[Decision, ...], allowed: frozenset[str]) -> bool:
    """Whether forced decisions only make allowed choices (hplan.planner.slack.counted: an offload that moves
    nothing makes none; a refused recompute's offload is allowed beside recompute)."""
    ok = allowed | {None} | ({"fallback"} if allowed & {"offload", "recompute"} else set())
    return all(counted(d.choice, bool(d.segment.offload_bytes), d.segment.recomputable) in ok for d in decisions)


def auto_regimes(trace: Trace, hardware: Hardware, without: frozenset[str] = frozenset()
                 ) -> list[tuple[str, Hardware, Items]]:
    """Each allocator-slack regime (hplan.planner.slack.regimes) with its items, the mixed one first. Without
    offload (host memory short), the recompute regime is left out when a segment that may not be recomputed saves
    bytes: its only mode there is an offload (`build_items`), which host memory cannot take."""
    stuck = "offload" in without and any(not s.recomputable and s.offload_bytes for s in trace.segments)
    out = [(name, _forced_reserve(trace, hardware, hw, name), build_items(trace, hw, allowed))
           for name, hw, allowed in regimes(hardware, without) if not (stuck and allowed == frozenset(("recompute",)))]
    parts = parts_regime(trace, hardware, without)
    return out[:1] + [(PARTS, parts, build_items(trace, parts, ("keep", "offload")))] + out[1:] if parts else out


def _forced_reserve(trace: Trace, hardware: Hardware, hw: Hardware, name: str) -> Hardware:
    """The selective regime's hardware: what the forced selective plan reserves (its own mix's replayed figure
    where larger than the table's: hplan.planner.activations.with_slack), so the regime is that plan's search."""
    if name != "selective":
        return hw
    from hplan.planner.activations import decide, with_slack

    return with_slack(hardware, decide(trace, "selective"), trace)


PARTS = "parts"
"""The regime of keep and offload mixes where the trace has child segments ([Note: nested segments]): a kept
block's children offloaded beside offloaded blocks, under the larger of keep's and offload's figures."""


def parts_regime(trace: Trace, hardware: Hardware, without: frozenset[str] = frozenset()) -> Hardware | None:
    """The hardware of the parts regime (`PARTS`), or None where it cannot win: no child segments, no offload, no
    per-choice table, or a mixed figure no larger. Its figure is a sample (the pure figures) that guides the
    search: each of its mixed plans reserves its own mix's replayed figure (`for_figure` through `with_slack`),
    and is searched again under it where that is larger (`_settle` in hplan.planner.activation_auto); its bound
    covers the plans below it as the mixed regime's does ([Note: a mix's reserve])."""
    table = dict(hardware.activation_slack)
    if not trace.nested or "offload" in without or not table:
        return None
    figure = max(table["keep"], table["offload"])
    if figure >= table["mixed"]:
        return None
    table["mixed"] = figure
    return replace(hardware, slack_bytes=figure,
                   activation_slack=tuple((k, table[k]) for k, _ in hardware.activation_slack))


def min_auto(trace: Trace, hardware: Hardware, without: frozenset[str] = frozenset()
             ) -> tuple[MinGpu, tuple[Decision, ...]]:
    """The smallest budget over every choice per segment and every regime, and the choices that reach it. With
    host memory given (`--cpu-mem`, no disk tier), choices whose offloads could not sit in host memory beside
    all the model data are left for the smallest budget without offload (as auto's plan does)."""
    shared = Shared()
    runs = [(hw, items, min_gpu_auto(trace, hw, items, shared), name in ("mixed", SELECTIVE_MIX, PARTS))
            for name, hw, items in auto_regimes(trace, hardware, without)]  # ties: a single choice's regime
    hw, items, best, _ = min(runs, key=lambda r: (r[2].value, not r[2].exact, r[3]))
    host = hardware.host_bytes
    if host is not None and hardware.nvme_bytes is None and "offload" not in without \
            and trace.model_bytes + _held(best.lean) > host:
        return min_auto(trace, hardware, frozenset(("offload",)))
    return min_gpu_of(trace, hw, items, best, shared), best.lean


def _held(decisions: tuple[Decision, ...]) -> int:
    """The most bytes of offloaded activations in host memory at once (from each forward's end to its backward; a
    stage's part to its own backward)."""
    held: dict[int, int] = {}
    for d in decisions:
        if d.choice == "offload" and d.segment.offload_bytes:
            for t in range(d.segment.forward_events[1], d.segment.backward_events[0] + 1):
                held[t] = held.get(t, 0) + d.segment.offload_bytes
        if d.choice == "stage":  # its part stays in host memory past its block's backward start
            for t in range(d.segment.stage_from + 1, d.segment.backward_events[0] + 1):
                held[t] = held.get(t, 0) + d.segment.stage_bytes
    return max(held.values(), default=0)
