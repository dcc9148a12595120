"""A dense block's attention and feed-forward found from its graph, for a family that names
none (``ModelAdapter.sub_blocks``): the sub-blocks the tp modes of ``SUB_BLOCK_TP_MODES``
parallelize apart."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from .adapters import ModelAdapter
from .tp_styles import InferredTP, block_signature


def _traced(block: nn.Module, names: list[str], inputs: tuple[tuple, dict]
            ) -> tuple[list[str], dict[str, Any], dict[str, Any]] | None:
    """One forward of ``block``: the children of ``names`` in call order, each one's first
    argument and output; None where the block does not run."""
    calls: list[str] = []
    firsts: dict[str, Any] = {}
    outputs: dict[str, Any] = {}

    def before(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            calls.append(name)
            firsts[name] = args[0] if args else None
        return hook

    def after(name: str):
        return lambda module, args, out: outputs.__setitem__(name, out)

    handles = [hook for name in names for hook in (
        block.get_submodule(name).register_forward_pre_hook(before(name)),
        block.get_submodule(name).register_forward_hook(after(name)))]
    args, kwargs = inputs
    try:
        with torch.no_grad():
            block(*args, **kwargs)
    except Exception:  # a block that does not run here shows no sub-blocks
        return None
    finally:
        for handle in handles:
            handle.remove()
    return calls, firsts, outputs


def pre_norm_pairs(block: nn.Module, regions: set[str], inputs: tuple[tuple, dict]
                   ) -> tuple[tuple[str, str], ...]:
    """(norm, module) for the two children of ``block`` in ``regions`` in call order, each
    entered with the output of a normalisation child of its own, the second norm reading the
    residual sum (not the first module's output): a pre-norm block. Empty otherwise (post-norm,
    one norm feeding both, a third module, a block that does not run)."""
    children = [name for name, _ in block.named_children()]
    norms = [n for n in children if "norm" in type(block.get_submodule(n)).__name__.lower()]
    traced = _traced(block, norms + [n for n in children if n in regions], inputs)
    if traced is None:
        return ()
    calls, firsts, outputs = traced
    modules = [name for name in calls if name in regions]
    pairs = tuple((next((n for n in norms if firsts[m] is not None
                         and outputs.get(n) is firsts[m]), ""), m) for m in modules)
    if len(pairs) != 2 or "" in (pairs[0][0], pairs[1][0]) or pairs[0][0] == pairs[1][0]:
        return ()
    if firsts.get(pairs[1][0]) is outputs.get(pairs[0][1]):
        return ()
    return pairs


def with_found_sub_blocks(adapter: ModelAdapter, model: nn.Module, inputs: tuple[tuple, dict],
                          dim: int, seq_len: int) -> ModelAdapter:
    """``adapter`` with ``sub_blocks`` read from its first block where the family names none,
    the model is dense and TP is inferred: the block's two (norm, module) pairs whose module
    the inferred plan enters through a layout change, wired pre-norm (``pre_norm_pairs``).
    Unchanged otherwise (the sub-block modes are then not offered)."""
    if adapter.sub_blocks or not isinstance(adapter.tp_fn, InferredTP):
        return adapter
    blocks = list(model.get_submodule(adapter.blocks).children())
    if not blocks or any(adapter.routed_experts(block) is not None for block in blocks):
        return adapter
    block = blocks[0]
    plan = adapter.tp_fn.plans.get(block_signature(block), {})
    regions = {name for name, style in plan.items() if style.kind == "prepare"}
    args, kwargs = inputs
    x = torch.empty(1, seq_len, dim, device="meta")
    pairs = pre_norm_pairs(block, regions, ((x, *args[1:]), kwargs))
    return dataclasses.replace(adapter, sub_blocks=pairs) if pairs else adapter
