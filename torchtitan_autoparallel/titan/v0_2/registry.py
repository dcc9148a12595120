"""Registration with TorchTitan: train specs (bench flavors, offline data) and datasets.

The project's train specs are TorchTitan's own, re-registered under the same family names
through ``register_train_spec`` with three additions:

* a ``bench`` flavor (~10M parameters) per family, derived from the family's ``debugmodel``;
* the project's global-batch data loader for the project's datasets (other datasets keep the
  family's loader);
* the plan's application instead of the family's parallelize function when the job is planned
  (the ``autoparallel`` converter attaches the plan to the model);
* after parallelizing, the CPU/gloo gradient-reduction fix (no-op on GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.nn as nn

FAMILIES = ("llama3", "qwen3", "llama4", "deepseek_v3")
HF_BACKEND = "transformers_modeling_backend"
"""TorchTitan's Hugging Face backend (``torchtitan.experiments``): any HF causal LM."""

# Overrides applied to each family's ``debugmodel`` args to make its ``bench`` flavor.
BENCH_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama3": {"n_layers": 10, "n_heads": 8},
    "qwen3": {"n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "head_dim": 32, "hidden_dim": 1024,
              "enable_weight_tying": False},
    "llama4": {"n_layers": 4, "n_heads": 8},
    "deepseek_v3": {"n_layers": 4, "n_heads": 8},
}

# Extra flavors: name -> (base flavor, overrides). TorchTitan 0.2.2's own FSDP recipe puts the
# embedding and the output in separate FSDP groups, which fails for tied weights; its qwen3
# debug flavor ties them, so the CPU recipe configs use an untied copy.
# llama3 1B / 3B: Llama 3.2's shapes (untied output; TorchTitan's llama3 does not tie), sized
# for one GPU: the single-device runs that check the cost and memory model on real hardware.
EXTRA_FLAVORS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "qwen3": {"debugmodel_untied": ("debugmodel", {"enable_weight_tying": False})},
    "llama3": {
        "1B": ("8B", {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                      "multiple_of": 256, "ffn_dim_multiplier": 1.5}),
        "3B": ("8B", {"dim": 3072, "n_layers": 28, "n_heads": 24, "n_kv_heads": 8,
                      "multiple_of": 256, "ffn_dim_multiplier": 1.0}),
    },
}

_registered = False


def _with_plan_and_cpu_reduction(
    parallelize_fn: Callable[..., nn.Module],
) -> Callable[..., nn.Module]:
    """The family's parallelize function, or the plan's application when the ``autoparallel``
    converter attached a plan to the model; then the CPU gradient-reduction fix."""
    from .apply import apply_plan
    from .converter import PLAN_ATTR
    from .cpu import force_sum_reduction

    def parallelize(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
        plan = getattr(model, PLAN_ATTR, None)
        if plan is not None:
            model = apply_plan(model, parallel_dims, job_config, plan)
        else:
            model = parallelize_fn(model, parallel_dims, job_config)
        force_sum_reduction(model)
        return model

    parallelize.__name__ = getattr(parallelize_fn, "__name__", "parallelize")
    parallelize.__wrapped__ = parallelize_fn  # type: ignore[attr-defined]
    parallelize.applies_plans = True  # type: ignore[attr-defined]
    return parallelize


def _with_global_batch_loader(family_loader: Callable[..., Any]) -> Callable[..., Any]:
    from .data import DATASET_NAMES, build_global_batch_dataloader

    def build_dataloader(*args: Any, **kwargs: Any) -> Any:
        job_config = kwargs.get("job_config")
        if job_config is not None and job_config.training.dataset in DATASET_NAMES:
            return build_global_batch_dataloader(*args, **kwargs)
        return family_loader(*args, **kwargs)

    return build_dataloader


def bench_args(family: str, debug_args: Any) -> Any:
    """The family's ``bench`` flavor: its ``debugmodel`` args with ``BENCH_OVERRIDES``."""
    return dataclasses.replace(debug_args, **BENCH_OVERRIDES[family])


def register() -> None:
    """Register datasets and the project's train specs with TorchTitan (idempotent)."""
    global _registered
    if _registered:
        return
    from torchtitan.protocols import train_spec as ts

    from .converter import register_converter
    from .data import register_datasets

    register_datasets()
    register_converter()
    for family in FAMILIES:
        if family in ts._extra_train_specs:
            continue
        base = ts.get_train_spec(family)
        model_args = dict(base.model_args)
        model_args["bench"] = bench_args(family, model_args["debugmodel"])
        for name, (base_flavor, overrides) in EXTRA_FLAVORS.get(family, {}).items():
            model_args[name] = dataclasses.replace(model_args[base_flavor], **overrides)
        ts.register_train_spec(family, _plannable(base, model_args=model_args))
    _registered = True


def _plannable(spec: Any, **changes: Any) -> Any:
    """``spec`` applying attached plans and reading the project's datasets."""
    return dataclasses.replace(
        spec,
        parallelize_fn=_with_plan_and_cpu_reduction(spec.parallelize_fn),
        build_dataloader_fn=_with_global_batch_loader(spec.build_dataloader_fn),
        **changes,
    )


def train_spec_of(name: str) -> Any:
    """TorchTitan's train spec ``name``; a one-line error when none is registered."""
    from torchtitan.protocols.train_spec import get_train_spec

    from ...errors import UserError

    try:
        return get_train_spec(name)
    except ValueError as exc:
        raise UserError(f"model.name {name!r} has no train spec: register one with "
                        "register_train_spec in the module experimental.custom_import names"
                        ) from exc
    except ImportError as exc:  # an experiment whose optional packages are missing
        from ...errors import shown

        extra = " (pip install -e '.[hf]')" if name == HF_BACKEND else ""
        raise UserError(f"model.name {name!r} cannot be imported: {shown(exc, 200)}; install "
                        f"what it needs{extra}") from None


def make_plannable(name: str) -> None:
    """Let train spec ``name`` run plans: any spec the project does not register itself (a
    user's, registered through ``experimental.custom_import``, or another TorchTitan family)
    gets the same plan application and data loader as the project's own (idempotent)."""
    from torchtitan.protocols import train_spec as ts

    spec = train_spec_of(name)
    if getattr(spec.parallelize_fn, "applies_plans", False):
        return
    changes: dict[str, Any] = {}
    if name == HF_BACKEND:
        from ...runtime.hf import with_rotary_in_every_stage, with_rotary_reset

        changes["model_cls"] = with_rotary_reset(spec.model_cls)
        if spec.pipelining_fn is not None:
            changes["pipelining_fn"] = with_rotary_in_every_stage(spec.pipelining_fn)
    # TorchTitan's register_train_spec refuses a second registration of a name
    ts._extra_train_specs[name] = _plannable(spec, **changes)


def import_custom_module(job_config: Any) -> None:
    """Import ``experimental.custom_import`` (the user's train spec and adapter) before
    planning; TorchTitan's Trainer imports it again later (a no-op)."""
    import importlib

    from ...errors import UserError

    module = job_config.experimental.custom_import
    if not module:
        return
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise UserError(f"experimental.custom_import = {module!r} cannot be imported ({exc}): "
                        "put its package on PYTHONPATH") from None
