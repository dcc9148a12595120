"""User-facing errors: one line, non-zero exit, no traceback; how a user's value is shown in
one, and the field rules (type, finiteness, range) that raise them. Imports nothing of the
package: every layer may use it."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


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


MAX_SHOWN = 60
"""Longest rendering of a user value inside an error line."""


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` (a message: ``str(value)`` on one line) cut to ``limit`` characters."""
    text = " ".join(str(value).split()) if isinstance(value, BaseException) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Rule:
    """What one field accepts. Numbers must be finite; ``gt`` / ``ge`` / ``le`` bound them;
    ``choices`` lists the legal strings; ``item`` is the type of list items."""

    kind: type
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    item: type | None = None
    zero_or_ge: float | None = None
    """Numbers: 0 (meaning "default"), or >= this."""
    optional: bool = False
    """null (None) is accepted too."""

    def describe(self) -> str:
        if self.choices:
            return f"one of {list(self.choices)}"
        if self.kind is list:
            return f"a list of {self.item.__name__ if self.item else 'values'}"
        kind = {bool: "true or false", str: "a string", int: "an integer",
                dict: "an object"}.get(self.kind, "a finite number")
        bounds = [f"{op} {v:g}" for op, v in ((">", self.gt), (">=", self.ge), ("<=", self.le))
                  if v is not None]
        text = f"{kind} {' and '.join(bounds)}".strip()
        if self.zero_or_ge is not None:
            text = f"0 (the default) or {kind} >= {self.zero_or_ge:g}"
        return text + (" or null" if self.optional else "")

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` has the right type and range (bools are not numbers)."""
        if value is None and self.optional:
            return True
        if self.kind is list:
            return isinstance(value, list) and all(
                self.item is None or isinstance(v, self.item) for v in value)
        if self.kind in (int, float):
            numeric = (int,) if self.kind is int else (int, float)
            if isinstance(value, bool) or not isinstance(value, numeric):
                return False
            if not math.isfinite(value):
                return False
            if self.zero_or_ge is not None and value != 0 and value < self.zero_or_ge:
                return False
            return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                    and (self.le is None or value <= self.le))
        if not isinstance(value, self.kind):
            return False
        return not self.choices or value in self.choices


def rule_for_type(annotation: Any) -> Rule:
    """The default rule of a dataclass field from its annotation."""
    kind = annotation if isinstance(annotation, type) else typing.get_origin(annotation)
    if kind is list:
        args = typing.get_args(annotation)
        return Rule(list, item=args[0] if args else None)
    if kind in (int, float):
        return Rule(kind, ge=0)
    return Rule(kind if isinstance(kind, type) else object)


def check_value(where: str, key: str, value: Any, rule: Rule, fix: str = "") -> None:
    """Raise a one-line UserError unless ``rule`` accepts ``value``."""
    if not rule.accepts(value):
        hint = f"; {fix}" if fix else ""
        raise UserError(f"{where}{key} = {shown(value)} is invalid: use {rule.describe()}{hint}")


def check_fields(where: str, values: Mapping[str, Any], cls: type,
                 rules: Mapping[str, Rule], fix: str = "") -> None:
    """Check every field of dataclass ``cls`` present in ``values`` against its row in
    ``rules`` (or the rule its annotation implies); unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        import difflib

        close = difflib.get_close_matches(str(unknown[0]), sorted(fields), n=3)
        known = (f"did you mean {close}?" if close
                 else f"see the {len(fields)} fields of {cls.__name__}")
        raise UserError(f"{where}unknown key {shown(unknown[0])}: {known}"
                        f"{'; ' + fix if fix else ''}")
    for name in fields & set(values):
        check_value(where, name, values[name], rules.get(name) or rule_for_type(hints[name]), fix)
