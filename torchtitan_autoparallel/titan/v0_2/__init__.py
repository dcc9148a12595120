"""TorchTitan 0.2.2: TOML job configs (``JobConfig``), train specs, ``parallelize_*`` recipes."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import UserError, shown
from ...frontend import Frontend, register_frontend
from ...graph.layer_graph import LayerGraph
from ...model_config import ModelConfig, graph_job_config
from ...registry import train_spec_of
from .model import build_layer_graph


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
    graph = build_layer_graph(name, flavor, spec.model_args[flavor], spec.model_cls, seq_len,
                              job)
    if spec.pipelining_fn is None:
        graph = dataclasses.replace(graph, excluded=tuple(sorted((*graph.excluded, (
            "pp", f"train spec {name!r} has no pipelining function")))))
    return graph


register_frontend(Frontend(release="0.2", read_model=read_model))
