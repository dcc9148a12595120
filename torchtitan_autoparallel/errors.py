"""User-facing errors: one line, non-zero exit, no traceback; how a user's value is shown in
one, and the field rules (type, finiteness, range) that raise them. Imports nothing of the
package: every layer may use it."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (requires-python >= 3.10): tomli is a dependency
    import tomli as tomllib

__all__ = ["tomllib"]  # the one TOML reader of the package (TOML configs, profiles)


class UserError(Exception):
    """A mistake in the user's input; the message names the problem and the fix."""


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def run_cli(main: Callable[[], int]) -> int:
    """Run ``main``; turn a UserError into ``error: <message>`` on stderr and exit code 2."""
    try:
        return main()
    except UserError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of stdout left (``| head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


MAX_INPUT_BYTES = 64 << 20
"""Largest input file read (plans, profiles, configs, runs CSVs): far above any real one."""


def read_input(path: str | os.PathLike, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the input file ``path`` (a leading UTF-8 BOM dropped). One line when it is
    missing, not a regular file (a FIFO, a device, a folder: reading those can block or never
    end), larger than ``limit``, or unreadable."""
    import stat

    name = shown(str(path))
    try:
        info = os.stat(path)
    except FileNotFoundError as exc:
        raise UserError(f"{what} not found: {name}") from exc
    except OSError as exc:
        raise UserError(f"cannot read {what} {name}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{what} {name} is not a regular file; name a file")
    if info.st_size > limit:
        raise UserError(f"{what} {name} is {info.st_size / 2**20:.0f} MiB, more than the "
                        f"{limit / 2**20:.0f} MiB any {what} needs; name the right file")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UserError(f"cannot read {what} {name}: {exc.strerror or exc}") from exc
    if len(data) > limit:
        raise UserError(f"{what} {name} is larger than {limit / 2**20:.0f} MiB; name the right "
                        "file")
    return data[3:] if data.startswith(b"\xef\xbb\xbf") else data


def check_output_path(path: str, what: str) -> None:
    """An output path must be a new path or an existing regular file (not a symlink, FIFO,
    device or folder: writing there would replace or block on something that is not ours)."""
    import stat

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {what} to {shown(path, 300)}: its folder does not exist "
                        "(or is not a folder); create it first or name another path")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"cannot write {what} to {shown(path)}: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(info.st_mode):
        raise UserError(f"cannot write {what} to {shown(path)}: it is a directory; name a file")
    if not stat.S_ISREG(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        raise UserError(f"cannot write {what} to {shown(path)}: it is {kind}; name a new path "
                        "or a regular file")


class _Terminated(Exception):
    """SIGTERM arrived while a file was being written."""


MAX_LINE = 2000
"""Longest error line printed: a user's megabyte-long value is cut, not echoed whole."""


def one_line(message: str, limit: int = MAX_LINE) -> str:
    """``message`` on one line, its middle cut when longer than ``limit``."""
    text = " ".join(message.split())
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def atomic_write(path: str, data: str | bytes, what: str) -> None:
    """Write ``data`` to ``path`` atomically (see ``atomic_write_all``)."""
    atomic_write_all([(path, data)], what)


def atomic_write_all(files: list[tuple[str, str | bytes]], what: str) -> None:
    """Write every ``(path, data)`` atomically: temp files in the targets' folders, created
    with the user's umask, renamed over the targets only once all are written. On any failure
    (also SIGTERM) the temp files are removed and a UserError names the problem; no partial
    file is left behind, and no target is written unless all can be."""
    import signal
    import threading

    for path, _ in files:
        check_output_path(path, what)
    umask = os.umask(0)
    os.umask(umask)
    temps: list[str] = []
    handler = None
    main = threading.current_thread() is threading.main_thread()
    if main:
        def terminated(signum: int, frame: Any) -> None:
            raise _Terminated

        handler = signal.signal(signal.SIGTERM, terminated)
    current = files[0][0]
    try:
        for current, data in files:
            folder = os.path.dirname(os.path.abspath(current))
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{what}-", suffix=".tmp")
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~umask)  # as open() creates files (mkstemp makes 0600)
        for (current, _), tmp in zip(files, temps, strict=True):
            os.replace(tmp, current)
        temps = []
    except _Terminated as exc:
        raise UserError(f"terminated while writing {what} to {current}; nothing was "
                        "written") from exc
    except OSError as exc:
        raise UserError(f"cannot write {what} to {current}: {exc.strerror or exc}") from exc
    finally:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if main:
            signal.signal(signal.SIGTERM, handler)


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
    or_int_ge: int | None = None
    """Booleans: an integer >= this is accepted too (FSDP2's integer reshard_after_forward)."""

    def describe(self) -> str:
        if self.choices:
            return f"one of {list(self.choices)}"
        if self.kind is list:
            return f"a list of {self.item.__name__ if self.item else 'values'}"
        kind = {bool: "true or false", str: "a string", int: "an integer",
                dict: "an object"}.get(self.kind, "a finite number")
        bounds = [f"{op} {_number(v)}" for op, v in
                  ((">", self.gt), (">=", self.ge), ("<=", self.le)) if v is not None]
        text = f"{kind} {' and '.join(bounds)}".strip()
        if self.or_int_ge is not None:
            text += f", or an integer >= {self.or_int_ge}"
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
        if self.or_int_ge is not None and isinstance(value, int) and not isinstance(value, bool):
            return value >= self.or_int_ge
        if not isinstance(value, self.kind):
            return False
        return not self.choices or value in self.choices


def _number(value: float) -> str:
    """A bound as written: integers in full, others short."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def rule_for_type(annotation: Any) -> Rule:
    """The default rule of a dataclass field from its annotation."""
    kind = annotation if isinstance(annotation, type) else typing.get_origin(annotation)
    if kind in (types.UnionType, typing.Union):
        # ``X | None``: X's rule, None accepted
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner = rule_for_type(args[0]) if len(args) == 1 else Rule(object)
        return dataclasses.replace(inner, optional=True)
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
