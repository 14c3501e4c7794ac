"""Predicted step time of a tiered plan: compute, both PCIe directions, the host optimizer and the disk.

Same model as `planner.schedule.predict_seconds`, with one more resource: the disk, one queue shared by reads
and writes (an SSD's flash channels serve both; the published read and write rates are each for one direction
alone, so a mixed stream gets neither in full). Dependencies, per [Note: host tier]:

- a phase's reads and allocations start once its drops are done, and a drop waits for the region's disk write;
- a write-back (device→host) lands once its staging buffer exists and any pending disk write of it is done;
  a fetch (host→device) starts once its disk read is done;
- a host update starts once its chunk's reads are done, its gradient has landed and the pending writes of the
  regions it modifies are done; its writes start when it ends;
- a disk write starts when the region's content is final (after its write-back or host update).

With `hardware.overlap` the device computes beside the links, the host optimizer and the disk (copy engines,
CUDA streams); without it (the CPU executor) one clock runs transfers, host updates and compute in the
executor's order while the disk works in the background and is waited for where the plan needs it. Two
iterations are simulated and the second one's length is the step time, so reads placed late in an iteration
for the next one, and writes still running when it ends, are counted in the steady state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hplan.artifacts.host_replay import PhaseAccess
from hplan.artifacts.plan import Plan, staging_bytes
from hplan.planner.schedule import TRANSFER_LATENCY_S


@dataclass(kw_only=True, slots=True)
class _Clock:
    """When each resource is next free, and when each region's copies are ready (seconds)."""

    compute: float = 0.0
    up: float = 0.0
    down: float = 0.0
    cpu: float = 0.0
    disk: float = 0.0
    now: float = 0.0
    """The executor's one clock when nothing overlaps."""
    host_ready: dict[int, float] = field(default_factory=dict)
    """Region → its host content is there (read done, write-back landed, host update ended)."""
    write_done: dict[int, float] = field(default_factory=dict)
    device_ready: dict[int, float] = field(default_factory=dict)
    landed: dict[int, float] = field(default_factory=dict)
    """Region → its last write-back finished (a host update waits for its gradient)."""


def predict_tier_seconds(plan: Plan, accesses: list[PhaseAccess], seconds: list[float]) -> dict[str, float]:
    """Steady-state step time ("step") and its split: compute, h2d, d2h, cpu_optimizer, nvme_read and
    nvme_write (busy seconds), and nvme_stall (how much longer the step is than with an infinitely fast disk)."""
    hw = plan.hardware
    read_bps, write_bps = hw.nvme_read_gbps * 1e9, hw.nvme_write_gbps * 1e9
    step = _simulate(plan, accesses, seconds, read_bps, write_bps)
    free = _simulate(plan, accesses, seconds, math.inf, math.inf)
    size = {r.id: r.bytes for r in plan.regions}
    up = [size[r] for s in plan.steps for r in s.fetch]
    down = [size[r] for s in plan.steps for r in s.writeback]
    reads = sum(staging_bytes(size[r]) for s in plan.steps for ph in s.host for r in ph.nvme_read)
    writes = sum(staging_bytes(size[r]) for s in plan.steps for ph in s.host for r in ph.nvme_write)
    update = plan.chunk_bytes()
    updated = sum(update[c] for s in plan.steps for c in s.host_updates)
    return {"compute": sum(seconds), "h2d": len(up) * TRANSFER_LATENCY_S + sum(up) / (hw.h2d_gbps * 1e9),
            "d2h": len(down) * TRANSFER_LATENCY_S + sum(down) / (hw.d2h_gbps * 1e9),
            "cpu_optimizer": updated / (hw.cpu_optimizer_gbps * 1e9), "nvme_read": reads / read_bps,
            "nvme_write": writes / write_bps, "nvme_stall": max(0.0, step - free), "step": step}


def _simulate(plan: Plan, accesses: list[PhaseAccess], seconds: list[float], read_bps: float,
              write_bps: float) -> float:
    hw = plan.hardware
    h2d, d2h, cpu_bps = hw.h2d_gbps * 1e9, hw.d2h_gbps * 1e9, hw.cpu_optimizer_gbps * 1e9
    size = {r.id: r.bytes for r in plan.regions}
    update = plan.chunk_bytes()
    grad = {r.chunk: r.id for r in plan.regions if r.kind == "grad"}
    by_step: list[list[PhaseAccess]] = [[] for _ in plan.steps]
    for a in accesses:
        by_step[a.step].append(a)
    c = _Clock(device_ready={r: 0.0 for r in plan.initial_resident},
               host_ready={r: 0.0 for r in plan.initial_staged})
    serial = not hw.overlap

    def stage_in(ph_drop: tuple[int, ...], alloc: tuple[int, ...], read: tuple[int, ...], at: float) -> float:
        at = max([at] + [c.write_done.get(r, 0.0) for r in ph_drop])
        for r in alloc:
            c.host_ready[r] = at
        for r in read:
            c.disk = max(c.disk, at) + staging_bytes(size[r]) / read_bps
            c.host_ready[r] = c.disk
        return at

    def write(rs: tuple[int, ...]) -> None:
        for r in rs:
            c.disk = max(c.disk, c.host_ready.get(r, 0.0)) + staging_bytes(size[r]) / write_bps
            c.write_done[r] = c.disk

    ends = []
    for _ in range(2):
        for t, step in enumerate(plan.steps):
            phases = by_step[t]
            issue = c.now if serial else c.compute
            ph = step.host[0]
            at = stage_in(ph.drop, ph.alloc, ph.nvme_read, issue)
            if serial:
                c.now = at
            for r in step.writeback:
                begin = max(c.now if serial else max(c.down, issue), c.host_ready.get(r, 0.0),
                            c.write_done.get(r, 0.0))
                done = begin + TRANSFER_LATENCY_S + size[r] / d2h
                c.now, c.down = (done, c.down) if serial else (c.now, done)
                c.host_ready[r] = c.landed[r] = done
            write(ph.nvme_write)
            for r in step.fetch:
                begin = max(c.now if serial else max(c.up, issue), c.host_ready.get(r, 0.0))
                done = begin + TRANSFER_LATENCY_S + size[r] / h2d
                c.now, c.up = (done, c.up) if serial else (c.now, done)
                c.device_ready[r] = done
            if not serial:
                start = max([issue] + [c.device_ready.get(r, 0.0) for r in step.needs])
                c.compute = start + seconds[t]
            for a in phases[1:]:
                ph = step.host[a.phase]
                at = stage_in(ph.drop, ph.alloc, ph.nvme_read, c.now if serial else issue)
                inputs = [c.host_ready.get(r, 0.0) for r in a.need] + [c.write_done.get(r, 0.0) for r in a.dirty]
                begin = max([at, c.now if serial else c.cpu, c.landed.get(grad.get(a.chunk, -1), 0.0)] + inputs)
                done = begin + update[a.chunk] / cpu_bps
                c.now, c.cpu = (done, c.cpu) if serial else (c.now, done)
                for r in a.dirty:
                    c.host_ready[r] = done
                write(ph.nvme_write)
            if serial:
                c.now += seconds[t]
        ends.append(c.now if serial else max(c.compute, c.cpu))
    return ends[1] - ends[0]
