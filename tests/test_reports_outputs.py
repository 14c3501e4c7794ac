"""The HTML report and the exports: the report opens offline and says what it should; the snapshot loads in
PyTorch's own memory_viz helpers; the Chrome trace is valid trace-event JSON with the plan's transfers."""

import base64
import io
import itertools
import json
import pickle
import re
from dataclasses import replace
from html.parser import HTMLParser
from typing import ClassVar

import matplotlib.image
import pytest
from hplan.reports import chrome_trace, export_chrome_trace, export_memory_snapshot, report_html, write_report
from test_reports_samples import gpt_like_plan, gpt_like_trace, make_metrics, make_plan, make_trace

from hplan.errors import HplanError


class _Page(HTMLParser):
    """Collects headings, image sources and every attribute value, and checks that tags nest."""

    VOID: ClassVar[set[str]] = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.headings: list[str] = []
        self.images: list[str] = []
        self.attrs: list[str] = []
        self._in_heading = False

    def handle_starttag(self, tag, attrs):
        self.attrs += [v or "" for _, v in attrs]
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag not in self.VOID:
            self.stack.append(tag)
        self._in_heading = tag in ("h1", "h2")

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        self._in_heading = False

    def handle_data(self, data):
        if self._in_heading:
            self.headings.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    assert page.stack == [], f"unclosed tags {page.stack}"
    return page


def test_report_is_self_contained_and_has_every_section(tmp_path):
    trace = gpt_like_trace()
    plan = gpt_like_plan(trace, compare=True)
    out = tmp_path / "report.html"
    write_report(trace, out, plan=plan, metrics=make_metrics(plan))
    text = out.read_text(encoding="utf-8")
    assert 50_000 < out.stat().st_size < 5_000_000
    page = _parse(text)
    for heading in ("Summary", "Memory timeline", "Categories at the peak", "Top modules by memory", "Plan",
                    "Against the baselines", "Predicted vs measured"):
        assert heading in page.headings, heading
    outside_images = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text)
    assert "http" not in outside_images.lower() and "//" not in outside_images, "no reference to the network"
    assert not re.search(r"<(script|link|iframe)", text, re.IGNORECASE)
    assert len(page.images) == 1 and page.images[0].startswith("data:image/png;base64,")
    png = base64.b64decode(page.images[0].split(",", 1)[1])
    assert b"http" not in png, "matplotlib's URL stamp must be dropped too"
    img = matplotlib.image.imread(io.BytesIO(png), format="png")
    assert min(img.shape[:2]) >= 400 and float(img[..., :3].var()) > 1e-3
    for needle in ("gpt-like:4x256", "lm_head", "optimizer state", "ZeRO-Offload", "Gemini", "measured (run)",
                   "peak at"):
        assert needle in text, needle


def test_report_scores_baselines_when_the_plan_has_none():
    trace = gpt_like_trace()
    plan = gpt_like_plan(trace)
    assert plan.baselines == ()
    text = report_html(trace, plan=plan)
    assert "ZeRO-Offload" in text and "scored now" in text
    assert "Predicted vs measured" not in text


def test_report_from_a_trace_alone_and_with_hand_made_artifacts():
    assert "Plan</h2>" not in report_html(make_trace())
    trace = make_trace()
    plan = make_plan(trace)
    text = report_html(trace, plan=plan, metrics=make_metrics(plan))
    _parse(text)
    assert "toy3" in text and "Predicted vs measured" in text


def test_report_escapes_names():
    trace = replace(make_trace(), workload="<script>alert(1)</script>")
    text = report_html(trace)
    assert "<script>" not in text and "&lt;script&gt;" in text


@pytest.mark.parametrize("name", ["report.txt", "report", "report.png"])
def test_report_refuses_other_suffixes_and_writes_nothing(tmp_path, name):
    with pytest.raises(HplanError, match="html"):
        write_report(make_trace(), tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_snapshot_loads_in_torch_memory_viz(tmp_path):
    torch_viz = pytest.importorskip("torch.cuda._memory_viz")
    trace = gpt_like_trace()
    out = tmp_path / "snapshot.pickle"
    export_memory_snapshot(trace, out)
    with open(out, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}
    events = snap["device_traces"][0]
    assert events and {e["action"] for e in events} <= {"alloc", "free_requested", "free_completed"}
    assert [e["time_us"] for e in events] == sorted(e["time_us"] for e in events)
    flat = lambda text: text
    assert "allocated" in torch_viz.segsum(snap)
    assert "entries" in torch_viz.trace(snap)
    assert "optimizer" in torch_viz.memory(snap, format_flamegraph=flat)
    assert "active_allocated" in torch_viz.segments(snap, format_flamegraph=flat)
    torch_viz.compare(snap["segments"], snap["segments"], format_flamegraph=flat)
    assert "<html>" in torch_viz.trace_plot(snap) and "<html>" in torch_viz.segment_plot(snap)
    live = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    last = trace.timeline[trace.timeline["iteration"] == trace.timeline["iteration"].max()].iloc[-1]
    assert live == last["total_bytes"], "blocks live at the end are the bytes live after the last op"


def test_chrome_trace_is_valid_trace_event_json_with_transfers(tmp_path):
    trace = gpt_like_trace()
    plan = gpt_like_plan(trace)
    out = tmp_path / "trace.json"
    export_chrome_trace(trace, out, plan=plan)
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in ("X", "M", "C") and isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] > 0 and isinstance(e["tid"], int)
    ops = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] in (1, 2, 3)]
    assert len(ops) == trace.n_ops
    transfers = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    moved = sum(e["args"]["bytes"] for e in transfers)
    assert moved == plan.summary.bytes_moved_per_iter
    assert {e["name"].split()[0] for e in transfers} == {"fetch", "write-back"}
    for tid in (1, 2):  # one copy engine per direction: slices on a track never overlap
        track = sorted((e["ts"], e["ts"] + e["dur"]) for e in transfers if e["tid"] == tid)
        assert all(end <= nxt + 1e-6 for (_, end), (nxt, _) in itertools.pairwise(track))
    assert any(e["ph"] == "C" for e in events)


def test_chrome_trace_without_timing_uses_op_index():
    trace = make_trace()
    trace = replace(trace, timeline=trace.timeline.assign(seconds=0.0))
    data = chrome_trace(trace, plan=make_plan(trace))
    assert "op index" in data["otherData"]["time_axis"]
    assert any(e.get("pid") == 2 and e["ph"] == "X" for e in data["traceEvents"])


@pytest.mark.parametrize(("fn", "name"), [(export_memory_snapshot, "s.json"), (export_chrome_trace, "t.pickle"),
                                          (export_chrome_trace, "t.png")])
def test_exports_refuse_the_wrong_suffix_and_write_nothing(tmp_path, fn, name):
    with pytest.raises(HplanError, match="name the file"):
        fn(make_trace(), tmp_path / name)
    assert list(tmp_path.iterdir()) == []
