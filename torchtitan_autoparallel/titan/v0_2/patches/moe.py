"""Upstream workarounds for TorchTitan 0.2.2's MoE under tensor parallelism: gradients its
``apply_moe_ep_tp`` leaves partial or incomplete, made whole again (both fixed upstream after
0.2.2; each function names the upstream behaviour, the measurement and the test)."""

from typing import Any

import torch
import torch.nn as nn


class _TpGradient(torch.autograd.Function):
    """Identity forward over a tp mesh; the subclass's backward corrects the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
        ctx.tp_mesh = tp_mesh
        return x.view_as(x)


class _GatherOwnedRows(_TpGradient):
    """Backward keeps this tp rank's block of rows of the gradient (the rows it routed) and
    all-gathers the blocks of every tp rank, so each rank gets the full gradient."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torch.distributed import _functional_collectives as funcol

        mesh = ctx.tp_mesh
        owned = grad.contiguous().view(mesh.size(), -1)[mesh.get_local_rank()]
        full = funcol.wait_tensor(funcol.all_gather_tensor(owned, 0, mesh))
        return full.view(grad.shape), None


def reduce_sequence_parallel_moe_grads(moe: nn.Module, tp_mesh: Any) -> None:
    """Correct the backward of a TorchTitan MoE whose tokens TP splits for EP (etp = 1).

    Upstream (TorchTitan 0.2.2, ``apply_moe_ep_tp`` with ``ReordererSequenceParallel``): the
    MoE input is all-gathered over tp and the router runs on every token, but each tp rank
    dispatches only its block of the flattened tokens, so the gradients reaching the routing
    scores and the routed branch of the MoE input are non-zero only in that rank's rows. Both
    are then treated as replicated: ``router.gate`` gets the gradient of half the tokens on each
    tp rank (measured: 60-69 % off the 1-rank gradient at step 1, deepseek_v3 debug model, ep 4
    x tp 2) and the sequence shard each rank keeps of the MoE input gradient misses the routed
    rows of the other rank (``ffn_norm`` of MoE blocks 9-12 % off, everything upstream ~1e-3).
    TorchTitan fixed this after 0.2.2 (pytorch/torchtitan#2387). Here the gradients of the
    router's scores and of the MoE input are made whole again: each row comes from the tp rank
    that routed it (the shared experts' part is already all-reduced, hence equal on every
    rank). Tested by tests/test_moe_parity.py (deepseek_v3-ep4-tp2)."""
    if tp_mesh.size() == 1:
        return

    def scores_hook(module: nn.Module, args: Any, output: Any) -> Any:
        top_scores, *rest = output
        return (_GatherOwnedRows.apply(top_scores, tp_mesh), *rest)

    def input_hook(module: nn.Module, args: Any) -> Any:
        x, *rest = args  # local and replicated over tp: TorchTitan's input hook ran first
        return (_GatherOwnedRows.apply(x, tp_mesh), *rest)

    moe.router.register_forward_hook(scores_hook)
    moe.register_forward_pre_hook(input_hook)


class _SumGradOverTp(_TpGradient):
    """Backward all-reduces (sums) the gradient over tp, for a tensor that is replicated over
    tp but whose gradient each tp rank only holds a partial sum of."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torch.distributed import _functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.tp_mesh)), None


def reduce_tensor_parallel_router_grads(moe: nn.Module, tp_mesh: Any) -> None:
    """Correct the backward of a TorchTitan MoE whose routed experts are tensor parallel over
    tp (ep = 1, or etp = tp) and that scores after the experts (``score_before_experts =
    False``: deepseek_v3, qwen3).

    Upstream (TorchTitan 0.2.2, ``apply_moe_ep_tp``): the router runs replicated over tp
    (``NoParallel``) and the routed experts' output is a partial sum over tp (row-wise ``w2``),
    reduced only after the scores have weighted it (the MoE output is ``Partial``). The gradient
    of the scores, ``grad_out . routed_output``, is then one tp rank's partial sum, yet it is
    treated as replicated: ``router.gate`` gets a different, partial gradient on each tp rank
    and the router's share of the MoE input gradient is partial too (measured: deepseek_v3
    debug model, tp 2, ep 1: ``router.gate`` 62-72 % off the 1-rank gradient at step 1, the MoE
    blocks' ``ffn_norm`` 0.6-1.2 % off, the grad norm 1.5e-3 off by step 5). With
    ``score_before_experts = True`` (llama4) the scores multiply the experts' input, whose
    gradient TorchTitan already reduces. TorchTitan fixed this after 0.2.2 (pytorch/torchtitan
    PR #2416). Here the scores' gradient is summed over tp. Tested by tests/test_moe_parity.py
    (deepseek_v3-tp2)."""
    if tp_mesh.size() == 1 or getattr(moe, "score_before_experts", True):
        return

    def scores_hook(module: nn.Module, args: Any, output: Any) -> Any:
        top_scores, *rest = output
        return (_SumGradOverTp.apply(top_scores, tp_mesh), *rest)

    moe.router.register_forward_hook(scores_hook)
