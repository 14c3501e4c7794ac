"""Exports other tools read: PyTorch's memory-snapshot pickle (memory_viz) and a Chrome trace (Perfetto).

The trace holds bytes per category, not individual tensors, so the snapshot shows one allocation per
growth of a category, freed last-in-first-out when the category shrinks; each allocation's frame
names the op, its module and its phase, which is what memory_viz groups and colours by.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hplan.artifacts.io import atomic_path
from hplan.artifacts.plan import Plan
from hplan.artifacts.trace import CATEGORIES, Trace
from hplan.errors import HplanError

from .downsample import envelope_indices
from .views import planned_events, steady_ops

SEGMENT_SPACING = 1 << 44
"""Each category gets its own fake address range (one segment), far apart so ranges never overlap."""
EXPORT_FORMATS: dict[str, tuple[str, ...]] = {"snapshot": (".pickle", ".pkl"), "chrome": (".json",)}
"""Each export format and the file suffixes it may be written to (the first is the usual one)."""


def export_format(out: str | os.PathLike[str], fmt: str | None = None) -> str:
    """The export format for `out`: `fmt` checked against the suffix, or inferred from it when None."""
    if fmt is not None and fmt not in EXPORT_FORMATS:
        raise HplanError(f"unknown export format {fmt!r}: use snapshot (PyTorch memory_viz) or chrome (Perfetto)")
    suffix = Path(out).suffix.lower()
    found = next((f for f, sufs in EXPORT_FORMATS.items() if suffix in sufs), None)
    if found is None or (fmt is not None and found != fmt):
        want = fmt or "snapshot or chrome"
        examples = " or ".join(f"-o trace{EXPORT_FORMATS[f][0]}" for f in ([fmt] if fmt else EXPORT_FORMATS))
        raise HplanError(f"cannot write {Path(out).name} as {want}: name the file e.g. {examples}")
    return found


def export_memory_snapshot(trace: Trace, out: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the steady-state iteration as a `torch.cuda.memory._snapshot()`-style pickle; return it too."""
    export_format(out, "snapshot")
    snapshot = memory_snapshot(trace)
    with atomic_path(out) as tmp:
        tmp.write_bytes(pickle.dumps(snapshot, protocol=4))
    return snapshot


def memory_snapshot(trace: Trace) -> dict[str, Any]:
    """{"segments": blocks live at the end, "device_traces": [alloc/free events]} as memory_viz expects."""
    ops = steady_ops(trace)
    times = _times_us(ops)
    events: list[dict[str, Any]] = []
    segments = []
    for i, cat in enumerate(CATEGORIES):
        base = (i + 1) * SEGMENT_SPACING
        live, high = _category_events(ops, times, cat, base, events)
        segments.append(_segment(base, live, max(high - base, 1), cat))
    events.sort(key=lambda e: e["time_us"])
    return {"segments": segments, "device_traces": [events], "allocator_settings": {},
            "hplan": {"workload": trace.workload, "device": trace.device, "note": "synthesised from per-category bytes"}}


def _times_us(ops: pd.DataFrame) -> np.ndarray:
    """Op start times in µs from measured seconds; op index as µs when the trace has no timing."""
    secs = ops["seconds"].to_numpy(dtype=float) if "seconds" in ops.columns else np.zeros(len(ops))
    if secs.sum() <= 0:
        return ops["x"].to_numpy(dtype=float)
    return np.concatenate([[0.0], np.cumsum(secs)[:-1]]) * 1e6


def _category_events(ops: pd.DataFrame, times: np.ndarray, cat: str, base: int,
                     events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Append alloc/free events for one category's byte curve; return the blocks live at the end."""
    values = ops[f"{cat}_bytes"].to_numpy(dtype=np.int64)
    changed = np.flatnonzero(np.diff(np.concatenate([[0], values])) != 0)
    live: list[dict[str, Any]] = []
    top = high = base
    current = 0
    for i in changed:
        row = ops.iloc[i]
        frames = [{"name": f"{row['op']} [{row['phase']}]", "filename": str(row["module"]) or "<top>",
                   "line": int(row["x"])}, {"name": cat, "filename": "hplan", "line": 0}]
        t = int(times[i])
        delta = int(values[i]) - current
        while delta < 0:
            block = live.pop()
            events.append(_event("free_requested", block, t))
            events.append(_event("free_completed", block, t))
            top -= block["size"]
            delta += block["size"]
        if delta > 0:
            block = {"addr": top, "size": delta, "frames": frames, "category": cat}
            live.append(block)
            events.append(_event("alloc", block, t))
            top += delta
            high = max(high, top)
        current = int(values[i])
    return live, high


def _event(action: str, block: dict[str, Any], t: int) -> dict[str, Any]:
    """One device-trace entry in the shape torch.cuda.memory._snapshot() writes."""
    return {"action": action, "addr": block["addr"], "size": block["size"], "stream": 0, "time_us": t,
            "frames": block["frames"], "category": block["category"]}


def _segment(base: int, live: list[dict[str, Any]], total: int, cat: str) -> dict[str, Any]:
    """One segment per category: its live blocks, then the free remainder."""
    used = sum(b["size"] for b in live)
    blocks = [{"address": b["addr"], "size": b["size"], "requested_size": b["size"], "state": "active_allocated",
               "frames": b["frames"]} for b in live]
    if total > used:
        blocks.append({"address": base + used, "size": total - used, "requested_size": 0, "state": "inactive",
                       "frames": []})
    return {"device": 0, "address": base, "total_size": total, "allocated_size": used, "active_size": used,
            "requested_size": used, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [], "blocks": blocks, "category": cat}


def export_chrome_trace(trace: Trace, out: str | os.PathLike[str], *, plan: Plan | None = None) -> dict[str, Any]:
    """Write a Chrome trace JSON (opens in Perfetto / chrome://tracing); return it too."""
    export_format(out, "chrome")
    data = chrome_trace(trace, plan=plan)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(data, separators=(",", ":")))
    return data


def chrome_trace(trace: Trace, *, plan: Plan | None = None) -> dict[str, Any]:
    """Ops as slices on one track per phase, events (modules) on their own track, memory as counters,
    and the plan's fetches and write-backs as slices on two transfer tracks."""
    ops = steady_ops(trace)
    start = _times_us(ops)
    timed = "seconds" in ops.columns and ops["seconds"].sum() > 0
    dur = ops["seconds"].to_numpy(dtype=float) * 1e6 if timed else np.ones(len(ops))
    tids = {"forward": 1, "backward": 2, "optimizer": 3}
    out: list[dict[str, Any]] = [_meta("process_name", 1, 0, f"{trace.workload} ({trace.device})")]
    out += [_meta("thread_name", 1, tid, f"ops: {phase}") for phase, tid in tids.items()]
    out.append(_meta("thread_name", 1, 4, "events (modules)"))
    names, modules, phases = ops["op"].astype(str).to_numpy(), ops["module"].astype(str).to_numpy(), ops["phase"].to_numpy()
    for i in range(len(ops)):
        out.append({"ph": "X", "pid": 1, "tid": tids.get(phases[i], 5), "name": names[i], "ts": float(start[i]),
                    "dur": float(dur[i]), "args": {"module": modules[i], "op_index": int(ops["x"].iat[i])}})
    ends = start + dur
    for e in trace.events:
        lo, hi = _clip(e.op_start, len(ops)), _clip(max(e.op_end, e.op_start + 1) - 1, len(ops))
        out.append({"ph": "X", "pid": 1, "tid": 4, "name": e.key, "ts": float(start[lo]),
                    "dur": float(ends[hi] - start[lo]), "args": {"event_index": e.index, "params": len(e.params)}})
    out += _memory_counters(ops, start)
    if plan is not None:
        out += _transfer_slices(trace, plan, start, ends, timed)
    unit = "µs (measured op times)" if timed else "op index (this trace has no timing; 1 µs per op)"
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"workload": trace.workload, "time_axis": unit}}


def _clip(i: int, n: int) -> int:
    """An op index kept inside the iteration (event windows may end past the last op)."""
    return min(max(i, 0), n - 1)


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    """A metadata event naming a process or track in Perfetto."""
    return {"ph": "M", "pid": pid, "tid": tid, "name": name, "args": {"name": value}}


def _memory_counters(ops: pd.DataFrame, start: np.ndarray) -> list[dict[str, Any]]:
    """Bytes per category as a stacked counter track (downsampled without losing the peak)."""
    keep = envelope_indices(ops["total_bytes"].to_numpy())
    cols = [f"{c}_bytes" for c in CATEGORIES]
    values = ops[cols].to_numpy(dtype=np.int64)
    return [{"ph": "C", "pid": 1, "tid": 0, "name": "memory (bytes)", "ts": float(start[i]),
             "args": {c: int(v) for c, v in zip(CATEGORIES, values[i])}} for i in keep]


def _transfer_slices(trace: Trace, plan: Plan, start: np.ndarray, ends: np.ndarray,
                     timed: bool) -> list[dict[str, Any]]:
    """Each step's fetch and write-back as a slice from its event on. With measured op times a copy lasts
    bytes / link speed and waits for the previous copy in its direction (one copy engine each way, so
    slices on a track never overlap); without them it spans the event's window of ops."""
    link = _link_bytes_per_s(plan) if timed else None
    out = [_meta("process_name", 2, 0, f"hplan plan: {plan.workload} on {plan.gpu_bytes / 1e9:.2f} GB"),
           _meta("thread_name", 2, 1, "fetch host→GPU"), _meta("thread_name", 2, 2, "write-back GPU→host")]
    n = len(start)
    free_at = {1: 0.0, 2: 0.0}
    for p in planned_events(trace, plan):
        lo, hi = _clip(p.op_start, n), _clip(p.op_end - 1, n)
        for tid, size, name in ((1, p.h2d_bytes, "fetch"), (2, p.d2h_bytes, "write-back")):
            if size <= 0:
                continue
            ts = max(float(start[lo]), free_at[tid])
            dur = size / link * 1e6 if link else max(float(ends[hi]) - ts, 1.0)
            free_at[tid] = ts + dur
            out.append({"ph": "X", "pid": 2, "tid": tid, "name": f"{name} {size / 1e9:.3f} GB", "ts": ts,
                        "dur": dur, "args": {"bytes": size, "event": p.event, "step": p.index}})
    return out


def _link_bytes_per_s(plan: Plan) -> float | None:
    """Host link speed the plan assumed (its hardware's host→device rate)."""
    return plan.hardware.h2d_gbps * 1e9
