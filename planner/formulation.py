"""The interval model ([Note: interval normal form]) as an LP / MILP for HiGHS: rows, columns, and where they are.

    minimise  constant + sum_i size_i (1 - y_i) + sum_s size_s z_s
    s.t.      sum_{i inside t} size_i y_i <= free_t      memory left at step t by what t needs
              z_s + y_i >= 1                              a live drop in span s writes s back once
              y binary (keep gap i), z in [0, 1]          (z is integral once y is)

With choices ([Note: choices in the interval model]) a binary x_m per mode (sum over an item's modes = 1) and a
switch g join: a mode's gap costs size_i (x_m - y_i) with y_i <= x_m, its write-back rows read
z_s + y_i >= x_m, its forced bytes cost cost_m x_m, and a step where modes hold more memory gets its own row
load_t + sum_m extra_mt x_m + switch_bytes g <= free_t, with g >= x_m for the modes that turn the switch on.
Alone these let the LP turn every mode a little on and pay a little of the switch (gpt:1.3b fp16 at 12 GB:
an LP bound 15% under the optimum, the switch being 5.46 GB of update temporaries), so the switch's step also
gets the *switch cut* sum_m extra_mt x_m <= (free_t - switch_bytes) g over the modes that turn the switch on:
valid, since those modes are off when the switch is, and the kept gaps and other modes only take room; it makes
the LP pay the switch in full per unit of mode.

Rows: steps between two consecutive gap boundaries see the same gaps, so one row per such segment (its smallest
free memory) suffices, and segments whose gaps all fit anyway are left out; HiGHS gets them chained through load
columns (see `_highs`), which keeps the matrix sparse.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import highspy
import numpy as np
from scipy.sparse import csc_matrix

from hplan.planner.intervals import IntervalModel, Stay

INF = highspy.kHighsInf


@dataclass(frozen=True, kw_only=True, slots=True)
class Rows:
    """The binding memory rows, in step order, and the cyclic range of them inside each gap."""

    free: np.ndarray
    """Free bytes of each binding row (the least over its segment's steps)."""
    first: np.ndarray
    """Per gap: the first binding row inside it."""
    count: np.ndarray
    """Per gap: how many consecutive binding rows (cyclically, from `first`) lie inside it."""
    extra_row: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Choices: the binding row of each memory entry kept (`extra_entry` indexes `Choices.extra_*`)."""
    extra_entry: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    switch_row: int = -1
    """Choices: the binding row of the switch's step (-1: none, or it never binds)."""
    _special: list[np.ndarray] = field(default_factory=list, compare=False, repr=False)
    """Cache of `special()` (rows are immutable; the LP, branch and bound and every bound read it)."""
    _extra_at: list[np.ndarray] = field(default_factory=list, compare=False, repr=False)
    """Cache of `extra_at()`; both caches read `extra_row` and `switch_row` only (rows given more free bytes share)."""

    def inside(self, i: int) -> np.ndarray:
        return (self.first[i] + np.arange(self.count[i])) % max(len(self.free), 1)

    def special(self) -> np.ndarray:
        """Binding rows where modes add memory, sorted: each gets its own row beside the chain."""
        if not self._special:
            rows = [self.extra_row] + ([np.array([self.switch_row])] if self.switch_row >= 0 else [])
            special = np.unique(np.concatenate(rows)).astype(np.int64)
            special.setflags(write=False)
            self._special.append(special)
        return self._special[0]

    def extra_at(self) -> np.ndarray:
        """Per memory entry kept, its row's position in `special()`: with activation items a search of ~30,000
        entries (~1 ms) that every bound priced from the rows and the LP's build need, so made once."""
        if not self._extra_at:
            at = np.searchsorted(self.special(), self.extra_row)  # `special()` is sorted and holds every extra row
            at.setflags(write=False)
            self._extra_at.append(at)
        return self._extra_at[0]


def memory_rows(model: IntervalModel) -> Rows:
    """One row per segment of steps with the same gaps inside it (cut at every gap's first and after its last
    inside step, and around every step where modes add memory), binding segments only. A gap's inside is a
    cyclic range of steps, hence of segments."""
    n, g = model.problem.n_steps, model.n_gaps
    c = model.choices
    special = np.zeros(0, dtype=np.int64)
    if c is not None:
        special = np.unique(np.concatenate([c.extra_step, [c.switch_step] if len(c.switch_modes) else []]))
        special = special.astype(np.int64)
    cuts = np.unique(np.concatenate([(model.start + 1) % n, model.end % n, [0], special, (special + 1) % n]))
    seg_of = np.searchsorted(cuts, np.arange(n), side="right") - 1
    n_seg = len(cuts)
    seg_free = np.full(n_seg, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(seg_free, seg_of, model.free)
    lo = seg_of[(model.start + 1) % n]
    span = (seg_of[(model.end - 1) % n] - lo) % n_seg + 1
    delta = np.zeros(2 * n_seg + 1, dtype=np.int64)
    np.add.at(delta, lo, model.size)
    np.add.at(delta, lo + span, -model.size)
    run = np.cumsum(delta)[: 2 * n_seg]
    demand = run[:n_seg] + run[n_seg:]
    if c is not None and len(c.extra_step):  # the most the modes can add at each step
        keys, inverse = np.unique(c.item[c.extra_mode] * n + c.extra_step, return_inverse=True)
        most = np.zeros(len(keys), dtype=np.int64)
        np.maximum.at(most, inverse, c.extra_bytes)
        np.add.at(demand, seg_of[keys % n], most)
    if c is not None and len(c.switch_modes) and c.switch_bytes > 0:
        demand[seg_of[c.switch_step]] += c.switch_bytes
    binding = np.flatnonzero(demand > seg_free)
    m = len(binding)
    # Binding rows inside gap i: those in segments lo .. lo+span-1 (cyclic), a cyclic range of binding rows.
    first = np.searchsorted(binding, lo) % max(m, 1)
    before_end = np.searchsorted(binding, lo + span) + np.where(lo + span > n_seg,
                                                                np.searchsorted(binding, lo + span - n_seg), 0)
    count = np.minimum(before_end - np.searchsorted(binding, lo), m) if m else np.zeros(g, dtype=np.int64)
    row_of_seg = np.full(n_seg, -1, dtype=np.int64)
    row_of_seg[binding] = np.arange(m)
    extra_row, extra_entry, switch_row = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), -1
    if c is not None:
        rows = row_of_seg[seg_of[c.extra_step]]
        extra_entry = np.flatnonzero(rows >= 0)
        extra_row = rows[extra_entry]
        if len(c.switch_modes) and c.switch_bytes:
            switch_row = int(row_of_seg[seg_of[c.switch_step]])
    return Rows(free=seg_free[binding], first=first.astype(np.int64), count=count.astype(np.int64),
                extra_row=extra_row, extra_entry=extra_entry, switch_row=switch_row)


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Where things are in the HiGHS model `_highs` builds: columns gaps, spans, loads, modes, switch; rows
    chain (one per binding row), write-back, special memory, items, mode links, switch links."""

    unit: float
    """The objective's unit: bytes of the largest region (HiGHS sees bytes / unit)."""
    first: int
    """The binding row that became load row 0."""
    covers: tuple[np.ndarray, np.ndarray, np.ndarray]
    special: np.ndarray
    cover_row: int
    special_row: int
    switch_link_row: int
    n_switch: int
    """Switch link rows (0: no switch column)."""
    persp_row: int
    """The switch cut's row (-1: none)."""
    mode_col: int
    switch_col: int
    key: bytes = b""
    """A digest of everything HiGHS was given (`solve` answers an identical model from its memo)."""


def _highs(model: IntervalModel, rows: Rows, *, integral: bool, stay: bool = False) -> tuple[highspy._Highs, Layout]:
    """A HiGHS instance holding the model, and where its parts are.

    Memory rows are chained, not written out: a load column L_j per binding segment j (0 <= L_j <= free_j),
    one row L_0 = sum of the kept gaps inside segment 0, and for j > 0 one row L_j = L_{j-1} + gaps entering
    at j - gaps leaving at j. A gap then has about 2 coefficients instead of one per segment it spans (gaps
    span most of the iteration, so the plain rows are ~70% dense on gpt:18b). Segments are relabelled so that
    segment 0 is the one inside the fewest gaps. A segment where modes add memory also gets the row
    L_j + sum_m extra x_m + switch_bytes g <= free_j."""
    g, s, m = model.n_gaps, model.n_spans, len(rows.free)
    c = model.choices
    k = c.n_modes if c is not None else 0
    has_switch = c is not None and len(c.switch_modes) > 0 and c.switch_bytes != 0
    unit = float(max(int(model.size.max(initial=0)), int(model.span_size.max(initial=0)), 1))
    size = model.size / unit
    first = int(np.argmin(load_counts(rows))) if m else 0
    covers = model.covers()
    special = rows.special()
    mode_col, switch_col = g + s + m, g + s + m + k
    stay = model.stay if stay else None  # host memory's row: a constraint on solutions (see `_stay_rows`)
    stay_col = switch_col + int(has_switch)
    n_col = stay_col + (len(stay.bytes) if stay is not None else 0)
    cover_row = m
    special_row = cover_row + len(covers[0])
    item_row = special_row + len(special)
    mode_gaps = np.flatnonzero(c.gap_mode >= 0) if c is not None else np.zeros(0, dtype=np.int64)
    link_row = item_row + (c.n_items if c is not None else 0)
    switch_link_row = link_row + len(mode_gaps)
    n_switch = len(c.switch_modes) if has_switch and c is not None else 0
    persp_row = switch_link_row + n_switch
    persp = has_switch and c is not None and c.switch_bytes > 0 and rows.switch_row >= 0
    stay_row = persp_row + int(persp) + int(has_switch and c is not None and c.switch_bytes < 0)
    n_row = stay_row + (_stay_rows(stay) if stay is not None else 0)
    r_idx: list[np.ndarray] = []
    c_idx: list[np.ndarray] = []
    vals: list[np.ndarray] = []

    def put(row: object, col: object, value: object) -> None:
        rr, cc, vv = np.broadcast_arrays(np.asarray(row), np.asarray(col), np.asarray(value, dtype=float))
        r_idx.append(rr.ravel())
        c_idx.append(cc.ravel())
        vals.append(vv.ravel())

    gi = np.flatnonzero(rows.count)  # every gap inside a binding row, all at once
    if len(gi):
        cnt = rows.count[gi]
        entry, leave = (rows.first[gi] - first) % m, (rows.first[gi] + cnt - first) % m
        anchor = (cnt == m) | (entry == 0) | (entry + cnt > m)
        put(np.zeros(int(anchor.sum()), dtype=np.int64), gi[anchor], -size[gi[anchor]])  # inside row 0: the anchor
        part = cnt < m
        enter, out = part & (entry != 0), part & (leave != 0)
        put(entry[enter], gi[enter], -size[gi[enter]])
        put(leave[out], gi[out], size[gi[out]])
    put(np.arange(m), g + s + np.arange(m), 1.0)
    put(np.arange(1, m), g + s + np.arange(m - 1), -1.0)
    gap, span, mode = covers
    ncov = np.arange(len(gap))
    put(cover_row + ncov, gap, 1.0)
    put(cover_row + ncov, g + span, 1.0)
    conditional = np.flatnonzero(mode >= 0)
    put(cover_row + conditional, mode_col + mode[conditional], -1.0)
    put(special_row + np.arange(len(special)), g + s + (special - first) % max(m, 1), 1.0)
    if c is not None:
        e = rows.extra_entry
        put(special_row + rows.extra_at(), mode_col + c.extra_mode[e], c.extra_bytes[e] / unit)
        put(item_row + c.item, mode_col + np.arange(k), 1.0)
        put(link_row + np.arange(len(mode_gaps)), mode_gaps, 1.0)
        put(link_row + np.arange(len(mode_gaps)), mode_col + c.gap_mode[mode_gaps], -1.0)
        if has_switch:
            if rows.switch_row >= 0:
                put(special_row + int(np.searchsorted(special, rows.switch_row)), switch_col, c.switch_bytes / unit)
            put(switch_link_row + np.arange(n_switch), switch_col, 1.0)
            put(switch_link_row + np.arange(n_switch), mode_col + c.switch_modes, -1.0)
            if persp:  # see `switch_cut`
                at = switch_extras(model, rows)
                put(persp_row, mode_col + c.extra_mode[at], c.extra_bytes[at] / unit)
                put(persp_row, switch_col, -switch_room(model, rows) / unit)
            if c.switch_bytes < 0:  # then the switch must also be off when no mode turns it on
                put(persp_row + int(persp), switch_col, 1.0)
                put(persp_row + int(persp), mode_col + c.switch_modes, -1.0)
    if stay is not None:  # a_j <= y_i per link, a_j <= x_m per pair with a mode, sum_j bytes_j a_j >= need
        links, moded = len(stay.link_pair), np.flatnonzero(stay.mode >= 0)
        put(stay_row + np.arange(links), stay_col + stay.link_pair, 1.0)
        put(stay_row + np.arange(links), stay.link_gap, -1.0)
        put(stay_row + links + np.arange(len(moded)), stay_col + moded, 1.0)
        put(stay_row + links + np.arange(len(moded)), mode_col + stay.mode[moded], -1.0)
        put(n_row - 1, stay_col + np.arange(len(stay.bytes)), stay.bytes / unit)
    cat = (lambda xs, dtype: np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype=dtype))
    matrix = csc_matrix((cat(vals, float), (cat(r_idx, np.int64), cat(c_idx, np.int64))), shape=(n_row, n_col))
    matrix.sum_duplicates()
    matrix.sort_indices()
    free = np.roll(rows.free, -first) / unit
    lower = np.zeros(n_row)
    upper = np.zeros(n_row)
    lower[cover_row:special_row] = np.where(mode < 0, 1.0, 0.0)
    upper[cover_row:special_row] = INF
    lower[special_row:item_row] = -INF
    upper[special_row:item_row] = rows.free[special] / unit
    lower[item_row:link_row] = upper[item_row:link_row] = 1.0
    lower[link_row:switch_link_row] = -INF
    upper[switch_link_row:switch_link_row + n_switch] = INF
    lower[persp_row:] = -INF
    if stay is not None:
        lower[n_row - 1], upper[n_row - 1] = stay.need / unit, INF
    cost = np.zeros(n_col)
    cost[:g] = -size
    cost[g:g + s] = model.span_size / unit
    if c is not None:
        mode_cost = c.cost.astype(float)
        np.add.at(mode_cost, c.gap_mode[mode_gaps], model.size[mode_gaps].astype(float))
        cost[mode_col:mode_col + k] = mode_cost / unit
    col_upper = np.ones(n_col)
    col_upper[g + s:g + s + m] = free
    kinds = np.zeros(n_col, dtype=np.int32)  # HighsVarType: 0 continuous, 1 integer
    if integral:
        kinds[:g] = 1
        kinds[mode_col:stay_col] = 1
    start, index, value = (np.ascontiguousarray(a) for a in (matrix.indptr.astype(np.int32),
                                                              matrix.indices.astype(np.int32),
                                                              matrix.data.astype(float)))
    digest = hashlib.blake2b(np.array([n_col, n_row, int(integral)], dtype=np.int64).tobytes(), digest_size=20)
    for part in (cost, col_upper, lower, upper, start, index, value, kinds.astype(np.int8)):
        digest.update(np.ascontiguousarray(part).tobytes())
    h = highspy._Highs()  # the public wrapper prints a banner on stdout (breaks --json); same solver underneath
    for name, value_ in (("output_flag", False), ("threads", 1), ("random_seed", 0), ("time_limit", INF)):
        h.setOptionValue(name, value_)
    _pass(h, n_col, n_row, cost, col_upper, lower, upper, start, index, value, kinds)
    return h, Layout(unit=unit, first=first, covers=covers, special=special, cover_row=cover_row,
                     special_row=special_row, switch_link_row=switch_link_row, n_switch=n_switch,
                     persp_row=persp_row if persp else -1, mode_col=mode_col,
                     switch_col=switch_col, key=digest.digest())


def _pass(h: highspy._Highs, n_col: int, n_row: int, cost: np.ndarray, col_upper: np.ndarray, lower: np.ndarray,
          upper: np.ndarray, start: np.ndarray, index: np.ndarray, value: np.ndarray, kinds: np.ndarray) -> None:
    """Give HiGHS the model (columns from 0 to `col_upper`, minimised, no offset: the constant part is added back
    by the caller, see `constant_of`) through its array overload of passModel.

    [Note: the model passed as arrays] A `HighsLp` takes its vectors as Python lists, which pybind11 copies one
    number at a time (12 ms for the children's bound's 125,780 nonzeros, about 50 ms per gpt:18b plan); the
    array overload copies the buffers. HiGHS builds the same `HighsLp` from them (`Highs::passModel` with
    pointers), but for the integrality vector: an LP gets one of continuous columns instead of none, still an LP
    (`HighsLp::isMip`). Checked byte for byte: gpt:18b's 17 solves at 24 GB (primal and duals of every LP, every
    branch and bound's answer and bound) and tests/test_planner_exact.py's small LP and MILP, either way."""
    status = h.passModel(n_col, n_row, len(value), int(highspy.MatrixFormat.kColwise),
                         int(highspy.ObjSense.kMinimize), 0.0, np.ascontiguousarray(cost, dtype=float),
                         np.zeros(n_col), np.ascontiguousarray(col_upper, dtype=float),
                         np.ascontiguousarray(lower, dtype=float), np.ascontiguousarray(upper, dtype=float),
                         start[:-1], index, value, kinds)
    if status == highspy.HighsStatus.kError:
        raise AssertionError("HiGHS refused the planner's model: an hplan bug")


@dataclass(frozen=True, kw_only=True, slots=True)
class Solved:
    """What the planner reads of a HiGHS run."""

    status: str
    primal_solution_status: int
    mip_dual_bound: float
    mip_node_count: int
    col_value: np.ndarray
    col_dual: np.ndarray
    row_dual: np.ndarray


_MEMOS: list[dict[bytes, Solved]] = []


@contextmanager
def solves_remembered() -> Iterator[None]:
    """Within it, `solve` answers a model it has solved already from memory.

    [Note: remembered solves] One `make_plan` gives HiGHS the same model more than once: auto's search runs again
    with child segments after the blocks' search and plans the forced regimes (keep first) anew, and the children's
    bound stages the LPs the second search stages again (gpt:1.3b fp16-mixed at 8 GB: 3.6 of 6.6 s of solver time
    on repeats). HiGHS is deterministic for one input and options (one thread, a fixed seed, no time limit), and
    each run starts from a fresh instance, so a repeat's answer is the first's: the memo, keyed by a digest of
    every array and option HiGHS gets, changes no plan. It lives as long as the plan being made."""
    _MEMOS.append({})
    try:
        yield
    finally:
        _MEMOS.pop()


def solve(h: highspy._Highs, lay: Layout, options: tuple[tuple[str, float | int], ...] = ()) -> Solved:
    """Set `options`, run HiGHS and read its answer, or the answer to the same model and options from the memo
    (inside `solves_remembered`)."""
    memo = _MEMOS[-1] if _MEMOS and lay.key else None
    key = lay.key + repr(options).encode()
    if memo is not None and key in memo:
        return memo[key]
    for name, value in options:
        h.setOptionValue(name, value)
    h.run()
    info, sol = h.getInfo(), h.getSolution()
    solved = Solved(status=h.modelStatusToString(h.getModelStatus()),
                    primal_solution_status=int(info.primal_solution_status),
                    mip_dual_bound=float(info.mip_dual_bound), mip_node_count=int(info.mip_node_count),
                    col_value=np.asarray(sol.col_value, dtype=float), col_dual=np.asarray(sol.col_dual, dtype=float),
                    row_dual=np.asarray(sol.row_dual, dtype=float))
    for a in (solved.col_value, solved.col_dual, solved.row_dual):
        a.setflags(write=False)
    if memo is not None:
        memo[key] = solved
    return solved


def _stay_rows(stay: Stay) -> int:
    """Rows of host memory's constraint ([Note: host memory in the model]): one per link, one per pair with a mode
    and the bytes row. Only the branch and bound that finds schedules gets them (`planner.exact.solve_milp`); the
    bounds (the LP's multipliers, `lagrangian_bound`, the dual bound reported) are the model's without them."""
    return len(stay.link_pair) + int(np.count_nonzero(stay.mode >= 0)) + 1


def switch_extras(model: IntervalModel, rows: Rows) -> np.ndarray:
    """The memory entries the switch cut holds: those of switch modes at the switch's step (a mode that does not
    turn the switch on may hold bytes there with the switch off, so it stays out of the cut)."""
    assert model.choices is not None
    c = model.choices
    at = rows.extra_entry[rows.extra_row == rows.switch_row]
    return at[np.isin(c.extra_mode[at], c.switch_modes)]


def switch_room(model: IntervalModel, rows: Rows) -> float:
    """Bytes the modes' extras may take at the switch's step while the switch is on: its free bytes less the
    switch's own (the kept gaps there take some too; they only make it smaller)."""
    assert model.choices is not None and rows.switch_row >= 0
    return float(rows.free[rows.switch_row] - model.choices.switch_bytes)


def load_counts(rows: Rows) -> np.ndarray:
    """How many gaps each binding row lies inside."""
    m = len(rows.free)
    delta = np.zeros(2 * m + 1, dtype=np.int64)
    np.add.at(delta, rows.first, 1)
    np.add.at(delta, rows.first + rows.count, -1)
    run = np.cumsum(delta)[: 2 * m]
    return run[:m] + run[m:]


def constant_of(model: IntervalModel) -> float:
    """Bytes of the objective that no decision changes: forced traffic plus the fetch of every gap that exists
    whatever is chosen (a kept gap subtracts its own; a mode's gaps are part of its cost)."""
    sizes = model.size if model.choices is None else model.size[model.choices.gap_mode < 0]
    return float(model.constant) + float(sizes.sum())
