"""Candidates: legal mesh shapes for a world size, and per-block strategies on a mesh."""

from dataclasses import dataclass

from .errors import UserError
from .graph.layer_graph import LayerGraph
from .pins import Pin
from .plan import LayerPlan, Mesh, strategy_label

TECHNIQUES = ("fsdp", "hsdp", "ddp", "tp", "tp_dp", "cp", "ep", "ac", "pp")
"""fsdp: shard over dp_shard; hsdp: replicate x shard; ddp: replicate only (gradients
all-reduced, parameters whole on every rank; tp = cp = 1); tp: tensor + sequence parallel; tp_dp: a
block may use the tp dim as extra data parallel (dense models); cp: context parallel (ring
attention); ep: expert parallel for routed experts (MoE models); ac: activation checkpointing;
pp: pipeline parallel (schedule, stages per rank, micro-batches and the stage split searched)."""
TP_MODES = ("sp", "dp")
"""Per block on a mesh with tp > 1: "sp" = TorchTitan's TP + sequence-parallel plan; "dp" = the
block's parameters are FSDP-sharded over dp_shard x tp and the tp ranks split the micro-batch
(entry/exit all-to-all between the sequence-sharded residual stream and a batch shard)."""
AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True, order=True)
class BlockStrategy:
    """How one transformer block runs: activation checkpointing, FSDP resharding, and what the
    tp mesh dim does for it ("none" when tp = 1, else one of TP_MODES)."""

    ac: str
    reshard_after_forward: bool
    tp_mode: str = "none"

    @classmethod
    def of(cls, layer: LayerPlan) -> "BlockStrategy":
        """The strategy a planned block runs (its plan-file fields)."""
        return cls(layer.ac, layer.reshard_after_forward, layer.tp_mode)

    def describe(self, ep: int = 1, unsharded: str = "") -> str:
        """Label of this strategy for a block with experts on ``ep`` ranks (``strategy_label``)."""
        return strategy_label(self.ac, self.reshard_after_forward, self.tp_mode, ep,
                              unsharded=unsharded)


@dataclass(frozen=True)
class Constraints:
    """What the user fixed: degrees (0 = free) and allowed techniques."""

    dp_replicate: int = 0
    dp_shard: int = 0
    tp: int = 0
    cp: int = 0
    ep: int = 0
    etp: int = 0
    techniques: tuple[str, ...] = TECHNIQUES
    ac_modes: tuple[str, ...] = AC_MODES
    """AC modes the model's adapter can apply (selective needs its op list)."""
    reshard_after_forward: str = "default"
    """parallelism.fsdp_reshard_after_forward: "default" = chosen per block, "always" /
    "never" = every FSDP-sharded block reshards / keeps its parameters after forward."""
    pp: int = 0
    pp_schedules: tuple[str, ...] = ()
    """Pipeline schedules the search may use (empty: all of TorchTitan's)."""
    pp_microbatch: int = 0
    """Sequences per pipeline micro-batch (0 = searched)."""
    pp_stages_per_rank: int = 0
    """Pipeline stages per pp rank (0 = searched)."""
    pp_ep_overlap: bool = True
    """parallelism.pipeline_parallel_expert_parallel_overlap: DualPipeV hides the expert
    all-to-all under the other micro-batch's computation."""
    accumulation: bool = True
    """Gradient accumulation allowed (False: the local batch is the micro-batch, as
    ``optimizer.early_step_in_backward`` requires)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def legal_tp(graph: LayerGraph, tp: int, gpus_per_node: int) -> bool:
    return (
        tp <= gpus_per_node
        and graph.n_heads % tp == 0
        and graph.n_kv_heads % tp == 0
        and graph.seq_len % tp == 0
        and graph.dim % tp == 0
    )


def enumerate_meshes(
    graph: LayerGraph, world: int, gpus_per_node: int, constraints: Constraints
) -> list[Mesh]:
    """Every mesh shape the model, the world size and the user's constraints allow."""
    allowed = set(constraints.techniques)
    cp_attention = graph.cp_attention
    if graph.attn_type not in cp_attention:
        if constraints.cp > 1:
            raise UserError(
                f"context parallel in {graph.family} needs {' or '.join(cp_attention)} "
                f"attention; {graph.flavor} uses {graph.attn_type!r}: set "
                "parallelism.context_parallel_degree = 1 or pick a flavor with sdpa attention"
            )
        allowed.discard("cp")
    check_expert_constraints(graph, world, constraints)
    meshes = []
    for pp in pipeline_degrees(graph, world, constraints, allowed):
        dense = world // pp
        for tp in _divisors(dense):
            if tp > 1 and "tp" not in allowed:
                continue
            if not legal_tp(graph, tp, gpus_per_node):
                continue
            for cp in _divisors(dense // tp):
                # ring attention with head-tail load balancing: seq_len % (2 * cp * tp) == 0
                if cp > 1 and ("cp" not in allowed or graph.seq_len % (2 * cp * tp)):
                    continue
                for dp_replicate in _divisors(dense // tp // cp):
                    dp_shard = dense // tp // cp // dp_replicate
                    if dp_replicate > 1 and dp_shard > 1 and "hsdp" not in allowed:
                        continue
                    if dp_replicate > 1 and dp_shard == 1 and (
                            "ddp" not in allowed or tp > 1 or cp > 1 or pp > 1):
                        continue  # pure replication: data parallel alone (TorchTitan's DDP)
                    if dp_shard > 1 and "fsdp" not in allowed and "hsdp" not in allowed:
                        continue
                    fixed = (constraints.dp_replicate, constraints.dp_shard, constraints.tp,
                             constraints.cp)
                    values = (dp_replicate, dp_shard, tp, cp)
                    if any(f and f != v for f, v in zip(fixed, values, strict=True)):
                        continue
                    meshes.extend(
                        Mesh(dp_replicate, dp_shard, tp, cp, ep, etp, pp)
                        for ep, etp in expert_degrees(graph, dp_shard, cp, tp, constraints,
                                                      allowed)
                    )
    if not meshes:
        raise UserError(
            f"no legal mesh for world size {world}: tp must divide the heads "
            f"({graph.n_heads} query / {graph.n_kv_heads} kv), the sequence length and be "
            f"<= gpus_per_node ({gpus_per_node}); fixed degrees "
            f"pp={constraints.pp or 'free'} "
            f"dp_replicate={constraints.dp_replicate or 'free'} "
            f"dp_shard={constraints.dp_shard or 'free'} tp={constraints.tp or 'free'} "
            f"cp={constraints.cp or 'free'} (cp needs seq_len % (2 x cp x tp) == 0) and "
            f"techniques {list(constraints.techniques)} must multiply to {world}"
        )
    return meshes


def pipeline_degrees(graph: LayerGraph, world: int, constraints: Constraints,
                     allowed: set[str]) -> list[int]:
    """pp degrees to search: 1, plus the divisors of the world that leave every rank at least
    one block (TorchTitan builds one model part per stage), when pp is allowed."""
    if constraints.pp:
        if world % constraints.pp:
            raise UserError(
                f"parallelism.pipeline_parallel_degree = {constraints.pp} does not divide the "
                f"world size {world}: choose one of {_divisors(world)[1:]} or 1 (searched)")
        if constraints.pp > len(graph.blocks):
            raise UserError(
                f"parallelism.pipeline_parallel_degree = {constraints.pp} exceeds the "
                f"{len(graph.blocks)} blocks of {graph.family} {graph.flavor}: every pp rank "
                "needs a block; lower it")
        return [constraints.pp]
    if "pp" not in allowed:
        return [1]
    return [pp for pp in _divisors(world) if pp == 1 or 2 * pp <= len(graph.blocks)]


def legal_ep(num_experts: int, dp_shard: int, cp: int, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs TorchTitan 0.2.2 accepts on a dp_shard x cp x tp mesh, ep > 1: etp = tp
    with ep dividing dp_shard x cp, or etp = 1 with ep a multiple of tp dividing
    dp_shard x cp x tp (ep borrows all of tp); ep must divide the expert count. TorchTitan
    shards the rest of an EP model with FSDP, so dp_shard x cp must exceed 1."""
    out: list[tuple[int, int]] = []
    if dp_shard * cp == 1:
        return out
    for k in _divisors(dp_shard * cp):
        for ep, etp in ((k, tp), (k * tp, 1)):
            if ep > 1 and num_experts % ep == 0 and (ep, etp) not in out:
                out.append((ep, etp))
    return sorted(out)


def expert_degrees(graph: LayerGraph, dp_shard: int, cp: int, tp: int,
                   constraints: Constraints, allowed: set[str]) -> list[tuple[int, int]]:
    """The (ep, etp) choices for one dense mesh: (1, 1) plus the legal EP layouts."""
    options = [(1, 1)]
    if graph.num_experts and "ep" in allowed:
        options += legal_ep(graph.num_experts, dp_shard, cp, tp)
    return [(ep, etp) for ep, etp in options
            if (not constraints.ep or constraints.ep == ep)
            and (not constraints.etp or ep > 1 and constraints.etp == etp)]


def check_expert_constraints(graph: LayerGraph, world: int, constraints: Constraints) -> None:
    """Errors for EP settings that cannot work on this model."""
    if constraints.ep > 1 and not graph.num_experts:
        raise UserError(
            f"parallelism.expert_parallel_degree = {constraints.ep} but {graph.family} "
            f"{graph.flavor} has no MoE layers: set it to 1 (expert parallel applies to routed "
            "experts only)"
        )
    if constraints.ep > 1 and graph.num_experts % constraints.ep:
        legal = sorted({ep for ep, _ in legal_ep(graph.num_experts, world, 1, 1)})
        raise UserError(
            f"parallelism.expert_parallel_degree = {constraints.ep} does not divide the "
            f"{graph.num_experts} experts of {graph.family} {graph.flavor}: choose one of "
            f"{legal or [1]}"
        )
    if constraints.etp > 1 and not graph.num_experts:
        raise UserError(
            f"parallelism.expert_tensor_parallel_degree = {constraints.etp} but {graph.family} "
            f"{graph.flavor} has no MoE layers: set it to 1"
        )
    if constraints.etp > 1 and constraints.tp and constraints.etp != constraints.tp:
        raise UserError(
            f"parallelism.expert_tensor_parallel_degree = {constraints.etp} must be 1 or equal "
            f"to tensor_parallel_degree ({constraints.tp}) (TorchTitan's rule)"
        )


def block_strategies(mesh: Mesh, microbatch: int, constraints: Constraints,
                     moe_model: bool = False) -> list[BlockStrategy]:
    """Per-block choices on ``mesh`` for a local batch of ``microbatch`` sequences. The tp dim
    as data parallel is offered on dense models only (MoE blocks follow TorchTitan's MoE TP)."""
    acs = constraints.ac_modes if "ac" in constraints.techniques else ("none",)
    tp_modes: tuple[str, ...] = ("none",)
    if mesh.tp > 1:
        # tp as data parallel needs an FSDP mesh over dp_shard x tp (dp_shard > 1)
        dp_ok = ("tp_dp" in constraints.techniques and microbatch % mesh.tp == 0
                 and mesh.dp_shard > 1 and mesh.dp_replicate == 1 and mesh.cp == 1
                 and not moe_model)
        tp_modes = TP_MODES if dp_ok else ("sp",)
    out = []
    for mode in tp_modes:
        sharded = mesh.dp_shard * mesh.cp > 1 or mode == "dp"
        reshards = {"default": (True, False), "always": (True,), "never": (False,)}[
            constraints.reshard_after_forward] if sharded else (False,)
        for ac in acs:
            for reshard in reshards:
                out.append(BlockStrategy(ac, reshard, mode))
    return out


def edge_strategy(kind: str, mesh: Mesh) -> BlockStrategy:
    """How the embedding and the norm + output are applied (and so costed): the embedding
    reshards after forward, the output keeps its parameters for the backward that follows at
    once; vocab-parallel with loss parallel when tp > 1."""
    return BlockStrategy("none", kind == "embedding", "sp" if mesh.tp > 1 else "none")


def pinned_strategies(mesh: Mesh, microbatch: int, constraints: Constraints, moe_model: bool,
                      pin: Pin | None) -> list[BlockStrategy]:
    """Strategies a block may take given its pin: TorchTitan's recipe only (whole block
    pinned), no tp-as-dp (a region inside pinned), or all of them."""
    if pin is not None and pin.whole:
        sharded = mesh.dp_shard * mesh.cp > 1
        return [BlockStrategy(pin.recipe_ac, pin.recipe_reshard and sharded,
                              "sp" if mesh.tp > 1 else "none")]
    free = block_strategies(mesh, microbatch, constraints, moe_model)
    if pin is not None and pin.regions:
        return [s for s in free if s.tp_mode != "dp"]
    return free


def microbatch_sizes(global_batch: int, mesh: Mesh, accumulation: bool = True) -> list[int]:
    """Local batch sizes that split the global batch evenly over the data-parallel ranks
    (without ``accumulation``: only the whole local batch)."""
    if global_batch % mesh.dp:
        return []
    local = global_batch // mesh.dp
    return _divisors(local) if accumulation else [local]
