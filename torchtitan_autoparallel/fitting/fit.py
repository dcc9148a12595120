"""Fit hardware-profile constants to measured times: one convex program (cvxpy), used by
``calibrate`` (micro-benchmarks), the ``fit`` command (a user's runs) and the sweep and
published-table fits in experiments/.

Public API::

    fit_profile(runs: list[Run], base: HardwareProfile, free: list[str] | None = None,
                caps: dict[str, float] | None = None, loss: str = "squares") -> FitResult
    cross_validate(runs, base, free=None, caps=None, loss="squares") -> list[float]
    predicted_times(runs, hw) -> list[float]

A ``Run`` is one measurement: a label, the measured seconds and either a ``Plan`` (its step time
comes from ``recost.recost``: the plan as it ran, costed on a candidate profile) or a
``time_of(profile) -> seconds`` function (a micro-benchmark priced by the cost model's own
formula); ``group`` names what ``cross_validate`` leaves out together (a config). A published
table's rows, for instance::

    runs = [Run(name, global_batch * seq_len / (tokens_per_s_per_gpu * gpus), plan=plan)
            for name, plan, ... in rows]        # plan: e.g. job.request.recipe_plan(job, gpus)
    result = fit_profile(runs, load_profile("h100_sxm"),
                         free=["matmul_efficiency", "block_overhead_us"])
    result.profile, result.rel_stderr, result.unidentified

``FitResult.profile`` is ``base`` with the fitted constants replaced (nothing else changes);
``free`` lists what was fitted, ``unidentified`` what kept the base value and why. Fields added
to ``HardwareProfile`` later are fitted by name, their kind read from the name: ``*_gbps``,
``*tflops`` and ``*efficiency`` are throughputs (fitted as inverses; efficiency at most 1),
names with ``overlap`` or ``fraction`` lie in [0, 1], all others are non-negative.

How step time depends on the constants is read off the cost model, not restated here. Each
constant is fitted in the coordinate in which time is linear: the inverse of a throughput or
bandwidth (``*_gbps``, ``*tflops``, ``*efficiency``), the value itself for latencies, overheads,
overlap fractions and factors. Within one pattern of the model's max() terms (which of compute
or communication is exposed per block, as the current profile decides) step time is affine in
those coordinates, so its coefficients are exact finite differences of ``recost`` at the current
profile. One iteration solves the convex program on that affine model

    minimize  sum_i ((t_i + J_i (z - z_k)) / m_i - 1)^2   (or Huber: outliers weigh less)
    subject to bounds on z (efficiency and overlap in (0, 1], bandwidth and peak <= ``caps``,
               non-negative latencies and overheads)

with a solver cvxpy ships (CLARABEL), then steps towards its optimum by backtracking on the
true (re-costed) loss; iterations repeat until the profile is a fixed point. Products of two
free constants (the overlap fraction times compute) are linearised at each iterate the same way.

Constants the data cannot pin down are not invented: those no run depends on, those in an exact
linear dependency with others (pivoted QR of the scaled Jacobian), and those whose relative
standard error exceeds ``MAX_REL_STDERR`` keep their base value and are listed in
``FitResult.unidentified`` with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cost.hardware import HardwareProfile
from ..errors import UserError
from ..plan.recost import recost

DEFAULT_FREE = ("matmul_efficiency", "intra_node_gbps", "inter_node_gbps", "intra_node_latency_us",
                "inter_node_latency_us", "oversubscribed_latency_us", "block_overhead_us",
                "comm_overlap", "host_copy_gbps", "kernel_launch_us")
"""Fields fitted when ``free`` is not given (those the runs do not exercise are reported)."""
MAX_REL_STDERR = 0.5
"""A constant whose relative standard error exceeds this is not determined by the data."""
HUBER_M = 0.1
"""Relative error beyond which the Huber loss grows linearly (outliers weigh less)."""
MAX_ITERATIONS = 30


def datasheet_caps(profile: HardwareProfile) -> dict[str, float]:
    """Upper bounds a fit keeps to: the profile's peak throughput and bandwidths."""
    return {f.name: float(getattr(profile, f.name)) for f in dataclasses.fields(profile)
            if f.name.endswith(("_gbps", "tflops")) and getattr(profile, f.name) > 0}


@dataclass(frozen=True)
class Run:
    """One measured time and what it measured."""

    label: str
    measured_s: float
    plan: Any = None
    """A ``plan.Plan`` that ran (mesh, batch split, per-block strategies)."""
    time_of: Callable[[HardwareProfile], float] | None = None
    """Instead of a plan: the model's time of the measured operation on a profile."""
    group: str = ""
    peak_memory_gib: float | None = None


@dataclass(frozen=True)
class FitResult:
    profile: HardwareProfile
    free: list[str]
    """Fields that were fitted."""
    rel_stderr: dict[str, float]
    """Relative standard error of each fitted field (nan at a bound)."""
    at_bound: list[str]
    unidentified: dict[str, str]
    """Field -> why the data cannot pin it down (it keeps the base value)."""
    before_s: list[float]
    after_s: list[float]
    iterations: int
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Coord:
    """A field in the coordinate in which time is linear, with its bounds there."""

    name: str
    inverse: bool
    lo: float
    hi: float

    def to_z(self, value: float) -> float:
        return (1.0 / value if value > 0 else 0.0) if self.inverse else value

    def to_value(self, z: float) -> float:
        return (1.0 / z if z > 0 else 0.0) if self.inverse else z


def _coord(name: str, base: HardwareProfile, caps: dict[str, float]) -> _Coord:
    """Bounds from physics, by the field's kind (named by its suffix, so new fields fit too)."""
    value = float(getattr(base, name))
    if name.endswith(("_gbps", "tflops", "efficiency")):
        hi_value = min(caps.get(name, math.inf), 1.0 if name.endswith("efficiency") else math.inf)
        lo_z = 1.0 / hi_value if math.isfinite(hi_value) else 0.0
        if lo_z == 0.0 and value > 0 and not name.startswith("host_copy"):
            lo_z = 1e-3 / value  # no cap: at most 1000x the base throughput
        return _Coord(name, True, lo_z, math.inf)
    hi = 1.0 if ("overlap" in name or "fraction" in name) else caps.get(name, math.inf)
    lo = 1.0 if name == "moe_load_imbalance" else 0.0
    return _Coord(name, False, lo, hi)


def predicted_times(runs: list[Run], hw: HardwareProfile, cache: dict | None = None
                    ) -> list[float]:
    """Each run's time as the cost model predicts it on ``hw``."""
    cache = {} if cache is None else cache
    out = []
    for run in runs:
        if run.time_of is not None:
            out.append(run.time_of(hw))
        else:
            out.append(recost(run.plan, hw, cache).predicted["step_time_s"])
    return out


def _loss(rel: np.ndarray, kind: str) -> float:
    if kind == "squares":
        return float(np.sum(rel**2))
    a = np.abs(rel)
    return float(np.sum(np.where(a <= HUBER_M, a**2, 2 * HUBER_M * a - HUBER_M**2)))


class _Problem:
    def __init__(self, runs: list[Run], base: HardwareProfile, coords: list[_Coord],
                 loss: str) -> None:
        self.runs, self.base, self.coords, self.loss = runs, base, coords, loss
        self.measured = np.array([r.measured_s for r in runs])
        self.cache: dict = {}

    def profile(self, z: np.ndarray) -> HardwareProfile:
        return dataclasses.replace(self.base, **{
            c.name: c.to_value(float(v)) for c, v in zip(self.coords, z, strict=True)})

    def times(self, z: np.ndarray) -> np.ndarray:
        return np.array(predicted_times(self.runs, self.profile(z), self.cache))

    def objective(self, z: np.ndarray) -> float:
        return _loss(self.times(z) / self.measured - 1.0, self.loss)

    def jacobian(self, z: np.ndarray, t: np.ndarray, cols: list[int] | None = None
                 ) -> np.ndarray:
        """d t / d z by forward differences (exact where no max() switches branch); columns
        not in ``cols``, and those no time moves with, are 0."""
        jac = np.zeros((len(self.runs), len(z)))
        for j in range(len(z)) if cols is None else cols:
            c = self.coords[j]
            h = 1e-4 * abs(z[j]) if z[j] else 1e-3
            for _ in range(4):  # grow a step too small to move any time above rounding
                step = -h if z[j] + h > c.hi else h
                if z[j] + step < c.lo:
                    break  # no room inside the bounds: nothing depends on it there
                dz = z.copy()
                dz[j] += step
                diff = self.times(dz) - t
                if np.max(np.abs(diff) / t) > 1e-9:
                    jac[:, j] = diff / step
                    break
                h *= 1e3
        return jac


def _scaled(jac: np.ndarray, z: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Jacobian of relative error per relative change of each coordinate."""
    scale = np.where(np.abs(z) > 0, np.abs(z), 1.0)
    return jac * scale / measured[:, None]


def _dependent(a: np.ndarray, names: list[str], active: list[int]) -> dict[str, str]:
    """Columns of ``a`` (among ``active``) that no run depends on or that are linear
    combinations of others (pivoted QR), with the reason."""
    import scipy.linalg

    out: dict[str, str] = {}
    norms = np.linalg.norm(a, axis=0)
    live = []
    for j in active:
        if norms[j] == 0.0:
            out[names[j]] = "no run depends on it"
        else:
            live.append(j)
    if len(live) < 2:
        return out
    cols = a[:, live] / norms[live]
    _, r, piv = scipy.linalg.qr(cols, mode="economic", pivoting=True)
    diag = np.abs(np.diag(r))
    rank = int(np.sum(diag > 1e-6 * diag[0]))
    kept = [names[live[p]] for p in piv[:rank]]
    for p in piv[rank:]:
        out[names[live[p]]] = ("only a combination with " + ", ".join(kept) +
                               f" is determined ({len(live)} constants, rank {rank})")
    return out


def _solve_step(a_rel: np.ndarray, resid: np.ndarray, z: np.ndarray, coords: list[_Coord],
                active: list[int], loss: str) -> np.ndarray:
    """Optimum of the affine model: relative errors ``resid + a_rel @ (z' - z)``, solved for
    the relative change of each coordinate (columns of like size: a well-scaled program)."""
    import cvxpy as cp

    scale = np.where(np.abs(z[active]) > 0, np.abs(z[active]), 1.0)
    lo = np.array([coords[j].lo for j in active])
    hi = np.array([coords[j].hi for j in active])
    y = cp.Variable(len(active))
    rel = resid + (a_rel[:, active] * scale) @ y
    obj = cp.sum_squares(rel) if loss == "squares" else cp.sum(cp.huber(rel, HUBER_M))
    cons = [y >= (lo - z[active]) / scale]
    finite = np.isfinite(hi)
    if finite.any():
        cons.append(y[np.flatnonzero(finite)] <= ((hi - z[active]) / scale)[finite])
    problem = cp.Problem(cp.Minimize(obj), cons)
    try:
        problem.solve(solver=cp.CLARABEL)
    except cp.error.SolverError:
        problem.solve(solver=cp.SCS)
    if y.value is None:
        raise UserError(f"the profile fit did not solve ({problem.status}): check the runs' "
                        "measured times")
    out = z.copy()
    out[active] = np.clip(z[active] + scale * y.value, lo, hi)
    return out


def _descend(prob: _Problem, z: np.ndarray, active: list[int]) -> tuple[np.ndarray, int]:
    """Iterate convex steps on the re-linearised model to a fixed point."""
    names = [c.name for c in prob.coords]
    t = prob.times(z)
    best = _loss(t / prob.measured - 1.0, prob.loss)
    iterations = 0
    while iterations < MAX_ITERATIONS:
        iterations += 1
        jac = prob.jacobian(z, t, active)
        a = jac / prob.measured[:, None]
        dead = _dependent(_scaled(jac, z, prob.measured), names, active)
        step_on = [j for j in active if names[j] not in dead]
        if not step_on:
            break
        target = _solve_step(a, t / prob.measured - 1.0, z, prob.coords, step_on, prob.loss)
        moved = False
        for frac in (1.0, 0.5, 0.25, 0.125, 0.0625):
            trial = z + frac * (target - z)
            t_trial = prob.times(trial)
            value = _loss(t_trial / prob.measured - 1.0, prob.loss)
            if value < best - 1e-12 * max(best, 1.0):
                z, t, best, moved = trial, t_trial, value, True
                break
        if not moved:
            break
    return z, iterations


def _rel_stderr(prob: _Problem, t: np.ndarray, scaled: np.ndarray, fitted: list[int]
                ) -> dict[str, float]:
    """Relative standard error of each fitted field from the residuals (Gauss-Newton);
    ``scaled``: the Jacobian from ``_scaled``."""
    rel = t / prob.measured - 1.0
    a = scaled[:, fitted]
    dof = len(rel) - len(fitted)
    out = {}
    if dof <= 0:  # as many runs as constants: an exact fit, its error unknown
        return {prob.coords[j].name: math.nan for j in fitted}
    sigma2 = float(np.sum(rel**2)) / dof
    cov = sigma2 * np.linalg.pinv(a.T @ a)
    for k, j in enumerate(fitted):
        out[prob.coords[j].name] = math.sqrt(max(cov[k, k], 0.0))
    return out


def fit_profile(runs: list[Run], base: HardwareProfile, free: list[str] | None = None,
                caps: dict[str, float] | None = None, loss: str = "squares") -> FitResult:
    """Fit the ``free`` fields of ``base`` to the runs' measured times (see module doc).
    ``caps``: upper bounds on fields' values (datasheet peak and bandwidths)."""
    if loss not in ("huber", "squares"):
        raise UserError(f"unknown loss {loss!r}: use 'huber' or 'squares'")
    if not runs:
        raise UserError("no runs to fit: give at least one measured run per constant")
    bad = [r.label for r in runs if not (r.measured_s > 0 and math.isfinite(r.measured_s))]
    if bad:
        raise UserError(f"measured times must be positive seconds; not so for {bad[:3]}")
    names = list(DEFAULT_FREE if free is None else free)
    fields = {f.name: f.type for f in dataclasses.fields(HardwareProfile)}
    unknown = [n for n in names if n not in fields or fields[n] not in (float, "float")]
    if unknown:
        raise UserError(f"cannot fit {unknown}: free constants must be numeric fields of "
                        f"HardwareProfile, e.g. {list(DEFAULT_FREE)}")
    caps = caps or {}
    coords = [_coord(n, base, caps) for n in names]
    prob = _Problem(runs, base, coords, loss)
    z0 = np.array([c.to_z(float(getattr(base, c.name))) for c in coords])
    z0 = np.clip(z0, [c.lo for c in coords], [c.hi for c in coords])
    before = prob.times(z0)
    unidentified = _dependent(_scaled(prob.jacobian(z0, before), z0, prob.measured), names,
                              list(range(len(names))))
    iterations = 0
    while True:
        active = [j for j, n in enumerate(names) if n not in unidentified]
        z, its = _descend(prob, z0.copy(), active)
        iterations += its
        t = prob.times(z)
        tol = 1e-6 * np.maximum(np.maximum(np.abs(z), np.abs(z0)), 1.0)
        at_bound = [names[j] for j in active if abs(z[j] - coords[j].lo) <= tol[j]
                    or abs(z[j] - coords[j].hi) <= tol[j]]
        inside = [j for j in active if names[j] not in at_bound]
        scaled = _scaled(prob.jacobian(z, t, inside), z, prob.measured)
        final_dead = _dependent(scaled, names, inside)
        fitted = [j for j in inside if names[j] not in final_dead]
        stderr = _rel_stderr(prob, t, scaled, fitted)
        loose = {n: s for n, s in stderr.items() if s > MAX_REL_STDERR}
        if not loose:
            break
        worst = max(loose, key=lambda n: loose[n])
        unidentified[worst] = (f"the runs determine it only to +-{loose[worst]:.0%} "
                               f"(more than {MAX_REL_STDERR:.0%})")
    notes = [f"{n}: {why} where the fit ended; the value is where the runs stopped "
             "depending on it" for n, why in final_dead.items()]
    if len(runs) <= len(fitted):
        notes.append(f"{len(runs)} runs for {len(fitted)} constants: an exact fit, its "
                     "error unknown; add runs")
    return FitResult(prob.profile(z), [n for n in names if n not in unidentified],
                     {n: stderr.get(n, math.nan) for n in names if n not in unidentified},
                     [n for n in at_bound if n not in unidentified], unidentified,
                     before.tolist(), t.tolist(), iterations, notes)


def cross_validate(runs: list[Run], base: HardwareProfile, free: list[str] | None = None,
                   caps: dict[str, float] | None = None, loss: str = "squares") -> list[float]:
    """Leave one group out: each run's time predicted by a profile fitted to the runs of the
    other groups (``Run.group``; one group: nan for every run)."""
    groups = sorted({r.group for r in runs})
    out = [math.nan] * len(runs)
    if len(groups) < 2:
        return out
    for g in groups:
        train = [r for r in runs if r.group != g]
        test = [i for i, r in enumerate(runs) if r.group == g]
        hw = fit_profile(train, base, free, caps, loss).profile
        for i, t in zip(test, predicted_times([runs[i] for i in test], hw), strict=True):
            out[i] = t
    return out
