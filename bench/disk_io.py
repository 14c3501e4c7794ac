"""Disk I/O for the NVMe tier (issue 16, benchmark b): DiskStore's achieved bandwidth ÷ raw bandwidth.

    python -m bench.disk_io [--dir DIR] [--total-mib 256] [--region-mib 16] [--threads 4] [--repeats 5]

Not wired into `python -m bench` yet: the executor does not use the NVMe tier. Each repeat measures,
in alternating order, the directory's raw sequential bandwidth (`measure_raw_bandwidth`: `--threads`
streams, O_DIRECT where allowed, fsync after writing) and the store moving the same bytes as
`total / region` regions on `--threads` threads (writes then `commit()`, which fsyncs; reads verified
by checksum). Both rewrite files that already exist, the store's steady state: allocating passes are
untimed. Disk use: about three times `--total-mib` (two store slots + the raw scratch file), removed
at the end.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch
from hplan.executor.tiers.nvme import DiskStore, aligned_empty, measure_raw_bandwidth
from hplan.executor.tiers.nvme_format import checksum_function
from hplan.executor.tiers.nvme_io import byte_view

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class DiskIoResult:
    """Bandwidths in bytes/second; one entry per repeat, in order."""

    raw_write: list[float]
    raw_read: list[float]
    store_write: list[float]
    store_read: list[float]
    direct: bool
    fallback_reason: str | None
    checksum: str
    checksum_bandwidth: float
    """The store's checksum on these buffers, one thread: what verifying every byte costs."""

    def ratios(self) -> tuple[float, float]:
        """(write, read) median over repeats of store ÷ raw of the same repeat: issue 16's "achieved ÷ raw".

        Paired, because a disk shared with other jobs drifts by 2x within a minute; the pair's two
        runs are seconds apart and alternate which goes first.
        """
        w = median(s / r for s, r in zip(self.store_write, self.raw_write))
        return w, median(s / r for s, r in zip(self.store_read, self.raw_read))


def measure(directory: Path, *, total: int, region: int, threads: int, repeats: int) -> DiskIoResult:
    """Run the comparison in a fresh subdirectory of `directory`, removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix="hplan-disk-io-", dir=directory))
    try:
        n = max(1, total // region)
        bufs = [aligned_empty(region) for _ in range(n)]
        for i, buf in enumerate(bufs):
            buf.copy_(torch.randint(0, 256, (region,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
        raw_w, raw_r, st_w, st_r = [], [], [], []
        with DiskStore(work, threads=threads) as store:
            _, fn = checksum_function(store.checksum_name)
            start = time.perf_counter()
            for buf in bufs:
                fn(byte_view(buf, "checksum"))
            checksum_bw = n * region / (time.perf_counter() - start)
            for _ in range(2):  # untimed: allocate both slots of every region (see nvme.py's crash-safety note)
                _store_pass(store, bufs)
            for rep in range(repeats):
                for raw_first in ((True, False) if rep % 2 == 0 else (False, True)):
                    w, r = measure_raw_bandwidth(work, n * region, streams=threads) if raw_first else \
                        _store_pass(store, bufs)
                    (raw_w if raw_first else st_w).append(w)
                    (raw_r if raw_first else st_r).append(r)
            return DiskIoResult(raw_write=raw_w, raw_read=raw_r, store_write=st_w, store_read=st_r,
                                direct=store.direct, fallback_reason=store.fallback_reason,
                                checksum=store.checksum_name, checksum_bandwidth=checksum_bw)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _store_pass(store: DiskStore, bufs: list[torch.Tensor]) -> tuple[float, float]:
    """(write, read) bytes/second: every region written then committed (fsync, like the raw figure),
    then every region read back and verified. Wall clock, as the raw figure."""
    nbytes = sum(b.numel() for b in bufs)
    store.reset_stats()
    start = time.perf_counter()
    for i, buf in enumerate(bufs):
        store.write_async(f"r{i}", buf)
    store.commit()
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    for i, buf in enumerate(bufs):
        store.read_async(f"r{i}", buf)
    store.wait_all()
    read_s = time.perf_counter() - start
    stats = store.stats()
    assert stats.write_bytes == stats.read_bytes == nbytes, "the store's counters disagree with the bytes moved"
    return nbytes / write_s, nbytes / read_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.disk_io", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="directory on the disk to test")
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--region-mib", type=int, default=16)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    res = measure(args.dir, total=args.total_mib * MIB, region=args.region_mib * MIB, threads=args.threads,
                  repeats=args.repeats)
    gb = 1e9
    print(f"directory {args.dir}: {args.total_mib} MiB as {args.total_mib // args.region_mib} regions of "
          f"{args.region_mib} MiB, {args.threads} threads, {args.repeats} repeats; O_DIRECT "
          f"{'on' if res.direct else f'off ({res.fallback_reason})'}; "
          f"checksum {res.checksum} {res.checksum_bandwidth / gb:.2f} GB/s")
    print("            write GB/s (per repeat)         read GB/s (per repeat)")
    for name, w, r in (("raw", res.raw_write, res.raw_read), ("DiskStore", res.store_write, res.store_read)):
        print(f"{name:10s}  {median(w) / gb:5.2f}  ({' '.join(f'{x / gb:.2f}' for x in w)})"
              f"{'':8s}{median(r) / gb:5.2f}  ({' '.join(f'{x / gb:.2f}' for x in r)})")
    rw, rr = res.ratios()
    print(f"achieved ÷ raw (median of paired repeats): write {rw:.2f}, read {rr:.2f} (issue 16 goal ≥ 0.7)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
