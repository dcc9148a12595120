"""Dry runs on a fake process group (``comm.mode = "fake_backend"``).

Upstream TorchTitan's fake backend still materialises the sharded model on the accelerator (or
"cuda" on a CPU box), which does not fit 405B/671B shards on one host and runs real kernels.
A dry run here keeps every parameter on the meta device: TorchTitan's Trainer reads
``torchtitan.tools.utils.device_type`` for the device it initialises weights on, so it is set to
"meta" for the dry-run process only. Kernels that only accelerate compute (float8, compile,
async TP) are switched off with a warning: they do not change how the model is sharded.
Autocast (TorchTitan's mixed precision without FSDP: DDP or one device) has no meta backend; it
is skipped, as the dry run runs no kernels.
Tested by tests/test_dry_run.py.
"""

from __future__ import annotations

from typing import Any


def prepare_dry_run(job_config: Any) -> list[str]:
    """Adjust the job for a meta-device dry run; returns the warnings it logged."""
    import torchtitan.tools.utils as tt_utils
    from torchtitan.tools.logging import logger

    tt_utils.device_type = "meta"
    _skip_meta_autocast()
    warnings: list[str] = []
    if job_config.debug.seed is None:
        # The seed broadcast reads a tensor back from the device, impossible on meta.
        job_config.debug.seed = 0
    converters = [c for c in job_config.model.converters if "float8" not in c and "mx" not in c]
    if converters != list(job_config.model.converters):
        warnings.append(f"dry run: ignoring model.converters {job_config.model.converters}")
        job_config.model.converters = converters
    if job_config.compile.enable:
        warnings.append("dry run: ignoring compile.enable")
        job_config.compile.enable = False
    if job_config.parallelism.enable_async_tensor_parallel:
        warnings.append("dry run: ignoring parallelism.enable_async_tensor_parallel")
        job_config.parallelism.enable_async_tensor_parallel = False
    for w in warnings:
        logger.warning(w)
    return warnings


def _skip_meta_autocast() -> None:
    """TorchTitan's ``maybe_enable_amp`` without autocast on the meta device (idempotent)."""
    import contextlib

    import torchtitan.distributed.utils as dist_utils

    original = dist_utils.maybe_enable_amp
    if getattr(original, "_skips_meta", False):
        return

    def maybe_enable_amp(parallel_dims: Any, mixed_precision_param: str, device_type: str
                         ) -> Any:
        if device_type == "meta":
            return contextlib.nullcontext()
        return original(parallel_dims, mixed_precision_param, device_type)

    maybe_enable_amp._skips_meta = True  # type: ignore[attr-defined]
    dist_utils.maybe_enable_amp = maybe_enable_amp
