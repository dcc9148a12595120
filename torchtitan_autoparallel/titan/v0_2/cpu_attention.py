"""Context-parallel (ring) SDPA on CPU for TorchTitan / DTensor.

On CPU, ``F.scaled_dot_product_attention`` lowers to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``..._for_cpu_backward``).
torch's context-parallel support only knows the CUDA kernels (flash / efficient /
cuDNN): there is no ``Shard(2)`` sharding strategy and no ring-attention handler for
the CPU ops, so CP fails on CPU. :func:`enable_cpu_ring_attention` adds both, hooked
into torch's CP enable/disable machinery so that TorchTitan's
``_enable_context_parallel_dispatcher()`` picks them up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpStrategy,
    PlacementList,
    RuntimeSchemaInfo,
)
from torch.distributed.tensor._ops._matrix_ops import (
    _scaled_dot_product_flash_attention_backward_base_strategies,
    _scaled_dot_product_flash_attention_base_strategies,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.experimental._context_parallel import _attention as _cp_attn
from torch.distributed.tensor.experimental._context_parallel import _sharding_rules as _cp_rules
from torch.distributed.tensor.placement_types import Shard

__all__ = ["enable_cpu_ring_attention"]

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SEQ_DIM = _cp_rules.SEQ_DIM  # torch's CP hardcodes seq_dim=2 (B, H, S, D)
# Rows of the 12-entry flash placement lists that exist in the CPU forward:
# output, logsumexp, q, k, v (the CPU op has no cum_seq/max/rng/debug outputs).
_FLASH_TO_CPU_FWD = (0, 1, 9, 10, 11)
_enabled = False


def _cpu_fwd_base(op_schema: OpSchema) -> list[PlacementList]:
    return [
        [s[i] for i in _FLASH_TO_CPU_FWD]
        for s in _scaled_dot_product_flash_attention_base_strategies(op_schema)
    ]


def _cpu_fwd_strategy(op_schema: OpSchema) -> OpStrategy:
    """Flash base strategies (replicate / head / batch sharding) for the CPU forward."""
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _cpu_fwd_base(op_schema),
                                           input_index=2)


def _cpu_bwd_strategy(op_schema: OpSchema) -> OpStrategy:
    """Flash backward base strategies (the CPU backward has the same 9-slot layout)."""
    mesh = op_schema.get_mesh_from_args(validate=False)
    strategies = _scaled_dot_product_flash_attention_backward_base_strategies(op_schema)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3)


def _register_cpu_tp_strategies() -> None:
    """Head/batch sharding for the CPU SDPA ops in DTensor's default registry.

    Works around torch registering SDPA strategies only for the CUDA kernels: tensor
    parallelism that keeps q/k/v as DTensors into SDPA (TorchTitan's qwen3 plan) fails on
    CPU. Tested by the qwen3 TP parity tests. CP's context registry overrides these while
    CP is enabled and restores them on disable.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.register_op_strategy(
        _FWD, _cpu_fwd_strategy, RuntimeSchemaInfo(3, static_kwargkey=["scale"])
    )
    propagator.register_op_strategy(
        _BWD, _cpu_bwd_strategy, RuntimeSchemaInfo(6, static_kwargkey=["scale"])
    )


def _cpu_fwd_cp_strategy(op_schema: OpSchema) -> OpStrategy:
    """Flash base strategies (replicate / head / batch) restricted to the CPU outputs, + CP."""
    mesh = op_schema.get_mesh_from_args()
    strategies: list[PlacementList] = [
        [s[i] for i in _FLASH_TO_CPU_FWD]
        for s in _scaled_dot_product_flash_attention_base_strategies(op_schema)
    ]
    strategies.append([Shard(_SEQ_DIM)] * 5)  # out, lse, q, k, v all sequence-sharded
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=2)


def _cpu_bwd_cp_strategy(op_schema: OpSchema) -> OpStrategy:
    """Flash backward base strategies (same 9-slot layout for the CPU op), + CP."""
    mesh = op_schema.get_mesh_from_args(validate=False)
    strategies = _scaled_dot_product_flash_attention_backward_base_strategies(op_schema)
    # dq, dk, dv, grad_out, q, k, v, out, lse all sequence-sharded
    strategies.append([Shard(_SEQ_DIM)] * 9)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3)


def _ring_fwd(
    mesh: DeviceMesh,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Ring forward with the CPU kernel; returns ``(out, logsumexp[B, H, S])``."""
    if attn_mask is not None:
        raise NotImplementedError("CPU ring attention does not support attn_mask")
    # The CPU kernel returns exactly (out, lse); _SDPAMerger unsqueezes/squeezes the
    # [B, H, S] lse itself, so the template's result already matches the op's outputs.
    return _cp_attn._templated_ring_attention(
        mesh.get_group(),
        _SEQ_DIM,
        _FWD,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _ring_bwd(
    mesh: DeviceMesh,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Ring backward with the CPU kernel; returns ``(dq, dk, dv)``."""
    if attn_mask is not None:
        raise NotImplementedError("CPU ring attention does not support attn_mask")
    return _cp_attn._templated_ring_attention_backward(
        mesh.get_group(),
        _SEQ_DIM,
        _BWD,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


_RING_FNS: dict[torch._ops.OpOverload, Callable[..., tuple[torch.Tensor, ...]]] = {
    _FWD: _ring_fwd,
    _BWD: _ring_bwd,
}


def _cpu_sdpa_handler(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """DTensor custom-op handler: like torch's ``_sdpa_handler``, for the CPU ops.

    Works around ``_sdpa_handler`` hardcoding its op -> ring-function table (a local
    dict), so the CPU ops cannot simply be added to it.
    """
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise RuntimeError(f"CPU ring attention expects Shard({_SEQ_DIM}) q/k/v: {sharding}")
    local: Any = _RING_FNS[op_call](
        op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs
    )
    return dispatcher.wrap(local, sharding.output_spec)


def _register_cpu_cp_strategies() -> None:
    """Add the CPU strategies to torch's CP registry (undone by its unregister)."""
    contexts = _cp_rules._cp_strategy_contexts  # rebound by unregister: read it afresh
    for op, fn in ((_FWD, _cpu_fwd_cp_strategy), (_BWD, _cpu_bwd_cp_strategy)):
        if op not in contexts:
            ctx = _cp_rules._op_strategy_context(op, fn, None)
            _cp_rules._original_strategies[op] = ctx.__enter__()
            contexts[op] = ctx


def enable_cpu_ring_attention() -> None:
    """Make DTensor context parallelism run ring attention with the CPU SDPA kernels.

    Idempotent. Safe to call before or after ``_enable_context_parallel_dispatcher()``.
    """
    global _enabled
    if _enabled:
        return
    _enabled = True
    _register_cpu_tp_strategies()

    # Workaround: _enable_cp_dtensor_dispatcher() installs
    # {**existing_custom_ops, **custom_ops}, rebuilt from the module-level
    # ``custom_ops`` on every call, which lists only the CUDA SDPA ops. Add ours there.
    _cp_attn.custom_ops.update(dict.fromkeys(_RING_FNS, _cpu_sdpa_handler))

    # Workaround: register_cp_sharding_rules() registers Shard(2) strategies only for
    # the CUDA SDPA ops, from a local list. Wrap it (it is looked up on the module at
    # each enable) so the CPU strategies join the same context registry;
    # unregister_cp_sharding_rules() then drops them with the rest on disable, and the
    # next enable re-registers them.
    original_register = _cp_rules.register_cp_sharding_rules

    def register_cp_sharding_rules() -> None:
        original_register()
        _register_cpu_cp_strategies()

    _cp_rules.register_cp_sharding_rules = register_cp_sharding_rules

    # CP dispatcher already enabled: patch the live handler table and registry too
    # (never the pristine ``existing_custom_ops`` that disable restores).
    handlers = DTensor._op_dispatcher._custom_op_handlers
    if _cp_rules._cp_strategy_contexts and handlers is not _cp_attn.existing_custom_ops:
        handlers.update(dict.fromkeys(_RING_FNS, _cpu_sdpa_handler))
        _register_cpu_cp_strategies()
