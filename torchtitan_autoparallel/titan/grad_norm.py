"""Gradient-norm clipping across parameters that live on different device meshes.

Upstream: ``torchtitan.distributed.utils.clip_grad_norm_`` stacks every gradient's norm into
one tensor, which fails when DTensor gradients sit on different meshes (a plan where some
blocks shard over dp_shard and others over dp_shard x tp). TorchTitan solves the same problem
for expert parallelism by grouping parameters in two (``_clip_grad_norm_with_ep``: on a mesh
with an ep dim or not); this does it for any grouping, expert parallel meshes among them:
per-mesh total norms are made full tensors, combined as a p-norm, and every gradient is
clipped with the combined norm. With one mesh it defers to upstream.
Both releases call ``clip_grad_norm_`` through ``torchtitan.distributed.utils`` with this
signature; each release's train.py calls ``install()`` only for plans that ``need`` it. Tested
by tests/test_auto_parity.py (mixed plans, 0.2.2) and tests_v0_3/test_train_v0_3.py
(sub-block plans, 0.3.0).
"""

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_installed = False


def _mesh_key(grad: torch.Tensor) -> Any:
    return grad.device_mesh if isinstance(grad, DTensor) else None


def _combine(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if math.isinf(norm_type):
        return torch.stack(norms).max()
    return torch.stack([n**norm_type for n in norms]).sum() ** (1.0 / norm_type)


def needed(plan: Any) -> bool:
    """Whether ``plan`` puts gradients on several meshes outside expert parallelism (which
    TorchTitan's clipping handles): a block using the tp dim as data parallel is FSDP-sharded
    over dp_shard x tp (a sub-block mode's data-parallel sub-block or projection too), the
    other layers over dp_shard with TP on tp (a MoE block's data-parallel MoE beside expert
    parallel experts too); an embedding looked up on its embedding dim sits on a mesh of its
    own (dp_shard x tp, or dp_shard apart from FSDP's mesh), at any tp."""
    from ..candidates.layout import EMBEDDING_MODES, split_fsdp, tp_dp_params

    return plan is not None and (any(layer.tp_mode in EMBEDDING_MODES for layer in plan.layers)
                                 or plan.mesh.tp > 1 and any(
        tp_dp_params(layer.tp_mode) or split_fsdp(layer.tp_mode) for layer in plan.layers))


def install() -> None:
    """Route TorchTitan's clip_grad_norm_ through the mesh-grouping version (idempotent)."""
    global _installed
    if _installed:
        return
    import torchtitan.distributed.utils as dist_utils

    original = dist_utils.clip_grad_norm_

    def clip_grad_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        pp_mesh: Any = None,
        ep_enabled: bool = False,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        groups: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                groups.setdefault(_mesh_key(p.grad), []).append(p)
        if len(groups) <= 1:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh,
                            ep_enabled)
        norms = []
        for group in groups.values():
            grads = [p.grad for p in group]
            norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = _combine(norms, norm_type)
        if pp_mesh is not None:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            if not math.isinf(norm_type):
                total = total**norm_type
            dist.all_reduce(total, op=op, group=pp_mesh.get_group())
            if not math.isinf(norm_type):
                total = total ** (1.0 / norm_type)
        for group in groups.values():  # foreach kernels cannot mix meshes
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
        return total

    dist_utils.clip_grad_norm_ = clip_grad_norm_
    _installed = True
