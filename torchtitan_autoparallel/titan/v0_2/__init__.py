"""TorchTitan 0.2.2: TOML job configs (``JobConfig``), train specs, ``parallelize_*`` recipes."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

from ...errors import UserError, shown
from ...frontend import Frontend, register_frontend
from ...graph.adapters import register_adapter, registered_adapter
from ...graph.layer_graph import LayerGraph
from ...job.model_config import ModelConfig
from .model import build_layer_graph, graph_job_config
from .registry import HF_BACKEND, import_custom_module, register, train_spec_of
from .tp_dp import ATTENTION_DP_FAMILIES, MOE_SUB_BLOCKS_APPLIED


def read_model(name: str, flavor: str, seq_len: int, model_config: ModelConfig | None = None
               ) -> LayerGraph:
    """The layer graph of train spec ``name``'s ``flavor`` at ``seq_len``; ``model_config``:
    the job's custom config sections the model args read (e.g. the HF backend's
    ``[hf_transformers]``)."""
    spec = train_spec_of(name)
    if flavor not in spec.model_args:
        raise UserError(f"unknown flavor {shown(flavor)} for {name}: choose one of "
                        f"{sorted(spec.model_args)}")
    job: Any = graph_job_config(model_config, seq_len) if model_config and model_config.sections \
        else None
    if name == HF_BACKEND and job is not None:  # what the backend cannot run
        from .hf_check import check_hf_spec

        section = job.hf_transformers
        check_hf_spec(spec, flavor, job, str(getattr(section, "model", "")))
    graph = build_layer_graph(name, flavor, spec.model_args[flavor], spec.model_cls, seq_len,
                              job)
    if spec.pipelining_fn is None:
        graph = dataclasses.replace(graph, excluded=tuple(sorted((*graph.excluded, (
            "pp", f"train spec {name!r} has no pipelining function")))))
    return graph


def attention_types() -> tuple[type, ...]:
    from torchtitan.models import attention

    return (attention.ScaledDotProductAttentionWrapper, attention.FlexAttentionWrapper)


def moe_types() -> tuple[type, ...]:
    from torchtitan.models.moe import MoE

    return (MoE,)


def parallelize_module(name: str) -> Any:
    """The module defining train spec ``name``'s parallelize function (unwrapped)."""
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        fn = inspect.unwrap(get_train_spec(name).parallelize_fn)
    except ValueError:  # a model class without a train spec (planned directly)
        return None
    return sys.modules.get(getattr(fn, "__module__", ""), None)


def model_names() -> list[str]:
    """Names ``get_train_spec`` resolves: a model of ``torchtitan.models``, an experiment of
    ``torchtitan.experiments`` or a registered train spec."""
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models
    from torchtitan.protocols import train_spec

    return sorted(set(_supported_models) | set(_supported_experiments)
                  | set(train_spec._extra_train_specs))


def prepare_models(custom_import: str) -> None:
    """The project's train specs registered; the user's module imported."""
    from types import SimpleNamespace

    register()
    if custom_import:
        import_custom_module(SimpleNamespace(
            experimental=SimpleNamespace(custom_import=custom_import)))


register_frontend(Frontend(release="0.2", read_model=read_model, attention_types=attention_types,
                           moe_types=moe_types, parallelize_module=parallelize_module,
                           model_names=model_names, prepare_models=prepare_models,
                           moe_sub_block_modes=MOE_SUB_BLOCKS_APPLIED))
# the families whose MoE blocks' attention the apply runs data parallel over tp (tp_dp.py);
# other MoE families take a MoE block's data-parallel MoE alone
for _family in ATTENTION_DP_FAMILIES:
    register_adapter(_family, dataclasses.replace(
        registered_adapter(_family), moe_sub_block_modes=MOE_SUB_BLOCKS_APPLIED), replace=True)
