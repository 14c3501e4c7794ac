"""Artifacts that are not what they claim (issue 22): the one bounded JSON reader, typed metadata fields, and a
trace read column by column. tests/test_bad_inputs*.py check the same through every command."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from artifact_samples import sample_trace
from test_reports_samples import gpt_like_trace

from hplan import HplanError, Trace
from hplan.artifacts import TIMELINE_COLUMNS, Event, ParamInfo
from hplan.artifacts.io import MAX_JSON_DEPTH, parse_json, read_json
from hplan.artifacts.typed import FieldError, typed


@pytest.mark.parametrize(("text", "says"), [
    ("[" * 100_000 + "]" * 100_000, "nested 100000 deep"),
    ('{"a": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) + "}", f"nested {MAX_JSON_DEPTH + 2} deep"),
    ('{"bytes": ' + "9" * 5000 + "}", 'a number of over 64 digits at "bytes"'),
    ('{"seconds": NaN}', 'non-standard value NaN at "seconds"'),
    ('{"seconds": -Infinity}', "non-standard value -Infinity"),
    ('{"seconds": 1e999}', "a number out of range (1e999)"),
    ('{"params": [{"bytes": 1}, {"bytes": 2, "s": [-Infinity]}]}', 'non-standard value -Infinity at "params[1].s[0]"'),
    ('{"a": 1', "Expecting"),
    (b'\xff\xfe{}', "not UTF-8 text"),
])
def test_hostile_json_is_one_line_naming_the_problem(text, says):
    with pytest.raises(HplanError) as err:
        parse_json(text, source="x.json", what="plan", regenerate="hplan plan t.parquet -o x.json")
    message = str(err.value)
    assert says in message and "\n" not in message and "`hplan plan t.parquet -o x.json`" in message


def test_json_within_the_bounds_reads_as_json():
    deep = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)  # inside the top-level object
    text = json.dumps({"s": "[[[[" * 100 + '"\\"{', "n": -(2**63), "x": 1.5e300, "deep": "@"}).replace('"@"', deep)
    obj = parse_json(text, source="x", what="plan")
    assert obj["s"].startswith("[[[[") and obj["n"] == -(2**63) and obj["x"] == 1.5e300


def test_read_json_refuses_a_document_that_is_not_an_object(tmp_path):
    (tmp_path / "p.json").write_text("[1, 2]")
    with pytest.raises(HplanError, match="is not a plan file"):
        read_json(tmp_path / "p.json", what="plan")


@dataclass(frozen=True, kw_only=True)
class _Inner:
    n: int
    tag: str = ""


@dataclass(frozen=True, kw_only=True)
class _Outer:
    size: int
    delta: int
    rate: float
    flag: bool
    names: tuple[str, ...]
    pair: tuple[int, str]
    counts: dict[str, int]
    inner: _Inner
    maybe: int | None = None
    items: tuple[_Inner, ...] = ()


GOOD = {"size": 3, "delta": -1, "rate": 0.5, "flag": True, "names": ["a"], "pair": [1, "x"], "counts": {"a": 1},
        "inner": {"n": 1}, "items": [{"n": 2, "tag": "t"}]}


def test_typed_builds_the_dataclass_from_json():
    got = typed(_Outer, GOOD, minimum={"delta": -1})
    assert got == _Outer(size=3, delta=-1, rate=0.5, flag=True, names=("a",), pair=(1, "x"), counts={"a": 1},
                         inner=_Inner(n=1), items=(_Inner(n=2, tag="t"),))


@pytest.mark.parametrize(("edit", "path", "problem"), [
    ({"size": "3"}, "size", "expected an integer, got the string '3'"),
    ({"size": True}, "size", "expected an integer, got the boolean true"),
    ({"size": 3.0}, "size", "expected an integer"),
    ({"size": -1}, "size", "must be non-negative"),
    ({"delta": -2}, "delta", "must be at least -1"),
    ({"size": 2**63}, "size", "out of range"),
    ({"rate": float("nan")}, "rate", "expected a finite number"),
    ({"flag": 1}, "flag", "expected true or false"),
    ({"names": "a"}, "names", "expected a list"),
    ({"names": [1]}, "names[0]", "expected a string"),
    ({"pair": [1]}, "pair", "a list of 2 values"),
    ({"counts": [1]}, "counts", "expected an object, got a list"),
    ({"counts": {"a": "1"}}, "counts.a", "expected an integer"),
    ({"inner": []}, "inner", "expected an object, got a list"),
    ({"inner": {}}, "inner.n", "missing"),
    ({"items": [{"n": 1, "colour": 2}]}, "items[0].colour", "unknown field"),
    ({"maybe": "x"}, "maybe", "expected an integer"),
    ({"extra": 1}, "extra", "unknown field"),
])
def test_typed_names_the_field_that_is_not_what_it_says(edit, path, problem):
    with pytest.raises(FieldError) as err:
        typed(_Outer, {**GOOD, **edit}, minimum={"delta": -1})
    assert err.value.path == path and problem in err.value.problem


def test_every_trace_field_has_a_typing_rule(tmp_path):
    """A field added to Trace, ParamInfo or Event later is checked on load without touching the reader: a saved
    trace loads back equal, whatever fields it has (an unsupported annotation would raise TypeError here)."""
    trace = sample_trace()
    trace.save(tmp_path / "t.parquet")
    back = Trace.load(tmp_path / "t.parquet")
    assert back == trace
    for cls in (Trace, ParamInfo, Event):
        assert fields(cls)


def _with_extra_column(tmp_path):
    """A GPT-shaped trace plus an unused column holding large strings: read by nobody."""
    trace = gpt_like_trace(n_layer=2, ops_per_event=2)
    trace.save(tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    junk = pa.array(["x" * 100_000] * len(table))
    pq.write_table(table.append_column("junk", junk), tmp_path / "t.parquet")
    return trace


def test_load_reads_only_the_columns_asked_for(tmp_path, monkeypatch):
    _with_extra_column(tmp_path)
    read: list[list[str]] = []
    original = pq.ParquetFile.read

    def spy(self, columns=None, **kwargs):
        read.append(list(columns) if columns is not None else ["<every column>"])
        return original(self, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read", spy)
    assert Trace.load(tmp_path / "t.parquet", columns=()).timeline.empty and read == []
    two = Trace.load(tmp_path / "t.parquet", columns=("iteration", "total_bytes"))
    assert list(two.timeline.columns) == ["iteration", "total_bytes"] and read == [["iteration", "total_bytes"]]
    full = Trace.load(tmp_path / "t.parquet")
    assert list(full.timeline.columns) == list(TIMELINE_COLUMNS) and "junk" not in read[-1]


def test_plan_and_reports_read_no_column_they_do_not_draw(tmp_path, monkeypatch):
    """`plan` reads the metadata only; plot/report/export read reports.views.TIMELINE_USED."""
    from typer.testing import CliRunner

    from hplan.cli import app
    from hplan.reports.views import TIMELINE_USED

    _with_extra_column(tmp_path)
    read: list[tuple[str, ...]] = []
    original = Trace.load.__func__

    def spy(cls, path, *, columns=None):
        read.append(tuple(columns) if columns is not None else TIMELINE_COLUMNS)
        return original(cls, path, columns=columns)

    monkeypatch.setattr(Trace, "load", classmethod(spy))
    t = str(tmp_path / "t.parquet")
    runner = CliRunner()
    result = runner.invoke(app, ["plan", t, "--gpu-mem", "min", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    for argv in (["plot", t, "--plan", str(tmp_path / "p.json"), "-o", str(tmp_path / "t.png")],
                 ["export", t, "-o", str(tmp_path / "c.json")]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.output
    assert read == [(), TIMELINE_USED, TIMELINE_USED]
    assert set(TIMELINE_USED) < set(TIMELINE_COLUMNS)


def test_a_trace_with_too_many_rows_is_refused_before_any_column_is_read(tmp_path, monkeypatch):
    trace = sample_trace()
    trace.save(tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    long = pa.table({"iteration": np.ones(5_000_000, dtype=np.int64)}).replace_schema_metadata(table.schema.metadata)
    pq.write_table(long, tmp_path / "t.parquet")
    assert (tmp_path / "t.parquet").stat().st_size < 1_000_000
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("read a column of a refused trace"))
    with pytest.raises(HplanError, match="5000000 timeline rows"):
        Trace.load(tmp_path / "t.parquet", columns=("iteration",))


def test_an_input_swapped_for_a_fifo_after_the_check_is_refused_without_blocking(tmp_path, monkeypatch):
    """open_input checks the file it opened (non-blocking), not only the path it checked before."""
    import os

    import hplan.artifacts.io as io

    os.mkfifo(tmp_path / "p.json")
    monkeypatch.setattr(io, "check_input", lambda path, what: tmp_path / "p.json")  # the check saw a regular file
    with pytest.raises(HplanError, match="is a FIFO"):
        read_json(tmp_path / "p.json", what="plan")


# -- run reports (`hplan run --json`, demo's run.json) ----------------------------------------------------------

def _run_report(world: int = 2) -> dict:
    """A valid run report, parsed from its JSON."""
    from hplan import RunReport
    from hplan.artifacts.run import RANK_FIELDS

    ranks = tuple({**dict.fromkeys(RANK_FIELDS, 7), "rank": r} for r in range(world)) if world > 1 else ()
    report = RunReport(workload="gpt:tiny", device="cpu", steps=2, first_step=3, losses=(2.5, -0.25),
                       step_seconds=(0.1, 0.2), peak_resident_bytes=10, budget_bytes=20, bytes_moved_per_iter=4,
                       planned_bytes_moved_per_iter=4, h2d_bytes_per_iter=2, d2h_bytes_per_iter=2, world_size=world,
                       ranks=ranks)
    return json.loads(json.dumps(report.to_dict()))


def test_a_run_report_reads_back_as_written_negative_losses_included(tmp_path):
    from hplan import RunReport

    for world in (1, 2):
        (tmp_path / "r.json").write_text(json.dumps(_run_report(world)))
        report = RunReport.load(tmp_path / "r.json")
        assert json.loads(json.dumps(report.to_dict())) == _run_report(world) and report.losses == (2.5, -0.25)


def _edit(key: str, value):
    def edit(obj: dict) -> None:
        *head, last = key.split(".")
        target = obj
        for part in head:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if value is _DROP:
            del target[last]
        else:
            target[int(last) if isinstance(target, list) else last] = value
    return edit


_DROP = object()


@pytest.mark.parametrize(("edit", "says"), [
    (_edit("steps", "2"), "field steps: expected an integer, got the string '2'"),
    (_edit("peak_resident_bytes", -5), "field peak_resident_bytes: must be non-negative, got -5"),
    (_edit("budget_bytes", True), "field budget_bytes: expected an integer, got the boolean true"),
    (_edit("bytes_moved_per_iter", 1.5), "field bytes_moved_per_iter: expected an integer, got the number 1.5"),
    (_edit("losses", ["2.5", 1.0]), "field losses[0]: expected a finite number, got the string '2.5'"),
    (_edit("step_seconds", [0.1, -0.2]), "field step_seconds[1]: must be non-negative, got -0.2"),
    (_edit("losses", [1.0]), "field losses: holds 1 values for 2 steps"),
    (_edit("losses", {"a": 1}), "field losses: expected a list, got an object"),
    (_edit("ranks.1.peak_resident_bytes", "7"), "field ranks[1].peak_resident_bytes: expected an integer"),
    (_edit("ranks.0.rank", 1), "field ranks[0].rank: is 1, expected 0"),
    (_edit("ranks.1.budget_bytes", _DROP), "field ranks[1].budget_bytes: missing"),
    (_edit("ranks", []), "field ranks: holds 0 entries for a world of 2"),
    (_edit("world_size", 0), "field world_size: must be at least 1, got 0"),
    (_edit("workload", None), "field workload: expected a string, got null"),
    (_edit("h2d_bytes_per_iter", _DROP), "field h2d_bytes_per_iter: missing"),
    (_edit("peak_rss", 1), "field peak_rss: unknown field"),
    (_edit("nvme_busy_seconds", 2**70), "field nvme_busy_seconds: 1180591620717411303424 is out of range"),
])
def test_an_edited_run_report_is_one_line_naming_the_field(tmp_path, edit, says):
    from hplan import RunReport

    obj = _run_report()
    edit(obj)
    (tmp_path / "r.json").write_text(json.dumps(obj))
    with pytest.raises(HplanError) as err:
        RunReport.load(tmp_path / "r.json")
    message = str(err.value)
    assert says in message and "\n" not in message and "is not a valid run report" in message, message
    assert "hplan run SPEC --plan PLAN --steps N --json > FILE" in message


@pytest.mark.parametrize(("text", "says"), [
    ('"step_seconds": [0.1, NaN]', 'non-standard value NaN at "step_seconds[1]"'),
    ('"losses": [Infinity, 0.2]', 'non-standard value Infinity at "losses[0]"'),
    ('"losses": [1e999, 0.2]', 'a number out of range (1e999) at "losses[0]"'),
])
def test_a_run_report_holding_nan_is_refused_by_the_reader(tmp_path, text, says):
    from hplan import RunReport

    raw = json.dumps(_run_report())
    key = text.split(":")[0]
    start = raw.index(key)
    raw = raw[:start] + text + raw[raw.index("]", start) + 1:]
    (tmp_path / "r.json").write_text(raw)
    with pytest.raises(HplanError) as err:
        RunReport.load(tmp_path / "r.json")
    assert says in str(err.value) and "is not a valid run report file" in str(err.value), err.value
