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
stage. What this apply cannot run yet (tensor parallel as data parallel, TP on some layers only)
stops in one line. Without a CUDA device the CPU shims of
``cpu.py`` apply (gloo).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from ...errors import UserError, run_cli
from ...job.explicit import NOTES_ATTR
from .. import ASSETS
from . import cpu


def check_applicable(plan: Any) -> None:
    """UserError naming what in ``plan`` this apply cannot run."""
    m = plan.mesh
    modes = {layer.tp_mode for layer in plan.layers}
    if "dp" in modes:
        fqns = [layer.fqn for layer in plan.layers if layer.tp_mode == "dp"]
        raise UserError(f"the plan runs tensor parallel as data parallel on {fqns[0]} "
                        f"({len(fqns)} layers): not applied to TorchTitan 0.3.0 yet; leave "
                        "out tp_dp (e.g. --autoparallel.techniques fsdp hsdp ddp tp cp ep ac pp)")
    if m.tp > 1 and modes != {"sp"}:
        n = sum(layer.tp_mode == "sp" for layer in plan.layers)
        raise UserError(f"the plan runs tensor parallel on {n} of {len(plan.layers)} layers "
                        "(tp > 1): TorchTitan 0.3.0's model.parallelize shards every layer; "
                        "not applied yet")


def apply_plan(config: Any, plan: Any) -> None:
    """The plan's mesh and batch in ``config``, and ``plan_parallelize`` as its
    ``parallelize_fn``."""
    check_applicable(plan)
    m, p, t = plan.mesh, config.parallelism, config.training
    p.data_parallel_replicate_degree = m.dp_replicate
    p.data_parallel_shard_degree = m.dp_shard
    p.tensor_parallel_degree = m.tp
    p.context_parallel_degree = m.cp
    p.expert_parallel_degree = m.ep
    p.pipeline_parallel_degree = m.pp
    if plan.global_batch_size != (plan.local_batch_size * m.dp
                                   * plan.gradient_accumulation_steps):
        raise UserError(f"plan: global batch {plan.global_batch_size} is not local "
                        f"{plan.local_batch_size} x dp {m.dp} x accumulation "
                        f"{plan.gradient_accumulation_steps}")
    t.local_batch_size = plan.local_batch_size
    t.global_batch_size = plan.global_batch_size  # TorchTitan derives the accumulation steps
    if plan.pipeline is not None:
        # TorchTitan's pipeline_llm splits the planned stages and runs the planned schedule,
        # calling plan_parallelize on each stage's model part
        p.pipeline_parallel_schedule = plan.pipeline.schedule
        p.pipeline_parallel_microbatch_size = plan.pipeline.microbatch_size
        p.module_fqns_per_model_part = [list(stage) for stage in plan.pipeline.stages]
        p.pipeline_parallel_layers_per_stage = None

    def parallelize(model: Any, **kwargs: Any) -> Any:
        return plan_parallelize(model, plan=plan, **kwargs)

    config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=parallelize)


def _ac_policies(ac_config: Any, dump_folder: str) -> dict[str, Any]:
    """AC mode -> the 0.3.0 policy that applies it (the job's own options kept when it names
    that mode)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    out: dict[str, Any] = {"none": None}
    for mode, cls in (("full", FullAC), ("selective", SelectiveAC)):
        cfg = ac_config if type(ac_config) is cls.Config else cls.Config()
        out[mode] = cfg.build(dump_folder=dump_folder)
    return out


def plan_parallelize(model: Any, *, plan: Any, parallel_dims: Any, training: Any,
                     parallelism: Any, compile_config: Any, ac_config: Any,
                     dump_folder: str) -> Any:
    """TorchTitan 0.3.0's ``parallelize_llama`` with AC, FSDP ``reshard_after_forward`` and
    FSDP units per block from ``plan``; a vision encoder (qwen3_5, Kimi K2.5) compiled and
    FSDP-sharded as one unit as the family's ``parallelize`` does, without the blocks' AC (as
    the plan costs it)."""
    import torch.nn as nn
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.context_parallel import apply_cp_to_forward
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
    from torchtitan.distributed.full_dtensor import (
        resolve_fsdp_mesh,
        resolve_sparse_fsdp_mesh,
        validate_config,
    )

    from ...plan.schema import fsdp_units

    blocks = dict(model.layers.named_children())
    planned = [layer.fqn for layer in plan.layers if layer.kind == "block"]
    parts = [planned] if plan.pipeline is None else \
        [[f for f in stage if f in planned] for stage in plan.pipeline.stages]
    if [f"layers.{name}" for name in blocks] not in parts:
        raise UserError(f"plan: its blocks {planned[:2]}... are not the model's layers "
                        f"({len(blocks)} blocks)")
    if _is_hf(model):
        _declare_hf_sharding(model, parallel_dims)
    if parallel_dims.pp_enabled and getattr(model, "enable_weight_tying", False):
        raise UserError("pipeline stages with tied embedding and output weights: not applied "
                        "to TorchTitan 0.3.0; set --parallelism.pipeline_parallel_degree 1")
    if getattr(model, "mtp_layers", None) is not None:
        raise UserError("multi-token prediction layers (model.mtp_layers) are not in the plan: "
                        "use a config without MTP (num_mtp_layers = 0) under auto")

    # tensor / context / expert parallel: the sharding the model declares, as TorchTitan's
    # parallelize_llama / parallelize_deepseekv3 apply it
    if parallelism.spmd_backend in ("full_dtensor", "spmd_types"):
        validate_config(parallel_dims, model)
        model.parallelize(parallel_dims)
    else:
        if parallel_dims.cp_enabled:
            apply_cp_to_forward([block.attention.inner_attention for block in blocks.values()],
                                parallel_dims.get_mesh("cp"))
        if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
            model.parallelize(parallel_dims)

    # activation checkpointing per block
    policies = _ac_policies(ac_config, dump_folder)
    by_fqn = {layer.fqn: layer for layer in plan.layers}
    for name in list(blocks):
        policy = policies[by_fqn[f"layers.{name}"].ac]
        if policy is not None:
            blocks[name] = policy._wrap_block(blocks[name], base_fqn=f"layers.{name}")
            model.layers.register_module(name, blocks[name])

    encoders = {layer.fqn: getattr(model, layer.fqn) for layer in plan.layers
                if layer.kind == "encoder" and getattr(model, layer.fqn, None) is not None}
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
        for encoder in encoders.values():  # as parallelize_qwen3_5 / _kimi_k2_5 compile it
            apply_compile(encoder, compile_config=compile_config, parallel_dims=parallel_dims)

    # FSDP per unit with the plan's reshard_after_forward
    edp_mesh = edp_mesh_dims = None
    if parallelism.spmd_backend in ("full_dtensor", "spmd_types"):
        dp_mesh, dp_mesh_dims = resolve_fsdp_mesh(parallel_dims)
        edp_mesh, edp_mesh_dims = resolve_sparse_fsdp_mesh(parallel_dims)
    else:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        dp_mesh, dp_mesh_dims = parallel_dims.get_mesh(names), None
        if parallel_dims.ep_enabled:
            edp_mesh = parallel_dims.get_optional_mesh(
                ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"])
    fsdp: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False)}
    if dp_mesh_dims is not None:
        fsdp["dp_mesh_dims"] = dp_mesh_dims
    if training.enable_cpu_offload:
        fsdp["offload_policy"] = CPUOffloadPolicy()

    def reshard(kind: str) -> bool | int:
        layers = [layer for layer in plan.layers if layer.kind == kind]
        return layers[0].reshard_after_forward if layers else True

    # each encoder one FSDP unit, before the decoder, its inputs (pixels) cast to the
    # parameters' dtype (TorchTitan's apply_fsdp_to_vision_encoder)
    for fqn, encoder in encoders.items():
        fully_shard(encoder, **{k: v for k, v in fsdp.items() if k != "offload_policy"} | {
            "mp_policy": dataclasses.replace(fsdp["mp_policy"], cast_forward_inputs=True)},
            reshard_after_forward=by_fqn[fqn].reshard_after_forward)
    ends: list[nn.Module] = [m for m in (model.norm, model.lm_head) if m is not None]
    if getattr(model, "enable_weight_tying", False):
        fully_shard([model.tok_embeddings, *ends], **fsdp,
                    reshard_after_forward=reshard("output"))
    else:
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, **fsdp,
                        reshard_after_forward=reshard("embedding"))
        if len(ends) == 2:
            fully_shard(ends, **fsdp, reshard_after_forward=reshard("output"))
    placement = _expert_placement(blocks.values(), parallel_dims.ep, fsdp, dp_mesh_dims,
                                  edp_mesh, edp_mesh_dims)
    units = []
    here = {f"layers.{name}" for name in blocks}
    for unit in fsdp_units([layer for layer in plan.layers if layer.fqn in here]):
        modules = [blocks[layer.fqn.split(".", 1)[1]] for layer in unit]
        units.append(modules[0])
        fully_shard(modules if len(modules) > 1 else modules[0], **fsdp,
                    reshard_after_forward=unit[0].reshard_after_forward,
                    **({"shard_placement_fn": placement} if placement else {}))
    fully_shard(model, **fsdp)
    disable_fsdp_gradient_division(model)
    if parallel_dims.ep_enabled:
        _prefetch_explicitly(model, units)
    return model


def _hf_config(config: Any) -> bool:
    """``config`` trains a model of TorchTitan 0.3.0's HF backend."""
    return type(config.model_spec.model).__module__.startswith(
        "torchtitan.experiments.transformers_modeling_backend")


def _is_hf(model: Any) -> bool:
    return type(model).__module__.startswith(
        "torchtitan.experiments.transformers_modeling_backend")


def _declare_hf_sharding(model: Any, parallel_dims: Any) -> None:
    """What TorchTitan 0.3.0's ``parallelize_hf_transformers`` does before
    ``model.parallelize``: tied embedding and output weights untied (FSDP shards them
    apart), HF MoE blocks swapped for TorchTitan's, HF modules converted to TorchTitan's
    ``Module`` protocol, and the backend's sharding declared on them."""
    import torch.nn as nn
    from torchtitan.experiments.transformers_modeling_backend.hf_sharding import (
        set_hf_sharding_configs,
    )
    from torchtitan.experiments.transformers_modeling_backend.module_conversion import (
        convert_hf_to_module,
    )

    embedding, output = model.tok_embeddings, model.lm_head
    if embedding is not None and output is not None and any(
            p is q for p in embedding.parameters() for q in output.parameters()):
        output.weight = nn.Parameter(output.weight.clone(),
                                     requires_grad=output.weight.requires_grad)
    if any(getattr(block, "moe_enabled", False) for block in model.layers):
        from torchtitan.experiments.transformers_modeling_backend.moe_replacement import (
            build_and_swap_native_moe,
        )

        build_and_swap_native_moe(model, parallel_dims)
    convert_hf_to_module(model)
    set_hf_sharding_configs(model, enable_sp=parallel_dims.tp_enabled)


def _expert_placement(blocks: Any, ep: int, fsdp: dict[str, Any], dp_mesh_dims: Any,
                      edp_mesh: Any, edp_mesh_dims: Any) -> Any:
    """The ``shard_placement_fn`` TorchTitan 0.3.0's ``apply_fsdp_to_decoder`` gives MoE blocks
    (None when no block has routed experts or the default placement serves): under EP the
    routed experts shard over ``efsdp`` (the ranks EP leaves), the rest over the dp mesh; the
    experts on dim 1 when their FSDP x EP ranks outnumber the experts (dim 0 would pad)."""
    from torch.distributed.tensor import Shard

    experts = [block.moe.routed_experts.inner_experts for block in blocks
               if getattr(block, "moe_enabled", False)]
    if not experts:
        return None
    params = {p for e in experts for p in e.parameters()}
    ranks = edp_mesh["efsdp"].size() * ep if ep > 1 else fsdp["mesh"].size()
    expert_dim = Shard(1) if ranks > min(e.num_experts for e in experts) else Shard(0)
    if ep == 1:
        if expert_dim == Shard(0):
            return None
        return lambda param: expert_dim if param in params else None
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    expert_mesh = _get_mesh_info(edp_mesh, edp_mesh_dims)
    dense_mesh = _get_mesh_info(fsdp["mesh"], dp_mesh_dims)

    def place(param: Any) -> Any:
        if param in params:
            return ShardPlacementResult(placement=expert_dim, mesh_info=expert_mesh)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dense_mesh)

    return place


def _prefetch_explicitly(model: Any, units: list[Any]) -> None:
    """TorchTitan 0.3.0's explicit FSDP prefetch under EP (its all-to-all's device-to-host
    syncs would stall implicit prefetching), per FSDP unit: forward gathers the next unit
    (the last one the norm and output), backward the previous one (the first the
    embedding)."""
    ends = [m for m in (model.norm, model.lm_head) if m is not None]
    if model.tok_embeddings is not None and units:
        model.tok_embeddings.set_modules_to_forward_prefetch([units[0]])
    for unit, nxt in zip(units, units[1:] + [None], strict=True):
        if nxt is not None:
            unit.set_modules_to_forward_prefetch([nxt])
        elif len(ends) == 2:
            unit.set_modules_to_forward_prefetch(ends)
    back = units[::-1]
    if len(ends) == 2 and back:
        model.lm_head.set_modules_to_backward_prefetch([back[0]])
    for unit, prev in zip(back, back[1:] + [None], strict=True):
        if prev is not None:
            unit.set_modules_to_backward_prefetch([prev])
        elif model.tok_embeddings is not None:
            unit.set_modules_to_backward_prefetch([model.tok_embeddings])


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
    from .job import OPTIMIZERS, optimizers_of, override_targets

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
