"""Plan assembly: the job's resolved planning inputs, and a costed layout of the job (mesh,
batch split, one strategy per block) written as a Plan with its predictions."""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .cost.hardware import HardwareProfile
from .cost.model import Precision, low_precision_linears
from .errors import Rule, UserError, check_fields, check_value, shown
from .exclusions import exclusion_notes
from .features import Features
from .graph.layer_graph import LayerGraph
from .layout import BlockStrategy, Mesh, edge_strategy
from .pins import Pin
from .plan import LayerPlan, Pipeline, Plan
from .solver import Candidate, block_classes
from .strategies import Constraints


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
                       "regions": list(pin.regions)} for fqn, pin in sorted(inputs.pins.items())},
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
    from .cost.hardware import check_profile_data

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
        if not isinstance(pin, dict) or set(pin) != {"recipe_ac", "recipe_reshard", "regions"}:
            raise UserError(f"{where}pins.{shown(fqn)} must hold recipe_ac, recipe_reshard "
                            f"and regions; {fix}")


def layer_plans(inputs: JobInputs, mesh: Mesh, strategies: list[BlockStrategy],
                predicted: Callable[[str, BlockStrategy], dict[str, float]]) -> list[LayerPlan]:
    """One LayerPlan per layer: edges as ``mesh`` runs them, blocks with ``strategies`` (in
    block order) and the per-layer predictions ``predicted(block class, strategy)`` gives."""
    assigned = iter(zip(block_classes(inputs.graph, inputs.pins), strategies, strict=True))
    layers = []
    for layer in inputs.graph.layers:
        if layer.kind != "block":
            edge = edge_strategy(layer.kind, mesh)
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
        kept[layer.fqn] = [n for n, is_low in zip(layer.linear_names, low, strict=True)
                           if not is_low]
        converted += [f"{layer.fqn}.{n}" for n, is_low in
                      zip(layer.linear_names, low, strict=True) if is_low]
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
            "peak_memory_gib": peak_bytes / 2**30,
            "state_memory_gib": state_bytes / 2**30,
            "budget_gib": inputs.budget_bytes / 2**30,
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


def build_plan(inputs: JobInputs, cand: Candidate, strategies: list[BlockStrategy],
               solver: dict[str, Any]) -> Plan:
    """The Plan for running ``cand`` (mesh, micro-batch) with ``strategies`` for the blocks, in
    block order, with its predicted step time and memory."""
    counts: dict[tuple[str, BlockStrategy], int] = {}
    for key in zip(block_classes(inputs.graph, inputs.pins), strategies, strict=True):
        counts[key] = counts.get(key, 0) + 1

    def predicted(cls: str, strategy: BlockStrategy) -> dict[str, float]:
        cost = cand.costs[(cls, strategy)]
        return {"time_ms": round(cost.time_s * 1e3, 6),
                "comm_ms": round(cost.exposed_comm_s * 1e3, 6),
                "memory_mib": round((cost.kept_bytes + cost.state_bytes) / 2**20, 6)}

    return plan_of(inputs, cand.mesh, cand.microbatch, cand.accum,
                   layer_plans(inputs, cand.mesh, strategies, predicted),
                   cand.step_time(counts), cand.memory(counts), cand.state_bytes, solver)
