"""Routed experts of an MoE block from their kernels, as TorchTitan 0.2.2 runs them.

A routed-expert layer (``torchtitan/models/moe/moe.py`` with ``distributed/expert_parallel.py``)
runs, per micro-batch on one rank:

- the router: the gate GEMM (a linear of the block, costed with them), a float32 sigmoid /
  softmax, top-k, two histograms and an argsort of the token indices: kernels on
  (tokens x experts) and (tokens x top_k) tensors, each at least a kernel launch
  (``ROUTER_KERNELS``); their bytes are in the layer graph's measured traffic;
- with EP, the token dispatcher's device -> host sync: ``_token_dispatch`` reads the
  all-to-all split sizes with ``.tolist()`` in every forward (and recomputation), draining the
  stream (``host_sync_us`` of the MoE kernel table);
- the permutation into expert order and back (``models/moe/utils.py``: ``_permute`` appends a
  zero row with ``vstack`` and gathers the rows, ``_unpermute`` scatters them back; with or
  without EP), memory-bound passes over (routed tokens x dim) at the profile's ``hbm_gbps``, the
  gathers at the measured ``gather_efficiency``, their backward (``indexing_backward_kernel``)
  at the measured ``index_backward_bytes``; the router's own row gather ``x[indices // top_k]``
  is in the measured traffic, its backward is charged the same measured kernel here;
- three grouped GEMMs forward (w1, w3: dim -> hidden; w2: hidden -> dim), six backward, per
  local expert at the group's shape: rows = routed tokens per local expert, from the dense GEMM
  table at that shape divided by the grouped kernel's efficiency against it
  (``grouped_efficiency_*`` of the MoE kernel table), so small groups (few tokens per expert)
  run slower than large ones; float8 / MXFP8 grouped GEMMs at the profile's speedup.

Under TorchTitan's op-level selective AC every routed-expert kernel but the host sync runs
again in backward (``SELECTIVE_RECOMPUTE``), not the half of the forward that the dense
linears' every-other-matmul rule recomputes.

With EP the busiest rank receives ``moe_load_imbalance`` x the mean tokens (the profile's
assumption, 1 when the job forces balanced routing): its grouped GEMMs and permutation set the
pace. The MoE kernel table of a profile is ``profiles/kernels/moe_<arch>.csv`` beside its GEMM
table ``gemm_<arch>.csv``; each constant names its source there.
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from pathlib import Path

from ..candidates.layout import Mesh
from ..graph.layer_graph import Layer
from . import kernels
from .common import CostContext
from .hardware import HardwareProfile

ROUTER_KERNELS = (20, 12)
"""Small kernels of one MoE layer's router and index bookkeeping, forward / backward, each at
least ``kernel_launch_us`` (TorchTitan 0.2.2, counted from moe.py and utils.py): forward the
float32 cast, sigmoid / softmax, bias add, top-k, score gather, normalisation (sum, add, div),
scale, two histc, the token counter's add, argsort (3), score index, floor division, the
index cumsum, the permutation's index kernel (3) and zero row; backward the casts, the score
gather's and product's gradients, the sorts of the two index backwards (4) and the scatter's
zero fill."""
PERMUTE_FWD_BYTES = 8.0
"""Bytes per element (2-byte activations) of ``_permute``'s forward: ``vstack`` reads and
writes the routed tokens, the row gather reads and writes them again."""
UNPERMUTE_BYTES = 4.0
"""Bytes per element of ``_unpermute``'s row scatter (read the expert outputs, write them in
token order) and of its backward (the gradient gathered back): one read and one write."""
SLICE_BACKWARD_BYTES = 6.0
"""Bytes per element of the backward of ``_unpermute``'s ``[:-1]`` (aten slice_backward: a
zero-filled buffer with one row more, the gradient copied into it: write, read, write)."""
COUNTED_GATHER_BYTES = 2.0
"""Bytes per routed element the layer graph's forward traffic counts for the router's row
gather ``x[indices // top_k]`` (its output; its input x is top_k times smaller), which the
block's backward charges twice (``compute.block_compute_s``): what the measured
``index_backward_bytes`` of that gather's backward replaces."""
MOE_CONSTANTS = ("grouped_efficiency_bf16", "grouped_efficiency_float8", "grouped_efficiency_mx",
                 "host_sync_us", "gather_efficiency", "index_backward_bytes")
"""Every constant a MoE kernel table (``profiles/kernels/moe_<arch>.csv``) gives."""


@functools.cache
def moe_table(gemm_table: str) -> dict[str, float]:
    """The MoE kernel constants beside GEMM table ``gemm_table`` (``gemm_sm_90`` ->
    ``profiles/kernels/moe_sm_90.csv``); {} where there is none (no GEMM table: the CPU
    profile costs routed experts at its flat rate)."""
    if not gemm_table:
        return {}
    path = kernels.KERNEL_DIR / f"moe_{gemm_table.removeprefix('gemm_')}.csv"
    if not Path(path).is_file():
        return {}
    with open(path) as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        table = {row["constant"]: float(row["value"]) for row in rows}
    missing = [name for name in MOE_CONSTANTS if name not in table]
    if missing:
        raise ValueError(f"MoE kernel table {path} lacks {', '.join(missing)}")
    return table


def moe_sources(gemm_table: str) -> dict[str, str]:
    """Each constant of the MoE kernel table beside ``gemm_table`` -> where it comes from."""
    path = kernels.KERNEL_DIR / f"moe_{gemm_table.removeprefix('gemm_')}.csv"
    if not gemm_table or not Path(path).is_file():
        return {}
    with open(path) as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {row["constant"]: row["source"] for row in rows}


_SCALED: dict[str, float] = {}
"""Factors on the MoE terms while ``scaled_term`` holds them (sensitivity notes)."""
SELECTIVE_RECOMPUTE = {"grouped GEMMs": 1.0, "permutation": 1.0, "router kernels": 1.0,
                       "host sync": 0.0}
"""Share of each routed-expert term's forward that TorchTitan 0.2.2's op-level selective AC
(``selective_ac_option = "op"``, its default) runs again in backward. The policy
(``distributed/activation_checkpoint.py`` ``_apply_op_sac``) saves the outputs of the ops in the
model's ``_op_sac_save_list`` (``models/deepseek_v3|llama4/infra/parallelize.py``: ``aten.mm``,
every other one, the SDPA kernels, ``reduce_scatter_tensor``, ``all_to_all_single``,
``aten.max``) and recomputes every other op: ``aten._grouped_mm`` is not in the list, so all
three grouped GEMMs run again, as do the permutation's index / scatter kernels and the router's
sigmoid, top-k, histc and sort (all counted on CPU by tests/test_moe_kernels.py). The token
all-to-alls are saved (``block_cost`` charges four; six under full AC), and the dispatcher's
device -> host copy is ``MUST_SAVE`` in the policy (``_to_copy`` to the CPU), so the
recomputation does not sync again. Full AC recomputes all of it (1 for every term)."""
TERMS = ("grouped GEMMs", "permutation", "router kernels", "host sync", "load imbalance")
"""The MoE terms a plan's notes weigh (``commands/moe_notes.py``): ``MoeCost.parts``' names
and the load imbalance."""


def load_imbalance(hw: HardwareProfile) -> float:
    """Tokens on the busiest expert-parallel rank / the mean: the profile's (or the job's)
    ``moe_load_imbalance``, its excess over 1 scaled while ``scaled_term("load imbalance")``
    holds (what the routed experts' kernels and the token all-to-alls are charged)."""
    factor = _SCALED.get("load imbalance")
    if factor is None:
        return hw.moe_load_imbalance
    return 1.0 + (hw.moe_load_imbalance - 1.0) * factor


@dataclass(frozen=True)
class MoeShape:
    """What one rank's routed experts process per micro-batch."""

    tokens: float
    """Tokens the rank routes (before top-k)."""
    dim: float
    hidden: float
    """Each expert's hidden width on this rank (split by etp)."""
    local_experts: int
    top_k: int
    ep: int
    imbalance: float
    """Tokens on the busiest rank / the mean (1 without EP)."""
    act_bytes: float = 2.0
    """Bytes per activation element (the training dtype)."""

    @property
    def routed(self) -> float:
        """(token, expert) pairs the busiest rank's experts process."""
        return self.tokens * self.top_k * self.imbalance

    @property
    def group_rows(self) -> float:
        """Rows of one local expert's grouped GEMM."""
        return self.routed / self.local_experts


def moe_shape(layer: Layer, mesh: Mesh, microbatch: int, imbalance: float,
              act_bytes: float = 2.0) -> MoeShape:
    """``layer``'s routed experts on ``mesh``: the layer graph's expert FLOPs give the tokens
    of a sequence, its input bytes the model dim, the expert parameters the hidden width
    (three dim x hidden matrices per expert). cp splits the sequence; with etp = 1 the tp
    ranks split the tokens (TorchTitan's ReordererSequenceParallel), with etp = tp they split
    each expert's hidden width; ep splits the experts."""
    per_expert = layer.expert_params / layer.num_experts
    seq_tokens = layer.expert_flops / (2.0 * layer.top_k * per_expert)
    dim = layer.io_bytes / (4.0 * seq_tokens)
    hidden = per_expert / (3.0 * dim)
    tokens = seq_tokens * microbatch / mesh.cp
    if mesh.etp > 1:
        hidden /= mesh.etp
    else:
        tokens /= mesh.tp
    ep = mesh.ep if mesh.ep > 1 else 1
    return MoeShape(tokens=tokens, dim=dim, hidden=hidden,
                    local_experts=max(1, layer.num_experts // ep), top_k=layer.top_k, ep=ep,
                    imbalance=imbalance if ep > 1 else 1.0, act_bytes=act_bytes)


TILE_ROWS = 128
"""Rows of one output tile of the grouped kernel along the grouped dimension (assumed: the
128-row tiles of CUTLASS's SM90 / SM100 grouped GEMMs behind torch._grouped_mm): each group's
last tile is computed whole, so a group costs its rows rounded up to a multiple of it."""


def stacked_gemm_s(groups: int, rows: float, n: float, k: float, table: str, clock: float
                   ) -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) seconds at the dense GEMM table's rate of
    ``groups`` GEMMs of ``rows`` x ``k`` -> ``n`` run as one grouped kernel: one launch
    schedules every group's output tiles together, so it does the tile work of one dense GEMM
    with the groups stacked along the grouped dimension (forward and input gradient: the
    groups' rows, each rounded up to ``TILE_ROWS``; weight gradient: the groups' n x k
    outputs, each reducing over its own rows), not that of ``groups`` separate small GEMMs,
    whose own wave quantization the grouped launch does not pay."""
    padded = groups * math.ceil(rows / TILE_ROWS) * TILE_ROWS
    return (kernels.gemm_s(padded, n, k, table, clock), kernels.gemm_s(padded, k, n, table, clock),
            kernels.gemm_s(groups * n, k, rows, table, clock))


def grouped_gemm_s(shape: MoeShape, hw: HardwareProfile, recipe: str = "none"
                   ) -> tuple[float, float]:
    """(forward, backward) seconds of the routed experts' grouped GEMMs: three forward GEMMs
    per local expert (rows x dim -> hidden twice, rows x hidden -> dim) and their input and
    weight gradients, as grouped kernels (``stacked_gemm_s``) at the dense GEMM table's
    throughput divided by the grouped kernel's measured efficiency against it (``recipe``:
    "none" bf16, "float8" rowwise, "mx" MXFP8, at the profile's speedup; "loop": TorchTitan's
    for-loop experts, one plain GEMM per expert at the table's rate for its shape)."""
    m, d, h, experts = shape.group_rows, shape.dim, shape.hidden, shape.local_experts
    table, clock = hw.gemm_table, hw.clock_scale
    if recipe == "loop":
        fwd = 2 * kernels.gemm_s(m, h, d, table, clock) + kernels.gemm_s(m, d, h, table, clock)
        bwd = (2 * (kernels.gemm_s(m, d, h, table, clock) + kernels.gemm_s(h, d, m, table, clock))
               + kernels.gemm_s(m, h, d, table, clock) + kernels.gemm_s(d, h, m, table, clock))
        rate = 1.0 / _SCALED.get("grouped GEMMs", 1.0)
        return experts * fwd / rate, experts * bwd / rate
    up = stacked_gemm_s(experts, m, h, d, table, clock)  # w1, w3: dim -> hidden
    down = stacked_gemm_s(experts, m, d, h, table, clock)  # w2: hidden -> dim
    fwd, bwd = 2 * up[0] + down[0], 2 * (up[1] + up[2]) + down[1] + down[2]
    low = {"float8": "float8", "mx": "mx"}.get(recipe, "bf16")
    speed = {"float8": hw.float8_rowwise_gemm_speedup, "mx": hw.mx_speedup}.get(low, 1.0)
    efficiency = moe_table(table)[f"grouped_efficiency_{low}"]
    rate = efficiency * speed / _SCALED.get("grouped GEMMs", 1.0)
    return fwd / rate, bwd / rate


def permutation_s(shape: MoeShape, hw: HardwareProfile) -> tuple[float, float]:
    """(forward, backward) seconds of the token permutation: ``_permute``'s vstack and row
    gather and ``_unpermute``'s scatter forward; backward the scatter's gradient gathered back
    (and its slice's zero-filled copy), and two row-gather backwards (``_permute``'s and the
    router's ``x[indices // top_k]``) at the measured ``index_backward_bytes``, less what the
    block's traffic already charges the router's gather."""
    constants = moe_table(hw.gemm_table)
    if hw.hbm_gbps <= 0 or not constants:
        return 0.0, 0.0
    elements = shape.routed * shape.dim
    scale = shape.act_bytes / 2.0  # the byte counts are for 2-byte activations
    bandwidth = hw.hbm_gbps * 1e9 / _SCALED.get("permutation", 1.0)
    gather = constants["gather_efficiency"]
    fwd = (PERMUTE_FWD_BYTES + UNPERMUTE_BYTES) / gather
    backward = constants["index_backward_bytes"]
    bwd = (UNPERMUTE_BYTES / gather + SLICE_BACKWARD_BYTES + backward
           + max(0.0, backward - 2 * COUNTED_GATHER_BYTES))
    return (elements * fwd * scale / bandwidth, elements * bwd * scale / bandwidth)


def router_s(hw: HardwareProfile) -> tuple[float, float]:
    """(forward, backward) seconds of the router's and the bookkeeping's small kernels, each
    at least a kernel launch."""
    launch = hw.kernel_launch_us * 1e-6 * _SCALED.get("router kernels", 1.0)
    return ROUTER_KERNELS[0] * launch, ROUTER_KERNELS[1] * launch


def host_sync_s(shape: MoeShape, hw: HardwareProfile, grouped: bool = True) -> float:
    """Seconds of the device -> host sync in one forward: the EP dispatcher's split sizes, or
    the for-loop experts' token counts (``_run_experts_for_loop``); grouped GEMMs without EP
    have none (TorchTitan 0.2.2 pads the groups on the device)."""
    if shape.ep <= 1 and grouped:
        return 0.0
    sync = moe_table(hw.gemm_table).get("host_sync_us", 0.0)
    return sync * 1e-6 * _SCALED.get("host sync", 1.0)


@dataclass(frozen=True)
class MoeCost:
    """One MoE block's routed-expert work per micro-batch on the busiest rank."""

    fwd_s: float
    """Forward seconds (what FSDP's forward all-gather can hide under)."""
    total_s: float
    """Forward + backward + the recomputed forward share."""
    parts: tuple[tuple[str, float], ...] = ()
    """(term, seconds of ``total_s``) per term of ``TERMS`` but the load imbalance."""


def recompute_share(term: str, ac: str) -> float:
    """Share of routed-expert term ``term``'s forward that AC mode ``ac`` runs again."""
    return {"none": 0.0, "full": 1.0}.get(ac, SELECTIVE_RECOMPUTE[term])


def moe_cost(layer: Layer, mesh: Mesh, microbatch: int, ctx: CostContext,
             ac: str, grouped: bool = True) -> MoeCost:
    """Routed experts of ``layer`` from their kernels (module docstring) under AC mode ``ac``
    (each term's forward again by ``recompute_share``); zero where the profile has no MoE
    kernel table (routed experts then stay in ``compute``'s flat rate). ``grouped``: the
    model runs grouped GEMMs where the profile has them (else TorchTitan's for-loop experts:
    a GEMM per expert, a host sync, no permutation without EP)."""
    hw, recipe = ctx.hw, ctx.features.grouped_mm
    if not layer.expert_flops or not moe_table(hw.gemm_table):
        return MoeCost(0.0, 0.0)
    shape = moe_shape(layer, mesh, microbatch, load_imbalance(hw), ctx.prec.param_bytes)
    grouped = grouped and hw.grouped_mm
    terms = {"grouped GEMMs": grouped_gemm_s(shape, hw, recipe if grouped else "loop"),
             "permutation": permutation_s(shape, hw) if grouped or shape.ep > 1 else (0.0, 0.0),
             "router kernels": router_s(hw),
             "host sync": (host_sync_s(shape, hw, grouped), 0.0)}
    fwd = sum(f for f, _ in terms.values())
    parts = tuple((name, f * (1.0 + recompute_share(name, ac)) + b)
                  for name, (f, b) in terms.items())
    return MoeCost(fwd, sum(t for _, t in parts), parts)


class scaled_term:
    """Within ``with scaled_term(term, factor)``, MoE term ``term`` (one of ``TERMS``; the
    load imbalance as its excess over 1) costs ``factor`` x its value (sensitivity notes).
    Memoized costs must be cleared around it (``compute.clear_compute_memo``)."""

    def __init__(self, term: str, factor: float) -> None:
        if term not in TERMS:
            raise ValueError(f"unknown MoE term {term!r}: one of {TERMS}")
        self.term, self.factor = term, factor

    def __enter__(self) -> None:
        _SCALED[self.term] = self.factor

    def __exit__(self, *exc: object) -> None:
        _SCALED.pop(self.term, None)
