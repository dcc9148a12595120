"""The layout vocabulary every layer shares: the device mesh, a block's strategy on it, the
modes and techniques they are made of, and how a strategy is named. Imports nothing of the
package."""

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` >= 1, ascending (O(sqrt n): batches reach millions)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


TECHNIQUES = ("fsdp", "hsdp", "ddp", "tp", "tp_dp", "cp", "ep", "ac", "pp", "tp_sub_block")
"""fsdp: shard over dp_shard; hsdp: replicate x shard; ddp: replicate only (gradients
all-reduced, parameters whole on every rank; tp = cp = 1); tp: tensor + sequence parallel; tp_dp: a
block may use the tp dim as extra data parallel (dense models); cp: context parallel (ring
attention); ep: expert parallel for routed experts (MoE models); ac: activation checkpointing;
pp: pipeline parallel (schedule, stages per rank, micro-batches and the stage split searched);
tp_sub_block: a dense block's attention and feed-forward may each use the tp dim their own way
(``SUB_BLOCK_TP_MODES``) and the embedding may be looked up on its embedding dim
(``EMBEDDING_DIM``); not searched unless asked for: ``DEFAULT_TECHNIQUES``."""
DEFAULT_TECHNIQUES = tuple(t for t in TECHNIQUES if t != "tp_sub_block")
"""What the search uses unless ``autoparallel.techniques`` says otherwise."""
TpMode = Literal["none", "sp", "dp", "dp/sp", "sp/dp", "sp/sp:a2a", "dp/sp:batch",
                 "sp/dp:batch", "sp/sp:batch", "sp/tp@dp_shard", "sp/sp:rep", "dp/sp:rep",
                 "sp/dp:rep", "sp/sp:shared_dp", "dp/sp:shared_dp", "dim", "dim:gather"]
"""What the tp dim does for a block: "none" (tp = 1), one of ``TP_MODES`` or one of
``SUB_BLOCK_TP_MODES``; for a MoE block also one of ``MOE_SUB_BLOCK_MODES``; for the
embedding also one of ``EMBEDDING_MODES``."""
TP_MODES: tuple[TpMode, ...] = ("sp", "dp")
"""Per block on a mesh with tp > 1: "sp" = TorchTitan's TP + sequence-parallel plan; "dp" = the
block's parameters are FSDP-sharded over dp_shard x tp and the tp ranks split the micro-batch
(entry/exit all-to-all between the sequence-sharded residual stream and a batch shard)."""
BATCH_STREAM = ":batch"
"""The suffix of a sub-block mode whose residual stream is sharded on the batch over tp."""
REPLICATED_STREAM = ":rep"
"""The suffix of a sub-block mode whose residual stream is whole on every tp rank: tensor
parallel without sequence parallel (``REPLICATED_MODES``)."""
TP_WITHOUT_SP: TpMode = "sp/sp:rep"
"""TorchTitan's tensor parallel without sequence parallel, the mode a job that turns sequence
parallel off runs its tensor-parallel blocks in (``Constraints.sequence_parallel``)."""
REPLICATED_MODES: tuple[TpMode, ...] = (TP_WITHOUT_SP, "dp/sp:rep", "sp/dp:rep")
"""Sub-block modes on a replicated residual stream (TorchTitan's TP with
``enable_sequence_parallel`` off): a TP sub-block takes the stream as it is (no all-gather),
its row-wise linears' output all-reduced over tp (their column-wise linears' input gradient
in backward) where SP reduce-scatters, its norm and residual add run on every token of the
micro-batch on every tp rank; a data-parallel sub-block runs on a batch shard of the stream
(cut locally, no collective) and its output is all-gathered over tp (its input gradient in
backward). "sp/sp:rep" is TorchTitan's own TP without SP."""
A2A = ":a2a"
"""The suffix of the sub-block mode whose attention output projection reads its input through
an all-to-all (heads to sequence) with its weight whole (``A2A_MODES``)."""
A2A_MODES: tuple[TpMode, ...] = ("sp/sp:a2a",)
"""TP + SP on both sub-blocks except the attention's row-wise output projection: its input
(sharded on the heads by the column-wise projections and attention) goes through an all-to-all
over tp onto the sequence shard, where it runs with its weight whole and leaves its output on
the stream without a reduce-scatter. The weight is stored as TorchTitan's row-wise one (split
over tp, FSDP over dp_shard) and all-gathered over tp for the matmul, its gradient
reduce-scattered back (the placement TorchTitan 0.3.0's AutoParallel picks for wo on
Llama 3 8B)."""
DP_SHARD_TP = "tp@dp_shard"
"""A feed-forward's sub-block mode in ``DP_SHARD_TP_MODES``: tensor parallel over the dp_shard
dim (its input all-gathered over dp_shard on the batch, w1 / w3 column-wise and w2 row-wise over
dp_shard, its output reduce-scattered back onto the batch) on the sequence shard of each tp
rank, its weights stored sharded over dp_shard x tp and all-gathered over tp for their matmuls
(the tp dim as FSDP for them), their gradients reduce-scattered back."""
DP_SHARD_TP_MODES: tuple[TpMode, ...] = ("sp/tp@dp_shard",)
"""Attention TorchTitan's TP + SP over tp, the feed-forward ``DP_SHARD_TP``: a second mesh dim
as TP inside one block (TorchTitan 0.3.0's AutoParallel's Llama 3 8B placement on 8 GPUs)."""
SUB_BLOCK_TP_MODES: tuple[TpMode, ...] = ("dp/sp", "sp/dp", *A2A_MODES, "dp/sp:batch",
                                          "sp/dp:batch", "sp/sp:batch", *DP_SHARD_TP_MODES,
                                          *REPLICATED_MODES)
"""Per sub-block, "<attention>/<feed-forward>", each "sp" or "dp" as above: "dp/sp" = attention
data parallel over tp (its parameters and its norm FSDP-sharded over dp_shard x tp, an
all-to-all into and out of it) and the feed-forward TP + SP; "sp/dp" the reverse, the
feed-forward (per token) run on the stream's sequence shard as it is (``batch_a2a``). The
residual stream stays sequence-sharded between the sub-blocks and between blocks. With
``BATCH_STREAM`` ("dp/sp:batch", "sp/dp:batch", "sp/sp:batch") the stream is sharded on the
batch over tp instead, everywhere (embedding output to final norm): a data-parallel
sub-block runs on it as it is (no all-to-all) and a TP sub-block all-gathers and
reduce-scatters it on the batch. With ``REPLICATED_STREAM`` the stream is whole on every tp
rank (``REPLICATED_MODES``). Every tp layer of a plan keeps one stream layout
(``stream_dim``)."""


MOE_SHARED_DP: TpMode = "sp/dp"
"""A MoE block's attention TorchTitan's TP + SP and its MoE (router, shared experts, token
dispatch) data parallel over tp on each tp rank's sequence shard of the stream (per token: no
all-to-all, no all-gather or reduce-scatter around it); its router and shared experts
FSDP-sharded over dp_shard x tp, its routed experts expert parallel as the mesh says (ep
covers tp, etp = 1) or, with ep = 1, sharded with the MoE over dp_shard x tp."""

MOE_ATTENTION_DP: TpMode = "dp/sp"
"""A MoE block's attention (and its norm) data parallel over tp on a batch shard, as a dense
block's in "dp/sp", and its MoE as TorchTitan's MoE TP / EP runs it."""

SHARED_DP = ":shared_dp"
"""The suffix of the MoE modes whose shared experts alone run data parallel over tp beside
the model's MoE TP (``MOE_ROUTED_TP``, ``MOE_ATTENTION_SHARED_DP``)."""

MOE_ROUTED_TP: TpMode = "sp/sp:shared_dp"
"""A MoE block with ep = 1 whose attention and routed experts run the model's TP + SP (the
MoE's input all-gathered over tp, the routed experts' output reduce-scattered) and whose shared
experts run data parallel over tp on this tp rank's sequence shard of that gathered input
(weights whole on tp, FSDP over dp_shard x tp): their output joins the routed experts'
scattered one with no collective of its own, where TorchTitan 0.3.0's MoE TP reduce-scatters
the two apart. With ep > 1, ``MOE_SHARED_DP`` runs the shared experts so."""

MOE_ATTENTION_SHARED_DP: TpMode = "dp/sp:shared_dp"
"""``MOE_ATTENTION_DP``'s attention (data parallel over tp on a batch shard) with
``MOE_ROUTED_TP``'s MoE (ep = 1)."""

MOE_SUB_BLOCK_MODES: tuple[TpMode, ...] = (MOE_SHARED_DP, MOE_ATTENTION_DP, MOE_ROUTED_TP,
                                           MOE_ATTENTION_SHARED_DP)
"""The sub-block modes a MoE block may take (``Frontend.moe_sub_block_modes``: those a release
applies)."""


EMBEDDING_DIM: TpMode = "dim"
"""The embedding's mode under ``tp_sub_block`` (``embedding_dim_problem``): its table sharded
on the embedding dim over dp_shard x tp (no FSDP, no vocabulary split), looked up for the
token ids of every dp_shard rank (all-gathered) and its output moved onto this rank's shard of
the residual stream by one all-to-all over dp_shard x tp; the table's gradient is local. No
FSDP all-gather of the table, no reduce-scatter of its gradient (AutoParallel's placement of
Llama 3's embedding)."""
EMBEDDING_DIM_GATHER: TpMode = "dim:gather"
"""The embedding's other mode under ``tp_sub_block``: its table sharded on the embedding dim
over dp_shard and on the vocabulary over tp, all-gathered over tp for the lookup (the tp dim
as FSDP for the table, its gradient reduce-scattered back); each tp rank looks up its own
shard of the stream's tokens for every dp_shard rank (all-gathered over dp_shard) and one
all-to-all over dp_shard moves the output onto the stream (AutoParallel's placement of
Llama 3 70B's embedding on 256 GPUs)."""
EMBEDDING_MODES: tuple[TpMode, ...] = (EMBEDDING_DIM, EMBEDDING_DIM_GATHER)
"""How the embedding may be looked up on its embedding dim."""


def sub_block_modes(tp_mode: str) -> tuple[str, str]:
    """(attention, feed-forward) use of the tp dim under ``tp_mode``: each "none", "sp" or
    "dp" (a whole-block mode gives both sub-blocks its own; the stream suffix dropped)."""
    attention, _, ffn = tp_mode.partition(":")[0].partition("/")
    return attention, ffn or attention


def a2a_mode(tp_mode: str) -> bool:
    """Whether ``tp_mode`` runs the attention's output projection on the sequence shard
    (``A2A_MODES``)."""
    return tp_mode.endswith(A2A)


def shared_experts_dp(tp_mode: str) -> bool:
    """Whether ``tp_mode`` runs a MoE block's shared experts alone data parallel over tp
    (``SHARED_DP``)."""
    return tp_mode.endswith(SHARED_DP)


def without_shared_dp(tp_mode: str) -> str:
    """``tp_mode`` with its shared experts as the rest of its feed-forward: the mode without
    ``SHARED_DP`` ("sp" for ``MOE_ROUTED_TP``)."""
    base = tp_mode.removesuffix(SHARED_DP)
    return "sp" if base == "sp/sp" else base


def tp_dp_params(tp_mode: str) -> bool:
    """Whether some of a block's parameters are data parallel over tp under ``tp_mode`` (a
    "dp" block or sub-block, the shared experts of a ``SHARED_DP`` mode): FSDP shards them over
    dp_shard x tp."""
    return "dp" in sub_block_modes(tp_mode) or shared_experts_dp(tp_mode)


def split_fsdp(tp_mode: str) -> bool:
    """Whether a block in ``tp_mode`` is one FSDP group per sub-block (one of them data
    parallel over tp, on dp_shard x tp; or a ``DP_SHARD_TP`` feed-forward, sharded by its own
    style and in no FSDP group; a ``SHARED_DP`` mode's shared experts beside the rest) rather
    than one group for the block."""
    return shared_experts_dp(tp_mode) or tp_mode in SUB_BLOCK_TP_MODES and (
        tp_dp_params(tp_mode) or DP_SHARD_TP in sub_block_modes(tp_mode))


def batch_a2a(tp_mode: str) -> bool:
    """Whether ``tp_mode`` moves the residual stream from its sequence shard to a batch shard
    (and back) around a part that uses tp as data parallel: its attention (a "dp" block, a
    "dp/..." sub-block), which needs whole sequences; a data-parallel feed-forward runs per
    token on the sequence shard, and a stream sharded on the batch needs no move."""
    return sub_block_modes(tp_mode)[0] == "dp" and stream_dim(tp_mode) == 1


def stream_dim(tp_mode: str) -> int | None:
    """The dim of the residual stream the tp dim shards around a layer in ``tp_mode``: 0 (the
    batch) for a ``BATCH_STREAM`` mode, None (whole on every tp rank) for a
    ``REPLICATED_STREAM`` mode, else 1 (the sequence, TorchTitan's SP)."""
    if tp_mode.endswith(BATCH_STREAM):
        return 0
    return None if tp_mode.endswith(REPLICATED_STREAM) else 1


STREAM_LAYOUTS = {0: "sharded on the batch", 1: "sharded on the sequence",
                  None: "whole on every tp rank"}
"""The residual stream's layouts over tp (``stream_dim``), in words."""


def stream_of(tp_modes: Iterable[str]) -> int | None:
    """The dim of the residual stream tp shards for blocks in ``tp_modes`` (one layout per
    plan, ``stream_problem``): 0 where they take ``BATCH_STREAM`` modes, None where they take
    ``REPLICATED_STREAM`` ones, else 1."""
    dims = {stream_dim(mode) for mode in tp_modes if mode != "none"}
    return next((dim for dim in (0, None) if dim in dims), 1)


def stream_problem(tp_modes: list[str], embedding: str = "") -> str:
    """Why blocks with these tp modes cannot share one residual stream (empty if they can):
    the tp modes of a plan's blocks shard the stream on the batch (``BATCH_STREAM``), leave it
    whole (``REPLICATED_STREAM``) or all shard it on the sequence, one of the three (the
    search's ``milp._one_stream``); an embedding looked up on its embedding dim
    (``EMBEDDING_MODES``, its output moved onto a shard of the stream) needs a sharded one."""
    dims = {stream_dim(mode): mode for mode in tp_modes if mode != "none"}
    if None in dims and embedding_stream_problem(embedding, None):
        return f"tp_mode {dims[None]!r}: {embedding_stream_problem(embedding, None)}"
    if len(dims) < 2:
        return ""
    (a, mode_a), (b, mode_b) = list(dims.items())[:2]
    return (f"tp_mode {mode_a!r} keeps the residual stream {STREAM_LAYOUTS[a]} and {mode_b!r} "
            f"{STREAM_LAYOUTS[b]}: a plan keeps one stream layout; use modes ending "
            f"{BATCH_STREAM!r} on every tp block, modes ending {REPLICATED_STREAM!r} on every "
            "tp block, or neither")


def embedding_stream_problem(embedding: str, stream: int | None) -> str:
    """Why the embedding in mode ``embedding`` ("" TorchTitan's, or one of
    ``EMBEDDING_MODES``) cannot feed a residual stream laid out as ``stream``
    (``stream_dim``; empty if it can): a lookup on the embedding dim moves its output onto a
    shard of the stream, so not onto a replicated one."""
    if stream is None and embedding in EMBEDDING_MODES:
        return (f"the residual stream is whole on every tp rank and the embedding's "
                f"{embedding!r} leaves its output on a shard of it: use TorchTitan's embedding")
    return ""


AcMode = Literal["none", "selective", "full"]
AC_MODES: tuple[AcMode, ...] = get_args(AcMode)
"""Activation checkpointing of a block (also the ``activation_checkpoint.mode`` values a
planned job accepts: the plan picks per block among them)."""


TP_PART = {"sp": "tp+sp", "dp": "tp_dp", DP_SHARD_TP: DP_SHARD_TP}
"""A tp mode's word in strategy labels."""


def strategy_parts(ac: str, reshard_after_forward: bool | int, tp_mode: str, ep: int = 1,
                   pinned: bool = False, unsharded: str = "", fsdp_unit: int = 1,
                   stream: int | None = 1) -> dict[str, str]:
    """The one vocabulary of a strategy, by aspect (tables, explain, diff and pictures):
    params "fsdp" / "fsdp-keep" / "fsdp-node<n>" (reshard after forward, keep, or reshard to
    groups of n ranks of one node; ``unsharded``: the mesh's label
    when it shards nothing, "ddp" / "single", see ``Mesh.unsharded_label``), unit "unit<k>"
    (FSDP units of k blocks), tp "tp+sp" ("tp" on a ``stream`` whole on every tp rank, None) /
    "tp_dp" / "attn:<tp>/ffn:<tp>" (a ``SHARED_DP`` mode: "/shared:tp_dp" after it; a TP
    sub-block "tp" and stream "stream:batch" /
    "stream:replicated" where the stream is sharded on the batch / whole on every tp rank),
    ep "ep<k>", ac
    "ac:<mode>", pinned "pinned"; absent aspects are left out."""
    if tp_mode in EMBEDDING_MODES:
        return {"params": "dim-shard", "tp": "a2a" if tp_mode == EMBEDDING_DIM
                else "tp-gather+a2a"}
    node = reshard_group(reshard_after_forward)
    parts = {"params": unsharded or (f"fsdp-node{node}" if node else
                                     "fsdp" if reshard_after_forward else "fsdp-keep")}
    if fsdp_unit > 1:
        parts["unit"] = f"unit{fsdp_unit}"
    if tp_mode in TP_PART:
        # TorchTitan's TP plan on a replicated stream (``stream`` None): no sequence parallel
        parts["tp"] = "tp" if tp_mode == "sp" and stream is None else TP_PART[tp_mode]
    elif tp_mode in SUB_BLOCK_TP_MODES:
        stream = stream_dim(tp_mode)
        attention, ffn = ("tp" if stream != 1 and m == "sp" else TP_PART[m]
                          for m in sub_block_modes(tp_mode))
        if a2a_mode(tp_mode):
            attention = "tp+a2a"
        parts["tp"] = f"attn:{attention}/ffn:{ffn}"
        if stream != 1:
            parts["stream"] = "stream:batch" if stream == 0 else "stream:replicated"
    elif shared_experts_dp(tp_mode):
        attention, ffn = (TP_PART[m] for m in sub_block_modes(tp_mode))
        parts["tp"] = f"attn:{attention}/ffn:{ffn}/shared:{TP_PART['dp']}"
    if ep > 1:
        parts["ep"] = f"ep{ep}"
    if ac != "none":
        parts["ac"] = f"ac:{ac}"
    if pinned:
        parts["pinned"] = "pinned"
    return parts


def strategy_label(ac: str, reshard_after_forward: bool | int, tp_mode: str, ep: int = 1,
                   pinned: bool = False, unsharded: str = "", fsdp_unit: int = 1,
                   stream: int | None = 1) -> str:
    """A strategy as one string: its ``strategy_parts`` joined by "+"."""
    return "+".join(strategy_parts(ac, reshard_after_forward, tp_mode, ep, pinned,
                                   unsharded, fsdp_unit, stream).values())


GIB = 2.0**30
"""Bytes per GiB: what memory budgets, peaks and profiles are written in."""


def reshard_group(reshard_after_forward: bool | int) -> int:
    """The group size an integer ``reshard_after_forward`` reshards to (FSDP2's integer form:
    after forward each rank keeps a 1/n shard, and backward all-gathers over those n ranks);
    0 for True (reshard over the whole FSDP group) and False (keep the parameters)."""
    return 0 if isinstance(reshard_after_forward, bool) else reshard_after_forward


@dataclass(frozen=True, order=True, kw_only=True)
class Mesh:
    """pp x dp_replicate x dp_shard x cp x tp = world size (TorchTitan's mesh order: pp
    outermost, tp innermost). Built with keywords only; the fields' order is the order meshes
    sort in (dp_replicate, dp_shard, tp, cp, ...), which the search's tie-breaking follows.

    ``ep`` / ``etp`` follow TorchTitan's rules for routed experts: with ``etp = tp`` the ep ranks
    come from dp_shard x cp; with ``etp = 1`` they also take all of tp (ep a multiple of tp).
    Experts are FSDP-sharded over the remaining ``efsdp`` ranks."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    """Pipeline stages across ranks (1: no pipeline parallelism)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def replicate_only(self) -> bool:
        """Pure data parallel (DDP): replicas only, nothing sharded."""
        return self.dp_replicate > 1 and self.unsharded

    @property
    def unsharded(self) -> bool:
        """No dim splits parameters or sequences (one device, or replicas only)."""
        return self.dp_shard * self.cp * self.tp == 1

    @property
    def unsharded_label(self) -> str:
        """"ddp" for pure data parallel, "single" for one device, "" when something is
        sharded."""
        return "ddp" if self.replicate_only else "single" if self.world == self.pp else ""

    @property
    def efsdp(self) -> int:
        """FSDP degree of routed experts when ep > 1."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    def spans_nodes(self, dim: str, gpus_per_node: int) -> bool:
        """Whether the process groups of ``dim`` cross node boundaries (ranks are node-major)."""
        if dim == "tp":
            inner = self.tp
        elif dim == "cp":
            inner = self.cp * self.tp
        elif dim == "dp_shard":
            inner = self.dp_shard * self.cp * self.tp
        elif dim == "ep":
            inner = self.ep * self.etp
        elif dim == "dp_replicate":
            inner = self.world // self.pp
        else:  # pp: neighbouring stages are world / pp ranks apart
            inner = self.world
        return inner > gpus_per_node

    def __str__(self) -> str:
        text = (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} "
                f"tp={self.tp}")
        text = (f"pp={self.pp} " if self.pp > 1 else "") + text
        return text + (f" ep={self.ep} etp={self.etp}" if self.ep > 1 else "")


class StrategyFields(Protocol):
    """What a planned layer records of its strategy (``plan.LayerPlan``)."""

    ac: str
    reshard_after_forward: bool | int
    tp_mode: str
    fsdp_unit: int


@dataclass(frozen=True, order=True)
class BlockStrategy:
    """How one transformer block runs: activation checkpointing, FSDP resharding (True / False,
    or an integer group size, see ``reshard_group``), what the tp mesh dim does for it
    ("none" when tp = 1, else one of TP_MODES), and the blocks of its FSDP unit (``fsdp_unit``
    consecutive blocks with this strategy share one ``fully_shard`` group)."""

    ac: AcMode
    reshard_after_forward: bool | int
    tp_mode: TpMode = "none"
    fsdp_unit: int = 1

    @classmethod
    def of(cls, layer: StrategyFields) -> "BlockStrategy":
        """The strategy a planned block runs (its plan-file fields)."""
        return cls(layer.ac, layer.reshard_after_forward, layer.tp_mode, layer.fsdp_unit)

    def describe(self, ep: int = 1, unsharded: str = "") -> str:
        """Label of this strategy for a block with experts on ``ep`` ranks (``strategy_label``)."""
        return strategy_label(self.ac, self.reshard_after_forward, self.tp_mode, ep,
                              unsharded=unsharded, fsdp_unit=self.fsdp_unit)


def fsdp_sharded(mesh: Mesh, tp_mode: str = "none", experts: bool = False) -> bool:
    """Whether FSDP shards a layer's parameters on ``mesh`` (what resharding after forward, the
    per-step all-gathers and the unreduced gradients apply to): over dp_shard x cp, over
    dp_shard x tp where the tp dim acts as data parallel (``tp_mode`` "dp"), and, for a block
    with routed ``experts`` under expert parallelism, its experts over ``efsdp``."""
    return (mesh.dp_shard * mesh.cp > 1 or tp_dp_params(tp_mode)
            or (experts and mesh.ep > 1))


def fsdp_group_size(mesh: Mesh, tp_mode: str = "none") -> int:
    """Ranks FSDP shards a block's dense parameters over: dp_shard x cp, times tp where the tp
    dim acts as data parallel (``tp_mode`` "dp"; for a sub-block mode, the larger group: its
    data-parallel sub-block's)."""
    return mesh.dp_shard * mesh.cp * (mesh.tp if tp_dp_params(tp_mode) else 1)


def node_reshard_fits(group: int, node: int) -> bool:
    """Whether resharding to ``node`` ranks after forward is FSDP2's integer form for an FSDP
    group of ``group`` ranks: a proper divisor of the group, above 1."""
    return 1 < node < group and group % node == 0


def node_reshard_group(mesh: Mesh, gpus_per_node: int, tp_mode: str = "none") -> int:
    """The integer ``reshard_after_forward`` that keeps a block's backward all-gather inside
    one node: the block's FSDP ranks on one node, when its FSDP group spans several nodes and
    that count is a proper divisor of the group (FSDP2 reshards to consecutive members of its
    mesh, ``mesh.view(-1, n)``); 0 otherwise, and for sub-block modes with two FSDP groups
    (``split_fsdp``)."""
    group = fsdp_group_size(mesh, tp_mode)
    stride = 1 if tp_mode == "dp" else mesh.tp  # rank distance between FSDP neighbours
    if gpus_per_node < 1 or group * stride <= gpus_per_node or gpus_per_node % stride \
            or split_fsdp(tp_mode):
        return 0
    n = gpus_per_node // stride
    return n if node_reshard_fits(group, n) else 0


def node_reshard_problem(mesh: Mesh, tp_mode: str, node: int, kind: str = "block",
                         experts: bool = False) -> str:
    """Why a layer cannot reshard to ``node`` ranks after forward (empty if it can): a dense
    block of a plan without pp, ``node`` a proper divisor of its FSDP group above 1."""
    group = fsdp_group_size(mesh, tp_mode)
    if split_fsdp(tp_mode):
        return (f"reshard_after_forward {node} is not planned with tp_mode {tp_mode!r} (its "
                "sub-blocks have FSDP groups of their own sizes)")
    if kind != "block" or mesh.pp > 1 or experts or not node_reshard_fits(group, node):
        return (f"reshard_after_forward {node} needs a dense block of a plan without pp "
                f"and a proper divisor of its FSDP group ({group} ranks)")
    return ""


FSDP_UNIT_SIZES = (2, 4)
"""Blocks per FSDP unit the search offers besides 1 (at most the run of identical blocks):
one ``fully_shard`` call over k consecutive blocks gathers and reduces them in one collective
each, fewer and larger, and holds k blocks' parameters (and the next unit's) unsharded."""


def ep_problem(mesh: Mesh, num_experts: int = 0) -> str:
    """Why TorchTitan cannot run ``mesh``'s expert layout (empty if it can): etp is 1 or tp
    (its documented forms, "partial dp -> ep" with etp = tp: ep divides dp_shard x cp; "partial
    dp + all tp -> ep" with etp = 1: ep is tp x a divisor of dp_shard x cp), the rest of an EP
    model FSDP-sharded over dp_shard x cp > 1, and ep dividing the ``num_experts`` routed
    experts (when given)."""
    ep, etp, tp, dp = mesh.ep, mesh.etp, mesh.tp, mesh.dp_shard * mesh.cp
    if ep == 1:
        return "" if etp == 1 else "etp > 1 needs ep > 1"
    if etp not in (1, tp):
        return f"etp {etp} must be 1 or tp ({tp})"
    if dp == 1:
        return "ep > 1 needs dp_shard x cp > 1 (the rest of an EP model is FSDP-sharded)"
    if etp == tp and dp % ep:
        return f"ep {ep} with etp = tp must divide dp_shard x cp ({dp})"
    if etp != tp and (ep % tp or dp % (ep // tp)):
        return (f"ep {ep} with etp = 1 must be tp ({tp}) x a divisor of dp_shard x cp ({dp}): "
                "EP borrows all of tp")
    if num_experts and num_experts % ep:
        return f"ep {ep} must divide the {num_experts} routed experts"
    return ""


def fsdp_unit_problem(mesh: Mesh, tp_mode: str = "none", kind: str = "block") -> str:
    """Why blocks cannot share FSDP units of several blocks on ``mesh`` (empty if they can):
    a unit is a dense block's FSDP group over dp_shard x cp (x tp for tp mode "dp") in a plan
    without pp or EP (whose stages and explicit expert prefetch are per block)."""
    if kind != "block":
        return "FSDP units group blocks only"
    if mesh.pp > 1:
        return "FSDP units are not planned with pipeline parallelism (stages keep parameters)"
    if mesh.ep > 1:
        return "FSDP units are not planned with expert parallelism (per-block expert prefetch)"
    if not fsdp_sharded(mesh, tp_mode):
        return "FSDP units need blocks FSDP shards (dp_shard x cp > 1, or tp as data parallel)"
    if split_fsdp(tp_mode):
        return f"FSDP units are not planned with tp_mode {tp_mode!r} (one group per sub-block)"
    return ""


def tp_dp_problem(mesh: Mesh, microbatch: int, kind: str = "block", tp_mode: str = "dp",
                  fix: bool = True) -> str:
    """Why the tp dim cannot act as data parallel (``tp_mode`` "dp", or the data-parallel
    sub-block of a sub-block mode) for a ``kind`` layer on ``mesh`` with a local batch of
    ``microbatch`` sequences; empty if it can. It needs tp > 1, no pipeline parallelism, a
    block, one FSDP mesh over dp_shard x tp (dp_replicate = 1, cp = 1; dp_shard > 1 for the
    whole block, whose data parallel over tp alone would be plain FSDP over the same ranks; a
    sub-block mode may have dp_shard = 1: its data-parallel part sharded over tp, the rest as
    TorchTitan's TP alone; ``SHARED_DP`` modes ep = 1), etp = 1 (MoE blocks) and, where the
    tp ranks split the micro-batch (``batch_a2a``, a stream sharded on the batch, a
    data-parallel sub-block on a replicated stream), a batch they split evenly. ``A2A_MODES``
    use no data parallel over tp: they need tp > 1, no pipeline, a block and cp = 1 only
    (the all-to-all splits the sequence over tp alone), as does ``TP_WITHOUT_SP``.
    ``DP_SHARD_TP_MODES`` split no batch over tp either: they need dp_shard > 1 (the
    feed-forward's TP group), dp_replicate = 1 and cp = 1. With ``fix`` the reason ends
    with the fix (tp_mode 'sp')."""
    reason = _tp_dp_reason(mesh, microbatch, kind, tp_mode)
    return f"{reason}; use 'sp'" if reason and fix and mesh.tp > 1 else reason


def _tp_dp_reason(mesh: Mesh, microbatch: int, kind: str, tp_mode: str) -> str:
    """``tp_dp_problem``'s reason, without its fix."""
    mode = f"tp_mode {tp_mode!r}"
    if mesh.tp == 1:
        return f"{mode} needs tp > 1"
    if mesh.pp > 1:
        return f"{mode} is not planned with pipeline parallelism"
    if kind != "block":
        return f"{mode} applies to blocks only"
    if a2a_mode(tp_mode) or tp_mode == TP_WITHOUT_SP:
        return f"{mode} needs cp = 1" if mesh.cp > 1 else ""
    if shared_experts_dp(tp_mode) and mesh.ep > 1:
        return (f"{mode} needs ep = 1 (with ep > 1, {MOE_SHARED_DP!r} runs the shared experts "
                "data parallel beside the model's EP)")
    if tp_mode in DP_SHARD_TP_MODES:
        return ("" if mesh.dp_shard > 1 and mesh.dp_replicate == 1 and mesh.cp == 1 else
                f"{mode} needs dp_shard > 1, dp_replicate = 1 and cp = 1")
    if mesh.dp_replicate > 1 or mesh.cp > 1 or (mesh.dp_shard == 1 and tp_mode == "dp"):
        return (f"{mode} needs " + ("dp_shard > 1, " if tp_mode == "dp" else "")
                + "dp_replicate = 1 and cp = 1")
    if mesh.etp > 1:
        return (f"{mode} needs etp = 1 (routed experts tensor parallel over tp take the whole "
                "micro-batch)")
    if microbatch % mesh.tp and (batch_a2a(tp_mode) or stream_dim(tp_mode) == 0 or (
            stream_dim(tp_mode) is None and tp_dp_params(tp_mode))):
        return f"{mode} needs local_batch_size divisible by tp ({mesh.tp})"
    return ""


def edge_strategy(kind: str, mesh: Mesh, embedding: str = "") -> BlockStrategy:
    """How the embedding, an encoder and the norm + output are applied (and so costed): the
    embedding and an encoder (one FSDP unit, as TorchTitan 0.3.0's
    ``apply_fsdp_to_vision_encoder``) reshard after forward, the output keeps its parameters
    for the backward that follows at once; vocab-parallel with loss parallel when tp > 1 (an
    encoder's linears column- / row-wise on replicated activations). ``embedding``
    one of ``EMBEDDING_MODES``: the embedding looked up on its embedding dim."""
    if kind == "embedding" and embedding in EMBEDDING_MODES:
        return BlockStrategy("none", False, embedding)
    return BlockStrategy("none", kind in ("embedding", "encoder"),
                         "sp" if mesh.tp > 1 else "none")


def embedding_dim_problem(mesh: Mesh, dim: int = 0, vocab: int = 0,
                          tp_mode: str = EMBEDDING_DIM) -> str:
    """Why the embedding cannot be looked up on its embedding dim in ``tp_mode`` (one of
    ``EMBEDDING_MODES``) on ``mesh`` (empty if it can): one group over dp_shard x tp holds the
    whole batch's lookups, so no pipeline, replication or context parallel, more than one rank
    in it, and an embedding dim (``dim``, where known) it splits evenly; ``EMBEDDING_DIM_GATHER``
    splits the embedding dim over dp_shard > 1 and the vocabulary (``vocab``) over tp > 1."""
    mode = f"tp_mode {tp_mode!r} for the embedding"
    if mesh.pp > 1 or mesh.dp_replicate > 1 or mesh.cp > 1:
        return f"{mode} needs pp = 1, dp_replicate = 1 and cp = 1; use the default"
    gather = tp_mode == EMBEDDING_DIM_GATHER
    if gather and (mesh.dp_shard == 1 or mesh.tp == 1):
        return f"{mode} needs dp_shard > 1 and tp > 1; use {EMBEDDING_DIM!r}"
    group = mesh.dp_shard * (1 if gather else mesh.tp)
    if group == 1:
        return f"{mode} needs dp_shard x tp > 1; use the default"
    what = "dp_shard" if gather else "dp_shard x tp"
    if dim and dim % group:
        return (f"{mode} needs the embedding dim ({dim}) divisible by {what} ({group}); use "
                "the default")
    if gather and vocab and vocab % mesh.tp:
        return (f"{mode} needs the vocabulary ({vocab}) divisible by tp ({mesh.tp}); use "
                f"{EMBEDDING_DIM!r}")
    return ""
