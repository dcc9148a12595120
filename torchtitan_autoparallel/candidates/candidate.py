"""A search candidate: one (mesh, schedule, stages per rank, micro-batch) with the cost of every
block strategy, in the one form the MILP reads.

Its pp ranks fall into a few *rank types* whose ranks are interchangeable: the first
(embedding; with V schedules also norm + output), the middle ones (blocks only) and the last
(norm + output). A flat plan (pp = 1) is one rank type holding everything. Per rank type ``t``
a split gives each block class ``c`` and strategy ``s`` a count ``n[t,c,s]``; identical blocks
are interchangeable, so nothing here grows with depth or pp.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..cost.model import (
    STATE_BYTES_PER_PARAM,
    STEP_BYTES_PER_PARAM,
    BlockCost,
    CostContext,
    FsdpFloor,
    block_cost,
    block_time_floor,
    edge_cost,
    edges_cost,
    model_time_floor,
    state_memory,
)
from ..cost.pipeline import StageBlockCost
from ..graph.layer_graph import LayerGraph
from ..job.pins import Pin
from .layout import BlockStrategy, Mesh
from .schedules import V_SCHEDULES
from .strategies import (
    Constraints,
    block_tp_modes,
    embedding_modes,
    fastest_strategies,
    microbatch_sizes,
    pinned_strategies,
)

Key = tuple[str, BlockStrategy]
"""(block class, strategy)."""
Counts = dict[Key, int]
Option = tuple[float, Mesh, str, int, int, "Callable[[], Candidate | None]"]
"""(lower bound on the step time, mesh, schedule, stages per rank, micro-batch size, the
candidate's costs on demand): what the search visits, in that order."""


def block_classes(graph: LayerGraph, pins: dict[str, Pin]) -> list[str]:
    """Each block's MILP class, in block order: its signature plus what its pin fixes."""
    return [layer.signature + (pins[layer.fqn].key if layer.fqn in pins else "")
            for layer in graph.blocks]


def class_runs(classes: list[str]) -> dict[str, int]:
    """Each block class's number of blocks where they are all consecutive (one run, what FSDP
    units may group), else 1."""
    where: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(classes):
        where[c].append(i)
    return {c: len(ix) if ix[-1] - ix[0] + 1 == len(ix) else 1 for c, ix in where.items()}


@dataclass(frozen=True)
class RankType:
    """pp ranks that hold the same kind of stages (``rank``: the one with the most
    activations in flight, which sets the type's memory)."""

    name: str
    ranks: int
    rank: int
    embedding: bool
    output: bool


FLAT = (RankType("first", 1, 0, True, True),)
"""The rank types of a flat plan: one rank holds every layer."""


@functools.lru_cache(maxsize=256)
def rank_types(pp: int, schedule: str) -> tuple[RankType, ...]:
    """The rank types of a pipeline of ``pp`` ranks under ``schedule`` (cached)."""
    if schedule in V_SCHEDULES:
        return (RankType("first", 1, 0, True, True),
                RankType("middle", pp - 1, 1, False, False))
    types = [RankType("first", 1, 0, True, False)]
    if pp > 2:
        types.append(RankType("middle", pp - 2, 1, False, False))
    types.append(RankType("last", 1, pp - 1, False, True))
    return tuple(types)


@dataclass(frozen=True)
class Candidate:
    """One (mesh, schedule, stages per rank, micro-batch size) with its costs. Block costs
    (``cost.model.BlockCost`` flat, ``cost.pipeline.StageBlockCost`` on a stage) give per
    micro-batch ``time_s``, per step ``step_s``, ``resident_bytes`` held all step,
    ``kept_bytes`` per micro-batch in flight, ``transient_bytes`` and the optimizer step's
    ``step_bytes``; ``edge_*`` are a rank type's terms that do not depend on its blocks."""

    mesh: Mesh
    microbatch: int
    accum: int
    classes: dict[str, int]
    """block class (signature + pin) -> number of blocks."""
    strategies: dict[str, list[BlockStrategy]]
    """block class -> the strategies its blocks may take."""
    costs: dict[Key, BlockCost | StageBlockCost]
    types: tuple[RankType, ...]
    in_flight: dict[str, float]
    edge_time: dict[str, float]
    """Per micro-batch (flat: the embedding, output and per-step terms)."""
    edge_step: dict[str, float]
    edge_memory: dict[str, float]
    """Forward/backward memory that does not depend on the blocks' strategies."""
    edge_state: dict[str, float]
    """Optimizer-step memory besides the blocks' ``step_bytes``."""
    schedule: str = ""
    stages_per_rank: int = 1
    microbatches: int = 1
    prefix: tuple[str, ...] = ()
    """Block classes that must sit on the first stage (before the main class)."""
    beta: float = 0.0
    """The schedule's bubble, in slowest-rank micro-batches."""
    fill_s: float = 0.0
    """P2P hops of the fill and drain, exposed once per step."""
    per_step_s: float = 0.0
    """Time paid once per step whatever the blocks do (the host optimizer with CPU offload)."""
    state_bytes: float | None = None
    """Parameters, gradients and optimizer state per device when the blocks' strategies do not
    change them (flat); None: from each rank's optimizer-step bytes."""
    embedding: str = ""
    """The embedding's mode where not the mesh's default (``strategies.embedding_modes``)."""

    def keys(self) -> list[Key]:
        return [(c, s) for c in self.classes for s in self.strategies[c]]

    def allowed(self, t: RankType, cls: str) -> bool:
        return t.embedding or cls not in self.prefix

    def rank_time(self, t: RankType, counts: Counts) -> float:
        """Time of one micro-batch on a rank of type ``t`` holding ``counts``."""
        return self.edge_time[t.name] + sum(n * self.costs[k].time_s for k, n in counts.items())

    def rank_memory(self, t: RankType, counts: Counts) -> float:
        """Peak memory of a rank of type ``t`` holding ``counts``."""
        costs, flight = self.costs, self.in_flight[t.name]
        working = max((costs[k].transient_bytes for k, n in counts.items() if n > 0),
                      default=0.0)
        held = step = 0
        for k, n in counts.items():
            cost = costs[k]
            held += n * (cost.resident_bytes + flight * cost.kept_bytes)
            step += n * cost.step_bytes
        return max(self.edge_memory[t.name] + working + held, self.edge_state[t.name] + step)

    def rank_state(self, t: RankType, counts: Counts, optimizer: str) -> float:
        """Parameters, gradients and optimizer state of a rank of type ``t`` (its optimizer
        step's bytes less the step's temporary)."""
        if self.state_bytes is not None:
            return self.state_bytes
        return (self.edge_state[t.name] + sum(n * self.costs[k].step_bytes
                                              for k, n in counts.items())
                ) * STATE_BYTES_PER_PARAM / STEP_BYTES_PER_PARAM[optimizer]

    def type_of_rank(self, rank: int) -> RankType:
        """The rank type pp rank ``rank`` belongs to."""
        by_name = {t.name: t for t in self.types}
        if rank == 0:
            return by_name["first"]
        if "last" in by_name and rank == self.mesh.pp - 1:
            return by_name["last"]
        return by_name["middle"]

    def evaluate(self, per_rank: list[Counts]) -> tuple[float, list[float], list[float]]:
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

    def per_rank(self, counts: dict[str, Counts]) -> list[Counts]:
        """Each pp rank's counts from counts per rank type."""
        return [counts[self.type_of_rank(r).name] for r in range(self.mesh.pp)]

    def time_lower_bound(self) -> float:
        """Every block at its fastest strategy, the work spread evenly over the pp ranks."""
        work = sum(self.edge_time.values()) + sum(
            n * min(self.costs[(c, s)].time_s for s in self.strategies[c])
            for c, n in self.classes.items())
        return self.accum * ((self.microbatches + self.beta) * work / self.mesh.pp
                             + self.fill_s) + self.per_step_s

    def state_floor(self) -> float:
        """The memory every split holds whatever its blocks' strategies (each rank type's
        parameters, gradients, optimizer state and edge activations; with several rank types,
        also the average rank's resident memory, which AC does not change), a floor under
        every split's peak: the same for the fastest-strategies candidate as for the full
        one."""
        edges = max(max(self.edge_memory[t.name], self.edge_state[t.name]) for t in self.types)
        return max(edges, self.memory_lower_bound()) if len(self.types) > 1 else edges

    def memory_lower_bound(self) -> float:
        """No split fits below this. One rank type: exact, the smallest peak reached by giving
        every block of each class one strategy, tried for each strategy (a class that cannot
        take it keeps its most frugal one). Several: the average resident memory."""
        return self._memory_floor

    @functools.cached_property
    def _memory_floor(self) -> float:
        if len(self.types) > 1:
            blocks = sum(n * min(self.costs[(c, s)].resident_bytes for s in self.strategies[c])
                         for c, n in self.classes.items())
            edges = sum(self.edge_memory[t.name] * t.ranks for t in self.types)
            return (blocks + edges) / self.mesh.pp
        t = self.types[0]
        flight = self.in_flight[t.name]
        held = {k: cost.resident_bytes + flight * cost.kept_bytes
                for k, cost in self.costs.items()}
        frugal = {c: min(ss, key=lambda s, c=c: held[(c, s)])
                  for c, ss in self.strategies.items()}
        best = math.inf
        for s in {s for ss in self.strategies.values() for s in ss}:
            counts = {(c, s if s in self.strategies[c] else frugal[c]): n
                      for c, n in self.classes.items()}
            best = min(best, self.rank_memory(t, counts))
        return best

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
                              + flight * self.costs[(c, s)].kept_bytes, self.costs[(c, s)].time_s)
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
        return self.accum * ((self.microbatches + self.beta) * time_s / pp
                             + self.fill_s) + self.per_step_s

    def numbers(self, budget: float) -> dict[str, float]:
        """Every number the MILP reads, by name (for the finiteness check)."""
        out = {"memory budget": budget, "bubble": self.beta, "fill and drain": self.fill_s,
               "per-step time": self.per_step_s}
        for t in self.types:
            for name in ("edge_time", "edge_step", "edge_memory", "edge_state"):
                out[f"{t.name} rank {name}"] = getattr(self, name)[t.name]
        for (_, strategy), cost in self.costs.items():
            for name in ("time_s", "step_s", "kept_bytes", "resident_bytes", "step_bytes",
                         "transient_bytes"):
                out[f"{strategy.describe()} {name}"] = getattr(cost, name)
        return out


def faster_units(cls: str, strategies: list[BlockStrategy], costs: dict[Key, BlockCost]
                 ) -> list[BlockStrategy]:
    """``strategies`` less the FSDP units no faster than the next smaller unit of the same
    strategy: they hold more memory for nothing (the smaller unit, which also divides every
    count of the larger one, is always as good), so the MILP need not see them."""
    out: list[BlockStrategy] = []
    kept: dict[tuple, list[BlockStrategy]] = {}  # by the strategy without its unit
    for s in strategies:
        same = kept.setdefault((s.ac, s.reshard_after_forward, s.tp_mode), [])
        smaller = [t for t in same if t.fsdp_unit < s.fsdp_unit]
        if not smaller or costs[(cls, s)].time_s < costs[(cls, smaller[-1])].time_s:
            out.append(s)
            same.append(s)
    return out


def build_candidate(graph: LayerGraph, mesh: Mesh, microbatch: int, global_batch: int,
                    ctx: CostContext, constraints: Constraints,
                    pins: dict[str, Pin] | None = None, fastest: bool = False,
                    order: list[str] | None = None, embedding: str = "") -> Candidate:
    """Costs of every block strategy for one flat (mesh, micro-batch): one rank type.
    ``fastest``: only the strategies that set the time bound (``fastest_strategies``), enough
    for ``Candidate.time_lower_bound``. ``order``: ``block_classes(graph, pins)`` when the
    caller has it. ``embedding``: the embedding's mode (``Candidate.embedding``)."""
    pins = pins or {}
    classes: dict[str, int] = defaultdict(int)
    representative = {}
    strategies: dict[str, list[BlockStrategy]] = {}
    moe_model = graph.num_experts > 0
    order = order or block_classes(graph, pins)
    runs = class_runs(order)
    for layer, cls in zip(graph.blocks, order, strict=True):
        classes[cls] += 1
        if cls not in representative:
            representative[cls] = layer
            strategies[cls] = pinned_strategies(mesh, microbatch, constraints, moe_model,
                                                pins.get(layer.fqn), ctx.gpus_per_node,
                                                runs[cls], layer.num_experts > 0)
            if fastest:
                strategies[cls] = fastest_strategies(strategies[cls])
    costs = {
        (c, s): block_cost(representative[c], mesh, s, microbatch, ctx, graph.grouped_experts)
        for c in classes for s in strategies[c]
    }
    for c in classes:
        strategies[c] = faster_units(c, strategies[c], costs)
    edges = edges_cost(graph, mesh, microbatch, ctx, embedding)
    # parameters, gradients and optimizer state do not depend on the block's strategy
    state = edges.state_bytes + sum(
        costs[(c, strategies[c][0])].state_bytes * n for c, n in classes.items())
    accum = global_batch // (microbatch * mesh.dp)
    resident, step_bytes, per_step = state_memory(state, accum, ctx)
    name = FLAT[0].name
    return Candidate(mesh, microbatch, accum, dict(classes), strategies, costs, FLAT,
                     {name: 1}, {name: edges.time_s}, {name: 0.0},
                     {name: resident + edges.kept_bytes}, {name: step_bytes},
                     per_step_s=per_step, state_bytes=state, embedding=embedding)


def flat_options(graph: LayerGraph, global_batch: int, ctx: CostContext,
                 constraints: Constraints, meshes: list[Mesh],
                 pins: dict[str, Pin] | None = None, cutoff: float = math.inf
                 ) -> tuple[list[Option], int, float]:
    """(options, how many, inf) for ``meshes`` (all with pp = 1), each bounded by its compute
    floor and costed on demand (the search takes the memory floor from those it costs); an
    option whose bound reaches ``cutoff`` (a step time already reached) is not listed."""
    options: list[Option] = []
    count = 0
    order = block_classes(graph, pins or {})
    for mesh in meshes:
        for mb in microbatch_sizes(global_batch, mesh, constraints.accumulation):
            count += 1
            modes = block_tp_modes(mesh, mb, constraints, graph.num_experts > 0,
                                   experts=graph.num_experts > 0)
            accum = global_batch // (mb * mesh.dp)
            fsdp: FsdpFloor = ""
            floor = model_time_floor(graph, mesh, mb, ctx, modes)
            if not accum * floor >= cutoff:  # then FSDP's share, for the fewer left
                fsdp = "microbatch"
                floor = model_time_floor(graph, mesh, mb, ctx, modes, fsdp=fsdp)
            for embedding in _undominated(graph, mesh, mb, ctx,
                                          embedding_modes(graph, mesh, constraints)):
                bound = accum * (floor + _embedding_shift(graph, mesh, mb, ctx, modes, fsdp,
                                                          embedding))
                if not bound >= cutoff:  # a NaN goes on to the finiteness check
                    options.append((bound, mesh, "", 1, mb, functools.partial(
                        build_candidate, graph, mesh, mb, global_batch, ctx, constraints, pins,
                        order=order, embedding=embedding)))
    return options, count, math.inf


def _undominated(graph: LayerGraph, mesh: Mesh, microbatch: int, ctx: CostContext,
                 modes: tuple[str, ...]) -> list[str]:
    """The embedding ``modes`` no other mode beats on both its time and the memory it keeps
    (its training state is the same in every mode): a candidate with a dominated embedding is
    never better, whatever its blocks run (the first of equal ones kept)."""
    if len(modes) == 1:
        return list(modes)
    layer = graph.embedding
    costs = {mode: edge_cost(graph, layer, mesh, microbatch, ctx, mode) for mode in modes}
    points = {mode: (cost.time_s, cost.kept_bytes) for mode, cost in costs.items()}
    return [mode for i, mode in enumerate(modes)
            if not any(other != mode and points[other][0] <= points[mode][0]
                       and points[other][1] <= points[mode][1]
                       and (points[other] != points[mode] or j < i)
                       for j, other in enumerate(modes))]


def _embedding_shift(graph: LayerGraph, mesh: Mesh, microbatch: int, ctx: CostContext,
                     tp_modes: tuple[str, ...], fsdp: FsdpFloor, embedding: str) -> float:
    """What the embedding's ``embedding`` mode changes in the model's time floor: its own time
    in place of the default mode's floor (0 for the default)."""
    if not embedding:
        return 0.0
    layer = graph.embedding
    return (edge_cost(graph, layer, mesh, microbatch, ctx, embedding).time_s
            - block_time_floor(layer, mesh, microbatch, ctx, tp_modes, fsdp=fsdp))
