"""Checks of a job's settings that end it with one line before any rank starts (run_train.sh's
preflight runs them in one process): what the installed torchao and the GPU can run, and the
settings ``auto`` refuses (see docs/settings.md)."""

from __future__ import annotations

from typing import Any

from ...candidates.layout import AC_MODES, GIB
from ...errors import UserError

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

    from ...cost.hardware import Device

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Device(props.name, (props.major, props.minor), props.total_memory / GIB)


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
    if job_config.fault_tolerance.enable:
        raise UserError(
            "fault_tolerance.enable with auto = true: TorchFT's replica groups change what "
            "data_parallel_replicate_degree means, which the planner does not model (and "
            "torchft is not installed here); set fault_tolerance.enable = false or "
            "parallelism.auto = false")
    if job_config.memory_estimation.enable:
        raise UserError(
            "memory_estimation.enable with auto = true: TorchTitan 0.2.2 reads it nowhere; the "
            "plan predicts each device's memory (python -m torchtitan_autoparallel plan / "
            "predict); set memory_estimation.enable = false")
    if job_config.activation_checkpoint.mode not in AC_MODES:
        raise UserError(
            f"activation_checkpoint.mode = {job_config.activation_checkpoint.mode!r} with auto "
            f"= true: the planner chooses AC per block among {list(AC_MODES)}; set one of "
            "those or parallelism.auto = false"
        )


def check_job_keys(job_config: Any) -> None:
    """TorchTitan keys whose values would fail after the ranks started (or be ignored): any
    job, planned or not."""
    import torchtitan.components.quantization  # noqa: F401  (registers TorchTitan's converters)
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    from ...errors import shown
    from .data import DATASET_NAMES

    known = sorted(_registry_model_converter_cls)
    for name in job_config.model.converters or []:
        if name not in known:
            raise UserError(f"model.converters has {shown(name)}, which is no registered "
                            f"converter: use some of {known}")
    val, seq = job_config.validation, job_config.training.seq_len
    if val.enable and val.seq_len > seq:
        raise UserError(f"validation.seq_len = {val.seq_len} exceeds training.seq_len = {seq}: "
                        "TorchTitan sizes the model's RoPE cache to training.seq_len; set "
                        f"validation.seq_len <= {seq}")
    if job_config.optimizer.name not in OPTIMIZERS:
        raise UserError(f"optimizer.name = {shown(job_config.optimizer.name)}: TorchTitan "
                        f"0.2.2 builds {list(OPTIMIZERS)}; use one of them")
    if job_config.training.dataset in DATASET_NAMES:
        from torchtitan.config.job_config import DataLoader

        default = DataLoader()
        for key in ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor"):
            value = getattr(job_config.training.dataloader, key)
            if value != getattr(default, key):
                raise UserError(
                    f"training.dataloader.{key} = {shown(value)}: dataset "
                    f"{job_config.training.dataset!r} is an in-memory token stream without "
                    "worker processes, so it reads no dataloader setting; remove it")


OPTIMIZERS = ("Adam", "AdamW")
"""What TorchTitan 0.2.2's ``build_optimizers`` builds (the planner costs AdamW's state)."""


def check_plan_features(job_config: Any, plan: Any) -> None:
    """Features the chosen plan cannot apply."""
    from ...plan.schema import plan_shards_with_fsdp

    val = job_config.validation
    if val.enable and plan.mesh.pp > 1 and (
            val.local_batch_size != plan.local_batch_size
            or val.seq_len != job_config.training.seq_len):
        raise UserError(
            f"validation.enable with pipeline_parallel_degree = {plan.mesh.pp}: TorchTitan's "
            f"validator runs the training's pipeline schedule, so validation batches need the "
            f"training's shape: set validation.local_batch_size = {plan.local_batch_size} (the "
            f"plan's) and validation.seq_len = {job_config.training.seq_len}, or "
            "pipeline_parallel_degree = 1")

    if job_config.training.enable_cpu_offload and not plan_shards_with_fsdp(plan):
        raise UserError(
            f"training.enable_cpu_offload is FSDP's CPU offload, but the plan shards nothing "
            f"with FSDP (mesh {plan.mesh}): set parallelism.data_parallel_shard_degree >= 2 "
            "or turn CPU offload off"
        )
