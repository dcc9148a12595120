"""The placements below the block on TorchTitan 0.3.0 (``candidates.layout``): the tp mesh dim
used as data parallel (blocks planned "dp", the data-parallel sub-block of the sub-block
modes), the stream sharded on the batch over tp, the attention's output projection on the
sequence shard, the feed-forward TP over dp_shard and the embedding on its embedding dim.

The model declares TP + SP for every module (``sharding_config``, applied by
``model.parallelize``). For a part that runs data parallel over tp, those declarations are
dropped before ``model.parallelize`` (its weights stay whole on tp) and its forward is
wrapped as 0.3.0 wraps a declared module's: the residual stream arrives sequence-sharded over
tp (Shard(1)), is redistributed to a batch shard (Shard(0), an all-to-all) at the module's
input and back at its output where the module is a block or an attention; a feed-forward
(per token) and a sub-block's norm run on the local sequence shard. FSDP then
shards (and sums the gradients of) such a part over dp_shard x tp (``fsdp_arguments``); the
TP + SP parts are sharded over dp_shard as the others. A stream sharded on the batch rewrites
the declarations of the sequence-parallel layout (``batch_stream``); the other placements
keep the declarations they share with TorchTitan's and replace the rest with this
project's styles (``runtime/styles.py``). Under the ``spmd_types`` and ``partial_dtensor``
backends (the residual stream a local shard, or a DTensor)."""

from __future__ import annotations

from typing import Any

from ...candidates.layout import (
    DP_SHARD_TP,
    MOE_ATTENTION_DP,
    MOE_SHARED_DP,
    MOE_SUB_BLOCK_MODES,
    SUB_BLOCK_TP_MODES,
    a2a_mode,
    shared_experts_dp,
    split_fsdp,
    stream_dim,
    stream_problem,
    sub_block_modes,
    tp_dp_problem,
    without_shared_dp,
)
from ...errors import UserError

SUB_BLOCKS = (("attention_norm", "attention"), ("ffn_norm", "feed_forward"))
"""(norm, module) of a dense 0.3.0 decoder block's attention and feed-forward (llama3, qwen3):
each module's input is its norm's output, the block adds it to the residual stream."""

TP_DP_FAMILIES = ("llama3", "qwen3")
"""TorchTitan 0.3.0's dense text decoders: what this module applies the tp dim as data parallel
to (the multimodal families pass positions and masks it does not split, the HF backend
declares its own sharding)."""

ATTENTION_DP_FAMILIES = (*TP_DP_FAMILIES, "deepseek_v3")
"""The families whose MoE blocks' attention this module runs data parallel over tp
(``layout.MOE_ATTENTION_DP``): the dense decoders' attention and DeepSeek-V3's MLA, whose
arguments (positions; masks under SDPA: none) split by batch."""

Parts = list[tuple[str, list[Any]]]
"""A block's FSDP groups: (the tp dim's use: "sp", "dp", ``DP_SHARD_TP``, or a MoE block's
``MOE_SHARED`` / ``MOE_BLOCK``; the modules of the group)."""


SUB_BLOCKS_APPLIED = SUB_BLOCK_TP_MODES
"""The sub-block tp modes this apply runs: every linear of a sub-block placed alike, on the
model's sequence-sharded stream or, with ``layout.BATCH_STREAM``, on a stream sharded on the
batch over tp (``batch_stream``), the attention's output projection on the sequence shard
(``projections_a2a``), the feed-forward TP over dp_shard (``apply_dp_shard_tp``) and
``layout.TP_WITHOUT_SP`` (TorchTitan's ``parallelism.enable_sequence_parallel`` off,
``apply._sequence_parallel``) and a data-parallel sub-block beside it on that replicated
stream (``_batch_split_of_replicated``): all of ``layout.SUB_BLOCK_TP_MODES``."""


def tp_dp_parts(model: Any, plan: Any, blocks: dict[str, Any], parallelism: Any,
                compiled: bool) -> dict[str, Parts]:
    """By block name, the FSDP groups of each block whose plan runs some part data parallel
    over tp: the block ("dp") or each sub-block's norm and module (sub-block modes). Taken
    before AC wraps the blocks; a one-line UserError for what this apply cannot run (a
    stream sharded on the batch included)."""
    planned = {name: plan_layer(plan, name).tp_mode for name in blocks}
    chosen = {name: mode for name, mode in planned.items()
              if _own_groups(mode) or stream_dim(mode) == 0 or a2a_mode(mode)}
    if not chosen:
        return {}
    for mode in sorted(set(chosen.values())):
        problem = tp_dp_problem(plan.mesh, plan.local_batch_size, tp_mode=mode) or \
            stream_problem(list(planned.values()))
        if problem:
            raise UserError(f"plan: {problem}")
    mode = next(iter(chosen.values()))
    use = "the stream sharded on the batch over tp" if stream_dim(mode) == 0 else \
        "the output projection on the sequence shard" if a2a_mode(mode) else \
        "the feed-forward TP over dp_shard" if DP_SHARD_TP in sub_block_modes(mode) else \
        "the tp dim as data parallel"
    where = f"tp_mode {mode!r} ({use})"
    if compiled:
        raise UserError(f"{where} is not applied to compiled blocks on TorchTitan 0.3.0 "
                        "(FSDP's hooks would sit inside them): drop --compile.enable or use 'sp'")
    if parallelism.spmd_backend == "full_dtensor":
        raise UserError(f"{where} is not applied under --parallelism.spmd_backend full_dtensor "
                        "(DP and TP in one DTensor mesh): use spmd_types or partial_dtensor")
    module = type(model).__module__
    moe = {name for name in chosen if getattr(blocks[name], "moe_enabled", False)}
    dense = next((name for name in set(chosen) - moe if shared_experts_dp(chosen[name])), None)
    if dense:
        raise UserError(f"plan: layers.{dense} is a dense block in tp_mode {chosen[dense]!r}, "
                        "a MoE block's mode (its shared experts data parallel over tp): use "
                        "'sp' or a dense block's mode")
    dense_only = next((name for name in moe if chosen[name] not in MOE_SUB_BLOCK_MODES), None)
    if dense_only:
        raise UserError(f"plan: {dense_only} is a MoE block in tp_mode {chosen[dense_only]!r}, "
                        "which TorchTitan 0.3.0's apply runs on dense blocks only: use 'sp' or "
                        f"one of {', '.join(map(repr, MOE_SUB_BLOCK_MODES))}")
    if set(chosen) - moe and not _of_families(model, TP_DP_FAMILIES):
        raise UserError(f"{where} is applied to {' and '.join(TP_DP_FAMILIES)} only (the model "
                        f"is {module}.{type(model).__name__}): use 'sp'")
    if any(sub_block_modes(chosen[name])[0] == "dp" for name in moe) and not _of_families(
            model, ATTENTION_DP_FAMILIES):
        raise UserError(f"tp_mode {MOE_ATTENTION_DP!r} on MoE blocks (the attention data "
                        f"parallel over tp) is applied to {', '.join(ATTENTION_DP_FAMILIES)} "
                        f"only (the model is {module}.{type(model).__name__}): use 'sp' or "
                        f"{MOE_SHARED_DP!r}")
    _check_batch_stream(model, list(chosen.values()), where)
    out = {}
    for name, block_mode in chosen.items():
        if not _own_groups(block_mode):
            continue  # TP on both: the model's declarations (batch_stream, projections_a2a)
        block = blocks[name]
        if name in moe:
            out[name] = moe_parts(block, plan.mesh, block_mode)
            continue
        if not all(hasattr(block, part) for pair in SUB_BLOCKS for part in pair):
            raise UserError(f"{where} needs a dense block with {', '.join(SUB_BLOCKS[0])}, "
                            f"{', '.join(SUB_BLOCKS[1])} (layers.{name} is "
                            f"{type(block).__name__}): use 'sp'")
        out[name] = [("dp", [block])] if block_mode == "dp" else [
            (sub_mode, [getattr(block, norm), getattr(block, module)])
            for (norm, module), sub_mode in zip(SUB_BLOCKS, sub_block_modes(block_mode),
                                                strict=True)]
    return out


MOE_SHARED = "dp:shared"
"""The part of a MoE block in ``layout.MOE_SUB_BLOCK_MODES`` that FSDP shards over dp_shard x
tp: its shared experts (``moe_parts``)."""

MOE_SHARED_CUT = "dp:shared_cut"
"""The shared experts of a MoE block in a ``layout.SHARED_DP`` mode (ep = 1), FSDP over
dp_shard x tp: run on this tp rank's sequence shard, cut from the input the model's MoE TP
gathers (``_run_on_cut``)."""

MOE_DP = "dp:moe"
"""A MoE block's whole MoE (router, shared and routed experts) data parallel over tp: what
"sp/dp" runs with ep = 1 (``moe_on_sequence_shard``), FSDP over dp_shard x tp."""

MOE_BLOCK = "sp:moe"
"""The rest of such a block: the whole block as the model declares it, FSDP over dp_shard with
the experts' placement, its data-parallel part's group inside it."""


def moe_parts(block: Any, mesh: Any, tp_mode: str) -> Parts:
    """The FSDP groups of a MoE block in one of ``layout.MOE_SUB_BLOCK_MODES``: the
    data-parallel part whole on tp over dp_shard x tp, then the block as the model declares
    the rest (``MOE_BLOCK``). "sp/dp" with ep > 1: the shared experts data parallel
    (``MOE_SHARED``): the model already routes each tp rank's sequence shard to its experts
    (its router's weight replicated on tp, its token counts summed over tp); its shared
    experts alone are tensor parallel, and they run on the local sequence shard instead.
    "sp/dp" with ep = 1: the whole MoE (``MOE_DP``) on the local sequence shard in place of
    the model's MoE TP. "dp/sp": the attention and its norm data parallel on a batch shard (as
    a dense block's), the MoE as the model runs it. With ``layout.SHARED_DP`` (ep = 1): the
    shared experts (``MOE_SHARED_CUT``) apart from the model's MoE TP, the attention as the
    mode says; a one-line error for a MoE without shared experts."""
    if shared_experts_dp(tp_mode):
        if block.moe.shared_experts is None:
            raise UserError(f"tp_mode {tp_mode!r} runs a MoE's shared experts data parallel, "
                            f"and this model's MoE has none: use 'sp' or {MOE_SHARED_DP!r}")
        base = without_shared_dp(tp_mode)
        return [*(moe_parts(block, mesh, base)[:-1] if base != "sp" else []),
                (MOE_SHARED_CUT, [block.moe.shared_experts]), (MOE_BLOCK, [block])]
    if sub_block_modes(tp_mode)[0] == "dp":
        return [("dp", [getattr(block, part) for part in SUB_BLOCKS[0]]), (MOE_BLOCK, [block])]
    if mesh.ep == 1:
        return [(MOE_DP, [block.moe]), (MOE_BLOCK, [block])]
    shared = block.moe.shared_experts
    return ([(MOE_SHARED, [shared])] if shared is not None else []) + [(MOE_BLOCK, [block])]


def _of_families(model: Any, families: tuple[str, ...]) -> bool:
    """Whether ``model`` is one of TorchTitan 0.3.0's ``families``."""
    return any(type(model).__module__.startswith(f"torchtitan.models.{f}.") for f in families)


def _own_groups(tp_mode: str) -> bool:
    """Whether a block in ``tp_mode`` has FSDP groups of its own: a "dp" block (over
    dp_shard x tp), a sub-block mode's groups per sub-block (``layout.split_fsdp``)."""
    return tp_mode == "dp" or split_fsdp(tp_mode)


def _check_batch_stream(model: Any, modes: list[str], where: str) -> None:
    """A one-line UserError where a stream sharded on the batch meets modules that read the
    sequence shard inside their own kernels (dist-GEMM's fused all-gather / reduce-scatter)."""
    from torchtitan.models.common.dist_gemm import AllGatherFusedFeedForward, RowParallelLinear

    if all(stream_dim(mode) == 1 for mode in modes):
        return
    fused = next((name for name, module in model.named_modules()
                  if isinstance(module, (AllGatherFusedFeedForward, RowParallelLinear))), None)
    if fused is not None:
        raise UserError(f"{where} is not applied beside dist-GEMM modules ({fused} gathers "
                        "the sequence shard in its kernel): turn dist-GEMM off or use 'sp'")


def projections_a2a(blocks: dict[str, Any], plan: Any, tp_mesh: Any) -> None:
    """Before ``model.parallelize``, for blocks planned in ``layout.A2A_MODES``: the
    attention's output projection keeps the model's row-wise weight (Shard(1) over tp) and
    drops its output declaration; its input (sharded on the heads) moves onto the sequence
    shard by an all-to-all over tp, its weight is all-gathered over tp for the matmul (its
    gradient reduce-scattered back), and its output is the stream's sequence shard, with no
    reduce-scatter."""
    import torch.nn.functional as F
    from torch.distributed._functional_collectives import all_gather_tensor_autograd
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.tools.logging import logger

    names = [name for name in blocks if a2a_mode(plan_layer(plan, name).tp_mode)]
    if names:
        logger.info(f"{len(names)} blocks run attention.wo on the sequence shard (all-to-all "
                    "from the heads, weight gathered over tp)")
    for name in names:
        block = blocks[name]
        wo = block.attention.wo
        if getattr(wo, "bias", None) is not None or wo._sharding_config is None:
            raise UserError(f"tp_mode {plan_layer(plan, name).tp_mode!r} runs layers.{name}."
                            "attention.wo as a bias-free row-wise linear; use 'sp'")
        wo._sharding_config = type(wo._sharding_config)(
            state_shardings=wo._sharding_config.state_shardings)

        def forward(x: Any, wo: Any = wo) -> Any:
            wrapped = isinstance(x, DTensor)
            heads = x if wrapped else DTensor.from_local(x, tp_mesh, [Shard(2)], run_check=False)
            local = heads.redistribute(tp_mesh, [Shard(1)]).to_local()
            weight = wo.weight.to_local() if isinstance(wo.weight, DTensor) else wo.weight
            out = F.linear(local, all_gather_tensor_autograd(weight, 1, tp_mesh.get_group()))
            return DTensor.from_local(out, tp_mesh, [Shard(1)]) if wrapped else out

        wo.forward = forward


def batch_stream(model: Any, plan: Any) -> None:
    """Before ``model.parallelize``, for a plan whose stream is sharded on the batch over tp
    (``layout.BATCH_STREAM``): every declaration of TorchTitan's sequence-parallel layout
    (embedding output, norms, the attention's and feed-forward's input, wo's and w2's
    output, the final norm's input) reads the batch shard instead, so TP sub-blocks
    all-gather and reduce-scatter the stream on the batch."""
    import dataclasses

    from torchtitan.models.common.decoder_sharding import (
        CP,
        DP,
        TP,
        dense_sequence_parallel_placement,
    )
    from torchtitan.protocols.sharding import SpmdLayout

    if plan.stream == 1:
        return
    sequence = dense_sequence_parallel_placement()
    batch = SpmdLayout(dict(sequence.axis_types), partition_spec=((DP, TP), CP, None))

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(swap(v) for v in value)
        return batch if value == sequence else value

    for module in model.modules():
        config = getattr(module, "_sharding_config", None)
        if config is not None:
            module._sharding_config = dataclasses.replace(config, **{
                f: swap(getattr(config, f)) for f in ("in_src_shardings", "in_dst_shardings",
                                                       "out_src_shardings", "out_dst_shardings")})


def plan_layer(plan: Any, name: str) -> Any:
    """The plan's entry of block ``name``."""
    return next(layer for layer in plan.layers if layer.fqn == f"layers.{name}")


def dp_shard_tp_parts(parts: dict[str, Parts]) -> list[tuple[Any, Any]]:
    """(norm, feed-forward) of each block whose feed-forward is planned ``DP_SHARD_TP``; their
    declarations dropped (before ``model.parallelize``): ``apply_dp_shard_tp`` places them."""
    found = [modules for groups in parts.values() for mode, modules in groups
             if mode == DP_SHARD_TP]
    for modules in found:
        _drop_declarations(modules)
    return [tuple(modules) for modules in found]


def _drop_declarations(modules: list[Any], keep_state: bool = False) -> None:
    """``modules`` and everything in them keep their weights whole on tp: their sharding
    declarations dropped (before ``model.parallelize``); ``keep_state``: the first module's
    own state declarations kept (a MoE's buffers placed as in the model's other blocks)."""
    from torchtitan.protocols.sharding import ShardingConfig

    for module in modules:
        for inner in module.modules():
            if hasattr(inner, "_sharding_config"):
                config = inner._sharding_config
                keep = keep_state and inner is modules[0] and config is not None
                inner._sharding_config = ShardingConfig(
                    state_shardings=config.state_shardings) if keep else None


def apply_dp_shard_tp(found: list[tuple[Any, Any]], parallel_dims: Any, dtype: Any) -> None:
    """After ``model.parallelize``: each feed-forward in ``found`` tensor parallel over
    dp_shard on the 2-D (dp_shard, tp) mesh (``runtime.styles.dp_shard_tp_styles``: w1 / w3
    column-wise, w2 row-wise, weights also split over tp and gathered for their matmuls), its
    norm's weight read whole, weights read in ``dtype``; on the stream's local sequence shard
    (a DTensor's local shard under ``partial_dtensor``, wrapped back after the feed-forward's
    reduce-scatter)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.tools.logging import logger

    from ...runtime.styles import dp_shard_tp_styles

    if not found:
        return
    mesh = parallel_dims.get_mesh([_dp_shard_name(parallel_dims), "tp"])
    tp_mesh = parallel_dims.get_mesh("tp")
    wrapped = parallel_dims.spmd_backend == "partial_dtensor"
    for norm, module in found:
        norm_style, module_style = dp_shard_tp_styles(
            {"w1": "colwise", "w3": "colwise", "w2": "rowwise"}, dtype)
        parallelize_module(norm, mesh, norm_style)
        parallelize_module(module, mesh, module_style)
        if wrapped:
            inner = norm.forward
            norm.forward = lambda x, inner=inner: inner(
                x.to_local() if isinstance(x, DTensor) else x)
            module.register_forward_hook(
                lambda _, __, out: DTensor.from_local(out, tp_mesh, [Shard(1)]))
    logger.info(f"{len(found)} blocks run feed_forward tensor parallel over dp_shard "
                f"({parallel_dims.dp_shard} ranks), its weights gathered over tp")


def override_declared_sharding(parts: dict[str, Parts], tp_mesh: Any,
                               stream: int | None = 1) -> None:
    """Before ``model.parallelize``: each data-parallel part keeps its weights whole on tp
    (its modules' declarations dropped); on the sequence-sharded stream (``stream`` 1) a
    block or an attention runs on a batch shard, a feed-forward (per token) and a sub-block's
    norm on the local sequence shard; on a stream sharded on the batch (0) every part runs
    on the local batch shard as it is; on a replicated stream (None) a sub-block cuts its
    batch shard (``_batch_split_of_replicated``)."""
    from torchtitan.tools.logging import logger

    _log_moe_parts(parts)
    split = sum(len(modules) == 2 for groups in parts.values() for mode, modules in groups
                if mode == "dp")
    if split and stream is None:
        logger.info(f"{split} sub-blocks run data parallel over tp on a batch shard of the "
                    "replicated stream (output all-gathered over tp)")
    for groups in parts.values():
        for part, (mode, modules) in enumerate(groups):
            if mode in (MOE_SHARED, MOE_DP, MOE_SHARED_CUT):  # per token, on the local shard
                _drop_declarations(modules, keep_state=mode == MOE_DP)
                if mode == MOE_DP:
                    moe_on_sequence_shard(modules[0], tp_mesh)
                elif mode == MOE_SHARED_CUT:
                    _run_on_cut(modules[0], tp_mesh)
                else:
                    _run_on_local_shard(modules[0], tp_mesh, 1)
                continue
            if mode != "dp":
                continue
            _drop_declarations(modules)
            if len(modules) == 1:
                _run_on_batch_shard(modules[0], tp_mesh)
                continue
            norm, module = modules
            if stream is None:
                _batch_split_of_replicated(norm, module, tp_mesh)
                continue
            _run_on_local_shard(norm, tp_mesh, stream)
            if part == 0 and stream == 1:  # the attention reads whole sequences
                _run_on_batch_shard(module, tp_mesh)
            else:
                _run_on_local_shard(module, tp_mesh, stream, split=part == 0)


def _log_moe_parts(parts: dict[str, Parts]) -> None:
    """What the MoE blocks' data-parallel parts run, in the training log."""
    from torchtitan.tools.logging import logger

    for kind, what in ((MOE_SHARED, "their shared experts"),
                       (MOE_SHARED_CUT, "their shared experts (routed experts TP)"),
                       (MOE_DP, "their MoE (router, shared and routed experts)")):
        count = sum(mode == kind for groups in parts.values() for mode, _ in groups)
        if count:
            logger.info(f"{count} MoE blocks run {what} data parallel over tp on the sequence "
                        "shard (weights FSDP over dp_shard x tp)")


def moe_on_sequence_shard(moe: Any, tp_mesh: Any) -> None:
    """A whole MoE (weights whole on tp) run per token on this tp rank's sequence shard:
    router, shared and routed experts on those tokens alone, its load-balancing buffers read
    through their local tensors, and the token counts it adds summed over tp, so every tp
    rank counts the whole micro-batch, as under the model's MoE TP (what TorchTitan's
    expert-bias update reads; it sums them over tp itself only under expert parallel)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    inner = moe.forward

    def forward(x: Any) -> Any:
        counts, bias = moe.tokens_per_expert_E, getattr(moe, "expert_bias_E", None)
        added = torch.zeros_like(local(counts))
        moe.tokens_per_expert_E = added
        if bias is not None:
            moe.expert_bias_E = local(bias)
        try:
            out = inner(local(x))
        finally:
            moe.tokens_per_expert_E = counts
            if bias is not None:
                moe.expert_bias_E = bias
        if moe.training:
            dist.all_reduce(added, group=tp_mesh.get_group())
            with torch.no_grad():
                local(counts).add_(added)
        return DTensor.from_local(out, tp_mesh, [Shard(1)]) if isinstance(x, DTensor) else out

    moe.forward = forward


def _run_on_cut(module: Any, tp_mesh: Any) -> None:
    """``module`` (weights whole on tp) run on this tp rank's sequence shard of an input whole
    on every tp rank (what the model's MoE TP gathers): cut locally, no collective; the input
    gradient it leaves is that cut's rows alone, a partial sum over tp that the gather's
    backward reduce-scatters with the routed experts' one. Its output is this rank's sequence
    shard of the stream, of the input's kind (a DTensor under ``partial_dtensor``)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    inner = module.forward

    def forward(x: Any) -> Any:
        wrapped = isinstance(x, DTensor)
        whole = x.to_local(grad_placements=[Partial()]) if wrapped else x
        size = whole.shape[1] // tp_mesh.size()
        out = inner(whole.narrow(1, tp_mesh.get_local_rank() * size, size))
        return DTensor.from_local(out, tp_mesh, [Shard(1)]) if wrapped else out

    module.forward = forward


def _run_on_local_shard(norm: Any, tp_mesh: Any, stream: int = 1, split: bool = False) -> None:
    """``norm`` (a norm, a feed-forward or, on a stream sharded on the batch, an attention;
    weights whole on tp) applied to the local shard of the stream (dim ``stream``); its output
    of the input's kind (a DTensor under ``partial_dtensor``, a local shard under
    ``spmd_types``); ``split``: per-sequence tensor arguments (positions) split with the
    batch."""
    from torch.distributed.tensor import DTensor, Shard

    inner = norm.forward

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        if split:
            batch = x.shape[0] * (tp_mesh.size() if not isinstance(x, DTensor) else 1)
            args = tuple(_batch_part(a, batch, tp_mesh) for a in args)
            kwargs = {k: _batch_part(v, batch, tp_mesh) for k, v in kwargs.items()}
        if not isinstance(x, DTensor):
            return inner(x, *args, **kwargs)
        return DTensor.from_local(inner(x.to_local(), *args, **kwargs), tp_mesh,
                                  [Shard(stream)])

    norm.forward = forward


def _batch_split_of_replicated(norm: Any, module: Any, tp_mesh: Any) -> None:
    """A data-parallel sub-block (``norm`` and ``module``, weights whole on tp) on a stream
    whole on every tp rank (``layout.REPLICATED_STREAM``): the norm reads this tp rank's part
    of the micro-batch (no collective; its input gradient all-gathered in backward), the
    module's output is all-gathered over tp (its gradient cut in backward), of the stream's
    kind; per-sequence tensor arguments (positions) split with the batch."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    norm_forward, module_forward = norm.forward, module.forward
    stream_is_dtensor = [False]

    def cut(x: Any) -> Any:
        stream_is_dtensor[0] = isinstance(x, DTensor)
        whole = x if isinstance(x, DTensor) else DTensor.from_local(x, tp_mesh, [Replicate()])
        return norm_forward(whole.redistribute(tp_mesh, [Shard(0)]).to_local())

    def gather(x: Any, *args: Any, **kwargs: Any) -> Any:
        batch = x.shape[0] * tp_mesh.size()
        args = tuple(_batch_part(a, batch, tp_mesh) for a in args)
        kwargs = {k: _batch_part(v, batch, tp_mesh) for k, v in kwargs.items()}
        out = DTensor.from_local(module_forward(x, *args, **kwargs), tp_mesh, [Shard(0)])
        out = out.redistribute(tp_mesh, [Replicate()])
        return out if stream_is_dtensor[0] else out.to_local()

    norm.forward, module.forward = cut, gather


def _run_on_batch_shard(module: Any, tp_mesh: Any) -> None:
    """``module`` (weights whole on tp) run on this tp rank's part of the micro-batch: its
    input redistributed from a sequence shard to a batch shard (all-to-all), its output back,
    of the input's kind; a per-sequence tensor argument (positions) split with the batch."""
    from torch.distributed.tensor import DTensor, Shard

    inner = module.forward

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        stream = x if isinstance(x, DTensor) else DTensor.from_local(x, tp_mesh, [Shard(1)])
        batch = stream.shape[0]
        local = stream.redistribute(tp_mesh, [Shard(0)]).to_local()
        args = tuple(_batch_part(a, batch, tp_mesh) for a in args)
        kwargs = {k: _batch_part(v, batch, tp_mesh) for k, v in kwargs.items()}
        out = DTensor.from_local(inner(local, *args, **kwargs), tp_mesh, [Shard(0)])
        out = out.redistribute(tp_mesh, [Shard(1)])
        return out if isinstance(x, DTensor) else out.to_local()

    module.forward = forward


def _stream_as_dtensor(module: Any, tp_mesh: Any, stream: int) -> None:
    """``module``'s output (this rank's shard of the stream, on dim ``stream``) as the DTensor
    the blocks' declarations read under the ``partial_dtensor`` backend."""
    from torch.distributed.tensor import DTensor, Shard

    inner = module.forward

    def forward(x: Any) -> Any:
        return DTensor.from_local(inner(x), tp_mesh, [Shard(stream)])

    module.forward = forward


def _batch_part(value: Any, batch: int, tp_mesh: Any) -> Any:
    """This tp rank's rows of a per-sequence tensor argument; None as is; a UserError for
    attention masks (flex / varlen masks are built for the whole batch)."""
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch:
        return value.chunk(tp_mesh.size())[tp_mesh.get_local_rank()]
    raise UserError(f"the tp dim as data parallel got a {type(value).__name__} argument it "
                    "cannot split by batch (attention masks): use SDPA attention or 'sp'")


def fsdp_arguments(fsdp: dict[str, Any], parallel_dims: Any) -> dict[str, Any]:
    """``fully_shard``'s arguments for the data-parallel parts: ``fsdp``'s on a 1-D mesh over
    dp_shard x tp (``tp_dp_problem`` has checked dp_replicate = cp = 1), no SPMD mesh dims
    (their weights carry no tp annotation)."""
    return {k: v for k, v in fsdp.items() if k != "dp_mesh_dims"} | {
        "mesh": dp_shard_tp_mesh(parallel_dims)}


def _dp_shard_name(parallel_dims: Any) -> str:
    return "dp_shard" if parallel_dims.spmd_backend == "spmd_types" else "fsdp"


def dp_shard_tp_mesh(parallel_dims: Any) -> Any:
    """The 1-D mesh over dp_shard x tp (dp_shard-major); dp_shard's own with tp = 1."""
    if parallel_dims.tp == 1:
        return parallel_dims.get_mesh(_dp_shard_name(parallel_dims))
    # flattening again to the same name returns the mesh flattened first
    return parallel_dims.get_mesh([_dp_shard_name(parallel_dims), "tp"])._flatten("dp_shard_tp")


def drop_embedding_sharding(model: Any, plan: Any) -> None:
    """Before ``model.parallelize``: an embedding planned on its embedding dim
    (``layout.EMBEDDING_MODES``) keeps its table whole on tp (its declaration dropped);
    ``apply_embedding_dim`` places it."""
    if plan.embedding_mode and model.tok_embeddings is not None:
        model.tok_embeddings._sharding_config = None


def apply_embedding_dim(model: Any, plan: Any, parallel_dims: Any, dtype: Any) -> None:
    """The embedding looked up on its embedding dim (``layout.EMBEDDING_MODES``,
    ``runtime.styles``), its output on the plan's stream (``Plan.stream``; a local shard
    under ``spmd_types``, a DTensor under ``partial_dtensor``), read in ``dtype`` (the
    parameters' dtype FSDP computes the blocks in)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.tools.logging import logger

    from ...candidates.layout import EMBEDDING_DIM_GATHER, embedding_dim_problem
    from ...runtime.styles import embedding_dim_style

    mode, m = plan.embedding_mode, plan.mesh
    problem = embedding_dim_problem(m, tp_mode=mode)
    if problem:
        raise UserError(f"plan: {problem}")
    if parallel_dims.spmd_backend == "full_dtensor":
        raise UserError(f"tp_mode {mode!r} for the embedding is not applied under "
                        "--parallelism.spmd_backend full_dtensor: use spmd_types or "
                        "partial_dtensor")
    gather = mode == EMBEDDING_DIM_GATHER
    mesh = parallel_dims.get_mesh([_dp_shard_name(parallel_dims), "tp"]) if gather else \
        dp_shard_tp_mesh(parallel_dims)
    stream = plan.stream
    parallelize_module(model.tok_embeddings, mesh,
                       embedding_dim_style(m.dp_shard, m.tp, stream, dtype, gather))
    if parallel_dims.spmd_backend == "partial_dtensor" and m.tp > 1:
        _stream_as_dtensor(model.tok_embeddings, parallel_dims.get_mesh("tp"), stream)
    over = f"dp_shard ({m.dp_shard} ranks), its table gathered over tp" if gather else \
        f"dp_shard x tp ({m.dp_shard * m.tp} ranks)"
    logger.info(f"tok_embeddings looked up on its embedding dim over {over}: token ids "
                "all-gathered, output all-to-all onto the stream")
