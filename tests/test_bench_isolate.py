"""`python -m bench` runs each full section in its own process (bench/isolate.py): its result crosses as JSON and
fake traces are shared through the run's work folder."""

from __future__ import annotations

import json
import signal

from bench.context import FAKE_RUNS_INDEX, Context
from bench.harness import ChildResult, SectionOutput, SectionResult, Table
from bench.isolate import _died, result_from_json, result_to_json


def test_a_section_result_renders_the_same_after_crossing_as_json() -> None:
    table = Table(headers=["a", "b|c"], caption="cap", notes=["n1"])
    table.add(1.5, None)
    table.add("x|y", 3)
    out = SectionOutput(tables=[table], text=["t"], figures=[("f", "bench-figures/f.png")], headline=["h"],
                        failures=["part: boom"])
    before = SectionResult(key="k", title="T", output=out, error=None, seconds=2.5)
    after = result_from_json(json.loads(json.dumps(result_to_json(before))))
    assert after.output is not None and after.ok == before.ok is False
    assert after.output.tables[0].markdown() == table.markdown()
    assert (after.output.text, after.output.figures, after.output.headline) == (["t"], [("f", "bench-figures/f.png")],
                                                                              ["h"])
    dead = result_from_json(json.loads(json.dumps(result_to_json(
        SectionResult(key="k", title="T", output=None, error="E: x", seconds=1.0)))))
    assert dead.output is None and dead.error == "E: x"


def test_a_killed_section_says_it_was_most_likely_out_of_memory() -> None:
    assert "SIGKILL" in _died(-signal.SIGKILL) and "out of memory" in _died(-signal.SIGKILL)
    assert "exited 1" in _died(1)


def test_a_fake_trace_made_by_one_sections_process_is_reused_by_the_next(tmp_path) -> None:
    trace = tmp_path / "gpt_small.fp32.fake.parquet"
    trace.write_bytes(b"x")
    first = Context(quick=False, out_dir=tmp_path, fig_dir=tmp_path, work_dir=tmp_path, log=lambda m: None)
    first.fake_runs["gpt:small@fp32"] = ChildResult(ok=True, wall_seconds=1.0, peak_rss_bytes=5,
                                                    payload={"path": str(trace), "trace_seconds": 0.5})
    first._share_fake_runs()
    assert (tmp_path / FAKE_RUNS_INDEX).is_file()
    second = Context(quick=False, out_dir=tmp_path, fig_dir=tmp_path, work_dir=tmp_path, log=lambda m: None)
    res = second.fake_run("gpt:small", "fp32")  # no subprocess: the index answers
    assert res.ok and res.payload["path"] == str(trace) and res.peak_rss_bytes == 5
    trace.unlink()  # a trace file gone since is made again, not trusted
    assert "gpt:small@fp32" not in Context(quick=False, out_dir=tmp_path, fig_dir=tmp_path, work_dir=tmp_path,
                                           log=lambda m: None)._shared_fake_runs()


def test_the_headlines_gpu_plan_is_the_one_hplan_plan_gives(tmp_path) -> None:
    """Sections 4, 6, 9 and 10 plan a fake trace for a named GPU as `hplan plan --gpu` does (the CUDA context
    reserved, `for_gpu`): a headline figure is one a user can reproduce with the CLI (it was not, by 512 MiB)."""
    from typer.testing import CliRunner

    from hplan.artifacts import Plan, Trace
    from hplan.cli import app
    from hplan.tracer import trace_workload
    from hplan.specs import load_workload

    from bench.headline import plan_at

    path = tmp_path / "t.parquet"
    trace_workload(load_workload("gpt:tiny"), device="fake").save(path)
    out = tmp_path / "p.json"
    from hplan.planner import make_hardware

    made = CliRunner().invoke(app, ["plan", str(path), "--gpu", "rtx3090", "--gpu-mem",
                                    f"{make_hardware('rtx3090').gpu_bytes}B", "-o", str(out)])
    assert made.exit_code == 0, made.output
    cli, bench = Plan.load(out).summary, plan_at(Trace.load(path), "rtx3090").summary
    assert cli.min_gpu_bytes > 512 * 2**20  # the context is in it
    for field in ("min_gpu_bytes", "bytes_moved_per_iter", "predicted_peak_bytes", "predicted_step_seconds", "feasible"):
        assert getattr(bench, field) == getattr(cli, field), field
