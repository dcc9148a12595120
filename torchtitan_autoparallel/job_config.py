"""The TorchTitan job config with the project's extension: parse it (CLI, tests and
experiments use ``parse_config``), check what this machine cannot run, and make a planned job
follow its plan (mesh degrees, local batch, the ``autoparallel`` converter)."""

from __future__ import annotations

import os
import sys
from typing import Any

from .checks import (
    check_auto_settings,
    check_job_keys,
    check_plan_features,
    check_torchao,
    device,
    device_capability,
)
from .errors import UserError
from .explicit import record_explicit, user_set
from .features import check_device, features_from_config


def _config_manager() -> Any:
    """TorchTitan's ConfigManager over its JobConfig with the project's sections already merged
    in, so the ``job.custom_config_module`` a user names (CLI or TOML, e.g. the HF backend's
    ``[hf_transformers]``) is merged on top of both instead of replacing the project's."""
    from torchtitan.config import ConfigManager, JobConfig

    from .config import JobConfig as Extension

    return ConfigManager(ConfigManager._merge_configs(JobConfig, Extension))


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        for key in ("--job.config_file", "--job.config-file"):
            if arg.startswith(key + "="):
                return arg.split("=", 1)[1]
            if arg == key and i + 1 < len(argv):
                return argv[i + 1]
    return None


def _check_toml(path: str) -> dict[str, Any]:
    """The config file's data; one line if it is missing or not TOML (TorchTitan would print a
    traceback first)."""
    import tomllib

    from .errors import read_input, shown

    if not os.path.exists(path):
        raise UserError(f"config file not found: {shown(path)} (set CONFIG_FILE to an existing "
                        ".toml)")
    raw = read_input(path, "config")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"config {shown(path)} is not valid TOML: {shown(exc, 200)}; fix the "
                        "file") from exc


def parse_config(argv: list[str]) -> Any:
    """Parse TorchTitan's config (TOML + CLI) with the project's extension merged in; the keys
    the TOML file or the command line set are recorded (``explicit_keys``)."""
    import contextlib
    import io

    from .errors import shown

    path = _config_path(argv)
    toml = _check_toml(path) if path is not None else {}
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            job = _config_manager().parse_args(argv)
    except SystemExit as exc:  # tyro's usage error (a box on stderr): one line instead
        message = tyro_message(usage.getvalue())
        raise UserError("invalid command-line override" + (f": {message}" if message else "")
                        ) from exc
    except Exception as exc:  # TOML syntax errors and the like
        raise UserError(f"cannot read config {path}: {shown(exc, 200)}") from exc
    sys.stderr.write(usage.getvalue())
    record_explicit(job, toml, argv)
    return job


def tyro_message(text: str, limit: int = 400) -> str:
    """The text of tyro's usage error (boxed on a terminal, plain otherwise) on one line: its
    title, rules and help hint dropped, cut to ``limit`` characters."""
    lines = [raw.strip().strip("│").strip() for raw in text.splitlines()]
    lines = [line for line in lines if line][1:]  # the first is the title
    parts = []
    for line in lines:
        if line.startswith("For full helptext"):
            break  # the last part (it may wrap)
        if line[0] in "╭╰" or set(line) <= set("─- "):
            continue
        parts.append(" ".join(line.split()))
    message = " ".join(parts)
    return message if len(message) <= limit else message[: limit - 3] + "..."


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
    check_job_keys(job_config)
    features = features_from_config(job_config)
    check_torchao(features)
    if cpu and not dry_run:
        problems = cuda_only_features(job_config)
        if problems:
            raise UserError(problems[0])
    if not dry_run:
        check_device(features, device_capability())
    ap = getattr(job_config, "autoparallel", None)
    if ap is not None and not ap.hardware:
        # the job's own device picks the profile (a GPU no profile names stops here)
        from torchtitan.tools.logging import logger

        from .cost.hardware import profile_for_device

        found = None if dry_run else device()
        ap.hardware = profile_for_device(found)
        logger.info(f"hardware profile {ap.hardware!r}"
                    + (f" for {found.name}" if found else " (no GPU)"))


def world_size(job_config: Any) -> int:
    """World size of the job: NGPU for dry runs, else WORLD_SIZE set by torchrun."""
    key = "NGPU" if job_config.comm.mode == "fake_backend" else "WORLD_SIZE"
    return int(os.environ.get(key, os.environ.get("WORLD_SIZE", "1")))


def resolve_plan(job_config: Any, world: int) -> Any:
    """The job's plan: the plan file (validated against the job) or a fresh solve."""
    from torchtitan.tools.logging import logger

    from .plan import Plan, check_plan_for_job
    from .planner import fingerprint_diff, job_inputs, plan_job, recosted_file

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
    plan, note = recosted_file(plan)
    if note:
        logger.warning(f"plan {ap.plan_file}: {note}")
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
    import json
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
