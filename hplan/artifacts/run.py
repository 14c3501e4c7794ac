"""The RunReport artifact: what a training run on a plan measured."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from hplan.artifacts.io import check_schema, read_json, write_json
from hplan.artifacts.typed import FieldError, typed
from hplan.errors import HplanError

RANK_FIELDS: tuple[str, ...] = (
    "rank", "peak_resident_bytes", "bytes_moved_per_iter", "h2d_bytes_per_iter", "d2h_bytes_per_iter",
    "collective_bytes_per_iter", "collective_wire_bytes_per_iter", "planned_collective_bytes_per_iter",
    "planned_bytes_moved_per_iter", "budget_bytes",
)
"""The keys of each `RunReport.ranks` entry (hplan.executor.ranks.dist_train.report), every one a non-negative int."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunReport:
    """Measured, never copied from the plan: the executor's probe and counters fill it."""

    SCHEMA: ClassVar[str] = "hplan.run/1"
    workload: str
    device: str
    steps: int
    """Steps run in this invocation (after a resume: the new ones)."""
    first_step: int
    """Global index of the first step run here (0, or the resumed step)."""
    losses: tuple[float | None, ...]
    """The loss of each step (the mean over its micro-batches, and over ranks); None for a step whose loss was not
    finite, which only `nonfinite="skip"` trains past (JSON has no NaN)."""
    step_seconds: tuple[float, ...]
    peak_resident_bytes: int
    """Highest fast-tier bytes (model + non-model) the probe saw in any step."""
    budget_bytes: int
    bytes_moved_per_iter: int
    """Measured h2d + d2h bytes of a steady-state step."""
    planned_bytes_moved_per_iter: int
    h2d_bytes_per_iter: int
    d2h_bytes_per_iter: int
    setup_bytes: int = 0
    """Bytes moved once before the first step to reach the plan's initial residency."""
    metrics_path: str | None = None
    world_size: int = 1
    """Ranks that trained (a many-rank plan's `hardware.ranks`); 1 for one process."""
    planned_collective_bytes_per_iter: int = 0
    """Many ranks: the plan's collective bytes sent per rank per iteration (ring model)."""
    ranks: tuple[dict[str, int], ...] = ()
    """Many ranks: one entry per rank, measured on that rank — peak_resident_bytes, bytes_moved_per_iter (h2d +
    d2h, also split), collective_bytes_per_iter (ring-model bytes of the calls it made),
    collective_wire_bytes_per_iter (socket bytes written meanwhile, gloo on Linux) — beside the plan's
    planned_collective_bytes_per_iter, planned_bytes_moved_per_iter and budget_bytes. The top-level transfer
    fields are rank 0's; peak_resident_bytes is the highest of any rank."""
    peak_host_model_bytes: int = 0
    """Highest host memory holding model data at any phase (staging buffers, measured as a running sum of
    allocations; 0 for a two-tier plan, which keeps every host copy)."""
    planned_peak_host_model_bytes: int = 0
    host_budget_bytes: int = 0
    """The plan's --cpu-mem (0: unbounded)."""
    nvme_read_bytes_per_iter: int = 0
    """Disk→host bytes the last iteration issued (every one completed and checksum-verified before use)."""
    nvme_write_bytes_per_iter: int = 0
    planned_nvme_read_bytes_per_iter: int = 0
    planned_nvme_write_bytes_per_iter: int = 0
    peak_rss_bytes: int = 0
    """The process's resident memory, sampled at every host phase (a cross-check that sees everything)."""
    peak_rss_staging_bytes: int = 0
    """The resident pages of the staging buffers as the OS counts them (Linux RssShmem), at the same samples."""
    peak_host_outside_steps_bytes: int = 0
    """Staging bytes while NVMe-homed state was read outside the plan's steps (a checkpoint save, the model handed
    back at the end): the plan's between-step staging plus at most one chunk's regions; --cpu-mem covers the
    steps only (README, "Third tier: NVMe")."""
    nvme_read_gbps: float = 0.0
    """Achieved disk read bandwidth during the steps: bytes / seconds with a read in flight (GB/s)."""
    nvme_write_gbps: float = 0.0
    nvme_read_bytes: int = 0
    """Disk bytes read during the steps, all of them (completed transfers)."""
    nvme_write_bytes: int = 0
    nvme_busy_seconds: float = 0.0
    """Seconds during the steps with any disk transfer in flight (reads and writes share the disk)."""
    activation_bytes_moved_per_iter: int = 0
    """Saved activations the last iteration copied to host memory and back (offloaded segments), both directions."""
    planned_activation_bytes_moved_per_iter: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "schema": self.SCHEMA}

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunReport:
        """A run report (`hplan run --json` output, `hplan demo`'s run.json) read back: every field typed as its
        annotation says ([Note: typed artifact fields]: integers non-negative, seconds finite and non-negative,
        losses finite of either sign), then the counts that tie fields together; one HplanError naming the field
        otherwise."""
        obj = read_json(path, what="run report")
        regenerate = "hplan run SPEC --plan PLAN --steps N --json > FILE"
        check_schema(obj, expected=cls.SCHEMA, path=path, what="run report", regenerate=regenerate)
        try:
            report = typed(cls, obj, minimum={"losses": -(2**63)}, skip=frozenset({"schema"}))
            report.check()
        except FieldError as exc:
            raise HplanError(f"{path} is not a valid run report: field {exc.path}: {exc.problem}; regenerate it with "
                             f"`{regenerate}`") from None
        return report

    def check(self) -> None:
        """The rules between fields, as FieldError: one loss and one time per step, and one entry per rank (with
        exactly the keys hplan writes, in rank order) for a many-rank run (a world of one has none, or one for a
        sharded plan run on one rank)."""
        for name in ("losses", "step_seconds"):
            if len(getattr(self, name)) != self.steps:
                raise FieldError(name, f"holds {len(getattr(self, name))} values for {self.steps} steps")
        if self.world_size < 1:
            raise FieldError("world_size", f"must be at least 1, got {self.world_size}")
        allowed = (self.world_size,) if self.world_size > 1 else (0, 1)
        if len(self.ranks) not in allowed:
            raise FieldError("ranks", f"holds {len(self.ranks)} entries for a world of {self.world_size}")
        for i, entry in enumerate(self.ranks):
            if set(entry) != set(RANK_FIELDS):
                odd = sorted(set(entry) ^ set(RANK_FIELDS))[0]
                raise FieldError(f"ranks[{i}].{odd}", "unknown" if odd in entry else "missing")
            if entry["rank"] != i:
                raise FieldError(f"ranks[{i}].rank", f"is {entry['rank']}, expected {i} (entries in rank order)")


METRICS_COLUMNS: tuple[str, ...] = (
    "step", "event_index", "event", "resident_bytes", "model_resident_bytes",
    "h2d_bytes", "d2h_bytes", "loss", "step_seconds",
)
"""Columns of `hplan run --metrics OUT.parquet`: one row per (step, event) of the plan.
`resident_bytes` is the fast-tier total (model + non-model) the probe measured in the
event's window (its peak); `model_resident_bytes` the chunk storage resident then; the
transfer columns count bytes copied at that event; `loss` and `step_seconds` repeat per step."""
