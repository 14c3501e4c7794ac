"""The records a Plan is made of: its chunks and their regions, its steps (with their host-tier phases), its
summary, the placement rule and the baselines it is compared with, and the two rules the planner and the
validator share (`staging_bytes`, `host_update_effects`). Their meaning is the plan's: [Note: plan semantics],
[Note: placement claim] and [Note: host tier] in hplan.artifacts.plan. That module holds the Plan itself, its
file format and its loading (and re-exports these names); the parts live here so that the artifact's notes and
its load-time checks read in one short file, apart from the field lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hplan.artifacts.shard import Collective

REGION_KINDS: tuple[str, ...] = ("param", "grad", "master", "state")
OPTIMIZER_PLACES: tuple[str, ...] = ("gpu", "cpu")
HOMES: tuple[str, ...] = ("host", "nvme")
STAGING_ALIGNMENT = 4096
"""Bytes: host staging buffers and disk transfers are whole multiples of this (O_DIRECT's granularity)."""


def staging_bytes(nbytes: int) -> int:
    """Host bytes a staged region occupies and disk bytes one transfer of it moves (see [Note: host tier])."""
    return -(-nbytes // STAGING_ALIGNMENT) * STAGING_ALIGNMENT


def host_update_effects(regions: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a host (CPU) optimizer update of a chunk does to its regions' contents, as (read, overwritten):
    it reads the gradient, master and state and updates the last two in place; the weights are rewritten from
    the master with a mixed-precision recipe (overwritten), or updated in place without one (read). The planner
    and the validator both take this rule from here."""
    read = [regions[k] for k in ("grad", "master", "state") if k in regions]
    overwritten = []
    if "param" in regions:
        (overwritten if "master" in regions else read).append(regions["param"])
    return tuple(read), tuple(overwritten)


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """Parameters laid out together; every region of the chunk follows this order."""

    id: int
    tensors: tuple[str, ...]
    """Parameter names (canonical), in layout order."""
    trainable: tuple[str, ...]
    """The trainable subset of `tensors` (same order): they alone have gradient, master and state regions."""
    dtype: str
    """Compute dtype of the weights and gradients."""
    home: str = "host"
    """Where the chunk's regions live when off the device: "host", or "nvme" (read through host staging)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    id: int
    chunk: int
    kind: str
    """"param", "grad", "master" or "state" (see [Note: plan semantics])."""
    bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class HostPhase:
    """Host-tier actions of one phase of a step, as region ids (see [Note: host tier])."""

    drop: tuple[int, ...] = ()
    """Staging buffers freed first (each after its pending disk write completes)."""
    alloc: tuple[int, ...] = ()
    """Buffers staged without reading: their content is dead (e.g. a write-back lands in it)."""
    nvme_read: tuple[int, ...] = ()
    """Buffers staged and filled from disk; the read is waited on where the content is first used."""
    nvme_write: tuple[int, ...] = ()
    """Disk writes issued after this phase's host modifications; they clean the region."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    index: int
    event: str
    """The trace event's key, e.g. "forward:h.0.attn.c_attn"."""
    non_model_bytes: int
    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    overwrites: tuple[int, ...] = ()
    evict: tuple[int, ...] = ()
    writeback: tuple[int, ...] = ()
    fetch: tuple[int, ...] = ()
    alloc: tuple[int, ...] = ()
    flips: tuple[int, ...] = ()
    """Chunk ids whose weights' device storage is reused for their gradients during this step."""
    host_updates: tuple[int, ...] = ()
    """Chunk ids the CPU optimizer updates at this step, on host copies."""
    collectives: tuple[Collective, ...] = ()
    """Many-rank plans: the calls of this step, in order ([Note: plan collectives] in hplan.artifacts.shard)."""
    gathered_bytes: int = 0
    """Many-rank plans: transient device bytes beside the regions (full weight copies, full gradients, staging)."""
    host: tuple[HostPhase, ...] = ()
    """Host-tier phases (see [Note: host tier]): empty in a two-tier plan, else 1 + len(host_updates)."""
    kept_non_model_bytes: int | None = None
    """Non-model bytes with every segment's activations kept; `non_model_bytes` adds the activation choices'
    effects ([Note: plan activations]). None: the plan makes no activation choice."""

    @property
    def needs(self) -> tuple[int, ...]:
        """Regions the event touches on the device."""
        return tuple(sorted({*self.reads, *self.writes, *self.overwrites}))


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    feasible: bool
    h2d_bytes: int
    d2h_bytes: int
    bytes_moved_per_iter: int
    lower_bound_bytes: int
    predicted_peak_bytes: int
    min_gpu_bytes: int
    predicted_step_seconds: float
    solver: str
    gap: float = 0.0
    """(bytes moved - lower bound) / max(bytes moved, 1): how far from proven optimal."""
    optimal: bool = False
    """True when the solver proved the schedule optimal for this chunking: over every optimizer placement when
    `placement_free`, else for the plan's own ([Note: placement claim])."""
    bottleneck: str = ""
    """When infeasible or tight: the event that sets min_gpu_bytes, in words."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Predicted time split: compute, h2d, d2h (busy link seconds), cpu_optimizer, and — for plans that defer
    updates (clipping, loss scaling) — deferred: the estimated step time lost because host updates can no
    longer overlap the backward pass (hplan.planner.core.deferral_seconds); many-rank plans add all_gather,
    reduce_scatter and all_reduce (busy network seconds); with a disk tier also nvme_read, nvme_write (busy disk
    seconds) and nvme_stall (step time added by waiting on disk)."""
    collective_bytes_per_rank: int = 0
    """Many-rank plans: bytes each rank sends per iteration in its collectives (ring model; it receives as many)."""
    shard: dict[str, int] = field(default_factory=dict)
    """Many-rank plans: the shard factors, {"P": k, "G": k, "OS": k}; empty for one rank."""
    nvme_read_bytes: int = 0
    """Disk→host bytes per iteration ([Note: host tier]); 0 in a two-tier plan."""
    nvme_write_bytes: int = 0
    """Host→disk bytes per iteration."""
    min_cpu_bytes: int = 0
    """Smallest host budget (--cpu-mem) any staging of this GPU schedule fits (0: not computed, two tiers)."""
    predicted_host_peak_bytes: int = 0
    """Highest host memory for model data at any phase: staged bytes + host-update temporaries."""
    nvme_bytes_used: int = 0
    """Disk space the NVMe-homed regions take (one file each, staging bytes)."""
    activation_bytes_moved_per_iter: int = 0
    """Saved activations moved per iteration by offloaded segments, both directions ([Note: plan activations])."""
    recompute_seconds: float = 0.0
    """Predicted time per iteration of the recomputed segments' forwards and the selective calls' cheap ops (part
    of the predicted compute: [Note: selective priced in the step] in hplan.planner.activations)."""
    placement_free: bool = False
    """The lower bound covers every optimizer placement of the chunking, not only the plan's own."""
    activation_cost_bytes: int = 0
    """The activation choices' part of auto's objective in link bytes ([Note: auto activations]: offloaded bytes
    both ways + recompute seconds at the host→device bandwidth), for every `--activations` (0 in files written
    before forced plans reported it). Under auto `lower_bound_bytes` and `gap` bound `bytes_moved_per_iter` + this;
    for a forced choice they bound `bytes_moved_per_iter` (this is fixed by its choices)."""
    activations_free: bool = False
    """The lower bound covers every activation choice per segment, not only the plan's own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementRule:
    """What the placement claim needs beyond the steps (see [Note: placement claim])."""

    gpu_non_model_bytes: int
    """Non-model bytes of the optimizer step when any chunk is updated on the GPU."""
    host_non_model_bytes: int
    """Non-model bytes of the optimizer step when every chunk is updated on the host."""
    flippable: tuple[int, ...] = ()
    """Chunks whose gradient may take its weights' storage at its first write (fp32: while host-updated)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselineResult:
    """Another system simulated as its code runs, on the same trace and hardware (see hplan.planner.baselines).

    Fields added after hplan.plan/1 first shipped have defaults, so older plan files still load."""

    name: str
    feasible: bool
    """The system's own rule holds at every event (its cap, or the device memory minus the hardware's slack)."""
    bytes_moved_per_iter: int
    """h2d_bytes + d2h_bytes."""
    predicted_step_seconds: float
    predicted_peak_bytes: int
    """Highest device bytes at any event: its model data, its own buffers and transients, non-model data."""
    note: str = ""
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    min_gpu_bytes: int = 0
    """Smallest device memory at which the same rule holds (0: not reported)."""
    h2d_seconds: float = 0.0
    """Busy time of the host-to-device link (links are full duplex: each direction has its own)."""
    d2h_seconds: float = 0.0
    compute_seconds: float = 0.0
    """GPU compute at the hardware's efficiency."""
    cpu_optimizer_seconds: float = 0.0
    citation: str = ""
    """The source files (repository, commit, path:lines) the simulation follows."""
    not_modelled: tuple[str, ...] = ()
