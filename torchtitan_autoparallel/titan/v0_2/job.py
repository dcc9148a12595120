"""The TorchTitan job config with the project's extension: parse it (CLI, tests and
experiments use ``parse_config``) and check what this machine cannot run (``launch.py`` makes
a planned job follow its plan)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from ...errors import UserError
from ...job.explicit import record_explicit
from ...job.features import check_device, features_from_config
from .. import ASSETS
from .checks import (
    check_job_keys,
    check_torchao,
    device,
    device_capability,
)


def _config_manager() -> Any:
    """TorchTitan's ConfigManager over its JobConfig with the project's sections already merged
    in, so the ``job.custom_config_module`` a user names (CLI or TOML, e.g. the HF backend's
    ``[hf_transformers]``) is merged on top of both instead of replacing the project's."""
    from torchtitan.config import ConfigManager, JobConfig

    from ...job.config import JobConfig as Extension

    return ConfigManager(ConfigManager._merge_configs(JobConfig, Extension))


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        for key in ("--job.config_file", "--job.config-file"):
            if arg.startswith(key + "="):
                return arg.split("=", 1)[1]
            if arg == key and i + 1 < len(argv):
                return argv[i + 1]
    return None


def read_toml(path: str) -> dict[str, Any]:
    """The config file's data; one line if it is missing or not TOML (TorchTitan would print a
    traceback first)."""
    from ...errors import read_input, shown, tomllib

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
    import io

    from ...errors import shown
    from ...job.arguments import bool_value_hint, joined_lists

    argv = joined_lists(argv)
    path = _config_path(argv)
    toml = read_toml(path) if path is not None else {}
    check_toml_booleans(toml)
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage), _without_assets_warning():
            job = _config_manager().parse_args(argv)
    except SystemExit as exc:  # tyro's usage error (a box on stderr): one line instead
        if bool_value_hint(argv):
            raise UserError(bool_value_hint(argv)) from exc
        message = tyro_message(usage.getvalue())
        raise UserError("invalid command-line override" + (f": {message}" if message else "")
                        ) from exc
    except Exception as exc:  # TOML syntax errors and the like
        raise UserError(f"cannot read config {path}: {shown(exc, 200)}") from exc
    sys.stderr.write(usage.getvalue())
    record_explicit(job, toml, argv)
    return job


def check_toml_booleans(toml: dict[str, Any]) -> None:
    """The project's boolean keys in a TOML config (``[parallelism] auto``,
    ``[autoparallel] measure_memory``) are booleans: TorchTitan's parser reads a string there
    as a flag missing its value."""
    import dataclasses

    from ...errors import Rule, check_value
    from ...job.config import Autoparallel, Parallelism

    for section, cls in (("parallelism", Parallelism), ("autoparallel", Autoparallel)):
        values = toml.get(section)
        for f in dataclasses.fields(cls):
            if f.type is bool and isinstance(values, dict) and f.name in values:
                check_value(f"{section}.", f.name, values[f.name], Rule(bool),
                            f"write {f.name} = true or {f.name} = false (no quotes)")


@contextlib.contextmanager
def _without_assets_warning() -> Iterator[None]:
    """TorchTitan's ConfigManager warns "HF assets path ... does not exist!" for a relative
    ``model.hf_assets_path`` read outside the checkout; ``resolve_assets_path`` then finds the
    package's assets, and ``check_config`` names a tokenizer that is really missing."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("HF assets path ")

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


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


def resolve_assets_path(job_config: Any) -> None:
    """Let configs name the package's tokenizer (``./assets/...``) from any working directory."""
    path = job_config.model.hf_assets_path
    if path and not os.path.isabs(path) and not os.path.exists(path):
        candidate = os.path.join(os.path.dirname(ASSETS), path)
        if os.path.exists(candidate):
            job_config.model.hf_assets_path = candidate


def check_config(job_config: Any, cpu: bool, dry_run: bool) -> None:
    """Reject settings this machine cannot run, naming the fix."""
    from ...job.validate import check_model_name, check_training
    from ...launch import check_plan_outputs
    from .cpu import cuda_only_features

    check_model_name(job_config.model.name)
    check_training(job_config.training)
    check_plan_outputs(job_config.autoparallel,
                       job_config.parallelism.auto or bool(job_config.autoparallel.plan_file))
    resolve_assets_path(job_config)
    tokenizer = os.path.join(job_config.model.hf_assets_path, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise UserError(
            f"no tokenizer at {tokenizer}: set model.hf_assets_path to a folder with "
            "tokenizer.json (the package ships ./assets/tokenizer)"
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

        from ...cost.hardware import profile_for_device

        found = None if dry_run else device()
        ap.hardware = profile_for_device(found)
        logger.info(f"hardware profile {ap.hardware!r}"
                    + (f" for {found.name}" if found else " (no GPU)"))
