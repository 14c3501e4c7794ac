"""The one exception library code raises for problems a user can fix.

Only the CLI turns it into an exit code (2); anything else that escapes is an
internal error (exit 1).
"""

from __future__ import annotations


class HplanError(Exception):
    """Bad input or an impossible request, explained in one line with its fix."""

    exit_code: int = 2
