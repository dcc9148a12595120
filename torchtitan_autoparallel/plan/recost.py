"""A plan file's inputs rebuilt from the plan alone (version-1 plans from their fingerprint) and
the plan costed again by the current cost model."""

import dataclasses
import math
from typing import Any

from ..candidates.candidate import block_classes
from ..candidates.exclusions import without_excluded
from ..candidates.layout import GIB, BlockStrategy
from ..candidates.strategies import Constraints, embedding_dim_refused
from ..cost.hardware import HardwareProfile, load_profile
from ..cost.model import Precision
from ..errors import UserError
from ..frontend import frontend
from ..graph.layer_graph import LayerGraph
from ..job.features import Features
from ..job.inputs import DTYPE_BYTES, model_layer_graph
from ..job.model_config import (
    model_config_from_fingerprint,
)
from ..job.pins import Pin, recipe_of, resolve_pins
from .assembly import (
    JobInputs,
    build_plan,
    candidate_for,
    check_inputs_record,
    inputs_record,
)
from .schema import Plan, check_plan_for_job


def recost(plan: Plan, hw: HardwareProfile | None = None,
           cache: dict[str, Any] | None = None) -> Plan:
    """``plan`` (same mesh, batch split, per-block strategies) costed again by the current cost
    model on ``hw`` (default: the profile stored in the plan). ``cache`` keeps layer graphs
    between calls."""
    inputs = inputs_from_plan(plan, cache, hw)
    inputs = dataclasses.replace(inputs, hw=hw or inputs.hw)
    pipe = plan.pipeline
    cand = candidate_for(inputs, plan.mesh, plan.local_batch_size, pipe, plan.embedding_mode)
    strategies = [BlockStrategy.of(lp) for lp in plan.layers if lp.kind == "block"]
    check_costable(plan, inputs, set(cand.costs))
    return build_plan(inputs, cand, strategies, {},
                      None if pipe is None else [list(s) for s in pipe.stages])


def check_costable(plan: Plan, inputs: JobInputs, costed: set[tuple[str, BlockStrategy]]
                   ) -> None:
    """Every block's strategy is one the cost model has for that block on the plan's mesh
    (``costed``: the candidate's (class, strategy) keys); an FSDP unit holds blocks of one
    kind (an edited plan that fails here would be applied uncosted, or not at all)."""
    from .schema import PLAN_FIX, fsdp_units

    class_of = dict(zip([b.fqn for b in inputs.graph.blocks],
                        block_classes(inputs.graph, inputs.pins), strict=True))
    for unit in fsdp_units(plan.layers):
        if len({class_of[b.fqn] for b in unit}) > 1:
            raise UserError(f"plan: {unit[0].fqn} starts an FSDP unit of {len(unit)} blocks "
                            "that are not all of one kind (same parameters and pins); "
                            f"{PLAN_FIX}")
    for layer in plan.layers:
        if layer.kind == "block" and (class_of[layer.fqn], BlockStrategy.of(layer)) \
                not in costed:
            raise UserError(
                f"plan: {layer.fqn} runs {layer.describe(plan.mesh.unsharded_label)!r}, which "
                f"is no strategy the planner has for this block on mesh {plan.mesh} (e.g. an "
                "FSDP unit longer than its run of identical blocks, or a pinned block's "
                f"strategy changed); {PLAN_FIX}")
    refused = plan.embedding_mode and embedding_dim_refused(inputs.graph, plan.mesh,
                                                            inputs.constraints,
                                                            plan.embedding_mode)
    if refused:
        raise UserError(f"plan: {refused}; {PLAN_FIX}")


def recosted_file(plan: Plan, cache: dict[str, Any] | None = None) -> tuple[Plan, str]:
    """A plan read from a file, its predictions (plan-wide and per layer) made again from its
    own inputs by the current cost model, and a note when the file's differ: a file whose mesh,
    strategies or predictions were edited is explained, shown and applied with what it will
    actually cost, never with the numbers written in it ("" when they agree)."""
    fresh = recost(plan, cache=cache)
    old, new = plan.predicted, fresh.predicted
    if all(math.isclose(old[k], new[k], rel_tol=1e-6, abs_tol=1e-12)
           for k in ("step_time_s", "peak_memory_gib", "state_memory_gib")):
        return plan, ""
    costs = {layer.fqn: layer for layer in fresh.layers}
    layers = [dataclasses.replace(layer, time_ms=costs[layer.fqn].time_ms,
                                  comm_ms=costs[layer.fqn].comm_ms,
                                  memory_mib=costs[layer.fqn].memory_mib)
              if layer.fqn in costs else layer for layer in plan.layers]
    note = (f"the file's predictions (step {old['step_time_s']:.4g} s, peak "
            f"{old['peak_memory_gib']:.3g} GiB) are not what its mesh and strategies cost "
            f"(step {new['step_time_s']:.4g} s, peak {new['peak_memory_gib']:.3g} GiB): the "
            "file was edited or made by another version; the re-costed ones are used")
    pipeline = plan.pipeline
    if pipeline is not None and fresh.pipeline is not None:
        pipeline = dataclasses.replace(pipeline, **{
            k: getattr(fresh.pipeline, k)
            for k in ("bubble_fraction", "rank_time_ms", "rank_memory_gib", "rank_state_gib")})
    return dataclasses.replace(plan, predicted=new, layers=layers, pipeline=pipeline), note


def inputs_from_plan(plan: Plan, cache: dict[str, Any] | None = None,
                     hw: HardwareProfile | None = None) -> JobInputs:
    """The planning inputs ``plan`` was made from, rebuilt from the plan alone (its stored
    inputs; for a version-1 plan, its fingerprint and the hardware profile it names, or ``hw``
    in its place). ``cache`` keeps layer graphs between calls."""
    fp = plan.fingerprint
    cache = {} if cache is None else cache
    model_config = model_config_from_fingerprint(fp)
    key = f"{fp['model']}/{fp['flavor']}/{fp['seq_len']}"
    if model_config is not None:
        key += f"/{model_config.key}"
    if key not in cache:
        # the release's own models, and the user's train spec and adapter
        frontend().prepare_models(fp.get("custom_import", ""))
        cache[key] = model_layer_graph(fp["model"], fp["flavor"], fp["seq_len"], model_config)
    graph = cache[key]
    check_plan_for_job(plan, fp["world_size"], [(layer.fqn, layer.kind) for layer in
                                                graph.layers], "file")
    record = plan.inputs or record_from_fingerprint(fp, graph, hw)
    if plan.inputs:
        check_inputs_record(record, "file (its stored inputs)")
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(record["hardware"]) - known)
    if unknown:
        raise UserError(f"the plan's hardware profile has fields this version does not know "
                        f"({unknown}): re-plan the job with this version")
    constraints = {key: tuple(value) if isinstance(value, list) else value
                   for key, value in record["constraints"].items()}
    pins = {fqn: Pin(p["recipe_ac"], p["recipe_reshard"], tuple(p["regions"]), p.get("ac"),
                     p.get("defaults_only", False))
            for fqn, p in record["pins"].items()}
    return JobInputs(graph, Constraints(**constraints), HardwareProfile(**record["hardware"]),
                     record["gpus_per_node"], record["budget_bytes"], plan.global_batch_size,
                     Precision(**record["precision"]), record["world_size"], plan.fingerprint,
                     pins, Features.from_dict(record["features"]))


def record_from_fingerprint(fp: dict[str, Any], graph: LayerGraph,
                            hw: HardwareProfile | None = None) -> dict[str, Any]:
    """``inputs_record`` of a version-1 plan: its fingerprint resolved again (the hardware
    profile by name, or ``hw`` standing in for it; the pins against the model's ``graph``)."""
    c = fp["constraints"]
    reshard = c.get("reshard_after_forward", "default")
    hw = hw or load_profile(fp["hardware"])
    hw = dataclasses.replace(hw, moe_load_imbalance=fp.get("moe_load_imbalance")
                             or hw.moe_load_imbalance)
    recipe = {"ac_mode": "none", "selective_ac_option": "op",
              "fsdp_reshard_after_forward": reshard, **fp.get("pin_recipe", {})}
    pins = resolve_pins(graph, list(fp.get("pin", [])), graph.adapter.default_pins,
                        recipe_of(recipe))
    features = Features.from_dict(fp.get("features", {}))
    constraints = without_excluded(Constraints(
        c["dp_replicate"], c["dp_shard"], c["tp"], c.get("cp", 0), c.get("ep", 0),
        c.get("etp", 0), tuple(c["techniques"]), reshard_after_forward=reshard), graph,
        fp["world_size"])
    inputs = JobInputs(graph, constraints, hw, fp["gpus_per_node"],
                       fp["memory_budget_gib"] * GIB, fp["global_batch_size"],
                       Precision(DTYPE_BYTES[fp["mixed_precision_param"]],
                                 DTYPE_BYTES[fp["mixed_precision_reduce"]]),
                       fp["world_size"], fp, pins, features)
    return inputs_record(inputs)


def block_counts(plan: Plan, inputs: JobInputs
                 ) -> tuple[dict[str, str], dict[tuple[str, BlockStrategy], int]]:
    """Each block's MILP class (by fqn) and the plan's number of blocks per (class, strategy)."""
    class_of = dict(zip([b.fqn for b in inputs.graph.blocks],
                        block_classes(inputs.graph, inputs.pins), strict=True))
    counts: dict[tuple[str, BlockStrategy], int] = {}
    for layer in plan.layers:
        if layer.kind == "block":
            key = (class_of[layer.fqn], BlockStrategy.of(layer))
            counts[key] = counts.get(key, 0) + 1
    return class_of, counts
