"""TorchTitan 0.2.2's training entrypoint used by ``run_train.sh``: TorchTitan's Trainer, made to
run anywhere.

``python -m torchtitan_autoparallel.titan.v0_2.train --job.config_file X.toml [overrides]``
behaves like ``python -m torchtitan.train`` and adds: the CPU/gloo runtime when no GPU is
present, the project's config extension and train specs, one-line errors for user mistakes, an
optional per-step metrics file, and a dry-run mode (``--comm.mode fake_backend``) that builds and
shards the model on meta tensors across a fake process group, reports, and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from ...errors import UserError, run_cli
from .job_config import check_config, parse_config
from .launch import prepare_planned_job
from .runtime.dry_run import dry_run_report, prepare_dry_run

# Set by run_train.sh: parse and check the job in one process before torchrun starts the ranks,
# so a user mistake is reported once, as one line, without torchrun's failure report.
PREFLIGHT_ENV = "AUTOPARALLEL_PREFLIGHT"


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _gathered(value: float) -> list[float]:
    """``value`` from every rank, by global rank (one rank: just it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _make_trainer_class() -> type:
    from torchtitan.train import Trainer

    from .runtime.pipeline import drop_loss_visibility_warning

    drop_loss_visibility_warning()

    class AutoparallelTrainer(Trainer):
        """TorchTitan's Trainer plus an optional per-step JSON-lines metrics file."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            from .runtime import early_step

            early_step.install(self.model_parts, job_config)
            self._last_metrics: dict[str, float] = {}
            self._microbatch = 0
            log = self.metrics_processor.log

            def record(step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any):
                # read the step's memory peaks before TorchTitan's log resets them
                from .runtime.pipeline import last_stage_loss

                # under PP only the last stage holds the loss (the others a negative
                # placeholder, summed over data parallel): every rank logs the real one
                loss = last_stage_loss(float(loss), self.parallel_dims)
                max_loss = last_stage_loss(float(max_loss), self.parallel_dims)
                peak = self.metrics_processor.device_memory_monitor.get_peak_stats()
                self._last_metrics = {
                    "loss": loss,
                    "grad_norm": float(grad_norm),
                    "peak_memory_gib": peak.max_reserved_gib,
                    # bytes held by tensors (torch.cuda.max_memory_allocated on GPUs)
                    "peak_active_gib": peak.max_active_gib,
                }
                return log(step, loss, max_loss, grad_norm, **kw)

            self.metrics_processor.log = record

        def forward_backward_step(self, *args: Any, **kwargs: Any) -> Any:
            from .apply import sync_replicas_on_last_microbatch
            from .converter import job_plan

            plan = job_plan(self.job_config)
            if plan is not None:
                sync_replicas_on_last_microbatch(self.model_parts, plan, self._microbatch)
            self._microbatch += 1
            if self.parallel_dims.pp_enabled:
                from .runtime.pipeline import pipeline_step

                return pipeline_step(self, super().forward_backward_step, **kwargs)
            return super().forward_backward_step(*args, **kwargs)

        def train_step(self, data_iterator: Any) -> None:
            self._microbatch = 0
            measured, by_rank = None, []
            start = time.perf_counter()
            if self.job_config.autoparallel.measure_memory and self.step == 2:
                measured = self._measured_step(data_iterator)
                by_rank = _gathered(measured["Total"])
            else:
                super().train_step(data_iterator)
            elapsed = time.perf_counter() - start
            path = self.job_config.autoparallel.metrics_file
            if not path or int(os.environ.get("RANK", "0")) != 0:
                return
            training = self.job_config.training
            tokens = training.seq_len * self.gradient_accumulation_steps * (
                training.local_batch_size * self._batch_degree()
            )
            # loss, grad norm and memory exist on TorchTitan's log steps only (metrics.log_freq):
            # other steps' rows carry the step time alone, never a previous step's loss
            metrics, self._last_metrics = self._last_metrics, {}
            row = {
                "step": self.step,
                **metrics,
                "step_time_s": elapsed,
                "tokens_per_s": tokens / elapsed,
                # graphs torch.compile has produced in this process so far (0: nothing compiled)
                "compiled_graphs": _compiled_graphs(),
            }
            if measured is not None:
                row["measured_tensor_peak_gib"] = measured["Total"]
                row["measured_tensor_peak_by_kind_gib"] = measured
                # every rank's peak, by global rank (pp ranks differ under pipelining)
                row["measured_tensor_peak_by_rank_gib"] = by_rank
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

        def _measured_step(self, data_iterator: Any) -> dict[str, float]:
            """Run one step under MemTracker; this rank's peak tensor memory (GiB) by kind."""
            from torch.distributed._tools.mem_tracker import MemTracker
            from torch.nn.modules.module import register_module_forward_pre_hook

            tracker = MemTracker()
            # the container is not an Optimizer: hand MemTracker the torch optimizers inside
            tracker.track_external(*self.model_parts, *self.optimizers.optimizers)
            roots = {id(m) for m in self.model_parts}

            def new_microbatch(module: Any, args: Any) -> None:
                # MemTracker refuses a root module called twice (gradient accumulation, pipeline
                # micro-batches): the root's own stats restart with each micro-batch (its
                # blocks' are kept for backwards still to run), the global peak is kept.
                # Registered before MemTracker's own global hooks, so it runs first.
                if id(module) in roots and module in tracker.memory_tracking:
                    del tracker.memory_tracking[module]

            handle = register_module_forward_pre_hook(new_microbatch)
            try:
                with tracker:
                    super().train_step(data_iterator)
            finally:
                handle.remove()
            peak = max(tracker.get_tracker_snapshot("peak").values(), key=lambda d: d["Total"])
            return {str(getattr(k, "value", k)): v / 2**30 for k, v in peak.items()}

        def _batch_degree(self) -> int:
            dims = self.parallel_dims
            return dims.get_mesh("batch").size() if dims.dp_enabled else 1

    return AutoparallelTrainer


def main(argv: list[str] | None = None) -> int:
    """Parse, check, build the Trainer and train (or dry-run). Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .runtime import cpu as cpu_runtime
    from .runtime import grad_norm

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
