"""`hplan plan`: filled in by its issue; until then it says so instead of faking a result."""

from __future__ import annotations

import typer

from hplan.errors import HplanError


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command() -> None:
        """Not built yet."""
        from hplan.cli.common import guarded

        def body() -> None:
            raise HplanError("'hplan plan' is not built yet in this version")

        guarded(body)
