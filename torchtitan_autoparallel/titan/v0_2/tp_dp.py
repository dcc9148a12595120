"""The tp mesh dim used as data parallel on TorchTitan 0.2.2, and the placements below the
block: blocks planned "dp", the sub-blocks of blocks planned with a sub-block tp mode
(``candidates.layout.SUB_BLOCK_TP_MODES``), the feed-forward tensor parallel over dp_shard
(``DP_SHARD_TP``) and the embedding looked up on its embedding dim (``EMBEDDING_MODES``), each
with TorchTitan's / PyTorch's ``parallelize_module`` and FSDP2 (``apply.apply_plan`` calls
them in TorchTitan's order)."""

import inspect
from typing import Any

import torch.nn as nn

from ...candidates.layout import (
    A2A_MODES,
    DP_SHARD_TP,
    EMBEDDING_DIM_GATHER,
    MOE_ATTENTION_DP,
    MOE_SHARED_DP,
    SUB_BLOCK_TP_MODES,
    Mesh,
    a2a_mode,
    batch_a2a,
    embedding_dim_problem,
    shared_experts_dp,
    stream_dim,
    sub_block_modes,
    tp_dp_problem,
)
from ...errors import UserError
from ...graph.adapters import ModelAdapter, resolve
from ...graph.tp_styles import InferredTP, block_signature
from ...plan.schema import Plan
from ...runtime.styles import dp_shard_tp_styles, embedding_dim_style, heads_to_sequence


def batch_split_over_tp(block: nn.Module, tp_mesh: Any, n_args: int) -> None:
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


def batch_split_of_replicated(norm: nn.Module, module: nn.Module, tp_mesh: Any) -> None:
    """Run a sub-block (its ``norm`` and ``module``) on a batch shard of a residual stream
    whole on every tp rank (``layout.REPLICATED_STREAM``): each tp rank cuts its shard of the
    batch (no collective; its input gradient all-gathered in backward) and the module's
    output is all-gathered over tp (its gradient cut in backward). The norm runs on the shard
    too, so FSDP's sum over dp_shard x tp counts every token once."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        parallelize_module,
    )

    parallelize_module(norm, tp_mesh, PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(0),), use_local_output=True))
    parallelize_module(module, tp_mesh, PrepareModuleOutput(
        output_layouts=Shard(0), desired_output_layouts=Replicate(), use_local_output=True))


MOE_SUB_BLOCKS_APPLIED = (MOE_SHARED_DP, MOE_ATTENTION_DP)
"""The MoE blocks' sub-block modes this apply runs (``Frontend.moe_sub_block_modes``): the MoE
data parallel over tp (``MOE_SHARED_DP``, ``moe_on_sequence_shard``) and the attention data
parallel over tp (``MOE_ATTENTION_DP``, ``moe_attention_dp``) beside TorchTitan's MoE TP / EP.
Not ``MOE_ROUTED_TP``: 0.2.2's MoE TP gathers the MoE's input once and scatters the sum of its
routed and shared experts' outputs once, so shared experts apart would save no collective."""

MOE_ATTENTION = ("attention_norm", "attention")
"""(norm, module) of the attention sub-block of a TorchTitan 0.2.2 MoE family's block
(deepseek_v3, qwen3, llama4)."""

ATTENTION_DP_FAMILIES = ("deepseek_v3", "qwen3", "llama4")
"""The 0.2.2 families whose MoE blocks' attention this module runs data parallel over tp
(``MOE_ATTENTION_DP``); other families' MoE blocks take ``MOE_SHARED_DP`` alone
(``ModelAdapter.moe_sub_block_modes``)."""


SubBlocks = list[tuple[str, list[nn.Module]]]
"""A block's sub-blocks as planned: (the tp dim's use, "sp" or "dp"; the norm and the module)."""


def sub_blocks_of(block: nn.Module, adapter: ModelAdapter, tp_mode: str) -> SubBlocks:
    """The sub-blocks (``ModelAdapter.sub_blocks``) of a block planned with a sub-block tp
    mode, each with its use of the tp dim; a MoE block's are its MoE and the rest of its
    children (``MOE_SHARED_DP``: the MoE data parallel, the rest TP + SP) or its attention
    and its norm and the rest (``MOE_ATTENTION_DP``: the attention data parallel, the rest
    TP + SP, the MoE as TorchTitan runs it). A one-line error where the family names none or
    a MoE block has another mode."""
    if adapter.routed_experts(block) is not None:
        if tp_mode not in MOE_SUB_BLOCKS_APPLIED:
            raise UserError(f"tp_mode {tp_mode!r} on a MoE block: MoE blocks take 'sp' or "
                            f"{', '.join(map(repr, MOE_SUB_BLOCKS_APPLIED))} on TorchTitan "
                            "0.2.2")
        if tp_mode == MOE_ATTENTION_DP and tp_mode not in (adapter.moe_sub_block_modes or ()):
            raise UserError(f"tp_mode {tp_mode!r} on MoE blocks (the attention data parallel "
                            f"over tp) is applied to {', '.join(ATTENTION_DP_FAMILIES)} only "
                            f"on TorchTitan 0.2.2: use 'sp' or {MOE_SHARED_DP!r}")
        apart = (adapter.moe,) if tp_mode == MOE_SHARED_DP else _moe_attention(block)
        parts = [("dp", [block.get_submodule(name) for name in apart]),
                 ("sp", [m for n, m in block.named_children() if n not in apart])]
        return parts if tp_mode == MOE_ATTENTION_DP else parts[::-1]  # in forward's order
    if shared_experts_dp(tp_mode):
        raise UserError(f"tp_mode {tp_mode!r} is a MoE block's (its shared experts data "
                        "parallel over tp): use 'sp' or 'dp' on dense blocks")
    if len(adapter.sub_blocks) != 2:
        raise UserError(f"tp_mode {tp_mode!r} needs a dense block whose family names its "
                        "attention and feed-forward (ModelAdapter.sub_blocks); use 'sp' or 'dp'")
    if a2a_mode(tp_mode):
        a2a_projections(block, adapter)  # the rule, with its error
    return [(mode, [block.get_submodule(norm), block.get_submodule(module)])
            for (norm, module), mode in zip(adapter.sub_blocks, sub_block_modes(tp_mode),
                                            strict=True)]


def _moe_attention(block: nn.Module) -> tuple[str, str]:
    """``MOE_ATTENTION`` of a MoE block; a one-line error where the block has no such
    children."""
    names = {name for name, _ in block.named_children()}
    if not set(MOE_ATTENTION) <= names:
        raise UserError(f"tp_mode {MOE_ATTENTION_DP!r} needs a MoE block with "
                        f"{' and '.join(MOE_ATTENTION)} ({type(block).__name__} has "
                        f"{', '.join(sorted(names))}); use 'sp' or {MOE_SHARED_DP!r}")
    return MOE_ATTENTION


def a2a_projections(block: nn.Module, adapter: ModelAdapter) -> list[str]:
    """The attention sub-block's row-wise linears in the family's inferred TP plan (names in
    ``block``): what ``layout.A2A_MODES`` run on the sequence shard with their weights whole."""
    fn = resolve(adapter.tp_fn)
    if not isinstance(fn, InferredTP):
        raise UserError(f"tp_mode {A2A_MODES[0]!r} needs the family's inferred TP plan "
                        "(ModelAdapter.tp_fn = INFER_TP); use 'sp'")
    attention = adapter.sub_blocks[0][1]
    names = [key for key, style in fn.plans[block_signature(block)].items()
             if key.startswith(f"{attention}.") and style.kind == "rowwise"]
    if not names:
        raise UserError(f"{attention} has no row-wise linear in the inferred TP plan: its "
                        "output projection cannot run on the sequence shard; use 'sp'")
    return names


def planned_sub_blocks(blocks: nn.Module, adapter: ModelAdapter, planned: dict[str, Any],
                       compiled: bool) -> dict[str, SubBlocks]:
    """By block name, the sub-blocks of the blocks planned with a sub-block tp mode (taken
    before AC and compile wrap the blocks); a one-line error for compiled blocks (FSDP's
    hooks would sit inside the compiled block)."""
    out = {name: sub_blocks_of(blocks.get_submodule(name), adapter, layer.tp_mode)
           for name, layer in planned.items()
           if layer.tp_mode in SUB_BLOCK_TP_MODES or shared_experts_dp(layer.tp_mode)}
    if out and compiled:
        raise UserError("sub-block tp modes are applied without compile only; use 'sp' or 'dp'")
    return out


def attention_apart(block: nn.Module) -> nn.Module:
    """What a family's own TP function is handed in place of a MoE block in
    ``MOE_ATTENTION_DP``: the block's other children (the same modules), its attention and
    norm left out of its children, so the function's styles for them find no module and are
    skipped, but still readable as attributes (deepseek_v3's reads
    ``attention.q_lora_rank``)."""
    stand_in = nn.Module()
    for name, child in block.named_children():
        if name in MOE_ATTENTION:
            object.__setattr__(stand_in, name, child)  # an attribute, not a child
        else:
            stand_in.add_module(name, child)
    stand_in.moe_enabled = True
    return stand_in


def moe_attention_dp(block: nn.Module, adapter: ModelAdapter, tp_mesh: Any,
                     enable_float8_tensorwise_tp: bool) -> None:
    """A MoE block in ``MOE_ATTENTION_DP`` (its other children already TP + SP by the family's
    own TP function, or here by its inferred plan): its attention run on a batch shard (an
    all-to-all from the sequence shard and back, ``batch_split_over_tp``), its norm whole per
    token on the shard; a one-line error where the attention gets masks or positions it
    cannot split by batch (flex attention, document masks)."""
    from torch.distributed.tensor.parallel import parallelize_module

    fn = resolve(adapter.tp_fn)
    norm, attention = _moe_attention(block)
    if isinstance(fn, InferredTP):
        styles = fn.block_styles(block, enable_float8_tensorwise_tp)
        parallelize_module(block, tp_mesh, {
            key: style for key, style in styles.items()
            if key not in (norm, attention) and not key.startswith(f"{attention}.")})
    module = block.get_submodule(attention)

    def whole_batch_only(_: nn.Module, args: tuple) -> None:
        if any(arg is not None for arg in args[2:]):
            raise UserError(f"tp_mode {MOE_ATTENTION_DP!r} got attention masks or positions "
                            "it cannot split by batch (flex attention, document masks): use "
                            f"SDPA attention, 'sp' or {MOE_SHARED_DP!r}")

    module.register_forward_pre_hook(whole_batch_only)
    batch_split_over_tp(module, tp_mesh, len(inspect.signature(module.forward).parameters))


def moe_on_sequence_shard(block: nn.Module, adapter: ModelAdapter, tp_mesh: Any) -> None:
    """A MoE block in ``MOE_SHARED_DP`` (its attention and norms already TP + SP): its
    MoE reads this tp rank's sequence shard of the stream as a local tensor and routes,
    dispatches and runs its experts on those tokens alone (no all-gather, no reduce-scatter);
    the router's token counts (what the load-balancing bias update reads) are summed over tp,
    so every tp rank counts the whole micro-batch, as under TorchTitan's MoE TP."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    parallelize_module(block, tp_mesh, {adapter.moe: PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)})

    def count_over_tp(module: nn.Module, args: Any, output: Any) -> Any:
        from torch.distributed import _functional_collectives as funcol

        scores, indices, counts = output
        return scores, indices, funcol.wait_tensor(funcol.all_reduce(counts, "sum", tp_mesh))

    block.get_submodule(adapter.moe).router.register_forward_hook(count_over_tp)


def apply_sub_block_tp(block: nn.Module, adapter: ModelAdapter, tp_mesh: Any, tp_mode: str,
                       enable_float8_tensorwise_tp: bool) -> None:
    """A block whose attention and feed-forward use the tp dim apart: the family's TP + SP
    styles (its inferred ``parallelize_module`` plan) on the TP + SP sub-block's norm, module
    and linears only; a data-parallel attention entered and left through an all-to-all
    between the sequence-sharded stream and a batch shard (``batch_a2a``), a data-parallel
    feed-forward run per token on the sequence shard as it is, a data-parallel sub-block's
    norm left whole (per token on the shard; FSDP sums its gradient over dp_shard x tp). Where
    the stream is sharded on the batch (``stream_dim``), the TP sub-block's styles gather and
    scatter it on the batch and the data-parallel one runs on it with no collective; where it
    is whole on every tp rank, the TP sub-block takes it as it is and all-reduces its output
    (TP without SP, its norm whole) and the data-parallel one runs on a batch shard
    (``batch_split_of_replicated``). Under
    ``layout.A2A_MODES`` the attention's row-wise projection takes its input onto the sequence shard
    instead of being row-wise parallel."""
    from torch.distributed.tensor.parallel import parallelize_module

    fn = adapter.tp_fn
    if not isinstance(fn, InferredTP):
        raise UserError(f"tp_mode {tp_mode!r} needs the family's inferred TP plan "
                        "(ModelAdapter.tp_fn = INFER_TP); use 'sp' or 'dp'")
    sub_blocks_of(block, adapter, tp_mode)  # the rule, with its error
    inferred = fn.plans[block_signature(block)]
    stream = stream_dim(tp_mode)
    styles = fn.block_styles(block, enable_float8_tensorwise_tp, stream)
    if a2a_mode(tp_mode):
        styles.update(dict.fromkeys(a2a_projections(block, adapter), heads_to_sequence()))
    for part, ((norm, module), mode) in enumerate(zip(adapter.sub_blocks,
                                                      sub_block_modes(tp_mode), strict=True)):
        if mode == "sp":
            own = {key: style for key, style in styles.items()
                   if key in (norm, module) or key.startswith(f"{module}.")}
            parallelize_module(block, tp_mesh, own)
        elif mode == DP_SHARD_TP:
            continue  # on the 2-D mesh: apply_dp_shard_tp
        elif part == 0 and batch_a2a(tp_mode):
            batch_split_over_tp(block.get_submodule(module), tp_mesh,
                                 len(inferred[module].inputs))
        elif stream is None:
            batch_split_of_replicated(block.get_submodule(norm), block.get_submodule(module),
                                      tp_mesh)
        # a data-parallel feed-forward runs per token on the stream's shard as it is, as does
        # a sub-block on a stream sharded on the batch


def dp_over_tp_mesh(parallel_dims: Any, plan: Plan, tp_mode: str) -> Any:
    """FSDP mesh of the blocks or sub-blocks that use tp as data parallel (where
    ``layout.tp_dp_problem`` allows it): ``dp_shard_tp_mesh``."""
    problem = tp_dp_problem(plan.mesh, plan.local_batch_size, tp_mode=tp_mode)
    if problem:
        raise UserError(problem)
    return dp_shard_tp_mesh(parallel_dims)


def apply_dp_shard_tp(blocks: nn.Module, adapter: ModelAdapter, parallel_dims: Any,
                      tp_modes: dict[str, str], fsdp: dict[str, Any] | None) -> None:
    """The feed-forwards of blocks planned in a ``DP_SHARD_TP_MODES`` mode: tensor parallel
    over dp_shard on the 2-D (dp_shard, tp) mesh (``runtime.styles.dp_shard_tp_styles``, the
    linears column- / row-wise as the family's inferred TP plan has them), their weights read
    in FSDP's parameter dtype (``fsdp``: the job's ``fully_shard`` arguments)."""
    from torch.distributed.tensor.parallel import parallelize_module

    names = [name for name, mode in tp_modes.items() if DP_SHARD_TP in sub_block_modes(mode)]
    if not names:
        return
    if not parallel_dims.fsdp_enabled:
        raise UserError(tp_dp_problem(Mesh(dp_replicate=1, dp_shard=1, tp=parallel_dims.tp),
                                      1, tp_mode=tp_modes[names[0]]))
    mesh = parallel_dims.get_mesh(["fsdp", "tp"])
    dtype = fsdp["mp_policy"].param_dtype if fsdp else None
    norm, module = adapter.sub_blocks[1]
    for name in names:
        block = blocks.get_submodule(name)
        plan = resolve(adapter.tp_fn).plans[block_signature(block)]
        linears = {key[len(module) + 1:]: style.kind for key, style in plan.items()
                   if key.startswith(f"{module}.")}
        norm_style, module_style = dp_shard_tp_styles(linears, dtype)
        parallelize_module(block, mesh, {norm: norm_style, module: module_style})
    from torchtitan.tools.logging import logger

    logger.info(f"{len(names)} blocks run {module} tensor parallel over dp_shard "
                f"({parallel_dims.dp_shard} ranks), its weights gathered over tp")


def dp_shard_tp_mesh(parallel_dims: Any) -> Any:
    """1-D mesh over dp_shard x tp (dp_shard-major; tp alone with dp_shard = 1, dp_shard alone
    with tp = 1). TorchTitan keeps its own flattened ``efsdp`` mesh fake unless EP is on."""
    if not parallel_dims.fsdp_enabled:
        return parallel_dims.get_mesh("tp")
    if parallel_dims.tp == 1:
        return parallel_dims.get_mesh("fsdp")
    return parallel_dims.get_mesh(["fsdp", "tp"])._flatten("fsdp_tp")


def apply_embedding_dim(model: nn.Module, adapter: ModelAdapter, parallel_dims: Any,
                        plan: Plan, fsdp: dict[str, Any] | None) -> None:
    """The embedding looked up on its embedding dim (``layout.EMBEDDING_MODES``,
    ``runtime.styles``), its output on the plan's stream layout, read in FSDP's parameter
    dtype (``fsdp``: the job's ``fully_shard`` arguments, None without FSDP)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.tools.logging import logger

    mode = plan.embedding_mode
    problem = embedding_dim_problem(plan.mesh, tp_mode=mode)
    if problem:
        raise UserError(problem)
    stream = plan.stream
    dtype = fsdp["mp_policy"].param_dtype if fsdp else None
    m, gather = plan.mesh, mode == EMBEDDING_DIM_GATHER
    mesh = parallel_dims.get_mesh(["fsdp", "tp"]) if gather else dp_shard_tp_mesh(parallel_dims)
    parallelize_module(model.get_submodule(adapter.embedding), mesh,
                       embedding_dim_style(m.dp_shard, m.tp, stream, dtype, gather))
    over = f"dp_shard ({m.dp_shard} ranks), its table gathered over tp" if gather else \
        f"dp_shard x tp ({m.dp_shard * m.tp} ranks)"
    logger.info(f"{adapter.embedding} looked up on its embedding dim over {over}: token ids "
                "all-gathered, output all-to-all onto the stream")


def shard_tp_dp_parts_only(model: nn.Module, planned: dict[str, Any], plan: Plan,
                           parallel_dims: Any, fsdp: dict[str, Any],
                           sub_blocks: dict[str, SubBlocks]) -> None:
    """dp_shard = 1 (tp the only dim): FSDP over tp for the sub-blocks that use tp as data
    parallel, nothing else sharded (the TP parts, embedding and output as TorchTitan's TP
    alone leaves them)."""
    from torch.distributed.fsdp import fully_shard

    sharded: set[nn.Parameter] = set()
    for name, modes in sub_blocks.items():
        layer = planned[name]
        mesh = dp_over_tp_mesh(parallel_dims, plan, layer.tp_mode)
        for mode, modules in modes:
            if mode == "dp":
                fully_shard(modules, **{**fsdp, "mesh": mesh},
                            reshard_after_forward=layer.reshard_after_forward)
                sharded.update(p for m in modules for p in m.parameters())
    # FSDP needs one root: the model, managing none of the parameters left to TP
    fully_shard(model, **fsdp, ignored_params=set(model.parameters()) - sharded)
