"""The CUDA caching-allocator model: rounding, pools, segment sizes, reuse and coalescing."""

from __future__ import annotations

import random

from hplan.tracer.allocator import AllocatorModel, round_size

MiB = 1 << 20


def test_rounding():
    assert [round_size(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]


def test_segments_per_pool():
    a = AllocatorModel()
    a.malloc(1, 1)
    assert a.reserved_bytes == 2 * MiB
    a.malloc(2, 5 * MiB)
    a.malloc(3, 5 * MiB)
    assert a.reserved_bytes == 22 * MiB  # two 5 MiB requests share one 20 MiB segment
    a.malloc(4, 31 * MiB)
    assert a.reserved_bytes == 54 * MiB  # large requests: rounded up to 2 MiB
    assert a.allocated_bytes == 512 + 10 * MiB + 32 * MiB  # a 1 MiB tail is too small to split off


def test_freed_blocks_are_reused_and_coalesced():
    a = AllocatorModel()
    for key in (1, 2, 3):
        a.malloc(key, 600 * 1024)
    reserved = a.reserved_bytes
    a.free(1)
    a.free(2)
    a.free(2)  # idempotent
    a.free(99)  # unknown: ignored
    a.malloc(4, 1200 * 1024)  # over 1 MiB: the large pool, so a new 20 MiB segment
    a.malloc(5, 1000 * 1024)  # small: blocks 1 and 2, merged, hold it without a new segment
    assert a.reserved_bytes == reserved + 20 * MiB


def test_reserved_covers_allocated_and_only_grows():
    a, rng, live, last = AllocatorModel(), random.Random(0), [], 0
    for key in range(10_000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            a.malloc(key, rng.choice([rng.randrange(1, 4096), rng.randrange(1, 4 * MiB), rng.randrange(1, 40 * MiB)]))
            live.append(key)
        assert a.reserved_bytes >= a.allocated_bytes and a.max_reserved_bytes >= last
        last = a.max_reserved_bytes
