"""A pipeline MILP solution as a Plan: per-rank block counts -> stages of consecutive layers
(``parallelism.module_fqns_per_model_part``) with one strategy per block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cost.model import STATE_BYTES_PER_PARAM, STEP_BYTES_PER_PARAM
from .exclusions import exclusion_notes
from .graph.adapters import get_adapter
from .plan import LayerPlan, Pipeline, Plan
from .solver import block_classes
from .solver_pipeline import PipelineCandidate, PipelineSolution, RankType
from .strategies import BlockStrategy, edge_strategy

if TYPE_CHECKING:
    from .planner import JobInputs


def type_of_rank(cand: PipelineCandidate, rank: int) -> RankType:
    """The rank type pp rank ``rank`` belongs to."""
    by_name = {t.name: t for t in cand.types}
    if rank == 0:
        return by_name["first"]
    if "last" in by_name and rank == cand.mesh.pp - 1:
        return by_name["last"]
    return by_name["middle"]


def stage_sizes(blocks: int, stages: int, first_at_least: int = 0) -> list[int]:
    """``blocks`` split over ``stages`` as evenly as possible (earlier stages take the extra
    ones); the first stage takes at least ``first_at_least``."""
    first = max(first_at_least, -(-blocks // stages))
    rest = blocks - first
    if stages == 1:
        return [blocks]
    base, extra = divmod(rest, stages - 1)
    return [first] + [base + (1 if i < extra else 0) for i in range(stages - 1)]


def assign_stages(inputs: JobInputs, sol: PipelineSolution
                  ) -> tuple[list[list[str]], list[BlockStrategy], list[int]]:
    """(module fqns per stage, one strategy per block in block order, each block's pp rank)."""
    cand = sol.candidate
    graph = inputs.graph
    pp, v = cand.mesh.pp, cand.stages_per_rank
    classes = block_classes(graph, inputs.pins)
    queues: dict[int, dict[str, list[BlockStrategy]]] = {}
    sizes: dict[int, list[int]] = {}
    prefix = sum(1 for c in classes if c in cand.prefix)
    for rank in range(pp):
        counts = sol.counts[type_of_rank(cand, rank).name]
        queue: dict[str, list[BlockStrategy]] = {}
        # within a class, the most memory-saving strategies first (deterministic)
        for (cls, strategy), n in sorted(
                counts.items(), key=lambda kv: (kv[0][0], cand.costs[kv[0]].act_bytes, kv[0][1])):
            queue.setdefault(cls, []).extend([strategy] * n)
        queues[rank] = queue
        sizes[rank] = stage_sizes(sum(counts.values()), v, prefix if rank == 0 else 0)
    pipeline = Pipeline(cand.schedule, v, cand.microbatches, cand.microbatch, [])
    adapter = get_adapter(graph.family)
    embedding = next(layer.fqn for layer in graph.layers if layer.kind == "embedding")
    head = [name for name in (adapter.final_norm,) if name] + [
        layer.fqn for layer in graph.layers if layer.kind == "output"]
    stages: list[list[str]] = []
    strategies: list[BlockStrategy] = []
    ranks: list[int] = []
    taken = {rank: 0 for rank in range(pp)}
    block = 0
    for stage in range(pp * v):
        rank = pipeline.rank_of(stage, pp)
        size = sizes[rank][taken[rank]]
        taken[rank] += 1
        fqns = [embedding] if stage == 0 else []
        for _ in range(size):
            layer = graph.blocks[block]
            fqns.append(layer.fqn)
            strategies.append(queues[rank][classes[block]].pop(0))
            ranks.append(rank)
            block += 1
        if stage == pp * v - 1:
            fqns.extend(head)
        stages.append(fqns)
    return stages, strategies, ranks


def build_pipeline_plan(inputs: JobInputs, sol: PipelineSolution, solver: dict[str, Any]
                        ) -> Plan:
    """The Plan of a pipeline solution, with its stages and per-rank predictions."""
    from .planner import inputs_record

    cand = sol.candidate
    graph = inputs.graph
    stages, strategies, ranks = assign_stages(inputs, sol)
    classes = block_classes(graph, inputs.pins)
    layers = []
    blocks = iter(zip(classes, strategies, strict=True))
    for layer in graph.layers:
        if layer.kind != "block":
            edge = edge_strategy(layer.kind, cand.mesh)
            layers.append(LayerPlan(layer.fqn, layer.kind, edge.ac, edge.reshard_after_forward,
                                    edge.tp_mode))
            continue
        cls, strategy = next(blocks)
        cost = cand.costs[(cls, strategy)]
        pin = inputs.pins.get(layer.fqn)
        layers.append(LayerPlan(
            layer.fqn, "block", strategy.ac, strategy.reshard_after_forward, strategy.tp_mode,
            time_ms=round(cost.time_s * 1e3, 6),
            memory_mib=round((cost.resident_bytes + cost.act_bytes) / 2**20, 6),
            ep=cand.mesh.ep if layer.expert_params else 1,
            pinned=bool(pin and pin.whole)))
    pp = cand.mesh.pp
    per_rank = [type_of_rank(cand, r) for r in range(pp)]
    rank_time = [cand.rank_time(t, sol.counts[t.name]) for t in per_rank]
    rank_memory = [cand.rank_memory(t, sol.counts[t.name]) for t in per_rank]
    step = sol.step_time_s
    pipeline = Pipeline(
        schedule=cand.schedule, stages_per_rank=cand.stages_per_rank,
        microbatches=cand.microbatches, microbatch_size=cand.microbatch, stages=stages,
        bubble_fraction=round(cand.beta * max(rank_time) / step, 6),
        rank_time_ms=[round(t * 1e3, 6) for t in rank_time],
        rank_memory_gib=[round(b / 2**30, 6) for b in rank_memory])
    # parameters, gradients and AdamW state of the fullest rank (its optimizer-step bytes
    # less the step's temporary)
    state = max(cand.edge_state[t.name] + sum(n * cand.costs[k].step_bytes
                                              for k, n in sol.counts[t.name].items())
                for t in cand.types) * STATE_BYTES_PER_PARAM / STEP_BYTES_PER_PARAM
    return Plan(
        fingerprint=inputs.fingerprint,
        mesh=cand.mesh,
        global_batch_size=inputs.global_batch,
        local_batch_size=cand.microbatch * cand.microbatches,
        gradient_accumulation_steps=1,
        seq_len=graph.seq_len,
        layers=layers,
        predicted={
            "step_time_s": step,
            "tokens_per_s": inputs.global_batch * graph.seq_len / step,
            "peak_memory_gib": sol.peak_bytes / 2**30,
            "state_memory_gib": state / 2**30,
            "budget_gib": inputs.budget_bytes / 2**30,
        },
        solver={**solver, "objective": step},
        pipeline=pipeline,
        inputs=inputs_record(inputs),
        notes=exclusion_notes(graph),
    )
