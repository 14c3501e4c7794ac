"""The benchmark harness: tables, timing with medians, subprocess RSS, sections (the machine: bench.machine).

Pure helpers (no torch import at module level) so `tests/test_bench.py` can check them quickly.
Every number a section reports is computed in the run; this module only renders and measures.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- formatting

def fmt_bytes(n: float | None) -> str:
    """Decimal units (GB = 10^9 B), as the rest of hplan prints them."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "—"
    from hplan.sizes import format_size

    return format_size(n)


def fmt_ratio(x: float | None, digits: int = 2) -> str:
    """`1.23×`; an em dash when there is nothing to compare."""
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.{digits}f}×"


def fmt_pct(x: float | None, digits: int = 2) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{100 * x:.{digits}f}%"


def fmt_seconds(x: float | None, digits: int = 2) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.{digits}f} s"


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or the denominator is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def rel_diff(a: float, b: float) -> float:
    """|a - b| / max(|a|, |b|), 0 when both are 0: symmetric, so the order of a and b does not matter."""
    scale = max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def _cell(value: Any) -> str:
    text = "—" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def render_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; short rows are padded, `|` in cells is escaped."""
    headers = [_cell(h) for h in headers]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    for row in rows:
        cells = [_cell(c) for c in row]
        if len(cells) > len(headers):
            raise ValueError(f"row has {len(cells)} cells but the table has {len(headers)} columns: {row!r}")
        cells += [""] * (len(headers) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- timing

def median(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("median of no values")
    return float(statistics.median(xs))


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of one call, and its result."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def interleaved_times(fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time each function `repeats` times, alternating between them.

    On a machine shared with other jobs, load drifts; alternating A, B, A, B puts both sides
    under the same drift, so the ratio of their medians is fair where separate loops are not.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_call(fn)[0])
    return times


def median_ratio(times: dict[str, list[float]], num: str, den: str) -> float | None:
    return ratio(median(times[num]), median(times[den]))


# ----------------------------------------------------------------------------- subprocess RSS

@dataclass(frozen=True, kw_only=True, slots=True)
class ChildResult:
    """What a worker subprocess reported about itself, plus the parent's view."""

    ok: bool
    wall_seconds: float
    """Parent-side wall time of the whole child (interpreter start and imports included)."""
    peak_rss_bytes: int
    """The child's own peak RSS in bytes (`self_peak_rss_bytes`, reported by the child)."""
    payload: dict[str, Any]
    error: str = ""


def worker_command(args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of `python -m bench.worker ARGS` (run from REPO_ROOT)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return [sys.executable, "-m", "bench.worker", *args], env


def run_worker(args: Sequence[str], *, timeout: float) -> ChildResult:
    """Run `python -m bench.worker ARGS` and parse the JSON line it prints last.

    A subprocess gives each measurement a fresh address space, so peak RSS is the job's own and
    not the high-water mark of everything the suite did before.
    """
    cmd, env = worker_command(args)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env)
    except subprocess.TimeoutExpired:
        return ChildResult(ok=False, wall_seconds=time.perf_counter() - t0, peak_rss_bytes=0, payload={},
                           error=f"timed out after {timeout:.0f} s")
    wall = time.perf_counter() - t0
    payload = parse_last_json(proc.stdout)
    if proc.returncode != 0 or payload is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return ChildResult(ok=False, wall_seconds=wall, peak_rss_bytes=0, payload=payload or {},
                           error=f"exit {proc.returncode}: {tail[0][:200]}")
    return ChildResult(ok=True, wall_seconds=wall, peak_rss_bytes=int(payload.get("peak_rss_bytes", 0)),
                       payload=payload)


def parse_last_json(text: str) -> dict[str, Any] | None:
    """The last line of `text` that parses as a JSON object (workers may print progress first)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def self_peak_rss_bytes() -> int:
    """This process's peak RSS in bytes: VmHWM on Linux, the high-water mark of this program's own memory.

    Not ru_maxrss there: Linux carries it across exec from the process that spawned us, so a worker started by
    a suite holding 11 GB reports 11 GB whatever it used itself. (macOS: ru_maxrss, in bytes.)"""
    import resource

    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# ----------------------------------------------------------------------------- sections

@dataclass(kw_only=True)
class Table:
    """One markdown table with its caption and footnotes."""

    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    caption: str = ""
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append(list(cells))

    def markdown(self) -> str:
        head = f"{self.caption}\n\n" if self.caption else ""
        notes = "\n\n" + "\n".join(f"- {n}" for n in self.notes) if self.notes else ""
        return head + render_table(self.headers, self.rows) + notes


@dataclass(kw_only=True)
class SectionOutput:
    """What a section produces: tables, free text, figure paths (relative to the markdown file)."""

    tables: list[Table] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)
    """(caption, path relative to the .md file)."""
    headline: list[str] = field(default_factory=list)
    """One-line results for the summary at the top of the file."""
    failures: list[str] = field(default_factory=list)
    """Parts of the section that failed ("FAILED: part: reason"); any makes the suite exit non-zero."""

    def part(self, label: str, fn: Callable[..., Any], *args: Any, log: Callable[[str], None] = print) -> Any:
        """Run `fn(*args)`, one table of a section; on failure record it and return None so the rest still runs."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one broken table must not hide its neighbours
            reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
            log("".join(traceback.format_exception(exc))[-3000:])
            self.failures.append(f"{label}: {reason}")
            return None


@dataclass(kw_only=True)
class SectionResult:
    key: str
    title: str
    output: SectionOutput | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None and not (self.output and self.output.failures)


def run_section(key: str, title: str, fn: Callable[[], SectionOutput], *, log: Callable[[str], None] = print
                ) -> SectionResult:
    """Run one section; a failure becomes "FAILED: reason" in its place instead of ending the suite."""
    log(f"[bench] {title} …")
    t0 = time.perf_counter()
    try:
        out = fn()
        error = None
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        out = None
        error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        log("".join(traceback.format_exception(exc))[-3000:])
    seconds = time.perf_counter() - t0
    if error is None and out is not None and out.failures:
        error_note = "FAILED: " + "; ".join(out.failures)
    else:
        error_note = "ok" if error is None else "FAILED: " + error
    log(f"[bench] {title}: {error_note} ({seconds:.1f} s)")
    return SectionResult(key=key, title=title, output=out, error=error, seconds=seconds)


def render_document(*, command: str, machine: dict[str, str], date: str, sections: Sequence[SectionResult],
                    quick: bool, total_seconds: float, preamble: str = "") -> str:
    """The whole BENCHMARKS.md text."""
    lines = ["# hplan benchmarks", ""]
    if preamble:
        lines += [preamble, ""]
    lines += [f"Generated {date} by `{command}` in {total_seconds:.0f} s"
              + (" (**--quick**: small models, fewer repeats)." if quick else "."), "",
              ("Every number below was computed in that run; nothing is typed in by hand. CPU times appear only "
               "as ratios measured side by side (medians of repeats), except where an issue asks for an absolute "
               "CPU time (fake-trace time, planner solve time, plot time). No GPU was used: every GPU figure is a "
               "**plan** (a prediction from hplan's simulator), never a measurement."), "",
              "## Machine", "", render_table(["", ""], list(machine.items())), ""]
    heads = [(s.title, h) for s in sections if s.output for h in s.output.headline]
    failed = [s for s in sections if not s.ok]
    lines += ["## Headline", ""]
    lines += [f"- **{t}**: {h}" for t, h in heads] or ["- (no section produced a headline)"]
    if failed:
        lines += [f"- **FAILED sections**: {', '.join(s.title for s in failed)}"]
    lines.append("")
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.output is None:
            lines += [f"FAILED: {s.error}", ""]
            continue
        for t in s.output.text:
            lines += [t, ""]
        for table in s.output.tables:
            lines += [table.markdown(), ""]
        for caption, path in s.output.figures:
            lines += [f"![{caption}]({path})", "", f"*{caption}*", ""]
        for failure in s.output.failures:
            lines += [f"FAILED: {failure}", ""]
        lines += [f"<sub>section time {s.seconds:.0f} s</sub>", ""]
    return "\n".join(lines).rstrip() + "\n"


def offloaded_bytes(plan: Any) -> int:
    """Model-data bytes the plan keeps off the GPU at some step: what needs a home in host memory (the
    planner's own host-memory rule)."""
    from hplan.artifacts import replay
    from hplan.planner.core import host_bytes_needed

    return host_bytes_needed(plan, replay(plan))
