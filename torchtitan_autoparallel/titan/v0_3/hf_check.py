"""Whether TorchTitan 0.3.0's HF backend can run a Hugging Face architecture at all, asked before
any rank starts (planning, ``run_train.sh``'s preflight, a recipe run through this project).

The backend's ``parallelize_hf_transformers`` converts every HF module to TorchTitan's ``Module``
protocol and declares sharding on it (``hf_sharding.set_hf_sharding_configs``), then runs
``model.parallelize`` -- on every run, one rank and no TP included. Architectures its declarations
do not cover stop there with a traceback (Phi-3's fused ``qkv_proj``: "no recognized query
projection"; Gemma's scaled embedding, called with ``input_ids``: "in_dst_shardings is missing
entries"). Here the same two backend functions run on a model built on meta, and each converted
module with a ``local_map`` region is wrapped by TorchTitan's own ``_maybe_wrap_with_local_region``
up to the point where it needs a device mesh (its input check comes first); whatever they raise
is one line naming the architecture.
"""

from __future__ import annotations

from typing import Any

from ...errors import UserError


class _MeshNeeded(Exception):
    """The wrap got past its checks and asked for the mesh: the module is covered."""


class _NoMesh:
    """Stands for ``parallel_dims``; any read means the backend's checks passed."""

    def __getattr__(self, name: str) -> Any:
        raise _MeshNeeded(name)


def refusal(model: Any) -> str | None:
    """Why TorchTitan 0.3.0's HF backend cannot parallelize ``model`` (an HF backend model built
    on meta; it is converted in place), or None."""
    from torchtitan.experiments.transformers_modeling_backend.hf_sharding import (
        set_hf_sharding_configs,
    )
    from torchtitan.experiments.transformers_modeling_backend.module_conversion import (
        convert_hf_to_module,
    )

    try:
        convert_hf_to_module(model)
        set_hf_sharding_configs(model, enable_sp=False)
        for module in model.modules():
            config = getattr(module, "_sharding_config", None)
            if config is None or getattr(config, "local_map", None) is None:
                continue
            try:
                module._maybe_wrap_with_local_region(module.forward, _NoMesh())
            except _MeshNeeded:
                continue
    except Exception as exc:  # what the backend raises is the finding
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200].rstrip('.')}"
    return None


def trainer_refusal(model: Any) -> str | None:
    """Why TorchTitan 0.3.0's Trainer cannot start on ``model``, or None: its MoE
    load-balancing hook (``register_moe_load_balancing_hook``) reads ``moe`` of every layer the
    backend marks ``moe_enabled``, which the backend's HF decoder layers do not have (their
    experts sit under the HF name, e.g. Mixtral's ``block_sparse_moe``)."""
    for name, module in model.named_modules():
        if getattr(module, "moe_enabled", False) and not hasattr(module, "moe"):
            return (f"its Trainer's MoE load-balancing hook reads {name}.moe, which the "
                    f"backend's {type(module).__name__} does not have (AttributeError when "
                    "the Trainer starts)")
    return None


def check_hf_model(model: Any, hf_model: str) -> None:
    """UserError when TorchTitan 0.3.0's HF backend cannot run ``model`` (see ``refusal`` and
    ``trainer_refusal``)."""
    arch = type(getattr(model, "model", model)).__name__
    reason = trainer_refusal(model)
    if reason is not None:
        raise UserError(f"TorchTitan 0.3.0 cannot train {arch} (--hf_model {hf_model}) with "
                        f"its HF backend: {reason}; this architecture cannot be trained with "
                        "the backend")
    reason = refusal(model)
    if reason is None:
        return
    raise UserError(f"TorchTitan 0.3.0's HF backend cannot run {arch} (--hf_model {hf_model}): "
                    f"its parallelize, which every run goes through (one rank, no TP "
                    f"included), stops at {reason}; this architecture cannot be trained with "
                    "the backend (its hf_sharding.py has no case for it)")
