"""Candidates: legal mesh shapes for a world size, and per-block strategies on a mesh."""

import functools
from dataclasses import dataclass, replace

from ..errors import UserError
from ..graph.layer_graph import LayerGraph
from ..job.pins import Pin
from .layout import (
    AC_MODES,
    DEFAULT_TECHNIQUES,
    EMBEDDING_MODES,
    FSDP_UNIT_SIZES,
    MOE_SUB_BLOCK_MODES,
    SUB_BLOCK_TP_MODES,
    TP_WITHOUT_SP,
    BlockStrategy,
    Mesh,
    divisors,
    embedding_dim_problem,
    embedding_stream_problem,
    ep_problem,
    fsdp_sharded,
    fsdp_unit_problem,
    node_reshard_group,
    node_reshard_problem,
    stream_dim,
    tp_dp_problem,
)


@dataclass(frozen=True)
class Constraints:
    """What the user fixed: degrees (0 = free) and allowed techniques."""

    dp_replicate: int = 0
    dp_shard: int = 0
    tp: int = 0
    cp: int = 0
    ep: int = 0
    etp: int = 0
    techniques: tuple[str, ...] = DEFAULT_TECHNIQUES
    ac_modes: tuple[str, ...] = AC_MODES
    """AC modes the model's adapter can apply (selective needs its op list)."""
    reshard_after_forward: str = "default"
    """parallelism.fsdp_reshard_after_forward: "default" = chosen per block, "always" /
    "never" = every FSDP-sharded block reshards / keeps its parameters after forward,
    "torchtitan" = TorchTitan's "default" set by the user (always, never under pp)."""
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
    fsdp_required: bool = False
    """Every mesh shards over dp_shard x cp (``training.enable_cpu_offload`` is FSDP's)."""
    accumulation: bool = True
    """Gradient accumulation allowed (False: the local batch is the micro-batch, as
    ``optimizer.early_step_in_backward`` requires)."""
    node_reshard: bool = True
    """FSDP may reshard a block to one node's ranks after forward (an integer
    ``reshard_after_forward``); False where the release's FSDP cannot (``Frontend``)."""
    sub_block_modes: tuple[str, ...] = SUB_BLOCK_TP_MODES
    """The sub-block tp modes ``tp_sub_block`` offers: those the release's apply runs
    (``Frontend``)."""
    moe_sub_block_modes: tuple[str, ...] = MOE_SUB_BLOCK_MODES
    """The sub-block tp modes ``tp_sub_block`` offers MoE blocks: those the release's apply
    runs (``Frontend``)."""
    embedding_dim: bool = True
    """``tp_sub_block`` also offers the embedding looked up on its embedding dim, where the
    release's apply runs it (``Frontend.embedding_dim``)."""
    sequence_parallel: bool = True
    """False: the job turns sequence parallel off (TorchTitan 0.3.0's
    ``parallelism.enable_sequence_parallel``): dense blocks on tp > 1 run on a replicated
    stream only (``TP_WITHOUT_SP``, and the ``REPLICATED_MODES`` of ``sub_block_modes`` under
    ``tp_sub_block``); a MoE model's blocks run ``TP_WITHOUT_SP`` alone."""


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
    fixed = {"dp_replicate": constraints.dp_replicate, "dp_shard": constraints.dp_shard,
             "tp": constraints.tp, "cp": constraints.cp}
    meshes = []
    refused: dict[str, None] = {}  # why the meshes with the fixed degrees are illegal
    first: dict[str, None] = {}  # the set expert degrees' own reasons, said first
    for pp in pipeline_degrees(graph, world, constraints, allowed):
        dense = world // pp
        for tp in divisors(dense):
            for cp in divisors(dense // tp):
                for dp_replicate in divisors(dense // tp // cp):
                    dp_shard = dense // tp // cp // dp_replicate
                    values = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp,
                              "cp": cp}
                    if any(f and f != values[k] for k, f in fixed.items()):
                        continue
                    why = _mesh_refusal(graph, gpus_per_node, allowed, pp, dp_replicate,
                                        dp_shard, cp, tp)
                    if not why and tp > 1 and not constraints.sequence_parallel:
                        why = without_sp_refusal(Mesh(
                            dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp, pp=pp))
                    if not why and constraints.fsdp_required and dp_shard * cp == 1:
                        why = ("training.enable_cpu_offload is FSDP's CPU offload, so the mesh "
                               "must shard over dp_shard x cp > 1")
                    experts = [] if why else expert_degrees(graph, dp_shard, cp, tp,
                                                            constraints, allowed)
                    if not why and not experts:  # a set ep / etp no layout here takes
                        first[_expert_refusal(graph, constraints, Mesh(
                            dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp,
                            pp=pp))] = None
                    if why:
                        refused[why] = None
                    meshes.extend(Mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                                       cp=cp, ep=ep, etp=etp, pp=pp) for ep, etp in experts)
    refused = {**first, **refused}
    if not meshes:
        degrees = (f"pp={constraints.pp or 'free'} "
                   f"dp_replicate={constraints.dp_replicate or 'free'} "
                   f"dp_shard={constraints.dp_shard or 'free'} tp={constraints.tp or 'free'} "
                   f"cp={constraints.cp or 'free'}")
        if refused and any(fixed.values()):
            raise UserError(f"no legal mesh for world size {world} with the fixed degrees "
                            f"{degrees}: {'; '.join(list(refused)[:3])}")
        if refused:
            raise UserError(f"no legal mesh for world size {world} with techniques "
                            f"{list(constraints.techniques)}: {'; '.join(list(refused)[:3])}")
        raise UserError(f"no legal mesh for world size {world}: the fixed degrees {degrees} "
                        f"must multiply to a divisor of {world} (to {world} when all are "
                        "fixed); the free dims take the remaining ranks")
    return meshes


def without_sp_refusal(mesh: Mesh) -> str:
    """Why a job with sequence parallel off cannot run tensor parallel on ``mesh`` (empty if
    it can): its blocks run ``TP_WITHOUT_SP`` (``tp_dp_problem``'s rule)."""
    off = "parallelism.enable_sequence_parallel is off"
    problem = tp_dp_problem(mesh, 1, "block", TP_WITHOUT_SP, fix=False)
    return f"{off}: {problem}" if problem else ""


def _mesh_refusal(graph: LayerGraph, gpus_per_node: int, allowed: set[str], pp: int,
                  dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    """Why the mesh pp x dp_replicate x dp_shard x cp x tp cannot run this model ("" when it
    can). TorchTitan shards over dp_shard x cp (HSDP with dp_replicate > 1); replicas alone
    are its DDP, which runs with nothing else."""
    if tp > 1 and "tp" not in allowed:
        return "technique tp is not allowed (autoparallel.techniques)"
    if not legal_tp(graph, tp, gpus_per_node):
        return (f"tp {tp} must divide the heads ({graph.n_heads} query / {graph.n_kv_heads} kv), "
                f"the model dim {graph.dim} and seq_len {graph.seq_len} and be <= "
                f"gpus_per_node ({gpus_per_node})")
    if cp > 1 and "cp" not in allowed:
        return "technique cp is not allowed (autoparallel.techniques or the model's attention)"
    if cp > 1 and graph.seq_len % (2 * cp * tp):
        return (f"cp needs seq_len % (2 x cp x tp) == 0 (ring attention with load "
                f"balancing): cp {cp} x tp {tp}, seq_len {graph.seq_len}")
    sharded = dp_shard * cp > 1
    if dp_replicate > 1 and sharded and "hsdp" not in allowed:
        return "technique hsdp is not allowed (autoparallel.techniques)"
    if dp_replicate > 1 and not sharded:
        if "ddp" not in allowed:
            return "technique ddp is not allowed (autoparallel.techniques)"
        if tp > 1 or pp > 1:
            return (f"dp_replicate {dp_replicate} with dp_shard = cp = 1 is TorchTitan's DDP, "
                    "which runs with tp = pp = 1 only: shard over dp_shard or cp too (HSDP)")
    if dp_shard > 1 and "fsdp" not in allowed and "hsdp" not in allowed:
        return "techniques fsdp and hsdp are not allowed (autoparallel.techniques)"
    return ""


def pipeline_degrees(graph: LayerGraph, world: int, constraints: Constraints,
                     allowed: set[str]) -> list[int]:
    """pp degrees to search: 1, plus the divisors of the world that leave every rank at least
    one block (TorchTitan builds one model part per stage), when pp is allowed."""
    if constraints.pp:
        if world % constraints.pp:
            raise UserError(
                f"parallelism.pipeline_parallel_degree = {constraints.pp} does not divide the "
                f"world size {world}: choose one of {list(divisors(world)[1:])}, 1 (no pipeline) "
                "or leave it unset (searched)")
        if constraints.pp > len(graph.blocks):
            raise UserError(
                f"parallelism.pipeline_parallel_degree = {constraints.pp} exceeds the "
                f"{len(graph.blocks)} blocks of {graph.family} {graph.flavor}: every pp rank "
                "needs a block; lower it")
        return [constraints.pp]
    if "pp" not in allowed:
        return [1]
    return [pp for pp in divisors(world) if pp == 1 or 2 * pp <= len(graph.blocks)]


def legal_ep(num_experts: int, dp_shard: int, cp: int, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs with ep > 1 that TorchTitan runs on a dp_shard x cp x tp mesh for
    ``num_experts`` routed experts: the layouts ``ep_problem`` (the plan check's rule too)
    accepts, among etp = tp and etp = 1 with ep = a divisor of dp_shard x cp (times tp)."""
    pairs = {(ep, etp) for k in divisors(dp_shard * cp) for ep, etp in ((k, tp), (k * tp, 1))}
    return sorted((ep, etp) for ep, etp in pairs if ep > 1 and not ep_problem(
        Mesh(dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp), num_experts))


def expert_degrees(graph: LayerGraph, dp_shard: int, cp: int, tp: int,
                   constraints: Constraints, allowed: set[str]) -> list[tuple[int, int]]:
    """The (ep, etp) choices for one dense mesh: (1, 1) plus the legal EP layouts."""
    options = [(1, 1)]
    if graph.num_experts and "ep" in allowed:
        options += legal_ep(graph.num_experts, dp_shard, cp, tp)
    # a fixed etp applies to routed experts only: etp = 1 also allows ep = 1
    return [(ep, etp) for ep, etp in options
            if (not constraints.ep or constraints.ep == ep)
            and (not constraints.etp or constraints.etp == etp and (ep > 1 or etp == 1))]


def _expert_refusal(graph: LayerGraph, constraints: Constraints, mesh: Mesh) -> str:
    """Why the job's expert-parallel degrees take no layout on ``mesh`` (``ep_problem``)."""
    problem = constraints.ep and ep_problem(replace(
        mesh, ep=constraints.ep, etp=constraints.etp or 1), graph.num_experts)
    if problem:
        return f"expert_parallel_degree {constraints.ep}: {problem}"
    return (f"expert_tensor_parallel_degree {constraints.etp} takes no expert-parallel layout "
            f"with tp {mesh.tp} (its experts split over tp, ep needs dp_shard x cp > 1): set "
            "it to 1 or plan on more ranks")


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


def block_tp_modes(mesh: Mesh, microbatch: int, constraints: Constraints,
                   moe_model: bool = False, experts: bool = False) -> tuple[str, ...]:
    """What the tp dim may do for a block on ``mesh``: nothing (tp = 1); TorchTitan's TP + SP;
    on dense models, where the job allows it (``tp_dp_problem``), data parallel for the whole
    block ("tp_dp") or for one of its sub-blocks ("tp_sub_block": the sub-block modes the
    release applies, ``Constraints.sub_block_modes``). A MoE model's blocks with routed
    ``experts`` may take the release's ``Constraints.moe_sub_block_modes`` under
    "tp_sub_block"; its dense blocks TP + SP. A job with sequence parallel off
    (``Constraints.sequence_parallel``): TP without SP, and on dense models the sub-block
    modes on a replicated stream, in place of TP + SP and the rest."""
    if mesh.tp == 1:
        return ("none",)
    if moe_model and not constraints.sequence_parallel:  # the model's own TP without SP
        return (TP_WITHOUT_SP,) if not tp_dp_problem(mesh, microbatch, "block",
                                                     TP_WITHOUT_SP) else ()
    if moe_model:
        offered = constraints.moe_sub_block_modes if experts and "tp_sub_block" in \
            constraints.techniques else ()
        return ("sp", *(mode for mode in offered
                        if not tp_dp_problem(mesh, microbatch, "block", mode)))
    asked = (("dp",) if "tp_dp" in constraints.techniques else ()) + (
        constraints.sub_block_modes if "tp_sub_block" in constraints.techniques else ())
    if not constraints.sequence_parallel:  # TP without SP: a replicated stream only
        asked = (TP_WITHOUT_SP, *(mode for mode in asked
                                  if stream_dim(mode) is None and mode != TP_WITHOUT_SP))
        return tuple(mode for mode in asked if not tp_dp_problem(mesh, microbatch, "block",
                                                                   mode))
    return ("sp", *(mode for mode in asked if not tp_dp_problem(mesh, microbatch, "block", mode)))


def embedding_modes(graph: LayerGraph, mesh: Mesh, constraints: Constraints
                    ) -> tuple[str, ...]:
    """How the embedding may run on ``mesh``: as the mesh runs it ("": ``edge_strategy``'s
    default) and looked up on its embedding dim in each of ``EMBEDDING_MODES`` that
    ``embedding_dim_refused`` has no objection to."""
    return ("", *(mode for mode in EMBEDDING_MODES
                  if not embedding_dim_refused(graph, mesh, constraints, mode)))


def embedding_dim_refused(graph: LayerGraph, mesh: Mesh, constraints: Constraints,
                          tp_mode: str) -> str:
    """Why the embedding is not looked up on its embedding dim in ``tp_mode`` (one of
    ``EMBEDDING_MODES``) on ``mesh`` (empty if it may be): it needs ``tp_sub_block`` asked
    for, a dense model without encoders whose output does not share the embedding's weight,
    and ``embedding_dim_problem``'s mesh."""
    mode = f"tp_mode {tp_mode!r} for the embedding"
    if "tp_sub_block" not in constraints.techniques:
        return f"{mode} needs autoparallel.techniques with tp_sub_block"
    if not constraints.embedding_dim:
        return f"{mode} is not applied on this TorchTitan release; use the default"
    if not constraints.sequence_parallel and mesh.tp > 1:  # the blocks' stream replicated
        return embedding_stream_problem(tp_mode, None)
    if graph.num_experts or graph.tied_output or any(
            layer.kind == "encoder" for layer in graph.edges):
        return (f"{mode} is planned on dense models without encoders or tied output weights "
                "only; use the default")
    return embedding_dim_problem(mesh, graph.dim, graph.vocab_size, tp_mode)


@functools.lru_cache(maxsize=8192)
def block_strategies(mesh: Mesh, microbatch: int, constraints: Constraints,
                     moe_model: bool = False, gpus_per_node: int = 0, run: int = 1,
                     experts: bool = False) -> tuple[BlockStrategy, ...]:
    """Per-block choices on ``mesh`` for a local batch of ``microbatch`` sequences (cached: the
    search asks for the same ones for several candidates of a mesh). The tp dim
    as data parallel is offered on dense models only (MoE blocks follow TorchTitan's MoE TP).
    Where the FSDP group spans nodes, dense blocks of a flat plan may also reshard to the
    ranks of one node (``node_reshard_group``) when resharding is searched. Blocks of a dense
    model's class that forms one ``run`` of consecutive blocks may share FSDP units of k blocks
    (k in ``FSDP_UNIT_SIZES`` up to the run, where ``fsdp_unit_problem`` allows; MoE models
    keep TorchTitan's per-block FSDP, as for the node reshard). ``experts``: the block has
    routed experts (``block_tp_modes``)."""
    acs = constraints.ac_modes if "ac" in constraints.techniques else ("none",)
    out = []
    for mode in block_tp_modes(mesh, microbatch, constraints, moe_model, experts):
        sharded = fsdp_sharded(mesh, mode)
        reshards: tuple[bool | int, ...] = {
            "default": (True, False), "always": (True,), "never": (False,),
            "torchtitan": (mesh.pp == 1,)}[constraints.reshard_after_forward] if sharded \
            else (False,)
        node = node_reshard_group(mesh, gpus_per_node, mode)
        if node and constraints.reshard_after_forward == "default" and constraints.node_reshard \
                and not node_reshard_problem(mesh, mode, node, "block", moe_model):
            reshards += (node,)
        units = (1,) if fsdp_unit_problem(mesh, mode) or moe_model else (
            1, *(k for k in FSDP_UNIT_SIZES if k <= run))
        for ac in acs:
            for reshard in reshards:
                out.extend(BlockStrategy(ac, reshard, mode, unit) for unit in units)
    return tuple(out)


def pinned_strategies(mesh: Mesh, microbatch: int, constraints: Constraints, moe_model: bool,
                      pin: Pin | None, gpus_per_node: int = 0, run: int = 1,
                      experts: bool = False) -> list[BlockStrategy]:
    """Strategies a block may take given its pin: TorchTitan's recipe only (whole block
    pinned), TP + SP only (a region inside pinned), only the AC mode the job fixes for it
    (layer-wise selective AC), or all of them (``run``: see ``block_strategies``). A block
    whose only pinned regions are the family's default ones (MoE routing, which its code runs
    in these modes too) may also take the release's MoE sub-block modes."""
    if pin is not None and pin.whole:
        sharded = fsdp_sharded(mesh)
        return [BlockStrategy(pin.recipe_ac, pin.recipe_reshard and sharded,
                              "none" if mesh.tp == 1 else recipe_tp_mode(constraints))]
    free = block_strategies(mesh, microbatch, constraints, moe_model, gpus_per_node, run,
                            experts)
    kept = ("none", recipe_tp_mode(constraints),
            *(constraints.moe_sub_block_modes if pin is not None and pin.defaults_only
              else ()))
    return [s for s in free
            if not (pin is not None and pin.regions and s.tp_mode not in kept)
            and (pin is None or pin.ac is None or s.ac == pin.ac)]


def recipe_tp_mode(constraints: Constraints) -> str:
    """The tp mode of TorchTitan's own TP plan for the job's dense blocks on tp > 1: TP + SP,
    or TP without SP where the job turns sequence parallel off."""
    return "sp" if constraints.sequence_parallel else TP_WITHOUT_SP


def fastest_strategies(strategies: list[BlockStrategy]) -> list[BlockStrategy]:
    """The strategies that set a block's fastest time: no activation checkpointing and no
    resharding after forward (recomputing and gathering again only add time; TP modes and FSDP
    units may go either way). All of them when none qualifies (a pinned recipe)."""
    fast = [s for s in strategies if s.ac == "none" and not s.reshard_after_forward]
    return fast or strategies


def microbatch_sizes(global_batch: int, mesh: Mesh, accumulation: bool = True) -> list[int]:
    """Local batch sizes that split the global batch evenly over the data-parallel ranks
    (without ``accumulation``: only the whole local batch)."""
    if global_batch % mesh.dp:
        return []
    local = global_batch // mesh.dp
    return list(divisors(local)) if accumulation else [local]
