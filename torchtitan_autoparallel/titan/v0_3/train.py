"""Train with TorchTitan 0.3.0's own Trainer, parallelized by the plan under
``--parallelism.auto``.

    torchrun --nproc_per_node N -m torchtitan_autoparallel.titan.v0_3.train \\
        --module llama3 --config llama3_debugmodel --parallelism.auto [overrides]

Without ``--parallelism.auto`` the job runs as TorchTitan's ``torchtitan.train`` runs it. With
it, rank 0 plans the job on the world size and hands the plan to the other ranks (torchrun's
store), rank 0 prints it, the config takes the plan's mesh and batch, and the model spec's
``parallelize_fn`` is replaced by ``plan_parallelize``: 0.3.0's ``parallelize_llama`` /
``parallelize_deepseekv3`` (the sharding the model declares: TP, CP, EP on routed experts) with
activation checkpointing, FSDP ``reshard_after_forward`` and FSDP units per block from the plan.
Under pipeline parallel TorchTitan's ``pipeline_llm`` splits the planned stages and calls it per
stage; blocks (or their attention / feed-forward) planned to use the tp dim as data parallel
run as ``tp_dp.py`` applies them, gradient norms combined over their meshes
(``titan/grad_norm.py``). What this apply cannot run (a layer without TP on a tp mesh) stops in
one line. Without a CUDA device the CPU shims of
``cpu.py`` apply (gloo).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ...errors import UserError, run_cli
from ...job.explicit import NOTES_ATTR
from .. import ASSETS, grad_norm
from . import cpu
from .apply import apply_plan


def _hf_config(config: Any) -> bool:
    """``config`` trains a model of TorchTitan 0.3.0's HF backend."""
    return type(config.model_spec.model).__module__.startswith(
        "torchtitan.experiments.transformers_modeling_backend")


def plan_config(config: Any, world: int, rank: int, on_cpu: bool = False) -> Any:
    """Plan ``config`` on ``world`` ranks (rank 0 solves, or reads ``autoparallel.plan_file``,
    and hands the plan to the others), print it on rank 0, apply it; the plan."""
    from ...launch import plan_from_rank0, resolve_plan
    from .job import CPU_CP, job_of

    ap = config.autoparallel
    cpu_ranks = on_cpu and config.comm.mode != "fake_backend"
    # a plan file is checked against the job as planned offline (CP searched); CPU ranks
    # then refuse a plan with CP below
    job = job_of(config, cpu_ranks=cpu_ranks and not ap.plan_file)
    plan = plan_from_rank0(lambda: resolve_plan(job, world), ap.time_limit_s,
                           alone=config.comm.mode == "fake_backend")
    if cpu_ranks and plan.mesh.cp > 1:
        raise UserError(f"plan {ap.plan_file} runs context parallel (cp = {plan.mesh.cp}) on "
                        f"CPU ranks: {CPU_CP}; plan the job again with "
                        "--parallelism.context_parallel_degree 1, or run on GPUs")
    if rank == 0:
        print(plan.table(), flush=True)
        for note in getattr(job, NOTES_ATTR, []):
            print(f"  note: {note}", flush=True)
        if ap.save_plan:
            plan.save(ap.save_plan)
            print(f"plan written to {ap.save_plan}", flush=True)
    apply_plan(config, plan)
    if grad_norm.needed(plan):  # gradients on dp_shard and on dp_shard x tp meshes
        grad_norm.install()
    return plan


def debug_assets(config: Any) -> list[str]:
    """TorchTitan's debug configs read ``tests/assets/{tokenizer,c4_test,cc12m_test}`` of its
    source tree (relative to the working directory; the wheel ships none): when those are absent
    read the package's ``assets`` (its tokenizer and data) instead (the
    multimodal tokenizer for a ``MultiModalTokenizer``). The replacements made, as lines to
    log."""
    done = []
    if not ASSETS.is_dir():
        return done
    if os.path.normpath(config.hf_assets_path) == "tests/assets/tokenizer" and \
            not os.path.isdir(config.hf_assets_path):
        multimodal = type(config.tokenizer).__qualname__ == "MultiModalTokenizer.Config"
        config.hf_assets_path = str(ASSETS / ("tokenizer_mm" if multimodal else "tokenizer"))
        done.append(f"hf_assets_path = {config.hf_assets_path}")
    loader = config.dataloader
    for dataset, folder in (("c4_test", "data"), ("cc12m-test", "cc12m_test")):
        if getattr(loader, "dataset", None) == dataset and \
                not getattr(loader, "dataset_path", 1) and \
                not os.path.isdir(f"tests/assets/{dataset.replace('-', '_')}"):
            loader.dataset_path = str(ASSETS / folder)
            done.append(f"dataloader.dataset_path = {loader.dataset_path}")
    return done


def metrics_trainer(config: Any) -> Any:
    """TorchTitan 0.3.0's Trainer for ``config`` that writes ``autoparallel.metrics_file``
    and measures step 2's memory under ``autoparallel.measure_memory`` (as on 0.2.2)."""
    from torchtitan.trainer import Trainer

    from ...runtime.step_metrics import record_logged_metrics, recorded_step

    class MetricsTrainer(Trainer):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            record_logged_metrics(self)

        def train_step(self, data_iterator: Any) -> None:
            recorded_step(self, super().train_step, data_iterator, self.config.autoparallel,
                          self.config.training)

    return MetricsTrainer(config)


def check_runtime(config: Any, on_cpu: bool) -> None:
    """UserError for a job this machine cannot start (a missing package it names, a GPU-only
    feature on CPU ranks, settings out of range, a plan output where nothing is planned)."""
    import importlib.util

    from ...job.validate import check_training
    from ...launch import check_plan_outputs
    from .job import OPTIMIZERS, optimizers_of
    from .settings import override_targets

    check_training(config.training)
    ap = config.autoparallel
    check_plan_outputs(ap, config.parallelism.auto or bool(ap.plan_file))

    kwargs = getattr(config.dataloader, "load_dataset_kwargs", None) or {}
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    for path in [files] if isinstance(files, str) else list(files or []):
        if isinstance(path, str) and "://" not in path and not os.path.exists(path):
            raise UserError(f"dataloader.load_dataset_kwargs data_files {path} does not exist "
                            "here (TorchTitan's tests/assets is not in its wheel): run from a "
                            "TorchTitan checkout or point it at your data")

    shipped = [t for t in override_targets(config) if t.startswith("torchtitan.overrides.")]
    if on_cpu and shipped and config.comm.mode != "fake_backend":
        raise UserError(f"--override.imports {shipped[0]}: TorchTitan's override kernels run on "
                        "CUDA only (Triton / Helion / DeepEP), and this machine has no CUDA "
                        "device: drop it here, or run on GPUs")

    other = [name for name in optimizers_of(config.optimizer) if name not in OPTIMIZERS]
    if config.parallelism.auto and other:
        raise UserError(f"optimizer {other[0]} (the config's param_groups) under "
                        "--parallelism.auto: it keeps parameters in its own sharded storage, "
                        "which the plan's per-block FSDP does not give; use an AdamW config or "
                        "drop --parallelism.auto")
    if on_cpu and config.compile.enable_async_tensor_parallel \
            and config.comm.mode != "fake_backend":
        raise UserError("--compile.enable_async_tensor_parallel is Inductor's micro-pipeline "
                        "pass over CUDA symmetric memory, and this machine has no CUDA device "
                        "(on CPU ranks it would run as plain TP): drop it, or run on GPUs")

    if config.comm.mode == "torchcomms" and importlib.util.find_spec("torchcomms") is None:
        raise UserError("--comm.mode torchcomms needs the torchcomms package, which is not "
                        "installed: install it or drop --comm.mode torchcomms")


def run(argv: list[str]) -> int:
    on_cpu = cpu.apply_process_shims()
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from .config import parse_job

    init_logger()
    config = parse_job(argv)
    # torchrun sets WORLD_SIZE; a fake-backend dry run has NGPU ranks
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("NGPU") or 1)
    rank = int(os.environ.get("RANK", "0"))
    for line in debug_assets(config):
        if rank == 0:
            logger.info(f"TorchTitan's tests/assets is absent: {line}")
    check_runtime(config, on_cpu)
    if _hf_config(config):  # before any rank builds it: what the HF backend cannot run
        from .model import check_hf_config

        check_hf_config(config)
    if config.autoparallel.plan_file and not config.parallelism.auto:
        config.parallelism.auto = True  # a plan file is replayed, as on TorchTitan 0.2.2
    if config.parallelism.auto:
        if config.checkpoint.create_seed_checkpoint:
            raise UserError("--checkpoint.create_seed_checkpoint runs on 1 rank without a "
                            "plan: drop --parallelism.auto")
        plan_config(config, world, rank, on_cpu)
    if os.environ.get("AUTOPARALLEL_PREFLIGHT") == "1":
        return 0  # run_train.sh's check before starting ranks: the job parses and plans
    if on_cpu:
        for kind in cpu.sdpa_attention(config):
            if rank == 0:
                logger.info(f"CPU ranks: {kind} runs as causal SDPA (it has no CPU backward or "
                            "kernel): packed documents attend across their boundaries")

    if config.comm.mode == "local_tensor":  # as torchtitan.train: nothing to train
        logger.info("Local tensor mode enabled - skipping training execution")
        return 0
    if _hf_config(config):
        from .model import reset_hf_buffers_in_init_states

        reset_hf_buffers_in_init_states()  # HF's rotary inv_freq, other non-persistent buffers
    trainer = None
    try:
        ap = config.autoparallel
        trainer = metrics_trainer(config) if ap.metrics_file or ap.measure_memory \
            else config.build()
        if config.checkpoint.create_seed_checkpoint:
            if world != 1 or not config.checkpoint.enable:
                raise UserError("a seed checkpoint is created on 1 rank with "
                                "--checkpoint.enable")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except BaseException:
        if trainer is not None:
            trainer.close()
        raise
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def main() -> None:
    sys.exit(run_cli(lambda: run(sys.argv[1:])))


if __name__ == "__main__":
    main()
