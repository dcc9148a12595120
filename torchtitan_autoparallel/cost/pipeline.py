"""Pipeline-parallel costs: schedule bubbles, micro-batches in flight, P2P sends, and what a
block costs on a pipeline stage.

Step time of a schedule with ``m`` micro-batches on ``pp`` ranks, each running ``v`` stages
whose forward + backward of one micro-batch takes ``T`` on the slowest rank:
``(m + beta) * T`` plus the per-step FSDP collectives, with ``beta`` (the bubble, in units of
``T``) from the literature:

* GPipe and 1F1B: ``beta = pp - 1`` (Narayanan et al. 2021, arXiv 2104.04473, section 2.2).
* Interleaved 1F1B with ``v`` stages per rank: ``beta = (pp - 1) / v`` (same paper, 2.2.2).
* Zero-bubble schedules split the backward into B (input gradients) and W (weight gradients)
  and fill the bubble with W (Qi et al. 2024, arXiv 2401.10241): ZB-H1 leaves
  ``(pp - 1)(F + B - W)`` of 1F1B's ``(pp - 1)(F + B + W)``, used here for
  InterleavedZeroBubble (divided by ``v`` like interleaving); ZB-V leaves
  ``(pp - 1)(F + B - 2W)`` in units of one of its two chunks.
* DualPipe (DeepSeek-V3 report, arXiv 2412.19437, table 2): ``(pp/2 - 1)(F&B + B - 3W)`` in
  chunk units, with the forward and backward of two micro-batches overlapped so that the
  expert-parallel all-to-all hides under computation.

F, B and W are split by FLOPs: linears cost F in B and F in W; attention has no weights and
costs ``attention_backward_factor`` x F in B; recomputation (AC) is part of B.

Activations in flight on pp rank ``r`` (in micro-batches of that rank's stages): GPipe ``m``;
1F1B ``min(m, pp - r)`` (Narayanan et al.); interleaved schedules run ``(v - 1) pp +
2 (pp - 1 - r)`` stage forwards before the first backward (PyTorch's
``ScheduleInterleaved1F1B`` warm-up), each ``1 / v`` of the rank's layers; ZB-V holds as much as
1F1B's first stage on every rank (Qi et al.), DualPipe ``pp + 1`` (DeepSeek-V3 report).
Each stage also keeps its output of every micro-batch in flight for the backward, the last
stage its logits (one micro-batch's, all of them under GPipe), and PyTorch's per-micro-batch
receive buffers (``boundary_tensors``).

Under PP, TorchTitan's FSDP keeps each stage's parameters unsharded and its gradients
unreduced across the micro-batches of a step (PyTorch's ``PipelineStage`` turns resharding and
gradient sync off until the last micro-batch): the all-gathers and reduce-scatters happen once
per step and the stage holds its unsharded parameters and gradients throughout.
"""

from dataclasses import dataclass
from typing import ClassVar

from ..candidates.layout import BlockStrategy, Mesh, fsdp_sharded
from ..candidates.schedules import SINGLE_STAGE
from ..graph.layer_graph import Layer, LayerGraph
from .hardware import HardwareProfile
from .model import (
    AC_EFFECT,
    FWD_BWD_BYTES_PER_PARAM,
    GRAD_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    STEP_BYTES_PER_PARAM,
    CostContext,
    Precision,
    block_cost,
    core_share,
    optimizer_step_s,
)


@dataclass(frozen=True)
class Split:
    """Forward, input-gradient and weight-gradient shares of a block's compute."""

    f: float
    b: float
    w: float


def backward_split(layer: Layer, strategy: BlockStrategy, hw: HardwareProfile) -> Split:
    """F / B / W of ``layer`` (shares summing to 1) by FLOPs, recomputation in B."""
    attn = layer.attn_flops / max(layer.fwd_flops, 1.0)
    linear = 1.0 - attn
    f = 1.0
    b = linear + attn * hw.attention_backward_factor + AC_EFFECT[strategy.ac][1]
    w = linear
    total = f + b + w
    return Split(f / total, b / total, w / total)


def bubble(schedule: str, pp: int, v: int, split: Split) -> float:
    """Idle time of the slowest rank per step, in units of its per-micro-batch time."""
    if schedule in SINGLE_STAGE:
        return float(pp - 1)
    if schedule == "Interleaved1F1B":
        return (pp - 1) / v
    if schedule == "InterleavedZeroBubble":
        return (pp - 1) / v * max(0.0, split.f + split.b - split.w)
    if schedule == "ZBVZeroBubble":
        return (pp - 1) / 2 * max(0.0, split.f + split.b - 2 * split.w)
    # DualPipeV: F&B is one overlapped forward + backward chunk pair
    return max(0.0, pp / 2 - 1) / 2 * max(0.0, 1.0 + split.b - 3 * split.w)


def in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> float:
    """Micro-batches of activations (of all its stages) pp rank ``rank`` holds at its peak."""
    if schedule == "GPipe":
        return float(m)
    if schedule == "1F1B":
        return float(min(m, pp - rank))
    if schedule == "ZBVZeroBubble":
        return float(min(m, pp))
    if schedule == "DualPipeV":
        return float(min(m, pp + 1))
    warmup = (v - 1) * pp + 2 * (pp - 1 - rank)
    return min(m * v, warmup + 1) / v


def boundary_bytes(graph: LayerGraph, mesh: Mesh, microbatch: int, prec: Precision) -> float:
    """A micro-batch's residual stream at a stage boundary (sequence-sharded under TP + SP,
    split by CP): what one stage sends the next, and the gradient sent back."""
    return microbatch * graph.seq_len * graph.dim * prec.param_bytes / (mesh.tp * mesh.cp)


def boundary_tensors(v: int, m: int, first: bool, last: bool) -> int:
    """Boundary-sized tensors a pp rank with ``v`` stages holds through a step of ``m``
    micro-batches (``first`` / ``last``: it runs the model's first / last stage). PyTorch's
    ``PipelineStage`` allocates a receive buffer per micro-batch for each stage input, on which
    backward leaves the input gradient until the next step, and one per micro-batch for each
    output gradient."""
    with_input = v - (1 if first else 0)
    with_output_grad = v - (1 if last else 0)
    return m * (2 * with_input + with_output_grad)


def p2p_s(graph: LayerGraph, mesh: Mesh, microbatch: int, ctx: CostContext) -> float:
    """One stage-boundary send of a micro-batch's residual stream to the neighbouring pp
    rank."""
    hw = ctx.hw
    nbytes = boundary_bytes(graph, mesh, microbatch, ctx.prec)
    nodes = mesh.spans_nodes("pp", ctx.gpus_per_node)
    bw = (hw.inter_node_gbps if nodes else hw.intra_node_gbps) * 1e9
    alpha = (hw.inter_node_latency_us if nodes else hw.intra_node_latency_us) * 1e-6
    return alpha + nbytes / bw


@dataclass(frozen=True)
class StageBlockCost:
    """One block on a pipeline stage: per micro-batch, per step, and its memory."""

    time_s: float
    """Forward + backward of one micro-batch (no FSDP collectives: those run once per step)."""
    step_s: float
    """Once per step: FSDP all-gather, reduce-scatter (and HSDP all-reduce), exposed, and the
    block's share of the optimizer step (``optimizer_step_s``)."""
    kept_bytes: float
    """Activations kept for backward per micro-batch in flight."""
    resident_bytes: float
    """Held all step: parameters + AdamW moments + gradients, and under FSDP the unsharded
    parameters and unreduced gradients."""
    step_bytes: float
    """Held during the optimizer step."""
    transient_bytes: float
    """Working set while its backward runs."""
    split: Split

    def plan_fields(self) -> dict[str, float]:
        """The block's predictions in a plan's layer entry."""
        return {"time_ms": round(self.time_s * 1e3, 6),
                "memory_mib": round((self.resident_bytes + self.kept_bytes) / 2**20, 6)}

    EXPLAINED: ClassVar[tuple[str, str]] = ("microbatch_ms", "fsdp_step_ms")
    """What ``explained`` returns, as ``explain``'s rows name it."""

    def explained(self) -> tuple[float, float]:
        """(time per micro-batch, exposed FSDP collectives once per step) in seconds."""
        return self.time_s, self.step_s


def stage_block_cost(layer: Layer, mesh: Mesh, strategy: BlockStrategy, microbatch: int,
                     ctx: CostContext, grouped_experts: bool = True, hide_ep: bool = False
                     ) -> StageBlockCost:
    """``layer`` with ``strategy`` on a stage of ``mesh``. Kept after forward (TorchTitan's
    FSDP default under PP), its parameters are gathered once per step; resharded, they are
    gathered again in every micro-batch's backward. ``hide_ep``: DualPipeV with its
    expert-parallel overlap hides the dispatch / combine all-to-all under computation."""
    cost = block_cost(layer, mesh, strategy, microbatch, ctx, grouped_experts)
    parts = dict(cost.exposed_parts)
    share = core_share(mesh, ctx)
    fsdp_exposed, copies = parts.get("fsdp / dp", 0.0), parts.get("host copies", 0.0)
    regather = strategy.reshard_after_forward
    per_mb = cost.time_s - (0.0 if regather else share * (fsdp_exposed + copies))
    if hide_ep:
        per_mb -= share * min(parts.get("ep all-to-all", 0.0), cost.compute_s)
    tp_like = cost.exposed_comm_s - fsdp_exposed
    fsdp_comm = max(0.0, cost.comm_s - tp_like)
    sharded = fsdp_sharded(mesh, strategy.tp_mode, bool(layer.expert_params))
    per_param = cost.state_bytes / STATE_BYTES_PER_PARAM
    resident = per_param * (FWD_BWD_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM)
    transient = cost.transient_bytes
    act = cost.kept_bytes
    if sharded:
        resident += cost.grad_bytes + (0.0 if regather else cost.unsharded_bytes)
        if not regather:  # kept after forward: counted once, not per micro-batch
            act -= cost.unsharded_bytes
            transient -= 2 * cost.unsharded_bytes
        transient -= cost.grad_bytes
    return StageBlockCost(
        time_s=max(0.0, per_mb),
        step_s=share * (fsdp_comm + copies) + optimizer_step_s(cost.state_bytes, ctx),
        kept_bytes=max(0.0, act),
        resident_bytes=resident,
        step_bytes=per_param * STEP_BYTES_PER_PARAM[ctx.features.optimizer],
        transient_bytes=max(0.0, transient),
        split=backward_split(layer, strategy, ctx.hw),
    )

