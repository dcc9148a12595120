"""The MILP and the search around it: one builder for every candidate (a flat plan is one rank
type with pp = 1), solved by HiGHS to optimality (``mip_rel_gap = 0``); candidates visited in
order of their step-time bound, pruned by memory and by a relaxation before a MILP is built,
all under one time limit.

Per rank type ``t`` (``candidate.py``): integer ``n[t,c,s]`` blocks of class ``c`` with
strategy ``s`` (so the size does not grow with depth or pp), binary ``y[t,c,s]`` marking the
strategies in use and ``W[t]`` the working set of the worst used one (a max, not a sum). With
several rank types a makespan ``T`` bounds every type's time per micro-batch and ``F`` its
per-step FSDP collectives; with one, ``T`` and ``F`` are that rank's and are substituted (and
its one stage holds every block):

    minimize   accum * ((m + beta) * T + F)            (cost/pipeline.py: the schedule's bubble)
    subject to sum_t ranks[t] * sum_s n[t,c,s] = N[c]   (every block on one stage)
               sum_{c,s} n[t,c,s] >= v                  (every stage holds a block)
               edge_time[t] + sum n[t,c,s] * time[c,s] <= T
               edge_step[t] + sum n[t,c,s] * step[c,s] <= F
               n[t,c,s] <= N[c] y[t,c,s],  W[t] >= transient[c,s] * y[t,c,s]
               n[t,c,s] = k u[t,c,s], u integer (s: FSDP units of k blocks)
               edge_mem[t] + sum n[t,c,s] (resident[c,s] + in_flight[t] act[c,s]) + W[t] <= budget
               edge_state[t] + sum n[t,c,s] * step_bytes[c,s] <= budget (optimizer step)
               y[t,c,s] <= z (s: stream sharded on the batch), y[t,c,s] <= 1 - z (other tp s)

A row without variables (one rank type: the optimizer step) is checked before the solve.
"""

from __future__ import annotations

import heapq
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import highspy

from ..candidates.candidate import Candidate, Counts, Key, Option, flat_options
from ..candidates.layout import GIB, Mesh, embedding_stream_problem, stream_dim
from ..candidates.pipeline import pipeline_options
from ..candidates.strategies import Constraints
from ..cost.model import CostContext
from ..errors import UserError
from ..graph.layer_graph import LayerGraph
from ..job.pins import Pin

"""Memory rows in GiB: numbers of similar size for HiGHS."""


OBJECTIVE_PER_S = 1e3
"""The MILP's objective is in milliseconds: in seconds, strategies whose times differ by under
a microsecond look equal within HiGHS's tolerances, and it may return the slower one as
optimal (a brute force finds the difference)."""


class SolveTimeout(Exception):
    """HiGHS reached its time limit before finding any feasible point."""


@dataclass
class Solution:
    """A MILP optimum: the candidate, its blocks per rank type and what they cost."""

    candidate: Candidate
    counts: dict[str, Counts]
    """Blocks per (class, strategy) on each rank type."""
    step_time_s: float
    peak_bytes: float
    status: str
    gap: float
    variables: int
    constraints: int


@dataclass
class SearchResult:
    """The best plan of a search (None: nothing fits), what memory would fit, and counters."""

    best: Solution | None
    min_feasible_bytes: float
    """The smallest budget a flat candidate fits (achievable)."""
    min_pipeline_bytes: float = math.inf
    """A floor under the budget of every pipeline candidate skipped for memory."""
    stats: dict = field(default_factory=dict)
    timed_out: bool = False
    """``time_limit_s`` ran out before every candidate that could win was solved."""


def _new_highs() -> highspy.Highs:
    """A silent, single-threaded HiGHS instance. The first one prints a banner straight to file
    descriptor 1 (not through Python), which would corrupt ``--json`` output: hide fd 1
    meanwhile. One thread: the MILPs are a few dozen variables, and HiGHS's thread pool costs
    more than it saves on them (a third of the solve time of the 70B grid row on 2 cores, the
    same plans); ``search`` sizes HiGHS's process-wide scheduler to it."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
            h.setOptionValue("output_flag", False)
            h.setOptionValue("threads", 1)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h


def check_finite(cand: Candidate, budget: float) -> None:
    """Every number the MILP reads must be finite (a NaN or inf can stall HiGHS or turn the
    budget off); names the first offender."""
    for name, value in cand.numbers(budget).items():
        if not math.isfinite(value):
            raise UserError(
                f"the cost model gave a non-finite {name} ({value}) on mesh {cand.mesh}: check "
                "the hardware profile and autoparallel values for NaN, inf or zero")


def solve(cand: Candidate, budget: float, time_limit_s: float,
          cutoff_s: float = math.inf) -> Solution | None:
    """Build and solve one candidate's MILP: the optimum, or None when no split fits (or none
    beats ``cutoff_s``, the best step time found so far). Raises SolveTimeout when the time
    limit ends the solve without any feasible point (HiGHS then returns zeros)."""
    check_finite(cand, budget)
    h = _new_highs()
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("time_limit", float(time_limit_s))
    built = _build_milp(h, cand, budget)
    if built is None:
        return None
    n_idx, integers, offset = built
    model_status = _run_milp(h, integers, (cutoff_s - offset) * OBJECTIVE_PER_S)
    if model_status is None:
        return None
    keys = cand.keys()
    values = h.getSolution().col_value
    counts = {t.name: {k: int(round(values[n_idx[(t.name, k)]])) for k in keys}
              for t in cand.types}
    step = cand.evaluate(cand.per_rank(counts))[0]
    if step >= cutoff_s:
        return None
    peak = max(cand.rank_memory(t, counts[t.name]) for t in cand.types)
    return Solution(cand, counts, step, peak, h.modelStatusToString(model_status),
                    float(h.getInfo().mip_gap), h.getNumCol(), h.getNumRow())


def _build_milp(h: highspy.Highs, cand: Candidate, budget: float
                ) -> tuple[dict[tuple[str, Key], int], list[int], float] | None:
    """Add ``cand``'s MILP to ``h``: per rank type and (class, strategy) the count of blocks
    that run it, their memory and time rows. The count columns, the columns to make integral,
    and the step time the objective leaves out; None when the training state alone cannot
    fit."""
    inf = highspy.kHighsInf
    keys = cand.keys()
    single = len(cand.types) == 1
    scale = cand.accum * (cand.microbatches + cand.beta)
    integers: list[int] = []

    def col(cost: float, lo: float, hi: float, is_int: bool) -> int:
        h.addCol(cost * OBJECTIVE_PER_S, lo, hi, 0, [], [])
        j = h.getNumCol() - 1
        if is_int:
            integers.append(j)
        return j

    # the step time less the objective: with one rank type, its edge terms too
    offset = cand.accum * cand.fill_s + cand.per_step_s
    if not single:
        T = col(scale, 0.0, inf, False)
        F = col(float(cand.accum), 0.0, inf, False)
    else:
        t = cand.types[0].name
        offset += scale * cand.edge_time[t] + cand.accum * cand.edge_step[t]
    n_idx: dict[tuple[str, Key], int] = {}
    y_idx: dict[tuple[str, Key], int] = {}
    for t in cand.types:
        for k in keys:
            hi = float(cand.classes[k[0]]) if cand.allowed(t, k[0]) else 0.0
            cost = (scale * cand.costs[k].time_s + cand.accum * cand.costs[k].step_s
                    if single else 0.0)
            n_idx[(t.name, k)] = col(cost, 0.0, hi, True)
        for k in keys:
            y_idx[(t.name, k)] = col(0.0, 0.0, 1.0 if cand.allowed(t, k[0]) else 0.0, True)
    w_idx = {t.name: col(0.0, 0.0, inf, False) for t in cand.types}
    _one_stream(h, cand, y_idx, col)
    for c, count in cand.classes.items():
        idx = [n_idx[(t.name, (c, s))] for t in cand.types for s in cand.strategies[c]]
        vals = [float(t.ranks) for t in cand.types for s in cand.strategies[c]]
        h.addRow(float(count), float(count), len(idx), idx, vals)
    for t in cand.types:
        ns = [n_idx[(t.name, k)] for k in keys]
        if not single:
            h.addRow(float(cand.stages_per_rank), inf, len(ns), ns, [1.0] * len(ns))
            h.addRow(-inf, -cand.edge_time[t.name], len(ns) + 1, ns + [T],
                     [cand.costs[k].time_s for k in keys] + [-1.0])
            h.addRow(-inf, -cand.edge_step[t.name], len(ns) + 1, ns + [F],
                     [cand.costs[k].step_s for k in keys] + [-1.0])
        for k in keys:
            n, y = n_idx[(t.name, k)], y_idx[(t.name, k)]
            h.addRow(-inf, 0.0, 2, [n, y], [1.0, -float(cand.classes[k[0]])])
            h.addRow(0.0, inf, 2, [w_idx[t.name], y], [1.0, -cand.costs[k].transient_bytes / GIB])
            if k[1].fsdp_unit > 1:  # whole units: n = fsdp_unit x (units)
                units = col(0.0, 0.0, inf, True)
                h.addRow(0.0, 0.0, 2, [n, units], [1.0, -float(k[1].fsdp_unit)])
        flight = cand.in_flight[t.name]
        h.addRow(-inf, (budget - cand.edge_memory[t.name]) / GIB, len(ns) + 1,
                 ns + [w_idx[t.name]],
                 [(cand.costs[k].resident_bytes + flight * cand.costs[k].kept_bytes) / GIB
                  for k in keys] + [1.0])
        step = [cand.costs[k].step_bytes / GIB for k in keys]
        if any(step):
            h.addRow(-inf, (budget - cand.edge_state[t.name]) / GIB, len(ns), ns, step)
        elif cand.edge_state[t.name] > budget:
            return None
    return n_idx, integers, offset


def _one_stream(h: highspy.Highs, cand: Candidate, y_idx: dict[tuple[str, Key], int],
                col: Callable[[float, float, float, bool], int]) -> None:
    """Every tp block of the plan keeps one residual-stream layout (``layout.stream_problem``,
    the plan check's rule): where the strategies offer several, a binary ``z[d]`` per layout
    ``d`` (``layout.stream_dim``), sum z = 1, and y[t,c,s] <= z[d] for the strategies in
    layout d; a layout the candidate's embedding cannot feed (``embedding_stream_problem``)
    is ruled out."""
    by_dim: dict[int | None, list[int]] = {}
    for (_, k), y in y_idx.items():
        if k[1].tp_mode != "none":
            by_dim.setdefault(stream_dim(k[1].tp_mode), []).append(y)
    for dim in [d for d in by_dim if embedding_stream_problem(cand.embedding, d)]:
        for y in by_dim.pop(dim):
            h.changeColBounds(y, 0.0, 0.0)
    if len(by_dim) < 2:
        return
    z = {dim: col(0.0, 0.0, 1.0, True) for dim in by_dim}
    h.addRow(1.0, 1.0, len(z), list(z.values()), [1.0] * len(z))
    for dim, ys in by_dim.items():
        for y in ys:
            h.addRow(-highspy.kHighsInf, 0.0, 2, [y, z[dim]], [1.0, -1.0])


def _run_milp(h: highspy.Highs, integers: list[int], cutoff: float
              ) -> highspy.HighsModelStatus | None:
    """Solve the MILP built in ``h`` (its LP relaxation first when a ``cutoff`` objective must
    be beaten); the model status of a feasible point, or None."""
    if math.isfinite(cutoff):
        # the LP relaxation bounds the MILP: no need to branch when it cannot win
        h.run()
        if (h.getModelStatus() != highspy.HighsModelStatus.kOptimal
                or h.getInfo().objective_function_value >= cutoff):
            return None
        h.setOptionValue("objective_bound", cutoff)
    for j in integers:
        h.changeColIntegrality(j, highspy.HighsVarType.kInteger)
    h.run()
    model_status = h.getModelStatus()
    if model_status not in (highspy.HighsModelStatus.kOptimal,
                            highspy.HighsModelStatus.kTimeLimit):
        return None
    if h.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        if model_status == highspy.HighsModelStatus.kTimeLimit:
            raise SolveTimeout
        return None
    return model_status


def in_bound_order(options: list[Option], cutoff: Callable[[], float], exact: bool,
                   budget: float = math.inf,
                   over_budget: list[tuple[float, int, Callable[[], Candidate | None]]]
                   | None = None) -> Iterator[Candidate]:
    """The candidates of ``options`` whose full time bound is below ``cutoff()``, costed on
    demand, in the order of their floor or, ``exact``, of their full time bound (ties by mesh,
    schedule, stages per rank and micro-batch size): a candidate is yielded once no option
    left unbounded has a smaller floor. The full bound comes from the fastest strategies
    alone (``fastest=True``); every strategy is costed only for the candidates yielded. One
    whose ``Candidate.state_floor`` exceeds ``budget`` is not yielded: (its floor, index,
    costing) goes to ``over_budget``."""
    options.sort(key=lambda o: o[:5])
    heap: list[tuple[tuple[float, Mesh, str, int, int], int, Callable[..., Candidate | None]]] \
        = []

    def popped() -> Iterator[Candidate]:
        key, _, make = heapq.heappop(heap)
        if not key[0] >= cutoff():  # a NaN bound goes on to the finiteness check
            cand = make()
            if cand is not None:
                yield cand

    for i, (floor, mesh, schedule, stages, mb, make) in enumerate(options):
        while heap and heap[0][0][0] < floor:
            yield from popped()
        if floor >= cutoff():
            break
        quick = make(fastest=True)
        if quick is None:
            continue  # block kinds interleave, or a pinned recipe the schedule cannot run
        bound = quick.time_lower_bound()
        if bound >= cutoff():
            continue
        if quick.state_floor() > budget:
            if over_budget is not None:
                over_budget.append((quick.state_floor(), i, make))
            continue
        heapq.heappush(heap, ((bound if exact else floor, mesh, schedule, stages, mb), i, make))
    while heap:
        yield from popped()


def _over_budget_floor(over_budget: list[tuple[float, int, Callable[[], Candidate | None]]],
                       floor: float, piped: bool, budget: float) -> float:
    """``floor`` lowered by the memory floors of the candidates left out for their state alone
    (those costed in full too), in the order of their state floor."""
    for state, _, make in sorted(over_budget, key=lambda o: o[:2]):
        if state >= floor and not piped:
            break  # a flat candidate's floor is at least its state floor
        cand = make()
        if cand is not None and (cand.memory_lower_bound() > budget or not piped):
            floor = min(floor, cand.memory_lower_bound())
    return floor


def search(graph: LayerGraph, global_batch: int, ctx: CostContext, budget: float,
           constraints: Constraints, meshes: list[Mesh], time_limit_s: float,
           pins: dict[str, Pin] | None = None, beat_s: float = math.inf) -> SearchResult:
    """Best (mesh, schedule, stage split, micro-batch, per-block strategies) by predicted step
    time under ``budget`` among those faster than ``beat_s`` (what another job of the search
    already reaches); every solve within ``time_limit_s`` of the start.

    Flat meshes first (their best bounds the pipeline ones), each group in order of its
    options' step-time bound: the search stops once no remaining bound can win. A candidate
    is pruned by its full time bound, its memory floor, the relaxation with memory
    (``Candidate.aggregate_bound``) and its LP, before its MILP is branched on.
    """
    start = time.perf_counter()
    # HiGHS refuses to run with a thread count other than its global scheduler's (made by the
    # first solve in the process, maybe another caller's): start it afresh
    highspy.Highs.resetGlobalScheduler(True)
    pins = pins or {}

    def groups() -> Iterator[tuple[tuple[list[Option], int, float], bool]]:
        """(options, how many, memory floor) per group, and whether it is the pipeline one."""
        yield flat_options(graph, global_batch, ctx, constraints,
                           [m for m in meshes if m.pp == 1], pins, cutoff()), False
        piped = [m for m in meshes if m.pp > 1]
        if piped:
            yield pipeline_options(graph, global_batch, ctx, budget, constraints, piped, pins,
                                   cutoff()), True

    best: Solution | None = None
    candidates = solved = pruned = variables = rows = 0
    timed_out = False
    floors = []

    def cutoff() -> float:
        return min(beat_s, best.step_time_s if best else math.inf)

    for (options, count, floor), piped in groups():
        candidates += count
        # flat candidates in the order of their full time bound; pipeline ones in the order
        # of their compute floor (their relaxation and LP prune the rest)
        over_budget: list[tuple[float, int, Callable[[], Candidate | None]]] = []
        for cand in in_bound_order(options, cutoff, not piped, budget, over_budget):
            if cand.time_lower_bound() >= cutoff():
                continue
            low = cand.memory_lower_bound()
            if low > budget or not piped:
                floor = min(floor, low)  # flat: every costed candidate's (achievable) floor
            if low > budget:
                pruned += 1
                continue
            bound = cand.aggregate_bound(budget)
            if bound >= cutoff():
                pruned += math.isinf(bound)
                continue
            remaining = time_limit_s - (time.perf_counter() - start)
            try:
                sol = solve(cand, budget, max(0.0, remaining), cutoff())
            except SolveTimeout:
                timed_out = True
                break
            solved += 1
            if sol is None:
                continue
            variables += sol.variables
            rows += sol.constraints
            if sol.step_time_s < cutoff():
                best = sol
        pruned += len(over_budget)
        if best is None and math.isinf(beat_s):
            # the floor names what budget would do (needed only when no job has a plan)
            floor = _over_budget_floor(over_budget, floor, piped, budget)
        floors.append(floor)
    status = ("Time limit reached" if timed_out else best.status) if best else "infeasible"
    stats = {"status": status, "gap": best.gap if best else 0.0,
             "candidates": candidates, "meshes": len(meshes), "milps_solved": solved,
             "pruned_by_memory": pruned, "variables": variables, "constraints": rows,
             "solve_time_s": time.perf_counter() - start}
    return SearchResult(best, floors[0], min(floors[1:], default=math.inf), stats, timed_out)
