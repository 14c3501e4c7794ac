"""The GPU × host memory map (issue 16): which budgets fit with a disk tier, and the predicted step time there.

Reads the rows of `hplan.planner.tiers.sweep_tiers` ([Note: tier map rows]). Each cell is one (GPU, host) pair: its
colour the predicted step time (log scale), grey with a cross where nothing fits; the black steps trace the
smallest host memory each GPU size needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.colors import LogNorm

from hplan.errors import HplanError
from hplan.sizes import format_size

from .figure import image_format, new_figure, save_figure

TIER_MAP_KEYS: tuple[str, ...] = ("gpu_bytes", "cpu_bytes", "feasible", "step_seconds", "min_cpu_bytes")


def plot_tier_map(rows: Sequence[Mapping[str, Any]], out: str | os.PathLike[str], *, workload: str = "",
                  nvme_bytes: int | None = None, binary: bool = False) -> None:
    """Draw the map to a .png or .svg file."""
    image_format(out)
    if not rows:
        raise HplanError("the sweep has no points; give ranges with at least two sizes each")
    missing = [k for k in TIER_MAP_KEYS if k not in rows[0]]
    if missing:
        raise HplanError(f"tier map rows lack {missing}; they must come from hplan.planner.tiers.sweep_tiers")
    gpus = sorted({int(r["gpu_bytes"]) for r in rows})
    cpus = sorted({int(r["cpu_bytes"]) for r in rows})
    grid = np.full((len(cpus), len(gpus)), np.nan)
    for r in rows:
        if r["feasible"] and r["step_seconds"] > 0:
            grid[cpus.index(int(r["cpu_bytes"])), gpus.index(int(r["gpu_bytes"]))] = float(r["step_seconds"])
    fig = new_figure(10, 7)
    ax = fig.subplots()
    ax.set_facecolor("0.88")
    ok = grid[np.isfinite(grid)]
    image = None
    if ok.size:
        norm = LogNorm(vmin=float(ok.min()), vmax=float(max(ok.max(), ok.min() * 1.0001)))
        image = ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", cmap="viridis_r", norm=norm)
        fig.colorbar(image, ax=ax, label="predicted step time, s (a plan, not a measurement)")
    for i in range(len(cpus)):
        for j in range(len(gpus)):
            value = grid[i, j]
            if not np.isfinite(value):
                ax.text(j, i, "×", ha="center", va="center", color="0.45", fontsize=10)
            elif len(gpus) * len(cpus) <= 144:
                ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=7, color="black",
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.6})
    need = [min((int(r["min_cpu_bytes"]) for r in rows if int(r["gpu_bytes"]) == g and r["min_cpu_bytes"]),
                default=0) for g in gpus]
    ys = [float(np.searchsorted(cpus, n)) - 0.5 if n else np.nan for n in need]  # below the first size that fits
    ax.step(np.arange(len(gpus) + 1) - 0.5, ys + ys[-1:], where="post", color="black", lw=1.5,
            label="smallest host memory that fits (per GPU size)")
    ax.set_xticks(range(len(gpus)), [format_size(g, binary=binary) for g in gpus], rotation=45, ha="right",
                  fontsize=8)
    ax.set_yticks(range(len(cpus)), [format_size(c, binary=binary) for c in cpus], fontsize=8)
    ax.set_xlabel("GPU memory (--gpu-mem)")
    ax.set_ylabel("host memory for model data (--cpu-mem)")
    ax.set_xlim(-0.5, len(gpus) - 0.5)
    ax.set_ylim(-0.5, len(cpus) - 0.5)
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.18), fontsize=8, frameon=False)
    disk = f" with {format_size(nvme_bytes, binary=binary)} of NVMe" if nvme_bytes else ""
    name = f"{workload}: " if workload else ""
    ax.set_title(f"{name}where it fits{disk} (× = no plan) and the predicted step time", fontsize=11, loc="left")
    save_figure(fig, out)
