"""A block's time and memory for a strategy on a mesh, the fixed per-step terms (time floors,
host overheads, training-state memory) and the layout changes between layers.

The terms come from the parts: ``compute`` (GEMMs, float8 casts, attention, the loss from kernel
tables), ``comm`` (TP / SP, context parallel's ring, FSDP, MoE all-to-alls: alpha-beta ring
collectives at the link's bus bandwidth by message size, intra- vs inter-node), ``common``
(precision, AC's effect, bytes per parameter, one collective). FSDP collectives overlap a
fraction (profile ``comm_overlap``) of the block's compute; TP collectives are exposed. On CPU
training (profile ``host_cores``) ranks that outnumber the cores time-share them, and their
collectives wait for peers to be scheduled; every layer pays a fixed host overhead. Memory counts
parameters (in the dtypes the model builds them in), gradients and AdamW state sharded over
dp_shard x tp, activations kept for backward (scaled by AC), unsharded parameters of blocks that
keep them between forward and backward, the logits, and the transient working set of one block;
under autocast (one device, DDP) also the cached low-precision weight copies. The parts' names
are re-exported here for the callers.
"""

import dataclasses
from dataclasses import dataclass
from typing import Literal, NamedTuple

from ..candidates.layout import (
    EMBEDDING_DIM,
    EMBEDDING_MODES,
    MOE_SUB_BLOCK_MODES,
    SUB_BLOCK_TP_MODES,
    TP_MODES,
    BlockStrategy,
    Mesh,
    edge_strategy,
    fsdp_group_size,
    reshard_group,
    shared_experts_dp,
    stream_dim,
    sub_block_modes,
)
from ..graph.layer_graph import Layer, LayerGraph
from .comm import (  # noqa: F401  (re-exported: the cost model's names)
    ROW_PARALLEL_FLOP_SHARE,
    a2a_weight_bytes,
    cp_comm_s,
    dp_shard_tp_weight_bytes,
    fsdp_s,
    moe_dispatch_s,
    sp_comm_s,
    tp_comm_s,
    tp_region_gemms,
)
from .common import (  # noqa: F401  (re-exported: the cost model's names)
    _EDGE,
    _FLOOR,
    _FSDP,
    _HOST,
    AC_EFFECT,
    AUTOCAST_ACTIVATION_FACTOR,
    FWD_BWD_BYTES_PER_PARAM,
    GRAD_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    STEP_BYTES_PER_PARAM,
    BlockCost,
    CostContext,
    Precision,
    _memoized,
    autocast,
    collective_s,
    optimizer_step_s,
    state_bytes,
)
from .compute import (  # noqa: F401  (re-exported: the cost model's names)
    AUTO_FILTER_SMALL_KN,
    COMPILED_LOSS_PASSES,
    FLOAT8_CAST_BYTES,
    FLOAT8_CAST_KERNELS,
    FLOAT8_TENSOR_CORE_RATIO,
    FLOAT8_TRANSPOSE_BYTES,
    FSDP_COPY_BYTES_PER_PARAM,
    GEMM_PLATEAU,
    LINEAR_BENCH_STREAM_BYTES,
    LOSS_BWD_BYTES,
    LOSS_FWD_BYTES,
    RING_BWD_CALL_Q,
    RING_BWD_END_Q,
    RING_BWD_STEP_KV,
    RING_BWD_STEP_Q,
    RING_FWD_END_Q,
    RING_FWD_FIRST_Q,
    RING_FWD_STEP_KV,
    RING_FWD_STEP_Q,
    CastElements,
    _compute_shard,
    attention_times,
    block_compute_s,
    cast_s,
    clear_compute_memo,
    compute_s,
    float8_cast_elements,
    float8_linear_times,
    gemm_speedup,
    gemm_times,
    input_key,
    linear_names,
    linear_styles,
    linear_tokens,
    low_precision_linears,
    measured_float8_table,
    ring_attention_bytes,
)
from .hardware import HardwareProfile
from .moe import load_imbalance, moe_cost


def block_cost(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
               ctx: CostContext, grouped_experts: bool = True) -> BlockCost:
    """Time for one micro-batch through one block (forward + backward) and its memory."""
    ctx = on_host(ctx, mesh)
    hw, features = ctx.hw, ctx.features
    recompute_frac = AC_EFFECT[strategy.ac][1]
    fwd, compute = compute_s(layer, mesh, strategy, microbatch, ctx)
    # routed experts from their kernels (grouped GEMMs by group size, permutation, router,
    # the dispatcher's host sync) on the busiest expert-parallel rank
    moe = moe_cost(layer, mesh, microbatch, ctx, strategy.ac, grouped_experts)
    fwd, compute = fwd + moe.fwd_s, compute + moe.total_s

    full_ac = strategy.ac == "full"
    ep = mesh.ep if layer.expert_params else 1
    tp_only = tp_comm_s(layer, mesh, strategy, microbatch, ctx)
    cp_comm = sum(cp_comm_s(layer, mesh, strategy, microbatch, ctx))
    tp_comm = tp_only + cp_comm

    # float8 all-gather: the float8 linears' weights travel as 1 byte each
    # (TorchTitan's converter turns it off when dp_shard = 1)
    low = sum(k * n for (k, n), is_low in zip(
        layer.linear_shapes, low_precision_linears(layer, mesh, strategy, microbatch, hw, features),
        strict=True) if is_low) / max(layer.params, 1) \
        if features.float8_all_gather and mesh.dp_shard > 1 else 0.0
    fwd_comm, bwd_comm, copy_s, unsharded, gbytes = fsdp_s(layer, mesh, strategy, ctx, low)
    exposed = max(0.0, fwd_comm - hw.comm_overlap * fwd) + max(
        0.0, bwd_comm - hw.comm_overlap * (compute - fwd)
    )
    # while a collective runs beside compute, NCCL's kernels hold SMs: the overlapped compute
    # runs on the rest of the device
    compute += hw.nccl_sm_fraction * (min(fwd_comm, hw.comm_overlap * fwd)
                                      + min(bwd_comm, hw.comm_overlap * (compute - fwd)))
    if layer.num_experts and not (hw.grouped_mm and grouped_experts) and not moe.total_s:
        # one GEMM per local expert and projection: 3 forward, 6 backward (+3 recomputed)
        local = layer.num_experts // (mesh.ep if ep > 1 else 1)
        compute += local * 3 * (3 + (1 if recompute_frac else 0)) * hw.kernel_launch_us * 1e-6
    ep_comm = 0.0
    if ep > 1:
        ep_comm = moe_dispatch_s(layer, mesh, microbatch, ctx) * (4 + (2 if full_ac else 0))
        tp_comm += ep_comm
        if not moe.total_s:
            # the slowest ep rank sets the pace: routed-expert compute scaled by the imbalance
            expert = layer.expert_flops * microbatch / (mesh.tp * mesh.cp) / hw.flops_per_s
            compute += expert * (3.0 + recompute_frac) * (load_imbalance(hw) - 1.0)
    time = host_time_s(compute + copy_s + tp_comm + exposed, mesh, ctx)
    kept, state, transient = _block_memory(layer, mesh, strategy, microbatch, ctx, unsharded,
                                           gbytes)
    parts = (("tp", tp_only), ("cp ring", cp_comm), ("ep all-to-all", ep_comm),
             ("fsdp / dp", exposed), ("host copies", copy_s))
    return BlockCost(time_s=time, compute_s=compute, comm_s=tp_comm + fwd_comm + bwd_comm,
                     exposed_comm_s=tp_comm + exposed, kept_bytes=kept, state_bytes=state,
                     transient_bytes=transient, exposed_parts=parts, unsharded_bytes=unsharded,
                     grad_bytes=gbytes)


def _block_memory(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                  ctx: CostContext, unsharded: float, gbytes: float
                  ) -> tuple[float, float, float]:
    """A block's (kept, state, transient) bytes: what it holds from forward to backward, its
    sharded training state, and its working set while its backward runs."""
    hw, prec, features = ctx.hw, ctx.prec, ctx.features
    keep_frac = AC_EFFECT[strategy.ac][0]
    act_scale = prec.param_bytes / 4
    cast = autocast(mesh, prec)
    saved_scale = act_scale * (AUTOCAST_ACTIVATION_FACTOR if cast else 1.0)
    io_scale = 1.0 if cast else act_scale  # the residual stream stays fp32 under autocast
    # tp mode "dp": parameters are not split by tp but FSDP-sharded over dp_shard x tp
    fsdp_group = fsdp_group_size(mesh, strategy.tp_mode)
    ep = mesh.ep if layer.expert_params else 1
    node = reshard_group(strategy.reshard_after_forward)
    # what an eager block saves for backward without AC; compiled, the partitioner saves less
    # (fused pointwise chains keep their inputs only): what a block without AC keeps, and what
    # the recomputation of a checkpointed block materialises. Selective AC keeps the outputs of
    # the ops its policy saves, the same tensors compiled or not.
    eager_saved = layer.saved_bytes * microbatch * saved_scale / (mesh.tp * mesh.cp)
    # a replicated stream (TP without SP): each TP sub-block's norm input and output (the
    # column-wise linears' input) whole, where SP keeps a tp-th of them
    replicated = stream_dim(strategy.tp_mode) is None
    if replicated:
        eager_saved += (2 * sub_block_modes(strategy.tp_mode).count("sp") * layer.io_bytes
                        * microbatch * saved_scale / mesh.cp * (1 - 1 / mesh.tp))
    saved = eager_saved * (hw.compile_saved_fraction if features.compile else 1.0)
    # a checkpointed block keeps its input: one shard of the stream, or all of it replicated
    kept = (saved if strategy.ac == "none" else keep_frac * eager_saved) + (
        layer.io_bytes * microbatch * io_scale / (mesh.cp * (1 if replicated else mesh.tp))
        if strategy.ac != "none" else 0.0)
    if not strategy.reshard_after_forward and fsdp_group > 1:
        kept += unsharded
    elif node:
        kept += unsharded / node
    state = state_bytes(layer) / (mesh.dp_shard * mesh.cp * mesh.tp)
    # backward of this block: its recomputed activations and, when FSDP shards it, the
    # unsharded params of its unit and the prefetched next one and the unit's unsharded
    # gradients (DDP: the gradients' reduction buckets; one device: nothing beyond the state)
    if fsdp_group > 1 or ep > 1:
        gathered = strategy.fsdp_unit * (2 * unsharded + gbytes)
    else:
        gathered = gbytes if mesh.dp_replicate > 1 else 0.0
    transient = (saved if strategy.ac != "none" else 0.0) + gathered
    # DP_SHARD_TP: the feed-forward's weights as gathered over tp, saved for its backward
    # unless recomputed
    if strategy.ac != "full":
        kept += dp_shard_tp_weight_bytes(layer, mesh, strategy, prec.param_bytes)
    # A2A: the output projection's weight gathered whole over tp, and its gradient, while its
    # backward runs
    transient += 2 * a2a_weight_bytes(layer, mesh, strategy, prec.param_bytes) * (
        1 - 1 / mesh.tp)
    if strategy.ac == "full" and hw.recompute_grad_factor:
        # backward of a recomputed block: the gradients of its activations beside them, and
        # under TP + SP the all-gathered (unsplit) inputs of attention and FFN with theirs
        unsplit = 2 * layer.io_bytes * microbatch * act_scale / mesh.cp * (1 - 1 / mesh.tp)
        if strategy.tp_mode in SUB_BLOCK_TP_MODES or shared_experts_dp(strategy.tp_mode):
            # the modules that gather their input (one where the other is data parallel)
            unsplit *= sub_block_modes(strategy.tp_mode).count("sp") / 2
        transient += hw.recompute_grad_factor * (saved + 2 * unsplit)
    return kept, state, transient


FsdpFloor = Literal["", "step", "microbatch"]
"""When a time floor counts FSDP's collectives: "" not at all, "step" once per step (pipeline
stages), "microbatch" in every micro-batch (flat plans)."""

_NO_AC = {mode: BlockStrategy("none", False, mode)
          for mode in ("none", *TP_MODES, *SUB_BLOCK_TP_MODES, *MOE_SUB_BLOCK_MODES)}


def block_time_floor(layer: Layer, mesh: Mesh, microbatch: int, ctx: CostContext,
                     tp_modes: tuple[str, ...], hide_ep: bool = False, fsdp: FsdpFloor = ""
                     ) -> float:
    """A floor under ``block_cost(...).time_s`` of every strategy on ``mesh`` whose TP mode is
    in ``tp_modes``: the compute of the fastest mode without AC, plus what every strategy pays
    on top of it (routed experts: the four token all-to-alls, unless a schedule hides them,
    ``hide_ep``, and the busiest rank's extra expert work), as run on the host. TP
    communication counts in its mode without AC, CP's ring its latency alone (its transfers
    hide under more attention with AC). ``fsdp``: when FSDP's collectives (at their links'
    peak bandwidth, ``_fsdp_floor``) count: "" not at all; "step" once per step (pipeline
    stages keep their parameters gathered over the micro-batches, so each micro-batch pays only
    the SMs NCCL holds beside its compute); "microbatch" in every micro-batch (flat plans:
    also what the compute cannot hide, and the copies). ``model_time_floor`` sums it over a
    model, memoized."""
    modes, extra, device = _block_time_floor(layer, mesh, microbatch, ctx, tp_modes, hide_ep)
    if fsdp:
        device = _with_fsdp(modes, extra, _fsdp_floor(layer, mesh, ctx, tp_modes), ctx.hw,
                            fsdp)
    return host_time_s(device, mesh, ctx)


def _with_fsdp(modes: tuple[tuple[float, float, float], ...], extra: float,
               fsdp_modes: tuple[tuple[float, float, float], ...], hw: HardwareProfile,
               fsdp: FsdpFloor) -> float:
    """A block floor's device time with FSDP's collectives (``block_time_floor``): as
    ``block_cost`` counts them, monotone in the compute and in each collective's time, so the
    least of both bounds it for every strategy (AC and resharding only add to them)."""
    ov, sm, each = hw.comm_overlap, hw.nccl_sm_fraction, fsdp == "microbatch"
    return extra + min(
        compute + tp + sm * (min(ahead, ov * fwd) + min(back, ov * (compute - fwd))) + (
            max(0.0, ahead - ov * fwd) + max(0.0, back - ov * (compute - fwd)) + copies
            if each else 0.0)
        for (fwd, compute, tp), (ahead, back, copies) in zip(modes, fsdp_modes, strict=True))


def _block_time_floor(layer: Layer, mesh: Mesh, microbatch: int, ctx: CostContext,
                      tp_modes: tuple[str, ...], hide_ep: bool
                      ) -> tuple[tuple[tuple[float, float, float], ...], float, float]:
    """((forward compute, compute, TP communication) without AC per mode of ``tp_modes``, the
    rest of the floor, the floor without FSDP) on the device."""
    ctx = on_host(ctx, mesh)
    hw = ctx.hw
    # the routed experts' kernels (cost.moe) belong to the compute FSDP overlaps, as in
    # block_cost; the cheaper of grouped GEMMs and TorchTitan's for-loop experts (which one
    # a block runs depends on the model's flavor)
    moe = min((moe_cost(layer, mesh, microbatch, ctx, "none", grouped)
               for grouped in (True, False)),
              key=lambda cost: cost.total_s)
    modes = tuple((fwd + moe.fwd_s, compute + moe.total_s,
                   tp_comm_s(layer, mesh, _NO_AC[mode], microbatch, ctx))
                  for mode in tp_modes
                  for fwd, compute in (compute_s(layer, mesh, _NO_AC[mode], microbatch, ctx),))
    extra = cp_comm_s(layer, mesh, _NO_AC["none"], microbatch, ctx)[1]
    if layer.expert_params and mesh.ep > 1:
        if not hide_ep:
            extra += 4 * moe_dispatch_s(layer, mesh, microbatch, ctx)
        if not moe.total_s:
            expert = layer.expert_flops * microbatch / (mesh.tp * mesh.cp) / hw.flops_per_s
            extra += expert * 3.0 * (load_imbalance(hw) - 1.0)
    return modes, extra, extra + min(compute + tp for _, compute, tp in modes)


def _fsdp_floor(layer: Layer, mesh: Mesh, ctx: CostContext, tp_modes: tuple[str, ...]
                ) -> tuple[tuple[float, float, float], ...]:
    """(forward collectives, backward collectives, copies) of FSDP per mode of ``tp_modes``
    that every strategy's micro-batch pays at least: ``fsdp_s`` without resharding, saturated,
    every float8 linear's weight gathered in float8 (it does not depend on the micro-batch)."""
    ctx = on_host(ctx, mesh)
    low = sum(k * n for k, n in layer.linear_shapes) / max(layer.params, 1) \
        if ctx.features.float8_all_gather and mesh.dp_shard > 1 else 0.0
    return tuple(fsdp_s(layer, mesh, _NO_AC[mode], ctx, low, saturated=True)[:3]
                 for mode in tp_modes)


def model_time_floor(graph: LayerGraph, mesh: Mesh, microbatch: int, ctx: CostContext,
                     tp_modes: tuple[str, ...], hide_ep: bool = False, fsdp: FsdpFloor = ""
                     ) -> float:
    """A floor under the forward + backward time of one micro-batch through the whole model on
    ``mesh`` whose blocks run one of ``tp_modes`` (``block_tp_modes``; edges run "sp" on
    tp > 1, one of them): every layer's ``block_time_floor``, from two memoized tables, one
    per what the compute reads of the mesh, one per mesh for FSDP."""
    # what the layers' floors without FSDP read of the mesh: the same on the many meshes that
    # differ in pp and dp
    hw, prec, gpus_per_node, features = ctx.hw, ctx.prec, ctx.gpus_per_node, ctx.features
    key = (id(graph), id(hw), id(prec), id(features), _compute_shard(mesh, features), mesh.cp,
           mesh.tp, mesh.ep, mesh.etp, min(mesh.world, gpus_per_node), gpus_per_node,
           microbatch, tp_modes, hide_ep)
    layers, plain = _memoized(_FLOOR, key, (graph, hw, prec, features), _model_floor_parts,
                              graph, mesh, microbatch, ctx, tp_modes, hide_ep)
    if not fsdp:
        return plain
    key = (id(graph), id(hw), id(prec), id(features), mesh, gpus_per_node, tp_modes)
    per_mesh = _memoized(_FSDP, key, (graph, hw, prec, features), _model_fsdp_parts, graph,
                         mesh, ctx, tp_modes)
    return sum(n * host_time_s(_with_fsdp(modes, extra, fsdp_modes, hw, fsdp), mesh, ctx)
               for (n, modes, extra), fsdp_modes in zip(layers, per_mesh, strict=True))


def _model_floor_parts(graph: LayerGraph, mesh: Mesh, microbatch: int, ctx: CostContext,
                       tp_modes: tuple[str, ...], hide_ep: bool) -> tuple[tuple, float]:
    """((layers of a kind, ``_block_time_floor``'s parts) per kind of layer, the model's floor
    without FSDP)."""
    layers, plain = [], 0.0
    for layer, n in graph.alike:
        modes, extra, device = _block_time_floor(layer, mesh, microbatch, ctx, tp_modes,
                                                 hide_ep)
        layers.append((n, modes, extra))
        plain += n * host_time_s(device, mesh, ctx)
    return tuple(layers), plain


def _model_fsdp_parts(graph: LayerGraph, mesh: Mesh, ctx: CostContext,
                      tp_modes: tuple[str, ...]) -> tuple:
    return tuple(_fsdp_floor(layer, mesh, ctx, tp_modes) for layer, _ in graph.alike)


def core_share(mesh: Mesh, ctx: CostContext) -> float:
    """Ranks per core on a node when they outnumber ``host_cores`` (CPU training), else 1."""
    ranks_per_node = min(mesh.world, ctx.gpus_per_node)
    cores = ctx.hw.host_cores
    return max(1.0, ranks_per_node / cores) if cores > 0 else 1.0


def on_host(ctx: CostContext, mesh: Mesh) -> CostContext:
    """``ctx`` with the collective latency of oversubscribed cores added to its profile
    (``ctx`` itself otherwise)."""
    hw = ctx.hw
    if core_share(mesh, ctx) <= 1.0 or not hw.oversubscribed_latency_us:
        return ctx
    extra = hw.oversubscribed_latency_us
    # one profile object per profile: what the memoized costs of the job are keyed by
    host = _memoized(_HOST, (id(hw),), (hw,), dataclasses.replace, hw,
                     intra_node_latency_us=hw.intra_node_latency_us + extra,
                     inter_node_latency_us=hw.inter_node_latency_us + extra)
    return dataclasses.replace(ctx, hw=host)


def host_time_s(device_s: float, mesh: Mesh, ctx: CostContext) -> float:
    """A layer's time per micro-batch on the host: the device time, stretched when the ranks of
    a node outnumber its cores (``host_cores``), plus the fixed per-layer overhead."""
    return device_s * core_share(mesh, ctx) + ctx.hw.block_overhead_us * 1e-6


class StateMemory(NamedTuple):
    """A device's training state in a flat plan (``state_memory``)."""

    fwd_bwd_bytes: float
    """Held through forward and backward."""
    step_bytes: float
    """Held during the optimizer step."""
    host_step_s: float
    """The optimizer step's seconds per step: gradient clipping and AdamW on the device
    (``optimizer_step_s``), or on the host with CPU offload."""


def state_memory(state_bytes: float, accum: int, ctx: CostContext) -> StateMemory:
    """(forward/backward bytes, optimizer-step bytes, optimizer seconds per step) of a
    device's ``state_bytes`` of parameters, gradients and optimizer state (flat plans):
    gradients are resident from the second micro-batch on; CPU offload keeps all of it, and
    AdamW, on the host."""
    hw, features = ctx.hw, ctx.features
    per_param = state_bytes / STATE_BYTES_PER_PARAM
    fwd_bwd = FWD_BWD_BYTES_PER_PARAM + (
        GRAD_BYTES_PER_PARAM if accum > 1 or hw.reserved_gradients else 0)
    step_bytes = per_param * STEP_BYTES_PER_PARAM[features.optimizer]
    per_step = optimizer_step_s(state_bytes, ctx)
    if features.cpu_offload:
        fwd_bwd, step_bytes = 0, 0.0
        if hw.host_optimizer_gbps > 0:
            per_step = state_bytes / (hw.host_optimizer_gbps * 1e9)
    return StateMemory(per_param * fwd_bwd, step_bytes, per_step)


@dataclass(frozen=True)
class EdgeCost:
    """Embedding and norm + output: their per-micro-batch time and memory (not planned per
    layer: they follow the mesh, vocab-parallel with loss parallel when tp > 1)."""

    time_s: float
    kept_bytes: float
    state_bytes: float
    logits_bytes: float = 0.0
    """The part of ``kept_bytes`` that is logits (fp32 for the loss, and their low-precision
    originals)."""
    gathered_bytes: float = 0.0
    """Unsharded parameters and gradients while FSDP holds them gathered."""


def edge_cost(graph: LayerGraph, layer: Layer, mesh: Mesh, microbatch: int, ctx: CostContext,
              embedding: str = "") -> EdgeCost:
    """The embedding's or the norm + output's time and memory per micro-batch (memoized: the
    search costs a mesh's edges for several candidates); ``embedding``: the embedding's mode
    where not the mesh's default (``edge_strategy``)."""
    hw, prec, features = ctx.hw, ctx.prec, ctx.features
    key = (id(graph), id(layer), id(hw), id(prec), id(features), mesh, microbatch,
           ctx.gpus_per_node, embedding)
    return _memoized(_EDGE, key, (graph, layer, hw, prec, features), _edge_cost, graph, layer,
                     mesh, microbatch, ctx, embedding)


def _edge_cost(graph: LayerGraph, layer: Layer, mesh: Mesh, microbatch: int, ctx: CostContext,
               embedding: str) -> EdgeCost:
    hw, prec, features = ctx.hw, ctx.prec, ctx.features
    strategy = edge_strategy(layer.kind, mesh, embedding)
    cost = block_cost(layer, mesh, strategy, microbatch, ctx)
    if strategy.tp_mode in EMBEDDING_MODES:
        # the lookup keeps the token ids it looked up (int64: every dp_shard rank's, of this
        # rank's tp shard under EMBEDDING_DIM_GATHER) for its backward; its output goes through
        # the all-to-all and the gathered table is dropped, kept by no one
        ids = layer.io_bytes * microbatch * mesh.dp_shard
        return EdgeCost(cost.time_s,
                        ids if strategy.tp_mode == EMBEDDING_DIM else ids / mesh.tp,
                        cost.state_bytes)
    gathered = cost.unsharded_bytes + cost.grad_bytes
    if layer.kind != "output":
        return EdgeCost(cost.time_s, cost.kept_bytes, cost.state_bytes, 0.0, gathered)
    # one rank's logits per micro-batch (vocab-parallel under tp, sequence-split under cp)
    elements = graph.seq_len * graph.vocab_size * microbatch / (mesh.tp * mesh.cp)
    if features.compile_loss:
        # Inductor's partitioner keeps the loss's input (recomputing its upcast is cheaper
        # than saving fp32 logits) and the fused backward writes its gradient: two copies of
        # the low-precision logits, no fp32 ones
        logits = 2 * elements * prec.param_bytes
    else:
        # logits stay fp32 for the loss: not scaled by the activation dtype
        logits = layer.saved_bytes * microbatch / (mesh.tp * mesh.cp)
        if prec.param_bytes < 4:
            # the output projection's low-precision logits, upcast by the loss (kept as well)
            logits += elements * prec.param_bytes
        if hw.reserved_logits:
            # the caching allocator's reserve: the log-softmax backward allocates the gradient
            # of its input (fp32) while its output and the NLL gradient (which reuses the
            # freed upcast's block) are alive, and the freed low-precision logits' block is
            # too small to serve it: 4 B per element more than the tensors above
            logits += elements * 4
    return EdgeCost(cost.time_s, logits, cost.state_bytes, logits, gathered)


def edges_cost(graph: LayerGraph, mesh: Mesh, microbatch: int, ctx: CostContext,
               embedding: str = "") -> EdgeCost:
    """Every edge layer's ``edge_cost`` summed (a flat plan holds them all on one rank), with
    the weight copies autocast keeps; ``embedding`` as ``edge_cost``."""
    time = kept = state = logits = 0.0
    for layer in graph.edges:
        cost = edge_cost(graph, layer, mesh, microbatch, ctx, embedding)
        time += cost.time_s
        kept += cost.kept_bytes
        state += cost.state_bytes
        logits += cost.logits_bytes
    prec = ctx.prec
    if autocast(mesh, prec):
        # autocast caches the low-precision copy of every weight it casts (all but the
        # embedding) from the forward until the backward
        kept += prec.param_bytes * (graph.total_params - sum(
            layer.params for layer in graph.edges if layer.kind == "embedding"))
    return EdgeCost(time, kept, state, logits)
