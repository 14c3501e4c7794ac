"""`hplan plot / report / export / sweep`: examples in --help, --json, and bad input refused in one line with
exit 2, no traceback and no file left behind."""

import json

import pytest
from test_reports_samples import gpt_like_plan, gpt_like_trace, make_metrics, make_plan, make_trace
from typer.testing import CliRunner

from hplan.cli import app

runner = CliRunner()
COMMANDS = ["plot", "report", "export", "sweep"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A trace, its plan and run metrics on disk, plus a plan made from another workload."""
    d = tmp_path_factory.mktemp("artifacts")
    trace = gpt_like_trace()
    plan = gpt_like_plan(trace)
    trace.save(d / "t.parquet")
    plan.save(d / "plan.json")
    make_metrics(plan).to_parquet(d / "m.parquet")
    other = make_trace()
    make_plan(other).save(d / "other_plan.json")
    return d


def _run(args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_an_example_and_json(command):
    result = _run([command, "--help"])
    assert result.exit_code == 0
    assert f"hplan {command} " in result.output and "--json" in result.output


def test_plot_report_export_write_their_files(files, tmp_path):
    t, p, m = files / "t.parquet", files / "plan.json", files / "m.parquet"
    for args, out in ((["plot", t, "--plan", p, "--metrics", m], "t.png"), (["plot", t, "--gpu-mem", "30MB"], "t.svg"),
                      (["report", t, "--plan", p, "--metrics", m], "r.html"), (["export", t, "--plan", p], "c.json"),
                      (["export", t, "--format", "snapshot"], "s.pickle")):
        result = _run([*args, "-o", tmp_path / out, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["output"] == str(tmp_path / out)
        assert (tmp_path / out).stat().st_size > 1000


def test_sweep_prints_a_table_and_draws_the_plot(files, tmp_path):
    result = _run(["sweep", files / "t.parquet", "--range", "20MB:80MB", "--points", "4", "-o", tmp_path / "s.png"])
    assert result.exit_code == 0, result.output
    assert "smallest GPU that fits" in result.output and "ZeRO-2" in result.output and "Gemini" in result.output
    assert (tmp_path / "s.png").stat().st_size > 10_000
    result = _run(["sweep", files / "t.parquet", "--range", "20MB:80MB", "--points", "3", "-o", tmp_path / "s.svg",
                   "--json"])
    rows = json.loads(result.output)["rows"]
    assert len(rows) == 3 and {"gpu_bytes", "feasible", "bytes_moved", "gemini_feasible"} <= set(rows[0])


def _bad_cases(d):
    t, p = d / "t.parquet", d / "plan.json"
    return {
        "missing trace": (["plot", d / "nope.parquet", "-o", "{out}.png"], "not found"),
        "plan as trace": (["report", p, "-o", "{out}.html"], "not a trace"),
        "trace as plan": (["plot", t, "--plan", t, "-o", "{out}.png"], "plan"),
        "trace as metrics": (["report", t, "--metrics", t, "-o", "{out}.html"], "metrics"),
        "plan of another workload": (["plot", t, "--plan", d / "other_plan.json", "-o", "{out}.png"], "not made from"),
        "plot suffix": (["plot", t, "-o", "{out}.pdf"], ".png or .svg"),
        "report suffix": (["report", t, "-o", "{out}.png"], "HTML"),
        "export suffix": (["export", t, "-o", "{out}.txt"], "name the file"),
        "export format vs suffix": (["export", t, "--format", "chrome", "-o", "{out}.pickle"], "name the file"),
        "export unknown format": (["export", t, "--format", "pdf", "-o", "{out}.json"], "unknown export format"),
        "snapshot with plan": (["export", t, "--plan", p, "-o", "{out}.pickle"], "Chrome trace"),
        "sweep suffix": (["sweep", t, "--range", "1GB:2GB", "-o", "{out}.jpg"], ".png or .svg"),
        "sweep range": (["sweep", t, "--range", "8GB", "-o", "{out}.png"], "FROM:TO"),
        "sweep gpu": (["sweep", t, "--range", "1GB:2GB", "--gpu", "abacus", "-o", "{out}.png"], "GPU preset"),
        "gpu-mem with plan": (["plot", t, "--plan", p, "--gpu-mem", "1GB", "-o", "{out}.png"], "--gpu-mem"),
        "bad gpu-mem": (["plot", t, "--gpu-mem", "lots", "-o", "{out}.png"], "gpu-mem"),
        "missing folder": (["plot", t, "-o", "{missing}/x.png"], "does not exist"),
    }


@pytest.mark.parametrize("case", list(_bad_cases(__import__("pathlib").Path("."))))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(files, tmp_path, case):
    args, message = _bad_cases(files)[case]
    out = tmp_path / "out"
    args = [str(a).format(out=out, missing=tmp_path / "missing") for a in args]
    result = _run(args)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert message.lower() in result.output.lower(), result.output
    assert list(tmp_path.iterdir()) == [], "no output, partial or temporary, may be left behind"
