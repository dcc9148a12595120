"""A planned job at launch: the plan resolved once (plan file or solve) and shared by every rank
through torchrun's store, and the job TorchTitan runs made to follow it (mesh degrees, local
batch, float8 filter, the ``autoparallel`` converter)."""

from __future__ import annotations

import os
from typing import Any

from .checks import check_auto_settings, check_plan_features
from .errors import UserError, shown
from .explicit import user_set


def world_size(job_config: Any) -> int:
    """World size of the job: NGPU for dry runs, else WORLD_SIZE set by torchrun."""
    key = "NGPU" if job_config.comm.mode == "fake_backend" else "WORLD_SIZE"
    return int(os.environ.get(key, os.environ.get("WORLD_SIZE", "1")))


def resolve_plan(job_config: Any, world: int) -> Any:
    """The job's plan: the plan file (validated against the job) or a fresh solve."""
    import json

    from torchtitan.tools.logging import logger

    from .assembly import inputs_record
    from .plan import Plan, check_plan_for_job
    from .planner import plan_job
    from .planning_inputs import fingerprint_diff, job_inputs
    from .recost import recosted_file

    ap = job_config.autoparallel
    if not ap.plan_file:
        return plan_job(job_config, world)
    plan = Plan.load(ap.plan_file)
    inputs = job_inputs(job_config, world, dp=plan.mesh.dp)
    job_fp = inputs.fingerprint
    diff = fingerprint_diff(plan.fingerprint, job_fp)
    if diff:
        raise UserError(
            f"plan {ap.plan_file} was made for another job ({'; '.join(diff)}); re-plan "
            "(drop autoparallel.plan_file) or run the job the plan was made for"
        )
    check_plan_for_job(plan, world, [(layer.fqn, layer.kind) for layer in inputs.graph.layers],
                       ap.plan_file)
    if plan.fingerprint.get("versions") != job_fp["versions"]:
        logger.warning(f"plan {ap.plan_file} was made with {plan.fingerprint.get('versions')}"
                       f", this job runs {job_fp['versions']}")
    plan, note = recosted_file(plan)  # the stored inputs checked by their rules first
    if plan.inputs is not None:
        diff = record_diff(plan.inputs, json.loads(json.dumps(inputs_record(inputs))))
        if diff:
            raise UserError(f"plan {ap.plan_file} stores planning inputs that are not the "
                            f"job's ({'; '.join(diff[:3])}); re-plan (drop "
                            "autoparallel.plan_file) or run the job the plan was made for")
    if note:
        logger.warning(f"plan {ap.plan_file}: {note}")
    return plan


def record_diff(plan: Any, job: Any, prefix: str = "") -> list[str]:
    """Readable differences ``key: plan -> job`` between two stored-inputs records."""
    if isinstance(plan, dict) and isinstance(job, dict):
        return [line for key in sorted(set(plan) | set(job))
                for line in record_diff(plan.get(key), job.get(key), f"{prefix}{key}.")]
    if plan == job:
        return []
    return [f"{prefix.rstrip('.')}: plan {shown(plan, 60)} -> job {shown(job, 60)}"]


PLAN_KEY = "autoparallel/plan"


def shared_plan(job_config: Any, world: int) -> Any:
    """Rank 0 resolves the plan and hands it to the other ranks through torchrun's store, so
    ranks can never run different plans (a time-limited solve, a load-dependent tie or an
    edited file seen half-way could otherwise differ per rank). The store is the launcher's own
    key-value store (``TORCHELASTIC_USE_AGENT_STORE``), not a process group: TorchTitan builds
    those later, from the plan's degrees. A planning error on rank 0 is handed on too, so every
    rank stops with the same line. Without torchrun's store (one process, a dry run) the
    process plans alone; ``apply.check_plan_matches`` still compares the ranks' digests."""
    return plan_from_rank0(lambda: resolve_plan(job_config, world),
                           job_config.autoparallel.time_limit_s,
                           alone=job_config.comm.mode == "fake_backend")


def plan_from_rank0(resolve: Any, time_limit_s: float, alone: bool = False) -> Any:
    """``resolve()`` on rank 0, its plan (or its UserError) handed to the other ranks through
    torchrun's store (see ``shared_plan``); every process resolves alone when ``alone``, in one
    process, or without torchrun's store."""
    import json
    from datetime import timedelta

    from .plan import Plan

    if (alone or int(os.environ.get("WORLD_SIZE", "1")) == 1
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"):
        return resolve()
    import torch.distributed as dist

    timeout = timedelta(seconds=max(1800.0, 20 * time_limit_s))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    key = f"{PLAN_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            plan = resolve()
        except UserError as exc:
            store.set(key, json.dumps({"error": str(exc)}))
            raise
        store.set(key, plan.to_json())
        return plan
    data = json.loads(store.get(key))
    if "error" in data:
        raise UserError(data["error"])
    return Plan.from_dict(data, "received from rank 0")


def prepare_planned_job(job_config: Any, write: bool) -> Any:
    """Plan (or load the plan file), then make the job TorchTitan runs follow the plan: mesh
    degrees, local batch size, and the ``autoparallel`` converter that applies it. Everything
    is validated before the plan is saved or applied."""
    from torchtitan.tools.logging import logger

    from .converter import NAME, PLAN_ATTR

    ap = job_config.autoparallel
    check_auto_settings(job_config)
    plan = shared_plan(job_config, world_size(job_config))
    check_plan_features(job_config, plan)
    if write:
        logger.info("\n" + plan.table())
        if ap.save_plan:
            plan.save(ap.save_plan)
            logger.info(f"plan written to {ap.save_plan}")
    par, training = job_config.parallelism, job_config.training
    par.data_parallel_replicate_degree = plan.mesh.dp_replicate
    par.data_parallel_shard_degree = plan.mesh.dp_shard
    par.tensor_parallel_degree = plan.mesh.tp
    par.context_parallel_degree = plan.mesh.cp
    par.expert_parallel_degree = plan.mesh.ep
    par.expert_tensor_parallel_degree = plan.mesh.etp
    par.pipeline_parallel_degree = plan.mesh.pp
    if plan.pipeline is not None:
        # TorchTitan's pipeline_llm builds the planned stages with the planned schedule
        par.pipeline_parallel_schedule = plan.pipeline.schedule
        par.pipeline_parallel_microbatch_size = plan.pipeline.microbatch_size
        par.module_fqns_per_model_part = [list(stage) for stage in plan.pipeline.stages]
        par.pipeline_parallel_layers_per_stage = None
    training.global_batch_size = plan.global_batch_size
    training.local_batch_size = plan.local_batch_size
    if plan.float8_filter_fqns is not None:
        # the linears the plan keeps in bf16: TorchTitan's float8 converter skips them
        job_config.quantize.linear.float8.filter_fqns = list(plan.float8_filter_fqns)
    ac = job_config.activation_checkpoint
    if write:
        how = (f"activation_checkpoint.mode = {ac.mode!r} on every block"
               if user_set(job_config, "activation_checkpoint.mode") else "searched per block")
        logger.info(f"activation checkpointing from the plan ({how}); TorchTitan's "
                    f"activation_checkpoint settings (mode {ac.mode!r}) are what pinned blocks "
                    "run")
    ac.mode = "none"  # TorchTitan's recipe-wide AC is off: apply_plan applies the plan's
    if NAME not in job_config.model.converters:
        job_config.model.converters = [NAME, *job_config.model.converters]
    setattr(job_config, PLAN_ATTR, plan)
    return plan
