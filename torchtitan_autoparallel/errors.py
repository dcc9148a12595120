"""User-facing errors: one line, non-zero exit, no traceback."""

from __future__ import annotations

import os
import sys
import tempfile
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


def atomic_write(path: str, text: str, what: str) -> None:
    """Write ``text`` to ``path`` atomically: a temp file in the same folder, renamed over
    ``path``. On any failure the temp file is removed and a UserError names the problem; no
    partial file is left behind."""
    if os.path.isdir(path):
        raise UserError(f"cannot write {what} to {path}: it is a directory; name a file")
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{what}-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise UserError(f"cannot write {what} to {path}: {exc.strerror or exc}") from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
