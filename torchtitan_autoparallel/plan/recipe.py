"""A recipe (a non-auto TorchTitan config) expressed as a Plan, so it can be predicted, explained
and compared with auto plans on the same cost model. ``job.request.read_recipe`` reads it."""

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..candidates.layout import BlockStrategy, Mesh, fsdp_sharded
from ..candidates.strategies import recipe_tp_mode
from .assembly import JobInputs, build_plan, candidate_for
from .schema import Pipeline, Plan


@dataclass(frozen=True, kw_only=True)
class PipelineRecipe:
    """TorchTitan's pipeline recipe: its schedule, its stage split and micro-batch size."""

    schedule: str
    stages: list[list[str]]
    """Module fqns of each stage (``module_fqns_per_model_part``, else TorchTitan's split)."""
    microbatch_size: int


@dataclass(frozen=True, kw_only=True)
class RecipeRequest:
    """A recipe to cost as written: its mesh, batch, each block's (AC mode, resharding) and,
    under pp, its pipeline."""

    inputs: JobInputs
    """Planning inputs with every technique allowed and no pins (TorchTitan's recipe, not the
    search)."""
    mesh: Mesh
    local_batch: int
    global_batch: int
    block_recipes: tuple[tuple[str, bool], ...]
    """Each block's (AC mode, reshard after forward) as TorchTitan's recipe runs it."""
    keep_after_forward: bool
    """TorchTitan's "default" resharding under pp: parameters stay gathered after forward."""
    pipeline: PipelineRecipe | None = None


def plan_of_recipe(recipe: RecipeRequest) -> Plan:
    """The plan ``recipe`` runs, costed."""
    inputs, mesh = recipe.inputs, recipe.mesh
    mode = "none" if mesh.tp == 1 else recipe_tp_mode(inputs.constraints)
    strategies = []
    for block, (ac, reshard) in zip(inputs.graph.blocks, recipe.block_recipes, strict=True):
        sharded = fsdp_sharded(mesh, mode, bool(block.expert_params))
        strategies.append(BlockStrategy(ac, reshard and sharded and not recipe.keep_after_forward,
                                        mode))
    solver = {"status": "recipe", "gap": 0.0, "candidates": 1, "milps_solved": 0,
              "variables": 0, "constraints": 0}
    if recipe.pipeline is not None:
        plan = _pipeline_plan(recipe.pipeline, inputs, mesh, recipe.local_batch,
                              recipe.global_batch, strategies, solver)
    else:
        plan = build_plan(inputs, candidate_for(inputs, mesh, recipe.local_batch), strategies,
                          solver)
    if plan.predicted["peak_memory_gib"] > plan.predicted["budget_gib"]:
        plan.notes.append(
            f"predicted peak {plan.predicted['peak_memory_gib']:.3g} GiB exceeds the planning "
            f"budget {plan.predicted['budget_gib']:.3g} GiB (the planner would not choose this "
            "recipe; whether it fits the device: see fit)"
        )
    return plan


def _pipeline_plan(pipeline: PipelineRecipe, inputs: JobInputs, mesh: Mesh, local: int,
                   global_batch: int, strategies: list[BlockStrategy], solver: dict[str, Any]
                   ) -> Plan:
    """TorchTitan's PP recipe as a plan: its schedule, stages per rank and stage split."""
    split, mb = pipeline.stages, pipeline.microbatch_size
    pipe = Pipeline(pipeline.schedule, len(split) // mesh.pp, local // mb, mb, split)
    cand = candidate_for(inputs, mesh, local, pipe)
    cand = dataclasses.replace(cand, accum=global_batch // (local * mesh.dp))
    return build_plan(inputs, cand, strategies, solver, split)
