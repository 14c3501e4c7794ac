"""Matplotlib plumbing shared by every plot: Agg-only figures, byte units, atomic saving by suffix.

Figures are built on `matplotlib.figure.Figure` with an Agg canvas, never through pyplot, so
drawing a report neither needs a display nor changes the user's global backend or pyplot state.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from hplan.artifacts.io import atomic_path
from hplan.errors import HplanError

IMAGE_FORMATS: tuple[str, ...] = ("png", "svg")
CATEGORY_COLORS: dict[str, str] = {
    "param": "#1f77b4", "grad": "#ff7f0e", "optimizer": "#2ca02c",
    "activation": "#d62728", "temporary": "#9467bd", "other": "#8c8c8c",
}
CATEGORY_LABELS: dict[str, str] = {
    "param": "parameters", "grad": "gradients", "optimizer": "optimizer state",
    "activation": "activations", "temporary": "temporaries", "other": "other",
}
PHASE_COLORS: dict[str, str] = {"forward": "#e8f1fb", "backward": "#fdeee3", "optimizer": "#eaf6ea"}
_NO_URLS = {"png": {"Software": None}, "svg": {"Creator": None}}
"""Matplotlib stamps its home page into every file; dropped so reports hold no URL at all."""


def new_figure(width: float, height: float) -> Figure:
    """A Figure with its own Agg canvas (no pyplot, no global backend switch)."""
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def image_format(path: str | os.PathLike[str]) -> str:
    """The image format named by the file suffix; anything but .png/.svg is a user error."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in IMAGE_FORMATS:
        raise HplanError(f"cannot write {Path(path).name}: the output must end in .png or .svg, e.g. -o timeline.png")
    return suffix


def save_figure(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Write the figure atomically in the format the suffix names."""
    fmt = image_format(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, metadata=_NO_URLS[fmt])


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes (for embedding in HTML), without matplotlib's URL stamp."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata=_NO_URLS["png"])
    return buf.getvalue()


def phase_handles(phases: list[str]) -> list[Patch]:
    """Legend entries for the phase shading, so narrow (unlabelled) phases can still be told apart."""
    return [Patch(color=PHASE_COLORS.get(p, "#f4f4f4"), label=f"{p} phase (background)") for p in phases]


_UNITS = {False: (1e3, ("B", "KB", "MB", "GB", "TB"), "10^{}"),
          True: (2.0**10, ("B", "KiB", "MiB", "GiB", "TiB"), "2^{}")}
"""Per `binary`: the step between units, their names and how the axis label writes the power."""


def byte_unit(largest: float, binary: bool) -> tuple[float, str]:
    """(divisor, axis label, e.g. "MB (10^6 bytes)") of the largest unit in which `largest` bytes is at least 1,
    so an axis of megabytes is labelled in MB, not as 0.0005 GB; decimal units, or binary ones with `binary`."""
    step, names, power = _UNITS[binary]
    k = 0
    while k + 1 < len(names) and abs(largest) >= step ** (k + 1):
        k += 1
    exponent = 3 * k if not binary else 10 * k
    return step**k, f"{names[k]} ({power.format(exponent)} bytes)" if k else "bytes"


def unit_name(scale: float, binary: bool) -> str:
    """The short name of the unit `byte_unit` chose (its divisor `scale`), e.g. "MB"."""
    step, names, _ = _UNITS[binary]
    k = min(range(len(names)), key=lambda i: abs(step**i - scale))
    return "bytes" if k == 0 else names[k]


def traffic_stems(ax: Axes, xs: np.ndarray, items: list[object], series: tuple[tuple[str, int, str, str], ...], *,
                  scale: float, binary: bool) -> None:
    """Per item, a stem of bytes moved: up (sign 1) or down (-1) for each (attribute, sign, color, label) of
    `series`, labelled with the total; items that move nothing of a kind get no stem."""
    from hplan.sizes import format_size

    for attr, sign, color, label in series:
        vals = np.array([getattr(t, attr) for t in items], dtype=float) / scale
        hit = vals > 0
        total = format_size(sum(getattr(t, attr) for t in items), binary=binary)
        ax.vlines(xs[hit], 0, sign * vals[hit], color=color, lw=1.6)
        ax.plot(xs[hit], sign * vals[hit], ls="none", marker="^" if sign > 0 else "v", ms=5, color=color,
                label=f"{label}: {total}", clip_on=False)
