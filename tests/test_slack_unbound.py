"""The slack search's shortcuts change no figure: [Note: an unbound cap] (probes where no cap can act answered
without a replay) and the allocator model's written-out hot path (checked against a plain model of the same
rules, block by block)."""

from __future__ import annotations

import random

import pytest

from hplan.artifacts import slack
from hplan.artifacts.allocator import FREE, MARK, MIN_BLOCK, SMALL_SIZE, AllocatorModel, OutOfMemory, segment_size
from hplan.artifacts.expandable import ExpandableModel

MiB = 1 << 20


def _log(seed: int, n: int = 400) -> tuple[list[tuple[int, int]], list[int]]:
    """Random calls in windows (marks): live bytes pile up, then hold steady with requests of every pool's sizes
    coming and going (the cache fragments), and each window's level: its highest live bytes."""
    rng = random.Random(seed)
    log: list[tuple[int, int]] = []
    live: dict[int, int] = {}
    levels: list[int] = []
    level, key = 0, 0
    for i in range(n):
        if i % 20 == 0:
            if i:
                levels.append(level)
            log.append((0, MARK))
            level = sum(live.values())
        if live and rng.random() < (0.2 if i < n // 4 else 0.5):
            k = rng.choice(sorted(live))
            del live[k]
            log.append((k, FREE))
        else:
            key += 1
            size = rng.choice([rng.randrange(1, 600_000), rng.randrange(1 * MiB, 9 * MiB), rng.randrange(10, 40) * MiB])
            live[key] = -(-size // MIN_BLOCK) * MIN_BLOCK
            log.append((key, size))
        level = max(level, sum(live.values()))
    levels.append(level)
    return log, levels


def _plain_search(log, levels) -> tuple[int, int]:
    """The bisection as it was before the shortcut: (figure, replays)."""
    count = 0

    def fits(s: int) -> bool:
        nonlocal count
        count += 1
        return slack.holds(log, [x + s for x in levels])

    if fits(0):
        return 0, count
    lo, hi = 0, -(-slack.replay(log).max_reserved_bytes // slack.GRAIN) * slack.GRAIN
    while hi - lo > slack.GRAIN:
        mid = lo + (hi - lo) // slack.GRAIN // 2 * slack.GRAIN
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi, count


@pytest.mark.parametrize("expandable", [False, True])
def test_at_the_unbound_figure_no_cap_acts_and_one_byte_less_one_does(expandable, monkeypatch):
    released = {"n": 0}
    base = ExpandableModel if expandable else AllocatorModel

    class Counting(base):  # type: ignore[misc, valid-type]
        def release_cached(self, *args, **kwargs):  # every cap that acts releases first
            released["n"] += 1
            return super().release_cached(*args, **kwargs)

    for seed in range(6):
        log, levels = _log(seed)
        peak, unbound = slack.unbound_slack(log, levels, expandable=expandable)
        free = slack.replay(log, expandable=expandable)
        assert peak == free.max_reserved_bytes and unbound > 0
        monkeypatch.setattr(slack, "ExpandableModel" if expandable else "AllocatorModel", Counting)
        released["n"] = 0
        capped = slack.replay(log, caps=[x + unbound for x in levels], expandable=expandable)
        assert released["n"] == 0  # the uncapped run's moves: it holds
        assert (capped.max_reserved_bytes, capped.reserved_bytes) == (free.max_reserved_bytes, free.reserved_bytes)
        try:
            slack.replay(log, caps=[x + unbound - 1 for x in levels], expandable=expandable)
        except OutOfMemory:
            pass
        assert released["n"] > 0
        monkeypatch.undo()


def test_the_search_finds_the_plain_bisections_figure_with_fewer_replays(monkeypatch):
    fewer = 0
    for seed in range(8):
        log, levels = _log(seed)
        figure, plain = _plain_search(log, levels)
        calls = {"n": 0}
        real = slack.holds

        def counting(*args, **kwargs):
            calls["n"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(slack, "holds", counting)
        assert slack.smallest_slack(log, levels) == figure
        monkeypatch.setattr(slack, "holds", real)
        assert calls["n"] <= plain
        fewer += calls["n"] < plain
    assert fewer >= 4  # the probes far above the figure are answered without a replay


class _Plain:
    """The allocator's rules ([module doc of hplan.artifacts.allocator]) with plain lists: a segment is a list of
    [size, free] blocks in address order."""

    def __init__(self) -> None:
        self.segments: list[tuple[bool, int, list[list]]] = []  # (small, base address, blocks)
        self.live: dict[int, tuple[int, int]] = {}  # key -> (segment, block index) at the time; found again by walk
        self.where: dict[int, list] = {}
        self.reserved = self.allocated = self.peak = self.next = 0

    def malloc(self, key: int, nbytes: int) -> None:
        if key in self.where:
            self.free(key)
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        if size == 0:
            return
        small = size <= SMALL_SIZE
        fits = [(b[0], base + sum(x[0] for x in blocks[:i]), blocks, i) for sm, base, blocks in self.segments
                if sm == small for i, b in enumerate(blocks) if b[1] and b[0] >= size]
        if fits:
            _, _, blocks, i = min(fits, key=lambda f: (f[0], f[1]))
        else:
            seg = segment_size(size)
            blocks, i = [[seg, True]], 0
            self.segments.append((small, self.next, blocks))
            self.next += seg
            self.reserved += seg
        block = blocks[i]
        rest = block[0] - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            block[0] = size
            blocks.insert(i + 1, [rest, True])
        block[1] = False
        block.append(size)
        self.where[key] = block
        self.allocated += size
        self.peak = max(self.peak, self.reserved)

    def free(self, key: int) -> None:
        block = self.where.pop(key, None)
        if block is None:
            return
        self.allocated -= block.pop()
        block[1] = True
        for _, _, blocks in self.segments:
            for i in range(len(blocks) - 1, 0, -1):  # merge free neighbours
                if blocks[i][1] and blocks[i - 1][1]:
                    blocks[i - 1][0] += blocks.pop(i)[0]


@pytest.mark.parametrize("seed", range(4))
def test_the_hot_path_keeps_the_allocators_rules(seed):
    log, _ = _log(seed, n=600)
    model, plain = AllocatorModel(), _Plain()
    for key, nbytes in log:
        if nbytes == MARK:
            continue
        for m in (model, plain):
            m.free(key) if nbytes == FREE else m.malloc(key, nbytes)
        assert (model.reserved_bytes, model.allocated_bytes) == (plain.reserved, plain.allocated)
        layout = sorted((e[1], e[0]) for e in model._small + model._large)
        want = sorted((base + sum(x[0] for x in blocks[:i]), b[0]) for _, base, blocks in plain.segments
                      for i, b in enumerate(blocks) if b[1])
        assert layout == want  # the same free blocks at the same addresses
