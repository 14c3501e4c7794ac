"""The host tier's region store (issue 16): regions staged in host memory only as the plan says, the rest on disk.

`TieredStore` is a RegionStore whose host copies follow [Note: host tier] (hplan.artifacts.plan): a region is staged
(a page-aligned buffer, [Note: staging buffers]) or not, and regions that move to or from disk live in a DiskStore
(hplan.executor.tiers.nvme: O_DIRECT, four I/O threads, a checksum verified on every read) under the run's NVMe
directory. PlanRun calls its hooks through hplan.executor.tiers.host (`host_tier(store)`, no-ops for a two-tier
plan): `begin_step` (phase 0: drops, allocations, reads issued), `begin_update`/`end_update` around each host update
(its phase), `stage_chunk`/`settle_chunk` around optimizer-state adoption outside a step, and `close` on exit. Reads
are waited for where the content is used (a fetch, an update), so a read the plan placed earlier is a prefetch; a
disk write is issued right after the region's last modification (its write-back lands, its update ends) and waited
for only when the buffer is dropped or modified again.

Accounting: `host_model_bytes` is the running sum of staging buffers (whole pages, as allocated); after every
phase it must equal the plan's staged bytes there (a difference is an hplan bug and stops the run). The
process RSS is sampled at the same points as a cross-check that also sees the update's temporaries.

Setup (before the first step) writes every disk region once, streaming one region at a time, and keeps
regions without a disk file staged until the first step: device-only regions (resident on the fast tier at
every step) until their initial fetch, so setup briefly holds them in host memory too. `.grad` is not exposed
on the CPU tier (as on CUDA): a gradient's host copy may be on disk between steps.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import psutil
import torch
from hplan.executor.tiers import staging
from hplan.executor.device import FastTier
from hplan.executor.tiers.nvme import DiskStore
from hplan.executor.regions import RegionStore, Slot
from torch import nn

from hplan.artifacts import Plan, Step
from hplan.artifacts.host_replay import device_only, disk_regions, phase_accesses
from hplan.artifacts.replay import replay
from hplan.errors import HplanError


class TieredStore(RegionStore):
    """A RegionStore whose host copies are staged and dropped as the plan's host phases say (module doc)."""

    phased = True
    """Each host update runs in its own plan phase (PlanRun steps those chunks one at a time)."""

    def __init__(self, model: nn.Module, plan: Plan, tier: FastTier, *, master: bool, state_names: Any,
                 nvme_dir: str | os.PathLike[str] | None) -> None:
        self.plan = plan
        self.on_disk = disk_regions(plan)
        if self.on_disk and nvme_dir is None:
            raise HplanError(f"the plan keeps {len(plan.nvme_chunks())} chunks on NVMe: pass `nvme_dir`, a "
                             "directory on the disk to use")
        self._buffers: dict[int, staging.Staged] = {}
        self._layout: dict[int, staging.Layout] = {}
        self._reads: dict[int, Future[None]] = {}
        """Region → its read in flight (waited for where the content is first used)."""
        self._cache: dict[int, tuple[staging.Staged, dict[object, torch.Tensor]]] = {}
        """Regions of one chunk read outside the plan (values for a checkpoint or on exit), by region id."""
        self._started = False
        self._writes: set[int] = set()
        """The current phase's disk writes not issued yet."""
        self.iter_bytes = [0, 0]
        """Disk bytes (read, write) issued in the iteration under way (complete once it ends)."""
        self.setup_disk_bytes = [0, 0]
        self.extra_read_bytes = 0
        """Disk bytes read outside the plan (values read for a checkpoint or on exit)."""
        self.host_model_bytes = 0
        """Staging bytes allocated now (running sum of allocations and drops)."""
        self.peak_host_model_bytes = 0
        self.peak_rss_bytes = 0
        self.peak_rss_staging_bytes = 0
        self.peak_outside_steps_bytes = 0
        """Staging bytes while state is read outside the plan (see [Note: what --cpu-mem covers])."""
        self.staging_excess_bytes = 0
        """Most the OS ever counted (RssShmem) above the running sum (in a step: the plan's staging alone), at any
        sample: 0 when the sum is honest."""
        self._process = psutil.Process()
        self._shmem_before = staging.rss_shmem()
        """Shared memory the process held before this store (another run's, a DataLoader's): not staging."""
        self.disk: DiskStore | None = None
        if self.on_disk:
            self.disk = DiskStore(nvme_dir)  # type: ignore[arg-type]
            try:
                self.disk.check_free(sum(staging.staging_bytes(r.bytes) for r in plan.regions
                                         if r.id in self.on_disk))
            except BaseException:
                self.disk.close(discard=True)
                raise
        tier.exposes_host_grads = False  # a gradient's host copy may be on disk (see the module doc)
        try:
            super().__init__(model, plan, tier, master=master, state_names=state_names)
        except BaseException:
            self.close()
            raise
        rep = replay(plan)
        self.device_only = device_only(plan, [s.resident for s in rep.states])
        accesses = phase_accesses(plan, frozenset(self.slots) - self.device_only)
        assert rep.host is not None
        self.planned = [held - a.temp_bytes for held, a in zip(rep.host.host_bytes, accesses, strict=True)]
        """Staged bytes the plan holds after each phase's allocations and reads (temporaries excluded)."""
        self.planned_host_peak = rep.host.peak_bytes
        self._first_phase = [0] * len(plan.steps)
        for t in range(1, len(plan.steps)):
            self._first_phase[t] = self._first_phase[t - 1] + len(plan.steps[t - 1].host)

    # -- buffers ----------------------------------------------------------------------------------------
    def _make_views(self, slot: Slot, layout: list) -> None:
        """Views as RegionStore makes them, then unstaged: a host copy exists only while the plan stages it."""
        super()._make_views(slot, layout)
        self._layout[slot.region.id] = staging.layout_of(slot.host, slot.host_views)
        staging.point_away(slot.host, slot.host_views, self._layout[slot.region.id])

    def _stage(self, rid: int) -> None:
        slot = self.slots[rid]
        buffer = staging.allocate(slot.region.bytes)
        staging.point_at(slot.host, slot.host_views, self._layout[rid], buffer)
        self._buffers[rid] = buffer
        self.host_model_bytes += buffer.nbytes
        self._cache.pop(rid, None)

    def _drop(self, rid: int) -> None:
        self._wait(rid)
        slot = self.slots[rid]
        staging.point_away(slot.host, slot.host_views, self._layout[rid])
        self.host_model_bytes -= self._buffers.pop(rid).nbytes

    def staged(self, rid: int) -> bool:
        return rid in self._buffers

    def _read(self, rid: int, into: staging.Staged | None = None) -> None:
        assert self.disk is not None
        buffer = into or self._buffers[rid]
        self._reads[rid] = self.disk.read_async(self._key(rid), buffer.disk)

    def _wait_read(self, rid: int) -> None:
        """Wait for the region's pending read only (a write in flight may go on: both only read the buffer)."""
        future = self._reads.pop(rid, None)
        if future is not None:
            future.result()

    def _write(self, rid: int) -> None:
        assert self.disk is not None
        self.disk.write_async(self._key(rid), self._buffers[rid].disk)

    def _wait(self, rid: int) -> None:
        """Wait for every transfer of the region (before its buffer is modified or freed)."""
        self._reads.pop(rid, None)
        if self.disk is not None and rid in self.on_disk:
            self.disk.wait(self._key(rid))

    @staticmethod
    def _key(rid: int) -> str:
        return f"r{rid}"

    # -- setup ------------------------------------------------------------------------------------------
    def _adopt_weights(self, names: tuple[str, ...], rid: int) -> None:
        self._stage(rid)
        super()._adopt_weights(names, rid)
        self._settle([rid])

    def _settle(self, rids: list[int]) -> None:
        """Setup: a disk region goes to disk now (one region in host memory at a time); others stay staged."""
        for rid in rids:
            if rid in self.on_disk and self.staged(rid):
                self._write(rid)
                self.setup_disk_bytes[1] += self._buffers[rid].nbytes
                self._drop(rid)

    def _setup_stage(self, rid: int) -> None:
        if self.staged(rid):
            return
        self._stage(rid)
        if rid in self.on_disk and self.disk is not None and self._written(rid):
            self._read(rid)
            self.setup_disk_bytes[0] += self._buffers[rid].nbytes
            self._wait(rid)

    def _written(self, rid: int) -> bool:
        try:
            assert self.disk is not None
            self.disk.size(self._key(rid))
        except HplanError:
            return False
        return True

    def stage_chunk(self, chunk: int) -> None:
        """Outside a step (setup, load_state_dict): stage the chunk's regions while its state is adopted."""
        for rid in self.by_chunk[chunk].values():
            self._setup_stage(rid)

    def settle_chunk(self, chunk: int) -> None:
        """After `stage_chunk`: disk regions written back (and, in setup, dropped); the plan's staging restored."""
        rids = list(self.by_chunk[chunk].values())
        if self._started:
            for rid in rids:
                if rid in self.on_disk:
                    self._write(rid)
            for rid in rids:
                if self.staged(rid) and not self._staged_now(rid):
                    self._drop(rid)
        else:
            self._settle(rids)

    def _staged_now(self, rid: int) -> bool:
        """Is `rid` staged at this point of the plan (between steps: at the iteration's start)?"""
        return rid in self.plan.initial_staged

    def _start(self) -> None:
        """The first step: device-only regions lose their host copy, the initial staging is established."""
        self._started = True
        for rid in list(self._buffers):
            if rid not in self.plan.initial_staged:
                self._drop(rid)
        for rid in self.plan.initial_staged:
            self._setup_stage(rid)
        if self.disk is not None:
            self.disk.wait_all()
            self.disk.reset_stats()

    # -- the plan's phases ------------------------------------------------------------------------------
    def begin_step(self, step: Step) -> None:
        """Phase 0 of `step`: flush the previous phase's writes, then drops, allocations and reads."""
        if not self._started:
            self._start()
        self._cache.clear()  # reads outside the plan (a checkpoint's) never hold memory into a step
        if step.index == 0:
            self._flush()
            self.iter_bytes = [0, 0]
        self._phase(step, 0)

    def begin_update(self, step: Step, chunk: int) -> None:
        """Phase j of `step`, before the host update of `chunk`: drops, then its regions staged and read."""
        j = 1 + sorted(step.host_updates).index(chunk)
        self._phase(step, j)
        regions = self.by_chunk[chunk]
        for kind, rid in regions.items():
            if rid not in self.device_only:
                (self._wait_read if kind == "grad" else self._wait)(rid)  # the update rewrites the others

    def end_update(self, step: Step, chunk: int) -> None:
        """After the host update: its modified regions go to disk where the plan writes them."""
        self._flush()
        self._sample()

    def _phase(self, step: Step, j: int) -> None:
        self._flush()
        ph = step.host[j]
        for rid in ph.drop:
            self._drop(rid)
        for rid in ph.alloc:
            self._stage(rid)
        for rid in ph.nvme_read:
            self._stage(rid)
            self._read(rid)
            self.iter_bytes[0] += self._buffers[rid].nbytes
        self._writes = set(ph.nvme_write)
        k = self._first_phase[step.index] + j
        if self.host_model_bytes != self.planned[k]:
            raise HplanError(f"plan step {step.index} ({step.event}) phase {j} stages {self.host_model_bytes} bytes "
                             f"in host memory where the plan stages {self.planned[k]}: an hplan bug, please report it")
        self.peak_host_model_bytes = max(self.peak_host_model_bytes, self.host_model_bytes)
        self._sample()

    def _flush(self) -> None:
        """Issue the phase's writes not issued yet (those after a host update, or any the phase left)."""
        for rid in sorted(self._writes):
            self._issue_write(rid)

    def _issue_write(self, rid: int) -> None:
        self._writes.discard(rid)
        self._write(rid)
        self.iter_bytes[1] += self._buffers[rid].nbytes

    def _sample(self, *, in_step: bool = True) -> None:
        """The process's RSS, and on Linux its shared-memory part grown since the store began: the staging mappings'
        resident pages (nothing else in hplan maps shared memory; a DataLoader's workers may, and would count
        here), the OS's own count of what `host_model_bytes` (+ the out-of-plan reads held) tracks."""
        shmem = max(0, staging.rss_shmem() - self._shmem_before)
        counted = self.host_model_bytes + (0 if in_step else self.outside_bytes)  # in a step: the plan's alone
        self.staging_excess_bytes = max(self.staging_excess_bytes, shmem - counted)
        if in_step:
            self.peak_rss_bytes = max(self.peak_rss_bytes, self._process.memory_info().rss)
            self.peak_rss_staging_bytes = max(self.peak_rss_staging_bytes, shmem)
        else:
            self.peak_outside_steps_bytes = max(self.peak_outside_steps_bytes, counted)

    @property
    def outside_bytes(self) -> int:
        """Staging bytes of regions read outside the plan and held now (one chunk's at most)."""
        return sum(buffer.nbytes for buffer, _ in self._cache.values())

    # -- transitions ------------------------------------------------------------------------------------
    def fetch(self, rid: int) -> None:
        if not self._started and not self.slots[rid].state.on_fast_tier:  # setup's initial residency
            self._setup_stage(rid)
        self._wait_read(rid)
        super().fetch(rid)

    def evict(self, rid: int, *, writeback: bool) -> None:
        """A planned write-back always lands (its buffer was allocated for it), then goes to disk if planned."""
        if writeback and self.slots[rid].state.on_fast_tier:
            self._wait(rid)
            self.mark_dirty(rid)
        super().evict(rid, writeback=writeback)
        if writeback and rid in self._writes:
            self._issue_write(rid)

    def current(self, rid: int, key: Any) -> torch.Tensor:
        """As RegionStore's; a region on disk and not staged is read into a cache holding one chunk's regions
        (values for a checkpoint or the model handed back on exit: reads outside the plan, counted apart)."""
        slot = self.slots[rid]
        if self.staged(rid):
            self._wait_read(rid)  # a read hoisted into the staging buffer lands before anyone reads it
        if slot.state.on_fast_tier or self.staged(rid) or rid not in self.on_disk or not self._written(rid):
            return super().current(rid, key)
        if rid not in self._cache:
            if any(self.slots[r].region.chunk != slot.region.chunk for r in self._cache):
                self._cache.clear()
            buffer = staging.allocate(slot.region.bytes)
            self._read(rid, buffer)
            self._wait(rid)
            self.extra_read_bytes += buffer.nbytes
            self._cache[rid] = (buffer, staging.views_into(buffer, self._layout[rid]))
            self._sample(in_step=False)
        return self._cache[rid][1][key]

    def close(self) -> None:
        """Finish transfers, release the directory and remove the region files (state lives in checkpoints)."""
        self._cache.clear()
        if self.disk is None:
            return
        disk, self.disk = self.disk, None
        disk.close(discard=True)

    def disk_stats(self) -> dict[str, float]:
        """Disk figures since the first step, on DiskStore's own clock: bytes per second with a transfer of that
        direction in flight, and the bytes and seconds with any transfer in flight (reads and writes share it)."""
        if self.disk is None:
            return {}
        s = self.disk.stats()
        return {"nvme_read_gbps": s.read_bandwidth / 1e9, "nvme_write_gbps": s.write_bandwidth / 1e9,
                "nvme_read_bytes": s.read_bytes, "nvme_write_bytes": s.write_bytes,
                "nvme_busy_seconds": s.busy_seconds}
