"""The CUDA caching-allocator model: rounding, pools, segment sizes, best fit, reuse and coalescing."""

from __future__ import annotations

import random

import pytest
from hplan.artifacts.allocator import AllocatorModel, round_size

KiB, MiB = 1 << 10, 1 << 20


def test_rounding():
    assert [round_size(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    with pytest.raises(ValueError):
        round_size(-1)


def test_empty_request_takes_nothing():
    a = AllocatorModel()
    a.malloc(1, 0)
    assert (a.allocated_bytes, a.reserved_bytes) == (0, 0)
    a.free(1)
    assert a.allocated_bytes == 0


def test_one_byte_reserves_a_small_segment():
    a = AllocatorModel()
    a.malloc(1, 1)
    assert (a.allocated_bytes, a.reserved_bytes) == (512, 2 * MiB)
    a.malloc(2, 1 * MiB)  # still small (<= 1 MiB): shares the 2 MiB segment
    assert a.reserved_bytes == 2 * MiB


def test_medium_requests_share_a_20_mib_segment():
    a = AllocatorModel()
    a.malloc(1, 5 * MiB)
    assert a.reserved_bytes == 20 * MiB
    a.malloc(2, 5 * MiB)
    assert a.reserved_bytes == 20 * MiB
    assert a.allocated_bytes == 10 * MiB


def test_big_requests_round_to_2_mib():
    a = AllocatorModel()
    a.malloc(1, 30 * MiB)
    assert a.reserved_bytes == 30 * MiB
    a.malloc(2, 31 * MiB)
    assert a.reserved_bytes == 30 * MiB + 32 * MiB
    assert a.allocated_bytes == 61 * MiB


def test_pools_do_not_share_segments():
    a = AllocatorModel()
    a.malloc(1, 5 * MiB)  # large pool: 15 MiB left free in its segment
    a.malloc(2, 100 * KiB)  # small request: needs its own 2 MiB segment
    assert a.reserved_bytes == 22 * MiB


def test_free_then_realloc_reuses():
    a = AllocatorModel()
    for nbytes in (1000, 5 * MiB, 30 * MiB):
        a.malloc(1, nbytes)
        reserved = a.reserved_bytes
        a.free(1)
        assert a.allocated_bytes == 0 and a.reserved_bytes == reserved  # cached, not released
        a.malloc(1, nbytes)
        assert a.reserved_bytes == reserved
        a.free(1)


def test_coalescing_neighbours():
    a = AllocatorModel()
    for key in (1, 2, 3):
        a.malloc(key, 600 * KiB)  # one 2 MiB segment: [1 | 2 | 3 | 248 KiB free]
    assert a.reserved_bytes == 2 * MiB
    a.free(1)
    a.free(2)
    a.malloc(4, 1 * MiB)  # only 1 and 2 merged (1200 KiB) hold it: no new segment
    assert a.reserved_bytes == 2 * MiB
    a.free(3)
    a.free(4)
    a.malloc(5, 1 * MiB)
    a.malloc(6, 1 * MiB)  # the whole segment merged back into one 2 MiB block
    assert a.reserved_bytes == 2 * MiB


def test_best_fit_takes_the_smallest_block():
    a = AllocatorModel()
    a.malloc(1, 1 * MiB)
    a.malloc(2, 1 * MiB)  # segment 1 full
    a.malloc(3, 512 * KiB)  # segment 2: 1.5 MiB left free
    a.free(1)  # free: 1 MiB (segment 1), 1.5 MiB (segment 2)
    a.malloc(4, 512 * KiB)  # best fit: the 1 MiB block -> free 512 KiB and 1.5 MiB
    a.malloc(5, 1 * MiB)  # fits the 1.5 MiB block -> free 512 KiB and 512 KiB
    assert a.reserved_bytes == 4 * MiB
    a.malloc(6, 1 * MiB)  # nothing fits: a third segment (worst fit would have avoided it)
    assert a.reserved_bytes == 6 * MiB


def test_unknown_and_repeated_keys():
    a = AllocatorModel()
    a.free(99)  # unknown: ignored
    a.malloc(1, 1000)
    a.free(1)
    a.free(1)  # idempotent
    assert a.allocated_bytes == 0
    a.malloc(2, 1000)
    a.malloc(2, 3000)  # a live key again: the old allocation is taken as gone
    assert a.allocated_bytes == 3072


def test_random_sequence_invariants():
    a, rng, live, last = AllocatorModel(), random.Random(0), [], 0
    for key in range(10_000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            a.malloc(key, rng.choice([rng.randrange(0, 4096), rng.randrange(1, 4 * MiB), rng.randrange(1, 40 * MiB)]))
            live.append(key)
        assert a.reserved_bytes >= a.allocated_bytes
        assert a.max_reserved_bytes >= last and a.max_reserved_bytes >= a.reserved_bytes
        last = a.max_reserved_bytes
    for key in live:
        a.free(key)
    assert a.allocated_bytes == 0 and a.reserved_bytes == last
    # everything coalesced: each segment is one free block again
    assert all(block.prev is None and block.next is None for pool in (a._small, a._large) for *_, block in pool)
