"""Compute time of a block from its kernels: GEMMs by shape from the profile's tables (bf16,
float8 with its casts), attention (flash / ring), the loss, and the memoized per-block sum."""

import dataclasses
import functools
from dataclasses import dataclass

from ..candidates.layout import (
    DP_SHARD_TP,
    SUB_BLOCK_TP_MODES,
    BlockStrategy,
    Mesh,
    a2a_mode,
    shared_experts_dp,
    stream_dim,
    sub_block_modes,
    without_shared_dp,
)
from ..graph.layer_graph import Layer
from ..job.features import Features
from . import kernels
from .common import _COMPUTE, _MEMOS, AC_EFFECT, CostContext, _memoized
from .hardware import HardwareProfile
from .moe import moe_table

# float8 dynamic scaling, bytes moved per element of one cast of a bf16 operand: eager, amax
# (read 2 B) then cast (read 2 B, write 1 B); compiled, the amax fuses into the producing
# kernel (read 2 B, write 1 B). A transpose of a float8 operand reads and writes 1 B.
FLOAT8_CAST_BYTES = {False: 5.0, True: 3.0}
FLOAT8_TRANSPOSE_BYTES = 2.0


def gemm_speedup(layer: Layer, mesh: Mesh, strategy: BlockStrategy, hw: HardwareProfile,
                 features: Features) -> float:
    """Throughput of the block's linears with the job's low-precision recipe / bf16, weighted
    by their FLOPs: large GEMMs get the profile's speedup, small ones proportionally less."""
    if features.linear == "none" or not layer.linear_shapes:
        return 1.0
    full = {"float8_tensorwise": hw.float8_speedup, "mx": hw.mx_speedup}.get(
        features.linear, hw.float8_rowwise_speedup)
    flops = time = 0.0
    for (k, n), (split, _) in zip(layer.linear_shapes, linear_splits(layer, mesh, strategy, 1),
                                  strict=True):
        dim = min(k, n) / split
        knee = min(1.0, dim / hw.float8_full_speed_dim) if hw.float8_full_speed_dim else 1.0
        flops += k * n
        time += k * n / (1.0 + (full - 1.0) * knee)
    return flops / time


@functools.lru_cache(maxsize=4096)
def _shape_sums(shapes: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(summed input widths, summed weight sizes) of a block's linears."""
    return sum(k for k, _ in shapes), sum(k * n for k, n in shapes)


def _seq_tokens(layer: Layer) -> float:
    """Tokens of one sequence (the linears' input elements / their summed input widths)."""
    width = _shape_sums(layer.linear_shapes)[0]
    return layer.linear_input_elements / width if width else 0.0


def _tp_split(k: int, n: int, tp: int, style: str = "") -> tuple[float, float]:
    """A linear's local (in, out) under tensor parallelism: a column-wise linear splits its
    outputs, a row-wise one its inputs, a replicated one neither (the TP plan's style); where
    the style is unknown, the wider side is split."""
    if style == "replicate" or tp == 1:
        return k, n
    if style in ("colwise", "rowwise"):
        return (k, n / tp) if style == "colwise" else (k / tp, n)
    return (k / tp, n) if k > n else (k, n / tp)


def linear_styles(layer: Layer) -> tuple[str, ...]:
    """The TP style of each of the block's linears ("" where the graph does not record it)."""
    n = len(layer.linear_shapes)
    return layer.linear_styles if len(layer.linear_styles) == n else ("",) * n


def _low_speedups(hw: HardwareProfile, features: Features) -> tuple[float, float]:
    """(forward and input-gradient, weight-gradient) GEMM speedup of the job's low-precision
    linears over bf16 at large shapes."""
    speedup = {"float8_tensorwise": hw.float8_gemm_speedup,
               "float8_rowwise": hw.float8_rowwise_gemm_speedup,
               "float8_rowwise_with_gw_hp": hw.float8_rowwise_gemm_speedup,
               "mx": hw.mx_speedup}.get(features.linear, 1.0)
    # the weight-gradient GEMM stays bf16 with rowwise_with_gw_hp
    return speedup, 1.0 if features.linear == "float8_rowwise_with_gw_hp" else speedup


def gemm_times(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
               hw: HardwareProfile, features: Features) -> tuple[float, float]:
    """(forward, backward) seconds of the block's dense linears from the profile's measured
    GEMM table, each linear's three GEMMs at their own local shapes. Low-precision linears
    (``low_precision_linears``): the compute-bound part of each GEMM (its throughput / the
    table's plateau) runs ``float8_gemm_speedup`` (tensorwise) or
    ``float8_rowwise_gemm_speedup`` faster, the rest (launch- and memory-bound) does not; under
    async TP the all-gathered GEMMs run in tp chunks."""
    speedup, wgrad_speedup = _low_speedups(hw, features)
    low = low_precision_linears(layer, mesh, strategy, microbatch, hw, features)
    styles, measured = linear_styles(layer), measured_float8_table(hw, features)
    fwd = bwd = 0.0
    # one group of linears per use of the tp dim (a sub-block mode: attention and FFN apart)
    for idx, tp, tokens in linear_groups(layer, mesh, strategy, microbatch):
        chunks = tp if features.async_tp and tp > 1 else 1
        f, b = _linears_s(_pick(layer.linear_shapes, idx), tokens, tp, chunks, hw.gemm_table,
                          hw.clock_scale, speedup, wgrad_speedup, _pick(low, idx),
                          _pick(styles, idx), measured, hw.hbm_gbps)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def _pick(items: tuple, idx: tuple[int, ...]) -> tuple:
    return tuple(items[i] for i in idx)


def linear_sub_blocks(layer: Layer) -> tuple[int, ...]:
    """Per linear of the block, its sub-block: 0 in the block's child holding the first linear
    (the attention of a pre-norm block, e.g. ``attention.wq`` or 0.3.0's
    ``attention.qkv_linear.wq`` beside ``attention.wo``), 1 elsewhere (the feed-forward)."""
    regions = [name.partition(".")[0] for name in linear_names(layer)]
    return tuple(0 if region == regions[0] else 1 for region in regions)


def linear_groups(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int
                  ) -> tuple[tuple[tuple[int, ...], int, float], ...]:
    """The block's linears grouped by what the tp dim does for them: (their indices, the tp
    split of their weights, the tokens one rank's linears see per micro-batch); one group for a
    whole-block tp mode, one per sub-block (``linear_sub_blocks``) for a sub-block mode, and
    under ``A2A`` one more for the attention's row-wise linears (whole, a tp-th of the
    tokens), under ``MOE_ROUTED_TP`` for the shared experts' (whole, a tp-th of the
    tokens)."""
    n = len(layer.linear_shapes)
    if shared_experts_dp(strategy.tp_mode):
        shared = layer.shared_expert_linears
        rest = linear_groups(layer, mesh, dataclasses.replace(
            strategy, tp_mode=without_shared_dp(strategy.tp_mode)), microbatch)
        return (*((tuple(i for i in idx if i not in shared), tp, tokens)
                  for idx, tp, tokens in rest),
                (shared, 1, linear_tokens(layer, mesh, BlockStrategy("none", False, "dp"),
                                          microbatch)))
    if strategy.tp_mode not in SUB_BLOCK_TP_MODES:
        return ((tuple(range(n)), mesh.tp if strategy.tp_mode == "sp" else 1,
                 linear_tokens(layer, mesh, strategy, microbatch)),)
    parts = linear_sub_blocks(layer)
    own = a2a_linears(layer, strategy.tp_mode)
    groups = tuple((tuple(i for i in range(n) if parts[i] == part and i not in own),
                    *_sub_block_split(layer, mesh, mode, microbatch))
                   for part, mode in enumerate(sub_block_modes(strategy.tp_mode)))
    if own:  # whole weights on a tp-th of the tokens (the sequence shard)
        groups += ((own, 1, linear_tokens(layer, mesh, BlockStrategy("none", False, "dp"),
                                          microbatch)),)
    return groups


def _sub_block_split(layer: Layer, mesh: Mesh, mode: str, microbatch: int
                     ) -> tuple[int, float]:
    """(weight split, tokens per rank) of a sub-block's linears in ``mode``: TP + SP's tp
    split on every token of the micro-batch, data parallel's whole weights on a tp-th of them,
    ``DP_SHARD_TP``'s dp_shard split on the dp_shard ranks' tokens of this tp rank's shard."""
    if mode == DP_SHARD_TP:
        return mesh.dp_shard, linear_tokens(layer, mesh, BlockStrategy("none", False, "sp"),
                                            microbatch) * mesh.dp_shard / mesh.tp
    return (mesh.tp if mode == "sp" else 1,
            linear_tokens(layer, mesh, BlockStrategy("none", False, mode), microbatch))


def a2a_linears(layer: Layer, tp_mode: str) -> tuple[int, ...]:
    """The attention sub-block's row-wise linears (indices in ``linear_shapes``) that
    ``tp_mode`` runs on the sequence shard with their weights whole (``layout.A2A_MODES``);
    empty in other modes and where the graph does not record the linears' TP styles."""
    if not a2a_mode(tp_mode):
        return ()
    parts, styles = linear_sub_blocks(layer), linear_styles(layer)
    return tuple(i for i, (part, style) in enumerate(zip(parts, styles, strict=True))
                 if part == 0 and style == "rowwise")


def linear_splits(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int
                  ) -> tuple[tuple[int, float], ...]:
    """Per linear, in ``linear_shapes`` order: (tp split of its weight, tokens one rank's
    linear sees per micro-batch) (``linear_groups``)."""
    out: list[tuple[int, float]] = [(1, 0.0)] * len(layer.linear_shapes)
    for idx, tp, tokens in linear_groups(layer, mesh, strategy, microbatch):
        for i in idx:
            out[i] = (tp, tokens)
    return tuple(out)


def measured_float8_table(hw: HardwareProfile, features: Features) -> str:
    """The profile's measured float8 linear table for the job's recipe ("" where it has none:
    the GEMM speedup and the casts are costed apart)."""
    return hw.float8_rowwise_table if features.linear == "float8_rowwise" else ""


# torchao's float8 micro-benchmark times LayerNorm -> Linear -> Sigmoid (compiled, forward and
# backward) in both dtypes: the norm and the sigmoid, the same in both, move about 10 B per
# element of the linear's input and output (forward read + write 4 B, backward read the
# gradient and the input, write the gradient: 6 B)
LINEAR_BENCH_STREAM_BYTES = 10.0
FLOAT8_TENSOR_CORE_RATIO = 2.0
"""Dense float8 / bf16 tensor-core peak (datasheets: H100 1979 / 989, B200 4.5 / 2.25 PFLOP/s):
no float8 linear runs faster than this against bf16."""


def _measured_float8_s(bf16_s: float, tokens: float, k: float, n: float, measured: str,
                       hbm_gbps: float) -> float:
    """Seconds of one float8 linear (GEMMs and casts) from a measured speedup table: the
    benchmark's speedup covers the norm and sigmoid around the linear too, so they are added
    to the bf16 time before and taken off after."""
    around = LINEAR_BENCH_STREAM_BYTES * tokens * (k + n) / (hbm_gbps * 1e9) if hbm_gbps else 0.0
    speedup = kernels.table_speedup(measured, tokens, k, n)
    return max(bf16_s / FLOAT8_TENSOR_CORE_RATIO, (bf16_s + around) / speedup - around)


def linear_tokens(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int
                   ) -> float:
    """Tokens one rank's linears see per micro-batch under a whole-block tp mode (cp splits
    sequences; tp used as data parallel splits the batch; per sub-block: ``linear_groups``)."""
    batch_split = mesh.tp if strategy.tp_mode == "dp" else 1
    return _seq_tokens(layer) * microbatch / (mesh.cp * batch_split)


@functools.lru_cache(maxsize=65536)
def _linears_s(shapes: tuple[tuple[int, int], ...], tokens: float, tp: int, chunks: int,
               table: str, clock: float, speedup: float, wgrad_speedup: float,
               low: tuple[bool, ...], styles: tuple[str, ...] = (), measured: str = "",
               hbm_gbps: float = 0.0) -> tuple[float, float]:
    """``gemm_times`` for one set of linear shapes, ``low`` marking those in low precision,
    ``styles`` their TP styles, ``measured`` a measured float8 linear table that costs the low
    ones, casts included (memoised: the search asks again and again)."""
    plateau = kernels.table_flops(table, "bf16", *GEMM_PLATEAU)
    fwd = bwd = 0.0
    for (k, n), is_low, style in zip(shapes, low, styles or ("",) * len(shapes), strict=True):
        k_loc, n_loc = _tp_split(k, n, tp, style)
        gemms = ((tokens / chunks, n_loc, k_loc, chunks), (tokens / chunks, k_loc, n_loc, chunks),
                 (k_loc, n_loc, tokens, 1))
        times = []
        for (m, nn, kk, count), fast in zip(gemms, (speedup, speedup, wgrad_speedup), strict=True):
            t = count * kernels.gemm_s(m, nn, kk, table, clock)
            if is_low and fast != 1.0 and not measured:
                bound = min(1.0, kernels.table_flops(table, "bf16", m, nn, kk) / plateau)
                t *= bound / fast + 1.0 - bound
            times.append(t)
        if is_low and measured:
            bf16 = sum(times)
            ratio = _measured_float8_s(bf16, tokens, k_loc, n_loc, measured, hbm_gbps) / bf16
            times = [t * ratio for t in times]
        fwd += times[0]
        bwd += times[1] + times[2]
    return fwd, bwd


AUTO_FILTER_SMALL_KN = "auto_filter_small_kn"
"""TorchTitan's ``filter_fqns`` entry that hands the choice to torchao's size thresholds."""


def _torchao_converts(k: int, n: int, recipe: str) -> bool:
    """Whether torchao's ``_auto_filter_for_recipe`` (TorchTitan's "auto_filter_small_kn")
    converts a ``k`` -> ``n`` linear to float8 with ``recipe``."""
    import torch
    from torchao.float8 import _auto_filter_for_recipe

    linear = torch.nn.Linear(k, n, bias=False, device="meta")
    return bool(_auto_filter_for_recipe(recipe, [])(linear, ""))


@dataclass(frozen=True)
class CastElements:
    """Elements of one micro-batch's float8 operands that casts read (a rank's local shapes)."""

    inputs: float
    """The linears' inputs, cast in forward (one shared input counted once where it is cast
    once)."""
    inputs_again: float
    """The inputs once more for the weight gradient (tensorwise: the float8 input transposed;
    rowwise: cast again along the token dim)."""
    grads: float
    """The output gradients, cast in backward."""
    weights: float
    """The weights, cast in forward (0 where FSDP all-gathers them in float8)."""
    weights_again: float
    """The weights once more for the input gradient (tensorwise: transposed; rowwise: cast
    again along the output dim)."""


def float8_cast_elements(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                         features: Features, low: tuple[bool, ...]) -> CastElements:
    """What the float8 casts of the block's low-precision linears (``low``) read, at each
    linear's local shape under its TP style (a column-wise linear casts its all-gathered input,
    unsplit; a row-wise one its split input and its unsplit output gradient). The column-wise
    linears of one module read the same input: compiled, AOTAutograd's common-subexpression
    pass leaves one amax and cast of it (torch._functorch.config.cse), and TorchTitan's float8
    TP styles (PrepareFloat8ModuleInput) cast it once, before the all-gather, on the
    sequence-sharded input. With FSDP's float8 all-gather the weights arrive in float8 (cast on
    the shard before the gather: a 1 / shard of the casts)."""
    rowwise = features.linear.startswith("float8_rowwise")
    share_bwd = features.compile
    seen_fwd: set[tuple[str, int]] = set()
    seen_bwd: set[tuple[str, int]] = set()
    inputs = again = grads = weights = 0.0
    for (k, n), is_low, name, style, (tp, tokens) in zip(
            layer.linear_shapes, low, linear_names(layer), linear_styles(layer),
            linear_splits(layer, mesh, strategy, microbatch), strict=True):
        if not is_low:
            continue
        gathered_tp = features.linear == "float8_tensorwise" and tp > 1
        share_fwd = features.compile or gathered_tp
        k_loc, n_loc = _tp_split(k, n, tp, style)
        grads += tokens * n_loc
        weights += k_loc * n_loc
        key = input_key(name, style, k)
        if key is None or not share_fwd or key not in seen_fwd:
            inputs += tokens * k_loc / (tp if gathered_tp and style == "colwise" else 1)
        if key is None or not share_bwd or key not in seen_bwd:
            again += tokens * k_loc
        if key is not None:
            seen_fwd.add(key)
            seen_bwd.add(key)
    fwd_weights = weights
    if features.float8_all_gather and not rowwise and mesh.dp_shard > 1:
        fwd_weights = weights / (mesh.dp_shard * mesh.cp)
    return CastElements(inputs, again, grads, fwd_weights, weights)


def cast_s(elements: CastElements, hw: HardwareProfile, features: Features, linears: int
           ) -> tuple[float, float]:
    """(forward, backward) seconds of the float8 casts of ``linears`` linears: bytes at
    device-memory bandwidth, each cast / amax a kernel of its own with a launch-bound floor
    where the profile has a GEMM table. Tensorwise (torchao's Float8Linear): forward casts the
    input and the weight, backward the output gradient, and transposes the float8 output
    gradient, input and weight for the weight and input gradients. Rowwise (torchao's rowwise
    recipe: scales along each GEMM's reduction dim): forward casts the input and the weight
    along the inner dim, backward casts the output gradient twice (along the output and the
    token dim), the input along the token dim and the weight along the output dim."""
    if features.linear == "none" or hw.hbm_gbps <= 0 or not linears:
        return 0.0, 0.0
    rowwise = features.linear.startswith("float8_rowwise")
    cast, move = FLOAT8_CAST_BYTES[features.compile], FLOAT8_TRANSPOSE_BYTES
    e = elements
    fwd_bytes = cast * (e.inputs + e.weights)
    if rowwise:
        bwd_bytes = cast * (2 * e.grads + e.inputs_again + e.weights_again)
    else:
        bwd_bytes = cast * e.grads + move * (e.grads + e.inputs_again + e.weights_again)
    fwd = fwd_bytes / (hw.hbm_gbps * 1e9)
    bwd = bwd_bytes / (hw.hbm_gbps * 1e9)
    if hw.gemm_table:
        fwd_k, bwd_k = FLOAT8_CAST_KERNELS[rowwise]
        launch = linears * hw.kernel_launch_us * 1e-6
        fwd, bwd = fwd + fwd_k * launch, bwd + bwd_k * launch
    return fwd, bwd


def linear_names(layer: Layer) -> tuple[str, ...]:
    """The names of the block's linears, in ``linear_shapes`` order ("" for a graph that does
    not record them)."""
    n = len(layer.linear_shapes)
    return layer.linear_names if len(layer.linear_names) == n else ("",) * n


def low_precision_linears(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                          hw: HardwareProfile, features: Features) -> tuple[bool, ...]:
    """Which of the block's linears run the job's low-precision recipe. TorchTitan's converter
    takes those with both dims multiples of 16 whose FQN contains no ``filter_fqns`` entry
    (``features.float8_filter``; its "auto_filter_small_kn" entry applies torchao's size
    thresholds). Under auto without ``filter_fqns`` (None), a float8 job converts those where
    float8 is predicted faster than bf16 at the linear's local shapes, casts included, except
    in TP + SP blocks, where TorchTitan's float8 TP styles expect every linear converted."""
    shapes = layer.linear_shapes
    if features.linear == "none":
        return (False,) * len(shapes)
    names = linear_names(layer)
    filters = features.float8_filter or ()
    fqns = [f for f in filters if f != AUTO_FILTER_SMALL_KN]
    low = tuple(k % 16 == 0 and n % 16 == 0
                and not any(f in f"{layer.fqn}.{name}" for f in fqns)
                and (AUTO_FILTER_SMALL_KN not in filters
                     or _torchao_converts(k, n, features.linear.removeprefix("float8_")))
                for (k, n), name in zip(shapes, names, strict=True))
    if features.float8_filter is not None or not features.float8 or not hw.gemm_table \
            or ("sp" in sub_block_modes(strategy.tp_mode) and mesh.tp > 1):
        return low
    tokens = linear_tokens(layer, mesh, strategy, microbatch)
    alone = tuple(is_low and _float8_pays(k, n, tokens, hw, features)
                  for (k, n), is_low in zip(shapes, low, strict=True))
    # compiled, a column-wise linear whose input another converted linear of its module already
    # casts (float8_cast_elements) pays only its own GEMMs and output-gradient casts
    shared = {input_key(name, style, k) for (k, _), name, style, pays in zip(
        shapes, names, linear_styles(layer), alone, strict=True) if pays} if features.compile \
        else set()
    return tuple(pays or (is_low and input_key(name, style, k) in shared - {None}
                          and _float8_pays(k, n, tokens, hw, features, shared_input=True))
                 for (k, n), name, style, is_low, pays in zip(
                     shapes, names, linear_styles(layer), low, alone, strict=True))


def input_key(name: str, style: str, k: int) -> tuple[str, int] | None:
    """Linears with one key read one input (the column-wise linears of a module); None: its
    own."""
    return (name.rpartition(".")[0], k) if style == "colwise" else None


def float8_linear_times(k: int, n: int, tokens: float, hw: HardwareProfile,
                        features: Features, shared_input: bool = False
                        ) -> tuple[float, float]:
    """(bf16, float8) seconds of one ``k`` -> ``n`` linear over ``tokens`` tokens, forward and
    backward: its three GEMMs, and in float8 its casts too (``shared_input``: its input's casts
    are another linear's)."""
    speedup, wgrad = _low_speedups(hw, features)
    args = ((k, n),), tokens, 1, 1, hw.gemm_table, hw.clock_scale, speedup, wgrad
    measured = measured_float8_table(hw, features)
    # FSDP's float8 all-gather (tensorwise) brings the weight in float8
    gathered = features.float8_all_gather and not features.linear.startswith("float8_rowwise")
    inputs = 0.0 if shared_input else tokens * k
    cast = CastElements(inputs, inputs, tokens * n, 0.0 if gathered else k * n, k * n)
    casts = 0.0 if measured else sum(cast_s(cast, hw, features, 1))
    return (sum(_linears_s(*args, (False,))),
            sum(_linears_s(*args, (True,), (), measured, hw.hbm_gbps)) + casts)


def _float8_pays(k: int, n: int, tokens: float, hw: HardwareProfile, features: Features,
                 shared_input: bool = False) -> bool:
    """Whether one linear runs faster in float8 than in bf16 (``float8_linear_times``)."""
    bf16, float8 = float8_linear_times(k, n, tokens, hw, features, shared_input)
    return float8 < bf16


def attention_times(layer: Layer, mesh: Mesh, microbatch: int, hw: HardwareProfile
                    ) -> tuple[float, float]:
    """(forward, backward) seconds of the block's attention: flash-attention throughput by
    sequence length, saturating as ``peak * s / (s + s_half)`` (profile fields from public
    flash-attention benchmarks), per direction."""
    if not layer.attn_flops:
        return 0.0, 0.0
    seq = _seq_tokens(layer) / mesh.cp
    flops = layer.attn_flops * microbatch / (mesh.tp * mesh.cp)
    sat = seq / (seq + hw.attention_half_seq) if hw.attention_half_seq else 1.0
    fwd = flops / (hw.attention_fwd_tflops * 1e12 * hw.clock_scale * sat)
    bwd = (hw.attention_backward_factor * flops
           / (hw.attention_bwd_tflops * 1e12 * hw.clock_scale * sat))
    if mesh.cp > 1 and hw.hbm_gbps > 0:
        ring_fwd, ring_bwd = ring_attention_bytes(layer, mesh, microbatch)
        fwd += ring_fwd / (hw.hbm_gbps * 1e9)
        bwd += ring_bwd / (hw.hbm_gbps * 1e9)
    return fwd, bwd


# torch's ring attention (torch/distributed/tensor/experimental/_context_parallel/
# _attention.py: _templated_ring_attention and its backward, _SDPAMerger, _partial_update), in
# bytes per element of one rank's local queries / outputs (q) or keys / values (kv), eager ops,
# on the rank that sets the pace: the last of the ring, whose every later step takes all its
# queries against half the keys (the flash work is balanced, the bookkeeping is not)
RING_FWD_FIRST_Q = 6.0
"""Step 0: the block output upcast to fp32 (read 2 B, write 4)."""
RING_FWD_STEP_Q = 38.0
"""Each later step: the upcast (6) and the merge out - sigmoid(lse_b - lse) * (out - out_b) in
three fp32 passes (12 + 8 + 12)."""
RING_FWD_STEP_KV = 4.0
"""Every step but the last, per key / value element: the local keys and values concatenated
into one send buffer (read 2 B, write 2)."""
RING_FWD_END_Q = 6.0
"""The merged output back to bf16 (read 4, write 2)."""
RING_BWD_STEP_Q = 10.0
"""Each backward step: grad_query += the step's (fp32 read 4 + bf16 read 2, write 4)."""
RING_BWD_STEP_KV = 27.0
"""Each backward step, per key / value element: the send buffer (4), the partial update of
grad_key / grad_value (the first half += the step's: 5, then a torch.cat of both halves: 8),
the fp32 gradients concatenated for the ring (read 4, write 4: 8), their zero init, first-step
accumulation and final downcast spread over the steps (2)."""
RING_BWD_END_Q = 10.0
"""grad_query's fp32 zero init (4 B) and downcast (6 B)."""
RING_BWD_CALL_Q = 14.0
"""Each flash backward call past the first (the first is in the measured throughput): flash
attention 2's backward runs a pre-pass rowsum(dO * O) that zeroes its fp32 dq accumulator (read
2 + 2 B, write 4) and a final dq conversion (read 4, write 2) over the queries it is given (all
of them on the pacing rank)."""


def ring_attention_bytes(layer: Layer, mesh: Mesh, microbatch: int) -> tuple[float, float]:
    """(forward, backward) device-memory bytes of torch's ring attention around the flash
    kernels on one rank per micro-batch: each of the cp steps upcasts its partial output and
    log-sum-exp to fp32 and merges it into the running output, and the backward accumulates
    the query gradient and the ring's key / value gradients in fp32. All of it is elementwise,
    at device-memory bandwidth, and grows with the local sequence times cp (the steps)."""
    tokens = _seq_tokens(layer) * microbatch / (mesh.cp * mesh.tp)
    seq = _seq_tokens(layer)
    q = tokens * layer.attn_flops / (2.0 * seq * seq) if seq else 0.0
    kv = tokens * layer.kv_bytes / (4.0 * seq) if seq else 0.0
    steps = mesh.cp
    fwd = (RING_FWD_FIRST_Q * q + (steps - 1) * (RING_FWD_STEP_Q * q + RING_FWD_STEP_KV * kv)
           + RING_FWD_END_Q * q)
    bwd = (steps * (RING_BWD_STEP_Q * q + RING_BWD_STEP_KV * kv) + RING_BWD_END_Q * q
           + (steps - 1) * RING_BWD_CALL_Q * q)
    return fwd, bwd


FLOAT8_CAST_KERNELS = {False: (3, 5), True: (6, 10)}
"""Cast / amax / transpose kernels per float8 linear, forward and backward (tensorwise: amax and
cast of the input and weight, then of the output gradient and the transposed operands;
rowwise casts each operand along both dims)."""
LOSS_FWD_BYTES = 18.0
LOSS_BWD_BYTES = 18.0
"""Bytes moved per logit by TorchTitan's eager cross-entropy (fp32), forward / backward."""
COMPILED_LOSS_PASSES = (2, 2)
"""Passes over the logits (each their element size) of the cross-entropy compiled by Inductor
(``compile.components`` with "loss"), forward / backward: the upcast, log-softmax and NLL fuse
into reductions that read the low-precision logits twice (max, then the sum of exponentials);
the backward reads them once and writes their gradient once."""
FSDP_COPY_BYTES_PER_PARAM = 18.0
"""Device-memory traffic per parameter of one FSDP2 gather + reduce-scatter round: the
all-gather's copy-out into the unsharded bf16 parameters (2 B read + 2 written), the bf16
gradients cast to the fp32 reduce dtype (2 + 4) and the reduce-scatter's copy-in (4 + 4)."""
STREAM_OP_ELEMENTS = 5.0
"""Elements a pre-norm sub-block's RMSNorm and residual add move per element of the residual
stream in forward: the norm reads and writes one each, the add reads two and writes one."""
GEMM_PLATEAU = (8192.0, 8192.0, 8192.0)
"""A shape past every table's grid: the table's large-GEMM throughput."""


def whole_stream_bytes(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int
                       ) -> float:
    """Forward bf16 traffic a replicated stream (``layout.REPLICATED_MODES``) adds to one
    rank's micro-batch: its TP sub-blocks' norms and residual adds run on every token, where
    SP runs them on a tp-th (``STREAM_OP_ELEMENTS``); 0 on a sharded stream."""
    if stream_dim(strategy.tp_mode) is not None or mesh.tp == 1:
        return 0.0
    tp_parts = sub_block_modes(strategy.tp_mode).count("sp")
    # io_bytes: the stream of one sequence in fp32 (4 B per element), here at 2 B
    return (tp_parts * STREAM_OP_ELEMENTS * layer.io_bytes / 2 * microbatch / mesh.cp
            * (1 - 1 / mesh.tp))


def compute_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
              ctx: CostContext) -> tuple[float, float]:
    """``block_compute_s`` on the mesh's dp_shard x cp x tp and the strategy's AC and TP modes
    alone (what it depends on), memoized: the search costs the same block on many meshes that
    differ only in their replication and expert-parallel degrees, and with several resharding
    choices."""
    hw, prec, features = ctx.hw, ctx.prec, ctx.features
    shard = _compute_shard(mesh, features)
    key = (id(layer), id(hw), id(prec), id(features), shard, mesh.tp, mesh.cp,
           strategy.ac, strategy.tp_mode, microbatch)
    return _memoized(_COMPUTE, key, (layer, hw, prec, features), _compute_of, layer, shard,
                     mesh, strategy, microbatch, ctx)


def _compute_of(layer: Layer, shard: int, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                ctx: CostContext) -> tuple[float, float]:
    """``block_compute_s`` on dp_shard ``shard`` x the mesh's cp x tp, the strategy's AC and TP
    mode alone (what ``compute_s`` keys it by)."""
    return block_compute_s(layer, Mesh(dp_replicate=1, dp_shard=shard, tp=mesh.tp, cp=mesh.cp),
                           BlockStrategy(strategy.ac, False, strategy.tp_mode), microbatch, ctx)


def _compute_shard(mesh: Mesh, features: Features) -> int:
    """The dp_shard degree as compute sees it: only the float8 all-gather's weight casts
    (``float8_cast_elements``) depend on it."""
    return mesh.dp_shard if features.float8_all_gather else 1


def clear_compute_memo() -> None:
    """Forget memoized compute times, floors, edge costs and host profiles (each job is planned
    from none: a kernel table or cost function changed between jobs is costed afresh)."""
    for memo in _MEMOS:
        memo.clear()


def block_compute_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                    ctx: CostContext) -> tuple[float, float]:
    """(forward, forward + backward + recomputation) compute time of one micro-batch: GEMMs
    (from the measured GEMM table where the profile has one, else at the profile's flat
    efficiency, sped up by float8 / MX linears), attention, and the streaming kernels between
    them at device-memory bandwidth (each eager op reads and writes its operands; compiled,
    only the GEMM operands move once), plus float8 casts. It depends on the strategy's AC and
    tp mode only (``compute_s`` memoizes it for the strategies that share them: resharding,
    FSDP units)."""
    hw, prec, features = ctx.hw, ctx.prec, ctx.features
    _, recompute_frac = AC_EFFECT[strategy.ac]
    # cp splits every sequence (head-tail load balancing evens out causal attention)
    scale = microbatch / (mesh.tp * mesh.cp)
    # routed experts run grouped GEMMs (low precision with quantize.grouped_mm.*, rowwise
    # scaled), everything else nn.Linear GEMMs (low precision with quantize.linear.*)
    if hw.gemm_table:
        gemm_fwd, gemm_bwd = gemm_times(layer, mesh, strategy, microbatch, hw, features)
        attn_fwd, attn_bwd = attention_times(layer, mesh, microbatch, hw)
        rate = kernels.table_flops(hw.gemm_table, "bf16", *GEMM_PLATEAU) * hw.clock_scale
        if layer.expert_flops and not moe_table(hw.gemm_table):
            # else costed from their kernels by cost.moe (block_cost)
            grouped = {"float8": hw.float8_rowwise_gemm_speedup, "mx": hw.mx_speedup}.get(
                features.grouped_mm, 1.0)
            expert = layer.expert_flops * scale / (rate * grouped)
            gemm_fwd, gemm_bwd = gemm_fwd + expert, gemm_bwd + 2.0 * expert
        # GEMMs outside the linears' shapes (the output projection, MLA's einsums): large,
        # at the table's plateau
        covered = 2.0 * _seq_tokens(layer) * _shape_sums(layer.linear_shapes)[1]
        rest = max(0.0, layer.fwd_flops - layer.attn_flops - layer.expert_flops - covered)
        gemm_fwd += rest * scale / rate
        gemm_bwd += 2.0 * rest * scale / rate
    else:
        grouped = {"float8": hw.float8_rowwise_speedup, "mx": hw.mx_speedup}.get(
            features.grouped_mm, 1.0)
        dense = layer.fwd_flops - layer.attn_flops - layer.expert_flops
        gemm_fwd = (dense / gemm_speedup(layer, mesh, strategy, hw, features)
                    + layer.expert_flops / grouped) * scale / hw.flops_per_s
        gemm_bwd = 2.0 * gemm_fwd
        attn_fwd = layer.attn_flops * scale / hw.attention_flops_per_s
        attn_bwd = hw.attention_backward_factor * attn_fwd
    stream = cast_fwd = cast_bwd = 0.0
    if hw.hbm_gbps > 0:
        # traffic was measured in a bf16 forward (io_bytes: fp32); compiled, the residual
        # stream is read and written once more around the fused regions
        traffic = (layer.gemm_io_bytes + layer.io_bytes / 2 if features.compile
                   else layer.eager_bytes) * prec.param_bytes / 2
        stream = (traffic * scale + whole_stream_bytes(layer, mesh, strategy, microbatch)
                  * prec.param_bytes / 2) / (hw.hbm_gbps * 1e9)
        low = low_precision_linears(layer, mesh, strategy, microbatch, hw, features)
        if not measured_float8_table(hw, features):  # else inside the measured linear times
            cast_fwd, cast_bwd = cast_s(float8_cast_elements(layer, mesh, strategy, microbatch,
                                                             features, low),
                                        hw, features, sum(low))
    loss_fwd = loss_bwd = 0.0
    if layer.kind == "output" and hw.hbm_gbps > 0 and hw.gemm_table:
        # the eager cross-entropy on fp32 logits (saved_bytes: one sequence's fp32 logits):
        # upcast (2 B read, 4 B written), log-softmax (max, sum and output passes: 12 B),
        # and in backward its gradient (8 B read, 4 B written) and the downcast (4 + 2 B)
        logits = layer.saved_bytes / 4 * scale
        fwd_bytes, bwd_bytes = LOSS_FWD_BYTES, LOSS_BWD_BYTES
        if features.compile_loss:
            fwd_bytes, bwd_bytes = (n * prec.param_bytes for n in COMPILED_LOSS_PASSES)
        loss_fwd = logits * fwd_bytes / (hw.hbm_gbps * 1e9)
        loss_bwd = logits * bwd_bytes / (hw.hbm_gbps * 1e9)
    fwd = gemm_fwd + attn_fwd + stream + cast_fwd + loss_fwd
    bwd = gemm_bwd + attn_bwd + 2.0 * stream + cast_bwd + loss_bwd
    return fwd, fwd + bwd + recompute_frac * fwd
