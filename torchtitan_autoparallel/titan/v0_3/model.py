"""TorchTitan 0.3.0's models: a family's ``model_registry(flavor)`` spec, set up for the job's
sequence length as its trainer does (``update_from_config``), built on meta and read into a
layer graph."""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ...errors import UserError, shown
from ...graph.discover import get_adapter
from ...graph.layer_graph import LayerGraph, graph_of_model, meta_model
from ...job.model_config import ModelConfig
from .quiet import warnings_off

HF_BACKEND = "transformers_modeling_backend"
"""TorchTitan 0.3.0's HF backend (``torchtitan.experiments.transformers_modeling_backend``):
any Hugging Face causal LM, its config from ``--hf_model`` (a Hub id or a local folder)."""
HF_SECTION = "hf_transformers"
"""The model-config section that carries ``hf_model`` (named as 0.2.2's backend names it, so
plans of both releases record the HF config the same way)."""


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


def trainer_config(name: str, sections: dict[str, Any] | None = None) -> Any:
    """A default trainer config of family ``name`` (the HF backend's carries ``hf_model``)."""
    if name == HF_BACKEND:
        from torchtitan.experiments.transformers_modeling_backend.configs import (
            TransformersBackendConfig,
        )

        from .config import default_of

        config = default_of(TransformersBackendConfig)
        config.hf_model = str(((sections or {}).get(HF_SECTION) or {}).get("model", ""))
        return config
    from torchtitan.trainer import Trainer

    return Trainer.Config()


def hf_as_sdpa(model_config: Any) -> str:
    """The HF backend's attention implementation set to SDPA (what the layer graph measures,
    as ``as_sdpa`` does for TorchTitan's models); returns the kind it ran."""
    ran = str(getattr(model_config, "attn_implementation", "") or "sdpa")
    model_config.attn_implementation = "sdpa"
    model_config._attn_implementation = "sdpa"
    return "flex" if "flex" in ran else ("varlen" if "varlen" in ran else "sdpa")


def sized_for(model_config: Any, seq_len: int, config: Any = None) -> Any:
    """``model_config`` set up for ``seq_len`` as TorchTitan's trainer does
    (``update_from_config`` with ``config``, default a trainer config, of that length)."""
    from torchtitan.trainer import Trainer

    config = config if config is not None else Trainer.Config()
    config.training.seq_len = seq_len
    with warnings_off():  # TorchTitan's warnings about this machine, not the job
        model_config.update_from_config(config=config)
    return model_config


def model_on_meta(model_config: Any, seq_len: int, trainer: Any, hf: bool,
                  cannot: Callable[[Exception], str]) -> tuple[Any, Any, str]:
    """(model, its config, the attention kind the config ran): a copy of ``model_config`` with
    its attention as SDPA (``as_sdpa``; with ``hf``, the HF backend's too: ``hf_as_sdpa``), set
    up for ``seq_len`` as the trainer config ``trainer`` sets it up (``sized_for``), and the
    model built from it on meta. A build that fails is one line, ``cannot(error)``."""
    # a copy: a registry may hand out one shared config per flavor (the HF backend's does),
    # which the job's trainer then builds
    config = copy.deepcopy(model_config)
    kind = as_sdpa(config)
    sized_for(config, seq_len, trainer)
    if hf:
        kind = hf_as_sdpa(config)
    try:
        with warnings_off():
            model = meta_model(config.build)
    except Exception as exc:
        raise UserError(cannot(exc)) from None
    return model, config, kind


def read_model(name: str, flavor: str, seq_len: int, model_config: ModelConfig | None = None
               ) -> LayerGraph:
    """The layer graph of family ``name``'s ``flavor`` at ``seq_len``, its attention measured
    as causal SDPA; the graph records the attention the flavor runs. ``model_config``: the
    HF backend's ``hf_model``."""
    sections = model_config.sections if model_config else None
    model, config, kind = model_on_meta(
        model_spec(name, flavor).model, seq_len, trainer_config(name, sections),
        name == HF_BACKEND,
        lambda exc: f"model {name!r} {flavor!r} cannot be built on the meta device: "
                    f"{shown(exc, 200)}")
    _check_decoder_only(name, flavor, model)
    graph = graph_of_model(name, flavor, model, seq_len, kind, True, config)
    if name == HF_BACKEND:
        from .hf_check import check_hf_model

        check_hf_model(model, str((sections or {}).get(HF_SECTION, {}).get("model", "")))
    return graph


def _check_decoder_only(name: str, flavor: str, model: Any) -> None:
    """Refuse a model with parameters outside its embedding, encoders, blocks, final norm and
    output: their memory and time would go uncosted."""
    adapter = get_adapter(name, model)
    read = {adapter.embedding, adapter.blocks, adapter.final_norm, adapter.output,
            *adapter.encoders}
    outside = [n for n, m in model.named_children()
               if n not in read and any(True for _ in m.parameters())]
    if outside:
        count = sum(p.numel() for n in outside for p in model.get_submodule(n).parameters())
        raise UserError(f"model {name!r} {flavor!r} has {count:,} parameters outside its "
                        f"embedding, encoders, blocks and output ({', '.join(outside)}): the "
                        "planner reads decoders and their registered encoders only "
                        "(ModelAdapter.encoders); drop --parallelism.auto for this model")


def check_hf_config(config: Any) -> None:
    """``hf_check.check_hf_model`` on the model ``config`` (an HF backend trainer config)
    builds, built on meta at the job's sequence length; a build that fails is one line."""
    from .hf_check import check_hf_model

    hf_model = str(getattr(config, "hf_model", ""))
    model, _, _ = model_on_meta(
        config.model_spec.model, config.training.seq_len, copy.deepcopy(config), True,
        lambda exc: f"TorchTitan 0.3.0's HF backend cannot build the model of --hf_model "
                    f"{hf_model}: {type(exc).__name__}: {shown(exc, 200)}")
    check_hf_model(model, hf_model)


def reset_hf_buffers_in_init_states() -> None:
    """The HF backend's ``HFTransformerModel.init_states`` followed by
    ``runtime.hf.reset_nonpersistent_buffers`` (idempotent). Upstream, TorchTitan 0.3.0's
    ``init_states`` looks for a ``rope_init_fn`` attribute transformers 5 no longer has and its
    patched ``_init_weights`` skips rotary modules: ``inv_freq`` kept what memory held (see
    runtime/hf.py). Tested by tests_v0_3/test_hf_backend_v0_3.py."""
    from torchtitan.experiments.transformers_modeling_backend.model import HFTransformerModel

    from ...runtime.hf import reset_nonpersistent_buffers

    original = HFTransformerModel.init_states
    if getattr(original, "resets_buffers", False):
        return

    def init_states(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        reset_nonpersistent_buffers(self)

    init_states.resets_buffers = True  # type: ignore[attr-defined]
    init_states.__wrapped__ = original  # type: ignore[attr-defined]
    HFTransformerModel.init_states = init_states  # type: ignore[method-assign]
