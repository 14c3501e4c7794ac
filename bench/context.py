"""State shared by the sections of one run: mode, output folders, and traces reused across tables."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import ChildResult, run_worker
from bench.machine import BF16_TOO_SLOW

FAKE_RUNS_INDEX = "fake-runs.json"
"""In the run's work folder: the fake traces made so far, so each section's own process reuses them."""

HEADLINE_SHAPE = (1, 1024)
"""(batch, seq) of the fake GPT traces: the seed's headline setting and issue 3's 18b goal."""


@dataclass(kw_only=True)
class Context:
    quick: bool
    out_dir: Path
    fig_dir: Path
    log: Callable[[str], None] = print
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hplan-bench-")))
    fake_runs: dict[str, ChildResult] = field(default_factory=dict)
    speed_quick_runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """--quick: section 13's plain, all-resident and minimum-budget runs, which section 14 reuses."""
    _traces: dict[str, Any] = field(default_factory=dict)
    _bf16: float | None = None

    def bf16_slowdown(self) -> float:
        """`bench.machine.bf16_matmul_slowdown`, measured once per run."""
        if self._bf16 is None:
            from bench.machine import bf16_matmul_slowdown

            self._bf16 = bf16_matmul_slowdown()
            self.log(f"[bench]   bf16 matmul on this CPU: {self._bf16:.1f}× the fp32 time")
        return self._bf16

    def bf16_note(self) -> str:
        return (f"this CPU's bf16 matmul (grad_out @ W, 64×1024 @ 1024×1024) took {self.bf16_slowdown():.0f}× the "
                "fp32 time in this run (no bf16 units: torch falls back to a scalar kernel), so a bf16-mixed gpt:350m step "
                "would take minutes")

    def bf16_affordable(self) -> bool:
        return self.bf16_slowdown() < BF16_TOO_SLOW

    def fig_path(self, name: str) -> tuple[Path, str]:
        """Absolute path to write a figure to, and its path relative to the markdown file."""
        self.fig_dir.mkdir(parents=True, exist_ok=True)
        path = self.fig_dir / name
        try:
            rel = path.relative_to(self.out_dir).as_posix()
        except ValueError:
            rel = path.as_posix()
        return path, rel

    def fake_run(self, spec: str, precision: str = "fp32") -> ChildResult:
        """Fake-trace `spec` (batch 1, seq 1024) in `precision` in a subprocess once per run; later calls reuse it.

        The timeout keeps a stuck trace from eating the suite's time limit (3 min quick, 20 min full).
        """
        timeout = 120.0 if self.quick else 420.0
        key = f"{spec}@{precision}"
        if key not in self.fake_runs:
            self.fake_runs.update(self._shared_fake_runs())
        if key not in self.fake_runs:
            out = self.work_dir / (spec.replace(":", "_") + f".{precision}.fake.parquet")
            self.log(f"[bench]   fake trace {spec} {precision} (subprocess) …")
            res = run_worker(["fake-trace", spec, str(out), *map(str, HEADLINE_SHAPE), precision], timeout=timeout)
            res.payload.setdefault("path", str(out))
            self.fake_runs[key] = res
            self._share_fake_runs()
            self.log(f"[bench]   fake trace {spec} {precision}: "
                     + (f"{res.payload.get('trace_seconds', 0):.1f} s" if res.ok else res.error))
        return self.fake_runs[key]

    def _shared_fake_runs(self) -> dict[str, ChildResult]:
        """Fake traces an earlier section's process made in this run (`bench.isolate`), read from the work folder."""
        index = self.work_dir / FAKE_RUNS_INDEX
        if not index.is_file():
            return {}
        runs = {k: ChildResult(**v) for k, v in json.loads(index.read_text()).items()}
        return {k: r for k, r in runs.items() if not r.ok or Path(r.payload.get("path", "")).is_file()}

    def _share_fake_runs(self) -> None:
        index = self.work_dir / FAKE_RUNS_INDEX
        tmp = index.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: asdict(r) for k, r in self.fake_runs.items()}))
        tmp.replace(index)

    def fake_trace(self, spec: str, precision: str = "fp32") -> Any:
        """The Trace of `fake_run(spec, precision)`, loaded once; raises when the trace failed."""
        key = f"{spec}@{precision}"
        if key not in self._traces:
            res = self.fake_run(spec, precision)
            if not res.ok:
                raise RuntimeError(f"fake trace of {spec} ({precision}) failed: {res.error}")
            from hplan.artifacts import Trace

            self._traces[key] = Trace.load(res.payload["path"])
        return self._traces[key]

    def drop_trace(self, spec: str, precision: str = "fp32") -> None:
        """Forget a loaded trace to free memory (the file stays for later sections)."""
        self._traces.pop(f"{spec}@{precision}", None)
