"""The ``--autoparallel.*`` and ``--parallelism.auto`` arguments as both TorchTitan releases'
command lines read them: a list option given as several values (``--autoparallel.techniques
fsdp ddp ac``) is joined into the comma-separated form TorchTitan's parser takes, and a boolean
written with a value (``--parallelism.auto=False``) is named with the flags that set it."""

from __future__ import annotations

import dataclasses
import typing

from .config import Autoparallel, Parallelism

LIST_OPTIONS = tuple(f"--autoparallel.{f.name}" for f in dataclasses.fields(Autoparallel)
                     if typing.get_origin(f.type) is list or f.type is list)
"""Our list options (techniques, pp_schedules, pin)."""
BOOL_OPTIONS = tuple(
    [f"--parallelism.{f.name}" for f in dataclasses.fields(Parallelism) if f.type is bool]
    + [f"--autoparallel.{f.name}" for f in dataclasses.fields(Autoparallel) if f.type is bool])
"""Our boolean options (parallelism.auto, autoparallel.measure_memory)."""
BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def _name(arg: str) -> str:
    """``--section.key`` of an argument, dashes as underscores (TorchTitan takes both)."""
    return arg.split("=", 1)[0].replace("-", "_").replace("__", "--", 1)


def joined_lists(argv: list[str]) -> list[str]:
    """``argv`` with each of our list options followed by several values turned into one
    ``--option=a,b,c`` (the values up to the next ``--`` argument or subcommand)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if "=" not in arg and _name(arg) in LIST_OPTIONS:
            values = []
            while i + 1 < len(argv) and not argv[i + 1].startswith("-") \
                    and ":" not in argv[i + 1]:
                i += 1
                values.append(argv[i])
            out.append(f"{arg}={','.join(values)}" if values else arg)
        else:
            out.append(arg)
        i += 1
    return out


def bool_value_hint(argv: list[str]) -> str:
    """A one-line fix when ``argv`` gives one of our boolean options a value (TorchTitan's
    parser takes them as flags only and names the value as an unknown option); "" if none."""
    for i, arg in enumerate(argv):
        name = _name(arg)
        if name not in BOOL_OPTIONS:
            continue
        value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv)
                                                         else "")
        if value.lower() in BOOL_WORDS:
            section, key = name[2:].split(".", 1)
            return (f"{arg if '=' in arg else f'{arg} {value}'}: {name} is a flag, it takes no "
                    f"value: write --{section}.{key} to turn it on and --{section}.no-{key} "
                    f"(or nothing) to leave it off; in a TOML config, {key} = true / false")
    return ""
