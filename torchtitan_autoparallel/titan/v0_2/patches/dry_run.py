"""Dry runs on a fake process group (``comm.mode = "fake_backend"``).

Upstream TorchTitan's fake backend still materialises the sharded model on the accelerator (or
"cuda" on a CPU box), which does not fit 405B/671B shards on one host and runs real kernels.
A dry run here keeps every parameter on the meta device: TorchTitan's Trainer reads
``torchtitan.tools.utils.device_type`` for the device it initialises weights on, so it is set to
"meta" for the dry-run process only. The job's speed features are built as on the GPU:
float8 / MX linears (torchao converts them on meta), FSDP's float8 all-gather weights, the
per-block compile wrappers and async TP; nothing is compiled or run, as no forward runs.
TorchTitan's quantization converters refuse to build below SM89 / SM100 (``has_cuda_capability``),
which a meta-device dry run on a machine without that GPU would trip although it runs no kernel:
the check is answered "yes" in those converter modules for the dry-run process only (the real
job checks the device in its preflight, ``features.check_device``).
Autocast (TorchTitan's mixed precision without FSDP: DDP or one device) has no meta backend; it
is skipped, as the dry run runs no kernels.
Tested by tests/test_dry_run.py.
"""

from __future__ import annotations

from typing import Any

from ....candidates.layout import GIB


def prepare_dry_run(job_config: Any) -> None:
    """Adjust the process and the job for a meta-device dry run."""
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "meta"
    _skip_meta_autocast()
    _assume_quantization_capability()
    if job_config.debug.seed is None:
        # The seed broadcast reads a tensor back from the device, impossible on meta.
        job_config.debug.seed = 0


def _assume_quantization_capability() -> None:
    """Upstream: ``Float8LinearConverter`` / ``Float8GroupedMMConverter`` / ``MX*Converter``
    call ``torchtitan.tools.utils.has_cuda_capability`` (imported into their modules) and refuse
    to convert on a machine without an SM89 / SM100 GPU. A meta-device dry run converts and
    shards but runs no kernel, so those modules see a capable device. Tested by
    tests/test_dry_run.py::test_float8_compile_dry_run."""
    import importlib

    for name in ("torchtitan.components.quantization.float8",
                 "torchtitan.components.quantization.mx"):
        module = importlib.import_module(name)
        module.has_cuda_capability = lambda major, minor: True  # type: ignore[attr-defined]


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
        f"parameters per rank {local_bytes / GIB:.2f} GiB"
    )
    plan = getattr(trainer.job_config, "_autoparallel_plan", None)
    if plan is not None:
        # fp32 parameters, gradients and two AdamW moments: 4x the sharded parameter bytes
        # (with pp: this process builds pp rank 0's stages, compared with its prediction)
        p = plan.predicted
        state = p["state_memory_gib"]
        if plan.pipeline is not None and plan.pipeline.rank_state_gib:
            state = plan.pipeline.rank_state_gib[0]
        report += (
            f"; plan {plan.digest()}: sharded state {4 * local_bytes / GIB:.2f} GiB "
            f"(predicted {state:.2f} GiB), predicted peak "
            f"{p['peak_memory_gib']:.2f} GiB of budget {p['budget_gib']:.2f} GiB"
        )
    import json

    from ....plan.built import block_features

    # the blocks' container: a planned block's fqn is "<container>.<name>"
    blocks = (next(layer.fqn for layer in plan.layers if layer.kind == "block").rpartition(".")[0]
              if plan is not None else "layers")
    features = {}
    for model in trainer.model_parts:
        features.update(block_features(model, blocks))
    report += "\ndry run blocks: " + json.dumps(features, sort_keys=True)
    return report
