"""An expert (non-auto) TorchTitan config expressed as a Plan, so it can be predicted, explained
and compared with auto plans on the same cost model."""

import dataclasses
from typing import Any

from .errors import UserError
from .pins import recipe_from_config, recipe_of
from .plan import Mesh, Plan
from .planner import build_plan, candidate_for, job_inputs, with_global_batch
from .strategies import BlockStrategy


def expert_plan(job_config: Any, world: int) -> Plan:
    """The plan TorchTitan's own recipe runs for ``job_config`` on ``world`` devices."""
    par, training = job_config.parallelism, job_config.training
    inputs = job_inputs(job_config, world)
    dp_replicate, tp = par.data_parallel_replicate_degree, par.tensor_parallel_degree
    cp = par.context_parallel_degree
    dp_shard = par.data_parallel_shard_degree
    if dp_shard == -1:
        dp_shard = world // (dp_replicate * tp * cp)
    ep = par.expert_parallel_degree if inputs.graph.num_experts else 1
    mesh = Mesh(dp_replicate, dp_shard, tp, cp, ep,
                par.expert_tensor_parallel_degree if ep > 1 else 1)
    if mesh.world != world:
        raise UserError(
            f"[parallelism] degrees dp_replicate={dp_replicate} dp_shard={dp_shard} cp={cp} "
            f"tp={tp} do not multiply to world size {world}"
        )
    local = training.local_batch_size
    global_batch = (training.global_batch_size if training.global_batch_size > 0
                    else local * mesh.dp)
    if global_batch % (local * mesh.dp):
        raise UserError(f"global batch {global_batch} is not a multiple of local batch {local} "
                        f"x data-parallel degree {mesh.dp}")
    inputs = dataclasses.replace(with_global_batch(inputs, global_batch), pins={})
    cand = candidate_for(inputs, mesh, local)
    recipe = recipe_of(recipe_from_config(job_config))  # what a pinned block runs, too
    sharded = mesh.dp_shard * mesh.cp > 1
    mode = "sp" if tp > 1 else "none"
    strategies = []
    for i in range(len(inputs.graph.blocks)):
        ac, reshard = recipe(i)
        strategies.append(BlockStrategy(ac, reshard and sharded, mode))
    plan = build_plan(inputs, cand, strategies, {"status": "expert recipe", "gap": 0.0,
                                                 "candidates": 1, "milps_solved": 0,
                                                 "variables": 0, "constraints": 0})
    if plan.predicted["peak_memory_gib"] > plan.predicted["budget_gib"]:
        plan.notes.append(
            f"predicted peak {plan.predicted['peak_memory_gib']:.3g} GiB exceeds the budget "
            f"{plan.predicted['budget_gib']:.3g} GiB: this recipe is predicted to run out of "
            "memory"
        )
    return plan
