"""Communication of a block: TP / SP collectives and the GEMMs they overlap with (async TP),
context parallel's ring, FSDP's all-gathers and reduce-scatters, and MoE's all-to-alls."""

from typing import NamedTuple

from ..candidates.layout import (
    DP_SHARD_TP,
    EMBEDDING_DIM,
    EMBEDDING_MODES,
    SUB_BLOCK_TP_MODES,
    BlockStrategy,
    Mesh,
    batch_a2a,
    fsdp_group_size,
    reshard_group,
    shared_experts_dp,
    split_fsdp,
    stream_dim,
    sub_block_modes,
    without_shared_dp,
)
from ..graph.layer_graph import Layer
from ..job.features import Features
from .common import AC_EFFECT, CostContext, collective_s
from .compute import (
    FSDP_COPY_BYTES_PER_PARAM,
    _linears_s,
    _low_speedups,
    a2a_linears,
    gemm_times,
    linear_names,
    linear_splits,
    linear_styles,
    linear_sub_blocks,
    low_precision_linears,
    measured_float8_table,
)
from .hardware import HardwareProfile
from .moe import load_imbalance

ROW_PARALLEL_FLOP_SHARE = 1 / 3
"""Share of a decoder block's linear FLOPs in its row-parallel linears (wo and w2; Llama 3 8B
34 %, 70B 35 %): the backward GEMMs a fused all-gather of their output gradient can hide under."""


def tp_region_gemms(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                    hw: HardwareProfile, features: Features) -> tuple[tuple[float, float], ...]:
    """(column-wise, row-wise) forward GEMM seconds of each module the block's TP plan gathers
    into and scatters out of (attention, FFN; under a sub-block mode its TP + SP sub-block
    only), at the job's shapes and precision; empty where the graph does not record the
    linears' styles or the block is not two such modules."""
    styles, names = linear_styles(layer), linear_names(layer)
    if not all(styles):
        return ()
    speedup, wgrad = _low_speedups(hw, features)
    low = low_precision_linears(layer, mesh, strategy, microbatch, hw, features)
    measured = measured_float8_table(hw, features)
    mixed = strategy.tp_mode in SUB_BLOCK_TP_MODES or shared_experts_dp(strategy.tp_mode)
    regions: dict[str, list[float]] = {}
    for shape, is_low, style, name, (tp, tokens) in zip(
            layer.linear_shapes, low, styles, names,
            linear_splits(layer, mesh, strategy, microbatch), strict=True):
        if mixed and tp == 1:
            continue  # the data-parallel sub-block's linears
        chunks = tp if features.async_tp and tp > 1 else 1
        fwd, _ = _linears_s((shape,), tokens, tp, chunks, hw.gemm_table, hw.clock_scale, speedup,
                            wgrad, (is_low,), (style,), measured, hw.hbm_gbps)
        region = regions.setdefault(name.rpartition(".")[0], [0.0, 0.0, 0.0])
        region[0 if style == "colwise" else 1] += fwd
        region[2] += style == "rowwise"
    found = tuple((col, row) for col, row, rows in regions.values() if rows == 1)
    return found if len(found) == sp_modules(strategy) else ()


def sp_modules(strategy: BlockStrategy) -> int:
    """Modules of the block that run TorchTitan's TP + SP plan: attention and FFN under "sp",
    the TP + SP sub-block alone under a sub-block mode, none otherwise."""
    return sum(mode == "sp" for mode in sub_block_modes(strategy.tp_mode))


def moe_outputs(layer: Layer, mesh: Mesh, strategy: BlockStrategy, ctx: CostContext) -> int:
    """How many outputs the block's feed-forward reduces over tp on its own where it runs on
    the tp dim's stream layout ("sp" in ``strategy``): one (a dense feed-forward, a MoE that
    gathers its input as a whole), except where the release runs the MoE's routed experts on
    the sequence shard under EP (``Features.moe_routed_on_shard``, TorchTitan 0.3.0): there a
    MoE reduces its shared experts' output alone (none without shared experts, or with them
    data parallel), and with ep 1 its routed and shared experts' outputs apart (two; one with
    the shared experts data parallel, ``MOE_ROUTED_TP``). Shared experts:
    ``Layer.shared_expert_linears``. As counted per block on TorchTitan 0.3.0's DeepSeek-V3 and
    qwen3 MoE on 2 gloo ranks (tests_v0_3/test_v0_3.py)."""
    if not (ctx.features.moe_routed_on_shard and layer.expert_params
            and any(linear_names(layer)) and sub_block_modes(strategy.tp_mode)[1] == "sp"):
        return 1
    shared = bool(layer.shared_expert_linears) and not shared_experts_dp(strategy.tp_mode)
    return int(shared) if mesh.ep > 1 else 1 + shared


def sp_comm_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int, act: float,
              tp_nodes: bool, ctx: CostContext) -> float:
    """Exposed TP + SP communication of one micro-batch through a block.

    Each forward (and a full recomputation) all-gathers into the attention's and the FFN's
    column-parallel linears and reduce-scatters out of their row-parallel ones: 2 + 2
    collectives; backward runs their transposes, an all-gather of the row-parallel linears'
    output gradient and a reduce-scatter of the column-parallel linears' input gradient.
    Without async TP every collective is exposed. Under a sub-block mode only its TP + SP
    sub-block runs them (``sp_modules``), and a MoE as ``moe_outputs`` counts. On a
    replicated stream (``layout.REPLICATED_MODES``) an all-reduce takes the place of each
    pair, exposed. Async TP (Inductor's micro-pipeline pass)
    fuses an all-gather into the GEMMs that consume it and a reduce-scatter into the one GEMM
    that produces it; the transfers (copy engines, no SMs) then hide under those GEMMs, run in
    tp chunks, except the first chunk. What the pass cannot fuse stays exposed: the backward
    reduce-scatter (the input gradient is a sum of GEMMs, q + k + v and w1 + w3, not one
    GEMM), and every all-gather whose result is cast before its GEMMs (float8 rowwise in
    forward, the float8 output gradient in backward)."""
    hw, prec, features = ctx.hw, ctx.prec, ctx.features
    fwd_passes = 2 if strategy.ac == "full" else 1
    outputs = moe_outputs(layer, mesh, strategy, ctx)
    modules = sp_modules(strategy)
    quiet = int(outputs == 0)  # a MoE with no collective over tp of its own
    if stream_dim(strategy.tp_mode) is None:
        # TP without SP (a replicated stream): nothing to gather; each module all-reduces its
        # row-wise linears' output (in every forward pass; a quiet MoE the partial sum its
        # routed experts' shards leave) and its column-wise linears' input gradient
        # (backward). Async TP's pass finds no gather or scatter to fuse
        reduce = collective_s("all_reduce", act, mesh.tp, tp_nodes, hw)
        return (modules * fwd_passes + modules - quiet) * reduce
    modules -= quiet
    if not modules:
        return 0.0
    apart = max(0, outputs - 1)  # a MoE's routed and shared experts' outputs scattered apart
    # A2A: the attention's output projection leaves no partial sums to reduce-scatter (and
    # gathers no output gradient in backward): an all-to-all takes its place (tp_comm_s)
    own = int(bool(a2a_linears(layer, strategy.tp_mode)))
    gather = scatter = collective_s("all_gather", act, mesh.tp, tp_nodes, hw)
    # TorchTitan's float8 tensorwise TP styles cast the input before the forward all-gather
    # (1 byte per element); backward gathers the bf16 output gradient, cast afterwards
    gather_fwd = gather / prec.param_bytes if features.linear == "float8_tensorwise" else gather
    # SP gathers and scatters along the sequence dim (dim 1): with more than one sequence per
    # micro-batch the unfused collectives concatenate the chunks (torch.cat after the
    # all-gather, before the reduce-scatter), one more read and write of the full activation;
    # a stream sharded on the batch (dim 0) is gathered and scattered in place
    cat = (2 * act / (hw.hbm_gbps * 1e9)
           if microbatch > 1 and hw.gemm_table and hw.hbm_gbps > 0
           and stream_dim(strategy.tp_mode) == 1 else 0.0)
    # selective AC: TorchTitan's save list keeps reduce-scatter outputs, not all-gather ones,
    # so backward gathers the column-parallel linears' inputs again, for their weight
    # gradients (the gathered input as the transposed operand: not fused)
    regathers = modules if strategy.ac == "selective" else 0
    # (seconds, count, fused under async TP) per kind of collective
    kinds = ((gather_fwd, modules * fwd_passes,
              not features.linear.startswith(("float8_rowwise", "mx"))),
             (scatter, (modules - own) * fwd_passes, True),
             (gather, modules - own, features.linear == "none"),
             (scatter, modules, False),
             (gather_fwd, regathers, False),
             # the second of a MoE's outputs scattered apart (in every forward pass) and its
             # output gradient gathered (backward): not a GEMM's
             (scatter, apart * fwd_passes, False), (gather, apart, False))
    if not features.async_tp or not hw.gemm_table:
        total = sum(n * (t + cat) for t, n, _ in kinds)
        return total * (1.0 - hw.async_tp_overlap) if features.async_tp else total
    exposed = _fused_exposed(layer, mesh, strategy, microbatch, kinds, modules, act, ctx)
    return exposed + sum(n * (t + cat) for t, n, f in kinds if not f)


Kinds = tuple[tuple[float, int, bool], ...]
"""(seconds, count, fused under async TP) per kind of TP + SP collective (``sp_comm_s``)."""


def _fused_exposed(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                   kinds: Kinds, modules: int, act: float, ctx: CostContext) -> float:
    """What async TP leaves exposed of ``kinds``' fused collectives (``sp_comm_s``): each
    under its own GEMMs where the graph records the TP regions, else under the TP modules'
    share of the block's GEMMs, and the fused reduce-scatters' sums on the compute stream."""
    hw, features = ctx.hw, ctx.features
    fwd_passes = 2 if strategy.ac == "full" else 1
    fused = sum(n * t for t, n, f in kinds if f)
    regions = tp_region_gemms(layer, mesh, strategy, microbatch, hw, features)
    if regions:
        # each fused collective hides under its own GEMMs only: the gather into a module under
        # its column-wise GEMMs, the scatter out of it under its row-wise GEMM, the backward
        # gather of the row-wise output gradient under that linear's input-gradient GEMM (the
        # forward's FLOPs); a transfer longer than its GEMMs is exposed by the difference
        exposed = 0.0
        for col, row in regions:
            for (t, n, f), gemm in zip(kinds[:3], (col, row, row), strict=True):
                if f:
                    exposed += n / modules * max(t / mesh.tp, t - gemm)
    else:
        gemm_fwd, _ = gemm_times(layer, mesh, strategy, microbatch, hw, features)
        share = modules / 2  # of the block's GEMMs, those of its TP + SP modules
        hiding = gemm_fwd * share * (fwd_passes + (ROW_PARALLEL_FLOP_SHARE if kinds[2][2]
                                                   else 0.0))
        exposed = max(fused / mesh.tp, fused - hiding)
    if hw.hbm_gbps > 0:
        # the fused matmul + reduce-scatter sums the tp partial products it gathered after
        # the last chunk: the full activation read, a tp-th written, on the compute stream
        exposed += modules * fwd_passes * act * (1 + 1 / mesh.tp) / (hw.hbm_gbps * 1e9)
    return exposed


def tp_comm_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
              ctx: CostContext) -> float:
    """Exposed TP communication of one micro-batch through a block: TP + SP's collectives
    (``sp_comm_s``) where a module runs TP + SP, and where the tp dim is data parallel for the
    attention (``batch_a2a``), the all-to-alls between the sequence-sharded residual stream
    and a batch shard around it (none for a data-parallel feed-forward or MoE, per token on
    the stream's shard, nor where the stream is sharded on the batch already), and on a
    replicated stream the all-gather out of a data-parallel sub-block and, under EP, the
    backward all-gathers of the MoE's sequence-shard cuts; none in tp mode
    "none". It only grows with checkpointing (more passes,
    gathers). The embedding looked up on its embedding dim: ``embedding_dim_s``."""
    if strategy.tp_mode in EMBEDDING_MODES:
        return embedding_dim_s(layer, mesh, microbatch, ctx, strategy.tp_mode)
    act = layer.io_bytes * microbatch * ctx.act_scale / mesh.cp
    tp_nodes = mesh.spans_nodes("tp", ctx.gpus_per_node)
    comm = 0.0
    if sp_modules(strategy):
        comm += sp_comm_s(layer, mesh, strategy, microbatch, act, tp_nodes, ctx)
    fwd_passes = 2 if strategy.ac == "full" else 1
    if batch_a2a(strategy.tp_mode):
        # sequence-shard -> batch-shard all-to-all into the data-parallel attention (block or
        # sub-block) and back out of it, both again in backward (and in a full recompute)
        a2a = collective_s("all_to_all", act / mesh.tp, mesh.tp, tp_nodes, ctx.hw)
        comm += a2a * (4 + (2 if strategy.ac == "full" else 0))
    if stream_dim(strategy.tp_mode) is None:
        # a replicated stream: a data-parallel sub-block's output all-gathered over tp in
        # every forward pass, its input gradient in backward (its input cut locally)
        gather = collective_s("all_gather", act, mesh.tp, tp_nodes, ctx.hw)
        comm += sub_block_modes(strategy.tp_mode).count("dp") * (fwd_passes + 1) * gather
        if layer.expert_params and mesh.ep > 1 and ctx.features.moe_routed_on_shard:
            # EP on a replicated stream: the router and the routed experts each cut their tp
            # rank's sequence shard out of the whole stream; backward gathers both gradients
            comm += 2 * gather
    # A2A: heads -> sequence into the output projection, sequence -> heads in backward; its
    # weight all-gathered over tp in each forward pass, its gradient reduce-scattered back
    comm += dp_shard_tp_s(layer, mesh, strategy, act, ctx)
    weight = a2a_weight_bytes(layer, mesh, strategy, ctx.prec.param_bytes)
    comm += a2a_s(layer, mesh, strategy, act, tp_nodes, ctx) * (fwd_passes + 1)
    if weight:
        comm += (fwd_passes * collective_s("all_gather", weight, mesh.tp, tp_nodes, ctx.hw)
                 + collective_s("reduce_scatter", weight, mesh.tp, tp_nodes, ctx.hw))
    return comm


def embedding_dim_s(layer: Layer, mesh: Mesh, microbatch: int, ctx: CostContext,
                    tp_mode: str = EMBEDDING_DIM) -> float:
    """The token collectives of the embedding looked up on its embedding dim, for one
    micro-batch: ``EMBEDDING_DIM`` all-gathers every rank's token ids over dp_shard x tp, then
    moves the lookup's output (a 1 / (dp_shard x tp) slice of the embedding dim for the whole
    group's tokens: as many bytes as this rank's shard of the stream) onto the stream by an
    all-to-all over dp_shard x tp, its gradient back by another in backward;
    ``EMBEDDING_DIM_GATHER`` does the same over dp_shard for this tp rank's shard of the tokens
    (its table's gather over tp is FSDP's: ``fsdp_s``). Ranks are node-major: the group spans
    nodes once the dp_shard x tp ranks outgrow one, and its collectives then use every member's
    network rail."""
    hw, gpus_per_node = ctx.hw, ctx.gpus_per_node
    split = 1 if tp_mode == EMBEDDING_DIM else mesh.tp  # tp ranks outside the group
    group = mesh.dp_shard * mesh.tp // split
    spans = mesh.dp_shard * mesh.tp > gpus_per_node
    rails = max(1, min(group, gpus_per_node // split))
    ids = layer.io_bytes * microbatch * group / split
    shard = layer.saved_bytes * ctx.act_scale * microbatch / mesh.tp
    return (collective_s("all_gather", ids, group, spans, hw, rails)
            + 2 * collective_s("all_to_all", shard, group, spans, hw, rails))


def dp_shard_tp_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, act: float,
                  ctx: CostContext) -> float:
    """A ``DP_SHARD_TP`` feed-forward's activation collectives for one micro-batch (0 in other
    modes): its input all-gathered over dp_shard on the batch and its output reduce-scattered
    back (again in a full recompute), their transposes in backward; each full buffer the
    dp_shard ranks' shards of the stream (``act`` / tp each), unfused. The dp_shard ranks are
    tp apart: across nodes once dp_shard x tp outgrows one, a rail per member on each node."""
    if DP_SHARD_TP not in sub_block_modes(strategy.tp_mode):
        return 0.0
    spans = mesh.dp_shard * mesh.tp > ctx.gpus_per_node
    rails = max(1, min(mesh.dp_shard, ctx.gpus_per_node // mesh.tp))
    full = act / mesh.tp * mesh.dp_shard
    passes = 2 if strategy.ac == "full" else 1
    return (passes + 1) * (collective_s("all_gather", full, mesh.dp_shard, spans, ctx.hw, rails)
                           + collective_s("reduce_scatter", full, mesh.dp_shard, spans,
                                          ctx.hw, rails))


def dp_shard_tp_weight_bytes(layer: Layer, mesh: Mesh, strategy: BlockStrategy,
                             param_bytes: float) -> float:
    """Bytes of a ``DP_SHARD_TP`` feed-forward's weights as its matmuls read them: a
    dp_shard-th, gathered over tp (0 in other modes)."""
    if DP_SHARD_TP not in sub_block_modes(strategy.tp_mode):
        return 0.0
    return sub_block_params(layer)[1] * param_bytes / mesh.dp_shard


def dp_shard_tp_weights_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, ctx: CostContext,
                          saturated: bool = False) -> tuple[float, float]:
    """(forward, backward) collectives of a ``DP_SHARD_TP`` feed-forward's weights for one
    micro-batch: all-gathered over tp in each forward pass (again in a full recompute), their
    gradients reduce-scattered back over tp (0 in other modes)."""
    gathered = dp_shard_tp_weight_bytes(layer, mesh, strategy, ctx.prec.param_bytes)
    if not gathered:
        return 0.0, 0.0
    tp_nodes = mesh.spans_nodes("tp", ctx.gpus_per_node)
    grads = gathered / ctx.prec.param_bytes * ctx.prec.reduce_bytes
    passes = 2 if strategy.ac == "full" else 1
    return (passes * collective_s("all_gather", gathered, mesh.tp, tp_nodes, ctx.hw,
                                  saturated=saturated),
            collective_s("reduce_scatter", grads, mesh.tp, tp_nodes, ctx.hw,
                         saturated=saturated))


def a2a_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, act: float, tp_nodes: bool,
          ctx: CostContext) -> float:
    """One all-to-all of ``A2A``'s output projection input (heads to sequence over tp, a
    tp-th of ``act`` per rank); 0 in other modes or where the graph records no such linear."""
    if not a2a_linears(layer, strategy.tp_mode):
        return 0.0
    return collective_s("all_to_all", act / mesh.tp, mesh.tp, tp_nodes, ctx.hw)


def a2a_weight_bytes(layer: Layer, mesh: Mesh, strategy: BlockStrategy, param_bytes: float
                     ) -> float:
    """Bytes of ``A2A``'s output projection weights gathered whole over tp for the matmul
    (their gradient as many, reduce-scattered back); 0 in other modes."""
    if mesh.tp == 1:
        return 0.0
    return param_bytes * sum(k * n for i, (k, n) in enumerate(layer.linear_shapes)
                             if i in a2a_linears(layer, strategy.tp_mode))


class RingCost(NamedTuple):
    """Context parallel's ring attention for one micro-batch through a block (``cp_comm_s``)."""

    hidden_s: float
    """Transfer time the attention compute does not hide."""
    latency_s: float
    """The neighbours' synchronisation of every ring step (never hidden)."""


def cp_comm_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
              ctx: CostContext) -> RingCost:
    """(exposed transfer time, latency) of ring attention for one micro-batch through a block
    (zeros without CP): cp - 1 exchanges of the local keys/values in forward, twice that in
    backward (keys/values and their gradients), hidden under the attention compute; each ring
    step also synchronises the neighbours, a latency never hidden."""
    if mesh.cp == 1:
        return RingCost(0.0, 0.0)
    hw = ctx.hw
    kv = layer.kv_bytes * microbatch * ctx.act_scale / (mesh.cp * mesh.tp)
    cp_nodes = mesh.spans_nodes("cp", ctx.gpus_per_node)
    step = collective_s("all_to_all", kv * 2, 2, cp_nodes, hw)  # one neighbour exchange
    exchanges = (mesh.cp - 1) * (3 + (1 if strategy.ac == "full" else 0))
    attn = layer.attn_flops * microbatch / (mesh.tp * mesh.cp) / hw.attention_flops_per_s
    attn *= 1.0 + hw.attention_backward_factor + AC_EFFECT[strategy.ac][1]
    hidden = max(0.0, step * exchanges - hw.comm_overlap * attn)
    alpha = (hw.inter_node_latency_us if cp_nodes else hw.intra_node_latency_us) * 1e-6
    return RingCost(hidden, exchanges * alpha)


def sub_block_params(layer: Layer, experts: bool = True) -> tuple[float, float]:
    """(attention, feed-forward) parameters of a block (``linear_sub_blocks``): each
    sub-block's linear weights, the rest (its two norms) shared evenly; a MoE block's routed
    experts in its feed-forward where ``experts`` (else apart: expert parallel)."""
    parts = [0.0, 0.0]
    for (k, n), part in zip(layer.linear_shapes, linear_sub_blocks(layer), strict=True):
        parts[part] += k * n
    rest = (layer.params - layer.expert_params - sum(parts)) / 2
    return parts[0] + rest, parts[1] + rest + (layer.expert_params if experts else 0.0)


class FsdpCost(NamedTuple):
    """FSDP / HSDP of one block for one micro-batch (``fsdp_s``)."""

    fwd_s: float
    """Collectives in forward (the all-gathers)."""
    bwd_s: float
    """Collectives in backward (all-gathers again after resharding, reduce-scatters, HSDP's
    all-reduce)."""
    copy_s: float
    """Copies on the training stream (host copies, device copy-in / copy-out, CPU offload)."""
    unsharded_bytes: float
    """The block's parameters as FSDP all-gathers them."""
    grad_bytes: float
    """Its unsharded gradients before the reduce-scatter."""


def fsdp_groups(layer: Layer, mesh: Mesh, tp_mode: str) -> list[tuple[float, int, int]]:
    """(parameters, their split over tp / ep, their FSDP group's size) per FSDP group of a
    block in ``tp_mode``: the block (its parameters split over tp by TP + SP, whole under
    "dp"), or one group per sub-block (``split_fsdp``: TP + SP's split over tp and sharded
    over dp_shard x cp, data parallel's whole and sharded over dp_shard x tp,
    ``DP_SHARD_TP``'s in none; ``SHARED_DP`` (ep = 1): the shared experts whole and sharded
    over dp_shard x tp, out of the feed-forward's TP + SP group); with ep > 1 the routed
    experts apart, split over ep x etp and sharded over the remaining efsdp ranks."""
    if shared_experts_dp(tp_mode):  # the shared experts apart from the feed-forward's group
        shared = sum(k * n for i, (k, n) in enumerate(layer.linear_shapes)
                     if i in layer.shared_expert_linears)
        *rest, (n, split, size) = fsdp_groups(layer, mesh, without_shared_dp(tp_mode))
        return [*rest, (n - shared, split, size), (shared, 1, fsdp_group_size(mesh, "dp"))]
    ep = mesh.ep if layer.expert_params else 1
    groups = [(layer.params - (layer.expert_params if ep > 1 else 0),
               1 if tp_mode == "dp" else mesh.tp, fsdp_group_size(mesh, tp_mode))]
    if split_fsdp(tp_mode):
        groups = [(n, mesh.tp if mode == "sp" else 1, fsdp_group_size(mesh, mode))
                  for n, mode in zip(sub_block_params(layer, experts=ep == 1),
                                     sub_block_modes(tp_mode), strict=True)
                  if mode != DP_SHARD_TP]
    if ep > 1:
        groups.append((layer.expert_params, mesh.ep * mesh.etp, mesh.efsdp))
    return groups


def fsdp_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, ctx: CostContext, low: float,
           saturated: bool = False) -> FsdpCost:
    """FSDP / HSDP for one micro-batch through ``layer``. ``low``: the share of the parameters
    all-gathered in float8. ``saturated``: every collective at its link's peak bandwidth
    without latency, a floor under every FSDP unit's share of its unit's collectives. None for
    the embedding looked up on its embedding dim (``EMBEDDING_DIM``: never gathered); under
    ``EMBEDDING_DIM_GATHER`` its dp_shard-th of the table all-gathered over tp in forward and
    its gradient reduce-scattered back (no copies on the host: outside FSDP)."""
    if strategy.tp_mode in EMBEDDING_MODES:
        return _embedding_table_s(layer, mesh, strategy, ctx, saturated)
    hw, prec, gpus_per_node, features = ctx.hw, ctx.prec, ctx.gpus_per_node, ctx.features
    fsdp_group = fsdp_group_size(mesh, strategy.tp_mode)
    # FSDP: all-gather params in forward (and again in backward if resharded), reduce-scatter
    # grads; HSDP adds an all-reduce of the shard over dp_replicate
    ds_nodes = mesh.dp_shard * mesh.cp * mesh.tp > gpus_per_node
    rep_nodes = mesh.spans_nodes("dp_replicate", gpus_per_node)
    groups = fsdp_groups(layer, mesh, strategy.tp_mode)
    gathers = 2 if strategy.reshard_after_forward else 1
    # an integer reshard keeps a 1/node shard after forward and all-gathers it back over the
    # node's ranks (NVLink) in backward
    node = reshard_group(strategy.reshard_after_forward)
    # an FSDP unit of k blocks gathers, reduce-scatters (and all-reduces) the k blocks'
    # parameters in one collective each: this block's share is 1/k of the unit's collective
    unit = strategy.fsdp_unit
    ag = rs = ar = node_ag = unsharded = gbytes = copied = 0.0
    for n_params, split, group in groups:
        gathered_bytes = (1.0 - low) * prec.param_bytes + low * 1.0
        pb, gb = n_params * gathered_bytes / split, n_params * prec.reduce_bytes / split
        # members of the group on one node (ranks are node-major; the group is strided by
        # the dims inside it)
        rails = max(1, min(group, gpus_per_node * group // max(mesh.dp_shard * mesh.cp
                                                                * mesh.tp, 1)))
        rep_rails = max(1, gpus_per_node // (mesh.dp_shard * mesh.cp * mesh.tp))
        ag += collective_s("all_gather", unit * pb, group, ds_nodes, hw, rails,
                           saturated) / unit
        if node:
            node_ag += collective_s("all_gather", unit * pb, node, False, hw, 1,
                                   saturated) / unit
        rs += collective_s("reduce_scatter", unit * gb, group, ds_nodes, hw, rails,
                           saturated) / unit
        ar += collective_s("all_reduce", unit * gb / group, mesh.dp_replicate, rep_nodes, hw,
                           rep_rails, saturated) / unit
        unsharded += pb
        gbytes += gb
        if group > 1:
            # every micro-batch: the all-gathered parameters (again after resharding) and the
            # reduce-scattered gradients pass through host copies on the training thread
            copied += pb * gathers + gb + (pb / node if node else 0.0)
    own_ag, own_rs = dp_shard_tp_weights_s(layer, mesh, strategy, ctx, saturated)
    fwd_comm = ag + own_ag
    bwd_comm = (node_ag if node else ag if strategy.reshard_after_forward else 0.0) + rs + ar \
        + own_rs
    copy_s = copied / (hw.host_copy_gbps * 1e9) if hw.host_copy_gbps > 0 else 0.0
    if hw.gemm_table and hw.hbm_gbps > 0:
        # FSDP2's copy-out / cast / copy-in kernels run on the device between the blocks
        # (4 B per parameter per gather of FSDP_COPY_BYTES_PER_PARAM, the rest per reduce)
        per_param = FSDP_COPY_BYTES_PER_PARAM - 4.0 + 4.0 * gathers
        copy_s += sum(n * per_param / split for n, split, group in groups if group > 1) / (
            hw.hbm_gbps * 1e9)
    if features.cpu_offload and hw.pcie_gbps > 0:
        # sharded parameters come from host memory for every all-gather, reduced gradient
        # shards go back (FSDP's CPUOffloadPolicy), on the training stream
        copy_s += sum(n * (prec.param_bytes * gathers + prec.reduce_bytes) / (split * group)
                      for n, split, group in groups) / (hw.pcie_gbps * 1e9)
    if features.float8_all_gather and not features.precompute_scale and fsdp_group > 1:
        # without the precomputed scale, every float8 weight all-reduces its amax when gathered
        copy_s += len(layer.linear_shapes) * gathers * collective_s(
            "all_reduce", 4.0, fsdp_group, ds_nodes, hw, 1, saturated)
    return FsdpCost(fwd_comm, bwd_comm, copy_s, unsharded, gbytes)


def _embedding_table_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, ctx: CostContext,
                       saturated: bool) -> FsdpCost:
    """``fsdp_s`` of the embedding looked up on its embedding dim: nothing under
    ``EMBEDDING_DIM``; under ``EMBEDDING_DIM_GATHER`` its dp_shard-th of the table all-gathered
    over tp in forward and its gradient reduce-scattered back (outside FSDP: no host copies)."""
    if strategy.tp_mode == EMBEDDING_DIM:
        return FsdpCost(0.0, 0.0, 0.0, 0.0, 0.0)
    prec, part = ctx.prec, layer.params / mesh.dp_shard
    tp_nodes = mesh.spans_nodes("tp", ctx.gpus_per_node)
    return FsdpCost(
        collective_s("all_gather", part * prec.param_bytes, mesh.tp, tp_nodes, ctx.hw,
                     saturated=saturated),
        collective_s("reduce_scatter", part * prec.reduce_bytes, mesh.tp, tp_nodes, ctx.hw,
                     saturated=saturated),
        0.0, part * prec.param_bytes, part * prec.reduce_bytes)


def moe_dispatch_s(layer: Layer, mesh: Mesh, microbatch: int, ctx: CostContext) -> float:
    """One token dispatch (or combine) all-to-all over the ep group: every local token goes to
    its top-k experts. With etp = 1 the tp ranks split the tokens first (TorchTitan's
    ReordererSequenceParallel); with etp = tp each tp rank sends the same tokens. Routing is
    assumed uniform up to the profile's ``moe_load_imbalance`` (busiest rank / mean)."""
    # io_bytes: one sequence of hidden states in fp32; act_scale converts to the compute dtype
    nbytes = microbatch * layer.io_bytes * ctx.act_scale / mesh.cp * layer.top_k
    if mesh.etp == 1:
        nbytes /= mesh.tp
    nbytes *= load_imbalance(ctx.hw)
    return collective_s("all_to_all", nbytes, mesh.ep, mesh.spans_nodes("ep", ctx.gpus_per_node),
                        ctx.hw)
