"""``--parallelism.auto`` and ``--autoparallel.*`` on TorchTitan 0.3.0's command line.

``Config`` is TorchTitan's ``Trainer.Config`` with ``parallelism.auto`` and the
``autoparallel`` section (the same keys as under 0.2.2). A user's config function may return it
(``auto=True`` set there is the user's, as a TOML key is under 0.2.2); ``parse_job`` also turns
any registry function's ``Trainer.Config`` into one before tyro reads the overrides, so
``--module llama3 --config llama3_8b --parallelism.auto`` works for every family.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from dataclasses import dataclass, field
from typing import Any

from torchtitan.config import ParallelismConfig as TitanParallelism
from torchtitan.trainer import Trainer

from ...errors import UserError
from ...job.arguments import bool_value_hint, joined_lists
from ...job.config import Autoparallel
from ...job.explicit import cli_keys
from .quiet import warnings_off


@dataclass(kw_only=True, slots=True)
class ParallelismConfig(TitanParallelism):
    auto: bool = False
    """Let the planner choose the mesh and per-layer placements (degrees set by the config
    function or on the command line become constraints; unset ones are searched)."""


@dataclass(kw_only=True, slots=True)
class Config(Trainer.Config):
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    autoparallel: Autoparallel = field(default_factory=Autoparallel)


_AUTO_CLASSES: dict[type, type] = {}


def auto_class(base: type) -> type:
    """``base`` (``Trainer.Config`` or a subclass of it, e.g. the HF backend's) with
    ``parallelism.auto`` and the ``autoparallel`` section."""
    if base is Trainer.Config or issubclass(base, Config):
        return Config
    if base not in _AUTO_CLASSES:
        namespace = {"__annotations__": {"parallelism": ParallelismConfig,
                                         "autoparallel": Autoparallel},
                     "__module__": base.__module__, "__qualname__": base.__qualname__,
                     "parallelism": field(default_factory=ParallelismConfig),
                     "autoparallel": field(default_factory=Autoparallel)}
        _AUTO_CLASSES[base] = dataclass(kw_only=True, slots=True)(
            type(base.__name__, (base,), namespace))
    return _AUTO_CLASSES[base]


def with_auto(config: Any) -> Any:
    """A registry function's ``Trainer.Config`` (or subclass) with ``parallelism.auto`` and
    ``autoparallel`` (same values)."""
    if isinstance(config.parallelism, ParallelismConfig) and hasattr(config, "autoparallel"):
        return config
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name != "autoparallel"}
    par = values["parallelism"]
    values["parallelism"] = ParallelismConfig(
        **{f.name: getattr(par, f.name) for f in dataclasses.fields(par) if f.init})
    return auto_class(type(config))(**values)


def default_of(cls: type) -> Any:
    """``cls()`` without the warnings TorchTitan's configs log about their own defaults
    (e.g. a checkpoint config's ``initial_load_model_only`` without a load path)."""
    with warnings_off():
        return cls()


def _leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf value of a config tree as ``section.key`` (the model spec aside)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name == "model_spec":
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(_leaves(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def explicit_keys(config: Config, overrides: list[str]) -> frozenset[str]:
    """The keys the user set: on the command line (whatever the value), or in the config
    function (values other than ``Trainer.Config``'s defaults); the activation checkpointing
    policy counts as ``activation_checkpoint.mode``."""
    fresh = default_of(type(config))
    default = _leaves(fresh)
    values = _leaves(config)
    keys = {k for k, v in values.items() if k in default and default[k] != v}
    keys |= cli_keys(overrides, set(values))
    if type(config.activation_checkpoint) is not type(fresh.activation_checkpoint) or any(
            arg.startswith("activation-checkpoint:") or arg.startswith("activation_checkpoint:")
            for arg in overrides):
        keys.add("activation_checkpoint.mode")
    return frozenset(keys)


def _import_cause(argv: list[str]) -> str:
    """Why ``--module``'s config registry does not import (TorchTitan's error leaves it out),
    as a clause; "" when it imports or names no family."""
    import importlib

    module = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--module"), "")
    if not module or "." in module:
        return ""
    try:
        importlib.import_module(f"torchtitan.models.{module}.config_registry")
    except ModuleNotFoundError as exc:
        if exc.name and f"torchtitan.models.{module}".startswith(exc.name):
            return ""
        return f" ({type(exc).__name__}: {exc}; pip install -e '.[titan03]' brings what 0.3.0's "\
            "families import)"
    except Exception as exc:  # any import failure is reported in the line
        return f" ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    return ""


def _load_config(manager: Any, argv: list[str]) -> tuple[Any, list[str]]:
    """TorchTitan's ``--module`` / ``--config`` lookup and the config function's call; one
    line when the registry does not import (a syntax error included), the function raises, or
    it returns something other than a ``Trainer.Config``."""
    try:
        loaded, rest = manager._load_config(argv)
    except (ValueError, ImportError) as exc:
        raise UserError(f"{str(exc).splitlines()[0]}{_import_cause(argv)}") from None
    except SyntaxError as exc:
        raise UserError(f"--module's config registry does not import: {exc.msg} "
                        f"({exc.filename}, line {exc.lineno}); fix the file") from None
    except Exception as exc:  # the user's config function raised: its error, in one line
        name = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), "")
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UserError(f"config function {name} raised {type(exc).__name__}: {first[:200]}; "
                        "fix the function") from None
    if not isinstance(loaded, Trainer.Config):
        name = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), "")
        raise UserError(f"config function {name} returned {type(loaded).__name__}, not a "
                        "Trainer.Config: return one (e.g. Trainer.Config(model_spec=...) as "
                        "TorchTitan's config_registry functions do)")
    return loaded, rest


def config_nodes(config: Any, depth: int = 0) -> list[Any]:
    """Every dataclass in a config tree, also inside lists (a model's per-layer block
    configs, which ``Configurable.traverse`` does not enter)."""
    if depth > 16:
        return []
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return [config, *(node for f in dataclasses.fields(config)
                          for node in config_nodes(getattr(config, f.name, None), depth + 1))]
    if isinstance(config, (list, tuple)):
        return [node for item in config for node in config_nodes(item, depth + 1)]
    return []


def _check_experts(loaded: Any, rest: list[str]) -> None:
    """TorchTitan 0.3.0 validates CUDA graphs against the EP token dispatcher before anything
    else: an EP degree that divides no expert count is named first (the job parsed with CUDA
    graphs off, then its routed experts counted)."""
    import tyro
    from torchtitan.config.manager import custom_registry

    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings_off():
            probe = tyro.cli(type(loaded), args=[*rest, "--training.disable_cuda_graphs"],
                             default=loaded, registry=custom_registry)
    except (SystemExit, Exception):  # any other refusal: TorchTitan's own line stands
        return
    ep = probe.parallelism.expert_parallel_degree
    spec = probe.model_spec
    counts = sorted({n for node in (config_nodes(spec.model) if spec is not None else [])
                     if isinstance(n := getattr(node, "num_experts", None), int) and n > 0})
    if ep > 1 and counts and counts[0] % ep:
        raise UserError(f"parallelism.expert_parallel_degree = {ep} does not divide the "
                        f"{counts[0]} experts of {spec.name} {spec.flavor}: choose a divisor "
                        f"of {counts[0]}")


def parse_job(argv: list[str]) -> Config:
    """``--module M --config C [--section.key value ...]`` as TorchTitan 0.3.0 reads it, with
    ``parallelism.auto`` and ``autoparallel.*``; the keys the user set are recorded."""
    import tyro
    from torchtitan.config import ConfigManager
    from torchtitan.config.manager import custom_registry

    argv = joined_lists(list(argv))
    loaded, rest = _load_config(ConfigManager(), argv)
    loaded = with_auto(loaded)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            config = tyro.cli(type(loaded), args=rest, default=loaded, registry=custom_registry)
    except SystemExit:
        if bool_value_hint(rest):
            raise UserError(bool_value_hint(rest)) from None
        lines = [line.strip(" │╭╮╰╯─") for line in errors.getvalue().splitlines()]
        text = "; ".join(line for line in lines if line and "--help" not in line
                         and not line.startswith("usage"))
        if "CUDA graphs" in text:
            _check_experts(loaded, rest)
        raise UserError(f"TorchTitan's command line refused the arguments: {text[:300]}"
                        ) from None
    except (ValueError, TypeError) as exc:
        raise UserError(f"{str(exc).splitlines()[0]}") from None
    _EXPLICIT[id(config)] = explicit_keys(config, rest)
    return config


_EXPLICIT: dict[int, frozenset[str]] = {}
"""Explicit keys per parsed config (``Config`` has slots: no attribute to record them on)."""


def explicit_of(config: Config) -> frozenset[str]:
    """The keys the user set in ``config`` (as ``parse_job`` recorded them)."""
    return _EXPLICIT.get(id(config), frozenset())

