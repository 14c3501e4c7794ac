"""Replay a plan following [Note: plan semantics]: the one validator, and the one reading of traffic and memory.

Torch-free and shared: the planner's self-check, the executor (before step 0), the reports and the tests all
read a plan through `replay`, so they cannot disagree about what a plan means or whether it is valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hplan.artifacts.activations import activation_problems
from hplan.artifacts.host_replay import HostReplay, device_only, replay_host
from hplan.artifacts.plan import HOMES, OPTIMIZER_PLACES, REGION_KINDS, Plan, host_update_effects
from hplan.artifacts.shard import shard_problems
from hplan.errors import HplanError

OPTIMIZER_EVENT = "optimizer:optimizer"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepState:
    index: int
    event: str
    resident: tuple[int, ...]
    """Region ids on the device while the event runs (after evictions, fetches and allocations)."""
    resident_bytes: int
    """Model data on the device while the event runs (a flipped chunk's gradient shares its weights' bytes)."""
    total_bytes: int
    """resident_bytes + the event's non-model bytes + the hardware's slack."""
    h2d_bytes: int
    d2h_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Replay:
    states: tuple[StepState, ...]
    violations: tuple[str, ...]
    """Every broken rule, in words; empty for a valid plan."""
    h2d_bytes: int
    d2h_bytes: int
    peak_bytes: int
    host: HostReplay | None = None
    """The host tier's replay ([Note: host tier]); None for a two-tier plan."""

    @property
    def ok(self) -> bool:
        return not self.violations


def replay(plan: Plan) -> Replay:
    """Check the plan's structure, then walk its steps once from the initial state collecting every violation."""
    problems = _structure(plan)
    if problems:
        return Replay(states=(), violations=tuple(problems), h2d_bytes=0, d2h_bytes=0, peak_bytes=0)
    regions = plan.region_map()
    size = {r.id: r.bytes for r in plan.regions}
    by_chunk: dict[int, dict[str, int]] = {}
    for r in plan.regions:
        by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
    live = live_in(plan)
    resident, dirty = set(plan.initial_resident), set(plan.initial_dirty)
    if not dirty <= resident:
        problems.append(f"initial_dirty {sorted(dirty - resident)} not in initial_resident")
    states, h2d_total, d2h_total, peak = [], 0, 0, 0
    held = sum(size[r] for r in resident)  # bytes of `resident`, kept up to date as it changes
    budget, slack = plan.hardware.gpu_bytes, plan.hardware.slack_bytes
    for t, step in enumerate(plan.steps):
        where = f"step {step.index} ({step.event})"
        evict = set(step.evict)
        if evict - resident:
            problems.append(f"{where}: evicts non-resident regions {sorted(evict - resident)}")
        must = {r for r in evict & dirty if live[r][t]}
        if set(step.writeback) != must:
            problems.append(f"{where}: writeback {sorted(step.writeback)} must be exactly the evicted regions that "
                            f"are dirty with live content {sorted(must)}")
        d2h = sum(size[r] for r in step.writeback)
        held -= sum(size[r] for r in evict & resident)
        resident -= evict
        dirty -= evict
        arriving = set(step.fetch) | set(step.alloc)
        if arriving & resident:
            problems.append(f"{where}: fetches or allocates already-resident regions {sorted(arriving & resident)}")
        if set(step.fetch) & set(step.alloc):
            problems.append(f"{where}: regions both fetched and allocated {sorted(set(step.fetch) & set(step.alloc))}")
        lost = sorted(r for r in step.alloc if live[r][t])
        if lost:
            problems.append(f"{where}: allocates regions {lost} whose content is live (they must be fetched)")
        h2d = sum(size[r] for r in step.fetch)
        held += sum(size[r] for r in arriving - resident)
        resident |= arriving
        flipped_w, flipped_g = set(), set()
        for c in step.flips:
            w, g = by_chunk.get(c, {}).get("param"), by_chunk.get(c, {}).get("grad")
            if w is None or g is None or w not in resident or g in resident or g not in step.overwrites:
                problems.append(f"{where}: flip of chunk {c} needs its weights resident and its gradient overwritten "
                                "here and not yet resident")
                continue
            if live[w][(t + 1) % len(plan.steps)] and w in dirty:
                problems.append(f"{where}: flip of chunk {c} discards weights that are dirty and still live")
            flipped_w.add(w)
            flipped_g.add(g)
        missing = set(step.needs) - resident - flipped_g
        if missing:
            problems.append(f"{where}: needs regions {sorted(missing)} that are not resident")
        for c in step.host_updates:
            on = sorted(set(by_chunk.get(c, {}).values()) & resident)
            if on:
                problems.append(f"{where}: chunk {c} is updated on the host while regions {on} are on the device")
        resident_bytes = held
        total = resident_bytes + step.non_model_bytes + step.gathered_bytes + slack
        if total > budget:
            problems.append(f"{where}: needs {total} bytes, budget is {budget}")
        peak = max(peak, total)
        states.append(StepState(index=step.index, event=step.event, resident=tuple(sorted(resident)),
                                resident_bytes=resident_bytes, total_bytes=total, h2d_bytes=h2d, d2h_bytes=d2h))
        held -= sum(size[r] for r in resident & flipped_w)
        resident -= flipped_w
        held += sum(size[r] for r in flipped_g - resident)
        resident |= flipped_g
        dirty -= flipped_w
        dirty |= (set(step.writes) | set(step.overwrites)) & resident
        h2d_total, d2h_total = h2d_total + h2d, d2h_total + d2h
    if resident != set(plan.initial_resident) or dirty != set(plan.initial_dirty):
        problems.append("the schedule is not cyclic: its end state differs from initial_resident/initial_dirty")
    problems += shard_problems(plan)  # many ranks: factors, shard sizes, collectives (hplan.artifacts.shard)
    problems += activation_problems(plan)  # keep / offload / recompute ([Note: plan activations])
    del regions
    host = replay_host(plan, [s.resident for s in states]) if plan.tiered and not problems else None
    problems += host.violations if host is not None else []
    return Replay(states=tuple(states), violations=tuple(problems), h2d_bytes=h2d_total, d2h_bytes=d2h_total,
                  peak_bytes=peak, host=host)


def live_in(plan: Plan) -> dict[int, list[bool]]:
    """Region → per step: is the content present when step t begins read before it is next overwritten?

    Cyclic backward analysis: the content entering step t is live iff the region's next use-or-overwrite at or
    after t (wrapping to the iteration's start) is a use; a region never used is never live. Each region walks
    its own events only, so this is linear in the plan's size."""
    uses, defs = _uses_defs(plan)
    n = len(plan.steps)
    events: dict[int, list[tuple[int, bool]]] = {reg.id: [] for reg in plan.regions}
    for t in range(n):
        for r in uses[t]:
            events[r].append((t, True))
        for r in defs[t]:
            events[r].append((t, False))
    live: dict[int, list[bool]] = {}
    for r, evs in events.items():
        flags: list[bool] = []
        if any(use for _, use in evs):
            evs.sort()
            for t, use in evs:
                flags.extend([use] * (t + 1 - len(flags)))
            flags.extend([evs[0][1]] * (n - len(flags)))
        else:
            flags = [False] * n
        live[r] = flags
    return live


def _uses_defs(plan: Plan) -> tuple[list[set[int]], list[set[int]]]:
    """Per step, the regions whose content is read, and those overwritten without being read (device or host)."""
    by_chunk: dict[int, dict[str, int]] = {}
    for r in plan.regions:
        by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
    uses, defs = [], []
    for step in plan.steps:
        use, define = set(step.reads) | set(step.writes), set(step.overwrites) - set(step.reads) - set(step.writes)
        for c in step.host_updates:
            read, overwritten = host_update_effects(by_chunk.get(c, {}))
            use.update(read)
            define.update(overwritten)
        uses.append(use)
        defs.append(define - use)
    return uses, defs


def _structure(plan: Plan) -> list[str]:
    """Ids that exist, kinds and numbers that make sense, one update per trainable chunk per iteration."""
    problems: list[str] = []
    chunks = {c.id: c for c in plan.chunks}
    ids = [r.id for r in plan.regions]
    if len(set(ids)) != len(ids) or len(chunks) != len(plan.chunks):
        problems.append("region or chunk ids repeat")
    for r in plan.regions:
        if r.kind not in REGION_KINDS or r.chunk not in chunks or not _count(r.bytes):
            problems.append(f"region {r.id} is malformed (kind {r.kind!r}, chunk {r.chunk}, bytes {r.bytes!r})")
    for c in plan.chunks:
        if c.home not in HOMES or not set(c.trainable) <= set(c.tensors):
            problems.append(f"chunk {c.id} is malformed (home {c.home!r}, or trainable not a subset of tensors)")
    known = set(ids)
    for step in plan.steps:
        listed = {*step.reads, *step.writes, *step.overwrites, *step.evict, *step.writeback, *step.fetch, *step.alloc}
        if listed - known or {*step.flips, *step.host_updates} - set(chunks):
            problems.append(f"step {step.index} ({step.event}) names regions or chunks that do not exist")
        if not _count(step.non_model_bytes):
            problems.append(f"step {step.index} has non_model_bytes {step.non_model_bytes!r}; it must be a "
                            "non-negative integer")
    if {*plan.initial_resident, *plan.initial_dirty} - known:
        problems.append("initial_resident/initial_dirty name regions that do not exist")
    trainable = {c.id for c in plan.chunks if c.trainable}
    if set(plan.optimizer) != trainable or not set(plan.optimizer.values()) <= set(OPTIMIZER_PLACES):
        problems.append("optimizer must map every chunk with trainable parameters to 'gpu' or 'cpu'")
    hosts = [c for s in plan.steps for c in s.host_updates]
    for c, where in plan.optimizer.items():
        count = hosts.count(c)
        if (where == "cpu" and count != 1) or (where == "gpu" and count):
            problems.append(f"chunk {c} is updated on the host {count} times per iteration; plan.optimizer says "
                            f"{where!r} (cpu: exactly once, gpu: never)")
    problems += _gpu_updates(plan)
    problems += _placement_rule(plan)
    hw = plan.hardware
    if hw.gpu_bytes <= 0 or not all(math.isfinite(x) for x in (plan.summary.predicted_step_seconds, plan.summary.gap)):
        problems.append("the plan's budget or summary numbers are not finite and positive")
    return problems


def _gpu_updates(plan: Plan) -> list[str]:
    """A GPU-updated chunk's update happens at the optimizer step, which must touch its regions that way."""
    opt = [s for s in plan.steps if s.event == OPTIMIZER_EVENT]
    gpu = [c for c, where in plan.optimizer.items() if where == "gpu"]
    if not gpu:
        return []
    if len(opt) != 1:
        return [f"the plan updates chunks {gpu[:3]} on the GPU but has {len(opt)} optimizer steps (needs one)"]
    step, problems = opt[0], []
    by_chunk: dict[int, dict[str, int]] = {}
    for r in plan.regions:
        by_chunk.setdefault(r.chunk, {})[r.kind] = r.id
    touched = set(step.writes) | set(step.overwrites)
    for c in gpu:
        regions = by_chunk.get(c, {})
        needed = {regions[k] for k in ("param", "master", "state") if k in regions}
        if not needed <= touched:
            problems.append(f"chunk {c} is updated on the GPU but the optimizer step does not write its regions "
                            f"{sorted(needed - touched)}")
    return problems


def _placement_rule(plan: Plan) -> list[str]:
    """The optimizer step holds the non-model bytes the plan's placement implies, and only flippable chunks flip
    ([Note: placement claim])."""
    rule = plan.placement
    if rule is None:
        return []
    if not (_count(rule.gpu_non_model_bytes) and _count(rule.host_non_model_bytes)):
        return ["placement: the optimizer step's non-model figures must be non-negative integers"]
    problems = []
    if set(rule.flippable) - {c.id for c in plan.chunks}:
        problems.append("placement.flippable names chunks that do not exist")
    flipped = sorted({c for s in plan.steps for c in s.flips} - set(rule.flippable))
    if flipped:
        problems.append(f"chunks {flipped[:3]} flip but placement.flippable does not allow it")
    gpu = sorted(c for c, where in plan.optimizer.items() if where == "gpu")
    expected = rule.gpu_non_model_bytes if gpu else rule.host_non_model_bytes
    for step in plan.steps:
        if step.event == OPTIMIZER_EVENT and step.non_model_bytes != expected:
            words = f"chunks {gpu[:3]} are updated on the GPU" if gpu else "every chunk is updated on the host"
            problems.append(f"step {step.index} ({step.event}) holds {step.non_model_bytes} non-model bytes, but "
                            f"{words}, where the plan's placement rule says {expected}")
    return problems


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def validate(plan: Plan) -> None:
    """Raise HplanError naming the first broken rule of [Note: plan semantics]; checks the summary's traffic too.
    Every consumer of a plan (run, attach, plot, report, export) calls this before using it."""
    if not plan.summary.feasible:
        raise HplanError(f"the plan is infeasible ({plan.summary.bottleneck}); plan for a larger `gpu_bytes`")
    rep = replay(plan)
    problems = list(rep.violations)
    if rep.ok and (rep.h2d_bytes, rep.d2h_bytes) != (plan.summary.h2d_bytes, plan.summary.d2h_bytes):
        problems.append(f"summary says {plan.summary.h2d_bytes}/{plan.summary.d2h_bytes} bytes h2d/d2h, "
                        f"replay moves {rep.h2d_bytes}/{rep.d2h_bytes}")
    disk = (rep.host.nvme_read_bytes, rep.host.nvme_write_bytes) if rep.host is not None else (0, 0)
    if rep.ok and disk != (plan.summary.nvme_read_bytes, plan.summary.nvme_write_bytes):
        problems.append(f"summary says {plan.summary.nvme_read_bytes}/{plan.summary.nvme_write_bytes} bytes disk "
                        f"read/write, replay moves {disk[0]}/{disk[1]}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise HplanError(f"invalid plan: {problems[0]}{more}; regenerate it with `hplan plan`")


def homes_of(plan: Plan) -> dict[str, int]:
    """Bytes of model data by where it lives between uses: "gpu-only" (resident on the device at every step),
    "host" (regions of host-homed chunks) and "nvme" (regions of NVMe-homed chunks); for summaries and plots."""
    only = device_only(plan, [s.resident for s in replay(plan).states])
    home = {c.id: c.home for c in plan.chunks}
    out = {"gpu-only": 0, "host": 0, "nvme": 0}
    for r in plan.regions:
        out["gpu-only" if r.id in only else home[r.chunk]] += r.bytes
    return out
