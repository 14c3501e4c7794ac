"""The Budget and Plan artifacts: a placement schedule anyone can check on their own.

[Note: plan semantics] The plan is a cyclic schedule over the trace's steady-state
events. Replaying it (see ``hplan.planner.validate``) works like this:

- State: the set of chunks resident on the GPU and, among them, the dirty ones
  (modified on the GPU since they were fetched). It starts at ``initial_resident``
  / ``initial_dirty`` and must end there, because the iteration repeats.
- At each step, in order: chunks in ``evict`` leave the GPU (each in ``writeback``
  is copied device→host first; exactly the dirty ones must be listed there); then
  chunks in ``fetch`` are copied host→device (clean); then the event runs: every
  chunk in ``needs`` must be resident, every chunk in ``writes`` becomes dirty,
  and every chunk in ``host_updates`` must *not* be resident (its optimizer update
  runs on the CPU, on the host copy).
- Memory after the fetches: resident chunk bytes + ``non_model_bytes`` +
  ``budget.slack_bytes`` must be at most ``budget.gpu_bytes``.
- Traffic per iteration: h2d = bytes fetched, d2h = bytes written back.

Chunks of kind ``param`` hold compute parameters and their gradients; chunks of
kind ``optim`` hold the fp32 master copy (mixed precision) and optimizer moments.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from hplan.artifacts.io import check_schema, read_json, write_json
from hplan.errors import HplanError

CHUNK_KINDS: tuple[str, ...] = ("param", "optim")
OPTIMIZER_PLACES: tuple[str, ...] = ("gpu", "cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    """What the plan may use."""

    SCHEMA: ClassVar[str] = "hplan.budget/1"
    gpu_bytes: int
    """Device memory the plan may use, allocator slack included."""
    cpu_bytes: int | None = None
    """Host memory for offloaded data; None means unbounded."""
    slack_bytes: int = 0
    """Reserved for allocator fragmentation and non-framework overhead (CUDA context)."""

    def __post_init__(self) -> None:
        if self.gpu_bytes <= 0:
            raise HplanError(f"gpu memory must be positive, got {self.gpu_bytes} bytes")
        if self.cpu_bytes is not None and self.cpu_bytes <= 0:
            raise HplanError(f"cpu memory must be positive, got {self.cpu_bytes} bytes")
        if self.slack_bytes < 0:
            raise HplanError(f"slack must not be negative, got {self.slack_bytes} bytes")


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    id: int
    bytes: int
    kind: str
    """"param" (compute parameters + gradients) or "optim" (master weights + moments)."""
    tensors: tuple[str, ...]
    """Parameter names whose data of this kind lives in the chunk, in layout order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    index: int
    event: str
    """The trace event's key, e.g. "forward:h.0.attn.c_attn"."""
    needs: tuple[int, ...]
    writes: tuple[int, ...]
    non_model_bytes: int
    evict: tuple[int, ...] = ()
    fetch: tuple[int, ...] = ()
    writeback: tuple[int, ...] = ()
    host_updates: tuple[int, ...] = ()


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
    """(bytes moved - lower bound) / max(bytes moved, 1)."""
    bottleneck: str = ""
    """When infeasible or tight: the event that sets min_gpu_bytes, in words."""


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    SCHEMA: ClassVar[str] = "hplan.plan/1"
    workload: str
    budget: Budget
    chunks: tuple[Chunk, ...]
    steps: tuple[Step, ...]
    optimizer: dict[int, str]
    """Chunk id of each param chunk → "gpu" or "cpu": where its optimizer update runs."""
    summary: PlanSummary
    fingerprint: dict[str, Any]
    initial_resident: tuple[int, ...] = ()
    initial_dirty: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    """Solver options that produced the plan (chunk size, bandwidths, …)."""
    baselines: tuple[BaselineResult, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["optimizer"] = {str(k): v for k, v in sorted(self.optimizer.items())}
        data["schema"] = self.SCHEMA
        return data

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        obj = read_json(path, what="plan")
        check_schema(obj, expected=cls.SCHEMA, path=path, what="plan")
        try:
            return cls.from_dict(obj)
        except (KeyError, TypeError, ValueError) as exc:
            raise HplanError(f"{path} is an incomplete plan ({exc}); regenerate it with `hplan plan`") from None

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Plan:
        def ints(xs: Any) -> tuple[int, ...]:
            return tuple(int(x) for x in xs)

        steps = tuple(
            Step(**{**s, **{k: ints(s.get(k, ())) for k in
                            ("needs", "writes", "evict", "fetch", "writeback", "host_updates")}})
            for s in obj["steps"]
        )
        return cls(
            workload=obj["workload"],
            budget=Budget(**obj["budget"]),
            chunks=tuple(Chunk(**{**c, "tensors": tuple(c["tensors"])}) for c in obj["chunks"]),
            steps=steps,
            optimizer={int(k): v for k, v in obj["optimizer"].items()},
            summary=PlanSummary(**obj["summary"]),
            fingerprint=obj["fingerprint"],
            initial_resident=ints(obj.get("initial_resident", ())),
            initial_dirty=ints(obj.get("initial_dirty", ())),
            options=obj.get("options", {}),
            baselines=tuple(BaselineResult(**{**b, "not_modelled": tuple(b.get("not_modelled", ()))})
                            for b in obj.get("baselines", ())),
        )
