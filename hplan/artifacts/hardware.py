"""The Hardware artifact: the machine a plan targets, as data (tiers, links, compute, world).

[Note: hardware is data] Everything the planner needs to know about a machine lives here: how many bytes each
tier may hold for this plan, how fast bytes move between tiers (per direction: links are full duplex), how fast
the GPU computes and the host runs the optimizer, and how ranks group into nodes. The CLI builds one from presets
and flags (`hplan.planner.presets`), the planner reads it, the plan records it, the executor asks it. Nothing else
parses sizes, link speeds or world sizes.

Units: bytes, and GB/s meaning 10^9 bytes per second per direction.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from hplan.errors import HplanError

MIN_RATE = 1e-6
"""Smallest TFLOPS or GB/s a hardware may state. Predicted times divide work by these rates: near the smallest
floats they overflow to infinity, which standard JSON cannot hold; no real device is a million times slower
than 1 GB/s or 1 TFLOPS, so the floor refuses typos, not hardware."""

MAX_LATENCY_US = 1e6
"""A hop latency above a second is a typo (seconds given as µs), not a network."""
COLLECTIVE_ALGORITHMS = ("nccl", "ring", "tree", "hierarchical", "best")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """Tier capacities for this plan, link and compute rates, and the world of ranks."""

    SCHEMA: ClassVar[str] = "hplan.hardware/1"
    gpu: str = "custom"
    """Preset name the numbers came from (or "custom"); informational."""
    gpu_bytes: int
    """Device memory the plan may use per rank, allocator slack included."""
    host_bytes: int | None = None
    """Host memory the plan may use for model data per rank; None means unbounded (two-tier plans)."""
    nvme_bytes: int | None = None
    """Disk space for model data per rank; None means there is no disk tier."""
    slack_bytes: int = 0
    """Device bytes kept free for allocator fragmentation and non-framework overhead (CUDA context)."""
    activation_slack: tuple[tuple[str, int], ...] = ()
    """(figure, bytes) for keep, offload, recompute and mixed: the slack a plan making that activation choice for
    every segment, or mixing them, needs ([Note: slack per choice] in hplan.tracer.choice_slack), overhead
    included. When set, a plan's `slack_bytes` is the figure of the choices it makes (hplan.planner.slack);
    empty: `slack_bytes` holds for every plan."""
    tflops_16: float = 71.0
    """Datasheet dense 16-bit tensor-core TFLOPS."""
    tflops_32: float = 35.6
    """Datasheet fp32 TFLOPS (no TF32)."""
    efficiency: float = 0.30
    """Share of datasheet 16-bit TFLOPS a training step achieves (model FLOPs utilisation): the GPU preset's
    calibration (hplan.planner.calibration, [Note: compute calibration]); 0.30 = calibration.DEFAULT_EFFICIENCY,
    with its source (a test keeps the two equal)."""
    efficiency_32: float = 0.30
    """The same share for fp32 steps (no tensor cores): calibration.DEFAULT_EFFICIENCY."""
    efficiency_width: int = 0
    """Model width (hidden size) the efficiencies were measured at: an event of another width computes at
    efficiency × hplan.planner.kernel_size.width_factor ([Note: efficiency by width]); 0 = no size correction."""
    device_memory_gbps: float = 936.0
    """Device memory bandwidth, GB/s (the GPU preset's datasheet figure, hplan.planner.gpu_memory.MEMORY_GBPS; 936 =
    the RTX 3090, as the other defaults): what an optimizer step on the device is bound by ([Note: device
    optimizer step] in hplan.planner.kernel_size)."""
    h2d_gbps: float = 32.0
    """Host→device link, GB/s."""
    d2h_gbps: float = 32.0
    """Device→host link, GB/s."""
    nvme_read_gbps: float = 3.5
    """Disk→host, GB/s."""
    nvme_write_gbps: float = 3.0
    """Host→disk, GB/s."""
    cpu_optimizer_gbps: float = 26.5
    """Host optimizer throughput in GB/s of model state updated (weight + grad + master + moments)."""
    overlap: bool = True
    """Transfers and host updates run beside compute (copy engines). False: a fast tier without them (the CPU
    executor), where every copy and host update adds to the step time."""
    gpus_per_node: int = 1
    nodes: int = 1
    intra_gbps: float = 150.0
    """Per-GPU bandwidth of intra-node collectives (NVLink or PCIe), GB/s."""
    inter_gbps: float = 12.5
    """Per-node bandwidth of inter-node collectives (network), GB/s."""
    intra_latency_us: float = 3.4
    """Latency of one intra-node hop of a collective, µs: NCCL's NVLink ring hop with its Simple protocol
    (hplan.planner.ranks.nccl, [Note: collective latency model]); 0 with inter_latency_us 0 = bandwidth only."""
    inter_latency_us: float = 14.0
    """Latency of one network hop of a collective, µs: NCCL's network ring hop with its Simple protocol."""
    intra_link: str = "nvlink"
    """"nvlink" or "pci": which of NCCL's intra-node latency rows applies; "loopback": gloo between the CPU
    fast tier's processes (one protocol, no base latency; hplan.planner.ranks.nccl)."""
    collectives: str = "nccl"
    """How collectives are priced: "nccl" (NCCL's pick of ring or tree), "ring", "tree", "hierarchical" (two
    levels) or "best" (hplan.planner.ranks.collectives)."""
    network: str = ""
    """Network preset the link numbers came from; informational."""
    host: str = ""
    """Host preset the CPU optimizer rate came from; informational."""

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "host_bytes", "nvme_bytes", "slack_bytes", "efficiency_width", "gpus_per_node",
                     "nodes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise HplanError(f"hardware {name} must be an integer, got {value!r}")
            floor = 0 if name in ("slack_bytes", "efficiency_width") else 1
            if value < floor:
                raise HplanError(f"hardware {name} must be at least {floor}, got {value}")
        _check_activation_slack(self.activation_slack)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "activation_slack":
                continue
            if f.name in ("efficiency", "efficiency_32"):
                if not (isinstance(value, (int, float)) and 0 < value <= 1):
                    raise HplanError(f"hardware {f.name} is a share of datasheet TFLOPS (0 < e ≤ 1), got {value!r}")
            elif f.name in ("intra_latency_us", "inter_latency_us"):
                if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)
                                                   and 0 <= value <= MAX_LATENCY_US):
                    raise HplanError(f"hardware {f.name.replace('_', '-')} must be 0 to {MAX_LATENCY_US:g} µs, "
                                     f"got {value!r}")
            elif f.name == "intra_link" and value not in ("nvlink", "pci", "loopback"):
                raise HplanError(f"hardware intra-link must be nvlink, pci or loopback, got {value!r}")
            elif f.name == "collectives" and value not in COLLECTIVE_ALGORITHMS:
                raise HplanError(f"hardware collectives must be one of {', '.join(COLLECTIVE_ALGORITHMS)}, "
                                 f"got {value!r}")
            elif isinstance(value, float) and not (math.isfinite(value) and value >= MIN_RATE):
                raise HplanError(f"hardware {f.name.replace('_', '-')} must be a finite number of at least "
                                 f"{MIN_RATE:g}, got {value}")

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    def tflops(self, precision: str) -> float:
        """Achieved TFLOPS for a precision recipe: fp32 uses the fp32 rate, mixed recipes the 16-bit one."""
        if precision == "fp32":
            return self.tflops_32 * self.efficiency_32
        return self.tflops_16 * self.efficiency

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "schema": self.SCHEMA}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Hardware:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known - {"schema"})
        if unknown:
            raise HplanError(f"hardware has unknown fields {unknown}; regenerate the plan with `hplan plan`")
        values = {k: v for k, v in obj.items() if k in known}
        if isinstance(values.get("activation_slack"), list):
            values["activation_slack"] = tuple(tuple(x) if isinstance(x, list) else x
                                               for x in values["activation_slack"])
        return cls(**values)


def _check_activation_slack(table: object) -> None:
    """(figure, bytes) pairs: keep, offload, recompute and mixed once each (selective at most once, where the trace
    has its figure), non-negative integers."""
    names = ("keep", "offload", "recompute", "mixed")
    ok = isinstance(table, tuple) and all(
        isinstance(x, tuple) and len(x) == 2 and x[0] in (*names, "selective") and isinstance(x[1], int)
        and not isinstance(x[1], bool) and x[1] >= 0 for x in table)
    if not ok or (table and sorted(c for c, _ in table if c != "selective") != sorted(names)) \
            or sum(1 for c, _ in table if c == "selective") > 1:  # type: ignore[union-attr]
        raise HplanError(f"hardware activation_slack must pair keep, offload, recompute and mixed (and optionally "
                         f"selective) with byte counts, got {table!r}")
