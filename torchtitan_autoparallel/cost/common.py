"""What every cost part shares: activation checkpointing's effect, bytes per parameter of
the training state, precision, the ``BlockCost`` result, and one ring collective's time."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..candidates.layout import Mesh
from ..graph.layer_graph import Layer
from ..job.features import EAGER, Features
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
OPTIMIZER_TRAFFIC_PER_PARAM = {"fused": 28.0, "foreach": 80.0, "for-loop": 80.0}
"""Device-memory bytes one AdamW step moves per fp32 parameter, by optimizer.implementation
(torch/optim/adamw.py, torch 2.9-2.13). fused: one kernel (ATen's _fused_adamw_) reads the
parameter, gradient, exp_avg and exp_avg_sq and writes back the parameter and both moments
(16 + 12 B). foreach / for-loop: one pass per op, each reading its operands and writing its
result: the decoupled weight decay p *= 1 - lr wd (8), exp_avg.lerp_(g) (12), exp_avg_sq *= b2
(8) and += (1 - b2) g^2 (12), sqrt(exp_avg_sq) into a temporary (8), its bias-correction
division (8) and + eps (8), p.addcdiv_(exp_avg, denom) (16)."""
GRAD_CLIP_TRAFFIC_PER_PARAM = 12.0
"""Device-memory bytes per fp32 parameter of the gradient clipping TorchTitan runs every step
(train.py: dist_utils.clip_grad_norm_(..., foreach=True), max_norm 1.0 by default): the total
norm (_foreach_norm reads every gradient: 4 B) and the scaling by the clamped clip
coefficient, applied whatever the norm (_foreach_mul_ reads and writes it: 8 B)."""
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


@dataclass(frozen=True, kw_only=True)
class CostContext:
    """What every cost term reads beside the layer, the mesh, the strategy and the micro-batch:
    the job's hardware profile, precisions, node size and compile / float8 / optimizer
    features. One per job (``JobInputs.cost_context``); memoized costs are keyed by the
    identities of its parts."""

    hw: HardwareProfile
    prec: Precision
    gpus_per_node: int
    features: Features = EAGER

    @property
    def act_scale(self) -> float:
        """Activation bytes per element relative to the fp32 ones the layer graph measured."""
        return self.prec.param_bytes / 4


def optimizer_step_s(state: float, ctx: CostContext) -> float:
    """Device seconds of one optimizer step over a device's ``state`` bytes of parameters,
    gradients and AdamW moments (``STATE_BYTES_PER_PARAM`` per fp32 parameter): the gradient
    clipping and the AdamW update as passes over device memory at the profile's HBM bandwidth
    (once per step, after the last micro-batch's backward). None on profiles without an HBM
    bandwidth, or with CPU offload (the host steps: ``host_optimizer_gbps``)."""
    hw, features = ctx.hw, ctx.features
    if hw.hbm_gbps <= 0 or features.cpu_offload:
        return 0.0
    traffic = OPTIMIZER_TRAFFIC_PER_PARAM[features.optimizer] + GRAD_CLIP_TRAFFIC_PER_PARAM
    return state / STATE_BYTES_PER_PARAM * traffic / (hw.hbm_gbps * 1e9)


@dataclass(frozen=True, kw_only=True)
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


_MEMOS: tuple[dict[tuple, tuple[Any, tuple]], ...] = ({}, {}, {}, {}, {})
"""Memoized compute times, model time floors (without FSDP; FSDP's parts per mesh), edge costs
and host profiles (``on_host``) of the job being planned: each entry keyed by the identities
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
