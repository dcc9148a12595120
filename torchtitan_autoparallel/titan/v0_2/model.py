"""TorchTitan 0.2.2's models: a registered train spec's flavor, set up as its trainer does,
built on meta and read into a layer graph."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
from typing import Any

from ...errors import UserError
from ...graph.adapters import ModelAdapter
from ...graph.layer_graph import LayerGraph, graph_of_model, meta_model, planning_model
from ...job.model_config import ModelConfig


def _assign(target: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        current = getattr(target, key, None)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            _assign(current, value)
        else:
            setattr(target, key, value)


def graph_job_config(model_config: ModelConfig | None, seq_len: int) -> Any:
    """A default TorchTitan job config (merged with ``model_config.module``'s sections, set to
    its values) for ``seq_len``: what the layer graph hands ``update_from_config``."""
    from torchtitan.config import ConfigManager, JobConfig

    cls: Any = JobConfig
    if model_config is not None and model_config.module:
        try:
            extension = importlib.import_module(model_config.module).JobConfig
        except (ImportError, AttributeError) as exc:
            raise UserError(f"job.custom_config_module = {model_config.module!r} cannot be "
                            f"imported ({exc}); install what it needs") from None
        cls = ConfigManager._merge_configs(JobConfig, extension)
    job = cls()
    if model_config is not None:
        _assign(job, model_config.sections)
    job.training.seq_len = seq_len
    return job


def measurable_args(model_args: Any, seq_len: int, job: Any = None) -> tuple[Any, str]:
    """A private copy of the model args for ``seq_len``, set up as TorchTitan's trainer does
    (``update_from_config`` with ``job``, default TorchTitan's default job config), with
    attention measured as causal SDPA: flex / varlen kernels with document masks do at most the
    causal work. Returns (args, the model's own attention)."""
    from torchtitan.config import JobConfig

    args = copy.deepcopy(model_args)
    attn_type = getattr(args, "attn_type", "sdpa")
    if hasattr(args, "attn_type"):
        args.attn_type = "sdpa"
    if hasattr(args, "attn_mask_type"):
        args.attn_mask_type = "causal"
    job = JobConfig() if job is None else job
    job.training.seq_len = seq_len
    # quiet: TorchTitan warns about this machine's kernels (grouped mm), not the job's
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        args.update_from_config(job)
    finally:
        root.setLevel(level)
    args.max_seq_len = seq_len
    return args, attn_type


def build_layer_graph(family: str, flavor: str, model_args: Any, model_cls: type, seq_len: int,
                      job_config: Any = None) -> LayerGraph:
    """Read ``model_cls(model_args)`` (built on meta) into a LayerGraph for sequences of
    ``seq_len`` tokens. ``job_config``: what the model args' ``update_from_config`` reads
    (default: TorchTitan's default job config)."""
    grouped = bool(getattr(getattr(model_args, "moe_args", None), "use_grouped_mm", True))
    args, attn_type = measurable_args(model_args, seq_len, job_config)
    model = meta_model(lambda: model_cls(args))
    return graph_of_model(family, flavor, model, seq_len, attn_type, grouped, args)


def planning_adapter(family: str, model_args: Any, model_cls: type, seq_len: int,
                     job_config: Any = None) -> ModelAdapter:
    """The adapter ``build_layer_graph`` reads the model with (an inferred TP function
    included): what applying a plan needs where the registered adapter has no ``tp_fn``."""
    args, _ = measurable_args(model_args, seq_len, job_config)
    return planning_model(family, meta_model(lambda: model_cls(args)), seq_len)[0]
