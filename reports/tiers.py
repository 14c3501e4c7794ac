"""The three tiers of a plan with a disk (issue 16): where the model data is at each event, and the disk traffic.

Drawn under the timeline's plan panels (same op axis) when the plan has host phases ([Note: host tier] in
hplan.artifacts.plan): model data on the GPU, staged in host memory (with the host update's temporaries), and
only on disk; then disk reads (up) and writes (down) at the event that issues them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes

from hplan.artifacts.host_replay import disk_regions
from hplan.artifacts.plan import Plan, staging_bytes
from hplan.artifacts.replay import replay
from hplan.sizes import format_size

from .figure import traffic_stems, unit_name
from .views import PlannedEvent

TIER_COLORS = {"gpu": "#4c72b0", "host": "#dd8452", "disk": "#8c8c8c"}


@dataclass(frozen=True, kw_only=True, slots=True)
class TierStep:
    gpu_bytes: int
    """Model data resident on the device during the step."""
    host_bytes: int
    """Host memory for model data: the most any phase of the step holds (staging + update temporaries)."""
    disk_only_bytes: int
    """Bytes of disk regions neither on the device nor staged after the step's first phase: only on disk."""
    read_bytes: int
    write_bytes: int


def tier_steps(plan: Plan) -> list[TierStep]:
    """Per plan step, the bytes in each tier and the disk traffic it issues."""
    rep = replay(plan)
    host = rep.host
    assert host is not None, "tier_steps needs a plan with a disk tier"
    disk = disk_regions(plan)
    size = {r.id: r.bytes for r in plan.regions}
    staged = set(plan.initial_staged)
    out, k = [], 0
    for state, step in zip(rep.states, plan.steps, strict=True):
        phases = host.host_bytes[k:k + len(step.host)]
        first = step.host[0]
        staged = (staged - set(first.drop)) | set(first.alloc) | set(first.nvme_read)
        resident = set(state.resident)
        out.append(TierStep(gpu_bytes=state.resident_bytes, host_bytes=max(phases, default=0),
                            disk_only_bytes=sum(size[r] for r in disk - staged - resident),
                            read_bytes=sum(staging_bytes(size[r]) for ph in step.host for r in ph.nvme_read),
                            write_bytes=sum(staging_bytes(size[r]) for ph in step.host for r in ph.nvme_write)))
        for ph in step.host[1:]:
            staged = (staged - set(ph.drop)) | set(ph.alloc) | set(ph.nvme_read)
        k += len(step.host)
    return out


def draw_tiers(mem_ax: Axes, io_ax: Axes, plan: Plan, planned: list[PlannedEvent], scale: float,
               binary: bool) -> None:
    """The tiers over the planned events' op ranges (`mem_ax`), and the disk traffic as stems (`io_ax`)."""
    tiers = tier_steps(plan)
    xs = np.array([p.op_start for p in planned] + [planned[-1].op_end], dtype=float)

    def series(values: list[int]) -> np.ndarray:
        return np.array(values + values[-1:], dtype=float) / scale

    hw, s = plan.hardware, plan.summary
    for attr, key, label in (("disk_only_bytes", "disk", "model data only on disk (NVMe)"),
                             ("host_bytes", "host", "model data in host memory (staged + update temporaries)"),
                             ("gpu_bytes", "gpu", "model data on the GPU")):
        mem_ax.step(xs, series([getattr(t, attr) for t in tiers]), where="post", color=TIER_COLORS[key], lw=1.8,
                    label=label)
    if hw.host_bytes is not None:
        mem_ax.axhline(hw.host_bytes / scale, color=TIER_COLORS["host"], ls="--", lw=1.2,
                       label=f"host budget (--cpu-mem) {format_size(hw.host_bytes, binary=binary)}")
    mem_ax.set_ylim(0, max(ax_top(mem_ax), 1e-9) * 1.15)
    mem_ax.set_title(f"three tiers per event (host peak {format_size(s.predicted_host_peak_bytes, binary=binary)}; "
                     f"{format_size(s.nvme_bytes_used, binary=binary)} on disk)", fontsize=10, loc="left")
    mem_ax.set_ylabel(f"memory, {unit_name(scale, binary)}")
    x0 = np.array([p.op_start for p in planned], dtype=float)
    io_ax.axhline(0, color="0.3", lw=0.6)
    top = max([t.read_bytes for t in tiers] + [t.write_bytes for t in tiers] + [1])
    traffic_stems(io_ax, x0, tiers, (("read_bytes", 1, "#6a4c93", f"disk read ({hw.nvme_read_gbps:g} GB/s)"),
                                     ("write_bytes", -1, "#b5838d", f"disk write ({hw.nvme_write_gbps:g} GB/s)")),
                  scale=scale, binary=binary)
    io_ax.set_ylim(-1.3 * top / scale, 1.3 * top / scale)
    io_ax.set_title(f"disk traffic at each event ({format_size(s.nvme_read_bytes + s.nvme_write_bytes, binary=binary)}"
                    f" per iteration; predicted disk time {s.seconds.get('nvme_read', 0) + s.seconds.get('nvme_write', 0):.3f} s)",
                    fontsize=10, loc="left")
    io_ax.set_ylabel(f"copied per event, {unit_name(scale, binary)}")


def ax_top(ax: Axes) -> float:
    return float(ax.get_ylim()[1])
