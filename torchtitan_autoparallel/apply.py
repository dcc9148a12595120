"""Apply a Plan with ordinary PyTorch / TorchTitan calls. Never solves.

Order as in TorchTitan's own parallelize functions: TP (the family's TorchTitan helper), then
activation checkpointing per block (TorchTitan's AC helper with the block's own mode), then
FSDP2 ``fully_shard`` per block with the block's ``reshard_after_forward``, then the root.
"""

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from .errors import UserError
from .graph.adapters import get_adapter
from .plan import Plan

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_plan_matches(plan: Plan, parallel_dims: Any) -> None:
    """The mesh TorchTitan built must be the plan's, and every rank must hold the same plan."""
    m = plan.mesh
    built = (parallel_dims.dp_replicate, parallel_dims.dp_shard, parallel_dims.tp,
             parallel_dims.cp, parallel_dims.ep, parallel_dims.etp)
    if built != (m.dp_replicate, m.dp_shard, m.tp, m.cp, m.ep, m.etp):
        raise RuntimeError(f"mesh {built} differs from the plan's {m}")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        digests: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(digests, plan.digest())
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks hold different plans: {sorted(set(digests))}")


def blocks_names(blocks: nn.Module) -> list[str]:
    return [name for name, _ in blocks.named_children()]


def _batch_split_over_tp(block: nn.Module, tp_mesh: Any, n_args: int) -> None:
    """Run ``block`` on a batch shard: the residual stream arrives sequence-sharded over tp
    (TorchTitan's SP layout), is redistributed to a batch shard (all-to-all) for the block, and
    leaves sequence-sharded again. Its parameters are not split by tp (FSDP shards them over
    dp_shard x tp), so each tp rank runs the whole block on its part of the micro-batch."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        parallelize_module,
    )

    rest = (None,) * (n_args - 1)
    parallelize_module(block, tp_mesh, PrepareModuleInput(
        input_layouts=(Shard(1), *rest), desired_input_layouts=(Shard(0), *rest),
        use_local_output=True))
    parallelize_module(block, tp_mesh, PrepareModuleOutput(
        output_layouts=Shard(0), desired_output_layouts=Shard(1), use_local_output=True))


def _dp_over_tp_mesh(parallel_dims: Any) -> Any:
    """1-D mesh over dp_shard x tp (or tp alone): FSDP mesh of blocks that use tp as data
    parallel. TorchTitan keeps its own flattened ``efsdp`` mesh fake unless EP is on."""
    if parallel_dims.dp_replicate_enabled:
        raise UserError("tp used as data parallel is not supported together with dp_replicate")
    if not parallel_dims.dp_shard_enabled:
        return parallel_dims.get_mesh("tp")
    return parallel_dims.get_mesh(["fsdp", "tp"])._flatten("fsdp_tp")


def _sum_allreduce_hook(group: Any, bucket: torch.distributed.GradBucket
                        ) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce a gradient bucket as a sum (DDP's default divides by
    the world size; the loss is already normalised by the global token count)."""
    work = torch.distributed.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _apply_replication(model: nn.Module, parallel_dims: Any) -> None:
    """Pure data parallel: TorchTitan's ``apply_ddp`` with gradients summed like every other
    plan (TorchTitan 0.2.2's DDP recipe averages them on top of its global-token loss
    normalisation, which changes the numerics). DDP all-reduces the gradient accumulated so far,
    so with gradient accumulation only the last micro-batch may synchronise (a sum would count
    the earlier ones again): the trainer calls ``sync_replicas_on_last_microbatch``."""
    from torchtitan.models.llama3.infra.parallelize import apply_ddp

    if parallel_dims.tp > 1 or parallel_dims.cp > 1 or parallel_dims.ep > 1:
        raise UserError("pure data-parallel replication is planned with tp = cp = ep = 1 only")
    mesh = parallel_dims.get_mesh("dp_replicate")
    apply_ddp(model, mesh, enable_compile=False)
    model.register_comm_hook(mesh.get_group(), _sum_allreduce_hook)


def _shard_routed_experts(experts: nn.Module, parallel_dims: Any, plan: Plan, mp_policy: Any,
                          reshard_after_forward: bool) -> None:
    """FSDP of routed experts over the ranks EP leaves (``efsdp``, with dp_replicate for HSDP),
    as TorchTitan's recipe does: on dim 1 when efsdp x ep exceeds the expert count (dim 0 is
    already split by EP)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
    placement = None
    if plan.mesh.efsdp * plan.mesh.ep > experts.num_experts:
        placement = lambda param: Shard(1)  # noqa: E731
    fully_shard(experts, mesh=parallel_dims.get_mesh(names), mp_policy=mp_policy,
                reshard_after_forward=reshard_after_forward, shard_placement_fn=placement)


def apply_plan(model: nn.Module, parallel_dims: Any, job_config: Any, plan: Plan) -> nn.Module:
    """Parallelize ``model`` (on meta) as ``plan`` says."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.distributed.activation_checkpoint import _apply_ac_to_transformer_block
    from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division

    check_plan_matches(plan, parallel_dims)
    adapter = get_adapter(job_config.model.name, model)
    by_fqn = {layer.fqn: layer for layer in plan.layers}
    blocks = model.get_submodule(adapter.blocks)
    names = [f"{adapter.blocks}.{n}" for n, _ in blocks.named_children()]
    if [fqn for fqn in by_fqn if by_fqn[fqn].kind == "block"] != names:
        raise UserError("the plan's blocks do not match the model; re-plan the job")

    if plan.mesh.tp > 1:
        tp_mesh = parallel_dims.get_mesh("tp")
        modes = {name: by_fqn[f"{adapter.blocks}.{name}"].tp_mode for name in blocks_names(blocks)}
        adapter.apply_tp(model, tp_mesh,
                         loss_parallel=not job_config.parallelism.disable_loss_parallel,
                         block_names=[n for n, mode in modes.items() if mode == "sp"],
                         cp_enabled=plan.mesh.cp > 1)
        for name, mode in modes.items():
            if mode == "dp":
                _batch_split_over_tp(blocks.get_submodule(name), tp_mesh, adapter.block_args)

    moe_blocks = {name: block for name, block in blocks.named_children()
                  if adapter.routed_experts(block) is not None}
    if moe_blocks and (plan.mesh.tp > 1 or plan.mesh.ep > 1):
        # routing, token dispatch and the experts' EP / ETP / TP: TorchTitan's own code
        adapter.apply_moe(model, parallel_dims)

    if plan.mesh.cp > 1:
        from torchtitan.distributed.context_parallel import apply_cp_to_attention_module

        apply_cp_to_attention_module(
            [block.get_submodule(adapter.inner_attention) for block in blocks.children()],
            parallel_dims.get_mesh("cp"),
            getattr(getattr(model, "model_args", None), "attn_type", "sdpa"),
        )

    for name, block in list(blocks.named_children()):
        layer = by_fqn[f"{adapter.blocks}.{name}"]
        if layer.ac == "none":
            continue
        ac_config = dataclasses.replace(job_config.activation_checkpoint, mode=layer.ac,
                                        selective_ac_option="op")
        wrapped = _apply_ac_to_transformer_block(
            block, ac_config, base_fqn=layer.fqn, op_sac_save_list=adapter.sac_save_list()
        )
        blocks.register_module(name, wrapped)

    if (parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled
            and not any(layer.tp_mode == "dp" for layer in plan.layers)):
        _apply_replication(model, parallel_dims)
    elif (parallel_dims.fsdp_enabled or parallel_dims.ep_enabled
            or any(layer.tp_mode == "dp" for layer in plan.layers)):
        mesh_dims = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        training = job_config.training
        fsdp = {
            "mesh": (parallel_dims.get_mesh(mesh_dims) if parallel_dims.fsdp_enabled
                     else parallel_dims.get_mesh("tp")),
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=TORCH_DTYPES[training.mixed_precision_param],
                reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce],
            ),
        }
        embedding = model.get_submodule(adapter.embedding)
        head = [model.get_submodule(n) for n in (adapter.final_norm, adapter.output) if n]
        tied = {id(p) for p in embedding.parameters()} & {
            id(p) for p in head[-1].parameters()}
        if not tied:
            fully_shard(embedding, **fsdp,
                        reshard_after_forward=by_fqn[adapter.embedding].reshard_after_forward)
        dp_over_tp = None
        for name, block in blocks.named_children():
            layer = by_fqn[f"{adapter.blocks}.{name}"]
            mesh = fsdp["mesh"]
            if layer.tp_mode == "dp":
                dp_over_tp = dp_over_tp or _dp_over_tp_mesh(parallel_dims)
                mesh = dp_over_tp
            if name in moe_blocks and plan.mesh.ep > 1:
                _shard_routed_experts(adapter.routed_experts(block), parallel_dims, plan,
                                      fsdp["mp_policy"], layer.reshard_after_forward)
            fully_shard(block, mesh=mesh, mp_policy=fsdp["mp_policy"],
                        reshard_after_forward=layer.reshard_after_forward)
        # tied embedding/output weights (qwen3 small flavors) must share one FSDP group
        fully_shard([embedding, *head] if tied else head, **fsdp,
                    reshard_after_forward=by_fqn[adapter.output].reshard_after_forward)
        fully_shard(model, **fsdp)
        # the loss is already normalised by the global token count (as in TorchTitan's recipes)
        disable_fsdp_gradient_division(model)
    return model


def sync_replicas_on_last_microbatch(model_parts: list[nn.Module], plan: Plan, microbatch: int
                                     ) -> None:
    """Replicated (DDP) plans: all-reduce gradients on the step's last micro-batch only."""
    if not plan.mesh.replicate_only:
        return
    last = microbatch == plan.gradient_accumulation_steps - 1
    for model in model_parts:
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)
