"""executor.ranks.collectives on gloo: shards gather back to the full buffer, gradients reduce-scatter to the
mean, uneven sizes pad, async calls complete on wait(), and the byte counters equal the ring model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hplan.errors import HplanError
from hplan.executor.ranks.collectives import ChunkComm, CommCounter, ShardLayout, ring_bytes
from hplan.executor.ranks.launch import RankInfo, launch

HAVE_PROC_IO = Path("/proc/self/io").exists()


def test_shard_layout_pads_at_the_end():
    lay = ShardLayout(numel=10, world=4)
    assert (lay.shard_numel, lay.padded_numel) == (3, 12)
    assert [lay.span(r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [lay.pad_numel(r) for r in range(4)] == [0, 0, 0, 2]
    tiny = ShardLayout(numel=1, world=3)
    assert [tiny.span(r) for r in range(3)] == [(0, 1), (1, 1), (1, 1)] and tiny.padded_numel == 3
    with pytest.raises(HplanError):
        ShardLayout(numel=4, world=0)


def test_ring_bytes_follow_nccl_bus_model():
    # 4 ranks, a 12-element fp32 buffer (48 B, shard 12 B): AG/RS move 3 shards each way, AR twice that
    assert ring_bytes("all_gather", padded_bytes=48, payload_bytes=40, group_size=4).sent == 36
    assert ring_bytes("reduce_scatter", padded_bytes=48, payload_bytes=40, group_size=4).recv == 36
    call = ring_bytes("all_reduce", padded_bytes=48, payload_bytes=40, group_size=4)
    assert (call.sent, call.recv, call.payload) == (72, 72, 40)
    counter = CommCounter()
    counter.add(call)
    counter.add(ring_bytes("all_gather", padded_bytes=48, payload_bytes=40, group_size=4))
    assert (counter.sent, counter.by_op["all_reduce"].calls, len(counter.calls)) == (108, 1, 2)
    with pytest.raises(HplanError, match="unknown collective"):
        ring_bytes("broadcast", padded_bytes=8, payload_bytes=8, group_size=2)


def _wchar() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("wchar"):
            return int(line.split()[1])
    return 0


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()


def _battery(info: RankInfo) -> dict:
    """Run every check on this rank; return plain values for the parent to assert on."""
    comm = ChunkComm()
    r, n = info.rank, info.world_size
    out: dict = {"gather": {}, "errors": []}
    for numel in (4 * n, 4 * n + 1, 1):  # even, uneven, fewer elements than ranks
        lay = comm.layout(numel)
        whole = torch.arange(numel, dtype=torch.float32) * 1.5 + 1
        shard = torch.zeros(lay.shard_numel)
        start, stop = lay.span(r)
        shard[:stop - start] = whole[start:stop]
        padded = torch.full((lay.padded_numel,), float("nan"))
        comm.all_gather(shard, padded)
        logical = torch.full((numel,), float("nan"))
        comm.all_gather(shard, logical, numel=numel)
        raw = torch.empty(lay.padded_numel * 4, dtype=torch.uint8)  # the same bytes, gathered untyped
        comm.all_gather(shard.view(torch.uint8), raw)
        out["gather"][numel] = (bool(torch.equal(padded[:numel], whole)), bool((padded[numel:] == 0).all()),
                                bool(torch.equal(logical, whole)), bool(torch.equal(raw.view(torch.float32), padded)))
    # gradients: rank r holds g·(r+1) + r·1e-3; the mean over ranks, this rank's shard
    numel = 4 * n + 3
    lay = comm.layout(numel)
    g = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    mine = g * (r + 1) + r * 1e-3
    shard = torch.empty(lay.shard_numel)
    comm.reduce_scatter(mine, shard, numel=numel)
    expected = sum(g.double() * (k + 1) + k * 1e-3 for k in range(n)) / n
    start, stop = lay.span(r)
    out["rs_err"] = float((shard[:stop - start].double() - expected[start:stop]).abs().max())
    out["rs_pad"] = shard[stop - start:].tolist()
    if n == 2:  # two terms: the sum is commutative and halving exact, so bitwise (g0 + g1) / 2
        g0, g1 = g * 1 + 0 * 1e-3, g * 2 + 1e-3
        out["rs_exact"] = bool(torch.equal(shard[:stop - start], ((g0 + g1) / 2)[start:stop]))
    summed = mine.clone()
    comm.all_reduce(summed, average=False)
    out["ar_err"] = float((summed.double() - expected * n).abs().max())
    out["ar_digest"] = _digest(summed)
    # async: start, compute meanwhile, wait; output valid only after wait
    big = torch.full((1 << 16,), float(r + 1))
    gathered = torch.empty((1 << 16) * n)
    pending = comm.all_gather(big, gathered, async_op=True)
    busy = torch.randn(64, 64) @ torch.randn(64, 64)
    pending.wait()
    pending.wait()  # idempotent
    ranks = torch.arange(1, n + 1, dtype=torch.float32)
    out["async_ag"] = bool(torch.equal(gathered, ranks.repeat_interleave(1 << 16)))
    avg = torch.full((5,), float(r + 1))
    comm.all_reduce(avg, async_op=True).wait()
    out["async_ar"] = avg.tolist()
    out["busy"] = float(busy.sum()) == float(busy.sum())
    # counters: bytes of this battery's calls, per op
    out["counter"] = {op: (t.calls, t.sent, t.recv, t.payload) for op, t in comm.counter.by_op.items()}
    # measured wire bytes (gloo's TCP writes) against the ring model, on 4 MiB
    if HAVE_PROC_IO:
        comm.counter.reset()
        x = torch.ones(1 << 20)
        full = torch.empty((1 << 20) * n)
        dist.barrier()
        before = _wchar()
        comm.all_gather(x, full)
        ag_wire = _wchar() - before
        dist.barrier()
        before = _wchar()
        comm.reduce_scatter(full, x)
        rs_wire = _wchar() - before
        out["wire"] = {"all_gather": (ag_wire, comm.counter.by_op["all_gather"].sent),
                       "reduce_scatter": (rs_wire, comm.counter.by_op["reduce_scatter"].sent)}
    for bad in (lambda: comm.reduce_scatter(torch.zeros(8 * n, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)),
                lambda: comm.all_gather(torch.zeros(3), torch.zeros(4 * n)),
                lambda: comm.all_reduce(torch.zeros(2, 2))):
        try:
            bad()
            out["errors"].append("no error")
        except HplanError as exc:
            out["errors"].append(str(exc))
    return out


def _check(results: list[dict], n: int) -> None:
    for out in results:
        for numel, flags in out["gather"].items():
            assert all(flags), (numel, flags)
        assert out["rs_err"] < 1e-6 and all(v == 0 for v in out["rs_pad"])
        assert out["ar_err"] < 1e-5
        assert out["async_ag"] and out["async_ar"] == [(n + 1) / 2] * 5
        assert len(out["errors"]) == 3 and all("no error" != e for e in out["errors"])
        assert "typed view" in out["errors"][0] and "shard has 3 elements" in out["errors"][1]
    assert len({out["ar_digest"] for out in results}) == 1  # every rank holds bitwise the same sum
    # counters for the battery, rank 0: ring bytes from the padded sizes, payload from the logical ones
    sizes = (4 * n, 4 * n + 1, 1)
    shards = [-(-m // n) for m in sizes]  # shard elements of the three sizes; three gathers each
    ag_sent = 3 * sum((n - 1) * k * 4 for k in shards) + (n - 1) * (1 << 16) * 4
    # payload: the padded size when `full` is the padded buffer and no numel is given, else the logical one
    ag_payload = sum((2 * k * n + m) * 4 for k, m in zip(shards, sizes)) + n * (1 << 16) * 4
    rs_shard = -(-(4 * n + 3) // n)
    ar = 2 * (n - 1) * rs_shard * 4 + 2 * (n - 1) * -(-5 // n) * 4
    assert results[0]["counter"] == {
        "all_gather": (10, ag_sent, ag_sent, ag_payload),
        "reduce_scatter": (1, (n - 1) * rs_shard * 4, (n - 1) * rs_shard * 4, (4 * n + 3) * 4),
        "all_reduce": (2, ar, ar, (4 * n + 3) * 4 + 20),
    }


def test_two_ranks():
    results = launch(_battery, nprocs=2, timeout_s=60, collective_timeout_s=30)
    _check(results, 2)
    assert all(out["rs_exact"] for out in results)
    if HAVE_PROC_IO:
        for out in results:
            ag_wire, ag_model = out["wire"]["all_gather"]
            rs_wire, rs_model = out["wire"]["reduce_scatter"]
            assert ag_model <= ag_wire <= ag_model * 1.01  # gloo's all-gather is the ring: model + headers
            assert rs_wire >= 1.9 * rs_model  # gloo's reduce-scatter sends an all-reduce's bytes (finding)


@pytest.mark.slow  # uneven shards are also checked without ranks in test_shard_layout_pads_at_the_end
def test_three_ranks_uneven():
    _check(launch(_battery, nprocs=3, timeout_s=60, collective_timeout_s=30), 3)
