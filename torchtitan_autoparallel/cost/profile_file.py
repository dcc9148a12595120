"""Write a hardware profile as TOML (what ``load_profile`` reads), atomically."""

from __future__ import annotations

from dataclasses import asdict

from ..errors import atomic_write
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
    """Write ``profile`` to ``path`` atomically (``errors.atomic_write``: never half a file,
    nothing left behind on failure) and return the text."""
    text = to_toml(profile, notes)
    atomic_write(path, text, "profile")
    return text
