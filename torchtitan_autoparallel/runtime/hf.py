"""Workarounds for Hugging Face models run through TorchTitan's HF backend
(``torchtitan.experiments.transformers_modeling_backend``, transformers 4.57).

* ``meta_autocast``: HF's rotary embeddings open ``torch.autocast(device_type=x.device.type,
  enabled=False)`` to force float32; on the meta device that is ``device_type='meta'``, which
  torch refuses ("unsupported scalarType"), so the model cannot be run on meta tensors (the
  layer graph's block capture). Inside this context a meta autocast is a CPU one (disabled
  either way: a no-op). Tested by tests/test_hf_backend.py::test_layer_graph_of_hf_model.
* ``meta_capture``: ``meta_autocast``, and transformers 5's mask builder, which looks for packed
  sequences in ``position_ids`` with ``.all()`` (a host read, refused on meta tensors), told
  there are none on meta inputs (the layer graph measures one unpacked causal sequence).
  Tested by tests_v0_3/test_hf_backend_v0_3.py.
* ``reset_rotary_buffers``: HF's rotary embeddings keep ``inv_freq`` as a non-persistent buffer
  computed in ``__init__``. TorchTitan builds the model on meta, then ``to_empty`` + the
  backend's ``init_weights``, which re-initialises parameters only: ``inv_freq`` is left as
  uninitialised memory (values ~1e-38, or NaN with deterministic fills), and a checkpoint never
  restores it (non-persistent). Recomputed here from the model's config after
  ``init_weights``. Tested by tests/test_hf_backend.py::test_rotary_buffers_after_meta_init.
* ``with_rotary_in_every_stage``: the backend's pipeline split drops ``rotary_emb`` from stages
  given in the config (see there).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn


@contextlib.contextmanager
def meta_autocast() -> Iterator[None]:
    """``torch.autocast(device_type='meta', ...)`` acts as a CPU autocast inside."""
    original = torch.autocast

    class _Autocast(original):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast = _Autocast  # type: ignore[misc]
    try:
        with warnings.catch_warnings():  # an fp32 region (Kimi's encoder) is no CPU autocast
            warnings.filterwarnings("ignore", message=".*CPU [Aa]utocast")
            yield
    finally:
        torch.autocast = original  # type: ignore[misc]


@contextlib.contextmanager
def meta_capture() -> Iterator[None]:
    """``meta_autocast``, with transformers' packed-sequence search skipped on meta inputs."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is not None:
        def find(position_ids: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(position_ids, torch.Tensor) and position_ids.is_meta:
                return None
            return original(position_ids, *args, **kwargs)

        masking.find_packed_sequence_indices = find
    try:
        with meta_autocast():
            yield
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original


def reset_rotary_buffers(model: nn.Module) -> int:
    """Recompute ``inv_freq`` of every HF rotary embedding in ``model`` (on its current device)
    from the embedding's config; returns how many were reset."""
    count = 0
    for module in model.modules():
        init = getattr(module, "rope_init_fn", None)
        buffer = getattr(module, "inv_freq", None)
        if init is None or not isinstance(buffer, torch.Tensor) or buffer.is_meta:
            continue
        inv_freq, scaling = init(module.config, buffer.device)
        with torch.no_grad():
            buffer.copy_(inv_freq.to(buffer.dtype))
        module.original_inv_freq = buffer
        module.attention_scaling = scaling
        count += 1
    return count


def with_rotary_reset(model_cls: type) -> type:
    """``model_cls`` (the backend's ``HFTransformerModel``) whose ``init_weights`` also
    recomputes the rotary buffers (see the module docstring)."""

    class HFModelWithRotaryReset(model_cls):  # type: ignore[misc, valid-type]
        def init_weights(self, *args: Any, **kwargs: Any) -> None:
            super().init_weights(*args, **kwargs)
            reset_rotary_buffers(self)

    return HFModelWithRotaryReset


ROTARY = "rotary_emb"


def with_rotary_in_every_stage(pipelining_fn: Any) -> Any:
    """The backend's ``pipeline_hf_transformers`` with ``rotary_emb`` kept in every stage.

    Upstream (TorchTitan 0.2.2's HF backend): its pipeline split replaces every top-level
    module a stage's ``module_fqns_per_model_part`` does not name by ``nn.Identity``; its own
    split names ``rotary_emb`` in every stage, but a split given in the config (TorchTitan's
    convention: ``tok_embeddings``, ``layers.N``, ``norm``, ``output``, as the planner writes
    it) does not, and every stage then runs without its rotary embedding and fails. Tested by
    tests/test_hf_backend.py::test_pipeline_parity."""

    def pipeline(model: nn.Module, parallel_dims: Any, job_config: Any, *args: Any,
                 **kwargs: Any) -> Any:
        par = job_config.parallelism
        if par.module_fqns_per_model_part:
            par.module_fqns_per_model_part = [
                list(stage) if ROTARY in stage else [*stage, ROTARY]
                for stage in par.module_fqns_per_model_part]
        return pipelining_fn(model, parallel_dims, job_config, *args, **kwargs)

    pipeline.__wrapped__ = pipelining_fn  # type: ignore[attr-defined]
    return pipeline
