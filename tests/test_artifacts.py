import json
from dataclasses import fields

import pandas as pd
import pytest

from artifact_samples import sample_plan, sample_trace
from hplan import Hardware, HplanError, Plan, RunReport, Trace
from hplan.artifacts import fingerprint_mismatch, replay


def test_trace_round_trip_and_one_pandas_call(tmp_path):
    trace = sample_trace()
    path = tmp_path / "t.parquet"
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded == trace
    pd.testing.assert_frame_equal(loaded.timeline, trace.timeline)
    assert len(pd.read_parquet(path)) == 6
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temp files left behind


def test_plan_round_trip_is_byte_stable(tmp_path):
    plan = sample_plan()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    plan.save(a)
    Plan.load(a).save(b)
    assert a.read_bytes() == b.read_bytes()
    assert Plan.load(a) == plan
    assert json.loads(a.read_text())["schema"] == "hplan.plan/2"


def test_run_report_round_trip(tmp_path):
    report = RunReport(workload="w", device="cpu", steps=2, first_step=0, losses=(1.0, 0.5), step_seconds=(0.1, 0.1),
                       peak_resident_bytes=10, budget_bytes=20, bytes_moved_per_iter=4,
                       planned_bytes_moved_per_iter=4, h2d_bytes_per_iter=2, d2h_bytes_per_iter=2)
    report.save(tmp_path / "r.json")
    assert RunReport.load(tmp_path / "r.json") == report


def test_refusals_are_one_line(tmp_path):
    plan_path, trace_path = tmp_path / "p.json", tmp_path / "t.parquet"
    sample_plan().save(plan_path)
    sample_trace().save(trace_path)
    cases = []
    with pytest.raises(HplanError) as err:  # a plan passed as a trace
        Trace.load(plan_path)
    cases.append(err.value)
    report_path = tmp_path / "r.json"
    report_path.write_text(json.dumps({"schema": "hplan.run/1"}))
    with pytest.raises(HplanError, match="is a hplan.run file, not a plan") as err:
        Plan.load(report_path)
    cases.append(err.value)
    future = json.loads(plan_path.read_text()) | {"schema": "hplan.plan/9"}
    plan_path.write_text(json.dumps(future))
    with pytest.raises(HplanError, match="hplan.plan/9.*reads hplan.plan/2; regenerate it with `hplan plan ") as err:
        Plan.load(plan_path)
    cases.append(err.value)
    (tmp_path / "corrupt.json").write_text("{not json")
    with pytest.raises(HplanError, match="corrupt") as err:
        Plan.load(tmp_path / "corrupt.json")
    cases.append(err.value)
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 nonsense")
    with pytest.raises(HplanError, match="not valid Parquet") as err:
        Trace.load(tmp_path / "corrupt.parquet")
    cases.append(err.value)
    with pytest.raises(HplanError, match="not found") as err:
        Trace.load(tmp_path / "missing.parquet")
    cases.append(err.value)
    assert all("\n" not in str(e) for e in cases)


def test_failed_write_leaves_no_file(tmp_path):
    trace = sample_trace()
    broken = Trace(**{f.name: getattr(trace, f.name) for f in fields(trace) if f.name != "timeline"},
                   timeline=pd.DataFrame({"x": [object()]}))
    with pytest.raises(Exception):
        broken.save(tmp_path / "t.parquet")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(HplanError, match="does not exist"):
        trace.save(tmp_path / "no" / "such" / "t.parquet")


def test_hardware_checks():
    with pytest.raises(HplanError, match="at least 1"):
        Hardware(gpu_bytes=0)
    with pytest.raises(HplanError, match="at least 0"):
        Hardware(gpu_bytes=10, slack_bytes=-1)
    with pytest.raises(HplanError, match="finite"):
        Hardware(gpu_bytes=10, h2d_gbps=float("inf"))
    with pytest.raises(HplanError, match="integer"):
        Hardware(gpu_bytes=10.5)
    with pytest.raises(Exception):
        Hardware(10)  # keyword-only
    hw = Hardware(gpu_bytes=10, gpus_per_node=4, nodes=2)
    assert hw.ranks == 8 and Hardware.from_dict(hw.to_dict()) == hw


def test_replay_of_sample_plan_is_valid_and_counts_traffic():
    result = replay(sample_plan())
    assert result.ok, result.violations
    assert (result.h2d_bytes, result.d2h_bytes, result.peak_bytes) == (400, 400, 850)


def test_fingerprint_mismatch_says_what_differs():
    fp = sample_trace().fingerprint
    assert fingerprint_mismatch(fp, fp) is None
    assert "batch shape" in fingerprint_mismatch(fp, fp | {"batch": "f[2]"})


def test_binary_file_as_json_artifact_is_a_one_line_error(tmp_path):
    from hplan.artifacts import Plan
    from hplan.errors import HplanError

    bad = tmp_path / "plan.json"
    bad.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(HplanError, match="not UTF-8"):
        Plan.load(bad)


def test_atomic_writes_get_ordinary_permissions(tmp_path):
    import os

    from hplan.artifacts.io import write_json

    old = os.umask(0o022)
    try:
        write_json(tmp_path / "x.json", {"a": 1})
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "x.json").st_mode & 0o777 == 0o644


def test_atomic_path_never_renames_onto_a_non_regular_file(tmp_path):
    import os

    from hplan.artifacts.io import atomic_path, check_output

    dest = tmp_path / "out.json"
    with pytest.raises(HplanError, match="FIFO"), atomic_path(dest) as tmp:
        tmp.write_text("{}")
        os.mkfifo(dest)  # appears while the output is being written: checked again before the rename
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"] and not dest.is_file()
    source = tmp_path / "in.json"
    source.write_text("{}")
    (tmp_path / "alias.json").symlink_to(source)
    with pytest.raises(HplanError, match="same file as the input"):
        check_output(tmp_path / "alias.json", inputs=[source])
    with pytest.raises(HplanError, match="not a directory"):
        check_output(source, kind="dir")


def test_a_trace_without_an_optimizer_step_is_refused_in_one_line(tmp_path):
    """Trainable parameters need an optimizer event for their updates: without one `plan` said "an hplan bug"."""
    from typer.testing import CliRunner

    from hplan.cli import app

    sample_trace().save(tmp_path / "t.parquet")
    for args in (["--gpu-mem", "min", "--json"], ["--gpu-mem", "1MB", "--json"]):
        result = CliRunner().invoke(app, ["plan", str(tmp_path / "t.parquet"), *args])
        assert result.exit_code == 2, result.output
        assert "no optimizer event" in result.output and "hplan bug" not in result.output
        assert len(result.output.strip().splitlines()) == 1
