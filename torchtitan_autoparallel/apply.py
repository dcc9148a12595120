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
    built = (parallel_dims.dp_replicate, parallel_dims.dp_shard, parallel_dims.tp)
    if built != (m.dp_replicate, m.dp_shard, m.tp):
        raise RuntimeError(f"mesh {built} differs from the plan's {m}")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        digests: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(digests, plan.digest())
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks hold different plans: {sorted(set(digests))}")


def apply_plan(model: nn.Module, parallel_dims: Any, job_config: Any, plan: Plan) -> nn.Module:
    """Parallelize ``model`` (on meta) as ``plan`` says."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.distributed.activation_checkpoint import _apply_ac_to_transformer_block
    from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division

    check_plan_matches(plan, parallel_dims)
    adapter = get_adapter(job_config.model.name)
    by_fqn = {layer.fqn: layer for layer in plan.layers}
    blocks = model.get_submodule(adapter.blocks)
    names = [f"{adapter.blocks}.{n}" for n, _ in blocks.named_children()]
    if [fqn for fqn in by_fqn if by_fqn[fqn].kind == "block"] != names:
        raise UserError("the plan's blocks do not match the model; re-plan the job")

    if plan.mesh.tp > 1:
        adapter.apply_tp(model, parallel_dims.get_mesh("tp"),
                         loss_parallel=not job_config.parallelism.disable_loss_parallel)

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

    if parallel_dims.fsdp_enabled:
        mesh_dims = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        training = job_config.training
        fsdp = {
            "mesh": parallel_dims.get_mesh(mesh_dims),
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=TORCH_DTYPES[training.mixed_precision_param],
                reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce],
            ),
        }
        emb = by_fqn[adapter.embedding]
        fully_shard(model.get_submodule(adapter.embedding), **fsdp,
                    reshard_after_forward=emb.reshard_after_forward)
        for name, block in blocks.named_children():
            layer = by_fqn[f"{adapter.blocks}.{name}"]
            fully_shard(block, **fsdp, reshard_after_forward=layer.reshard_after_forward)
        out = by_fqn[adapter.output]
        fully_shard([model.get_submodule(adapter.final_norm), model.get_submodule(adapter.output)],
                    **fsdp, reshard_after_forward=out.reshard_after_forward)
        fully_shard(model, **fsdp)
        # the loss is already normalised by the global token count (as in TorchTitan's recipes)
        disable_fsdp_gradient_division(model)
    return model
