"""What ``apply_plan`` built, read back from the modules: float8 linears, float8 all-gather
weights, compile wrappers, FSDP groups. The dry run reports it; tests compare it with
TorchTitan's own recipes."""

from __future__ import annotations

from typing import Any


def block_features(model: Any, blocks: str = "layers") -> dict[str, dict[str, Any]]:
    """What was built in each block of ``model.<blocks>``: float8 linears (and the names of
    those left in bf16), weights FSDP
    all-gathers in float8, compile wrappers, the mesh dims of its sharded weights and whether
    FSDP offloads it to CPU. Read back by the dry-run tests."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn import Linear

    try:
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError:  # torchao absent: no float8 job can have run
        Float8Linear = WeightWithDynamicFloat8CastTensor = ()  # noqa: N806

    out: dict[str, dict[str, Any]] = {}
    children = dict(model.get_submodule(blocks).named_children())
    groups = {name: _param_group(block) for name, block in children.items()}
    for name, block in children.items():
        weights = [p for m in block.modules() if isinstance(m, Float8Linear)
                   for p in m.parameters(recurse=False)]
        local = [getattr(p, "_local_tensor", p) for p in weights]
        mesh = next((p.device_mesh for p in block.parameters() if hasattr(p, "device_mesh")),
                    None)
        out[name] = {
            "float8_linears": sum(isinstance(m, Float8Linear) for m in block.modules()),
            "bf16_linears": sorted(_plain_name(name) for name, m in block.named_modules()
                                   if isinstance(m, Linear) and not isinstance(m, Float8Linear)),
            "float8_all_gather": sum(isinstance(t, WeightWithDynamicFloat8CastTensor)
                                     for t in local),
            "compiled": sum(isinstance(m, OptimizedModule) for m in block.modules()),
            "block_compiled": isinstance(block, OptimizedModule),
            "mesh": list(mesh.mesh_dim_names or ()) if mesh is not None else [],
            **fsdp_group(block),
        }
        if groups[name] is not None:  # the blocks sharing its FSDP unit (itself alone: [name])
            out[name]["fsdp_unit"] = [n for n, g in groups.items() if g is groups[name]]
    return out


def _plain_name(name: str) -> str:
    """A submodule's name without the compile and checkpoint wrappers' parts."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _param_group(module: Any) -> Any:
    """FSDP2's parameter group of ``module`` (shared by the modules of one ``fully_shard``
    call), or None."""
    state = getattr(module, "_get_fsdp_state", None)
    return state()._fsdp_param_group if state is not None else None


def fsdp_group(module: Any) -> dict[str, Any]:
    """How FSDP2 manages ``module``'s own parameter group (empty when it is no FSDP module):
    resharding after forward, explicit prefetch (groups gathered next in forward, backward),
    CPU offload, parameter and gradient-reduction dtypes."""
    group = _param_group(module)
    if group is None:
        return {}
    # FSDP2: no post-forward mesh = keep; its own mesh = reshard; a smaller one = the integer
    post = group.post_forward_mesh_info
    reshard: bool | int = (False if post is None else True if post is group.mesh_info
                           else post.shard_mesh_size)
    fsdp_state = module._get_fsdp_state()
    return {"reshard_after_forward": reshard,
            "prefetch": [len(fsdp_state._states_to_forward_prefetch),
                         len(fsdp_state._states_to_backward_prefetch)],
            "cpu_offload": type(group.offload_policy).__name__ == "CPUOffloadPolicy",
            "param_dtype": str(group.mp_policy.param_dtype),
            "reduce_dtype": str(group.mp_policy.reduce_dtype)}
