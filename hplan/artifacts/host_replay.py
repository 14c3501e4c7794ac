"""Replay the host tier of a plan ([Note: host tier] in hplan.artifacts.plan): staging, disk traffic, host memory.

Torch-free, and shared like `hplan.artifacts.replay` (which calls `replay_host` for every tiered plan): the
planner builds its host-tier problem from `phase_accesses`, so planner, validator and executor read a plan's
host tier the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hplan.artifacts.plan import Plan, host_update_effects, staging_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseAccess:
    """What one phase does to host copies: phase 0 of a step is its device transfers, phase j ≥ 1 its j-th
    host update (chunk `chunk`)."""

    step: int
    phase: int
    chunk: int
    """The host-updated chunk (-1 in phase 0)."""
    need: frozenset[int]
    """Host-tier regions that must be staged during the phase."""
    use: frozenset[int]
    """Regions whose host content the phase reads (a device fetch, a host update's inputs)."""
    define: frozenset[int]
    """Regions whose host content the phase overwrites without reading it (a write-back, weights a master
    recipe's host update rewrites)."""
    dirty: frozenset[int]
    """Regions the phase modifies in host memory (they must reach the disk before a drop while live)."""
    temp_bytes: int
    """Host-update temporaries of the phase: the fp32 gradients of a master recipe (the chunk's master bytes)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostReplay:
    violations: tuple[str, ...]
    host_bytes: tuple[int, ...]
    """Host memory for model data at each phase (staged bytes + temporaries), phases in plan order."""
    peak_bytes: int
    nvme_read_bytes: int
    nvme_write_bytes: int
    nvme_bytes_used: int
    """Disk space of the regions that move to or from disk (one file each, staging bytes)."""


def device_only(plan: Plan, resident: Sequence[Sequence[int]]) -> frozenset[int]:
    """Regions resident on the device at every step (`resident[t]`: the replayed resident set of step t)."""
    always = set(plan.initial_resident)
    for rs in resident:
        always &= set(rs)
    return frozenset(always)


def disk_regions(plan: Plan) -> frozenset[int]:
    """Regions that move to or from disk: each has a file under the run's NVMe directory, written at setup."""
    return frozenset(r for step in plan.steps for ph in step.host for r in (*ph.nvme_read, *ph.nvme_write))


def phase_accesses(plan: Plan, tier: frozenset[int]) -> list[PhaseAccess]:
    """Every phase of the plan in order, with what it does to the host-tier regions `tier`."""
    by_chunk: dict[int, dict[str, int]] = {}
    sizes = {r.id: r.bytes for r in plan.regions}
    for r in plan.regions:
        by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
    out: list[PhaseAccess] = []
    for t, step in enumerate(plan.steps):
        back = frozenset(step.writeback) & tier
        fetched = frozenset(step.fetch) & tier
        out.append(PhaseAccess(step=t, phase=0, chunk=-1, need=back | fetched, use=fetched - back, define=back,
                               dirty=back, temp_bytes=0))
        for j, c in enumerate(sorted(step.host_updates), start=1):
            regs = by_chunk.get(c, {})
            mine = frozenset(regs.values()) & tier
            master = "master" in regs
            use, define = host_update_effects(regs)  # what the update reads and overwrites: one shared rule
            dirty = {regs[k] for k in ("param", "master", "state") if k in regs}
            out.append(PhaseAccess(step=t, phase=j, chunk=c, need=mine, use=frozenset(use) & tier,
                                   define=frozenset(define) & tier, dirty=frozenset(dirty) & tier,
                                   temp_bytes=sizes[regs["master"]] if master else 0))
    return out


def phase_liveness(accesses: list[PhaseAccess], regions: Sequence[int]) -> dict[int, list[bool]]:
    """Region → per phase: is the host content entering the phase read before it is next overwritten?
    Cyclic, like `hplan.artifacts.replay.live_in`; a phase that defines a region never also reads it first."""
    n = len(accesses)
    events: dict[int, list[tuple[int, bool]]] = {r: [] for r in regions}
    for k, a in enumerate(accesses):
        for r in a.define:
            if r in events:
                events[r].append((k, False))
        for r in a.use - a.define:
            if r in events:
                events[r].append((k, True))
    live: dict[int, list[bool]] = {}
    for r, evs in events.items():
        flags: list[bool] = []
        if any(use for _, use in evs):
            evs.sort()
            for k, use in evs:
                flags.extend([use] * (k + 1 - len(flags)))
            flags.extend([evs[0][1]] * (n - len(flags)))
        else:
            flags = [False] * n
        live[r] = flags
    return live


def replay_host(plan: Plan, resident: Sequence[Sequence[int]]) -> HostReplay:
    """Walk the host phases once from the initial staging, collecting every broken rule of [Note: host tier]."""
    problems: list[str] = []
    known = {r.id for r in plan.regions}
    tier = frozenset(known - device_only(plan, resident))
    for step in plan.steps:
        if len(step.host) != 1 + len(step.host_updates):
            problems.append(f"step {step.index} ({step.event}) has {len(step.host)} host phases; a tiered plan "
                            f"has 1 + one per host update ({1 + len(step.host_updates)})")
        named = {r for ph in step.host for r in (*ph.drop, *ph.alloc, *ph.nvme_read, *ph.nvme_write)}
        if named - tier:
            problems.append(f"step {step.index} ({step.event}) stages regions {sorted(named - tier)[:5]} that are "
                            "not host-tier regions (unknown, or on the device at every step)")
    if set(plan.initial_staged) - tier or not set(plan.initial_host_dirty) <= set(plan.initial_staged):
        problems.append("initial_staged must name host-tier regions and contain initial_host_dirty")
    if problems:
        return HostReplay(violations=tuple(problems), host_bytes=(), peak_bytes=0, nvme_read_bytes=0,
                          nvme_write_bytes=0, nvme_bytes_used=0)
    home = {c.id: c.home for c in plan.chunks}
    chunk_of = {r.id: r.chunk for r in plan.regions}
    stage = {r.id: staging_bytes(r.bytes) for r in plan.regions}
    disk = disk_regions(plan)
    homeless = sorted(r for r in disk if home[chunk_of[r]] != "nvme")
    if homeless:
        problems.append(f"regions {homeless[:5]} move to or from disk but their chunks are not homed on nvme")
    accesses = phase_accesses(plan, tier)
    live = phase_liveness(accesses, sorted(tier))
    staged, dirty = set(plan.initial_staged), set(plan.initial_host_dirty)
    budget = plan.hardware.host_bytes
    held, read_total, write_total = [], 0, 0
    for k, a in enumerate(accesses):
        step = plan.steps[a.step]
        ph = step.host[a.phase]
        where = f"step {step.index} ({step.event}) phase {a.phase}" + (f" (host update of chunk {a.chunk})"
                                                                        if a.phase else "")
        if set(ph.drop) - staged:
            problems.append(f"{where}: drops regions {sorted(set(ph.drop) - staged)[:5]} that are not staged")
        lost = sorted(r for r in ph.drop if (r in dirty or r not in disk) and live[r][k])
        if lost:
            problems.append(f"{where}: drops regions {lost[:5]} whose host content is read again later but is "
                            "not on disk (modified in host memory and not written since, or never on disk)")
        staged -= set(ph.drop)
        dirty -= set(ph.drop)
        arriving = set(ph.alloc) | set(ph.nvme_read)
        if arriving & staged or set(ph.alloc) & set(ph.nvme_read):
            problems.append(f"{where}: stages regions {sorted(arriving & staged)[:5]} twice")
        dead_wrong = sorted(r for r in ph.alloc if live[r][k])
        if dead_wrong:
            problems.append(f"{where}: allocates regions {dead_wrong[:5]} whose host content is live (they must be "
                            "read from disk)")
        staged |= arriving
        read_total += sum(stage[r] for r in ph.nvme_read)
        missing = a.need - staged
        if missing:
            problems.append(f"{where}: needs regions {sorted(missing)[:5]} staged in host memory")
        now = sum(stage[r] for r in staged) + a.temp_bytes
        if budget is not None and now > budget:
            problems.append(f"{where}: holds {now} bytes of model data in host memory, budget is {budget}")
        held.append(now)
        dirty |= a.dirty & staged
        if set(ph.nvme_write) - staged:
            problems.append(f"{where}: writes regions {sorted(set(ph.nvme_write) - staged)[:5]} that are not staged")
        dirty -= set(ph.nvme_write)
        write_total += sum(stage[r] for r in ph.nvme_write)
    if staged != set(plan.initial_staged) or dirty != set(plan.initial_host_dirty):
        problems.append("the host tier is not cyclic: its end staging differs from initial_staged/initial_host_dirty")
    used = sum(stage[r] for r in disk)
    if plan.hardware.nvme_bytes is not None and used > plan.hardware.nvme_bytes:
        problems.append(f"the NVMe-homed regions take {used} bytes of disk, more than nvme_bytes "
                        f"{plan.hardware.nvme_bytes}")
    return HostReplay(violations=tuple(problems), host_bytes=tuple(held), peak_bytes=max(held, default=0),
                      nvme_read_bytes=read_total, nvme_write_bytes=write_total, nvme_bytes_used=used)
