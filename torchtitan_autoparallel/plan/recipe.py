"""A recipe (a non-auto TorchTitan config) expressed as a Plan, so it can be predicted, explained
and compared with auto plans on the same cost model."""

import dataclasses
from typing import Any

from ..candidates.layout import TECHNIQUES, BlockStrategy, Mesh, fsdp_sharded
from ..errors import UserError
from ..job.inputs import job_inputs, with_global_batch
from ..job.pins import recipe_from_config, recipe_of
from .assembly import build_plan, candidate_for
from .schema import Plan


def recipe_plan(job_config: Any, world: int) -> Plan:
    """The plan TorchTitan's own recipe runs for ``job_config`` on ``world`` devices."""
    par, training = job_config.parallelism, job_config.training
    inputs = job_inputs(job_config, world)
    dp_replicate, tp = par.data_parallel_replicate_degree, par.tensor_parallel_degree
    cp = par.context_parallel_degree
    dp_shard = par.data_parallel_shard_degree
    pp = par.pipeline_parallel_degree
    if dp_shard == -1:
        dp_shard = world // (dp_replicate * tp * cp * pp)
    ep = par.expert_parallel_degree if inputs.graph.num_experts else 1
    mesh = Mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp, ep=ep,
                etp=par.expert_tensor_parallel_degree if ep > 1 else 1, pp=pp)
    if mesh.world != world:
        raise UserError(
            f"[parallelism] degrees pp={pp} dp_replicate={dp_replicate} dp_shard={dp_shard} "
            f"cp={cp} tp={tp} do not multiply to world size {world}"
        )
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
        constraints=dataclasses.replace(inputs.constraints, techniques=TECHNIQUES))
    if inputs.features.float8 and inputs.features.float8_filter is None:
        # TorchTitan converts every linear it can (quantize.linear.float8.filter_fqns = [])
        inputs = dataclasses.replace(
            inputs, features=dataclasses.replace(inputs.features, float8_filter=()))
    recipe = recipe_of(recipe_from_config(job_config))  # what a pinned block runs, too
    # TorchTitan's "default" resharding keeps parameters after forward under pp
    keep = pp > 1 and par.fsdp_reshard_after_forward == "default"
    mode = "sp" if tp > 1 else "none"
    strategies = []
    for i, block in enumerate(inputs.graph.blocks):
        ac, reshard = recipe(i)
        sharded = fsdp_sharded(mesh, mode, bool(block.expert_params))
        strategies.append(BlockStrategy(ac, reshard and sharded and not keep, mode))
    solver = {"status": "recipe", "gap": 0.0, "candidates": 1, "milps_solved": 0,
              "variables": 0, "constraints": 0}
    if pp > 1:
        plan = _pipeline_recipe_plan(job_config, inputs, mesh, local, global_batch,
                                     strategies, solver)
    else:
        plan = build_plan(inputs, candidate_for(inputs, mesh, local), strategies, solver)
    if plan.predicted["peak_memory_gib"] > plan.predicted["budget_gib"]:
        plan.notes.append(
            f"predicted peak {plan.predicted['peak_memory_gib']:.3g} GiB exceeds the planning "
            f"budget {plan.predicted['budget_gib']:.3g} GiB (the planner would not choose this "
            "recipe; whether it fits the device: see fit)"
        )
    return plan


def _pipeline_recipe_plan(job_config: Any, inputs: Any, mesh: Mesh, local: int,
                          global_batch: int, strategies: list[BlockStrategy],
                          solver: dict[str, Any]) -> Plan:
    """TorchTitan's PP recipe as a plan: its schedule, its stages per rank and its stage split
    (``module_fqns_per_model_part``, else TorchTitan's ``generate_llm_fqn_per_model_part``)."""
    import math

    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    from ..candidates.schedules import SCHEDULES, SINGLE_STAGE
    from .schema import Pipeline

    par = job_config.parallelism
    schedule = par.pipeline_parallel_schedule
    if schedule not in SCHEDULES:
        raise UserError(f"parallelism.pipeline_parallel_schedule = {schedule!r} is not one of "
                        f"{list(SCHEDULES)}")
    n_layers = len(inputs.graph.blocks)
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
    pipe = Pipeline(schedule, len(split) // mesh.pp, local // mb, mb, split)
    cand = candidate_for(inputs, mesh, local, pipe)
    cand = dataclasses.replace(cand, accum=global_batch // (local * mesh.dp))
    return build_plan(inputs, cand, strategies, solver, split)
