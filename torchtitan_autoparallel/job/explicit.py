"""Which TorchTitan config keys the user set: written in the TOML or on the command line,
whatever the value (TorchTitan's default included). Under auto a set key is a constraint and an
unset key is searched; ``parse_config`` records the keys, ``user_set`` answers."""

from __future__ import annotations

import dataclasses
from typing import Any

EXPLICIT_ATTR = "_autoparallel_explicit_keys"
RELEASE_FIXED_ATTR = "_autoparallel_release_fixed_keys"
"""Keys a TorchTitan release has no setting for, fixed at what it runs (constraints that the
user did not set; plans name them apart)."""


def field_paths(cls: Any, prefix: str = "") -> set[str]:
    """Every leaf key of a (merged) JobConfig class as ``section.key``."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(f.type):
            out |= field_paths(f.type, name + ".")
        else:
            out.add(name)
    return out


def _toml_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _toml_keys(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def cli_keys(argv: list[str], fields: set[str]) -> set[str]:
    """The keys ``--section.key[=value]`` flags of ``argv`` set (dashes or underscores;
    ``--section.no-key`` for booleans)."""
    out = set()
    for arg in argv:
        if not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0].replace("-", "_")
        section, _, name = key.rpartition(".")
        if key not in fields and name.startswith("no_"):
            key = f"{section}.{name[3:]}"
        if key in fields:
            out.add(key)
    return out


def record_explicit(job_config: Any, toml: dict[str, Any], argv: list[str]) -> None:
    """Record on ``job_config`` the keys its TOML data and command line ``argv`` set."""
    fields = field_paths(type(job_config))
    setattr(job_config, EXPLICIT_ATTR,
            frozenset((set(_toml_keys(toml)) | cli_keys(argv, fields)) & fields))


def explicit_keys(job_config: Any) -> frozenset[str]:
    """Keys the user set (TOML or command line), whatever their value. A config not built by
    ``parse_config`` records none: then every key whose value differs from TorchTitan's
    default counts as set."""
    recorded = getattr(job_config, EXPLICIT_ATTR, None)
    if recorded is not None:
        return recorded
    if not dataclasses.is_dataclass(job_config):
        return frozenset()
    default = type(job_config)()
    return frozenset(key for key in field_paths(type(job_config))
                     if _get(job_config, key) != _get(default, key))


NOTES_ATTR = "_autoparallel_release_notes"
"""Notes a release's front-end attaches to a job (settings whose effect the cost model does not
see); the plan carries them."""


def release_fixed(job_config: Any) -> frozenset[str]:
    """The keys the job's TorchTitan release fixes (recorded by its front-end)."""
    return getattr(job_config, RELEASE_FIXED_ATTR, frozenset())


def user_set(job_config: Any, key: str) -> bool:
    """Whether ``key`` (``section.key``) is the user's: set in the TOML or on the command line
    (even to TorchTitan's default value), or changed from the default since parsing."""
    if key in explicit_keys(job_config):
        return True
    if dataclasses.is_dataclass(job_config):
        default = type(job_config)()
    else:  # a stand-in (tests): TorchTitan's own defaults
        from torchtitan.config import JobConfig

        default = JobConfig()
    return _get(job_config, key) != _get(default, key)


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
