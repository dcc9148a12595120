"""Pipeline plans: a MILP solution's per-rank block counts -> stages of consecutive layers
(``parallelism.module_fqns_per_model_part``) with one strategy per block; any stage split
(the planner's, a plan file's, TorchTitan's own) costed and written as a Plan."""

from __future__ import annotations

from typing import Any

from .assembly import JobInputs, layer_plans, plan_of
from .cost.model import STATE_BYTES_PER_PARAM, STEP_BYTES_PER_PARAM
from .layout import BlockStrategy
from .plan import Pipeline, Plan
from .solver import block_classes
from .solver_pipeline import PipelineCandidate, PipelineSolution, build_pipeline_candidate


def stage_sizes(blocks: int, stages: int, first_at_least: int = 0) -> list[int]:
    """``blocks`` split over ``stages`` as evenly as possible (earlier stages take the extra
    ones); the first stage takes at least ``first_at_least``."""
    if stages == 1:
        return [blocks]
    first = max(first_at_least, -(-blocks // stages))
    base, extra = divmod(blocks - first, stages - 1)
    return [first] + [base + (1 if i < extra else 0) for i in range(stages - 1)]


def head_modules(inputs: JobInputs) -> tuple[str, list[str]]:
    """The embedding's fqn, and the final norm's and output's (the last stage's tail)."""
    graph = inputs.graph
    adapter = graph.adapter
    embedding = next(layer.fqn for layer in graph.layers if layer.kind == "embedding")
    head = [name for name in (adapter.final_norm,) if name] + [
        layer.fqn for layer in graph.layers if layer.kind == "output"]
    return embedding, head


def assign_stages(inputs: JobInputs, sol: PipelineSolution
                  ) -> tuple[list[list[str]], list[BlockStrategy]]:
    """(module fqns per stage, one strategy per block in block order) of a MILP solution."""
    cand = sol.candidate
    graph = inputs.graph
    pp, v = cand.mesh.pp, cand.stages_per_rank
    classes = block_classes(graph, inputs.pins)
    prefix = sum(1 for c in classes if c in cand.prefix)
    queues: dict[int, dict[str, list[BlockStrategy]]] = {}
    sizes: dict[int, list[int]] = {}
    for rank in range(pp):
        counts = sol.counts[cand.type_of_rank(rank).name]
        queue: dict[str, list[BlockStrategy]] = {}
        # within a class, the most memory-saving strategies first (deterministic)
        for (cls, strategy), n in sorted(
                counts.items(), key=lambda kv: (kv[0][0], cand.costs[kv[0]].act_bytes, kv[0][1])):
            queue.setdefault(cls, []).extend([strategy] * n)
        queues[rank] = queue
        sizes[rank] = stage_sizes(sum(counts.values()), v, prefix if rank == 0 else 0)
    shape = Pipeline(cand.schedule, v, cand.microbatches, cand.microbatch, [])
    embedding, head = head_modules(inputs)
    stages: list[list[str]] = []
    strategies: list[BlockStrategy] = []
    taken = dict.fromkeys(range(pp), 0)
    block = 0
    for stage in range(pp * v):
        rank = shape.rank_of(stage, pp)
        size = sizes[rank][taken[rank]]
        taken[rank] += 1
        fqns = [embedding] if stage == 0 else []
        for _ in range(size):
            fqns.append(graph.blocks[block].fqn)
            strategies.append(queues[rank][classes[block]].pop(0))
            block += 1
        if stage == pp * v - 1:
            fqns.extend(head)
        stages.append(fqns)
    return stages, strategies


def build_pipeline_plan(inputs: JobInputs, sol: PipelineSolution, solver: dict[str, Any]
                        ) -> Plan:
    """The Plan of a pipeline MILP solution."""
    stages, strategies = assign_stages(inputs, sol)
    return plan_from_stages(inputs, sol.candidate, stages, strategies, solver)


def plan_from_stages(inputs: JobInputs, cand: PipelineCandidate, stages: list[list[str]],
                     strategies: list[BlockStrategy], solver: dict[str, Any]) -> Plan:
    """Cost ``stages`` (module fqns per stage, in stage order) with one strategy per block on
    ``cand`` and write the Plan: per-layer, per-rank and whole-step predictions."""
    graph = inputs.graph
    pp = cand.mesh.pp
    shape = Pipeline(cand.schedule, cand.stages_per_rank, cand.microbatches, cand.microbatch,
                     stages)
    rank_of_fqn = {fqn: shape.rank_of(s, pp) for s, stage in enumerate(stages) for fqn in stage}
    per_rank: list[dict[tuple[str, BlockStrategy], int]] = [{} for _ in range(pp)]
    for layer, key in zip(graph.blocks, zip(block_classes(graph, inputs.pins), strategies,
                                            strict=True), strict=True):
        counts = per_rank[rank_of_fqn[layer.fqn]]
        counts[key] = counts.get(key, 0) + 1

    def predicted(cls: str, strategy: BlockStrategy) -> dict[str, float]:
        cost = cand.costs[(cls, strategy)]
        return {"time_ms": round(cost.time_s * 1e3, 6),
                "memory_mib": round((cost.resident_bytes + cost.act_bytes) / 2**20, 6)}

    step, times, memory = cand.evaluate(per_rank)
    shape.bubble_fraction = round(cand.beta * max(times) / step, 6)
    shape.rank_time_ms = [round(t * 1e3, 6) for t in times]
    shape.rank_memory_gib = [round(b / 2**30, 6) for b in memory]
    # parameters, gradients and AdamW state per rank (its optimizer-step bytes less the
    # step's temporary)
    states = [(cand.edge_state[cand.type_of_rank(r).name] + sum(
        n * cand.costs[k].step_bytes for k, n in per_rank[r].items()))
        * STATE_BYTES_PER_PARAM / STEP_BYTES_PER_PARAM[inputs.features.optimizer]
        for r in range(pp)]
    shape.rank_state_gib = [round(b / 2**30, 6) for b in states]
    return plan_of(inputs, cand.mesh, cand.microbatch * cand.microbatches, cand.accum,
                   layer_plans(inputs, cand.mesh, strategies, predicted), step, max(memory),
                   max(states), solver, pipeline=shape)


def pipeline_candidate_of(inputs: JobInputs, plan_mesh: Any, pipe: Pipeline
                          ) -> PipelineCandidate:
    """The costs of a given pipeline (a plan's, or a TorchTitan recipe's) on ``inputs``."""
    cand = build_pipeline_candidate(
        inputs.graph, plan_mesh, pipe.schedule, pipe.stages_per_rank, pipe.microbatch_size,
        pipe.microbatches, inputs.hw, inputs.precision, inputs.gpus_per_node,
        inputs.constraints, inputs.pins, inputs.features, keep_strategies=True)
    if cand is None:
        from .errors import UserError

        raise UserError("the model's block kinds alternate: it cannot be costed under pp")
    return cand


def recost_pipeline(plan: Plan, inputs: JobInputs) -> Plan:
    """A pipeline plan (mesh, stages, strategies) costed again on ``inputs``."""
    assert plan.pipeline is not None
    cand = pipeline_candidate_of(inputs, plan.mesh, plan.pipeline)
    strategies = [BlockStrategy.of(lp) for lp in plan.layers if lp.kind == "block"]
    return plan_from_stages(inputs, cand, [list(s) for s in plan.pipeline.stages], strategies,
                            {})


def rank_counts(plan: Plan, class_of: dict[str, str]
                ) -> tuple[list[dict[tuple[str, BlockStrategy], int]], dict[str, int]]:
    """Each pp rank's blocks per (class, strategy) in ``plan``, and each block's rank."""
    pipe = plan.pipeline
    assert pipe is not None
    pp = plan.mesh.pp
    rank_of_fqn = {fqn: pipe.rank_of(s, pp) for s, stage in enumerate(pipe.stages)
                   for fqn in stage}
    per_rank: list[dict[tuple[str, BlockStrategy], int]] = [{} for _ in range(pp)]
    for layer in plan.layers:
        if layer.kind == "block":
            key = (class_of[layer.fqn], BlockStrategy.of(layer))
            counts = per_rank[rank_of_fqn[layer.fqn]]
            counts[key] = counts.get(key, 0) + 1
    return per_rank, rank_of_fqn
