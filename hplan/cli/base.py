"""The click classes behind `hplan`: usage errors in one line, flags that read as flags in --help.

Typer prints a usage error (a missing option, `--steps abc`) as a usage line, a hint and a boxed
message, and labels every boolean flag `<bool>` in --help as if it took a value (`--json <bool>`).
hplan promises one line for every bad input (exit 2), and `--json` is a flag, so the group and
its commands use these two small subclasses; everything else is Typer's own behaviour.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

from rich.markup import escape
from typer import Abort
from typer.core import TyperCommand, TyperGroup

try:  # recent Typer vendors click as typer._click, whose exceptions are not click's own
    from typer._click import Context, Parameter
    from typer._click.exceptions import BadParameter, ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # older Typer runs on click itself
    from click import Context, Parameter
    from click.exceptions import BadParameter, ClickException, NoArgsIsHelpError, UsageError

from hplan.cli.common import err_console


def _flags_read_as_flags(params: list[Any]) -> list[Any]:
    """Give boolean flags an empty metavar, so --help shows no value type after them."""
    for param in params:
        if getattr(param, "is_flag", False) and getattr(param, "metavar", "") is None:
            param.metavar = ""
    return params


class HplanCommand(TyperCommand):
    """A command whose --help shows `--json`, not `--json <bool>`, and whose number options are in range."""

    def get_params(self, ctx: Context) -> list[Parameter]:
        return _flags_read_as_flags(super().get_params(ctx))

    def invoke(self, ctx: Context) -> Any:
        _numbers_in_range(ctx)
        return super().invoke(ctx)


INT64_END = 2**63


def _numbers_in_range(ctx: Context) -> None:
    """Every integer option within int64 and every number option finite, before the command runs: click reads
    `--steps 99999999999999999999` as a Python int and `--link-gbps 1e400` as inf, which crashed far inside
    (OverflowError) or ran forever. Each command's own checks (positive, at least 2, …) come after."""
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if isinstance(v, int) and not -INT64_END < v < INT64_END:
                raise BadParameter(f"{_digits(v)} is out of range (at most {INT64_END - 1:,})", ctx=ctx, param=param)
            if isinstance(v, float) and not math.isfinite(v):
                raise BadParameter(f"{v} is not a finite number", ctx=ctx, param=param)


def _digits(v: int) -> str:
    return f"a {len(str(abs(v)))}-digit number" if abs(v) >= 10**24 else f"{v:,}"


class HplanGroup(TyperGroup):
    """The `hplan` group: usage errors become one line on stderr with exit 2 (click's code)."""

    def get_params(self, ctx: Context) -> list[Parameter]:
        return _flags_read_as_flags(super().get_params(ctx))

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        args = expand_set_values(sys.argv[1:] if args is None else list(args))
        if not standalone_mode:  # a caller handling click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode=False,
                                windows_expand_args=windows_expand_args, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False,
                                windows_expand_args=windows_expand_args, **extra)
        except NoArgsIsHelpError as exc:  # bare `hplan` or a bare command: show the help
            exc.show()
            sys.exit(exc.exit_code)
        except ClickException as exc:
            err_console.print(f"[bold red]error:[/] {_one_line(exc)}", highlight=False, soft_wrap=True)
            sys.exit(exc.exit_code)
        except Abort:
            err_console.print("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


SET_HELP = "Workload option KEY=VALUE; several as --set a=1 b=2 or --set a=1 --set b=2."
_PAIR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def expand_set_values(args: list[str]) -> list[str]:
    """`--set a=1 b=2` as `--set a=1 --set b=2`: the key=value words right after a --set value are more of them.

    click options take one value each, so the first form, which the help's `--set KEY=VALUE` invites, used to
    end in "unexpected extra argument". Only words shaped `name=...` continue a --set, and no spec a command takes
    (`file.py:function`, `gpt:…`, `hf:…`) has that shape, so a positional argument after them is never taken."""
    out: list[str] = []
    in_set = False
    for i, word in enumerate(args):
        if word == "--":
            return out + args[i:]
        if in_set and _PAIR.match(word):
            out += ["--set", word]
            continue
        in_set = (i > 0 and args[i - 1] == "--set" and not word.startswith("-")) or word.startswith("--set=")
        out.append(word)
    return out


def _one_line(exc: ClickException) -> str:
    """click's message on one line, pointing at the command's --help for usage errors."""
    text = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, UsageError) and ctx is not None:
        text += f" (see `{ctx.command_path} --help`)"
    return escape(text)
