"""[Note: offload beside the forward]: the CPU twin's offload copies on the copier's thread train as plain PyTorch,
bit for bit, leave the forward's thread, and refuse a saved tensor written in place while its copy ran."""

from __future__ import annotations

import threading

import pytest
import torch
from loops import plan_for, user_loop
from test_activations import exact

from hplan.errors import HplanError
from hplan.executor.activations import copier
from hplan.specs import load_workload


@pytest.fixture(scope="module")
def offload_plan():
    workload = exact(load_workload("gpt:tiny"))
    return workload, plan_for(workload, activations="offload")


@pytest.mark.slow  # ~4 s (a trace and a plan); fast CI covers the copier's parity in test_activation_staged
def test_offload_beside_the_forward_trains_as_plain_pytorch_off_the_main_thread(offload_plan, monkeypatch):
    workload, plan = offload_plan
    threads: list[int] = []
    ups: list[int] = []
    real_down, real_up = copier._copy_down, copier._copy_up

    def copy_down(*args):
        threads.append(threading.get_ident())
        return real_down(*args)

    def copy_up(groups):
        ups.append(threading.get_ident())
        real_up(groups)

    monkeypatch.setattr(copier, "_copy_down", copy_down)
    monkeypatch.setattr(copier, "_copy_up", copy_up)
    ref = user_loop(workload, 3)
    got = user_loop(workload, 3, plan, measure=False, overlap=True)
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    offloaded = sum(1 for c in plan.activations if c.choice == "offload" and c.moved_bytes)
    assert len(threads) == 3 * offloaded  # every segment's copy, each iteration, on the copier's thread
    assert threading.get_ident() not in threads and len(ups) == len(threads) and threading.get_ident() not in ups
    inline = user_loop(workload, 1, plan, measure=False, overlap=False)
    assert len(threads) == 3 * offloaded and inline["losses"] == ref["losses"][:1]  # overlap=False: in line


def test_offload_copies_stay_in_line_where_a_probe_measures():
    assert not copier.offload_beside(True, measured=True)
    assert not copier.offload_beside(False, measured=False)
    assert copier.offload_beside(True, measured=False)


def test_a_source_written_in_place_while_its_copy_runs_is_refused():
    """The copier's thread held back until the source is written: the copy sees the write, the prefetch's check
    refuses it (never trained on)."""
    work = copier.Copier()
    gate = threading.Event()
    try:
        work.run(gate.wait)  # the copier's thread held until the source is written
        source = torch.arange(16, dtype=torch.float32)
        host = torch.empty(64, dtype=torch.uint8)
        view = torch.empty(0, dtype=torch.uint8).set_(source.untyped_storage())
        copying = work.down([(host, view, source)])
        source.add_(1)
        gate.set()
        with pytest.raises(HplanError, match="modified in place"):
            copier.finish(copying, "h.0")
        clean = torch.ones(4)
        copier.finish(work.down([(torch.empty(16, dtype=torch.uint8),
                                  torch.empty(0, dtype=torch.uint8).set_(clean.untyped_storage()), clean)]), "h.0")
        assert torch.equal(host.view(torch.float32), torch.arange(16, dtype=torch.float32) + 1)
    finally:
        gate.set()
        work.close()


def test_a_failed_copy_back_raises_at_the_unpack_never_reads_the_buffer():
    work = copier.Copier()
    try:
        good, bad = copier.Ready(), copier.Ready()
        fast = torch.empty(8, dtype=torch.uint8)
        work.up([(good, [fast], [torch.full((8,), 7, dtype=torch.uint8)]),
                 (bad, [torch.empty(4, dtype=torch.uint8)], [torch.ones(8, dtype=torch.uint8)])])  # sizes differ
        assert copier.wait(good) is None and good.done and torch.equal(fast, torch.full((8,), 7, dtype=torch.uint8))
        with pytest.raises(HplanError, match="copy back failed"):
            copier.wait(bad)
        assert not bad.done
    finally:
        work.close()


def test_a_prefetch_signals_its_small_buffers_with_the_next_group_and_copies_every_byte():
    """[Note: the copier's signals]: buffers grouped in the order the backward reads them (the last saved first),
    a group closed once it holds SIGNAL_BYTES; every buffer's bytes come back exactly."""
    from types import SimpleNamespace

    big, small = copier.SIGNAL_BYTES, 2048
    sizes = [big, small, small, big, 4 * big]  # saved in this order: read back in reverse
    slots = [SimpleNamespace(nbytes=n, host=torch.randint(0, 255, (n,), dtype=torch.uint8), fast=None,
                             storage=None, ready=None) for n in sizes]
    hosts = [s.host.clone() for s in slots]
    work, spare = copier.Copier(), {}
    try:
        assert copier.up_beside(slots, spare, torch.device("cpu"), work) == sum(sizes)
        groups = [s.ready for s in reversed(slots)]
        assert [groups.index(r) for r in groups] == [0, 1, 2, 2, 2]  # 4 * big alone, big alone, small+small+big
        for slot, host in zip(slots, hosts):
            assert copier.wait(slot.ready) is None and slot.ready.done and torch.equal(slot.fast, host)
        assert sorted(spare) == sorted(set(sizes)) and all(s.host is None for s in slots)
    finally:
        work.close()
