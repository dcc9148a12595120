"""Checks of a job's settings that end it with one line before any rank starts (run_train.sh's
preflight runs them in one process): what the installed torchao and the GPU can run, and the
settings ``auto`` refuses (see the README's settings table)."""

from __future__ import annotations

from typing import Any

from .errors import UserError
from .layout import AC_MODES

# What TorchTitan 0.2.2's quantization converters import from torchao, per feature: torchao
# 0.18.0 no longer has the MX linear config nor the MoE training config those converters use.
TORCHAO_NEEDS = {
    "float8": ("torchao.float8", "Float8LinearConfig", "quantize.linear.float8"),
    "mx": ("torchao.prototype.mx_formats.config", "MXLinearConfig", "quantize.linear.mx"),
    "grouped": ("torchao.prototype.moe_training.conversion_utils", "MoETrainingConfig",
                "quantize.grouped_mm.*"),
}


def check_torchao(features: Any) -> None:
    """Refuse a quantization converter whose torchao API the installed torchao lacks (TorchTitan
    would fail with an ImportError after the ranks started)."""
    import importlib
    import importlib.util

    wanted = [key for key, on in (("float8", features.float8), ("mx", features.linear == "mx"),
                                  ("grouped", features.grouped_mm != "none")) if on]
    for key in wanted:
        module, name, converter = TORCHAO_NEEDS[key]
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            version = getattr(importlib.import_module("torchao"), "__version__", "?") \
                if importlib.util.find_spec("torchao") else "not installed"
            raise UserError(f"model.converters has {converter}, whose TorchTitan 0.2.2 converter "
                            f"needs {module}.{name}, missing from torchao ({version}): install "
                            "a torchao that has it or remove the converter")


def device_capability() -> tuple[int, int] | None:
    """CUDA compute capability of this machine's GPU, None without one."""
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def device() -> Any:
    """What CUDA reports of this machine's first GPU (``cost.hardware.Device``), None without
    one."""
    import torch

    from .cost.hardware import Device

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Device(props.name, (props.major, props.minor), props.total_memory / 2**30)


def check_auto_settings(job_config: Any) -> None:
    """Settings a planned job cannot honour, refused before planning."""
    if job_config.parallelism.expert_parallel_comm_backend != "standard":
        raise UserError(
            f"parallelism.expert_parallel_comm_backend = "
            f"{job_config.parallelism.expert_parallel_comm_backend!r} with auto = true: plans "
            "apply TorchTitan's standard all-to-all; set it to \"standard\" or "
            "parallelism.auto = false"
        )
    if job_config.training.dtype != "float32":
        raise UserError(
            f"training.dtype = {job_config.training.dtype!r} with auto = true: the planner "
            "costs float32 parameters, gradients and optimizer state; set training.dtype = "
            "\"float32\" (mixed_precision_param = \"bfloat16\" computes in bf16) or "
            "parallelism.auto = false"
        )
    if job_config.activation_checkpoint.mode not in AC_MODES:
        raise UserError(
            f"activation_checkpoint.mode = {job_config.activation_checkpoint.mode!r} with auto "
            f"= true: the planner chooses AC per block among {list(AC_MODES)}; set one of "
            "those or parallelism.auto = false"
        )


def check_plan_features(job_config: Any, plan: Any) -> None:
    """Features the chosen plan cannot apply."""
    from .apply import plan_shards_with_fsdp

    if job_config.training.enable_cpu_offload and not plan_shards_with_fsdp(plan):
        raise UserError(
            f"training.enable_cpu_offload is FSDP's CPU offload, but the plan shards nothing "
            f"with FSDP (mesh {plan.mesh}): set parallelism.data_parallel_shard_degree >= 2 "
            "or turn CPU offload off"
        )
