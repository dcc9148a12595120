"""Per-block time and memory for a strategy on a mesh, and the fixed per-step terms.

Alpha-beta collectives (ring: (p-1)/p of the buffer for all-gather / reduce-scatter, 2(p-1)/p for
all-reduce; intra- vs inter-node bandwidth by whether the mesh dim spans nodes). FSDP collectives
overlap a fraction (profile ``comm_overlap``) of the block's compute; TP collectives are exposed.
On CPU training (profile ``host_cores``) ranks that outnumber the cores time-share them, and
their collectives wait for peers to be scheduled; every layer pays a fixed host overhead.
Memory counts parameters (in the dtypes the model builds them in: fp32 master weights, bf16 for
gpt_oss's blocks), gradients and AdamW state sharded over dp_shard x tp,
activations kept for backward (scaled by AC), unsharded parameters of blocks that keep them
between forward and backward, the logits, and the transient working set of one block; under
autocast (one device, DDP) also the cached low-precision weight copies.
"""

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..features import EAGER, Features
from ..graph.layer_graph import Layer, LayerGraph
from ..layout import TP_MODES, BlockStrategy, Mesh, edge_strategy, reshard_group
from . import kernels
from .hardware import HardwareProfile

# activation checkpointing: (fraction of activations kept, fraction of forward recomputed)
# selective = TorchTitan's op-level SAC: it keeps the outputs of every other matmul and of
# attention (besides the block input, counted apart). In a Llama 3 block that is wq, wv, w1, w2
# and the attention output, 27,648 of the 98,300 elements per token an eager block saves for
# backward without AC (8B; 0.276 for 70B): 0.28 of the measured saved bytes.
AC_EFFECT = {"none": (1.0, 0.0), "selective": (0.28, 0.5), "full": (0.0, 1.0)}
STATE_BYTES_PER_PARAM = 16  # fp32 param + fp32 grad + AdamW exp_avg + exp_avg_sq
# Peak is the larger of two phases. Forward/backward: parameters + AdamW moments (12 B/param;
# gradients do not exist yet: TorchTitan zeroes them to None) + activations + working set.
# Optimizer step: parameters, gradients and both moments (16 B/param) plus what
# optimizer.implementation allocates meanwhile: foreach one temporary of every parameter
# (20 B/param), fused none (16), for-loop one parameter's temporaries at a time (not counted).
# Measured with MemTracker on CPU, plain and FSDP-sharded AdamW (eight equal parameters:
# fused 16, foreach 20, for-loop 17.5).
FWD_BWD_BYTES_PER_PARAM = 12
STEP_BYTES_PER_PARAM = {"fused": 16, "foreach": 20, "for-loop": 16}
# With gradient accumulation the fp32 gradients of earlier micro-batches are resident too.
GRAD_BYTES_PER_PARAM = 4
# Under autocast (bf16 compute on fp32 weights: one device or DDP) the residual stream, norms
# and RoPE stay fp32: block activations are this much above the all-bf16 estimate (MemTracker
# on one H200: 1.16 for llama3 3B, 1.21 for 1B).
AUTOCAST_ACTIVATION_FACTOR = 1.19


def state_bytes(layer: Layer) -> float:
    """Unsharded parameters, gradients and AdamW's two moments of ``layer``: each a copy of
    the parameters in their own dtype (16 B per fp32 parameter, 8 per bf16 one). The per-phase
    byte counts below are per fp32 parameter and scale the same way."""
    return layer.stored_param_bytes * STATE_BYTES_PER_PARAM / 4


@dataclass(frozen=True)
class Precision:
    param_bytes: int = 4
    """Bytes per element of all-gathered parameters and activations (mixed_precision_param)."""
    reduce_bytes: int = 4
    """Bytes per element of gradient reduction (mixed_precision_reduce)."""


@dataclass(frozen=True)
class BlockCost:
    time_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    kept_bytes: float
    """Memory held from this block's forward until its backward (activations, unsharded params)."""
    state_bytes: float
    """Parameters, gradients and optimizer state, always resident."""
    transient_bytes: float
    """Working set while this block runs its backward."""
    exposed_parts: tuple[tuple[str, float], ...] = ()
    """Exposed communication and host copies by kind (before the host's core sharing):
    "tp", "cp ring", "ep all-to-all", "fsdp / dp", "host copies"; for pictures."""
    unsharded_bytes: float = 0.0
    """The block's parameters as FSDP all-gathers them (its local TP / EP shard)."""
    grad_bytes: float = 0.0
    """Its unsharded gradients before the reduce-scatter (reduce dtype)."""

    # the terms of a block on a pipeline stage (``cost.pipeline.StageBlockCost``) as a flat plan
    # has them: parameters and optimizer state counted per candidate, collectives in time_s
    resident_bytes = step_s = step_bytes = 0.0

    def plan_fields(self) -> dict[str, float]:
        """The block's predictions in a plan's layer entry."""
        return {"time_ms": round(self.time_s * 1e3, 6),
                "comm_ms": round(self.exposed_comm_s * 1e3, 6),
                "memory_mib": round((self.kept_bytes + self.state_bytes) / 2**20, 6)}

    EXPLAINED: ClassVar[tuple[str, str]] = ("compute_ms", "exposed_comm_ms")
    """What ``explained`` returns, as ``explain``'s rows name it."""

    def explained(self) -> tuple[float, float]:
        """(compute, exposed communication) per micro-batch in seconds."""
        return self.compute_s, self.exposed_comm_s


def autocast(mesh: Mesh, prec: Precision) -> bool:
    """TorchTitan trains under ``torch.autocast`` (fp32 weights, low-precision compute) when no
    FSDP applies the mixed precision: one device or pure data-parallel replication."""
    return prec.param_bytes < 4 and mesh.unsharded


def collective_s(kind: str, nbytes: float, group: int, spans_nodes: bool,
                 hw: HardwareProfile, rails: int = 1, saturated: bool = False) -> float:
    """Time of one ring collective of ``nbytes`` (full buffer) over ``group`` ranks: a latency
    per ring step and the bytes each rank moves at the link's bus bandwidth for that message
    size (saturating in the size where the profile gives ``*_half_mib``). Across nodes NCCL
    runs one ring per network rail: a group with ``rails`` members on each node moves its
    bytes over that many NICs at once (never faster than inside the node). ``saturated``: at
    the peak bandwidth without latency, the limit of a large message's time per byte."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    peak = (min(hw.intra_node_gbps, rails * hw.inter_node_gbps) if spans_nodes
            else hw.intra_node_gbps)
    half = (hw.inter_node_half_mib if spans_nodes else hw.intra_node_half_mib) * 2**20
    bw = (peak if saturated else kernels.bus_gbps(nbytes, peak, half)) * 1e9
    alpha = 0.0 if saturated else (
        hw.inter_node_latency_us if spans_nodes else hw.intra_node_latency_us) * 1e-6
    factor = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}[kind]
    return factor * ((group - 1) * alpha + (group - 1) / group * nbytes / bw)


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
    split = mesh.tp if strategy.tp_mode == "sp" else 1
    flops = time = 0.0
    for k, n in layer.linear_shapes:
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
    tp = mesh.tp if strategy.tp_mode == "sp" else 1
    tokens = linear_tokens(layer, mesh, strategy, microbatch)
    speedup, wgrad_speedup = _low_speedups(hw, features)
    chunks = tp if features.async_tp and tp > 1 else 1
    low = low_precision_linears(layer, mesh, strategy, microbatch, hw, features)
    return _linears_s(layer.linear_shapes, tokens, tp, chunks, hw.gemm_table, hw.clock_scale,
                      speedup, wgrad_speedup, low, linear_styles(layer),
                      measured_float8_table(hw, features), hw.hbm_gbps)


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
    """Tokens one rank's linears see per micro-batch (cp splits sequences; tp used as data
    parallel splits the batch)."""
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
    tp = mesh.tp if strategy.tp_mode == "sp" else 1
    tokens = linear_tokens(layer, mesh, strategy, microbatch)
    rowwise = features.linear.startswith("float8_rowwise")
    gathered_tp = features.linear == "float8_tensorwise" and tp > 1
    share_fwd, share_bwd = features.compile or gathered_tp, features.compile
    seen_fwd: set[tuple[str, int]] = set()
    seen_bwd: set[tuple[str, int]] = set()
    inputs = again = grads = weights = 0.0
    for (k, n), is_low, name, style in zip(layer.linear_shapes, low, linear_names(layer),
                                           linear_styles(layer), strict=True):
        if not is_low:
            continue
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
            or (strategy.tp_mode == "sp" and mesh.tp > 1):
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
GEMM_PLATEAU = (8192.0, 8192.0, 8192.0)
"""A shape past every table's grid: the table's large-GEMM throughput."""


_MEMOS: tuple[dict[tuple, tuple[Any, tuple]], ...] = ({}, {}, {}, {}, {})
"""Memoized compute times, model time floors (without FSDP; FSDP's parts per mesh), edge costs
and host profiles (``host_profile``) of the job being planned: each entry keyed by the identities
of the objects it was costed from (layer or graph, profile, precision, features) and what it
reads of the rest, and holding those objects so that their identities stay theirs."""
_COMPUTE, _FLOOR, _FSDP, _EDGE, _HOST = _MEMOS


def _memoized(memo: dict[tuple, tuple[Any, tuple]], key: tuple, held: tuple,
              cost: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``cost(*args, **kwargs)`` once per ``key`` (``held``: the objects whose identities the
    key holds)."""
    hit = memo.get(key)
    if hit is None:
        if len(memo) >= 1 << 16:
            memo.clear()
        hit = memo[key] = (cost(*args, **kwargs), held)
    return hit[0]


def compute_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
              hw: HardwareProfile, prec: Precision, features: Features) -> tuple[float, float]:
    """``block_compute_s`` on the mesh's dp_shard x cp x tp and the strategy's AC and TP modes
    alone (what it depends on), memoized: the search costs the same block on many meshes that
    differ only in their replication and expert-parallel degrees, and with several resharding
    choices."""
    shard = _compute_shard(mesh, features)
    key = (id(layer), id(hw), id(prec), id(features), shard, mesh.tp, mesh.cp,
           strategy.ac, strategy.tp_mode, microbatch)
    return _memoized(_COMPUTE, key, (layer, hw, prec, features), _compute_of, layer, shard,
                     mesh, strategy, microbatch, hw, prec, features)


def _compute_of(layer: Layer, shard: int, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                hw: HardwareProfile, prec: Precision, features: Features
                ) -> tuple[float, float]:
    """``block_compute_s`` on dp_shard ``shard`` x the mesh's cp x tp, the strategy's AC and TP
    mode alone (what ``compute_s`` keys it by)."""
    return block_compute_s(layer, Mesh(1, shard, mesh.tp, mesh.cp),
                           BlockStrategy(strategy.ac, False, strategy.tp_mode), microbatch, hw,
                           prec, features)


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
                    hw: HardwareProfile, prec: Precision, features: Features
                    ) -> tuple[float, float]:
    """(forward, forward + backward + recomputation) compute time of one micro-batch: GEMMs
    (from the measured GEMM table where the profile has one, else at the profile's flat
    efficiency, sped up by float8 / MX linears), attention, and the streaming kernels between
    them at device-memory bandwidth (each eager op reads and writes its operands; compiled,
    only the GEMM operands move once), plus float8 casts. It depends on the strategy's AC and
    tp mode only (``compute_s`` memoizes it for the strategies that share them: resharding,
    FSDP units)."""
    _, recompute_frac = AC_EFFECT[strategy.ac]
    # cp splits every sequence (head-tail load balancing evens out causal attention)
    scale = microbatch / (mesh.tp * mesh.cp)
    # routed experts run grouped GEMMs (low precision with quantize.grouped_mm.*, rowwise
    # scaled), everything else nn.Linear GEMMs (low precision with quantize.linear.*)
    if hw.gemm_table:
        gemm_fwd, gemm_bwd = gemm_times(layer, mesh, strategy, microbatch, hw, features)
        attn_fwd, attn_bwd = attention_times(layer, mesh, microbatch, hw)
        rate = kernels.table_flops(hw.gemm_table, "bf16", *GEMM_PLATEAU) * hw.clock_scale
        if layer.expert_flops:
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
        stream = traffic * scale / (hw.hbm_gbps * 1e9)
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


ROW_PARALLEL_FLOP_SHARE = 1 / 3
"""Share of a decoder block's linear FLOPs in its row-parallel linears (wo and w2; Llama 3 8B
34 %, 70B 35 %): the backward GEMMs a fused all-gather of their output gradient can hide under."""


def tp_region_gemms(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                    hw: HardwareProfile, features: Features) -> tuple[tuple[float, float], ...]:
    """(column-wise, row-wise) forward GEMM seconds of each module the block's TP plan gathers
    into and scatters out of (attention, FFN), at the job's shapes and precision; empty where
    the graph does not record the linears' styles or the block is not two such modules."""
    styles, names = linear_styles(layer), linear_names(layer)
    if not all(styles):
        return ()
    tp = mesh.tp if strategy.tp_mode == "sp" else 1
    tokens = linear_tokens(layer, mesh, strategy, microbatch)
    speedup, wgrad = _low_speedups(hw, features)
    chunks = tp if features.async_tp and tp > 1 else 1
    low = low_precision_linears(layer, mesh, strategy, microbatch, hw, features)
    measured = measured_float8_table(hw, features)
    regions: dict[str, list[float]] = {}
    for shape, is_low, style, name in zip(layer.linear_shapes, low, styles, names, strict=True):
        fwd, _ = _linears_s((shape,), tokens, tp, chunks, hw.gemm_table, hw.clock_scale, speedup,
                            wgrad, (is_low,), (style,), measured, hw.hbm_gbps)
        region = regions.setdefault(name.rpartition(".")[0], [0.0, 0.0, 0.0])
        region[0 if style == "colwise" else 1] += fwd
        region[2] += style == "rowwise"
    found = tuple((col, row) for col, row, rows in regions.values() if rows == 1)
    return found if len(found) == 2 else ()


def sp_comm_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int, act: float,
              tp_nodes: bool, hw: HardwareProfile, prec: Precision, features: Features
              ) -> float:
    """Exposed TP + SP communication of one micro-batch through a block.

    Each forward (and a full recomputation) all-gathers into the attention's and the FFN's
    column-parallel linears and reduce-scatters out of their row-parallel ones: 2 + 2
    collectives; backward runs their transposes, an all-gather of the row-parallel linears'
    output gradient and a reduce-scatter of the column-parallel linears' input gradient.
    Without async TP every collective is exposed. Async TP (Inductor's micro-pipeline pass)
    fuses an all-gather into the GEMMs that consume it and a reduce-scatter into the one GEMM
    that produces it; the transfers (copy engines, no SMs) then hide under those GEMMs, run in
    tp chunks, except the first chunk. What the pass cannot fuse stays exposed: the backward
    reduce-scatter (the input gradient is a sum of GEMMs, q + k + v and w1 + w3, not one
    GEMM), and every all-gather whose result is cast before its GEMMs (float8 rowwise in
    forward, the float8 output gradient in backward)."""
    fwd_passes = 2 if strategy.ac == "full" else 1
    gather = scatter = collective_s("all_gather", act, mesh.tp, tp_nodes, hw)
    # TorchTitan's float8 tensorwise TP styles cast the input before the forward all-gather
    # (1 byte per element); backward gathers the bf16 output gradient, cast afterwards
    gather_fwd = gather / prec.param_bytes if features.linear == "float8_tensorwise" else gather
    # SP gathers and scatters along the sequence dim (dim 1): with more than one sequence per
    # micro-batch the unfused collectives concatenate the chunks (torch.cat after the
    # all-gather, before the reduce-scatter), one more read and write of the full activation
    cat = (2 * act / (hw.hbm_gbps * 1e9)
           if microbatch > 1 and hw.gemm_table and hw.hbm_gbps > 0 else 0.0)
    # selective AC: TorchTitan's save list keeps reduce-scatter outputs, not all-gather ones,
    # so backward gathers the column-parallel linears' inputs again, for their weight
    # gradients (the gathered input as the transposed operand: not fused)
    regathers = 2 if strategy.ac == "selective" else 0
    # (seconds, count, fused under async TP) per kind of collective
    kinds = ((gather_fwd, 2 * fwd_passes, not features.linear.startswith(("float8_rowwise", "mx"))),
             (scatter, 2 * fwd_passes, True),
             (gather, 2, features.linear == "none"),
             (scatter, 2, False),
             (gather_fwd, regathers, False))
    if not features.async_tp or not hw.gemm_table:
        total = sum(n * (t + cat) for t, n, _ in kinds)
        return total * (1.0 - hw.async_tp_overlap) if features.async_tp else total
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
                    exposed += n / 2 * max(t / mesh.tp, t - gemm)
    else:
        gemm_fwd, _ = gemm_times(layer, mesh, strategy, microbatch, hw, features)
        hiding = gemm_fwd * (fwd_passes + (ROW_PARALLEL_FLOP_SHARE if kinds[2][2] else 0.0))
        exposed = max(fused / mesh.tp, fused - hiding)
    if hw.hbm_gbps > 0:
        # the fused matmul + reduce-scatter sums the tp partial products it gathered after
        # the last chunk: the full activation read, a tp-th written, on the compute stream
        exposed += 2 * fwd_passes * act * (1 + 1 / mesh.tp) / (hw.hbm_gbps * 1e9)
    return exposed + sum(n * (t + cat) for t, n, f in kinds if not f)


def tp_comm_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
              hw: HardwareProfile, prec: Precision, gpus_per_node: int, features: Features
              ) -> float:
    """Exposed TP communication of one micro-batch through a block: TP + SP's collectives
    (``sp_comm_s``) or, with tp as data parallel, the all-to-alls between sequence and batch
    shards; none in tp mode "none". It only grows with checkpointing (more passes, gathers)."""
    act = layer.io_bytes * microbatch * (prec.param_bytes / 4) / mesh.cp
    tp_nodes = mesh.spans_nodes("tp", gpus_per_node)
    if strategy.tp_mode == "sp":
        return sp_comm_s(layer, mesh, strategy, microbatch, act, tp_nodes, hw, prec, features)
    if strategy.tp_mode == "dp":
        # residual stream sequence-shard <-> batch-shard: one all-to-all at entry and exit,
        # both again in backward (and the entry again for a full recompute)
        a2a = collective_s("all_to_all", act / mesh.tp, mesh.tp, tp_nodes, hw)
        return a2a * (4 + (2 if strategy.ac == "full" else 0))
    return 0.0


def cp_comm_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
              hw: HardwareProfile, prec: Precision, gpus_per_node: int) -> tuple[float, float]:
    """(exposed transfer time, latency) of ring attention for one micro-batch through a block
    (zeros without CP): cp - 1 exchanges of the local keys/values in forward, twice that in
    backward (keys/values and their gradients), hidden under the attention compute; each ring
    step also synchronises the neighbours, a latency never hidden."""
    if mesh.cp == 1:
        return 0.0, 0.0
    kv = layer.kv_bytes * microbatch * (prec.param_bytes / 4) / (mesh.cp * mesh.tp)
    cp_nodes = mesh.spans_nodes("cp", gpus_per_node)
    step = collective_s("all_to_all", kv * 2, 2, cp_nodes, hw)  # one neighbour exchange
    exchanges = (mesh.cp - 1) * (3 + (1 if strategy.ac == "full" else 0))
    attn = layer.attn_flops * microbatch / (mesh.tp * mesh.cp) / hw.attention_flops_per_s
    attn *= 1.0 + hw.attention_backward_factor + AC_EFFECT[strategy.ac][1]
    hidden = max(0.0, step * exchanges - hw.comm_overlap * attn)
    alpha = (hw.inter_node_latency_us if cp_nodes else hw.intra_node_latency_us) * 1e-6
    return hidden, exchanges * alpha


def fsdp_s(layer: Layer, mesh: Mesh, strategy: BlockStrategy, hw: HardwareProfile,
           prec: Precision, gpus_per_node: int, features: Features, low: float,
           saturated: bool = False) -> tuple[float, float, float, float, float]:
    """FSDP / HSDP for one micro-batch through ``layer``: (forward collectives, backward
    collectives, copies on the training stream, unsharded parameter bytes, unsharded gradient
    bytes). ``low``: the share of the parameters all-gathered in float8. ``saturated``: every
    collective at its link's peak bandwidth without latency, a floor under every FSDP unit's
    share of its unit's collectives."""
    param_split = 1 if strategy.tp_mode == "dp" else mesh.tp
    fsdp_group = mesh.dp_shard * mesh.cp * (mesh.tp if strategy.tp_mode == "dp" else 1)
    # FSDP: all-gather params in forward (and again in backward if resharded), reduce-scatter
    # grads; HSDP adds an all-reduce of the shard over dp_replicate. With ep > 1 the routed
    # experts are split over ep x etp and FSDP-sharded over the remaining efsdp ranks.
    ds_nodes = mesh.dp_shard * mesh.cp * mesh.tp > gpus_per_node
    rep_nodes = mesh.spans_nodes("dp_replicate", gpus_per_node)
    ep = mesh.ep if layer.expert_params else 1
    groups = [(layer.params - (layer.expert_params if ep > 1 else 0), param_split, fsdp_group)]
    if ep > 1:
        groups.append((layer.expert_params, mesh.ep * mesh.etp, mesh.efsdp))
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
    fwd_comm = ag
    bwd_comm = (node_ag if node else ag if strategy.reshard_after_forward else 0.0) + rs + ar
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
    return fwd_comm, bwd_comm, copy_s, unsharded, gbytes


def block_cost(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
               hw: HardwareProfile, prec: Precision, gpus_per_node: int,
               grouped_experts: bool = True, features: Features = EAGER) -> BlockCost:
    """Time for one micro-batch through one block (forward + backward) and its memory."""
    hw = host_profile(hw, mesh, gpus_per_node)
    keep_frac, recompute_frac = AC_EFFECT[strategy.ac]
    act_scale = prec.param_bytes / 4
    cast = autocast(mesh, prec)
    saved_scale = act_scale * (AUTOCAST_ACTIVATION_FACTOR if cast else 1.0)
    io_scale = 1.0 if cast else act_scale  # the residual stream stays fp32 under autocast
    fwd, compute = compute_s(layer, mesh, strategy, microbatch, hw, prec, features)

    full_ac = strategy.ac == "full"
    # tp mode "dp": parameters are not split by tp but FSDP-sharded over dp_shard x tp
    fsdp_group = mesh.dp_shard * mesh.cp * (mesh.tp if strategy.tp_mode == "dp" else 1)
    ep = mesh.ep if layer.expert_params else 1
    node = reshard_group(strategy.reshard_after_forward)
    unit = strategy.fsdp_unit
    tp_only = tp_comm_s(layer, mesh, strategy, microbatch, hw, prec, gpus_per_node, features)
    cp_comm = sum(cp_comm_s(layer, mesh, strategy, microbatch, hw, prec, gpus_per_node))
    tp_comm = tp_only + cp_comm

    # float8 all-gather: the float8 linears' weights travel as 1 byte each
    # (TorchTitan's converter turns it off when dp_shard = 1)
    low = sum(k * n for (k, n), is_low in zip(
        layer.linear_shapes, low_precision_linears(layer, mesh, strategy, microbatch, hw, features),
        strict=True) if is_low) / max(layer.params, 1) \
        if features.float8_all_gather and mesh.dp_shard > 1 else 0.0
    fwd_comm, bwd_comm, copy_s, unsharded, gbytes = fsdp_s(layer, mesh, strategy, hw, prec,
                                                           gpus_per_node, features, low)
    exposed = max(0.0, fwd_comm - hw.comm_overlap * fwd) + max(
        0.0, bwd_comm - hw.comm_overlap * (compute - fwd)
    )
    # while a collective runs beside compute, NCCL's kernels hold SMs: the overlapped compute
    # runs on the rest of the device
    compute += hw.nccl_sm_fraction * (min(fwd_comm, hw.comm_overlap * fwd)
                                      + min(bwd_comm, hw.comm_overlap * (compute - fwd)))
    if layer.num_experts and not (hw.grouped_mm and grouped_experts):
        # one GEMM per local expert and projection: 3 forward, 6 backward (+3 recomputed)
        local = layer.num_experts // (mesh.ep if ep > 1 else 1)
        compute += local * 3 * (3 + (1 if recompute_frac else 0)) * hw.kernel_launch_us * 1e-6
    ep_comm = 0.0
    if ep > 1:
        ep_comm = moe_dispatch_s(layer, mesh, microbatch, act_scale, hw, gpus_per_node) * (
            4 + (2 if full_ac else 0))
        tp_comm += ep_comm
        # the slowest ep rank sets the pace: routed-expert compute scaled by the imbalance
        expert = layer.expert_flops * microbatch / (mesh.tp * mesh.cp) / hw.flops_per_s
        compute += expert * (3.0 + recompute_frac) * (hw.moe_load_imbalance - 1.0)
    time = host_time_s(compute + copy_s + tp_comm + exposed, mesh, hw, gpus_per_node)

    # what an eager block saves for backward without AC; compiled, the partitioner saves less
    # (fused pointwise chains keep their inputs only): what a block without AC keeps, and what
    # the recomputation of a checkpointed block materialises. Selective AC keeps the outputs of
    # the ops its policy saves, the same tensors compiled or not.
    eager_saved = layer.saved_bytes * microbatch * saved_scale / (mesh.tp * mesh.cp)
    saved = eager_saved * (hw.compile_saved_fraction if features.compile else 1.0)
    kept = (saved if strategy.ac == "none" else keep_frac * eager_saved) + (
        layer.io_bytes * microbatch * io_scale / (mesh.tp * mesh.cp)
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
        gathered = unit * (2 * unsharded + gbytes)
    else:
        gathered = gbytes if mesh.dp_replicate > 1 else 0.0
    transient = (saved if strategy.ac != "none" else 0.0) + gathered
    if full_ac and hw.recompute_grad_factor:
        # backward of a recomputed block: the gradients of its activations beside them, and
        # under TP + SP the all-gathered (unsplit) inputs of attention and FFN with theirs
        unsplit = 2 * layer.io_bytes * microbatch * act_scale / mesh.cp * (1 - 1 / mesh.tp)
        transient += hw.recompute_grad_factor * (saved + 2 * unsplit)
    parts = (("tp", tp_only), ("cp ring", cp_comm), ("ep all-to-all", ep_comm),
             ("fsdp / dp", exposed), ("host copies", copy_s))
    return BlockCost(time, compute, tp_comm + fwd_comm + bwd_comm, tp_comm + exposed,
                     kept, state, transient, parts, unsharded, gbytes)


_NO_AC = {mode: BlockStrategy("none", False, mode) for mode in ("none", *TP_MODES)}


def block_time_floor(layer: Layer, mesh: Mesh, microbatch: int, hw: HardwareProfile,
                     prec: Precision, gpus_per_node: int, features: Features,
                     tp_modes: tuple[str, ...], hide_ep: bool = False, fsdp: str = ""
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
    modes, extra, device = _block_time_floor(layer, mesh, microbatch, hw, prec, gpus_per_node,
                                             features, tp_modes, hide_ep)
    if fsdp:
        device = _with_fsdp(modes, extra, _fsdp_floor(layer, mesh, hw, prec, gpus_per_node,
                                                      features, tp_modes), hw, fsdp)
    return host_time_s(device, mesh, hw, gpus_per_node)


def _with_fsdp(modes: tuple[tuple[float, float, float], ...], extra: float,
               fsdp_modes: tuple[tuple[float, float, float], ...], hw: HardwareProfile,
               fsdp: str) -> float:
    """A block floor's device time with FSDP's collectives (``block_time_floor``): as
    ``block_cost`` counts them, monotone in the compute and in each collective's time, so the
    least of both bounds it for every strategy (AC and resharding only add to them)."""
    ov, sm, each = hw.comm_overlap, hw.nccl_sm_fraction, fsdp == "microbatch"
    return extra + min(
        compute + tp + sm * (min(ahead, ov * fwd) + min(back, ov * (compute - fwd))) + (
            max(0.0, ahead - ov * fwd) + max(0.0, back - ov * (compute - fwd)) + copies
            if each else 0.0)
        for (fwd, compute, tp), (ahead, back, copies) in zip(modes, fsdp_modes, strict=True))


def _block_time_floor(layer: Layer, mesh: Mesh, microbatch: int, hw: HardwareProfile,
                      prec: Precision, gpus_per_node: int, features: Features,
                      tp_modes: tuple[str, ...], hide_ep: bool
                      ) -> tuple[tuple[tuple[float, float, float], ...], float, float]:
    """((forward compute, compute, TP communication) without AC per mode of ``tp_modes``, the
    rest of the floor, the floor without FSDP) on the device."""
    hw = host_profile(hw, mesh, gpus_per_node)
    modes = tuple((*compute_s(layer, mesh, _NO_AC[mode], microbatch, hw, prec, features),
                   tp_comm_s(layer, mesh, _NO_AC[mode], microbatch, hw, prec, gpus_per_node,
                             features))
                  for mode in tp_modes)
    extra = cp_comm_s(layer, mesh, _NO_AC["none"], microbatch, hw, prec, gpus_per_node)[1]
    if layer.expert_params and mesh.ep > 1:
        act_scale = prec.param_bytes / 4
        if not hide_ep:
            extra += 4 * moe_dispatch_s(layer, mesh, microbatch, act_scale, hw, gpus_per_node)
        expert = layer.expert_flops * microbatch / (mesh.tp * mesh.cp) / hw.flops_per_s
        extra += expert * 3.0 * (hw.moe_load_imbalance - 1.0)
    return modes, extra, extra + min(compute + tp for _, compute, tp in modes)


def _fsdp_floor(layer: Layer, mesh: Mesh, hw: HardwareProfile, prec: Precision,
                gpus_per_node: int, features: Features, tp_modes: tuple[str, ...]
                ) -> tuple[tuple[float, float, float], ...]:
    """(forward collectives, backward collectives, copies) of FSDP per mode of ``tp_modes``
    that every strategy's micro-batch pays at least: ``fsdp_s`` without resharding, saturated,
    every float8 linear's weight gathered in float8 (it does not depend on the micro-batch)."""
    hw = host_profile(hw, mesh, gpus_per_node)
    low = sum(k * n for k, n in layer.linear_shapes) / max(layer.params, 1) \
        if features.float8_all_gather and mesh.dp_shard > 1 else 0.0
    return tuple(fsdp_s(layer, mesh, _NO_AC[mode], hw, prec, gpus_per_node, features, low,
                        saturated=True)[:3] for mode in tp_modes)


def model_time_floor(graph: LayerGraph, mesh: Mesh, microbatch: int, hw: HardwareProfile,
                     prec: Precision, gpus_per_node: int, features: Features,
                     tp_modes: tuple[str, ...], hide_ep: bool = False, fsdp: str = ""
                     ) -> float:
    """A floor under the forward + backward time of one micro-batch through the whole model on
    ``mesh`` whose blocks run one of ``tp_modes`` (``block_tp_modes``; edges run "sp" on
    tp > 1, one of them): every layer's ``block_time_floor``, from two memoized tables, one
    per what the compute reads of the mesh, one per mesh for FSDP."""
    # what the layers' floors without FSDP read of the mesh: the same on the many meshes that
    # differ in pp and dp
    key = (id(graph), id(hw), id(prec), id(features), _compute_shard(mesh, features), mesh.cp,
           mesh.tp, mesh.ep, mesh.etp, min(mesh.world, gpus_per_node), gpus_per_node,
           microbatch, tp_modes, hide_ep)
    layers, plain = _memoized(_FLOOR, key, (graph, hw, prec, features), _model_floor_parts,
                              graph, mesh, microbatch, hw, prec, gpus_per_node, features,
                              tp_modes, hide_ep)
    if not fsdp:
        return plain
    key = (id(graph), id(hw), id(prec), id(features), mesh, gpus_per_node, tp_modes)
    per_mesh = _memoized(_FSDP, key, (graph, hw, prec, features), _model_fsdp_parts, graph,
                         mesh, hw, prec, gpus_per_node, features, tp_modes)
    return sum(n * host_time_s(_with_fsdp(modes, extra, fsdp_modes, hw, fsdp), mesh, hw,
                               gpus_per_node)
               for (n, modes, extra), fsdp_modes in zip(layers, per_mesh, strict=True))


def _model_floor_parts(graph: LayerGraph, mesh: Mesh, microbatch: int, hw: HardwareProfile,
                       prec: Precision, gpus_per_node: int, features: Features,
                       tp_modes: tuple[str, ...], hide_ep: bool) -> tuple[tuple, float]:
    """((layers of a kind, ``_block_time_floor``'s parts) per kind of layer, the model's floor
    without FSDP)."""
    layers, plain = [], 0.0
    for layer, n in graph.alike:
        modes, extra, device = _block_time_floor(layer, mesh, microbatch, hw, prec,
                                                 gpus_per_node, features, tp_modes, hide_ep)
        layers.append((n, modes, extra))
        plain += n * host_time_s(device, mesh, hw, gpus_per_node)
    return tuple(layers), plain


def _model_fsdp_parts(graph: LayerGraph, mesh: Mesh, hw: HardwareProfile, prec: Precision,
                      gpus_per_node: int, features: Features, tp_modes: tuple[str, ...]
                      ) -> tuple:
    return tuple(_fsdp_floor(layer, mesh, hw, prec, gpus_per_node, features, tp_modes)
                 for layer, _ in graph.alike)


def moe_dispatch_s(layer: Layer, mesh: Mesh, microbatch: int, act_scale: float,
                   hw: HardwareProfile, gpus_per_node: int) -> float:
    """One token dispatch (or combine) all-to-all over the ep group: every local token goes to
    its top-k experts. With etp = 1 the tp ranks split the tokens first (TorchTitan's
    ReordererSequenceParallel); with etp = tp each tp rank sends the same tokens. Routing is
    assumed uniform up to the profile's ``moe_load_imbalance`` (busiest rank / mean)."""
    # io_bytes: one sequence of hidden states in fp32; act_scale converts to the compute dtype
    nbytes = microbatch * layer.io_bytes * act_scale / mesh.cp * layer.top_k
    if mesh.etp == 1:
        nbytes /= mesh.tp
    nbytes *= hw.moe_load_imbalance
    return collective_s("all_to_all", nbytes, mesh.ep, mesh.spans_nodes("ep", gpus_per_node), hw)


def core_share(mesh: Mesh, hw: HardwareProfile, gpus_per_node: int) -> float:
    """Ranks per core on a node when they outnumber ``host_cores`` (CPU training), else 1."""
    ranks_per_node = min(mesh.world, gpus_per_node)
    return max(1.0, ranks_per_node / hw.host_cores) if hw.host_cores > 0 else 1.0


def host_profile(hw: HardwareProfile, mesh: Mesh, gpus_per_node: int) -> HardwareProfile:
    """``hw`` with the collective latency of oversubscribed cores added (identity otherwise)."""
    if core_share(mesh, hw, gpus_per_node) <= 1.0 or not hw.oversubscribed_latency_us:
        return hw
    extra = hw.oversubscribed_latency_us
    # one object per profile: what the memoized costs of the job are keyed by
    return _memoized(_HOST, (id(hw),), (hw,), dataclasses.replace, hw,
                     intra_node_latency_us=hw.intra_node_latency_us + extra,
                     inter_node_latency_us=hw.inter_node_latency_us + extra)


def host_time_s(device_s: float, mesh: Mesh, hw: HardwareProfile, gpus_per_node: int) -> float:
    """A layer's time per micro-batch on the host: the device time, stretched when the ranks of
    a node outnumber its cores (``host_cores``), plus the fixed per-layer overhead."""
    return device_s * core_share(mesh, hw, gpus_per_node) + hw.block_overhead_us * 1e-6


def state_memory(state_bytes: float, accum: int, hw: HardwareProfile,
                 features: Features = EAGER) -> tuple[float, float, float]:
    """(forward/backward bytes, optimizer-step bytes, host optimizer seconds per step) of a
    device's ``state_bytes`` of parameters, gradients and optimizer state (flat plans):
    gradients are resident from the second micro-batch on; CPU offload keeps all of it, and
    AdamW, on the host."""
    per_param = state_bytes / STATE_BYTES_PER_PARAM
    fwd_bwd = FWD_BWD_BYTES_PER_PARAM + (
        GRAD_BYTES_PER_PARAM if accum > 1 or hw.reserved_gradients else 0)
    step_bytes, per_step = per_param * STEP_BYTES_PER_PARAM[features.optimizer], 0.0
    if features.cpu_offload:
        fwd_bwd, step_bytes = 0, 0.0
        if hw.host_optimizer_gbps > 0:
            per_step = state_bytes / (hw.host_optimizer_gbps * 1e9)
    return per_param * fwd_bwd, step_bytes, per_step


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


def edge_cost(graph: LayerGraph, layer: Layer, mesh: Mesh, microbatch: int,
              hw: HardwareProfile, prec: Precision, gpus_per_node: int,
              features: Features = EAGER) -> EdgeCost:
    """The embedding's or the norm + output's time and memory per micro-batch (memoized: the
    search costs a mesh's edges for several candidates)."""
    key = (id(graph), id(layer), id(hw), id(prec), id(features), mesh, microbatch,
           gpus_per_node)
    return _memoized(_EDGE, key, (graph, layer, hw, prec, features), _edge_cost, graph, layer,
                     mesh, microbatch, hw, prec, gpus_per_node, features)


def _edge_cost(graph: LayerGraph, layer: Layer, mesh: Mesh, microbatch: int,
               hw: HardwareProfile, prec: Precision, gpus_per_node: int,
               features: Features) -> EdgeCost:
    cost = block_cost(layer, mesh, edge_strategy(layer.kind, mesh), microbatch, hw, prec,
                      gpus_per_node, features=features)
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


def edges_cost(graph: LayerGraph, mesh: Mesh, microbatch: int, hw: HardwareProfile,
               prec: Precision, gpus_per_node: int, features: Features = EAGER
               ) -> EdgeCost:
    """Every edge layer's ``edge_cost`` summed (a flat plan holds them all on one rank), with
    the weight copies autocast keeps."""
    time = kept = state = logits = 0.0
    for layer in graph.edges:
        cost = edge_cost(graph, layer, mesh, microbatch, hw, prec, gpus_per_node, features)
        time += cost.time_s
        kept += cost.kept_bytes
        state += cost.state_bytes
        logits += cost.logits_bytes
    if autocast(mesh, prec):
        # autocast caches the low-precision copy of every weight it casts (all but the
        # embedding) from the forward until the backward
        kept += prec.param_bytes * (graph.total_params - sum(
            layer.params for layer in graph.edges if layer.kind == "embedding"))
    return EdgeCost(time, kept, state, logits)
