"""MILP construction and HiGHS solve; mesh search around it.

For each candidate (mesh, micro-batch) the per-block decision is a small MILP over integer
counts: identical blocks (same signature) are interchangeable, so the model has one integer
``n[c,s]`` per block class and strategy instead of one binary per layer, and its size does not
grow with depth. Binary ``y[c,s]`` marks strategies in use so the working-set term ``W`` is the
max over used strategies (not a sum). Solved to optimality (``mip_rel_gap = 0``).

    minimize   accum * (sum n[c,s] * t[c,s] + fixed time)
    subject to sum_s n[c,s] = N[c]                      (every block gets one strategy)
               n[c,s] <= N[c] * y[c,s]                  (y marks used strategies)
               W >= w[c,s] * y[c,s]                     (working set of the worst used one)
               sum n[c,s] * k[c,s] + W <= budget - resident   (forward/backward phase;
               the optimizer-step phase does not depend on the blocks: checked per candidate)
"""

import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import highspy

from .cost.hardware import HardwareProfile
from .cost.model import (
    FWD_BWD_BYTES_PER_PARAM,
    GRAD_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    STEP_BYTES_PER_PARAM,
    BlockCost,
    Precision,
    block_cost,
    fixed_cost,
)
from .errors import UserError
from .features import EAGER, Features
from .graph.layer_graph import LayerGraph
from .layout import BlockStrategy, Mesh
from .pins import Pin
from .strategies import Constraints, microbatch_sizes, pinned_strategies


@dataclass(frozen=True)
class Candidate:
    """One (mesh, micro-batch) option with its per-class strategy costs."""

    mesh: Mesh
    microbatch: int
    accum: int
    classes: dict[str, int]
    """block class (signature + pin) -> number of blocks."""
    strategies: dict[str, list[BlockStrategy]]
    """block class -> the strategies its blocks may take."""
    costs: dict[tuple[str, BlockStrategy], BlockCost]
    fixed_time_s: float
    resident_bytes: float
    """Forward/backward memory that does not depend on the per-block choice (parameters and
    optimizer moments, embedding/output activations)."""
    state_bytes: float
    """Parameters, gradients and optimizer state per device."""
    step_bytes: float
    """Peak of the optimizer step (independent of the per-block choice)."""
    per_step_s: float = 0.0
    """Time paid once per step whatever the blocks do (the host optimizer with CPU offload)."""

    def memory(self, counts: dict[tuple[str, BlockStrategy], int]) -> float:
        used = [key for key, n in counts.items() if n > 0]
        working = max((self.costs[key].transient_bytes for key in used), default=0.0)
        fwd_bwd = self.resident_bytes + working + sum(
            n * self.costs[key].kept_bytes for key, n in counts.items()
        )
        return max(fwd_bwd, self.step_bytes)

    def step_time(self, counts: dict[tuple[str, BlockStrategy], int]) -> float:
        return self.per_step_s + self.accum * (
            self.fixed_time_s + sum(n * self.costs[key].time_s for key, n in counts.items())
        )

    def keys(self) -> list[tuple[str, BlockStrategy]]:
        return [(c, s) for c in self.classes for s in self.strategies[c]]

    def min_memory(self) -> float:
        """Smallest peak reached by giving every block of each class one strategy, tried for
        each strategy (a class that cannot take it keeps its most frugal one): achievable."""
        best = float("inf")
        frugal = {c: min(ss, key=lambda s, c=c: self.costs[(c, s)].kept_bytes)
                  for c, ss in self.strategies.items()}
        for s in {s for ss in self.strategies.values() for s in ss}:
            counts = {(c, s if s in self.strategies[c] else frugal[c]): n
                      for c, n in self.classes.items()}
            best = min(best, self.memory(counts))
        return best

    def time_lower_bound(self) -> float:
        return self.per_step_s + self.accum * (self.fixed_time_s + sum(
            n * min(self.costs[(c, s)].time_s for s in self.strategies[c])
            for c, n in self.classes.items()
        ))


@dataclass
class Solution:
    candidate: Candidate
    counts: dict[tuple[str, BlockStrategy], int]
    step_time_s: float
    peak_bytes: float
    status: str
    gap: float
    variables: int
    constraints: int


@dataclass
class SearchResult:
    best: Solution | None
    min_feasible_bytes: float
    stats: dict = field(default_factory=dict)
    timed_out: bool = False
    """``time_limit_s`` ran out before every candidate that could win was solved."""


def block_classes(graph: LayerGraph, pins: dict[str, Pin]) -> list[str]:
    """Each block's MILP class, in block order: its signature plus what its pin fixes."""
    return [layer.signature + (pins[layer.fqn].key if layer.fqn in pins else "")
            for layer in graph.blocks]


def build_candidate(graph: LayerGraph, mesh: Mesh, microbatch: int, global_batch: int,
                    hw: HardwareProfile, prec: Precision, gpus_per_node: int,
                    constraints: Constraints, pins: dict[str, Pin] | None = None,
                    features: Features = EAGER) -> Candidate:
    """Costs of every block strategy for one (mesh, micro-batch)."""
    pins = pins or {}
    classes: dict[str, int] = defaultdict(int)
    representative = {}
    strategies: dict[str, list[BlockStrategy]] = {}
    moe_model = graph.num_experts > 0
    for layer, cls in zip(graph.blocks, block_classes(graph, pins), strict=True):
        classes[cls] += 1
        if cls not in representative:
            representative[cls] = layer
            strategies[cls] = pinned_strategies(mesh, microbatch, constraints, moe_model,
                                                pins.get(layer.fqn), gpus_per_node)
    costs = {
        (c, s): block_cost(representative[c], mesh, s, microbatch, hw, prec, gpus_per_node,
                           graph.grouped_experts, features)
        for c in classes for s in strategies[c]
    }
    fixed = fixed_cost(graph, mesh, microbatch, hw, prec, gpus_per_node, features)
    # parameters, gradients and optimizer state do not depend on the block's strategy
    state = fixed.state_bytes + sum(
        costs[(c, strategies[c][0])].state_bytes * n for c, n in classes.items())
    per_param = state / STATE_BYTES_PER_PARAM
    accum = global_batch // (microbatch * mesh.dp)
    # gradients accumulate across micro-batches: resident from the second one on
    fwd_bwd = FWD_BWD_BYTES_PER_PARAM + (
        GRAD_BYTES_PER_PARAM if accum > 1 or hw.reserved_gradients else 0)
    step_bytes, per_step = per_param * STEP_BYTES_PER_PARAM[features.optimizer], 0.0
    if features.cpu_offload:
        # parameters, gradients and AdamW state live in host memory; AdamW runs there
        fwd_bwd, step_bytes = 0, 0.0
        if hw.host_optimizer_gbps > 0:
            per_step = state / (hw.host_optimizer_gbps * 1e9)
    return Candidate(mesh, microbatch, accum, dict(classes), strategies, costs, fixed.time_s,
                     per_param * fwd_bwd + fixed.kept_bytes, state, step_bytes, per_step)


def _new_highs() -> highspy.Highs:
    """A silent HiGHS instance. The first one prints a banner straight to file descriptor 1
    (not through Python), which would corrupt ``--json`` output: hide fd 1 meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
            h.setOptionValue("output_flag", False)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h


OBJECTIVE_PER_S = 1e3
"""The MILP's objective is in milliseconds: in seconds, strategies whose times differ by under
a microsecond look equal within HiGHS's tolerances, and it may return the slower one as
optimal (a brute force finds the difference)."""


class SolveTimeout(Exception):
    """HiGHS reached its time limit before finding any feasible point."""


def check_finite(cand: Candidate, budget: float) -> None:
    """Every number the MILP reads must be finite (a NaN or inf can stall HiGHS or turn the
    budget off); names the first offender."""
    numbers = {"memory budget": budget, "resident memory": cand.resident_bytes,
               "optimizer-step memory": cand.step_bytes, "fixed time": cand.fixed_time_s}
    for (_, strategy), cost in cand.costs.items():
        for name in ("time_s", "kept_bytes", "transient_bytes"):
            numbers[f"{strategy.describe()} {name}"] = getattr(cost, name)
    for name, value in numbers.items():
        if not math.isfinite(value):
            raise UserError(
                f"the cost model gave a non-finite {name} ({value}) on mesh {cand.mesh}: check "
                "the hardware profile and autoparallel values for NaN, inf or zero")


def solve_candidate(cand: Candidate, budget: float, time_limit_s: float) -> Solution | None:
    """Solve the per-block MILP for one candidate; None if infeasible. Raises SolveTimeout when
    the time limit ends the solve without any feasible point (HiGHS then returns zeros)."""
    check_finite(cand, budget)
    h = _new_highs()
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("time_limit", float(time_limit_s))
    inf = highspy.kHighsInf
    keys = cand.keys()
    n_idx = {}
    y_idx = {}
    for key in keys:
        n_idx[key] = h.getNumCol()
        h.addCol(cand.accum * cand.costs[key].time_s * OBJECTIVE_PER_S, 0.0,
                 float(cand.classes[key[0]]), 0, [], [])
        h.changeColIntegrality(n_idx[key], highspy.HighsVarType.kInteger)
    for key in keys:
        y_idx[key] = h.getNumCol()
        h.addCol(0.0, 0.0, 1.0, 0, [], [])
        h.changeColIntegrality(y_idx[key], highspy.HighsVarType.kInteger)
    w = h.getNumCol()
    h.addCol(0.0, 0.0, inf, 0, [], [])
    for c, count in cand.classes.items():
        idx = [n_idx[(c, s)] for s in cand.strategies[c]]
        h.addRow(float(count), float(count), len(idx), idx, [1.0] * len(idx))
    gib = 2.0**30  # memory rows in GiB: numbers of similar size for HiGHS
    for key in keys:
        h.addRow(-inf, 0.0, 2, [n_idx[key], y_idx[key]], [1.0, -float(cand.classes[key[0]])])
        h.addRow(0.0, inf, 2, [w, y_idx[key]], [1.0, -cand.costs[key].transient_bytes / gib])
    idx = [n_idx[k] for k in keys] + [w]
    vals = [cand.costs[k].kept_bytes / gib for k in keys] + [1.0]
    h.addRow(-inf, (budget - cand.resident_bytes) / gib, len(idx), idx, vals)
    if cand.step_bytes > budget:
        return None
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    if h.getModelStatus() not in (highspy.HighsModelStatus.kOptimal,
                                  highspy.HighsModelStatus.kTimeLimit):
        return None
    feasible = highspy.SolutionStatus.kSolutionStatusFeasible
    has_point = h.getInfo().primal_solution_status == feasible
    if not has_point:
        if h.getModelStatus() == highspy.HighsModelStatus.kTimeLimit:
            raise SolveTimeout
        return None
    values = h.getSolution().col_value
    counts = {k: int(round(values[n_idx[k]])) for k in keys}
    info = h.getInfo()
    return Solution(cand, counts, cand.step_time(counts), cand.memory(counts), status,
                    float(info.mip_gap), h.getNumCol(), h.getNumRow())


def search(graph: LayerGraph, world: int, global_batch: int, hw: HardwareProfile,
           prec: Precision, gpus_per_node: int, budget: float, constraints: Constraints,
           meshes: list[Mesh], time_limit_s: float,
           pins: dict[str, Pin] | None = None, features: Features = EAGER,
           beat_s: float = math.inf) -> SearchResult:
    """Best (mesh, micro-batch, per-block strategies) by predicted step time under ``budget``
    among those faster than ``beat_s`` (what another job of the search already reaches).

    Candidates are visited in order of their time lower bound; those that cannot fit memory are
    pruned before a MILP is built, and the search stops once no remaining bound can win.
    """
    start = time.perf_counter()
    cands = [
        build_candidate(graph, mesh, mb, global_batch, hw, prec, gpus_per_node, constraints,
                        pins, features)
        for mesh in meshes
        for mb in microbatch_sizes(global_batch, mesh, constraints.accumulation)
    ]
    min_feasible = min((c.min_memory() for c in cands), default=float("inf"))
    cands.sort(key=lambda c: (c.time_lower_bound(), c.mesh, c.microbatch))
    best: Solution | None = None
    solved = pruned = variables = rows = 0
    status, gap, timed_out = "no candidate", 0.0, False
    for cand in cands:
        if cand.time_lower_bound() >= min(beat_s, best.step_time_s if best else math.inf):
            break
        if cand.min_memory() > budget:
            pruned += 1
            continue
        remaining = time_limit_s - (time.perf_counter() - start)
        try:
            sol = solve_candidate(cand, budget, max(0.0, remaining))
        except SolveTimeout:
            status, timed_out = "Time limit reached", True
            break
        solved += 1
        if sol is None:
            continue
        variables += sol.variables
        rows += sol.constraints
        if best is None or sol.step_time_s < best.step_time_s:
            best, status, gap = sol, sol.status, sol.gap
    stats = {
        "status": status if best else "infeasible",
        "gap": gap,
        "candidates": len(cands),
        "meshes": len(meshes),
        "milps_solved": solved,
        "pruned_by_memory": pruned,
        "variables": variables,
        "constraints": rows,
        "solve_time_s": time.perf_counter() - start,
    }
    return SearchResult(best, min_feasible, stats, timed_out)
