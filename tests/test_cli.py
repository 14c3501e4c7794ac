"""The CLI shell: version, help with examples, exit codes. Commands' own behaviour is tested beside their issue."""

import pytest
from typer.testing import CliRunner

from hplan import __version__
from hplan.cli import app

runner = CliRunner()
COMMANDS = ["trace", "plan", "run", "plot", "report", "demo"]


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "hplan " + command in result.output and "--json" in result.output


def test_unknown_command_is_exit_2():
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2


def test_bad_input_is_one_line_exit_2_without_traceback():
    result = runner.invoke(app, ["trace", "nope:spec", "-o", "x.parquet"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [*COMMANDS, "export", "sweep"])
def test_flags_read_as_flags_in_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0 and "--json" in result.output and "<bool>" not in result.output


def test_usage_errors_are_one_line_exit_2():
    result = runner.invoke(app, ["plan", "t.parquet", "-o", "p.json"])  # --gpu-mem missing
    assert result.exit_code == 2 and "--gpu-mem" in result.stderr and "plan --help" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
