"""Allocator slack at the budget ([Note: slack at the budget]): release on out-of-memory, expandable segments,
the trace fields that carry them and the planner's choice among them."""

from __future__ import annotations

import random

import pytest

from hplan.errors import HplanError
from hplan.artifacts.allocator import FREE, MARK, AllocatorModel, OutOfMemory
from hplan.artifacts.expandable import ExpandableModel
from hplan.artifacts.slack import holds, replay, slack_figures, smallest_slack

MiB = 1 << 20


def test_release_frees_an_empty_cached_segment_before_failing():
    # an 8 MiB request takes a 20 MiB segment (kLargeBuffer); freed, it stays cached; a 30 MiB request then needs
    # its own segment: 50 MiB kept, but a 30 MiB device releases the empty 20 MiB segment and retries
    log = [(1, 8 * MiB), (1, FREE), (2, 30 * MiB)]
    assert slack_figures(log, [30 * MiB]) == {"cached": 20 * MiB, "release": 0, "expandable": 10 * MiB}
    assert holds(log, [30 * MiB]) and not holds(log, [28 * MiB])
    # expandable: the 30 MiB block lands at address 0 and spans two 20 MiB pages
    assert holds(log, [40 * MiB], expandable=True) and not holds(log, [38 * MiB], expandable=True)


def test_a_split_segment_is_not_released_but_expandable_pages_are_shared():
    # a 50 MiB block splits the cached 100 MiB segment, which can then not be given back: 160 MiB either way;
    # with expandable segments the 60 MiB block continues right after the 50 MiB one: pages 0..5, 120 MiB
    log = [(1, 100 * MiB), (1, FREE), (2, 50 * MiB), (3, 60 * MiB)]
    assert slack_figures(log, [110 * MiB]) == {"cached": 50 * MiB, "release": 50 * MiB, "expandable": 10 * MiB}
    with pytest.raises(OutOfMemory):
        replay(log, caps=[158 * MiB])


def test_each_event_window_has_its_own_cap():
    # event 0 needs 100 MiB; event 1 only 50 MiB, but its block pins the 100 MiB segment it was cut from: the model
    # data planned into event 1 cannot use the other 50 MiB, so the slack is 50 MiB (one level: none). Expandable
    # segments unmap the free pages 3 and 4 and keep pages 0..2: 10 MiB.
    log = [(0, MARK), (1, 100 * MiB), (1, FREE), (2, 50 * MiB), (0, MARK), (2, FREE)]
    assert smallest_slack(log, [100 * MiB]) == 0
    assert slack_figures(log, [100 * MiB, 50 * MiB]) == {"cached": 0, "release": 50 * MiB, "expandable": 10 * MiB}
    assert holds(log, [100 * MiB, 100 * MiB]) and not holds(log, [100 * MiB, 98 * MiB])
    # the calls before the first mark belong to event 0
    assert not holds([(1, 100 * MiB), (0, MARK), (0, MARK)], [50 * MiB, 200 * MiB, 200 * MiB])


def test_capped_model_raises_when_the_live_bytes_do_not_fit():
    a = AllocatorModel(cap=40 * MiB)
    a.malloc(1, 30 * MiB)
    with pytest.raises(OutOfMemory):
        a.malloc(2, 30 * MiB)
    e = ExpandableModel(cap=40 * MiB)
    e.malloc(1, 30 * MiB)
    with pytest.raises(OutOfMemory):
        e.malloc(2, 30 * MiB)
    with pytest.raises(OutOfMemory):
        a.limit(20 * MiB)


def test_small_pool_pages_are_2_mib():
    e = ExpandableModel()
    for key in range(5):
        e.malloc(key, 400 << 10)  # 400 KiB: small pool, packed contiguously; 5 × 400 KiB fit one 2 MiB page
    assert e.reserved_bytes == 2 * MiB and e.allocated_bytes == 5 * (400 << 10)
    e.malloc(5, 400 << 10)  # the sixth crosses into a second page
    assert e.reserved_bytes == 4 * MiB
    e.free(5)
    e.release_cached()
    assert e.reserved_bytes == 2 * MiB


def _random_log(seed: int, n: int, sizes: list[tuple[int, int]], reuse: float = 0.0
                ) -> tuple[AllocatorModel, list[int]]:
    """A recorded model driven by `n` random mallocs and frees (a mark every 100; each malloc's size drawn from one
    of `sizes`' ranges; with probability `reuse` it takes a key still live), and the allocated peak per mark."""
    rng = random.Random(seed)
    a, live, levels = AllocatorModel(record=True), [], []
    for key in range(n):
        if key % 100 == 0:
            a.mark()
            levels.append(0)
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randrange(lo, hi) for lo, hi in sizes])
            a.malloc(live[0] if reuse and live and rng.random() < reuse else key, size)
            live.append(key)
        levels[-1] = max(levels[-1], a.allocated_bytes)
    return a, levels


def test_recorded_log_replays_to_the_same_reservation():
    a, levels = _random_log(3, 2000, [(1, MiB), (MiB, 64 * MiB)])
    again = replay(a.log)
    assert again.max_reserved_bytes == a.max_reserved_bytes
    assert again.max_allocated_bytes == a.max_allocated_bytes
    for expandable in (False, True):
        slack = smallest_slack(a.log, levels, expandable=expandable)
        assert 0 < slack <= a.max_reserved_bytes
        assert holds(a.log, [v + slack for v in levels], expandable=expandable)
        assert not holds(a.log, [v + slack - 2 * MiB for v in levels], expandable=expandable)
    assert smallest_slack(a.log, levels) <= a.max_reserved_bytes - max(levels) + 2 * MiB


def test_a_live_key_malloced_again_replays_identically():
    a = AllocatorModel(record=True)
    a.malloc(1, 30 * MiB)
    a.malloc(1, 40 * MiB)  # the tracer's keys come back only after the old storage died
    assert replay(a.log).allocated_bytes == a.allocated_bytes == 40 * MiB


def test_empty_log():
    assert slack_figures([], []) == {"cached": 0, "release": 0, "expandable": 0}


# -- the trace fields and the planner's choice -----------------------------------------------------------------
def _trace(**fields):
    from hplan.artifacts.trace import CATEGORIES, Trace

    return Trace(workload="w", device="fake", precision="fp32", iterations=2, capture="fx", params=(), events=(),
                 fingerprint={}, peak_bytes=10, peak_by_category=dict.fromkeys(CATEGORIES, 0), model_bytes=0,
                 n_ops=0, **fields)


def test_trace_fields_round_trip_and_old_traces_fall_back(tmp_path):
    from hplan.artifacts.trace import Trace
    from hplan.planner import default_slack

    t = _trace(allocator_slack_bytes=50, allocator_slack_release_bytes=20, allocator_slack_expandable_bytes=30,
               overhead_bytes=1)
    t.save(tmp_path / "t.parquet")
    back = Trace.load(tmp_path / "t.parquet", columns=())
    assert (back.allocator_slack_release_bytes, back.allocator_slack_expandable_bytes) == (20, 30)
    assert [default_slack(back, a) for a in ("release", "cached", "expandable")] == [21, 51, 31]
    assert default_slack(back) == 21
    meta = t.metadata()
    for key in ("allocator_slack_release_bytes", "allocator_slack_expandable_bytes"):
        del meta[key]  # a trace from before the at-budget model
    old = Trace.from_metadata(meta)
    assert old.allocator_slack_release_bytes is None and default_slack(old) == 51


@pytest.mark.parametrize("value", [-1, "20", 1.5, True])
def test_bad_slack_values_are_refused(value):
    from hplan.artifacts.trace import Trace

    meta = _trace().metadata() | {"allocator_slack_release_bytes": value}
    with pytest.raises(HplanError, match="allocator_slack_release_bytes.*regenerate"):
        Trace.from_metadata(meta)


def test_unknown_allocator_is_refused():
    from hplan.planner import default_slack

    with pytest.raises(HplanError, match="unknown allocator model 'huge'.*`allocator`"):
        default_slack(_trace(), "huge")


def test_fake_trace_carries_the_figures_and_plan_uses_the_chosen_one(tmp_path):
    from typer.testing import CliRunner

    from hplan.artifacts import Plan
    from hplan.cli import app
    from hplan.planner import reserve_bytes
    from hplan.specs import load_workload
    from hplan.tracer import trace_workload

    t = trace_workload(load_workload("gpt:tiny"), device="fake", iters=2)
    figures = (t.allocator_slack_release_bytes, t.allocator_slack_expandable_bytes)
    assert all(f is not None and f >= 0 and f % (2 * MiB) == 0 for f in figures)  # found on the 2 MiB grid
    t.save(tmp_path / "t.parquet")
    for allocator, slack in (("release", figures[0]), ("expandable", figures[1]), ("cached", t.allocator_slack_bytes)):
        out = tmp_path / f"{allocator}.json"
        res = CliRunner().invoke(app, ["plan", str(tmp_path / "t.parquet"), "--gpu-mem", "1GB", "--allocator",
                                       allocator, "-o", str(out)])
        assert res.exit_code == 0, res.output
        # + the default preset's GEMM workspaces, which a fake trace cannot see ([Note: GEMM workspaces])
        assert Plan.load(out).hardware.slack_bytes == slack + t.overhead_bytes + reserve_bytes("rtx3090")
    res = CliRunner().invoke(app, ["plan", str(tmp_path / "t.parquet"), "--gpu-mem", "1GB", "--allocator", "huge",
                                   "-o", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "--allocator" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x.json").exists()


class _PagePerPage(ExpandableModel):
    """The expandable model counted page by page (no bulk path for a block's interior pages): the reference the
    model's [Note: interior pages] must reproduce exactly."""

    def malloc(self, key: int, nbytes: int) -> None:
        AllocatorModel.malloc(self, key, nbytes)
        block = self._live.get(key)
        if block is None:
            return
        page = 2 * MiB if block.small else 20 * MiB
        first, last = block.addr // page, (block.addr + block.size - 1) // page
        pages, span = self._pages[block.small], range(block.addr // page, last + 1)
        need = page * sum(p not in pages for p in span)
        if self.cap is not None and self._reserved + need > self.cap:
            self.release_cached(keep=(block.small, span))
            if self._reserved + need > self.cap:
                raise OutOfMemory("over")
        for p in span:
            if pages.get(p, 0) == 0:
                self._idle[block.small].discard(p)
            pages[p] = pages.get(p, 0) + 1
        self._spans[key] = (block.small, first, last)
        self._reserved += need
        self._max_reserved = max(self._max_reserved, self._reserved)

    def _free(self, key: int) -> None:
        span = self._spans.pop(key, None)
        AllocatorModel._free(self, key)
        if span is not None:
            for p in range(span[1], span[2] + 1):
                self._pages[span[0]][p] -= 1
                if self._pages[span[0]][p] == 0:
                    self._idle[span[0]].add(p)


@pytest.mark.parametrize("seed", range(3))
def test_expandable_interior_pages_in_bulk_match_page_by_page(seed):
    """The bulk path for a block's interior pages gives the same reservation, peak and out-of-memory point as
    counting every page, under caps that change at each mark and release pages (blocks of 1 to 30 pages, keys
    reused while live)."""
    a, levels = _random_log(seed, 1200, [(1, MiB), (MiB, 64 * MiB), (64 * MiB, 600 * MiB)], reuse=0.05)

    def outcome(model: type[ExpandableModel], caps: list[int]) -> tuple:
        m, marks = model(cap=caps[0]), 0
        for i, (k, nbytes) in enumerate(a.log):
            try:
                if nbytes == FREE:
                    m.free(k)
                elif nbytes == MARK:
                    marks += 1
                    m.limit(caps[min(max(0, marks - 1), len(caps) - 1)])
                else:
                    m.malloc(k, nbytes)
            except OutOfMemory:
                return ("out of memory", i, m.reserved_bytes)
        return ("held", m.reserved_bytes, m.max_reserved_bytes, sorted(m._pages[False].items()))

    results = set()
    for slack in range(0, 700 * MiB, 10 * MiB):
        caps = [level + slack for level in levels]
        expected = outcome(_PagePerPage, caps)
        assert outcome(ExpandableModel, caps) == expected, slack
        results.add(expected[0])
    assert results == {"out of memory", "held"}  # the caps cover both outcomes
