"""Planning: TorchTitan job config -> planning inputs -> search (candidates, costs, MILP) -> Plan.

Offline: no process group, no device. ``plan_job`` is what the entrypoint (every rank, and the
one-process preflight) and the CLI call.
"""

import contextlib
import gc
import math
import time
from collections.abc import Iterator
from typing import Any

from ..candidates.layout import GIB, Mesh
from ..candidates.pipeline import no_pipeline_reason, prefix_classes
from ..candidates.strategies import enumerate_meshes
from ..cost.model import clear_compute_memo
from ..errors import UserError
from ..job.explicit import NOTES_ATTR, user_set
from ..job.features import features_from_config
from ..job.inputs import constraint_keys, job_inputs, with_global_batch
from ..plan.assembly import JobInputs, plan_of_solution
from ..plan.schema import Plan
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


def plan_job(job_config: Any, world: int) -> Plan:
    """Solve the parallelization of ``job_config`` on ``world`` devices. With
    ``training.global_batch_size = -1`` the global batch is the local batch x the mesh's
    data-parallel degree (TorchTitan's rule): each degree is searched with its own global batch
    and the plan with the most tokens/s wins."""
    with _collecting_new_objects():
        return _plan_job(job_config, world)


def _plan_job(job_config: Any, world: int) -> Plan:
    start = time.perf_counter()
    clear_compute_memo()
    inputs = job_inputs(job_config, world)
    meshes = enumerate_meshes(inputs.graph, world, inputs.gpus_per_node, inputs.constraints)
    if prefix_classes(inputs.graph, inputs.pins) is None:
        meshes = [m for m in meshes if m.pp == 1]  # no stage split keeps alternating blocks
    if inputs.constraints.pp > 1 and not meshes:
        raise UserError(
            f"parallelism.pipeline_parallel_degree = {inputs.constraints.pp}: the blocks of "
            f"{inputs.graph.family} {inputs.graph.flavor} alternate between kinds (or pins), so "
            "no stage split keeps each kind's blocks; set it to 1")
    local = job_config.training.local_batch_size
    if job_config.training.global_batch_size == -1:
        # largest data-parallel degree first: its rate bounds the pipeline search of the rest
        jobs = [(with_global_batch(inputs, local * dp), [m for m in meshes if m.dp == dp])
                for dp in sorted({m.dp for m in meshes}, reverse=True)]
    else:
        jobs = [(inputs, [m for m in meshes if inputs.global_batch % m.dp == 0]
                 or _no_batch_split(meshes, inputs.global_batch))]
    best: tuple[float, JobInputs, Solution, dict[str, Any]] | None = None
    min_feasible = min_pipeline = float("inf")
    candidates = 0
    limit = job_config.autoparallel.time_limit_s
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
        raise _no_plan_fits(job_config, inputs, min_feasible, min_pipeline)
    _, job, sol, stats = best
    stats["planning_time_s"] = time.perf_counter() - start
    plan = plan_of_solution(job, sol, stats)
    keys = constraint_keys(job_config)
    if keys:
        plan.notes.append(f"constraints (set by you): {', '.join(keys)}")
    plan.notes.extend(moot_fsdp_settings(job_config, plan))
    plan.notes.extend(getattr(job_config, NOTES_ATTR, []))
    training = job_config.training
    if user_set(job_config, "training.local_batch_size") and \
            training.local_batch_size != plan.local_batch_size:
        plan.notes.append(
            f"searched: training.local_batch_size = {training.local_batch_size} (set by you); "
            f"the plan runs {plan.local_batch_size} x accumulation "
            f"{plan.gradient_accumulation_steps} for the global batch {plan.global_batch_size}")
    return plan


def _no_plan_fits(job_config: Any, inputs: JobInputs, min_feasible: float,
                  min_pipeline: float) -> UserError:
    """The one line for a job no plan fits: the smallest budget that works, and the settings
    that narrowed the search."""
    # the plain search's smallest budget is achievable; the pipeline search only knows a
    # floor (no split it costed fits below it)
    smallest = (f"the smallest budget that works is {gib_up(min_feasible)} GiB"
                if math.isfinite(min_feasible) else
                f"pipeline plans need at least {gib_up(min_pipeline)} GiB"
                if math.isfinite(min_pipeline) else "no plan could be costed")
    if not inputs.constraints.accumulation:
        smallest += (" without gradient accumulation, which optimizer."
                     "early_step_in_backward rules out")
    fixed = constraint_keys(job_config) + [
        f"autoparallel.{key} = {getattr(job_config.autoparallel, key)!r}"
        for key in ("techniques", "pin") if user_set(job_config, f"autoparallel.{key}")]
    if fixed:  # the search was narrowed: those settings may be what does not fit
        smallest += f" with what you set ({', '.join(fixed)})"
    return UserError(
        f"no plan fits the memory budget of {inputs.budget_bytes / GIB:.3g} GiB per "
        f"device; {smallest} (raise autoparallel.memory_gib, "
        + ("relax those settings, " if fixed else "")
        + "lower the batch or sequence length, or add devices)"
    )


def moot_fsdp_settings(job_config: Any, plan: Plan) -> list[str]:
    """A note naming the FSDP-only settings the job sets when the plan shards nothing with
    FSDP (DDP or one device): they take no effect, and the plan says so."""
    from ..plan.schema import plan_shards_with_fsdp

    if plan_shards_with_fsdp(plan):
        return []
    keys = []
    if user_set(job_config, "parallelism.fsdp_reshard_after_forward"):
        keys.append("parallelism.fsdp_reshard_after_forward = "
                    f"{job_config.parallelism.fsdp_reshard_after_forward!r}")
    if features_from_config(job_config).float8_all_gather:
        keys.append("quantize.linear.float8.enable_fsdp_float8_all_gather")
    if not keys:
        return []
    return [f"no effect: {', '.join(keys)} (the plan shards nothing with FSDP, mesh "
            f"{plan.mesh}; set parallelism.data_parallel_shard_degree >= 2 for FSDP)"]


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
