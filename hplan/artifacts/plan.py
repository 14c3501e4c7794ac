"""The Plan artifact: a placement schedule of model-data regions that anyone can check on their own. This module
holds the Plan, its notes, its file format and its loading; the records it is made of (chunks, regions, steps,
summary) are in hplan.artifacts.plan_parts and are imported from here.

[Note: plan semantics] Parameters are grouped into *chunks* (the layout unit). Each chunk has up to four
*regions*, each with its own residency on the device and its own dirty bit: ``param`` (compute weights, frozen
ones included), ``grad`` (gradients of its trainable parameters), ``master`` (fp32 master weights, mixed
precision only) and ``state`` (optimizer per-element state). The plan is a cyclic schedule over the trace's
steady-state events; replaying it (`hplan.artifacts.replay`, the one validator every consumer runs):

- State: the resident regions and, among them, the dirty ones (newer on the device than on the host). It starts
  at ``initial_resident`` / ``initial_dirty`` and must end there, because the iteration repeats.
- Liveness: a region's *content* is live at a point when it is read before it is next overwritten. Reads are
  a step's ``reads`` and ``writes`` (read-modify-write, e.g. gradient accumulation, a GPU optimizer update)
  and what a host update reads; overwrites are a step's ``overwrites`` (a gradient's first write, the weights
  a mixed-precision GPU update writes from the master) and the weights a host update rewrites.
- At each step, in order: regions in ``evict`` leave the device (``writeback`` copies device→host first and
  must be exactly the evicted regions that are dirty with live content); ``fetch`` copies host→device; ``alloc``
  makes room without copying (only for dead content, e.g. a gradient before its first write); then the event
  runs: everything in reads/writes/overwrites is resident, written regions become dirty, and the regions of
  every chunk in ``host_updates`` (updated by the CPU optimizer on host copies) are off the device.
- A chunk in ``flips`` passes its device storage from weights to gradients inside the step (Gemini's reuse of
  the fp16 weight storage for the gradient): its param region is resident before and evicted by the step, its
  grad region is allocated by the step (overwritten), and the step's memory counts the param region only.
- Memory: resident bytes + ``non_model_bytes`` + ``hardware.slack_bytes`` ≤ ``hardware.gpu_bytes``.
- Traffic per iteration: h2d = bytes fetched, d2h = bytes written back. Allocations and flips move nothing.
- Every chunk with trainable parameters is updated exactly once per iteration: on the GPU at the optimizer step
  (``optimizer[c] == "gpu"``) or on the host at the one step listing it in ``host_updates`` ("cpu").

[Note: placement claim] ``summary.lower_bound_bytes`` (and ``summary.optimal``) bound every schedule of the
plan's chunking: with ``summary.placement_free`` over every choice of where each trainable chunk is updated,
else for the plan's own ``optimizer`` only. So that the file alone states the wider problem, ``placement``
records what the steps cannot show for the placements the plan did not take: the optimizer step's non-model
bytes when any update runs on the GPU (the update's temporaries live there) and when none does, and the
chunks whose gradient may take its weights' storage (the trace's operator order allows a flip at the step of
its first write): in fp32 only while updated on the host, in mixed precision whatever the placement. The
rest follows from the steps: a chunk updated on the GPU has, at the optimizer step, its gradient read (when
some step writes it), master and state written, and weights overwritten (mixed precision) or written (fp32); one
updated on the host is updated, all its regions off the device, right after the last step that reads its
weights or writes its gradient (at the optimizer step when ``defer_updates`` or nothing touches it). The
validator checks the optimizer step's non-model bytes against the figure for the plan's placement (a chunk
moved to the GPU by hand would otherwise run the update's temporaries over the budget) and every flip
against ``placement.flippable``. Files without ``placement`` (older plans) load and skip these checks.

[Note: host tier] A plan for a machine with a disk tier (``hardware.nvme_bytes`` set) also schedules host memory;
its steps then carry ``host`` phases (empty in a two-tier plan, which assumes every host copy always exists).
Regions resident on the device at every step are *device-only*: after setup they have no host copy. Every
other region (a *host-tier* region) is either *staged* (its host copy exists, in a page-aligned buffer of
``staging_bytes(r)`` = its bytes rounded up to ``STAGING_ALIGNMENT``, so disk transfers run O_DIRECT) or not
(its content lives in a file under the run's NVMe directory, or is dead). A region read or written in any
phase has such a file (written at setup) and its chunk is homed on "nvme"; a chunk homed on "host" never touches
the disk, so its regions are dropped only while their content is dead. Each step has phases: phase 0 holds the
step's device transfers (write-backs need a staged buffer to land in, fetches need staged content), phase j ≥ 1
the j-th host update in ``sorted(host_updates)`` (every host-tier region of that chunk staged), so the CPU
optimizer streams chunk by chunk. In each phase, in order: ``drop`` frees buffers (a pending disk write of the
region completes first); ``alloc`` stages without reading (dead content only); ``nvme_read`` stages and reads
disk→host (waited on where the content is used, so a read placed in an earlier phase is a prefetch); the
phase's host modifications happen (write-backs land, the host update runs) and make those regions host-dirty;
``nvme_write`` writes host→disk, after which the region is clean. A region whose content is live (read again
before being overwritten, by a fetch or a host update) may be dropped only while its disk file is current:
it has one, and it was written after the region's last host modification.
Host memory at a phase = staged bytes + the phase's host-update temporaries (the fp32 gradients of a
master recipe: the chunk's master bytes) ≤ ``hardware.host_bytes``. Disk traffic per iteration = staging
bytes read and written. Staging starts at ``initial_staged`` / ``initial_host_dirty`` and ends there.
The fields this adds have defaults meaning "two tiers", so the schema stays hplan.plan/2: older files load as
two-tier plans, and an older hplan refuses a file with these fields as incomplete instead of misreading it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from hplan.artifacts.activations import ActivationChoice
from hplan.artifacts.hardware import Hardware
from hplan.artifacts.io import check_schema, read_json, write_json
from hplan.artifacts.plan_parts import (
    HOMES,
    OPTIMIZER_PLACES,
    REGION_KINDS,
    STAGING_ALIGNMENT,
    BaselineResult,
    Chunk,
    HostPhase,
    PlacementRule,
    PlanSummary,
    Region,
    Step,
    host_update_effects,
    staging_bytes,
)
from hplan.artifacts.shard import Collective, Sharding
from hplan.artifacts.typed import FieldError
from hplan.errors import HplanError

# The parts (hplan.artifacts.plan_parts) are re-exported: every room imports them from here.
__all__ = ["HOMES", "OPTIMIZER_PLACES", "REGION_KINDS", "STAGING_ALIGNMENT", "BaselineResult", "Chunk", "HostPhase",
           "PlacementRule", "Plan", "PlanSummary", "Region", "Step", "host_update_effects", "staging_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    SCHEMA: ClassVar[str] = "hplan.plan/2"
    workload: str
    hardware: Hardware
    chunks: tuple[Chunk, ...]
    regions: tuple[Region, ...]
    steps: tuple[Step, ...]
    optimizer: dict[int, str]
    """Chunk id of each chunk with trainable parameters → "gpu" or "cpu": where its optimizer update runs."""
    summary: PlanSummary
    fingerprint: dict[str, Any]
    initial_resident: tuple[int, ...] = ()
    initial_dirty: tuple[int, ...] = ()
    accumulate: int = 1
    """Micro-steps per iteration (the steps repeat the forward/backward events per micro-step)."""
    defer_updates: bool = False
    """Every update waits for the optimizer step (clipping or loss scaling needs all gradients first)."""
    input_shapes: tuple[str, ...] = ()
    """Model-input signatures the plan was traced with; the executor refuses others before their forward."""
    max_grad_norm: float | None = None
    """The clipping the traced step applies (`hplan run` applies it too)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Solver options that produced the plan (chunking, solver, effort, …)."""
    baselines: tuple[BaselineResult, ...] = ()
    sharding: Sharding | None = None
    """Many-rank plans: shard factors and per-chunk element counts ([Note: shard layout]); None for one rank.
    The plan is then one rank's, for `hardware.ranks` ranks, and only a run with that many ranks may use it."""
    initial_staged: tuple[int, ...] = ()
    """Host-tier regions staged when an iteration begins (see [Note: host tier])."""
    initial_host_dirty: tuple[int, ...] = ()
    """Staged regions newer in host memory than on disk when an iteration begins."""
    activations: tuple[ActivationChoice, ...] = ()
    """Per segment call of the trace: keep, offload or recompute its saved activations ([Note: plan activations])."""
    placement: PlacementRule | None = None
    """The optimizer step's non-model bytes per placement and the flippable chunks ([Note: placement claim]);
    None in files written before it was recorded."""

    @property
    def gpu_bytes(self) -> int:
        return self.hardware.gpu_bytes

    @property
    def tiered(self) -> bool:
        """Does the plan schedule host memory (a disk tier, [Note: host tier])?"""
        return any(step.host for step in self.steps)

    def nvme_chunks(self) -> tuple[int, ...]:
        """Ids of the chunks homed on NVMe."""
        return tuple(c.id for c in self.chunks if c.home == "nvme")

    def region_map(self) -> dict[int, Region]:
        return {r.id: r for r in self.regions}

    def chunk_bytes(self) -> dict[int, int]:
        """Bytes of each chunk's regions (weights, gradient, optimizer state; 0 for a chunk with none): what a host
        update of the chunk processes, as the one-rank step-time models price it and the executor's worker policy
        reads (a many-rank update processes its optimizer piece: [Note: piece updates] in
        planner.ranks.piece_update)."""
        out = {c.id: 0 for c in self.chunks}
        for r in self.regions:
            out[r.chunk] = out.get(r.chunk, 0) + r.bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hardware"] = self.hardware.to_dict()
        data["optimizer"] = {str(k): v for k, v in sorted(self.optimizer.items())}
        for choice in data["activations"]:  # written only where set: a plan without stages reads as before
            if not choice["stage"]:
                del choice["stage"]
        data["schema"] = self.SCHEMA
        return data

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        regenerate = f"hplan plan TRACE.parquet --gpu-mem SIZE -o {path}"
        obj = read_json(path, what="plan", regenerate=regenerate)
        check_schema(obj, expected=cls.SCHEMA, path=path, what="plan", regenerate=regenerate)
        try:
            return cls.from_dict(obj)
        except FieldError as exc:
            raise HplanError(f"{path} is not a valid plan: field {exc.path}: {exc.problem}; regenerate it with "
                             "`hplan plan`") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HplanError(f"{path} is an incomplete plan ({type(exc).__name__}: {exc}); regenerate it with "
                             "`hplan plan`") from None

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Plan:
        def ints(xs: Any) -> tuple[int, ...]:
            return tuple(_int(x) for x in xs)

        lists = ("reads", "writes", "overwrites", "evict", "writeback", "fetch", "alloc", "flips", "host_updates")
        phase_lists = ("drop", "alloc", "nvme_read", "nvme_write")

        def phases(xs: Any) -> tuple[HostPhase, ...]:
            return tuple(HostPhase(**{k: ints(p.get(k, ())) for k in phase_lists}) for p in xs)

        steps = tuple(Step(**{**s, **{k: ints(s.get(k, ())) for k in lists}, "host": phases(s.get("host", ())),
                              "collectives": tuple(Collective(**c) for c in s.get("collectives", ()))})
                      for s in obj["steps"])
        return cls(
            workload=obj["workload"],
            hardware=Hardware.from_dict(obj["hardware"]),
            chunks=tuple(Chunk(**{**c, "tensors": tuple(c["tensors"]), "trainable": tuple(c["trainable"])})
                         for c in obj["chunks"]),
            regions=tuple(Region(**r) for r in obj["regions"]),
            steps=steps,
            optimizer={_int(k): v for k, v in obj["optimizer"].items()},
            summary=PlanSummary(**obj["summary"]),
            fingerprint=obj["fingerprint"],
            initial_resident=ints(obj.get("initial_resident", ())),
            initial_dirty=ints(obj.get("initial_dirty", ())),
            accumulate=_int(obj.get("accumulate", 1)),
            defer_updates=bool(obj.get("defer_updates", False)),
            input_shapes=tuple(obj.get("input_shapes", ())),
            max_grad_norm=obj.get("max_grad_norm"),
            options=obj.get("options", {}),
            baselines=tuple(BaselineResult(**{**b, "not_modelled": tuple(b.get("not_modelled", ()))})
                            for b in obj.get("baselines", ())),
            sharding=Sharding.from_dict(obj["sharding"]) if obj.get("sharding") else None,
            initial_staged=ints(obj.get("initial_staged", ())),
            initial_host_dirty=ints(obj.get("initial_host_dirty", ())),
            activations=tuple(ActivationChoice.from_dict(a, path=f"activations[{i}]")
                              for i, a in enumerate(_list(obj.get("activations", ()), "activations"))),
            placement=_placement(obj.get("placement")),
        )


def _placement(obj: Any) -> PlacementRule | None:
    if obj is None:
        return None
    return PlacementRule(gpu_non_model_bytes=_int(obj["gpu_non_model_bytes"]),
                         host_non_model_bytes=_int(obj["host_non_model_bytes"]),
                         flippable=tuple(_int(c) for c in obj.get("flippable", ())))


def _list(x: Any, what: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(x, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {type(x).__name__}")
    return x


def _int(x: Any) -> int:
    """An integer field: JSON numbers that are whole (ids, bytes) only, never bools or floats like 1.5."""
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        if isinstance(x, float) and x.is_integer():
            return int(x)
        raise ValueError(f"expected an integer, got {x!r}")
    return int(x)
