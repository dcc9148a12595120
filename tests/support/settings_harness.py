"""Build a planned job's model on the meta device across a fake process group, in-process:
what TorchTitan's Trainer does before training (converters, then the train spec's parallelize
function, i.e. ``apply_plan``), without data, optimizer or kernels."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

WORLD = 8


@contextlib.contextmanager
def fake_process_group() -> Iterator[None]:
    """A fake process group of ``WORLD`` ranks (rank 0) and ``WORLD_SIZE``, for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(WORLD)
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        if previous is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = previous


def build(config: str, *overrides: str) -> tuple[nn.Module, Any, Any]:
    """(parallelized meta model, job config, plan) of ``train_configs/<config>`` planned for
    ``WORLD`` ranks with ``overrides``; a config without ``auto`` runs TorchTitan's own recipe
    (plan None)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.job import check_config, parse_config
    from torchtitan_autoparallel.titan.v0_2.patches.dry_run import _assume_quantization_capability
    from torchtitan_autoparallel.titan.v0_2.registry import register
    from torchtitan_autoparallel.titan.v0_2.train import prepare_planned_job

    cpu.install()
    register()
    _assume_quantization_capability()
    assert os.environ.get("WORLD_SIZE") == str(WORLD), "call inside fake_process_group()"
    job = parse_config(["--job.config_file", f"train_configs/{config}", *overrides])
    check_config(job, cpu=False, dry_run=True)  # as the dry-run entrypoint (no device check)
    plan = prepare_planned_job(job, write=False) if job.parallelism.auto else None
    par = job.parallelism
    dims = ParallelDims(dp_replicate=par.data_parallel_replicate_degree,
                        dp_shard=par.data_parallel_shard_degree, cp=par.context_parallel_degree,
                        tp=par.tensor_parallel_degree, pp=1, ep=par.expert_parallel_degree,
                        etp=par.expert_tensor_parallel_degree, world_size=WORLD)
    dims.build_mesh()
    spec = get_train_spec(job.model.name)
    args = spec.model_args[job.model.flavor]
    args.update_from_config(job)
    with torch.device("meta"):
        model = spec.model_cls(args)
    build_model_converters(job, dims).convert(model)
    model = spec.parallelize_fn(model, dims, job)
    return model, job, plan
