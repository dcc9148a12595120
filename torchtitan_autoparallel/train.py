"""Training entrypoint used by ``run_train.sh``: TorchTitan's Trainer, made to run anywhere.

``python -m torchtitan_autoparallel.train --job.config_file X.toml [overrides]`` behaves like
``python -m torchtitan.train`` and adds: the CPU/gloo runtime when no GPU is present, the
project's config extension and train specs, one-line errors for user mistakes, an optional
per-step metrics file, and a dry-run mode (``--comm.mode fake_backend``) that builds and shards
the model on meta tensors across a fake process group, reports, and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from .built import block_features
from .checks import (
    check_auto_settings,
    check_plan_features,
    check_torchao,
    device_capability,
)
from .config import CONFIG_MODULE
from .errors import UserError, run_cli
from .features import check_device, features_from_config
from .graph.adapters import get_adapter
from .runtime.dry_run import prepare_dry_run


def _with_config_module(argv: list[str]) -> list[str]:
    if any(a.startswith("--job.custom_config_module") for a in argv):
        return argv
    return [*argv, f"--job.custom_config_module={CONFIG_MODULE}"]


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        for key in ("--job.config_file", "--job.config-file"):
            if arg.startswith(key + "="):
                return arg.split("=", 1)[1]
            if arg == key and i + 1 < len(argv):
                return argv[i + 1]
    return None


def _check_toml(path: str) -> None:
    """The config file exists and is TOML (TorchTitan would print a traceback first)."""
    import tomllib

    from .validate import shown

    if not os.path.isfile(path):
        raise UserError(f"config file not found: {shown(path)} (set CONFIG_FILE to an existing "
                        ".toml)")
    try:
        with open(path, "rb") as f:
            tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"config {shown(path)} is not valid TOML: {shown(exc, 200)}; fix the "
                        "file") from exc
    except OSError as exc:
        raise UserError(f"cannot read config {shown(path)}: {exc.strerror}") from exc


def parse_config(argv: list[str]) -> Any:
    """Parse TorchTitan's config (TOML + CLI) with the project's extension merged in."""
    from torchtitan.config import ConfigManager

    from .validate import shown

    path = _config_path(argv)
    if path is not None:
        _check_toml(path)
    try:
        return ConfigManager().parse_args(_with_config_module(argv))
    except SystemExit as exc:  # tyro prints its own message for unknown flags
        raise UserError("invalid command-line override (see the message above)") from exc
    except Exception as exc:  # TOML syntax errors and the like
        raise UserError(f"cannot read config {path}: {shown(exc, 200)}") from exc


# Set by run_train.sh: parse and check the job in one process before torchrun starts the ranks,
# so a user mistake is reported once, as one line, without torchrun's failure report.
PREFLIGHT_ENV = "AUTOPARALLEL_PREFLIGHT"

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve_assets_path(job_config: Any) -> None:
    """Let configs name the project's tokenizer (``./assets/...``) from any working directory."""
    path = job_config.model.hf_assets_path
    if path and not os.path.isabs(path) and not os.path.exists(path):
        candidate = os.path.join(REPO_ROOT, path)
        if os.path.exists(candidate):
            job_config.model.hf_assets_path = candidate


def check_config(job_config: Any, cpu: bool, dry_run: bool) -> None:
    """Reject settings this machine cannot run, naming the fix."""
    from .runtime.cpu import cuda_only_features
    from .validate import check_model_name

    check_model_name(job_config.model.name)
    resolve_assets_path(job_config)
    tokenizer = os.path.join(job_config.model.hf_assets_path, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise UserError(
            f"no tokenizer at {tokenizer}: set model.hf_assets_path to a folder with "
            "tokenizer.json (the project ships ./assets/tokenizer)"
        )

    # conflicting speed features, and features this GPU cannot run, end here: run_train.sh's
    # preflight calls this before torchrun starts any rank
    features = features_from_config(job_config)
    check_torchao(features)
    if cpu and not dry_run:
        problems = cuda_only_features(job_config)
        if problems:
            raise UserError(problems[0])
    if not dry_run:
        check_device(features, device_capability())


def world_size(job_config: Any) -> int:
    """World size of the job: NGPU for dry runs, else WORLD_SIZE set by torchrun."""
    key = "NGPU" if job_config.comm.mode == "fake_backend" else "WORLD_SIZE"
    return int(os.environ.get(key, os.environ.get("WORLD_SIZE", "1")))


def resolve_plan(job_config: Any, world: int) -> Any:
    """The job's plan: the plan file (validated against the job) or a fresh solve."""
    from torchtitan.tools.logging import logger

    from .plan import Plan
    from .planner import fingerprint_diff, job_inputs, plan_job
    from .validate import check_plan_for_job

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
    return plan


PLAN_KEY = "autoparallel/plan"


def shared_plan(job_config: Any, world: int) -> Any:
    """Rank 0 resolves the plan and hands it to the other ranks through torchrun's store, so
    ranks can never run different plans (a time-limited solve, a load-dependent tie or an
    edited file seen half-way could otherwise differ per rank). The store is the launcher's own
    key-value store (``TORCHELASTIC_USE_AGENT_STORE``), not a process group: TorchTitan builds
    those later, from the plan's degrees. A planning error on rank 0 is handed on too, so every
    rank stops with the same line. Without torchrun's store (one process, a dry run) the
    process plans alone; ``apply.check_plan_matches`` still compares the ranks' digests."""
    from datetime import timedelta

    from .plan import Plan

    if (int(os.environ.get("WORLD_SIZE", "1")) == 1
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or job_config.comm.mode == "fake_backend"):
        return resolve_plan(job_config, world)
    import torch.distributed as dist

    timeout = timedelta(seconds=max(1800.0, 20 * job_config.autoparallel.time_limit_s))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    key = f"{PLAN_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            plan = resolve_plan(job_config, world)
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
    training.global_batch_size = plan.global_batch_size
    training.local_batch_size = plan.local_batch_size
    ac = job_config.activation_checkpoint
    if write:
        logger.info(f"activation checkpointing per block from the plan (searched); the "
                    f"configured activation_checkpoint.mode = {ac.mode!r} is what pinned "
                    "blocks run")
    ac.mode = "none"  # TorchTitan's recipe-wide AC is off: apply_plan applies the plan's
    if NAME not in job_config.model.converters:
        job_config.model.converters = [NAME, *job_config.model.converters]
    setattr(job_config, PLAN_ATTR, plan)
    return plan


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _make_trainer_class() -> type:
    from torchtitan.train import Trainer

    class AutoparallelTrainer(Trainer):
        """TorchTitan's Trainer plus an optional per-step JSON-lines metrics file."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            self._last_metrics: dict[str, float] = {}
            self._microbatch = 0
            log = self.metrics_processor.log

            def record(step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any):
                # read the step's memory peaks before TorchTitan's log resets them
                from .runtime.pipeline import last_stage_loss

                peak = self.metrics_processor.device_memory_monitor.get_peak_stats()
                self._last_metrics = {
                    "loss": last_stage_loss(float(loss), self.parallel_dims),
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
            measured = None
            start = time.perf_counter()
            if self.job_config.autoparallel.measure_memory and self.step == 2:
                measured = self._measured_step(data_iterator)
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
                # MemTracker refuses a module called twice (gradient accumulation); its
                # per-module stats restart with each micro-batch, the global peak is kept.
                # Registered before MemTracker's own global hooks, so it runs first.
                if id(module) in roots:
                    tracker.reset_mod_stats()

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


def dry_run_report(trainer: Any) -> str:
    """One paragraph on what a fake-backend dry run built: mesh and per-rank parameter bytes."""
    dims = trainer.parallel_dims
    local_bytes = 0
    for model in trainer.model_parts:
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local_bytes += local.numel() * local.element_size()
    mesh = ", ".join(
        f"{n}={getattr(dims, n)}" for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    )
    report = (
        f"dry run OK: world {dims.world_size} ({mesh}); "
        f"parameters per rank {local_bytes / 2**30:.2f} GiB"
    )
    plan = getattr(trainer.job_config, "_autoparallel_plan", None)
    if plan is not None:
        # fp32 parameters, gradients and two AdamW moments: 4x the sharded parameter bytes
        p = plan.predicted
        report += (
            f"; plan {plan.digest()}: sharded state {4 * local_bytes / 2**30:.2f} GiB "
            f"(predicted {p['state_memory_gib']:.2f} GiB), predicted peak "
            f"{p['peak_memory_gib']:.2f} GiB of budget {p['budget_gib']:.2f} GiB"
        )
    blocks = get_adapter(trainer.job_config.model.name).blocks if plan is not None else "layers"
    features = {}
    for model in trainer.model_parts:
        features.update(block_features(model, blocks))
    report += "\ndry run blocks: " + json.dumps(features, sort_keys=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """Parse, check, build the Trainer and train (or dry-run). Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .runtime import cpu as cpu_runtime
    from .runtime import grad_norm

    cpu = cpu_runtime.install()
    grad_norm.install()
    from torchtitan.tools.logging import init_logger, logger

    from .registry import import_custom_module, make_plannable, register

    init_logger()
    register()
    job_config = parse_config(argv)
    import_custom_module(job_config)  # the user's train spec: model.name is checked against it
    dry_run = job_config.comm.mode == "fake_backend"
    check_config(job_config, cpu, dry_run)
    preflight = os.environ.get(PREFLIGHT_ENV) == "1"
    make_plannable(job_config.model.name)
    if job_config.parallelism.auto or job_config.autoparallel.plan_file:
        prepare_planned_job(job_config, write=preflight or int(os.environ.get("RANK", "0")) == 0)
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
