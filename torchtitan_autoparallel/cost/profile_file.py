"""Write a hardware profile as TOML (what ``load_profile`` reads), atomically."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict

from ..errors import UserError
from .hardware import HardwareProfile


def to_toml(profile: HardwareProfile, notes: list[str]) -> str:
    """The profile's fields as TOML, ``notes`` as leading comments."""
    lines = [f"# {line}" for n in notes for line in n.splitlines()]
    for key, value in asdict(profile).items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = f'"{value}"'
        else:
            text = repr(round(value, 6)) if isinstance(value, float) else str(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def write_profile(path: str, profile: HardwareProfile, notes: list[str]) -> str:
    """Write ``profile`` to ``path`` (temp file + rename: never half a file; the temp file is
    removed on failure) and return the text."""
    text = to_toml(profile, notes)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".profile-", suffix=".toml")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        raise UserError(f"cannot write profile to {path}: {exc.strerror}") from exc
    return text
