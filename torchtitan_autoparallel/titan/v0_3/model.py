"""TorchTitan 0.3.0's models: a family's ``model_registry(flavor)`` spec, set up for the job's
sequence length as its trainer does (``update_from_config``), built on meta and read into a
layer graph."""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from ...errors import UserError, shown
from ...graph.discover import get_adapter
from ...graph.layer_graph import LayerGraph, graph_of_model, meta_model


def family_module(name: str) -> Any:
    """The package of model family ``name`` (``torchtitan.models.<name>`` or an experiment's),
    the one that defines its ``model_registry``."""
    for prefix in ("torchtitan.models", "torchtitan.experiments"):
        try:
            module = importlib.import_module(f"{prefix}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name and (f"{prefix}.{name}".startswith(exc.name)):
                continue
            raise UserError(f"model {name!r} cannot be imported: {shown(exc, 200)}; install "
                            "what it needs") from None
        if hasattr(module, "model_registry"):
            return module
    from torchtitan.models import _supported_models

    raise UserError(f"model {shown(name)} is not a TorchTitan 0.3.0 family: choose one of "
                    f"{sorted(_supported_models)}")


def model_spec(name: str, flavor: str, **kwargs: Any) -> Any:
    """``model_registry(flavor, **kwargs)`` of family ``name`` (keyword arguments it does not
    take are left out)."""
    registry = family_module(name).model_registry
    accepted = inspect.signature(registry).parameters
    try:
        return registry(flavor, **{k: v for k, v in kwargs.items() if k in accepted})
    except KeyError:
        flavors = _flavors(family_module(name))
        raise UserError(f"unknown flavor {shown(flavor)} for {name}: choose one of "
                        f"{flavors}") from None


def _flavors(module: Any) -> list[str]:
    tables = [v for k, v in vars(module).items() if k.endswith("_configs") and isinstance(v, dict)]
    return sorted(tables[0]) if tables else []


def as_sdpa(model_config: Any) -> str:
    """Swap every flex / varlen attention of ``model_config`` for SDPA (what the layer graph
    measures: those kernels with causal, sliding-window or document masks do at most causal
    SDPA's work); returns the kind the config ran ("flex", "varlen", "sdpa")."""
    from torchtitan.models.common import attention

    kind = "sdpa"
    for cls, name in ((attention.FlexAttention.Config, "flex"),
                      (attention.VarlenAttention.Config, "varlen")):
        for _, _, parent, attr in list(model_config.traverse(cls)):
            kind = name
            sdpa = attention.ScaledDotProductAttention.Config()
            if isinstance(attr, int):
                parent[attr] = sdpa
            else:
                setattr(parent, attr, sdpa)
    return kind


def sized_for(model_config: Any, seq_len: int) -> Any:
    """``model_config`` set up for ``seq_len`` as TorchTitan's trainer does
    (``update_from_config`` with a default trainer config of that length)."""
    from torchtitan.trainer import Trainer

    config = Trainer.Config()
    config.training.seq_len = seq_len
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # TorchTitan's warnings about this machine, not the job
    try:
        model_config.update_from_config(config=config)
    finally:
        root.setLevel(level)
    return model_config


def read_model(name: str, flavor: str, seq_len: int, model_config: Any = None) -> LayerGraph:
    """The layer graph of family ``name``'s ``flavor`` at ``seq_len``, its attention measured
    as causal SDPA; the graph records the attention the flavor runs."""
    config = model_spec(name, flavor).model
    kind = as_sdpa(config)
    sized_for(config, seq_len)
    try:
        model = meta_model(config.build)
    except Exception as exc:
        raise UserError(f"model {name!r} {flavor!r} cannot be built on the meta device: "
                        f"{shown(exc, 200)}") from None
    _check_decoder_only(name, flavor, model)
    return graph_of_model(name, flavor, model, seq_len, kind, True, config)


def _check_decoder_only(name: str, flavor: str, model: Any) -> None:
    """Refuse a model with parameters outside its embedding, blocks, final norm and output
    (e.g. qwen3_5's and Kimi's vision encoders): their memory and time would go uncosted."""
    adapter = get_adapter(name, model)
    read = {adapter.embedding, adapter.blocks, adapter.final_norm, adapter.output}
    outside = [n for n, m in model.named_children()
               if n not in read and any(True for _ in m.parameters())]
    if outside:
        count = sum(p.numel() for n in outside for p in model.get_submodule(n).parameters())
        raise UserError(f"model {name!r} {flavor!r} has {count:,} parameters outside its "
                        f"embedding, blocks and output ({', '.join(outside)}): the planner "
                        "reads decoders only; drop --parallelism.auto for this model")
