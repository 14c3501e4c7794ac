"""The collectives a rank has started and not yet waited for ([Note: collectives in flight] in hplan.artifacts.shard).

Weight gathers issued ahead are kept per chunk until the step that reads them; gradient reductions per region
until something reads, moves or reopens it, and at the latest until the event after their last step begins: the
step after their own where the plan reserves their buffers, later where its windows have room ([Note: collectives
ahead within the plan's room] in hplan.artifacts.lookahead). Every rank starts and waits for the same calls
at the same plan steps: which calls go ahead, and how long they run, is decided from the plan alone.
"""

from __future__ import annotations

from hplan.executor.ranks.collectives import Pending


class InFlight:
    """Started calls by what they hold; counts of this iteration's overlapped calls (hplan's Iteration)."""

    def __init__(self) -> None:
        self.gathers: dict[int, Pending] = {}
        """Chunk → its weight gather issued ahead."""
        self.reductions: dict[int, tuple[int, Pending]] = {}
        """Gradient region → (the last plan step it may run beside, its latest reduction)."""
        self.ahead = 0
        self.reducing = 0

    def gather_ahead(self, chunk: int, pending: Pending) -> None:
        self.gathers[chunk] = pending
        self.ahead += 1

    def take_gather(self, chunk: int) -> bool:
        """Wait for the chunk's gather if it was issued ahead; False when it was not."""
        pending = self.gathers.pop(chunk, None)
        if pending is None:
            return False
        pending.wait()
        return True

    def reduction(self, rid: int, until: int, pending: Pending) -> None:
        """A reduction on region `rid` that may run beside plan steps up to `until` (kept only while it runs)."""
        if not pending.done:
            self.reductions[rid] = (until, pending)
            self.reducing += 1

    def latest(self, rid: int) -> Pending | None:
        held = self.reductions.get(rid)
        return held[1] if held is not None else None

    def settle(self, rid: int | None) -> None:
        """Wait for the reduction in flight on this region, if any."""
        held = self.reductions.pop(rid, None) if rid is not None else None
        if held is not None:
            held[1].wait()

    def settle_older(self, cursor: int) -> None:
        """Wait for every reduction whose last step ends before `cursor`'s event."""
        for rid in [r for r, (until, _) in self.reductions.items() if until < cursor]:
            self.settle(rid)

    def settle_all(self) -> None:
        for rid in list(self.reductions):
            self.settle(rid)
        for chunk in list(self.gathers):
            self.gathers.pop(chunk).wait()

    def counts(self) -> tuple[int, int]:
        """(gathers issued ahead, reductions left in flight) since the last call; resets them."""
        out = (self.ahead, self.reducing)
        self.ahead = self.reducing = 0
        return out
