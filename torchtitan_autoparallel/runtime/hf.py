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
* ``reset_nonpersistent_buffers``: HF's rotary embeddings keep ``inv_freq`` (and
  ``original_inv_freq``; Gemma its ``embed_scale``) as non-persistent buffers computed in
  ``__init__``. TorchTitan builds the model on meta, then ``to_empty`` + the backend's
  ``init_weights``, which re-initialises parameters: 0.2.2's leaves ``inv_freq`` as
  uninitialised memory, and 0.3.0's ``init_states`` looks for a ``rope_init_fn`` attribute
  transformers 5 no longer has while its patched ``_init_weights`` skips rotary modules, so
  the losses depend on what the allocator left there; a checkpoint never restores them
  (non-persistent). Each such buffer of a transformers module is filled with NaN, then written
  by the HF model's own ``_init_weights`` and HF's rope init function; one left NaN is refused
  in one line. Installed by ``with_rotary_reset`` (0.2.2's train spec) and
  ``titan.v0_3.model.reset_hf_buffers_in_init_states`` (0.3.0's ``HFTransformerModel``,
  installed by the project's ``titan.v0_3.train``). On 0.2.2 the parameters are NaN-filled
  before ``init_weights`` too: one its ``_init_weights`` does not know (Mixtral's experts'
  ``w1`` / ``w2`` / ``w3``, which trained to NaN losses) is refused in one line. Tested by
  tests/test_hf_backend.py::test_rotary_buffers_after_meta_init and ::test_mixtral_*, and
  tests_v0_3/test_hf_backend_v0_3.py (two malloc fill patterns, bit-identical losses).
* ``with_rotary_in_every_stage``: the backend's pipeline split drops ``rotary_emb`` from stages
  given in the config (see there).
"""

from __future__ import annotations

import contextlib
import copy
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


def _rope_init(module: nn.Module) -> Any:
    """HF's own init function of a rotary embedding: transformers 4's ``rope_init_fn``
    attribute, else what transformers 5's ``PreTrainedModel._init_weights`` picks
    (``ROPE_INIT_FUNCTIONS[rope_type]``, or the module's ``compute_default_rope_parameters``);
    None for a module that is none (or keeps one rope type per layer type: its model's own
    ``_init_weights`` computes those)."""
    init = getattr(module, "rope_init_fn", None)
    rope_type = getattr(module, "rope_type", None)
    if init is not None or not isinstance(rope_type, str):
        return init
    if rope_type == "default":
        return getattr(module, "compute_default_rope_parameters", None)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (written in place), a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _write(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """``value`` (the full tensor) into ``buffer``, a plain tensor or a DTensor."""
    value = value.to(device=_local(buffer).device, dtype=buffer.dtype)
    if hasattr(buffer, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value, buffer.device_mesh, buffer.placements).to_local()
    _local(buffer).copy_(value)


def _nonpersistent(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own non-persistent floating-point buffers that hold memory, for a module of
    transformers (also as TorchTitan 0.3.0's backend converts it: a subclass); TorchTitan's own
    modules (its MoE's ``tokens_per_expert``) are its ``init_weights``'s."""
    if not any(c.__module__.startswith("transformers.") for c in type(module).__mro__):
        return {}
    return {name: buf for name, buf in module._buffers.items()
            if name in module._non_persistent_buffers_set and isinstance(buf, torch.Tensor)
            and buf.is_floating_point() and not buf.is_meta}


def _hf_init(hf_model: nn.Module, module: nn.Module) -> None:
    """HF's model-specific ``_init_weights`` on ``module``'s buffers only: it runs on a stand-in
    sharing the buffers, its parameters on meta (the trainer has initialised the real ones)."""
    stand_in = copy.copy(module)
    stand_in._parameters = {name: None if p is None else nn.Parameter(
        torch.empty_like(p, device="meta"), requires_grad=False)
        for name, p in module._parameters.items()}
    stand_in._buffers = {name: None if b is None else _local(b)
                         for name, b in module._buffers.items()}
    hf_model._init_weights(stand_in)


def reset_nonpersistent_buffers(model: nn.Module) -> list[str]:
    """Recompute every non-persistent buffer of the HF model inside ``model`` as HF does after a
    meta build: each buffer is first filled with NaN, then the HF model's own ``_init_weights``
    and, for rotary embeddings, HF's rope init function write it. Returns the buffers reset;
    UserError naming a buffer neither writes (it would train on NaN)."""
    from transformers import PreTrainedModel

    hf_model = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    done, left = [], []
    for fqn, module in model.named_modules():
        buffers = _nonpersistent(module)
        if not buffers:
            continue
        with torch.no_grad():
            for buf in buffers.values():
                _local(buf).fill_(float("nan"))
            if hf_model is not None:
                _hf_init(hf_model, module)
            init = _rope_init(module)
            if init is not None and "inv_freq" in buffers:
                inv_freq, scaling = init(module.config, _local(buffers["inv_freq"]).device)
                for name in ("inv_freq", "original_inv_freq"):
                    if name in buffers:
                        _write(buffers[name], inv_freq)
                module.attention_scaling = scaling
        for name, buf in buffers.items():
            (left if torch.isnan(_local(buf)).any() else done).append(f"{fqn}.{name}")
    if left:
        from ..errors import UserError

        raise UserError(f"the HF model's non-persistent buffer {left[0]} ({len(left)} in all) "
                        "is not recomputed after the meta build (neither its model's "
                        "_init_weights nor a rope init function writes it): this architecture "
                        "cannot be trained through the HF backend here")
    return done


def reset_rotary_buffers(model: nn.Module) -> int:
    """``reset_nonpersistent_buffers``; how many rotary ``inv_freq`` buffers were reset."""
    return sum(name.endswith("inv_freq") and not name.endswith("original_inv_freq")
               for name in reset_nonpersistent_buffers(model))


def with_rotary_reset(model_cls: type) -> type:
    """``model_cls`` (TorchTitan 0.2.2's ``HFTransformerModel``) whose ``init_weights`` also
    recomputes the non-persistent buffers and refuses parameters it leaves unwritten (see the
    module docstring)."""

    class HFModelWithRotaryReset(model_cls):  # type: ignore[misc, valid-type]
        def init_weights(self, *args: Any, **kwargs: Any) -> None:
            params = {n: _local(p) for n, p in self.named_parameters() if not p.is_meta}
            with torch.no_grad():
                for param in params.values():
                    param.fill_(float("nan"))
            super().init_weights(*args, **kwargs)
            reset_nonpersistent_buffers(self)
            left = [n for n, p in params.items() if torch.isnan(p).any()]
            if left:
                from ..errors import UserError

                raise UserError(
                    f"TorchTitan 0.2.2's HF backend leaves {left[0]} ({len(left)} parameters "
                    "in all) uninitialised: its init_weights does not know this "
                    f"architecture's {type(self.model).__name__} modules, which would train "
                    "from whatever memory held; this architecture cannot be trained with the "
                    "backend")

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
