"""The pipeline-parallel MILP: stage split and per-stage block strategies in one solve.

A pipeline candidate fixes the mesh (pp > 1), the schedule, the stages per rank ``v`` and the
micro-batch size. Its pp ranks fall into a few *rank types* whose ranks are interchangeable:
the first (embedding; with V schedules also norm + output), the middle ones (blocks only) and
the last (norm + output). Per rank type ``t`` the MILP counts blocks per class and strategy,
``n[t,c,s]``, so its size does not grow with depth or pp; a makespan ``T`` bounds every rank
type's time per micro-batch and ``F`` its per-step FSDP collectives:

    minimize   (m + beta) * T + F                    (cost/pipeline.py: the schedule's bubble)
    subject to sum_t ranks[t] * sum_s n[t,c,s] = N[c]   (every block on one stage)
               sum_{c,s} n[t,c,s] >= v                  (every stage holds a block)
               edge_time[t] + sum n[t,c,s] * time[c,s] <= T
               edge_step[t] + sum n[t,c,s] * step[c,s] <= F
               edge_mem[t] + sum n[t,c,s] (resident[c,s] + in_flight[t] act[c,s]) + W[t] <= budget
               W[t] >= transient[c,s] * y[t,c,s],  n[t,c,s] <= N[c] y[t,c,s]
               edge_state[t] + sum n[t,c,s] * step_bytes[c,s] <= budget (optimizer step)

Block classes other than the main one must form a prefix of the model (deepseek_v3's dense
first layers, a pinned first block): they go to the first stage, so that every stage keeps
consecutive layers. Solved to optimality (``mip_rel_gap = 0``).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import highspy

from .cost.hardware import HardwareProfile
from .cost.model import (
    FWD_BWD_BYTES_PER_PARAM,
    GRAD_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    STEP_BYTES_PER_PARAM,
    Precision,
    compute_s,
    edge_cost,
    state_bytes,
)
from .cost.pipeline import (
    Split,
    StageBlockCost,
    backward_split,
    boundary_bytes,
    boundary_tensors,
    bubble,
    in_flight,
    p2p_s,
    stage_block_cost,
)
from .errors import UserError
from .features import EAGER, Features
from .graph.layer_graph import LayerGraph
from .layout import AC_MODES, BlockStrategy, Mesh, divisors, fsdp_sharded
from .pins import Pin
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
from .solver import SolveTimeout, _new_highs, block_classes
from .strategies import Constraints, pinned_strategies


@dataclass(frozen=True)
class RankType:
    """pp ranks that hold the same kind of stages (``rank``: the one with the most
    activations in flight, which sets the type's memory)."""

    name: str
    ranks: int
    rank: int
    embedding: bool
    output: bool


def rank_types(pp: int, schedule: str) -> tuple[RankType, ...]:
    if schedule in V_SCHEDULES:
        return (RankType("first", 1, 0, True, True),
                RankType("middle", pp - 1, 1, False, False))
    types = [RankType("first", 1, 0, True, False)]
    if pp > 2:
        types.append(RankType("middle", pp - 2, 1, False, False))
    types.append(RankType("last", 1, pp - 1, False, True))
    return tuple(types)


def prefix_classes(graph: LayerGraph, pins: dict[str, Pin]) -> tuple[str, tuple[str, ...]] | None:
    """(main class, classes that must sit on the first stage), or None when the block
    classes interleave (a stage split would then change which blocks a class has)."""
    classes = block_classes(graph, pins)
    main = classes[-1]
    first_main = classes.index(main)
    if any(c != main for c in classes[first_main:]):
        return None
    return main, tuple(dict.fromkeys(classes[:first_main]))


@dataclass(frozen=True)
class PipelineCandidate:
    """One (mesh with pp, schedule, stages per rank, micro-batch size) with its costs."""

    mesh: Mesh
    schedule: str
    stages_per_rank: int
    microbatch: int
    microbatches: int
    classes: dict[str, int]
    prefix: tuple[str, ...]
    strategies: dict[str, list[BlockStrategy]]
    costs: dict[tuple[str, BlockStrategy], StageBlockCost]
    types: tuple[RankType, ...]
    in_flight: dict[str, float]
    edge_time: dict[str, float]
    edge_step: dict[str, float]
    edge_memory: dict[str, float]
    edge_state: dict[str, float]
    beta: float
    fill_s: float
    """P2P hops of the fill and drain, exposed once per step."""
    accum: int = 1
    per_step_s: float = 0.0

    def keys(self) -> list[tuple[str, BlockStrategy]]:
        return [(c, s) for c in self.classes for s in self.strategies[c]]

    def allowed(self, t: RankType, cls: str) -> bool:
        return t.name == "first" or cls not in self.prefix

    def rank_time(self, t: RankType, counts: dict[tuple[str, BlockStrategy], int]) -> float:
        return self.edge_time[t.name] + sum(n * self.costs[k].time_s for k, n in counts.items())

    def rank_memory(self, t: RankType, counts: dict[tuple[str, BlockStrategy], int]) -> float:
        used = [k for k, n in counts.items() if n > 0]
        working = max((self.costs[k].transient_bytes for k in used), default=0.0)
        fwd_bwd = self.edge_memory[t.name] + working + sum(
            n * (self.costs[k].resident_bytes + self.in_flight[t.name] * self.costs[k].act_bytes)
            for k, n in counts.items())
        step = self.edge_state[t.name] + sum(n * self.costs[k].step_bytes
                                             for k, n in counts.items())
        return max(fwd_bwd, step)

    def type_of_rank(self, rank: int) -> RankType:
        """The rank type pp rank ``rank`` belongs to."""
        by_name = {t.name: t for t in self.types}
        if rank == 0:
            return by_name["first"]
        if "last" in by_name and rank == self.mesh.pp - 1:
            return by_name["last"]
        return by_name["middle"]

    def evaluate(self, per_rank: list[dict[tuple[str, BlockStrategy], int]]
                 ) -> tuple[float, list[float], list[float]]:
        """(step time, per-rank time per micro-batch, per-rank peak memory) of a split given
        as each pp rank's blocks per (class, strategy)."""
        types = [self.type_of_rank(r) for r in range(self.mesh.pp)]
        times = [self.rank_time(t, c) for t, c in zip(types, per_rank, strict=True)]
        memory = [self.rank_memory(t, c) for t, c in zip(types, per_rank, strict=True)]
        fsdp = max(self.edge_step[t.name] + sum(n * self.costs[k].step_s for k, n in c.items())
                   for t, c in zip(types, per_rank, strict=True))
        step = self.accum * ((self.microbatches + self.beta) * max(times) + fsdp
                             + self.fill_s) + self.per_step_s
        return step, times, memory

    def step_time(self, counts: dict[str, dict[tuple[str, BlockStrategy], int]]) -> float:
        """Step time of a MILP solution (per rank type counts)."""
        return self.evaluate([counts[self.type_of_rank(r).name]
                              for r in range(self.mesh.pp)])[0]

    def time_lower_bound(self) -> float:
        pp = self.mesh.pp
        work = sum(self.edge_time.values()) + sum(
            n * min(self.costs[(c, s)].time_s for s in self.strategies[c])
            for c, n in self.classes.items())
        return (self.microbatches + self.beta) * work / pp + self.fill_s + self.per_step_s

    def aggregate_bound(self, budget: float) -> float:
        """A lower bound on the step time with memory (inf: no split fits): the MILP with all
        pp ranks pooled, every block holding the fewest activations in flight of any rank
        and the ranks' memory summed against pp x budget. A fractional multiple-choice knapsack,
        solved greedily along each class's lower hull of (memory, time) points."""
        pp = self.mesh.pp
        flight = min(self.in_flight.values())
        room = pp * budget - sum(self.edge_memory[t.name] * t.ranks for t in self.types)
        time_s = sum(self.edge_time.values())
        upgrades: list[tuple[float, float, float]] = []  # (time per byte saved, bytes, time)
        for c, n in self.classes.items():
            points = sorted({(self.costs[(c, s)].resident_bytes
                              + flight * self.costs[(c, s)].act_bytes, self.costs[(c, s)].time_s)
                             for s in self.strategies[c]})
            hull: list[tuple[float, float]] = []
            for mem, t in points:  # lower-left convex hull, time falling as memory grows
                if hull and t >= hull[-1][1]:
                    continue
                while len(hull) >= 2 and (
                        (hull[-1][1] - hull[-2][1]) * (mem - hull[-1][0])
                        >= (t - hull[-1][1]) * (hull[-1][0] - hull[-2][0])):
                    hull.pop()
                hull.append((mem, t))
            room -= n * hull[0][0]
            time_s += n * hull[0][1]
            for (m0, t0), (m1, t1) in itertools.pairwise(hull):
                upgrades.append(((t1 - t0) / (m1 - m0), n * (m1 - m0), n * (t1 - t0)))
        if room < 0:
            return math.inf
        for _, extra, gain in sorted(upgrades):
            share = min(1.0, room / extra) if extra > 0 else 1.0
            time_s += share * gain
            room -= share * extra
            if room <= 0:
                break
        return (self.microbatches + self.beta) * time_s / pp + self.fill_s + self.per_step_s

    def memory_lower_bound(self) -> float:
        """No split puts less than the average resident memory on its fullest rank."""
        blocks = sum(n * min(self.costs[(c, s)].resident_bytes for s in self.strategies[c])
                     for c, n in self.classes.items())
        edges = sum(self.edge_memory[t.name] * t.ranks for t in self.types)
        return (blocks + edges) / self.mesh.pp


def build_pipeline_candidate(graph: LayerGraph, mesh: Mesh, schedule: str, v: int,
                             microbatch: int, microbatches: int, hw: HardwareProfile,
                             prec: Precision, gpus_per_node: int, constraints: Constraints,
                             pins: dict[str, Pin], features: Features = EAGER,
                             cache: dict | None = None, keep_strategies: bool = False
                             ) -> PipelineCandidate | None:
    """Costs of one pipeline candidate (None when its block classes interleave or a class has
    no strategy the schedule can run).
    ``keep_strategies``: cost every strategy a plan file or recipe may give a block, not only
    those the search offers."""
    cache = {} if cache is None else cache
    if "order" not in cache:  # the same for every candidate of a search
        cache["order"] = prefix_classes(graph, pins)
        cache["classes"] = block_classes(graph, pins)
        cache["last_block"] = graph.blocks[-1]
    order = cache["order"]
    if order is None:
        return None
    _, prefix = order
    hide_ep = schedule == "DualPipeV" and constraints.pp_ep_overlap
    key = (mesh, microbatch, hide_ep, keep_strategies)
    if key not in cache:
        cache[key] = _block_costs(graph, cache["classes"], mesh, microbatch, hw, prec,
                                  gpus_per_node, constraints, pins, features, hide_ep,
                                  keep_strategies)
    classes, strategies, costs, edges = cache[key]
    if not all(strategies.values()):
        return None  # a pinned block's recipe the schedule cannot run (DualPipeV's EP with AC)
    types = rank_types(mesh.pp, schedule)
    flight = {t.name: in_flight(schedule, mesh.pp, v, microbatches, t.rank) for t in types}
    edge_time, edge_step, edge_memory, edge_state = {}, {}, {}, {}
    hop = cache.setdefault(("hop", mesh, microbatch),
                           p2p_s(graph, mesh, microbatch, prec, hw, gpus_per_node))
    boundary = boundary_bytes(graph, mesh, microbatch, prec)
    logits_held = microbatches if schedule == "GPipe" else 1  # the last stage's, in flight
    for t in types:
        kinds = [k for k, on in (("embedding", t.embedding), ("output", t.output)) if on]
        # sends: the stage outputs forward, the input gradients back, per stage and micro-batch
        sends = 2 * v - (1 if t.embedding else 0) - (1 if t.output else 0)
        edge_time[t.name] = (sum(edges[k].time_s for k in kinds)
                             + sends * hop * (1 - hw.comm_overlap))
        edge_step[t.name] = 0.0
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
        cache[split_key] = backward_split(cache["last_block"], frugal, hw)
    split = cache[split_key]
    beta = bubble(schedule, mesh.pp, v, split)
    fill = 2 * (mesh.pp - 1) * hop
    return PipelineCandidate(mesh, schedule, v, microbatch, microbatches, classes, prefix,
                             strategies, costs, types, flight, edge_time, edge_step,
                             edge_memory, edge_state, beta, fill)


def _block_costs(graph: LayerGraph, block_class: list[str], mesh: Mesh, microbatch: int,
                 hw: HardwareProfile,
                 prec: Precision, gpus_per_node: int, constraints: Constraints,
                 pins: dict[str, Pin], features: Features, hide_ep: bool,
                 keep_strategies: bool = False) -> tuple:
    classes: dict[str, int] = {}
    representative = {}
    strategies: dict[str, list[BlockStrategy]] = {}
    moe_model = graph.num_experts > 0
    for layer, cls in zip(graph.blocks, block_class, strict=True):
        classes[cls] = classes.get(cls, 0) + 1
        if cls not in representative:
            representative[cls] = layer
            # under PP, TorchTitan keeps parameters unsharded across micro-batches; tp as
            # data parallel is not offered (its batch split is per micro-batch)
            options = pinned_strategies(mesh, microbatch, constraints, moe_model,
                                        pins.get(layer.fqn))
            strategies[cls] = sorted({BlockStrategy(s.ac, False, s.tp_mode) for s in options
                                      if s.tp_mode != "dp"})
            if hide_ep and mesh.ep > 1:  # TorchTitan: no AC with EP under DualPipeV
                strategies[cls] = [s for s in strategies[cls] if s.ac == "none"]
            if keep_strategies:
                mode = "sp" if mesh.tp > 1 else "none"
                strategies[cls] = [BlockStrategy(ac, reshard, mode) for ac in AC_MODES
                                   for reshard in (False, True)]
    costs = {(c, s): stage_block_cost(representative[c], mesh, s, microbatch, hw, prec,
                                      gpus_per_node, graph.grouped_experts, features, hide_ep)
             for c in classes for s in strategies[c]}
    edges = {}
    for layer in graph.layers:
        if layer.kind == "block":
            continue
        cost = edge_cost(graph, layer, mesh, microbatch, hw, prec, gpus_per_node, features)
        per_param = cost.state_bytes / STATE_BYTES_PER_PARAM
        sharded = fsdp_sharded(mesh)
        edges[layer.kind] = EdgeCost(
            cost.time_s,
            per_param * (FWD_BWD_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM)
            + (cost.gathered_bytes if sharded else 0.0),
            cost.kept_bytes, per_param * STEP_BYTES_PER_PARAM[features.optimizer])
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


@dataclass
class PipelineSolution:
    candidate: PipelineCandidate
    counts: dict[str, dict[tuple[str, BlockStrategy], int]]
    step_time_s: float
    peak_bytes: float
    status: str
    gap: float
    variables: int
    constraints: int


def solve_pipeline(cand: PipelineCandidate, budget: float, time_limit_s: float,
                   cutoff_s: float = math.inf) -> PipelineSolution | None:
    """Solve one candidate's MILP; None when no split fits (or none beats ``cutoff_s``, the
    best step time found so far). SolveTimeout as ``solve_candidate``. Memory rows are in GiB
    (time in seconds) so that HiGHS sees numbers of similar size."""
    numbers = [budget, cand.beta, cand.fill_s, *cand.edge_time.values(),
               *cand.edge_memory.values(), *cand.edge_state.values()]
    numbers += [x for c in cand.costs.values() for x in (c.time_s, c.act_bytes,
                                                         c.resident_bytes, c.transient_bytes)]
    if not all(math.isfinite(x) for x in numbers):
        raise UserError(f"the cost model gave a non-finite pipeline cost on mesh {cand.mesh}: "
                        "check the hardware profile for NaN, inf or zero")
    h = _new_highs()
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("time_limit", float(time_limit_s))
    cutoff = cutoff_s - cand.fill_s - cand.per_step_s
    inf = highspy.kHighsInf
    integer = highspy.HighsVarType.kInteger
    gib = 2.0**30
    keys = cand.keys()
    n_idx: dict[tuple[str, tuple[str, BlockStrategy]], int] = {}
    y_idx: dict[tuple[str, tuple[str, BlockStrategy]], int] = {}

    integers: list[int] = []

    def col(cost: float, lo: float, hi: float, is_int: bool) -> int:
        h.addCol(cost, lo, hi, 0, [], [])
        j = h.getNumCol() - 1
        if is_int:
            integers.append(j)
        return j

    T = col(cand.microbatches + cand.beta, 0.0, inf, False)
    F = col(1.0, 0.0, inf, False)
    for t in cand.types:
        for k in keys:
            hi = float(cand.classes[k[0]]) if cand.allowed(t, k[0]) else 0.0
            n_idx[(t.name, k)] = col(0.0, 0.0, hi, True)
            y_idx[(t.name, k)] = col(0.0, 0.0, 1.0 if hi else 0.0, True)
    w_idx = {t.name: col(0.0, 0.0, inf, False) for t in cand.types}
    for c, count in cand.classes.items():
        idx = [n_idx[(t.name, (c, s))] for t in cand.types for s in cand.strategies[c]]
        vals = [float(t.ranks) for t in cand.types for s in cand.strategies[c]]
        h.addRow(float(count), float(count), len(idx), idx, vals)
    for t in cand.types:
        ns = [n_idx[(t.name, k)] for k in keys]
        h.addRow(float(cand.stages_per_rank), inf, len(ns), ns, [1.0] * len(ns))
        h.addRow(-inf, -cand.edge_time[t.name], len(ns) + 1, ns + [T],
                 [cand.costs[k].time_s for k in keys] + [-1.0])
        h.addRow(-inf, -cand.edge_step[t.name], len(ns) + 1, ns + [F],
                 [cand.costs[k].step_s for k in keys] + [-1.0])
        flight = cand.in_flight[t.name]
        h.addRow(-inf, (budget - cand.edge_memory[t.name]) / gib, len(ns) + 1,
                 ns + [w_idx[t.name]],
                 [(cand.costs[k].resident_bytes + flight * cand.costs[k].act_bytes) / gib
                  for k in keys] + [1.0])
        h.addRow(-inf, (budget - cand.edge_state[t.name]) / gib, len(ns), ns,
                 [cand.costs[k].step_bytes / gib for k in keys])
        for k in keys:
            n, y = n_idx[(t.name, k)], y_idx[(t.name, k)]
            h.addRow(-inf, 0.0, 2, [n, y], [1.0, -float(cand.classes[k[0]])])
            h.addRow(0.0, inf, 2, [w_idx[t.name], y],
                     [1.0, -cand.costs[k].transient_bytes / gib])
    if math.isfinite(cutoff):
        # the LP relaxation bounds the MILP: no need to branch when it cannot win
        h.run()
        if (h.getModelStatus() != highspy.HighsModelStatus.kOptimal
                or h.getInfo().objective_function_value >= cutoff):
            return None
        h.setOptionValue("objective_bound", cutoff)
    for j in integers:
        h.changeColIntegrality(j, integer)
    h.run()
    model_status = h.getModelStatus()
    if model_status not in (highspy.HighsModelStatus.kOptimal,
                            highspy.HighsModelStatus.kTimeLimit):
        return None
    if h.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        if model_status == highspy.HighsModelStatus.kTimeLimit:
            raise SolveTimeout
        return None
    values = h.getSolution().col_value
    counts = {t.name: {k: int(round(values[n_idx[(t.name, k)]])) for k in keys}
              for t in cand.types}
    peak = max(cand.rank_memory(t, counts[t.name]) for t in cand.types)
    return PipelineSolution(cand, counts, cand.step_time(counts), peak,
                            h.modelStatusToString(model_status), float(h.getInfo().mip_gap),
                            h.getNumCol(), h.getNumRow())


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
    """Why ``search_pipeline`` has no candidate for the fixed pp degree on ``meshes``: no
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


@dataclass
class PipelineSearch:
    best: PipelineSolution | None
    min_feasible_bytes: float
    stats: dict = field(default_factory=dict)
    timed_out: bool = False


def search_pipeline(graph: LayerGraph, global_batch: int, hw: HardwareProfile, prec: Precision,
                    gpus_per_node: int, budget: float, constraints: Constraints,
                    meshes: list[Mesh], time_limit_s: float, pins: dict[str, Pin],
                    features: Features = EAGER, beat_s: float = math.inf) -> PipelineSearch:
    """Best pipeline plan over ``meshes`` (all with pp > 1) that beats ``beat_s`` (the best
    plan without pp). Candidates are visited by a compute-only lower bound (cheap: no
    communication or memory costed), costed in full only when that bound can still win, then
    bounded again with their full costs, pruned by memory and solved."""
    start = time.perf_counter()
    schedules = schedules_for(graph, constraints, features)
    n_blocks = len(graph.blocks)
    cache: dict = {}
    compute: dict[tuple[int, int, int], tuple[float, Split]] = {}
    options = []
    splits = 0
    min_feasible = math.inf
    for mesh in meshes:
        if global_batch % mesh.dp:
            continue
        floor = _memory_floor(graph, mesh, prec)
        local = global_batch // mesh.dp
        for schedule in schedules:
            for v in stage_options(schedule, mesh.pp, n_blocks):
                if constraints.pp_stages_per_rank and v != constraints.pp_stages_per_rank:
                    continue
                for mb in divisors(local):
                    if constraints.pp_microbatch and mb != constraints.pp_microbatch:
                        continue
                    m = local // mb
                    if not microbatch_ok(schedule, mesh.pp, v, m):
                        continue
                    splits += 1
                    if floor > budget:  # no split of this mesh fits: not costed
                        min_feasible = min(min_feasible, floor)
                        continue
                    key = (mesh.tp, mesh.cp, mb)
                    if key not in compute:
                        compute[key] = _compute_floor(graph, mesh, mb, hw, prec, features)
                    work, split = compute[key]
                    bound = (m + bubble(schedule, mesh.pp, v, split)) * work / mesh.pp
                    options.append((bound, mesh, schedule, v, mb, m))
    options.sort(key=lambda o: o[:5])
    best: PipelineSolution | None = None
    solved = pruned = variables = rows = 0
    status, gap, timed_out = "no candidate", 0.0, False
    for quick, mesh, schedule, v, mb, m in options:
        cutoff = min(beat_s, best.step_time_s if best else math.inf)
        if quick >= cutoff:
            break
        cand = build_pipeline_candidate(graph, mesh, schedule, v, mb, m, hw, prec,
                                        gpus_per_node, constraints, pins, features, cache)
        if cand is None:
            continue  # block kinds interleave, or a pinned recipe the schedule cannot run
        if cand.time_lower_bound() >= cutoff:
            continue
        if cand.memory_lower_bound() > budget:
            pruned += 1
            min_feasible = min(min_feasible, cand.memory_lower_bound())
            continue
        bound = cand.aggregate_bound(budget)
        if bound >= cutoff:
            pruned += math.isinf(bound)
            continue
        remaining = time_limit_s - (time.perf_counter() - start)
        try:
            sol = solve_pipeline(cand, budget, max(0.0, remaining), cutoff)
        except SolveTimeout:
            status, timed_out = "Time limit reached", True
            break
        solved += 1
        if sol is None or sol.step_time_s >= cutoff:
            continue
        variables += sol.variables
        rows += sol.constraints
        best, status, gap = sol, sol.status, sol.gap
    stats = {"status": status if best else "infeasible", "gap": gap,
             "candidates": splits, "meshes": len(meshes), "milps_solved": solved,
             "pruned_by_memory": pruned, "variables": variables, "constraints": rows,
             "solve_time_s": time.perf_counter() - start}
    return PipelineSearch(best, min_feasible, stats, timed_out)


def _memory_floor(graph: LayerGraph, mesh: Mesh, prec: Precision) -> float:
    """A floor under the fullest pp rank's memory on ``mesh`` (the average rank's): sharded
    parameters, gradients and AdamW state, and under FSDP the stage's parameters gathered (1
    byte each at least) and their unreduced gradients."""
    shards = mesh.dp_shard * mesh.cp * mesh.tp
    total = 0.0
    for layer in graph.layers:
        experts = layer.expert_params if mesh.ep > 1 else 0
        total += state_bytes(layer) / shards
        if fsdp_sharded(mesh, experts=bool(layer.expert_params)):
            split = (layer.params - experts) / mesh.tp + experts / (mesh.ep * mesh.etp)
            total += split * (1 + prec.reduce_bytes)
    return total / mesh.pp


def _compute_floor(graph: LayerGraph, mesh: Mesh, microbatch: int, hw: HardwareProfile,
                   prec: Precision, features: Features) -> tuple[float, Split]:
    """A floor under the forward + backward time of one micro-batch through the whole model on
    ``mesh``: compute only, no checkpointing, no communication (every strategy's time is at
    least this); and the F / B / W split of a block without checkpointing."""
    none = BlockStrategy("none", False, "sp" if mesh.tp > 1 else "none")
    work = sum(compute_s(layer, mesh, none, microbatch, hw, prec, features)[1]
               for layer in graph.layers)
    return work, backward_split(graph.blocks[-1], none, hw)
