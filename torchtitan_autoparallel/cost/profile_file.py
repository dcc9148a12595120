"""Write a hardware profile as TOML (what ``load_profile`` reads), atomically."""

from __future__ import annotations

from dataclasses import asdict

from ..errors import atomic_write
from .hardware import HardwareProfile, check_profile_data


def to_toml(profile: HardwareProfile, notes: list[str],
            sources: dict[str, str] | None = None) -> str:
    """The profile's fields as TOML, ``notes`` as leading comments, and a ``[provenance]``
    table: ``sources`` for the fields this write determined, the profile's own for the rest."""
    lines = [f"# {line}" for n in notes for line in n.splitlines()]
    provenance = {**dict(profile.provenance), **(sources or {})}
    for key, value in asdict(profile).items():
        if key == "provenance":
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = f'"{value}"'
        elif isinstance(value, (list, tuple)):
            text = "[" + ", ".join(_quoted(str(v)) for v in value) + "]"
        else:
            text = repr(round(value, 6)) if isinstance(value, float) else str(value)
        lines.append(f"{key} = {text}")
    lines += ["", "[provenance]"]
    for key in asdict(profile):
        if key not in ("name", "provenance"):
            text = provenance.get(key, "assumed: the default of the profile schema")
            lines.append(f"{key} = {_quoted(text)}")
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_profile(path: str, profile: HardwareProfile, notes: list[str],
                  sources: dict[str, str] | None = None) -> str:
    """Write ``profile`` to ``path`` atomically (``errors.atomic_write``: never half a file,
    nothing left behind on failure) and return the text."""
    data = {k: v for k, v in profile.to_dict().items() if k != "provenance"}
    check_profile_data(data, f"{path} (as written)")  # a fit far off the data stops here
    text = to_toml(profile, notes, sources)
    atomic_write(path, text, "profile")
    return text
