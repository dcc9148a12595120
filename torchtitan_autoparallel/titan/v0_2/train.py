"""TorchTitan 0.2.2's training entrypoint used by ``run_train.sh``: TorchTitan's Trainer, made to
run anywhere.

``python -m torchtitan_autoparallel.titan.v0_2.train --job.config_file X.toml [overrides]``
behaves like ``python -m torchtitan.train`` and adds: the CPU/gloo runtime when no GPU is
present, the project's config extension and train specs, one-line errors for user mistakes, an
optional per-step metrics file, and a dry-run mode (``--comm.mode fake_backend``) that builds and
shards the model on meta tensors across a fake process group, reports, and exits.

A planned job: the plan resolved once and shared by every rank (``launch.plan_from_rank0``),
and the job TorchTitan runs made to follow it (``prepare_planned_job``: mesh degrees, local
batch, float8 filter, the ``autoparallel`` converter), as 0.3.0's ``train.py`` does.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ...errors import UserError, run_cli
from ...job.explicit import user_set
from ...launch import plan_from_rank0, resolve_plan
from .checks import check_auto_settings, check_plan_features
from .job import check_config, parse_config
from .patches.dry_run import dry_run_report, prepare_dry_run

# Set by run_train.sh: parse and check the job in one process before torchrun starts the ranks,
# so a user mistake is reported once, as one line, without torchrun's failure report.
PREFLIGHT_ENV = "AUTOPARALLEL_PREFLIGHT"


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


def _make_trainer_class() -> type:
    from torchtitan.train import Trainer

    from ...runtime.step_metrics import record_logged_metrics, recorded_step
    from .patches.pipeline import drop_loss_visibility_warning

    drop_loss_visibility_warning()

    class AutoparallelTrainer(Trainer):
        """TorchTitan's Trainer plus an optional per-step JSON-lines metrics file."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            from .patches import early_step

            early_step.install(self.model_parts, job_config)
            self._microbatch = 0
            from .patches.pipeline import last_stage_loss

            # under PP only the last stage holds the loss (the others a negative placeholder,
            # summed over data parallel): every rank logs the real one
            record_logged_metrics(self, lambda loss: last_stage_loss(loss, self.parallel_dims))

        def forward_backward_step(self, *args: Any, **kwargs: Any) -> Any:
            from .apply import sync_replicas_on_last_microbatch
            from .converter import job_plan

            plan = job_plan(self.job_config)
            if plan is not None:
                sync_replicas_on_last_microbatch(self.model_parts, plan, self._microbatch)
            self._microbatch += 1
            if self.parallel_dims.pp_enabled:
                from .patches.pipeline import pipeline_step

                return pipeline_step(self, super().forward_backward_step, **kwargs)
            return super().forward_backward_step(*args, **kwargs)

        def train_step(self, data_iterator: Any) -> None:
            self._microbatch = 0
            recorded_step(self, super().train_step, data_iterator,
                          self.job_config.autoparallel, self.job_config.training)

    return AutoparallelTrainer


def main(argv: list[str] | None = None) -> int:
    """Parse, check, build the Trainer and train (or dry-run). Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from . import cpu as cpu_runtime
    from .patches import grad_norm

    cpu = cpu_runtime.install()
    from torchtitan.tools.logging import init_logger, logger

    from .registry import HF_BACKEND, import_custom_module, make_plannable, register

    init_logger()
    register()
    job_config = parse_config(argv)
    import_custom_module(job_config)  # the user's train spec: model.name is checked against it
    dry_run = job_config.comm.mode == "fake_backend"
    check_config(job_config, cpu, dry_run)
    preflight = os.environ.get(PREFLIGHT_ENV) == "1"
    plan = None
    make_plannable(job_config.model.name)
    if job_config.model.name == HF_BACKEND:  # before any rank builds it
        from .hf_check import check_hf_job

        check_hf_job(job_config)
    if job_config.parallelism.auto or job_config.autoparallel.plan_file:
        plan = prepare_planned_job(job_config,
                                   write=preflight or int(os.environ.get("RANK", "0")) == 0)
        if cpu and not dry_run:
            cpu_runtime.check_cpu_plan(job_config, plan)
    if grad_norm.needed(plan):
        grad_norm.install()
    if preflight:
        logger.info("preflight OK: config parsed and checked")
        return 0
    if dry_run:
        prepare_dry_run(job_config)

    import torch

    trainer = _make_trainer_class()(job_config)
    try:
        if dry_run:
            logger.info(dry_run_report(trainer))
            return 0
        if job_config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1 or not job_config.checkpoint.enable:
                raise UserError(
                    "create_seed_checkpoint needs NGPU=1 and --checkpoint.enable"
                )
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
            return 0
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        # leave together: a rank tearing down gloo while a peer still uses it can abort
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def _exit_now(code: int) -> None:
    """Flush and leave without running C++ static destructors: on CPU, tearing down gloo's
    threads at interpreter exit intermittently aborts a finished rank ("terminate called without
    an active exception", SIGABRT) after all its work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        exit_code = run_cli(main)
    except BaseException:
        import traceback

        traceback.print_exc()
        exit_code = 1
    _exit_now(exit_code)
