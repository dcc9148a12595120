"""Pipeline candidates: the (mesh with pp > 1, schedule, stages per rank, micro-batch) options
of a job, each bounded cheaply (compute only) and costed in full on demand as a ``Candidate``
with its rank types, in-flight activations, bubble and P2P terms (``cost/pipeline.py``).

Block classes other than the main one must form a prefix of the model (deepseek_v3's dense
first layers, a pinned first block): they go to the first stage, so that every stage keeps
consecutive layers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..cost.model import (
    FWD_BWD_BYTES_PER_PARAM,
    GRAD_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    STEP_BYTES_PER_PARAM,
    CostContext,
    Precision,
    edge_cost,
    model_time_floor,
    optimizer_step_s,
    state_bytes,
)
from ..cost.pipeline import (
    backward_split,
    boundary_bytes,
    boundary_tensors,
    bubble,
    in_flight,
    p2p_s,
    stage_block_cost,
)
from ..graph.layer_graph import LayerGraph
from ..job.features import Features
from ..job.pins import Pin
from .candidate import Candidate, Option, block_classes, rank_types
from .layout import AC_MODES, BlockStrategy, Mesh, divisors, fsdp_sharded
from .schedules import (
    MOE_ONLY,
    SCHEDULES,
    SINGLE_STAGE,
    V_SCHEDULES,
    ZERO_BUBBLE,
    microbatch_ok,
    schedule_stages,
    stage_options,
)
from .strategies import Constraints, fastest_strategies, pinned_strategies


def prefix_classes(graph: LayerGraph, pins: dict[str, Pin]) -> tuple[str, tuple[str, ...]] | None:
    """(main class, classes that must sit on the first stage), or None when the block
    classes interleave (a stage split would then change which blocks a class has)."""
    classes = block_classes(graph, pins)
    main = classes[-1]
    first_main = classes.index(main)
    if any(c != main for c in classes[first_main:]):
        return None
    return main, tuple(dict.fromkeys(classes[:first_main]))


def hides_ep(schedule: str, constraints: Constraints) -> bool:
    """DualPipeV with its expert-parallel overlap on hides the token all-to-alls."""
    return schedule == "DualPipeV" and constraints.pp_ep_overlap


def build_pipeline_candidate(graph: LayerGraph, mesh: Mesh, schedule: str, v: int,
                             microbatch: int, microbatches: int, ctx: CostContext,
                             constraints: Constraints, pins: dict[str, Pin],
                             cache: dict | None = None, keep_strategies: bool = False,
                             fastest: bool = False) -> Candidate | None:
    """Costs of one pipeline candidate (None when its block classes interleave or a class has
    no strategy the schedule can run).
    ``keep_strategies``: cost every strategy a plan file or recipe may give a block, not only
    those the search offers. ``fastest``: only those that set the time bound."""
    cache = {} if cache is None else cache
    if "order" not in cache:  # the same for every candidate of a search
        cache["order"] = prefix_classes(graph, pins)
        cache["classes"] = block_classes(graph, pins)
        cache["last_block"] = graph.blocks[-1]
    order = cache["order"]
    if order is None:
        return None
    _, prefix = order
    hide_ep = hides_ep(schedule, constraints)
    key = (mesh, microbatch, hide_ep, keep_strategies, fastest)
    if key not in cache:
        cache[key] = _block_costs(graph, cache["classes"], mesh, microbatch, ctx, constraints,
                                  pins, hide_ep, keep_strategies, fastest)
    classes, strategies, costs, edges = cache[key]
    if not all(strategies.values()):
        return None  # a pinned block's recipe the schedule cannot run (DualPipeV's EP with AC)
    types = rank_types(mesh.pp, schedule)
    flight = {t.name: in_flight(schedule, mesh.pp, v, microbatches, t.rank) for t in types}
    edge_time, edge_step, edge_memory, edge_state = {}, {}, {}, {}
    hop = cache.setdefault(("hop", mesh, microbatch),
                           p2p_s(graph, mesh, microbatch, ctx))
    boundary = boundary_bytes(graph, mesh, microbatch, ctx.prec)
    logits_held = microbatches if schedule == "GPipe" else 1  # the last stage's, in flight
    for t in types:
        kinds = [k for k, on in (("embedding", t.embedding), ("output", t.output)) if on]
        # sends: the stage outputs forward, the input gradients back, per stage and micro-batch
        sends = 2 * v - (1 if t.embedding else 0) - (1 if t.output else 0)
        edge_time[t.name] = (sum(edges[k].time_s for k in kinds)
                             + sends * hop * (1 - ctx.hw.comm_overlap))
        edge_step[t.name] = sum(edges[k].step_s for k in kinds)  # their optimizer step
        # embedding activations stay for every micro-batch in flight, the logits for one
        # (all under GPipe); each stage's outputs in flight and the receive buffers
        outputs = max(0.0, flight[t.name] * v - (1 if t.output else 0))
        edge_memory[t.name] = sum(edges[k].resident_bytes + edges[k].kept_bytes * (
            flight[t.name] if k == "embedding" else logits_held) for k in kinds) + boundary * (
            outputs + boundary_tensors(v, microbatches, t.embedding, t.output))
        edge_state[t.name] = sum(edges[k].step_bytes for k in kinds)
    split_key = ("split", mesh, microbatch, hide_ep, keep_strategies)
    if split_key not in cache:
        frugal = min(strategies[order[0]], key=lambda s: s.ac != "none")
        cache[split_key] = backward_split(cache["last_block"], frugal, ctx.hw)
    split = cache[split_key]
    beta = bubble(schedule, mesh.pp, v, split)
    fill = 2 * (mesh.pp - 1) * hop
    return Candidate(mesh, microbatch, 1, classes, strategies, costs, types, flight,
                     edge_time, edge_step, edge_memory, edge_state, schedule, v, microbatches,
                     prefix, beta, fill)


def stage_tp_modes(mesh: Mesh) -> tuple[str, ...]:
    """What the tp dim may do for a block on a pipeline stage: TorchTitan's TP + SP where
    tp > 1 (tp as data parallel is not offered: its batch split is per micro-batch)."""
    return ("sp",) if mesh.tp > 1 else ("none",)


def _block_costs(graph: LayerGraph, block_class: list[str], mesh: Mesh, microbatch: int,
                 ctx: CostContext, constraints: Constraints, pins: dict[str, Pin],
                 hide_ep: bool, keep_strategies: bool = False, fastest: bool = False) -> tuple:
    classes: dict[str, int] = {}
    representative = {}
    strategies: dict[str, list[BlockStrategy]] = {}
    moe_model = graph.num_experts > 0
    for layer, cls in zip(graph.blocks, block_class, strict=True):
        classes[cls] = classes.get(cls, 0) + 1
        if cls not in representative:
            representative[cls] = layer
            # under PP, TorchTitan keeps parameters unsharded across micro-batches
            options = pinned_strategies(mesh, microbatch, constraints, moe_model,
                                        pins.get(layer.fqn))
            strategies[cls] = sorted({BlockStrategy(s.ac, False, s.tp_mode) for s in options
                                      if s.tp_mode in stage_tp_modes(mesh)})
            if hide_ep and mesh.ep > 1:  # TorchTitan: no AC with EP under DualPipeV
                strategies[cls] = [s for s in strategies[cls] if s.ac == "none"]
            if keep_strategies:
                mode = "sp" if mesh.tp > 1 else "none"
                strategies[cls] = [BlockStrategy(ac, reshard, mode) for ac in AC_MODES
                                   for reshard in (False, True)]
            if fastest:
                strategies[cls] = fastest_strategies(strategies[cls])
    costs = {(c, s): stage_block_cost(representative[c], mesh, s, microbatch, ctx,
                                      graph.grouped_experts, hide_ep)
             for c in classes for s in strategies[c]}
    edges = {}
    for layer in graph.edges:
        cost = edge_cost(graph, layer, mesh, microbatch, ctx)
        per_param = cost.state_bytes / STATE_BYTES_PER_PARAM
        sharded = fsdp_sharded(mesh)
        edges[layer.kind] = EdgeCost(
            cost.time_s,
            per_param * (FWD_BWD_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM)
            + (cost.gathered_bytes if sharded else 0.0),
            cost.kept_bytes, per_param * STEP_BYTES_PER_PARAM[ctx.features.optimizer],
            optimizer_step_s(cost.state_bytes, ctx))
    return classes, strategies, costs, edges


@dataclass(frozen=True)
class EdgeCost:
    """The embedding or norm + output on its stage."""

    time_s: float
    """Per micro-batch."""
    resident_bytes: float
    """Parameters, AdamW moments, gradients (and unsharded copies under FSDP), all step."""
    kept_bytes: float
    """Per micro-batch in flight (the logits: one micro-batch at a time)."""
    step_bytes: float
    step_s: float = 0.0
    """Its optimizer step, once per step (``optimizer_step_s``)."""


def schedules_for(graph: LayerGraph, constraints: Constraints, features: Features
                  ) -> list[str]:
    """The schedules the search may use for this job."""
    out = []
    for schedule in constraints.pp_schedules or SCHEDULES:
        if features.compile and schedule in ZERO_BUBBLE:
            continue
        if schedule in MOE_ONLY and not graph.num_experts:
            continue
        out.append(schedule)
    if "GPipe" in out and "1F1B" in out and not constraints.pp_schedules:
        # same bubble as 1F1B with every micro-batch's activations held: never better
        out.remove("GPipe")
    return out


def no_pipeline_reason(graph: LayerGraph, global_batch: int, constraints: Constraints,
                       features: Features, meshes: list[Mesh]) -> str:
    """Why the search has no pipeline candidate for the fixed pp degree on ``meshes``: no
    schedule left, too few blocks for the stages a schedule runs, or too few micro-batches
    (the conditions it applies, in that order)."""
    pp, n = constraints.pp, len(graph.blocks)
    name = f"{graph.family} {graph.flavor}"
    asked = constraints.pp_schedules or SCHEDULES
    schedules = schedules_for(graph, constraints, features)
    if not schedules:
        moe = [s for s in asked if s in MOE_ONLY and not graph.num_experts]
        if moe:
            return (f"pipeline schedule {moe[0]} is for MoE models (it hides the expert "
                    f"all-to-all); {name} has no routed experts: choose another schedule")
        return (f"pipeline schedules {list(asked)} split the backward, which compiled blocks "
                "cannot: set compile.enable = false or choose 1F1B, GPipe or Interleaved1F1B")
    fixed_v = constraints.pp_stages_per_rank
    shapes = [(s, v) for s in schedules for v in stage_options(s, pp, n)
              if not fixed_v or v == fixed_v]
    if not shapes:
        need = min(v for s in schedules for v in schedule_stages(s) if not fixed_v or v == fixed_v)
        return (f"pipeline schedule {' / '.join(schedules)} runs at least {need} stages per "
                f"rank: pipeline_parallel_degree = {pp} x {need} = {pp * need} stages of at "
                f"least one block each, but {name} has {n} blocks: lower "
                f"pipeline_parallel_degree to {n // need} or less"
                + ("" if any(s in SINGLE_STAGE for s in schedules) else
                   ", or choose a schedule with one stage per rank (1F1B, GPipe)"))
    mb = constraints.pp_microbatch or 1
    have = sorted({global_batch // m.dp // mb for m in meshes
                   if global_batch % m.dp == 0 and (global_batch // m.dp) % mb == 0})
    local = sorted({global_batch // m.dp for m in meshes if global_batch % m.dp == 0})
    if not have and local:
        return (f"parallelism.pipeline_parallel_microbatch_size = {mb} divides no local batch: "
                f"global batch {global_batch} over the data-parallel ranks gives "
                f"{' or '.join(map(str, local))} per rank; choose a divisor of one of them")
    rules: dict[str, list[str]] = {}
    for schedule in dict.fromkeys(s for s, _ in shapes):
        rule = (f"at least {2 * pp}" if schedule in V_SCHEDULES else f"at least {pp}"
                if schedule in SINGLE_STAGE else f"a multiple of {pp}")
        rules.setdefault(rule, []).append(schedule)
    need = min(2 * pp if s in V_SCHEDULES else pp for s, _ in shapes)
    why = "; ".join(f"{rule} for {' / '.join(ss)}" for rule, ss in rules.items())
    return (f"parallelism.pipeline_parallel_degree = {pp} needs at least {need} micro-batches "
            f"per step ({why}): global batch {global_batch} over the data-parallel ranks in "
            f"micro-batches of {mb} gives {' or '.join(map(str, have)) or 'no even split'}; raise "
            "training.global_batch_size or lower parallelism.pipeline_parallel_microbatch_size")


def pipeline_options(graph: LayerGraph, global_batch: int, ctx: CostContext, budget: float,
                     constraints: Constraints, meshes: list[Mesh], pins: dict[str, Pin],
                     cutoff: float = math.inf) -> tuple[list[Option], int, float]:
    """(options, how many, a floor under the memory of those skipped) for ``meshes`` (all with
    pp > 1). The bound is ``model_time_floor``'s (FSDP's collectives once per step, no memory
    costed): a mesh whose memory floor exceeds ``budget`` is skipped without costing, an
    option whose bound reaches ``cutoff`` (a step time already reached) is not listed."""
    schedules = schedules_for(graph, constraints, ctx.features)
    n_blocks = len(graph.blocks)
    cache: dict = {}
    options: list[Option] = []
    splits = 0
    min_floor = math.inf
    # the bubble's shares of one micro-batch's time (checkpointing only lengthens B)
    split = backward_split(graph.blocks[-1], BlockStrategy("none", False), ctx.hw)
    # per (pp, micro-batches): the (schedule, stages per rank, hidden all-to-alls, share of the
    # work per pp rank with the bubble) that can run
    runnable: dict[tuple[int, int], list[tuple[str, int, bool, float]]] = {}
    for mesh in meshes:
        if global_batch % mesh.dp:
            continue
        floor = _memory_floor(graph, mesh, ctx.prec)
        local = global_batch // mesh.dp
        modes = stage_tp_modes(mesh)
        for mb in divisors(local):
            if constraints.pp_microbatch and mb != constraints.pp_microbatch:
                continue
            m = local // mb
            if (mesh.pp, m) not in runnable:
                runnable[(mesh.pp, m)] = [
                    (schedule, v, hides_ep(schedule, constraints),
                     (m + bubble(schedule, mesh.pp, v, split)) / mesh.pp)
                    for schedule in schedules for v in stage_options(schedule, mesh.pp, n_blocks)
                    if (not constraints.pp_stages_per_rank or v == constraints.pp_stages_per_rank)
                    and microbatch_ok(schedule, mesh.pp, v, m)]
            shapes = runnable[(mesh.pp, m)]
            splits += len(shapes)
            if shapes and floor > budget:  # no split of this mesh fits: not costed
                min_floor = min(min_floor, floor)
                continue
            work: dict[tuple[bool, str], float] = {}
            for schedule, v, hide_ep, share in shapes:
                for fsdp in ("", "step"):  # FSDP's share only for the fewer left
                    if (hide_ep, fsdp) not in work:
                        work[(hide_ep, fsdp)] = model_time_floor(graph, mesh, mb, ctx, modes,
                                                                 hide_ep, fsdp)
                    bound = share * work[(hide_ep, fsdp)]
                    if bound >= cutoff:
                        break
                if not bound >= cutoff:  # a NaN goes on to the finiteness check
                    options.append((bound, mesh, schedule, v, mb, functools.partial(
                        build_pipeline_candidate, graph, mesh, schedule, v, mb, m, ctx,
                        constraints, pins, cache)))
    return options, splits, min_floor


def _memory_floor(graph: LayerGraph, mesh: Mesh, prec: Precision) -> float:
    """A floor under the fullest pp rank's memory on ``mesh`` (the average rank's): sharded
    parameters, gradients and AdamW state, and under FSDP the stage's parameters gathered (1
    byte each at least) and their unreduced gradients."""
    shards = mesh.dp_shard * mesh.cp * mesh.tp
    total = 0.0
    for layer, n in graph.alike:
        experts = layer.expert_params if mesh.ep > 1 else 0
        total += n * state_bytes(layer) / shards
        if fsdp_sharded(mesh, experts=bool(layer.expert_params)):
            split = (layer.params - experts) / mesh.tp + experts / (mesh.ep * mesh.etp)
            total += n * split * (1 + prec.reduce_bytes)
    return total / mesh.pp
