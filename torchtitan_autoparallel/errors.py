"""User-facing errors: one line, non-zero exit, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """A mistake in the user's input; the message names the problem and the fix."""


EXIT_USER_ERROR = 2


def run_cli(main: Callable[[], int]) -> int:
    """Run ``main``; turn a UserError into ``error: <message>`` on stderr and exit code 2."""
    try:
        return main()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
