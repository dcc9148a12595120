"""Plan assembly: the job's resolved planning inputs, and a costed layout of the job (mesh,
batch split, stage split under pp, one strategy per block) written as a Plan with its
predictions; a solution's per-rank block counts turned into such a layout (stages of
consecutive layers, ``parallelism.module_fqns_per_model_part``)."""

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..candidates.candidate import Candidate, Counts, block_classes, build_candidate
from ..candidates.exclusions import exclusion_notes
from ..candidates.layout import GIB, BlockStrategy, Mesh, edge_strategy
from ..candidates.pipeline import build_pipeline_candidate
from ..candidates.strategies import Constraints
from ..cost.hardware import HardwareProfile
from ..cost.model import CostContext, Precision, linear_names, low_precision_linears
from ..errors import Rule, UserError, check_fields, check_value, shown
from ..graph.layer_graph import LayerGraph
from ..job.features import Features
from ..job.pins import Pin
from ..solve.milp import Solution
from .schema import LayerPlan, Pipeline, Plan


@dataclass(frozen=True)
class JobInputs:
    """Everything planning reads from a job, resolved (profile loaded, defaults applied)."""

    graph: LayerGraph
    constraints: Constraints
    hw: HardwareProfile
    gpus_per_node: int
    budget_bytes: float
    global_batch: int
    precision: Precision
    world: int
    fingerprint: dict[str, Any]
    pins: dict[str, Pin] = dataclasses.field(default_factory=dict)
    """What ``autoparallel.pin`` (and the family's default pins) fix, per block fqn."""
    features: Features = Features()
    """Compile, float8 / MX, async TP, CPU offload and the resharding policy of the job."""

    @functools.cached_property
    def cost_context(self) -> CostContext:
        """What the cost model reads of the job beside its layers and a layout."""
        return CostContext(hw=self.hw, prec=self.precision, gpus_per_node=self.gpus_per_node,
                           features=self.features)


def with_global_batch(inputs: JobInputs, global_batch: int) -> JobInputs:
    """``inputs`` with another global batch (fingerprint included)."""
    return dataclasses.replace(inputs, global_batch=global_batch, fingerprint={
        **inputs.fingerprint, "global_batch_size": global_batch})


def inputs_record(inputs: JobInputs) -> dict[str, Any]:
    """The resolved planning inputs as plain data (stored in the plan as ``Plan.inputs``)."""
    fp = inputs.fingerprint
    return {
        "model": fp["model"], "flavor": fp["flavor"], "seq_len": inputs.graph.seq_len,
        "world_size": inputs.world, "global_batch_size": inputs.global_batch,
        "gpus_per_node": inputs.gpus_per_node, "budget_bytes": inputs.budget_bytes,
        "hardware": inputs.hw.to_dict(),
        "precision": dataclasses.asdict(inputs.precision),
        "constraints": {key: list(value) if isinstance(value, tuple) else value
                        for key, value in dataclasses.asdict(inputs.constraints).items()},
        "features": inputs.features.to_dict(),
        "pins": {fqn: {"recipe_ac": pin.recipe_ac, "recipe_reshard": pin.recipe_reshard,
                       "regions": list(pin.regions), **({"ac": pin.ac} if pin.ac else {}),
                       **({"defaults_only": True} if pin.defaults_only else {})}
                 for fqn, pin in sorted(inputs.pins.items())},
    }


RECORD_RULES: dict[str, Rule] = {
    "world_size": Rule(int, ge=1), "global_batch_size": Rule(int, ge=1),
    "gpus_per_node": Rule(int, ge=1), "budget_bytes": Rule(float, gt=0),
    "seq_len": Rule(int, ge=1), "model": Rule(str), "flavor": Rule(str),
    "hardware": Rule(dict), "precision": Rule(dict), "constraints": Rule(dict),
    "features": Rule(dict), "pins": Rule(dict),
}
"""The stored planning inputs of a plan (``inputs_record``)."""


def check_inputs_record(record: Any, source: str) -> None:
    """A plan's stored planning inputs, checked as their sources are (the hardware profile by
    its rules, the rest by their types), so an edited value is one line, not a traceback or a
    negative time."""
    from ..cost.hardware import check_profile_data

    where = f"plan {source}: inputs."
    fix = "re-plan the job, or restore the value"
    if not isinstance(record, dict):
        raise UserError(f"plan {source}: inputs must be an object; {fix}")
    missing = sorted(set(RECORD_RULES) - set(record))
    if missing:
        raise UserError(f"{where}{missing[0]} is missing; {fix}")
    for key, rule in RECORD_RULES.items():
        check_value(where, key, record[key], rule, fix)
    check_profile_data(record["hardware"], f"in plan {source}")
    for name, cls in (("precision", Precision), ("constraints", Constraints),
                      ("features", Features)):
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in record[name].items()}
        check_fields(f"{where}{name}.", values, cls, {}, fix)
    for fqn, pin in record["pins"].items():
        if not isinstance(pin, dict) or set(pin) - {"ac", "defaults_only"} != {
                "recipe_ac", "recipe_reshard", "regions"} \
                or pin.get("ac", "none") not in ("none", "full") \
                or pin.get("defaults_only", True) is not True:
            raise UserError(f"{where}pins.{shown(fqn)} must hold recipe_ac, recipe_reshard "
                            f"and regions (and ac 'none' or 'full', defaults_only true where "
                            f"set); {fix}")


def layer_plans(inputs: JobInputs, mesh: Mesh, strategies: list[BlockStrategy],
                predicted: Callable[[str, BlockStrategy], dict[str, float]],
                embedding: str = "") -> list[LayerPlan]:
    """One LayerPlan per layer: edges as ``mesh`` runs them (the embedding in mode
    ``embedding``), blocks with ``strategies`` (in block order) and the per-layer predictions
    ``predicted(block class, strategy)`` gives."""
    assigned = iter(zip(block_classes(inputs.graph, inputs.pins), strategies, strict=True))
    layers = []
    for layer in inputs.graph.layers:
        if layer.kind != "block":
            edge = edge_strategy(layer.kind, mesh, embedding)
            layers.append(LayerPlan(layer.fqn, layer.kind, edge.ac, edge.reshard_after_forward,
                                    edge.tp_mode))
            continue
        cls, strategy = next(assigned)
        pin = inputs.pins.get(layer.fqn)
        layers.append(LayerPlan(
            layer.fqn, "block", strategy.ac, strategy.reshard_after_forward, strategy.tp_mode,
            **predicted(cls, strategy),
            ep=mesh.ep if layer.expert_params else 1,
            pinned=bool(pin and pin.whole),
            fsdp_unit=strategy.fsdp_unit,
        ))
    return layers


def float8_filter_fqns(inputs: JobInputs, mesh: Mesh, microbatch: int,
                       layers: list[LayerPlan]) -> list[str] | None:
    """``filter_fqns`` for TorchTitan's float8 converter when the planner chooses the float8
    linears (a float8 job without filter_fqns): the output layer (left in bf16 and costed so)
    and the block linears the cost model keeps in bf16, by their name inside the block where
    every block keeps the same ones, else by FQN. TorchTitan matches entries as substrings of
    a linear's FQN: an entry that would also catch a linear chosen for float8 (``wq`` in
    ``wq_a``) is left out, and that linear runs float8. None when the planner does not
    choose."""
    features = inputs.features
    if not features.float8 or features.float8_filter is not None:
        return None
    strategies = {layer.fqn: BlockStrategy.of(layer) for layer in layers}
    kept: dict[str, list[str]] = {}
    converted: list[str] = []
    for layer in inputs.graph.blocks:
        low = low_precision_linears(layer, mesh, strategies[layer.fqn], microbatch, inputs.hw,
                                    features)
        kept[layer.fqn] = [n for n, is_low in zip(linear_names(layer), low, strict=True)
                           if not is_low]
        converted += [f"{layer.fqn}.{n}" for n, is_low in
                      zip(linear_names(layer), low, strict=True) if is_low]
    if len({tuple(names) for names in kept.values()}) == 1:
        entries = next(iter(kept.values()))
    else:
        entries = [f"{fqn}.{name}" for fqn, names in kept.items() for name in names]
    return [inputs.graph.layers[-1].fqn,
            *(e for e in entries if not any(e in fqn for fqn in converted))]


def plan_of(inputs: JobInputs, mesh: Mesh, local_batch: int, accum: int,
            layers: list[LayerPlan], step: float, peak_bytes: float, state_bytes: float,
            solver: dict[str, Any], pipeline: Pipeline | None = None) -> Plan:
    """The Plan record of a costed layout (step time in s, memory in bytes)."""
    return Plan(
        fingerprint=inputs.fingerprint,
        mesh=mesh,
        global_batch_size=inputs.global_batch,
        local_batch_size=local_batch,
        gradient_accumulation_steps=accum,
        seq_len=inputs.graph.seq_len,
        layers=layers,
        predicted={
            "step_time_s": step,
            "tokens_per_s": inputs.global_batch * inputs.graph.seq_len / step,
            "peak_memory_gib": peak_bytes / GIB,
            "state_memory_gib": state_bytes / GIB,
            "budget_gib": inputs.budget_bytes / GIB,
        },
        solver={**solver, "objective": step},
        pipeline=pipeline,
        float8_filter_fqns=float8_filter_fqns(
            inputs, mesh, pipeline.microbatch_size if pipeline else local_batch, layers),
        inputs=inputs_record(inputs),
        notes=exclusion_notes(inputs.graph) + ([] if inputs.constraints.accumulation else [
            "optimizer.early_step_in_backward: no DDP, PP, EP or gradient accumulation "
            "(gradients are final when each parameter steps)"]),
    )


def candidate_for(inputs: JobInputs, mesh: Mesh, local_batch: int,
                  pipeline: Pipeline | None = None, embedding: str = "") -> Candidate:
    """The costs of a given layout of the job (a plan's, or a TorchTitan recipe's): flat with
    micro-batches of ``local_batch`` and the embedding in mode ``embedding``
    (``Plan.embedding_mode``), or ``pipeline``'s schedule and micro-batches; under pp every
    strategy a plan file or recipe may give a block is costed."""
    if pipeline is None:
        return build_candidate(inputs.graph, mesh, local_batch, inputs.global_batch,
                               inputs.cost_context, inputs.constraints, inputs.pins,
                               embedding=embedding)
    cand = build_pipeline_candidate(
        inputs.graph, mesh, pipeline.schedule, pipeline.stages_per_rank,
        pipeline.microbatch_size, pipeline.microbatches, inputs.cost_context,
        inputs.constraints, inputs.pins, keep_strategies=True)
    if cand is None:
        raise UserError("the model's block kinds alternate: it cannot be costed under pp")
    return cand


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
    embedding = graph.embedding.fqn
    head = [name for name in (adapter.final_norm,) if name] + [
        layer.fqn for layer in graph.layers if layer.kind == "output"]
    return embedding, head


def assign(inputs: JobInputs, sol: Solution) -> tuple[list[list[str]] | None, list[BlockStrategy]]:
    """(module fqns per stage, None without pp; one strategy per block in block order) of a
    MILP solution. Within a class the most memory-saving strategies go to the earliest blocks
    (deterministic; the order does not change the predicted time or peak)."""
    cand = sol.candidate
    graph = inputs.graph
    pp, v = cand.mesh.pp, cand.stages_per_rank
    classes = block_classes(graph, inputs.pins)
    prefix = sum(1 for c in classes if c in cand.prefix)
    queues: dict[int, dict[str, list[BlockStrategy]]] = {}
    sizes: dict[int, list[int]] = {}
    for rank, counts in enumerate(cand.per_rank(sol.counts)):
        queue: dict[str, list[BlockStrategy]] = {}
        for (cls, strategy), n in sorted(
                counts.items(), key=lambda kv: (kv[0][0], cand.costs[kv[0]].kept_bytes, kv[0][1])):
            queue.setdefault(cls, []).extend([strategy] * n)
        queues[rank] = queue
        sizes[rank] = stage_sizes(sum(counts.values()), v, prefix if rank == 0 else 0)
    if pp == 1:
        return None, [queues[0][cls].pop(0) for cls in classes]
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


def plan_of_solution(inputs: JobInputs, sol: Solution, solver: dict[str, Any]) -> Plan:
    """The Plan of a MILP solution."""
    stages, strategies = assign(inputs, sol)
    return build_plan(inputs, sol.candidate, strategies, solver, stages)


def build_plan(inputs: JobInputs, cand: Candidate, strategies: list[BlockStrategy],
               solver: dict[str, Any], stages: list[list[str]] | None = None) -> Plan:
    """The Plan for running ``cand`` with ``strategies`` for the blocks (in block order) and,
    under pp, ``stages`` (module fqns per stage, in stage order): per-layer, per-rank and
    whole-step predictions."""
    graph = inputs.graph
    pp = cand.mesh.pp
    shape = None if stages is None else Pipeline(
        cand.schedule, cand.stages_per_rank, cand.microbatches, cand.microbatch, stages)
    rank_of_fqn = {} if shape is None else {
        fqn: shape.rank_of(s, pp) for s, stage in enumerate(shape.stages) for fqn in stage}
    per_rank: list[Counts] = [{} for _ in range(pp)]
    for layer, key in zip(graph.blocks, zip(block_classes(graph, inputs.pins), strategies,
                                            strict=True), strict=True):
        counts = per_rank[rank_of_fqn.get(layer.fqn, 0)]
        counts[key] = counts.get(key, 0) + 1
    step, times, memory = cand.evaluate(per_rank)
    states = [cand.rank_state(cand.type_of_rank(r), per_rank[r], inputs.features.optimizer)
              for r in range(pp)]
    if shape is not None:
        shape.bubble_fraction = round(cand.beta * max(times) / step, 6)
        shape.rank_time_ms = [round(t * 1e3, 6) for t in times]
        shape.rank_memory_gib = [round(b / GIB, 6) for b in memory]
        shape.rank_state_gib = [round(b / GIB, 6) for b in states]
    layers = layer_plans(inputs, cand.mesh, strategies,
                         lambda cls, strategy: cand.costs[(cls, strategy)].plan_fields(),
                         cand.embedding)
    return plan_of(inputs, cand.mesh, cand.microbatch * cand.microbatches, cand.accum, layers,
                   step, max(memory), max(states), solver, pipeline=shape)


def rank_counts(plan: Plan, class_of: dict[str, str]) -> tuple[list[Counts], dict[str, int]]:
    """Each pp rank's blocks per (class, strategy) in ``plan``, and each block's rank."""
    pipe = plan.pipeline
    pp = plan.mesh.pp
    rank_of_fqn = {} if pipe is None else {
        fqn: pipe.rank_of(s, pp) for s, stage in enumerate(pipe.stages) for fqn in stage}
    per_rank: list[Counts] = [{} for _ in range(pp)]
    for layer in plan.layers:
        if layer.kind == "block":
            key = (class_of[layer.fqn], BlockStrategy.of(layer))
            counts = per_rank[rank_of_fqn.get(layer.fqn, 0)]
            counts[key] = counts.get(key, 0) + 1
    return per_rank, rank_of_fqn
