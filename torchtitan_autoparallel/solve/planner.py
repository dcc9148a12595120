"""Planning: a job's request (``job.request``) -> search (candidates, costs, MILP) -> Plan.

Offline: no process group, no device. ``job.request.plan_job`` reads a TorchTitan config into
the request and calls ``solve_request``.
"""

import contextlib
import gc
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..candidates.layout import GIB, Mesh
from ..candidates.pipeline import no_pipeline_reason, prefix_classes
from ..candidates.strategies import enumerate_meshes
from ..cost.model import clear_compute_memo
from ..errors import UserError
from ..plan.assembly import JobInputs, plan_of_solution, with_global_batch
from ..plan.schema import Plan, plan_shards_with_fsdp
from .milp import Solution, search


@contextlib.contextmanager
def _collecting_new_objects() -> Iterator[None]:
    """Garbage collection visits only the objects made inside: the process's older ones
    (torch's, the model's) wait in the permanent generation until it ends, so a full
    collection while planning takes milliseconds, not a pass over half a million objects."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """A search: the planning inputs and what the plan reports back about the settings."""

    inputs: JobInputs
    local_batch: int
    """``training.local_batch_size``: with ``global_batch_follows_dp`` each data-parallel
    degree is searched with this many sequences per rank."""
    global_batch_follows_dp: bool
    """``training.global_batch_size = -1``: the global batch is the local batch x the mesh's
    data-parallel degree (TorchTitan's rule)."""
    local_batch_set: bool
    """The user set ``training.local_batch_size`` (the plan notes when it runs another)."""
    time_limit_s: float
    constraint_keys: tuple[str, ...]
    """The settings the search takes as constraints, as ``key = value``."""
    narrowing_keys: tuple[str, ...]
    """Those and the ``autoparallel.techniques`` / ``pin`` the user set: what a job no plan
    fits names."""
    fsdp_only_keys: tuple[str, ...]
    """FSDP-only settings the user set, as ``key = value``: noted when the plan shards
    nothing with FSDP."""
    release_notes: tuple[str, ...]
    """What the TorchTitan release's front-end noted while reading the config."""


def solve_request(request: PlanRequest) -> Plan:
    """The best plan for ``request``. With ``global_batch_follows_dp`` each data-parallel
    degree is searched with its own global batch and the plan with the most tokens/s wins."""
    with _collecting_new_objects():
        return _solve_request(request)


def _solve_request(request: PlanRequest) -> Plan:
    start = time.perf_counter()
    clear_compute_memo()
    inputs = request.inputs
    world = inputs.world
    meshes = enumerate_meshes(inputs.graph, world, inputs.gpus_per_node, inputs.constraints)
    if prefix_classes(inputs.graph, inputs.pins) is None:
        meshes = [m for m in meshes if m.pp == 1]  # no stage split keeps alternating blocks
    if inputs.constraints.pp > 1 and not meshes:
        raise UserError(
            f"parallelism.pipeline_parallel_degree = {inputs.constraints.pp}: the blocks of "
            f"{inputs.graph.family} {inputs.graph.flavor} alternate between kinds (or pins), so "
            "no stage split keeps each kind's blocks; set it to 1")
    local = request.local_batch
    if request.global_batch_follows_dp:
        # largest data-parallel degree first: its rate bounds the pipeline search of the rest
        jobs = [(with_global_batch(inputs, local * dp), [m for m in meshes if m.dp == dp])
                for dp in sorted({m.dp for m in meshes}, reverse=True)]
    else:
        jobs = [(inputs, [m for m in meshes if inputs.global_batch % m.dp == 0]
                 or _no_batch_split(meshes, inputs.global_batch))]
    best: tuple[float, JobInputs, Solution, dict[str, Any]] | None = None
    min_feasible = min_pipeline = float("inf")
    candidates = 0
    limit = request.time_limit_s
    # one limit for every solve of the job, whatever it searches (from here: reading the model
    # into its layer graph, which may compile its attention masks, is not solving)
    deadline = time.perf_counter() + limit
    timed_out = False
    for job, job_meshes in jobs:
        # only a plan with more tokens/s than the best so far (any job) can win
        step_to_beat = job.global_batch / best[0] if best is not None else float("inf")
        result = search(job.graph, job.global_batch, job.cost_context, job.budget_bytes,
                        job.constraints, job_meshes, max(0.0, deadline - time.perf_counter()),
                        job.pins, step_to_beat)
        timed_out |= result.timed_out
        min_feasible = min(min_feasible, result.min_feasible_bytes)
        min_pipeline = min(min_pipeline, result.min_pipeline_bytes)
        candidates += result.stats["candidates"]
        if result.best is not None:
            rate = job.global_batch / result.best.step_time_s
            if best is None or rate > best[0]:
                best = (rate, job, result.best, dict(result.stats))
    if best is None and timed_out:
        raise UserError(f"autoparallel.time_limit_s = {limit:g} s ran out before the solver "
                        "found any feasible plan: raise time_limit_s")
    if best is None and not candidates and inputs.constraints.pp > 1:
        raise UserError(no_pipeline_reason(inputs.graph, inputs.global_batch, inputs.constraints,
                                           inputs.features, [m for m in meshes if m.pp > 1]))
    if best is None:
        raise _no_plan_fits(request, min_feasible, min_pipeline)
    _, job, sol, stats = best
    stats["planning_time_s"] = time.perf_counter() - start
    plan = plan_of_solution(job, sol, stats)
    if request.constraint_keys:
        plan.notes.append(f"constraints (set by you): {', '.join(request.constraint_keys)}")
    plan.notes.extend(moot_fsdp_settings(request, plan))
    plan.notes.extend(request.release_notes)
    if request.local_batch_set and request.local_batch != plan.local_batch_size:
        plan.notes.append(
            f"searched: training.local_batch_size = {request.local_batch} (set by you); "
            f"the plan runs {plan.local_batch_size} x accumulation "
            f"{plan.gradient_accumulation_steps} for the global batch {plan.global_batch_size}")
    return plan


def _no_plan_fits(request: PlanRequest, min_feasible: float, min_pipeline: float
                  ) -> UserError:
    """The one line for a job no plan fits: the smallest budget that works, and the settings
    that narrowed the search."""
    # the plain search's smallest budget is achievable; the pipeline search only knows a
    # floor (no split it costed fits below it)
    inputs = request.inputs
    smallest = (f"the smallest budget that works is {gib_up(min_feasible)} GiB"
                if math.isfinite(min_feasible) else
                f"pipeline plans need at least {gib_up(min_pipeline)} GiB"
                if math.isfinite(min_pipeline) else "no plan could be costed")
    if not inputs.constraints.accumulation:
        smallest += (" without gradient accumulation, which optimizer."
                     "early_step_in_backward rules out")
    fixed = request.narrowing_keys
    if fixed:  # the search was narrowed: those settings may be what does not fit
        smallest += f" with what you set ({', '.join(fixed)})"
    return UserError(
        f"no plan fits the memory budget of {inputs.budget_bytes / GIB:.3g} GiB per "
        f"device; {smallest} (raise autoparallel.memory_gib, "
        + ("relax those settings, " if fixed else "")
        + "lower the batch or sequence length, or add devices)"
    )


def moot_fsdp_settings(request: PlanRequest, plan: Plan) -> list[str]:
    """A note naming the FSDP-only settings the job sets when the plan shards nothing with
    FSDP (DDP or one device): they take no effect, and the plan says so."""
    if plan_shards_with_fsdp(plan) or not request.fsdp_only_keys:
        return []
    return [f"no effect: {', '.join(request.fsdp_only_keys)} (the plan shards nothing with "
            f"FSDP, mesh {plan.mesh}; set parallelism.data_parallel_shard_degree >= 2 for FSDP)"]


def gib_up(size_bytes: float, digits: int = 3) -> str:
    """``size_bytes`` in GiB to ``digits`` significant digits, rounded up: a budget that
    large is enough."""
    gib = size_bytes / GIB
    if gib <= 0:
        return "0"
    scale = 10 ** (digits - 1 - math.floor(math.log10(gib)))
    return f"{math.ceil(gib * scale * (1 - 1e-12)) / scale:g}"


def _no_batch_split(meshes: list[Mesh], global_batch: int) -> list[Mesh]:
    dps = sorted({m.dp for m in meshes})
    raise UserError(
        f"global batch size {global_batch} cannot be split over any legal data-parallel degree "
        f"{dps}: choose training.global_batch_size as a multiple of one of them"
    )
