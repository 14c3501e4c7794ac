"""Timeline and sweep images: valid, not blank, sensible size, readable at 100,000 ops, no torch, no pyplot.

Plotting speed (issue 6: 100,000 ops in <= 10 s) is measured in bench/plot_cost.py, not timed here."""

import re
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
from hplan.reports import plot_sweep, plot_timeline, timeline_figure
from test_reports_samples import GB, gpt_like_plan, gpt_like_trace, make_metrics, make_plan, make_trace

from hplan.errors import HplanError
from hplan.sizes import format_size


def _check_png(path, min_side=400):
    img = matplotlib.image.imread(path)
    assert min(img.shape[:2]) >= min_side and max(img.shape[:2]) <= 4000
    assert float(img[..., :3].var()) > 1e-3, "image is blank"


@pytest.mark.parametrize("with_plan", [False, True])
def test_timeline_png_is_a_readable_image(tmp_path, with_plan):
    trace = make_trace()
    plan = make_plan(trace) if with_plan else None
    out = tmp_path / "t.png"
    plot_timeline(trace, out, plan=plan, metrics=make_metrics(plan) if plan else None)
    _check_png(out)
    assert 10_000 < out.stat().st_size < 2_000_000


def test_timeline_svg_has_labels_and_units(tmp_path):
    out = tmp_path / "t.svg"
    plot_timeline(make_trace(), out, binary=True)
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for needle in ("GiB", "forward", "backward", "optimizer", "peak", "toy3", "activations"):
        assert needle in text, needle


@pytest.mark.parametrize("name", ["t.pdf", "t", "t.jpg"])
def test_other_suffixes_are_refused_and_nothing_is_written(tmp_path, name):
    with pytest.raises(HplanError, match=r"\.png or \.svg"):
        plot_timeline(make_trace(), tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_downsampling_keeps_every_series_extremes():
    from hplan.reports.downsample import envelope_indices

    rng = np.random.default_rng(0)
    a, b = rng.random(250_001), rng.random(250_001)
    keep = envelope_indices(a, b, max_buckets=1000)
    assert len(keep) <= 4002 and keep[0] == 0 and keep[-1] == len(a) - 1 and np.all(np.diff(keep) > 0)
    for s in (a, b):
        assert s[keep].max() == s.max() and s[keep].min() == s.min()
    assert len(envelope_indices(a[:100])) == 100  # short series are drawn as they are


def test_100k_ops_are_downsampled_without_losing_the_peak(tmp_path):
    trace = gpt_like_trace(ops_per_event=100_000 // 57 + 1)
    assert trace.n_ops >= 100_000
    fig = timeline_figure(trace, plan=gpt_like_plan(trace))
    traced = fig.axes[0]
    drawn = max(len(p.vertices) for c in traced.collections for p in c.get_paths())
    assert drawn < 50_000, "each layer should be drawn from a few thousand rows (all 100,000 would be ~400,000 points)"
    top = max(p.vertices[:, 1].max() for c in traced.collections for p in c.get_paths())
    scale = 10 ** int(re.search(r"\(10\^(\d+) bytes\)", traced.get_ylabel()).group(1))
    assert top * scale == pytest.approx(trace.timeline["peak_bytes"].max(), rel=1e-9)
    assert any(f"peak {format_size(trace.peak_bytes)}" in t.get_text() for t in traced.texts)
    plot_timeline(trace, tmp_path / "big.png", plan=gpt_like_plan(trace))
    _check_png(tmp_path / "big.png")


def test_gpt_like_trace_with_a_real_plan_and_run_metrics(tmp_path):
    trace = gpt_like_trace()
    plan = gpt_like_plan(trace)
    out = tmp_path / "gpt.svg"
    plot_timeline(trace, out, plan=plan, metrics=make_metrics(plan))
    text = out.read_text()
    for needle in ("gpt-like:4x256", "GPU budget", "planned model data on GPU", "fetch host→GPU", "write-back",
                   "measured: all GPU memory", "backward phase", "MB (10^6 bytes)", "lm_head"):
        assert needle in text, needle
    assert "matplotlib.org" not in text
    plot_timeline(trace, tmp_path / "gpt.png", plan=plan, metrics=make_metrics(plan))
    _check_png(tmp_path / "gpt.png")


def test_a_plan_that_moves_nothing_says_so(tmp_path):
    trace = gpt_like_trace()
    from hplan.planner import PlanOptions, make_plan

    from hplan.artifacts import Hardware

    plan = make_plan(trace, Hardware(gpu_bytes=4 * trace.peak_bytes), PlanOptions(solver="fast"))
    assert plan.summary.bytes_moved_per_iter == 0
    fig = timeline_figure(trace, plan=plan)
    assert any("no transfers" in t.get_text() for t in fig.axes[2].texts)


def test_gpu_size_without_a_plan_shows_how_far_from_fitting(tmp_path):
    trace = make_trace()
    fig = timeline_figure(trace, gpu_bytes=2 * GB)
    assert "does not fit" in fig.axes[0].get_title(loc="left")
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "GPU budget 2.00 GB" in labels
    assert "does not fit" not in timeline_figure(trace, gpu_bytes=100 * GB).axes[0].get_title(loc="left")


def test_sweep_plot(tmp_path):
    rows = [{"gpu_bytes": g * GB, "feasible": g >= 6, "bytes_moved": max(14 - g, 0) * GB, "step_seconds": 0.1 * g,
             "min_gpu_bytes": 5 * GB, "gemini_feasible": g >= 8, "gemini_bytes_moved": 12 * GB,
             "gemini_step_seconds": 1.0} for g in (4, 6, 8, 12, 16)]
    plot_sweep(rows, tmp_path / "s.png", workload="toy3")
    _check_png(tmp_path / "s.png")
    with pytest.raises(HplanError, match="lack"):
        plot_sweep([{"gpu_bytes": 1}], tmp_path / "bad.png")


def test_reports_import_neither_torch_nor_pyplot():
    code = "import sys, hplan.reports; assert 'torch' not in sys.modules; assert 'matplotlib.pyplot' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plotting_leaves_the_users_backend_alone(tmp_path):
    code = (f"import matplotlib; matplotlib.use('svg'); import sys; sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r}); "
            "from test_reports_samples import make_trace; from hplan.reports import plot_timeline; "
            f"plot_timeline(make_trace(), {str(tmp_path / 'x.png')!r}); assert matplotlib.get_backend() == 'svg'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _tick_texts(ax) -> list[str]:
    ax.figure.canvas.draw()
    return [t.get_text() for t in ax.get_yticklabels() if t.get_text()]


@pytest.mark.parametrize(("peak", "binary", "unit"), [
    (2.5e6, False, "MB (10^6 bytes)"), (5e9, False, "GB (10^9 bytes)"), (3e4, False, "KB (10^3 bytes)"),
    (2.5e6, True, "MiB (2^20 bytes)"), (5e12, True, "TiB (2^40 bytes)")])
def test_axes_take_their_unit_from_the_data(peak, binary, unit):
    """Megabytes are labelled in MB (ticks like 0.5, 1.0), not as 0.0005 GB; gigabytes in GB."""
    from dataclasses import replace

    trace = gpt_like_trace(n_layer=2)
    factor = peak / trace.timeline["peak_bytes"].max()
    scaled = replace(trace, timeline=trace.timeline.assign(
        **{c: (trace.timeline[c] * factor).astype("int64") for c in trace.timeline.columns if c.endswith("_bytes")}))
    fig = timeline_figure(scaled, binary=binary)
    ax = fig.axes[0]
    assert ax.get_ylabel() == f"memory, {unit}"
    values = [float(t.replace("\u2212", "-")) for t in _tick_texts(ax)]
    assert max(values) >= 1 and all(len(t.split(".")[-1]) <= 2 for t in _tick_texts(ax))


def test_sweep_axes_take_their_unit_from_the_data(tmp_path):
    from hplan.reports.sweep import plot_sweep as draw

    mb = 10**6
    rows = [{"gpu_bytes": g * mb, "feasible": True, "bytes_moved": (10 - g) * mb, "step_seconds": 0.1,
             "min_gpu_bytes": 2 * mb} for g in range(2, 9)]
    draw(rows, tmp_path / "s.svg")
    text = (tmp_path / "s.svg").read_text()
    assert "MB (10^6 bytes)" in text and "GB (10^9 bytes)" not in text
