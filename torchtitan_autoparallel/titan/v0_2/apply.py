"""Apply a Plan with ordinary PyTorch / TorchTitan calls. Never solves.

``apply_plan`` reads like TorchTitan's ``parallelize_llama``: TP (the family's TorchTitan
helper, float8 styles for tensorwise float8) and async TP, MoE EP / ETP, CP, activation
checkpointing per block (TorchTitan's ``apply_ac`` with each block's planned mode), per-block
``torch.compile`` (TorchTitan's ``apply_compile``), then FSDP2 ``fully_shard`` per block with
the block's planned ``reshard_after_forward`` (and FSDP's CPU offload policy when asked) or
TorchTitan's DDP. The job's features come from ``features.features_from_config``; the plan's
fingerprint guarantees they are the ones it was planned for.
"""

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from ...candidates.layout import (
    BATCH_STREAM,
    DP_SHARD_TP,
    MOE_ATTENTION_DP,
    MOE_SHARED_DP,
    REPLICATED_STREAM,
    STREAM_LAYOUTS,
    SUB_BLOCK_TP_MODES,
    a2a_mode,
    split_fsdp,
    stream_of,
    sub_block_modes,
    tp_dp_params,
)
from ...errors import UserError
from ...graph.adapters import INFER_TP, ModelAdapter, resolve, submodule_or_none
from ...graph.discover import get_adapter
from ...graph.tp_styles import InferredTP
from ...job.features import features_from_config
from ...plan.schema import Plan, fsdp_units
from .model import planning_adapter
from .patches.moe import reduce_sequence_parallel_moe_grads, reduce_tensor_parallel_router_grads
from .tp_dp import (
    SubBlocks,
    a2a_projections,
    apply_dp_shard_tp,
    apply_embedding_dim,
    apply_sub_block_tp,
    attention_apart,
    batch_split_over_tp,
    dp_over_tp_mesh,
    moe_attention_dp,
    moe_on_sequence_shard,
    planned_sub_blocks,
    shard_tp_dp_parts_only,
)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_plan_matches(plan: Plan, parallel_dims: Any) -> None:
    """The mesh TorchTitan built must be the plan's, and every rank must hold the same plan."""
    m = plan.mesh
    built = (parallel_dims.dp_replicate, parallel_dims.dp_shard, parallel_dims.tp,
             parallel_dims.cp, parallel_dims.ep, parallel_dims.etp, parallel_dims.pp)
    if built != (m.dp_replicate, m.dp_shard, m.tp, m.cp, m.ep, m.etp, m.pp):
        raise RuntimeError(f"mesh {built} differs from the plan's {m}")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        digests: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(digests, plan.digest())
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks hold different plans: {sorted(set(digests))}")


def blocks_names(blocks: nn.Module) -> list[str]:
    return [name for name, _ in blocks.named_children()]


def check_part_blocks(plan: Plan, fqns: list[str]) -> None:
    """The blocks of the model (or, under pp, of one stage's model part) must be the plan's
    (or those of one of its stages)."""
    planned = [layer.fqn for layer in plan.layers if layer.kind == "block"]
    if plan.pipeline is not None:
        stages = [[f for f in stage if f in planned] for stage in plan.pipeline.stages]
        if fqns in stages:
            return
    elif fqns == planned:
        return
    raise UserError("the plan's blocks do not match the model; re-plan the job")


        # a stream sharded on the batch: the data-parallel sub-block runs on it as it is


def _sum_allreduce_hook(group: Any, bucket: torch.distributed.GradBucket
                        ) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce a gradient bucket as a sum (DDP's default divides by
    the world size; the loss is already normalised by the global token count)."""
    work = torch.distributed.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def apply_replication(model: nn.Module, dp_mesh: Any, enable_compile: bool) -> None:
    """Pure data parallel: TorchTitan's ``apply_ddp`` (with its compiled-DDP setting) and
    gradients summed like every other plan (TorchTitan 0.2.2's DDP recipe averages them on top
    of its global-token loss normalisation, which changes the numerics). DDP all-reduces the
    gradient accumulated so far, so with gradient accumulation only the last micro-batch may
    synchronise (a sum would count the earlier ones again): the trainer calls
    ``sync_replicas_on_last_microbatch``."""
    from torchtitan.models.llama3.infra.parallelize import apply_ddp

    apply_ddp(model, dp_mesh, enable_compile=enable_compile)
    model.register_comm_hook(dp_mesh.get_group(), _sum_allreduce_hook)


def _shard_routed_experts(experts: nn.Module, parallel_dims: Any, plan: Plan,
                          fsdp: dict[str, Any], reshard_after_forward: bool | int) -> None:
    """FSDP of routed experts over the ranks EP leaves (``efsdp``, with dp_replicate for HSDP),
    as TorchTitan's recipe does: on dim 1 when efsdp x ep exceeds the expert count (dim 0 is
    already split by EP)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
    placement = None
    if plan.mesh.efsdp * plan.mesh.ep > experts.num_experts:
        placement = lambda param: Shard(1)  # noqa: E731
    fully_shard(experts, **{**fsdp, "mesh": parallel_dims.get_mesh(names)},
                reshard_after_forward=reshard_after_forward, shard_placement_fn=placement)


def _experts_on_dim1(experts: nn.Module | None, group: int) -> Any:
    """``shard_placement_fn`` for a block whose routed experts FSDP shards with it (ep = 1):
    on dim 1 where the group outnumbers the experts (FSDP2 would pad dim 0 to the group, up to
    twice their memory), as TorchTitan shards them under EP; None where dim 0 splits."""
    from torch.distributed.tensor import Shard

    if experts is None or group <= experts.num_experts:
        return None
    ids = {id(param) for param in experts.parameters()}
    return lambda param: Shard(1) if id(param) in ids else None


def apply_tensor_parallel(model: nn.Module, adapter: ModelAdapter, tp_mesh: Any,
                          tp_modes: dict[str, str], *, loss_parallel: bool,
                          enable_float8_tensorwise_tp: bool, cp_enabled: bool,
                          embedding: bool = True) -> None:
    """The family's TorchTitan TP + SP plan on the blocks planned "sp" (and the embedding,
    norm and output); blocks planned "dp" run on a batch shard of the tp ranks; blocks planned
    with a sub-block mode get both, each on its own sub-block (``apply_sub_block_tp``). A plan
    whose stream is sharded on the batch has its embedding, norm and output styles shard it
    there, and a plan whose stream is whole on every tp rank (TP without SP) has them take and
    leave it replicated (one stream layout per plan: ``layout.stream_problem``).
    ``embedding`` False: the embedding is left to ``apply_embedding_dim``."""
    blocks = model.get_submodule(adapter.blocks)
    stream = stream_of(tp_modes.values())
    if stream != 1 and not isinstance(resolve(adapter.tp_fn), InferredTP):
        raise UserError(f"a residual stream {STREAM_LAYOUTS[stream]} (tp modes ending "
                        f"{BATCH_STREAM!r} or {REPLICATED_STREAM!r}) needs the family's "
                        "inferred TP plan (ModelAdapter.tp_fn = INFER_TP); use 'dp/sp' or "
                        "'sp/dp'")
    # MoE blocks whose MoE is data parallel: the family's TP + SP for the rest of the block;
    # whose attention is: for the rest too, its function handed the block without it
    moe_dp = moe_sub_block_names(blocks, adapter, tp_modes)
    moe_attention = moe_sub_block_names(blocks, adapter, tp_modes, MOE_ATTENTION_DP)
    own_fn = not isinstance(resolve(adapter.tp_fn), InferredTP)
    adapter.apply_tp(model, tp_mesh, loss_parallel=loss_parallel,
                     block_names=[n for n, mode in tp_modes.items() if mode == "sp"
                                  or n in moe_dp or (own_fn and n in moe_attention)],
                     cp_enabled=cp_enabled, embedding=embedding,
                     enable_float8_tensorwise_tp=enable_float8_tensorwise_tp,
                     stand_ins={n: attention_apart(blocks.get_submodule(n))
                                for n in moe_attention if own_fn},
                     **({"stream": stream} if stream != 1 else {}))
    for name, mode in tp_modes.items():
        if mode == "dp":
            batch_split_over_tp(blocks.get_submodule(name), tp_mesh, adapter.block_args)
        elif name in moe_dp:
            moe_on_sequence_shard(blocks.get_submodule(name), adapter, tp_mesh)
        elif name in moe_attention:
            moe_attention_dp(blocks.get_submodule(name), adapter, tp_mesh,
                             enable_float8_tensorwise_tp)
        elif mode in SUB_BLOCK_TP_MODES:
            apply_sub_block_tp(blocks.get_submodule(name), adapter, tp_mesh, mode,
                               enable_float8_tensorwise_tp)
    from torchtitan.tools.logging import logger

    if moe_attention:
        logger.info(f"{len(moe_attention)} MoE blocks run their attention data parallel over "
                    "tp on a batch shard (weights FSDP over dp_shard x tp)")
    if stream is None:
        logger.info("tensor parallel without sequence parallel: the residual stream whole on "
                    f"every tp rank ({tp_mesh.size()} ranks), the TP modules' output "
                    "all-reduced")
    a2a = [name for name, mode in tp_modes.items() if a2a_mode(mode)]
    if a2a:
        names = a2a_projections(blocks.get_submodule(a2a[0]), adapter)
        logger.info(f"{len(a2a)} blocks run {', '.join(names)} on the sequence shard: input "
                    "all-to-all from the heads over tp, weight all-gathered over tp")


def apply_moe_blocks(model: nn.Module, adapter: ModelAdapter, parallel_dims: Any,
                     job_config: Any, plan: Plan, tp_modes: dict[str, str]) -> None:
    """Routing, token dispatch and the experts' EP / ETP / TP of the MoE blocks (by name, their
    tp modes): TorchTitan's own code, with its gradients under TP corrected
    (``patches.moe``); the MoE of a block in ``MOE_SHARED_DP`` data parallel over
    tp, its experts expert parallel alone (on each tp rank's own tokens) where ep > 1."""
    from torchtitan.distributed.dual_pipe_v import get_dual_pipe_v_flag

    dual_pipe_v = get_dual_pipe_v_flag(job_config, parallel_dims)
    blocks = model.get_submodule(adapter.blocks)
    data_parallel = moe_sub_block_names(blocks, adapter, tp_modes)
    tp_moe = [name for name in tp_modes if name not in data_parallel]
    if tp_moe:
        adapter.apply_moe(model, parallel_dims, dual_pipe_v, block_names=tp_moe)
    if data_parallel and plan.mesh.ep > 1:
        adapter.apply_moe(model, parallel_dims, dual_pipe_v, block_names=data_parallel,
                          tp=False)
    if plan.mesh.tp == 1:
        return
    tp_mesh = parallel_dims.get_mesh("tp")
    # routed experts split over the tp ranks' tokens (ep > 1, etp = 1) or tensor parallel
    # over tp (ep = 1 or etp = tp)
    correct = reduce_sequence_parallel_moe_grads if plan.mesh.ep > 1 and plan.mesh.etp == 1 \
        else reduce_tensor_parallel_router_grads
    for name in tp_moe:
        correct(blocks.get_submodule(name).get_submodule(adapter.moe), tp_mesh)


def moe_sub_block_names(blocks: nn.Module, adapter: ModelAdapter, tp_modes: dict[str, str],
                        tp_mode: str = MOE_SHARED_DP) -> list[str]:
    """The MoE blocks planned in ``tp_mode`` (``MOE_SHARED_DP``: their MoE data parallel over
    tp; ``MOE_ATTENTION_DP``: their attention)."""
    return [name for name, mode in tp_modes.items() if mode == tp_mode
            and adapter.routed_experts(blocks.get_submodule(name)) is not None]


def apply_block_ac(blocks: nn.Module, block_ac: dict[str, str], ac_config: Any, *,
                   model_compile_enabled: bool, op_sac_save_list: set, base_folder: str
                   ) -> None:
    """TorchTitan's ``apply_ac`` once per planned AC mode, on the blocks planned with it
    (selective AC is op-level). ``block_ac``: block name -> "none" / "selective" / "full"."""
    from torchtitan.distributed.activation_checkpoint import apply_ac

    for mode in ("selective", "full"):
        chosen = [name for name, ac in block_ac.items() if ac == mode]
        if not chosen:
            continue
        view = nn.Module()
        view.layers = nn.ModuleDict({name: blocks.get_submodule(name) for name in chosen})
        config = dataclasses.replace(ac_config, mode=mode, selective_ac_option="op")
        apply_ac(view, config, model_compile_enabled=model_compile_enabled,
                 op_sac_save_list=op_sac_save_list, base_folder=base_folder)
        for name, block in view.layers.named_children():
            blocks.register_module(name, block)


def apply_block_compile(blocks: nn.Module, compile_config: Any, *, moe: bool,
                        ep_enabled: bool) -> None:
    """TorchTitan's per-block ``apply_compile`` (after AC, before FSDP): llama3's for dense
    models, llama4's MoE-aware one (as deepseek_v3 / llama4 / qwen3 use) when any block is
    MoE."""
    view = nn.Module()
    view.layers = blocks  # TorchTitan's helpers re-register the compiled blocks in place
    if moe:
        from torchtitan.models.llama4.infra.parallelize import apply_compile

        apply_compile(view, compile_config, ep_enabled)
    else:
        from torchtitan.models.llama3.infra.parallelize import apply_compile

        apply_compile(view, compile_config)


def apply_sharding(model: nn.Module, adapter: ModelAdapter, parallel_dims: Any, plan: Plan,
                   fsdp: dict[str, Any], moe_blocks: dict[str, nn.Module],
                   sub_blocks: dict[str, SubBlocks] | None = None) -> None:
    """FSDP2 per planned group, each with its planned ``reshard_after_forward``: embedding,
    every block or FSDP unit of blocks (one ``fully_shard`` over the unit's blocks; blocks
    using tp as data parallel on dp_shard x tp; routed experts of EP blocks on ``efsdp``),
    norm + output (with the embedding when tied), then the root. A block planned with a
    sub-block mode (``sub_blocks``: by block name, taken before AC / compile wrapped the
    blocks) is one group per sub-block, its norm with its module: on dp_shard x tp where the
    tp dim is data parallel for it, else on the FSDP mesh.
    ``fsdp``: ``fully_shard`` arguments shared by every group (mesh, mp / offload policy)."""
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division

    by_fqn = {layer.fqn: layer for layer in plan.layers}
    blocks = model.get_submodule(adapter.blocks)
    # a pipeline stage holds the embedding, the norm + output, both or neither
    embedding = submodule_or_none(model, adapter.embedding)
    head = [m for m in (submodule_or_none(model, n) for n in (adapter.final_norm, adapter.output)
                        if n) if m is not None]
    tied = embedding is not None and bool(head) and bool(
        {id(p) for p in embedding.parameters()} & {id(p) for p in head[-1].parameters()})
    own = embedding is not None and bool(plan.embedding_mode)
    if own and tied:
        raise UserError(f"tp_mode {plan.embedding_mode!r} for the embedding needs an output that "
                        "does not share its weight; use the default")
    if embedding is not None and not tied and not own:
        fully_shard(embedding, **fsdp,
                    reshard_after_forward=by_fqn[adapter.embedding].reshard_after_forward)
    dp_over_tp, split = None, False
    own_params: set[nn.Parameter] = set()  # sharded by styles of their own
    groups: list[list[nn.Module]] = []  # each block with its separately sharded experts
    unit_of = {layer.fqn: unit for unit in fsdp_units(plan.layers) for layer in unit}
    for name, block in blocks.named_children():
        fqn = f"{adapter.blocks}.{name}"
        layer = by_fqn[fqn]
        group = fsdp
        if split_fsdp(layer.tp_mode):
            if tp_dp_params(layer.tp_mode):
                dp_over_tp = dp_over_tp or dp_over_tp_mesh(parallel_dims, plan, layer.tp_mode)
            experts = adapter.routed_experts(moe_blocks[name]) if name in moe_blocks else None
            own_params |= _shard_sub_blocks((sub_blocks or {})[name], layer, fsdp, dp_over_tp,
                                            experts, parallel_dims, plan)
            split = True
            continue
        if layer.tp_mode == "dp":
            dp_over_tp = dp_over_tp or dp_over_tp_mesh(parallel_dims, plan, "dp")
            group = {**fsdp, "mesh": dp_over_tp}
        groups.append([block])
        placement = None
        if name in moe_blocks and plan.mesh.ep > 1:
            experts = adapter.routed_experts(moe_blocks[name])
            _shard_routed_experts(experts, parallel_dims, plan, fsdp, layer.reshard_after_forward)
            groups[-1].append(experts)
        elif name in moe_blocks:
            placement = _experts_on_dim1(adapter.routed_experts(moe_blocks[name]),
                                         group["mesh"].size())
        unit = unit_of[fqn]
        if fqn == unit[-1].fqn:  # an FSDP unit of several blocks: one call on its last
            members = [blocks.get_submodule(u.fqn[len(adapter.blocks) + 1:]) for u in unit]
            fully_shard(members if len(members) > 1 else block, **group,
                        reshard_after_forward=layer.reshard_after_forward,
                        shard_placement_fn=placement)
    # tied embedding/output weights (qwen3 small flavors) must share one FSDP group
    if head:
        fully_shard([embedding, *head] if tied else head, **fsdp,
                    reshard_after_forward=by_fqn[adapter.output].reshard_after_forward)
    # the embedding looked up on its embedding dim is sharded by its own style
    if own:
        own_params.update(embedding.parameters())
    fully_shard(model, **fsdp, ignored_params=own_params or None)
    if plan.mesh.ep > 1 and not split:  # blocks split into sub-blocks: FSDP's own order
        explicit_prefetch(embedding, groups, head)
    # the loss is already normalised by the global token count (as in TorchTitan's recipes)
    disable_fsdp_gradient_division(model)


def _shard_sub_blocks(parts: SubBlocks, layer: Any, fsdp: dict[str, Any], dp_over_tp: Any,
                      experts: nn.Module | None, parallel_dims: Any, plan: Plan
                      ) -> set[nn.Parameter]:
    """One FSDP group per sub-block of a block planned with a sub-block mode (``parts``): the
    TP + SP one on the FSDP mesh, the data-parallel one on dp_shard x tp (``dp_over_tp``); a
    MoE block's routed ``experts`` sharded with the part that holds them, on ``efsdp`` first
    where expert parallel (on dim 1 where the group outnumbers them). Returns the parameters a
    ``DP_SHARD_TP`` feed-forward's own style shards (no FSDP group)."""
    from torch.distributed.fsdp import fully_shard

    own: set[nn.Parameter] = set()
    reshard = layer.reshard_after_forward
    for mode, modules in parts:
        if mode == DP_SHARD_TP:
            own.update(p for m in modules for p in m.parameters())
            continue
        mesh = dp_over_tp if mode == "dp" else fsdp["mesh"]
        holds = experts is not None and any(experts is inner for module in modules
                                            for inner in module.modules())
        placement = None
        if holds and plan.mesh.ep > 1:
            _shard_routed_experts(experts, parallel_dims, plan, fsdp, reshard)
        elif holds:
            placement = _experts_on_dim1(experts, mesh.size())
        fully_shard(modules, **{**fsdp, "mesh": mesh}, reshard_after_forward=reshard,
                    shard_placement_fn=placement)
    return own


def explicit_prefetch(embedding: nn.Module | None, groups: list[list[nn.Module]],
                      head: list[nn.Module]) -> None:
    """TorchTitan's explicit FSDP prefetch under expert parallelism (llama4 / deepseek_v3
    ``apply_fsdp``): EP's device-to-host syncs would hold back FSDP's implicit prefetch, so in
    forward each group gathers the next block (with its experts), the last one the norm +
    output; in backward the previous block, the first one the embedding. ``groups``: each
    block with its separately sharded experts, in order."""
    if not groups:
        return
    if embedding is not None:
        embedding.set_modules_to_forward_prefetch(groups[0])
    for (block, *_), following in zip(groups, [*groups[1:], head], strict=True):
        if following:
            block.set_modules_to_forward_prefetch(following)
    if head:
        head[-1].set_modules_to_backward_prefetch(groups[-1])
    for (block, *_), preceding in zip(groups, [[embedding] if embedding else [], *groups[:-1]],
                                       strict=True):
        if preceding:
            block.set_modules_to_backward_prefetch(preceding)


def fsdp_arguments(parallel_dims: Any, training: Any, cpu_offload: bool) -> dict[str, Any]:
    """``fully_shard`` arguments of the job: the FSDP mesh (tp alone when only blocks using
    tp as data parallel shard), mixed precision, and FSDP's CPU offload policy when
    ``training.enable_cpu_offload``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    fsdp: dict[str, Any] = {
        "mesh": (parallel_dims.get_mesh(names) if parallel_dims.fsdp_enabled
                 else parallel_dims.get_mesh("tp")),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPES[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce],
        ),
    }
    if cpu_offload:
        fsdp["offload_policy"] = CPUOffloadPolicy()
    return fsdp


def plan_adapter(job_config: Any, model: nn.Module, tp: bool, cp: bool = False,
                 sub_blocks: bool = False) -> ModelAdapter:
    """The family's adapter, discovered from ``model``; for a ``tp`` plan of a family without
    a TP function, with the one planning inferred (``graph/tp_infer.py``); for a ``cp`` plan
    of a family naming no attention module, with the CP planning found
    (``graph/cp_find.py``); for a plan with ``sub_blocks`` of a family naming none, with
    those planning found (``graph/sub_block_find.py``)."""
    adapter = get_adapter(job_config.model.name, model)
    need_tp = tp and adapter.tp_fn in (None, INFER_TP)
    need_cp = cp and adapter.inner_attention is None and adapter.cp_fn is None
    need_sub = sub_blocks and not adapter.sub_blocks
    if not (need_tp or need_cp or need_sub):
        return adapter
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(job_config.model.name)
    inferred = planning_adapter(job_config.model.name, spec.model_args[job_config.model.flavor],
                                spec.model_cls, job_config.training.seq_len)
    for needed, field, technique, what in ((need_tp, "tp_fn", "tp", "TP plan"),
                                           (need_cp, "cp_fn", "cp", "context parallel")):
        if needed and getattr(inferred, field) is None:
            raise UserError(f"the plan uses {technique} but {job_config.model.name!r} has no "
                            f"{what}: {inferred.excluded.get(technique, '')}")
    return dataclasses.replace(adapter, tp_fn=inferred.tp_fn if need_tp else adapter.tp_fn,
                               cp_fn=inferred.cp_fn if need_cp else adapter.cp_fn,
                               sub_blocks=inferred.sub_blocks if need_sub
                               else adapter.sub_blocks)


def apply_plan(model: nn.Module, parallel_dims: Any, job_config: Any, plan: Plan) -> nn.Module:
    """Parallelize ``model`` (on meta) as ``plan`` says, in TorchTitan's order: TP (+ async
    TP), MoE EP / ETP, CP, AC, compile, then FSDP or DDP; the job's features (compile, float8,
    async TP, CPU offload) apply to every planned block."""
    from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp

    check_plan_matches(plan, parallel_dims)
    features = features_from_config(job_config)
    adapter = plan_adapter(job_config, model, tp=plan.mesh.tp > 1, cp=plan.mesh.cp > 1,
                           sub_blocks=any(layer.tp_mode in SUB_BLOCK_TP_MODES
                                          for layer in plan.layers))
    by_fqn = {layer.fqn: layer for layer in plan.layers}
    blocks = model.get_submodule(adapter.blocks)
    planned = {name: by_fqn.get(f"{adapter.blocks}.{name}") for name in blocks_names(blocks)}
    check_part_blocks(plan, [f"{adapter.blocks}.{name}" for name in planned])
    moe_blocks = {name: block for name, block in blocks.named_children()
                  if adapter.routed_experts(block) is not None}
    sub_blocks = planned_sub_blocks(blocks, adapter, planned, features.compile)

    if plan.mesh.tp > 1:
        tp_mesh = parallel_dims.get_mesh("tp")
        tp_modes = {name: layer.tp_mode for name, layer in planned.items()}
        apply_tensor_parallel(
            model, adapter, tp_mesh, tp_modes,
            loss_parallel=not job_config.parallelism.disable_loss_parallel,
            # TorchTitan 0.2.2's recipes test ``"float8" in model.converters``, which never
            # matches the converter's name: auto uses the float8 styles they intend
            enable_float8_tensorwise_tp=features.linear == "float8_tensorwise",
            cp_enabled=plan.mesh.cp > 1, embedding=not plan.embedding_mode,
        )
        if any("sp" in sub_block_modes(mode) for mode in tp_modes.values()):
            maybe_enable_async_tp(job_config, tp_mesh)
    fsdp = fsdp_arguments(parallel_dims, job_config.training, features.cpu_offload) \
        if parallel_dims.fsdp_enabled else None
    if plan.embedding_mode:
        apply_embedding_dim(model, adapter, parallel_dims, plan, fsdp)
    apply_dp_shard_tp(blocks, adapter, parallel_dims,
                      {name: layer.tp_mode for name, layer in planned.items()}, fsdp)

    if moe_blocks and (plan.mesh.tp > 1 or plan.mesh.ep > 1):
        apply_moe_blocks(model, adapter, parallel_dims, job_config, plan,
                         {name: planned[name].tp_mode for name in moe_blocks})

    if plan.mesh.cp > 1 and adapter.cp_fn is not None:
        resolve(adapter.cp_fn)(model, list(blocks.children()), parallel_dims.get_mesh("cp"))
    elif plan.mesh.cp > 1:
        from torchtitan.distributed.context_parallel import apply_cp_to_attention_module

        apply_cp_to_attention_module(
            [block.get_submodule(adapter.inner_attention) for block in blocks.children()],
            parallel_dims.get_mesh("cp"),
            getattr(getattr(model, "model_args", None), "attn_type", "sdpa"),
        )

    apply_block_ac(blocks, {name: layer.ac for name, layer in planned.items()},
                   job_config.activation_checkpoint, model_compile_enabled=features.compile,
                   op_sac_save_list=adapter.sac_save_list(),
                   base_folder=job_config.job.dump_folder)

    # per-block compile after AC and before FSDP, as in TorchTitan's recipes
    if features.compile:
        apply_block_compile(blocks, job_config.compile, moe=bool(moe_blocks),
                            ep_enabled=parallel_dims.ep_enabled)

    apply_data_parallel(model, adapter, parallel_dims, plan, job_config, moe_blocks,
                        sub_blocks, planned)
    return model


def apply_data_parallel(model: nn.Module, adapter: ModelAdapter, parallel_dims: Any,
                        plan: Plan, job_config: Any, moe_blocks: dict[str, nn.Module],
                        sub_blocks: dict[str, SubBlocks], planned: dict[str, Any]) -> None:
    """DDP for a replicate-only plan; else FSDP per planned group (``apply_sharding``), or,
    on tp alone (dp_shard = 1), FSDP over tp of the sub-blocks that use it as data parallel."""
    features = features_from_config(job_config)
    tp_dp = any(tp_dp_params(layer.tp_mode) for layer in plan.layers)
    if parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled and not tp_dp:
        if parallel_dims.tp > 1 or parallel_dims.cp > 1 or parallel_dims.ep > 1:
            raise UserError("pure data-parallel replication is planned with tp = cp = ep = 1 "
                            "only")
        apply_replication(model, parallel_dims.get_mesh("dp_replicate"),
                          enable_compile=features.compile)
    elif parallel_dims.fsdp_enabled or parallel_dims.ep_enabled or tp_dp:
        fsdp = fsdp_arguments(parallel_dims, job_config.training, features.cpu_offload)
        if parallel_dims.fsdp_enabled or parallel_dims.ep_enabled:
            apply_sharding(model, adapter, parallel_dims, plan, fsdp, moe_blocks, sub_blocks)
        else:
            from torchtitan.models.llama3.infra.parallelize import (
                disable_fsdp_gradient_division,
            )

            shard_tp_dp_parts_only(model, planned, plan, parallel_dims, fsdp, sub_blocks)
            disable_fsdp_gradient_division(model)


def sync_replicas_on_last_microbatch(model_parts: list[nn.Module], plan: Plan, microbatch: int
                                     ) -> None:
    """Replicated (DDP) plans: all-reduce gradients on the step's last micro-batch only."""
    if not plan.mesh.replicate_only:
        return
    last = microbatch == plan.gradient_accumulation_steps - 1
    for model in model_parts:
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)
