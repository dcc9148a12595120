"""Techniques a family's adapter cannot apply: left out of the search, reported in the plan,
and an error where the user fixed a degree that needs one of them."""

import dataclasses

from ..errors import UserError
from ..graph.layer_graph import LayerGraph
from .layout import MOE_SHARED_DP, shared_experts_dp
from .strategies import Constraints

# fixed degree (Constraints field, its [parallelism] key) -> the technique it needs
_DEGREES = {"tp": ("tp", "tensor_parallel_degree"), "cp": ("cp", "context_parallel_degree"),
            "ep": ("ep", "expert_parallel_degree"), "pp": ("pp", "pipeline_parallel_degree")}


def without_excluded(constraints: Constraints, graph: LayerGraph, world: int) -> Constraints:
    """``constraints`` with the graph's excluded techniques removed; errors for fixed degrees
    that need one of them, and for a fixed tp that does not divide the attention heads."""
    excluded = dict(graph.excluded)
    for field, (technique, key) in _DEGREES.items():
        degree = getattr(constraints, field)
        if degree > 1 and technique in excluded:
            raise UserError(
                f"parallelism.{key} = {degree} needs {technique}, which model {graph.family!r} "
                f"cannot use: {excluded[technique]}; or set it to 1"
            )
    # a MoE block's sub-blocks are its MoE and the rest (``MOE_SUB_BLOCK_MODES``), where the
    # release applies them and the family takes them; its shared experts apart where it has
    family_modes = graph.adapter.moe_sub_block_modes or (MOE_SHARED_DP,)
    shared = any(layer.shared_expert_linears for layer in graph.blocks)
    constraints = dataclasses.replace(constraints, moe_sub_block_modes=tuple(
        mode for mode in constraints.moe_sub_block_modes
        if mode in family_modes and (shared or not shared_experts_dp(mode))))
    moe = bool(graph.num_experts and constraints.moe_sub_block_modes)
    if "tp_sub_block" in constraints.techniques and not graph.adapter.sub_blocks and not moe:
        raise UserError(
            f"autoparallel.techniques has tp_sub_block, but model {graph.family!r} names no "
            "attention and feed-forward sub-blocks to parallelize apart "
            "(ModelAdapter.sub_blocks): leave tp_sub_block out")
    tp = constraints.tp
    if (tp > 1 and world % tp == 0
            and (graph.n_heads % tp or graph.n_kv_heads % tp)):
        raise UserError(
            f"parallelism.tensor_parallel_degree = {tp} does not divide the attention heads of "
            f"model {graph.family!r} ({graph.n_heads} query / {graph.n_kv_heads} kv heads, from "
            "ModelAdapter.heads or the model args' n_heads / n_kv_heads): choose a degree that "
            "divides both"
        )
    if not excluded:
        return constraints
    ac_modes = tuple(m for m in constraints.ac_modes
                     if not (m == "selective" and "selective_ac" in excluded))
    return dataclasses.replace(
        constraints, ac_modes=ac_modes,
        techniques=tuple(t for t in constraints.techniques if t not in excluded))


def exclusion_notes(graph: LayerGraph) -> list[str]:
    """Plan notes: one per excluded technique, with the reason, then what reading the model
    assumed (``LayerGraph.notes``)."""
    return [f"excluded {technique}: {why}" for technique, why in graph.excluded] + list(
        graph.notes)

