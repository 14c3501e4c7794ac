"""The `hplan` command: a thin Typer shell over the library; one module per command."""

from __future__ import annotations

from typing import Annotated

import typer

from hplan import __version__
from hplan.cli import common
from hplan.cli.base import HplanGroup

app = typer.Typer(
    name="hplan",
    cls=HplanGroup,
    help="Trace a PyTorch training step, plan which model data lives on the GPU, and train on the plan.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hplan {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    common.set_debug(debug)


def _register() -> None:
    from hplan.cli import demo_cmd, fit_cmd, plan_cmd, report_cmd, run_cmd, trace_cmd

    for module in (trace_cmd, plan_cmd, fit_cmd, run_cmd, report_cmd, demo_cmd):
        module.register(app)


_register()


def main() -> None:
    """The `hplan` program: the command, then no waiting on threads the workload left running (hplan.cli.threads)."""
    from hplan.cli.threads import exit_past_threads

    try:
        app()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        exit_past_threads(code)
        raise
    exit_past_threads(0)
