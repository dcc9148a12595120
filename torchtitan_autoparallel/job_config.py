"""The TorchTitan job config with the project's extension: parse it (CLI, tests and
experiments use ``parse_config``), check what this machine cannot run, and make a planned job
follow its plan (mesh degrees, local batch, the ``autoparallel`` converter)."""

from __future__ import annotations

import os
from typing import Any

from .checks import (
    check_auto_settings,
    check_plan_features,
    check_torchao,
    device_capability,
)
from .config import CONFIG_MODULE
from .errors import UserError
from .features import check_device, features_from_config


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


def parse_config(argv: list[str]) -> Any:
    """Parse TorchTitan's config (TOML + CLI) with the project's extension merged in."""
    from torchtitan.config import ConfigManager

    path = _config_path(argv)
    if path is not None and not os.path.isfile(path):
        raise UserError(f"config file not found: {path} (set CONFIG_FILE to an existing .toml)")
    try:
        return ConfigManager().parse_args(_with_config_module(argv))
    except SystemExit as exc:  # tyro prints its own message for unknown flags
        raise UserError("invalid command-line override (see the message above)") from exc
    except Exception as exc:  # TOML syntax errors and the like
        raise UserError(f"cannot read config {path}: {exc}") from exc


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


def prepare_planned_job(job_config: Any, write: bool) -> Any:
    """Plan (or load the plan file), then make the job TorchTitan runs follow the plan: mesh
    degrees, local batch size, and the ``autoparallel`` converter that applies it."""
    from torchtitan.tools.logging import logger

    from .converter import NAME, PLAN_ATTR
    from .plan import Plan
    from .planner import fingerprint_diff, job_inputs, plan_job

    world = world_size(job_config)
    ap = job_config.autoparallel
    check_auto_settings(job_config)
    if ap.plan_file:
        plan = Plan.load(ap.plan_file)
        job_fp = job_inputs(job_config, world).fingerprint
        diff = fingerprint_diff(plan.fingerprint, job_fp)
        if diff:
            raise UserError(
                f"plan {ap.plan_file} was made for another job ({'; '.join(diff)}); re-plan "
                "(drop autoparallel.plan_file) or run the job the plan was made for"
            )
        if plan.fingerprint.get("versions") != job_fp["versions"]:
            logger.warning(f"plan {ap.plan_file} was made with {plan.fingerprint.get('versions')}"
                           f", this job runs {job_fp['versions']}")
    else:
        plan = plan_job(job_config, world)
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
