"""move_regions, shared by the single-process and the ranks' executors: evictions (write-back only where the plan
says), then fetches, then allocations, each in the plan's order — the order hplan.artifacts.replay checks."""

from __future__ import annotations

from hplan.artifacts import Step
from hplan.executor.regions import move_regions
from hplan.executor.step_table import step_moves


class Recorder:
    """A store that only records the moves asked of it (the Mover protocol)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool | None]] = []

    def evict(self, rid: int, *, writeback: bool) -> None:
        self.calls.append(("evict", rid, writeback))

    def fetch(self, rid: int) -> None:
        self.calls.append(("fetch", rid, None))

    def alloc(self, rid: int) -> None:
        self.calls.append(("alloc", rid, None))


def test_moves_run_evict_fetch_alloc_in_plan_order() -> None:
    step = Step(index=3, event="forward:h.0", non_model_bytes=0, evict=(7, 2, 5), writeback=(5, 7),
                fetch=(9, 1), alloc=(4, 8))
    store = Recorder()
    move_regions(store, step_moves(step))
    assert store.calls == [("evict", 7, True), ("evict", 2, False), ("evict", 5, True),
                           ("fetch", 9, None), ("fetch", 1, None), ("alloc", 4, None), ("alloc", 8, None)]


def test_a_step_without_moves_asks_nothing() -> None:
    store = Recorder()
    move_regions(store, step_moves(Step(index=0, event="forward:h.0", non_model_bytes=0, reads=(1,))))
    assert store.calls == []
