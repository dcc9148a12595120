"""A plan applied to TorchTitan 0.3.0's model, as its ``parallelize_llama`` reads: the plan's
mesh and batch in the config (``apply_plan``), then per model part (each pipeline stage's)
``plan_parallelize``: TP / CP / EP as the model declares them, activation checkpointing per
block, compile, FSDP per unit with each block's ``reshard_after_forward``; the placements
below the block (sub-block modes, the embedding on its embedding dim) as ``tp_dp.py`` applies
them. What this apply cannot run (a layer without TP on a tp mesh) stops in one line."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...candidates.layout import (
    DP_SHARD_TP,
    EMBEDDING_MODES,
    MOE_SUB_BLOCK_MODES,
    embedding_dim_problem,
    split_fsdp,
)
from ...errors import UserError
from .tp_dp import (
    MOE_BLOCK,
    MOE_DP,
    MOE_SHARED,
    MOE_SHARED_CUT,
    SUB_BLOCKS_APPLIED,
    Parts,
    apply_dp_shard_tp,
    apply_embedding_dim,
    batch_stream,
    dp_shard_tp_parts,
    drop_embedding_sharding,
    override_declared_sharding,
    projections_a2a,
    tp_dp_parts,
)
from .tp_dp import fsdp_arguments as tp_dp_fsdp


def check_applicable(plan: Any) -> None:
    """UserError naming what in ``plan`` this apply cannot run: a layer without TP on a tp
    mesh (``model.parallelize`` shards every layer the model declares), an embedding on its
    embedding dim on a mesh that cannot hold it."""
    looked_up = next((layer for layer in plan.layers if layer.tp_mode in EMBEDDING_MODES), None)
    problem = looked_up and embedding_dim_problem(plan.mesh, tp_mode=looked_up.tp_mode)
    if problem:
        raise UserError(f"plan: {looked_up.fqn}: {problem}")
    m = plan.mesh
    if m.tp == 1:
        return
    applied = ("sp", "dp", *SUB_BLOCKS_APPLIED, *MOE_SUB_BLOCK_MODES, *EMBEDDING_MODES)
    other = [layer for layer in plan.layers if layer.tp_mode not in applied]
    if other:
        raise UserError(f"the plan runs tensor parallel on {len(plan.layers) - len(other)} of "
                        f"{len(plan.layers)} layers (tp > 1; {other[0].fqn} has tp_mode "
                        f"{other[0].tp_mode!r}): TorchTitan 0.3.0's model.parallelize shards "
                        "every layer; use 'sp', 'dp' or a sub-block mode")


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
    _sequence_parallel(p, plan)
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


def _sequence_parallel(parallelism: Any, plan: Any) -> None:
    """TP without SP (``layout.TP_WITHOUT_SP``, a replicated stream) through TorchTitan's own
    ``parallelism.enable_sequence_parallel``; a one-line UserError for a plan that shards the
    stream over tp in a job that turns sequence parallel off."""
    if plan.mesh.tp == 1:
        return
    if plan.stream is None:
        from torchtitan.tools.logging import logger

        parallelism.enable_sequence_parallel = False
        logger.info("tensor parallel without sequence parallel: the residual stream whole on "
                    f"every tp rank ({plan.mesh.tp} ranks), the TP modules' output all-reduced")
    elif not parallelism.enable_sequence_parallel:
        raise UserError(f"plan: its blocks shard the residual stream over tp (tp = "
                        f"{plan.mesh.tp}, sequence parallel) and "
                        "parallelism.enable_sequence_parallel is off: re-plan the job (the "
                        "planner runs it without sequence parallel), or turn it on")


def _ac_policies(ac_config: Any, dump_folder: str) -> dict[str, Any]:
    """AC mode -> the 0.3.0 policy that applies it: the job's own policy for the mode it names,
    the other mode's with the options every policy shares (``preserve_rng_state``,
    ``determinism_check``, ``debug``) as the job set them."""
    from torchtitan.distributed.activation_checkpoint import (
        ActivationCheckpointing,
        FullAC,
        SelectiveAC,
    )

    shared = ({f.name: getattr(ac_config, f.name)
               for f in dataclasses.fields(ActivationCheckpointing.Config)}
              if isinstance(ac_config, ActivationCheckpointing.Config) else {})
    out: dict[str, Any] = {"none": None}
    for mode, cls in (("full", FullAC), ("selective", SelectiveAC)):
        cfg = ac_config if type(ac_config) is cls.Config else cls.Config(**shared)
        out[mode] = cfg.build(dump_folder=dump_folder)
    return out


def plan_parallelize(model: Any, *, plan: Any, parallel_dims: Any, training: Any,
                     parallelism: Any, compile_config: Any, ac_config: Any,
                     dump_folder: str) -> Any:
    """TorchTitan 0.3.0's ``parallelize_llama`` with AC, FSDP ``reshard_after_forward`` and
    FSDP units per block from ``plan``: TP / CP / EP as the model declares them, AC per block,
    compile, FSDP per unit. A vision encoder (qwen3_5, Kimi K2.5) is compiled and FSDP-sharded
    as one unit as the family's ``parallelize`` does, without the blocks' AC (as the plan costs
    it). Blocks planned to use the tp dim as data parallel (wholly or in one sub-block), the
    other placements below the block and the embedding on its embedding dim as ``tp_dp.py``
    applies them."""
    blocks = dict(model.layers.named_children())
    _check_plan_fits_model(model, plan, blocks, parallel_dims)
    compiled = compile_config.enable and "model" in compile_config.components
    parts = tp_dp_parts(model, plan, blocks, parallelism, compiled)  # before AC wraps blocks
    _apply_below_the_block(model, plan, blocks, parts, parallel_dims, parallelism, training)
    by_fqn = {layer.fqn: layer for layer in plan.layers}
    _apply_ac_per_block(model, blocks, by_fqn, ac_config, dump_folder)
    encoders = {layer.fqn: getattr(model, layer.fqn) for layer in plan.layers
                if layer.kind == "encoder" and getattr(model, layer.fqn, None) is not None}
    if compiled:
        _apply_compile(model, encoders, compile_config, parallel_dims)
    _apply_fsdp_per_unit(model, plan, blocks, encoders, parallel_dims, parallelism, training,
                         parts)
    return model


def _apply_below_the_block(model: Any, plan: Any, blocks: dict[str, Any], parts: dict[str, Parts],
                           parallel_dims: Any, parallelism: Any, training: Any) -> None:
    """TP / CP / EP as the model declares them, with the placements below the block
    (``tp_dp.py``): declarations dropped or rewritten before ``model.parallelize``, this
    project's styles after it (weights read in the job's parameter dtype)."""
    from torchtitan.config import TORCH_DTYPE_MAP

    if parts:
        override_declared_sharding(parts, parallel_dims.get_mesh("tp"), plan.stream)
    over_dp_shard = dp_shard_tp_parts(parts)
    batch_stream(model, plan)
    if parallel_dims.tp_enabled:
        projections_a2a(blocks, plan, parallel_dims.get_mesh("tp"))
    drop_embedding_sharding(model, plan)
    _apply_declared_sharding(model, blocks, parallel_dims, parallelism)
    dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
    if plan.embedding_mode and model.tok_embeddings is not None:
        apply_embedding_dim(model, plan, parallel_dims, dtype)
    apply_dp_shard_tp(over_dp_shard, parallel_dims, dtype)


def _check_plan_fits_model(model: Any, plan: Any, blocks: dict[str, Any],
                           parallel_dims: Any) -> None:
    """Refuse, in one line, a plan whose blocks are not this model's (or this stage's), and
    what 0.3.0's apply does not run under a plan."""
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


def _apply_declared_sharding(model: Any, blocks: dict[str, Any], parallel_dims: Any,
                             parallelism: Any) -> None:
    """Tensor / context / expert parallel: the sharding the model declares, as TorchTitan's
    parallelize_llama / parallelize_deepseekv3 apply it."""
    from torchtitan.distributed.context_parallel import apply_cp_to_forward
    from torchtitan.distributed.full_dtensor import validate_config

    if parallelism.spmd_backend in ("full_dtensor", "spmd_types"):
        validate_config(parallel_dims, model)
        model.parallelize(parallel_dims)
        return
    if parallel_dims.cp_enabled:
        apply_cp_to_forward([block.attention.inner_attention for block in blocks.values()],
                            parallel_dims.get_mesh("cp"))
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)


def _apply_ac_per_block(model: Any, blocks: dict[str, Any], by_fqn: dict[str, Any],
                        ac_config: Any, dump_folder: str) -> None:
    """Each block wrapped in the activation checkpointing its plan entry names."""
    policies = _ac_policies(ac_config, dump_folder)
    for name in list(blocks):
        policy = policies[by_fqn[f"layers.{name}"].ac]
        if policy is not None:
            blocks[name] = policy._wrap_block(blocks[name], base_fqn=f"layers.{name}")
            model.layers.register_module(name, blocks[name])


def _apply_compile(model: Any, encoders: dict[str, Any], compile_config: Any,
                   parallel_dims: Any) -> None:
    """TorchTitan's ``apply_compile`` on the model's blocks and on each encoder (as
    parallelize_qwen3_5 / _kimi_k2_5 compile it)."""
    from torchtitan.distributed.compile import apply_compile

    apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    for encoder in encoders.values():
        apply_compile(encoder, compile_config=compile_config, parallel_dims=parallel_dims)


def _fsdp_arguments(parallel_dims: Any, parallelism: Any, training: Any
                    ) -> tuple[dict[str, Any], Any, Any, Any]:
    """``fully_shard``'s keyword arguments for dense parameters (mesh, mixed precision,
    offload), the data-parallel mesh dims, and the experts' mesh and its dims."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh, resolve_sparse_fsdp_mesh

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
    return fsdp, dp_mesh_dims, edp_mesh, edp_mesh_dims


def _apply_fsdp_per_unit(model: Any, plan: Any, blocks: dict[str, Any],
                         encoders: dict[str, Any], parallel_dims: Any, parallelism: Any,
                         training: Any, parts: dict[str, Parts]) -> None:
    """FSDP with the plan's ``reshard_after_forward``: each encoder one unit (its pixels cast
    to the parameters' dtype, as TorchTitan's apply_fsdp_to_vision_encoder), the embedding and
    the head, then the blocks by the plan's FSDP units (``parts``: the groups of blocks using
    the tp dim as data parallel, over dp_shard x tp where they do), then the model."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    from ...plan.schema import fsdp_units

    fsdp, dp_mesh_dims, edp_mesh, edp_mesh_dims = _fsdp_arguments(parallel_dims, parallelism,
                                                                  training)
    by_fqn = {layer.fqn: layer for layer in plan.layers}

    def reshard(kind: str) -> bool | int:
        layers = [layer for layer in plan.layers if layer.kind == kind]
        return layers[0].reshard_after_forward if layers else True

    for fqn, encoder in encoders.items():
        fully_shard(encoder, **{k: v for k, v in fsdp.items() if k != "offload_policy"} | {
            "mp_policy": dataclasses.replace(fsdp["mp_policy"], cast_forward_inputs=True)},
            reshard_after_forward=by_fqn[fqn].reshard_after_forward)
    ends: list[nn.Module] = [m for m in (model.norm, model.lm_head) if m is not None]
    if getattr(model, "enable_weight_tying", False):
        fully_shard([model.tok_embeddings, *ends], **fsdp,
                    reshard_after_forward=reshard("output"))
    else:
        if model.tok_embeddings is not None and not plan.embedding_mode:
            fully_shard(model.tok_embeddings, **fsdp,
                        reshard_after_forward=reshard("embedding"))
        if len(ends) == 2:
            fully_shard(ends, **fsdp, reshard_after_forward=reshard("output"))
    placement = _expert_placement(blocks.values(), parallel_dims.ep, fsdp, dp_mesh_dims,
                                  edp_mesh, edp_mesh_dims)
    units = []
    here = {f"layers.{name}" for name in blocks}
    over_tp = tp_dp_fsdp(fsdp, parallel_dims) if parts else fsdp
    own: set[nn.Parameter] = set()  # parameters sharded by styles of their own
    for unit in fsdp_units([layer for layer in plan.layers if layer.fqn in here]):
        names = [layer.fqn.split(".", 1)[1] for layer in unit]
        reshard = unit[0].reshard_after_forward
        if split_fsdp(unit[0].tp_mode):  # units of one block: one group per part
            for mode, modules in parts[names[0]]:
                if mode == DP_SHARD_TP:  # sharded by its own style
                    own.update(p for module in modules for p in module.parameters())
                    continue
                whole = mode == MOE_BLOCK  # a MoE block, around its data-parallel group
                place = placement if whole else _experts_on_dim1(
                    [modules[0].routed_experts.inner_experts],
                    over_tp["mesh"].size()) if mode == MOE_DP else None
                fully_shard(modules[0] if whole else modules,
                            **(over_tp if mode in ("dp", MOE_SHARED, MOE_DP, MOE_SHARED_CUT)
                               else fsdp),
                            reshard_after_forward=reshard,
                            **({"shard_placement_fn": place} if place else {}))
                if whole:
                    units.append(modules[0])
            continue
        modules = [blocks[name] for name in names]
        units.append(modules[0])
        fully_shard(modules if len(modules) > 1 else modules[0],
                    **(over_tp if unit[0].tp_mode == "dp" else fsdp),
                    reshard_after_forward=reshard,
                    **({"shard_placement_fn": placement} if placement else {}))
    # the embedding looked up on its embedding dim is sharded by its own style
    if plan.embedding_mode and model.tok_embeddings is not None:
        own.update(model.tok_embeddings.parameters())
    fully_shard(model, **fsdp, ignored_params=own or None)
    disable_fsdp_gradient_division(model)
    if parallel_dims.ep_enabled:
        _prefetch_explicitly(model, units)


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
    if ep == 1:
        return _experts_on_dim1(experts, fsdp["mesh"].size())
    params = {p for e in experts for p in e.parameters()}
    ranks = edp_mesh["efsdp"].size() * ep
    expert_dim = Shard(1) if _experts_on_dim1(experts, ranks) else Shard(0)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    expert_mesh = _get_mesh_info(edp_mesh, edp_mesh_dims)
    dense_mesh = _get_mesh_info(fsdp["mesh"], dp_mesh_dims)

    def place(param: Any) -> Any:
        if param in params:
            return ShardPlacementResult(placement=expert_dim, mesh_info=expert_mesh)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dense_mesh)

    return place


def _experts_on_dim1(experts: list[Any], ranks: int) -> Any:
    """The ``shard_placement_fn`` that shards the routed ``experts`` on dim 1 where the
    ``ranks`` that shard them (FSDP x EP) outnumber the experts (dim 0 would pad), as
    TorchTitan 0.3.0's ``apply_fsdp_to_decoder`` does; None where dim 0 serves."""
    from torch.distributed.tensor import Shard

    if ranks <= min(e.num_experts for e in experts):
        return None
    params = {p for e in experts for p in e.parameters()}
    return lambda param: Shard(1) if param in params else None


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
