"""What a job asks for, read once from its TorchTitan config into typed values: a search
(``PlanRequest``) or its own recipe costed (``RecipeRequest``). The stages below take these
values; none of them reads a TorchTitan config."""

import dataclasses
import math
from typing import Any

from ..candidates.layout import DEFAULT_TECHNIQUES, Mesh
from ..candidates.schedules import SCHEDULES, SINGLE_STAGE
from ..errors import UserError
from ..plan.assembly import with_global_batch
from ..plan.recipe import PipelineRecipe, RecipeRequest, plan_of_recipe
from ..plan.schema import Plan
from ..solve.planner import PlanRequest, solve_request
from .explicit import NOTES_ATTR, user_set
from .features import features_from_config
from .inputs import constraint_keys, job_inputs, sub_block_notes
from .pins import recipe_from_config, recipe_of


def read_request(job_config: Any, world: int) -> PlanRequest:
    """The search ``job_config`` asks for on ``world`` devices."""
    inputs = job_inputs(job_config, world)
    keys = tuple(constraint_keys(job_config))
    narrowing = keys + tuple(
        f"autoparallel.{key} = {getattr(job_config.autoparallel, key)!r}"
        for key in ("techniques", "pin") if user_set(job_config, f"autoparallel.{key}"))
    fsdp_only = []
    if user_set(job_config, "parallelism.fsdp_reshard_after_forward"):
        fsdp_only.append("parallelism.fsdp_reshard_after_forward = "
                         f"{job_config.parallelism.fsdp_reshard_after_forward!r}")
    if features_from_config(job_config).float8_all_gather:
        fsdp_only.append("quantize.linear.float8.enable_fsdp_float8_all_gather")
    training = job_config.training
    return PlanRequest(
        inputs=inputs, local_batch=training.local_batch_size,
        global_batch_follows_dp=training.global_batch_size == -1,
        local_batch_set=user_set(job_config, "training.local_batch_size"),
        time_limit_s=job_config.autoparallel.time_limit_s, constraint_keys=keys,
        narrowing_keys=narrowing, fsdp_only_keys=tuple(fsdp_only),
        release_notes=(*getattr(job_config, NOTES_ATTR, []),
                       *sub_block_notes(inputs.constraints, inputs.features)))


def read_recipe(job_config: Any, world: int) -> RecipeRequest:
    """The recipe ``job_config`` writes (its ``[parallelism]`` degrees, AC and batch), checked,
    on ``world`` devices."""
    par, training = job_config.parallelism, job_config.training
    inputs = job_inputs(job_config, world)
    mesh = _recipe_mesh(par, world, inputs.graph.num_experts > 0)
    local = training.local_batch_size
    global_batch = (training.global_batch_size if training.global_batch_size > 0
                    else local * mesh.dp)
    if global_batch % (local * mesh.dp):
        raise UserError(f"global batch {global_batch} is not a multiple of local batch {local} "
                        f"x data-parallel degree {mesh.dp}")
    # TorchTitan's recipe, not the search: every technique it runs is costed, whatever
    # autoparallel.techniques leaves out (e.g. its activation checkpointing without "ac")
    inputs = dataclasses.replace(
        with_global_batch(inputs, global_batch), pins={},
        constraints=dataclasses.replace(inputs.constraints, techniques=DEFAULT_TECHNIQUES))
    if inputs.features.float8 and inputs.features.float8_filter is None:
        # TorchTitan converts every linear it can (quantize.linear.float8.filter_fqns = [])
        inputs = dataclasses.replace(
            inputs, features=dataclasses.replace(inputs.features, float8_filter=()))
    recipe = recipe_of(recipe_from_config(job_config))  # what a pinned block runs, too
    return RecipeRequest(
        inputs=inputs, mesh=mesh, local_batch=local, global_batch=global_batch,
        block_recipes=tuple(recipe(i) for i in range(len(inputs.graph.blocks))),
        # TorchTitan's "default" resharding keeps parameters after forward under pp
        keep_after_forward=mesh.pp > 1 and par.fsdp_reshard_after_forward == "default",
        pipeline=_pipeline_recipe(par, mesh, local, len(inputs.graph.blocks))
        if mesh.pp > 1 else None)


def _recipe_mesh(par: Any, world: int, moe: bool) -> Mesh:
    """The mesh the ``[parallelism]`` degrees set (dp_shard -1: what the others leave)."""
    dp_replicate, tp = par.data_parallel_replicate_degree, par.tensor_parallel_degree
    cp, pp = par.context_parallel_degree, par.pipeline_parallel_degree
    dp_shard = par.data_parallel_shard_degree
    if dp_shard == -1:
        dp_shard = world // (dp_replicate * tp * cp * pp)
    ep = par.expert_parallel_degree if moe else 1
    mesh = Mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp, ep=ep,
                etp=par.expert_tensor_parallel_degree if ep > 1 else 1, pp=pp)
    if mesh.world != world:
        raise UserError(
            f"[parallelism] degrees pp={pp} dp_replicate={dp_replicate} dp_shard={dp_shard} "
            f"cp={cp} tp={tp} do not multiply to world size {world}"
        )
    return mesh


def _pipeline_recipe(par: Any, mesh: Mesh, local: int, n_layers: int) -> PipelineRecipe:
    """TorchTitan's PP recipe: its schedule and its stage split (``module_fqns_per_model_part``,
    else TorchTitan's ``generate_llm_fqn_per_model_part``)."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    schedule = par.pipeline_parallel_schedule
    if schedule not in SCHEDULES:
        raise UserError(f"parallelism.pipeline_parallel_schedule = {schedule!r} is not one of "
                        f"{list(SCHEDULES)}")
    first, last = (par.pipeline_parallel_first_stage_less_layers,
                   par.pipeline_parallel_last_stage_less_layers)
    if par.pipeline_parallel_layers_per_stage:
        stages = math.ceil((n_layers + first + last) / par.pipeline_parallel_layers_per_stage)
    else:
        stages = mesh.pp * (1 if schedule in SINGLE_STAGE else 2)
    split = par.module_fqns_per_model_part or generate_llm_fqn_per_model_part(
        stages, n_layers, first, last)
    mb = par.pipeline_parallel_microbatch_size
    if local % mb:
        raise UserError(f"training.local_batch_size {local} is not a multiple of "
                        f"parallelism.pipeline_parallel_microbatch_size {mb}")
    return PipelineRecipe(schedule=schedule, stages=split, microbatch_size=mb)


def plan_job(job_config: Any, world: int) -> Plan:
    """Solve the parallelization of ``job_config`` on ``world`` devices. With
    ``training.global_batch_size = -1`` each data-parallel degree is searched with its own
    global batch and the plan with the most tokens/s wins (``solve_request``)."""
    return solve_request(read_request(job_config, world))


def recipe_plan(job_config: Any, world: int) -> Plan:
    """The plan TorchTitan's own recipe runs for ``job_config`` on ``world`` devices."""
    return plan_of_recipe(read_recipe(job_config, world))
