"""A planned TorchTitan 0.2.2 job at launch: the plan resolved once and shared by every rank
(``launch.plan_from_rank0``), and the job TorchTitan runs made to follow it (mesh degrees, local
batch, float8 filter, the ``autoparallel`` converter)."""

from __future__ import annotations

import os
from typing import Any

from ...job.explicit import user_set
from ...launch import plan_from_rank0, resolve_plan
from .checks import check_auto_settings, check_plan_features


def world_size(job_config: Any) -> int:
    """World size of the job: NGPU for dry runs, else WORLD_SIZE set by torchrun."""
    key = "NGPU" if job_config.comm.mode == "fake_backend" else "WORLD_SIZE"
    return int(os.environ.get(key, os.environ.get("WORLD_SIZE", "1")))


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
