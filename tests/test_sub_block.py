"""Sub-block tp modes ("dp/sp": data-parallel attention beside a TP + SP feed-forward; "sp/dp"
the reverse): their costs against hand counts from the layer's shapes, their legality, and the
search that offers them only when asked (technique tp_sub_block)."""

import dataclasses
import functools

import pytest
import torch

from torchtitan_autoparallel.candidates.layout import (
    SUB_BLOCK_TP_MODES,
    BlockStrategy,
    Mesh,
    fsdp_unit_problem,
    node_reshard_group,
    node_reshard_problem,
    split_fsdp,
    sub_block_modes,
    tp_dp_problem,
)
from torchtitan_autoparallel.candidates.strategies import Constraints, block_tp_modes
from torchtitan_autoparallel.cost import kernels
from torchtitan_autoparallel.cost.comm import fsdp_s, tp_comm_s
from torchtitan_autoparallel.cost.compute import block_compute_s, gemm_times
from torchtitan_autoparallel.cost.hardware import load_profile
from torchtitan_autoparallel.cost.model import CostContext, Precision, block_cost
from torchtitan_autoparallel.graph.sub_block_find import pre_norm_pairs, with_found_sub_blocks
from torchtitan_autoparallel.job.features import Features
from torchtitan_autoparallel.titan.v0_2.tp_dp import MOE_SUB_BLOCKS_APPLIED

MESH = Mesh(dp_replicate=1, dp_shard=8, tp=8)
MB = 8  # sequences per micro-batch: the tp ranks split it evenly


@functools.lru_cache(maxsize=1)
def llama3_8b_block():
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_autoparallel.titan.v0_2.model import build_layer_graph
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    spec = get_train_spec("llama3")
    graph = build_layer_graph("llama3", "8B", spec.model_args["8B"], spec.model_cls, 8192)
    return graph, graph.blocks[0]


def context(**profile: float) -> CostContext:
    hw = dataclasses.replace(load_profile("h100_sxm"), **profile)
    return CostContext(hw=hw, prec=Precision(2, 4), gpus_per_node=8, features=Features())


def hand_gemms(block, mode: str, hw) -> float:
    """Forward + backward seconds of the block's linears, each GEMM from the kernel table at
    the local shape its sub-block's mode gives: TP + SP splits a column-wise weight's outputs
    and a row-wise one's inputs over tp on all tokens; data parallel keeps the weight whole on
    a tp-th of the tokens; ":a2a" keeps attention.wo whole on a tp-th of the tokens;
    "tp@dp_shard" splits the weights over dp_shard on the dp_shard ranks' tokens of a tp
    shard."""
    tokens = 8192 * MB
    attention, ffn = sub_block_modes(mode)
    total = 0.0
    for name, (k, n), style in zip(block.linear_names, block.linear_shapes, block.linear_styles,
                                   strict=True):
        own = attention if name.startswith("attention.") else ffn
        if name == "attention.wo" and mode.endswith(":a2a"):
            own = "dp"
        m = tokens / MESH.tp if own == "dp" else tokens
        if own == "sp":
            k, n = (k, n / MESH.tp) if style == "colwise" else (k / MESH.tp, n)
        if own == "tp@dp_shard":
            m = tokens * MESH.dp_shard / MESH.tp
            k, n = (k, n / MESH.dp_shard) if style == "colwise" else (k / MESH.dp_shard, n)
        for shape in ((m, n, k), (m, k, n), (k, n, m)):  # output, input grad, weight grad
            total += kernels.gemm_s(*shape, hw.gemm_table, hw.clock_scale)
    return total


@pytest.mark.parametrize("mode", SUB_BLOCK_TP_MODES)
def test_sub_block_compute_is_each_sub_block_at_its_own_mode(mode):
    """A sub-block mode's GEMMs are the attention's at its mode plus the FFN's at its own,
    counted GEMM by GEMM from the layer's shapes; the rest of the block (attention kernel,
    streaming ops) is what the whole-block modes pay too (both split the work over tp)."""
    _, block = llama3_8b_block()
    ctx = context()
    strategy = BlockStrategy("none", False, mode)
    fwd, bwd = gemm_times(block, MESH, strategy, MB, ctx.hw, ctx.features)
    assert fwd + bwd == pytest.approx(hand_gemms(block, mode, ctx.hw), rel=1e-12)
    whole = block_compute_s(block, MESH, BlockStrategy("none", False, "sp"), MB, ctx)[1]
    mixed = block_compute_s(block, MESH, strategy, MB, ctx)[1]
    expected = whole - hand_gemms(block, "sp", ctx.hw) + hand_gemms(block, mode, ctx.hw)
    if mode.endswith(":rep"):
        # TP without SP: each TP sub-block's RMSNorm (read + write) and residual add (two
        # reads, one write) run on all 8192 x MB tokens of 4096 bf16 elements where SP runs
        # them on a tp-th, forward once and backward twice, at HBM bandwidth
        tp_parts = mode.split(":")[0].split("/").count("sp")
        moved = tp_parts * 5 * 8192 * MB * 4096 * 2 * (1 - 1 / MESH.tp)
        expected += 3 * moved / (ctx.hw.hbm_gbps * 1e9)
    assert mixed == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("mode", SUB_BLOCK_TP_MODES)
def test_sub_block_tp_communication_by_hand(mode, ac):
    """Without async TP: the TP + SP sub-block all-gathers its input and reduce-scatters its
    output in forward and the transposes in backward (4 collectives of one micro-batch's
    activations over tp; full AC repeats the forward pair); a data-parallel attention is
    entered and left through an all-to-all of a tp-th of them, in forward and in backward
    (full AC: both again), except where the stream is sharded on the batch already; a
    data-parallel feed-forward runs per token on the sequence shard (no all-to-all).
    "tp@dp_shard": the feed-forward's pair over dp_shard instead (8 ranks, one per node: the
    network), each of the 8 ranks' stream shards, and its weights' dp_shard-th gathered over
    tp in each forward pass, their gradients reduce-scattered back. Flat
    bandwidth, no latency: time = (group - 1) / group x bytes / bw."""
    _, block = llama3_8b_block()
    ctx = context(intra_node_half_mib=0.0, intra_node_latency_us=0.0, hbm_gbps=0.0,
                  inter_node_half_mib=0.0, inter_node_latency_us=0.0)
    bw = ctx.hw.intra_node_gbps * 1e9
    act = 8192 * 4096 * 2 * MB  # bf16 residual stream of one micro-batch
    tp = MESH.tp
    ring = (tp - 1) / tp
    passes = 2 if ac == "full" else 1
    tp_parts = mode.split(":")[0].split("/").count("sp")
    sp = tp_parts * (2 * passes + 2) * ring * act / bw
    dp_part = mode.startswith("dp/") and not mode.endswith((":batch", ":rep"))
    a2a = (4 + 2 * (passes - 1)) * ring * (act / tp) / bw if dp_part else 0.0
    if mode.endswith(":rep"):
        # TP without SP: an all-reduce (2 x the ring's bytes) in place of each gather +
        # scatter pair, the same bytes; a data-parallel sub-block's output all-gathered in
        # each forward pass, its input gradient in backward
        a2a = mode.count("dp") * (passes + 1) * ring * act / bw
    if mode.endswith(":a2a"):
        # wo: no reduce-scatter out of it (forward, and again under full AC) and no all-gather
        # of its output gradient; an all-to-all of its heads-sharded input instead, each time,
        # and its 4096 x 4096 bf16 weight all-gathered over tp in each forward pass, its
        # gradient reduce-scattered back
        sp -= (passes + 1) * ring * act / bw
        wo = 4096 * 4096 * 2
        a2a = (passes + 1) * ring * (act / tp) / bw + (passes + 1) * ring * wo / bw
    if mode == "sp/tp@dp_shard":
        net = min(ctx.hw.intra_node_gbps, ctx.hw.inter_node_gbps) * 1e9
        a2a = (passes + 1) * 2 * ring * (act / tp * MESH.dp_shard) / net
    got = tp_comm_s(block, MESH, BlockStrategy(ac, False, mode), MB, ctx)
    assert got == pytest.approx(sp + a2a, rel=1e-9)
    if mode.endswith((":a2a", ":rep")) or mode == "sp/tp@dp_shard":
        return
    # half the TP + SP block's collectives per TP sub-block, plus the data-parallel block's
    # all-to-alls on a sequence-sharded stream
    whole_sp = tp_comm_s(block, MESH, BlockStrategy(ac, False, "sp"), MB, ctx)
    whole_dp = tp_comm_s(block, MESH, BlockStrategy(ac, False, "dp"), MB, ctx)
    assert got == pytest.approx(whole_sp * tp_parts / 2 + whole_dp * (a2a > 0), rel=1e-9)


def test_sub_block_a2a_fsdp_groups_by_hand():
    """":a2a" stores wo as TorchTitan's row-wise wo (split over tp, FSDP over dp_shard): the
    block's FSDP is TP + SP's, one group with every parameter split over tp (gathered bytes,
    bf16); while its backward runs the block also holds wo's weight and gradient gathered
    whole over tp (the transient grows by 2 x 7/8 of wo's bf16 bytes)."""
    _, block = llama3_8b_block()
    ctx = context()
    a2a = BlockStrategy("none", True, "sp/sp:a2a")
    both = fsdp_s(block, MESH, a2a, ctx, 0.0)
    assert both.unsharded_bytes == pytest.approx(2 * block.params / MESH.tp)
    assert both == fsdp_s(block, MESH, BlockStrategy("none", True, "sp"), ctx, 0.0)
    sp = block_cost(block, MESH, BlockStrategy("none", True, "sp"), 1, ctx)
    got = block_cost(block, MESH, a2a, 1, ctx)
    assert got.transient_bytes - sp.transient_bytes == pytest.approx(
        2 * 4096 * 4096 * 2 * 7 / 8)


def test_sub_block_a2a_is_legal_without_a_batch_split():
    """":a2a" splits no batch over tp (wo runs on the sequence shard) and shards nothing over
    dp_shard x tp: legal with one sequence per rank, as AutoParallel's 8B jobs run it, where
    the data-parallel sub-blocks are not, and on tp alone; not with cp (the all-to-all splits
    the sequence over tp only)."""
    assert tp_dp_problem(MESH, 1, "block", "sp/sp:a2a") == ""
    assert "divisible by tp" in tp_dp_problem(MESH, 1, "block", "dp/sp")
    assert "sp/sp:a2a" in block_tp_modes(MESH, 1, Constraints(techniques=("fsdp", "tp",
                                                                           "tp_sub_block")))
    assert tp_dp_problem(Mesh(dp_replicate=2, dp_shard=1, tp=8), 1, "block", "sp/sp:a2a") == ""
    assert "cp = 1" in tp_dp_problem(Mesh(dp_replicate=1, dp_shard=4, tp=8, cp=2), MB, "block",
                                     "sp/sp:a2a")


def test_sub_block_batch_stream_skips_the_concatenation():
    """With the profile's HBM bandwidth and two sequences per micro-batch, SP's unfused
    collectives concatenate the sequence chunks (one read and write of the activation per
    collective); gathered and scattered on the batch they do not: the TP + SP block's time
    less 6 concatenations (4 collectives + 2 forward ones again under full AC) x 2 x act / hbm,
    with the data-parallel attention's all-to-alls gone too."""
    _, block = llama3_8b_block()
    ctx = context(intra_node_half_mib=0.0, intra_node_latency_us=0.0)
    act = 8192 * 4096 * 2 * MB
    cat = 2 * act / (ctx.hw.hbm_gbps * 1e9)
    sp = tp_comm_s(block, MESH, BlockStrategy("full", False, "sp"), MB, ctx)
    batch = tp_comm_s(block, MESH, BlockStrategy("full", False, "sp/sp:batch"), MB, ctx)
    assert batch == pytest.approx(sp - 6 * 2 * cat, rel=1e-9)
    seq = tp_comm_s(block, MESH, BlockStrategy("full", False, "dp/sp"), MB, ctx)
    dp_batch = tp_comm_s(block, MESH, BlockStrategy("full", False, "dp/sp:batch"), MB, ctx)
    assert dp_batch == pytest.approx(batch / 2, rel=1e-9)
    assert dp_batch < seq


@pytest.mark.parametrize("mode", [m for m in SUB_BLOCK_TP_MODES if "dp" in sub_block_modes(m)])
def test_sub_block_fsdp_groups_by_hand(mode):
    """One FSDP group per sub-block: the data-parallel one whole and sharded over
    dp_shard x tp, the TP + SP one split over tp and sharded over dp_shard; each norm travels
    with its module. Gathered bytes (bf16) and the all-gather time (flat bandwidth, no latency:
    the group's (g - 1) / g of the gathered bytes) counted by hand."""
    _, block = llama3_8b_block()
    ctx = context(intra_node_half_mib=0.0, intra_node_latency_us=0.0,
                  inter_node_half_mib=0.0, inter_node_latency_us=0.0)
    dim = 4096
    attn = sum(k * n for name, (k, n) in zip(block.linear_names, block.linear_shapes,
                                             strict=True) if name.startswith("attention."))
    ffn = sum(k * n for name, (k, n) in zip(block.linear_names, block.linear_shapes,
                                            strict=True) if name.startswith("feed_forward."))
    assert attn + ffn + 2 * dim == block.params
    attention_mode, _ = sub_block_modes(mode)
    dp_part, sp_part = (attn + dim, ffn + dim) if attention_mode == "dp" else (ffn + dim,
                                                                             attn + dim)
    cost = fsdp_s(block, MESH, BlockStrategy("none", True, mode), ctx, 0.0)
    assert cost.unsharded_bytes == pytest.approx(2 * (dp_part + sp_part / MESH.tp))
    # dp_shard x tp = 64 ranks span 8 nodes of 8: one ring per rail, 8 members of the 64-rank
    # group on a node; the 8-rank dp_shard group (stride tp) has one member per node
    hw = ctx.hw
    dp_bw = min(hw.intra_node_gbps, 8 * hw.inter_node_gbps) * 1e9
    sp_bw = min(hw.intra_node_gbps, hw.inter_node_gbps) * 1e9
    gather = 63 / 64 * 2 * dp_part / dp_bw + 7 / 8 * 2 * sp_part / MESH.tp / sp_bw
    assert cost.fwd_s == pytest.approx(gather, rel=1e-9)


def test_sub_block_modes_follow_the_tp_dp_rule_in_one_place():
    """The search offers the sub-block modes where whole-block data parallel is legal (the same
    rule, ``tp_dp_problem``, that the plan check applies), on dense models (MoE blocks:
    "sp/dp" and "dp/sp", with etp = 1, and with ep = 1 the ":shared_dp" modes; TorchTitan
    0.2.2's front-end applies the first two), only with
    the technique; sub-block plans keep one FSDP group per sub-block (no units, no node
    reshard)."""
    asked = Constraints(techniques=("fsdp", "tp", "tp_sub_block"))
    assert block_tp_modes(MESH, MB, asked) == ("sp", *SUB_BLOCK_TP_MODES)
    assert block_tp_modes(MESH, MB, Constraints()) == ("sp", "dp")
    assert block_tp_modes(MESH, MB, asked, moe_model=True) == ("sp",)  # its dense blocks
    # with ep 1 the modes that run the shared experts alone data parallel too (offered where
    # the release applies them and the model has shared experts: ``exclusions``)
    assert block_tp_modes(MESH, MB, asked, moe_model=True, experts=True) == (
        "sp", "sp/dp", "dp/sp", "sp/sp:shared_dp", "dp/sp:shared_dp")
    assert block_tp_modes(MESH, 4, asked, moe_model=True, experts=True) == (
        "sp", "sp/dp", "sp/sp:shared_dp")
    assert block_tp_modes(dataclasses.replace(MESH, ep=16), MB, asked, moe_model=True,
                          experts=True) == ("sp", "sp/dp", "dp/sp")
    v0_2 = dataclasses.replace(asked, moe_sub_block_modes=MOE_SUB_BLOCKS_APPLIED)
    assert block_tp_modes(MESH, MB, v0_2, moe_model=True, experts=True) == (
        "sp", "sp/dp", "dp/sp")
    shared = dataclasses.replace(asked, moe_sub_block_modes=("sp/dp",))
    assert block_tp_modes(MESH, MB, shared, moe_model=True, experts=True) == ("sp", "sp/dp")
    assert block_tp_modes(MESH, MB, Constraints(), moe_model=True, experts=True) == ("sp",)
    etp = dataclasses.replace(MESH, ep=16, etp=8)
    assert "etp = 1" in tp_dp_problem(etp, MB, "block", "sp/dp")
    assert block_tp_modes(etp, MB, asked, moe_model=True, experts=True) == ("sp",)
    for mesh, mb, left in ((MESH, 4, ("sp/dp", "sp/sp:a2a", "sp/tp@dp_shard", "sp/sp:rep")),
                           (Mesh(dp_replicate=1, dp_shard=4, tp=8, cp=2), MB, ())):
        assert tp_dp_problem(mesh, mb)
        # "sp/dp" (its feed-forward per token), ":a2a", "tp@dp_shard" and "sp/sp:rep" (TP
        # without SP) split no batch over tp
        assert block_tp_modes(mesh, mb, asked) == ("sp", *left)
    # tp the only dim: whole-block data parallel over it would be FSDP over the same ranks,
    # a sub-block's is not
    tp_only = Mesh(dp_replicate=1, dp_shard=1, tp=8)
    assert "dp_shard > 1" in tp_dp_problem(tp_only, MB)
    assert block_tp_modes(tp_only, MB, Constraints(techniques=(*asked.techniques, "tp_dp"))) \
        == ("sp", *(m for m in SUB_BLOCK_TP_MODES if m != "sp/tp@dp_shard"))
    assert "dp_shard > 1" in tp_dp_problem(tp_only, MB, "block", "sp/tp@dp_shard")
    assert "'dp/sp'" in tp_dp_problem(MESH, 4, "block", "dp/sp")
    wide = Mesh(dp_replicate=1, dp_shard=16, tp=8)
    for mode in SUB_BLOCK_TP_MODES:
        if split_fsdp(mode):  # one FSDP group per sub-block (or none: "tp@dp_shard")
            assert fsdp_unit_problem(MESH, mode)
            assert node_reshard_group(wide, 8, mode) == 0
            assert node_reshard_problem(MESH, mode, 4)
        else:  # both sub-blocks TP: one FSDP group for the block, as TP + SP's
            assert fsdp_unit_problem(MESH, mode) == fsdp_unit_problem(MESH, "sp") == ""
            assert node_reshard_group(wide, 8, mode) == node_reshard_group(wide, 8, "sp")


def test_sub_block_plan_check_and_labels():
    """A plan file's sub-block mode passes the check where legal and names the rule where not;
    its label shows each sub-block's use of the tp dim."""
    from torchtitan_autoparallel.plan.schema import LayerPlan, layer_problem

    layer = LayerPlan("layers.0", "block", "none", True, "dp/sp")
    assert layer_problem(layer, MESH, MB) == ""
    assert "divisible by tp" in layer_problem(layer, MESH, 4)
    cp_mesh = Mesh(dp_replicate=1, dp_shard=4, tp=8, cp=2)
    assert "cp = 1" in layer_problem(layer, cp_mesh, MB)
    assert layer.describe() == "fsdp+attn:tp_dp/ffn:tp+sp"
    assert LayerPlan("layers.0", "block", "full", False, "sp/dp").describe() == \
        "fsdp-keep+attn:tp+sp/ffn:tp_dp+ac:full"


def test_sub_block_stream_rule_labels_and_explain(tmp_path):
    """A plan file mixing the batch-sharded stream with the sequence-sharded one is refused in
    one line naming both modes; the new modes' labels say what they do, and explain says why a
    uniform plan of them has no TorchTitan degrees."""
    from torchtitan_autoparallel.commands.explain import snippet
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.plan.schema import LayerPlan
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    plan = plan_job(parse_config(["--job.config_file", "train_configs/llama3_debug_auto.toml",
                                  "--parallelism.tensor_parallel_degree=2",
                                  "--parallelism.data_parallel_shard_degree=2",
                                  "--training.global_batch_size=8", TECHNIQUES]), 4)
    plan.local_batch_size, plan.gradient_accumulation_steps = 2, 2
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    for layer in blocks:
        layer.tp_mode, layer.fsdp_unit = "sp/sp:a2a", 1
    assert "output projection whole on the sequence shard" in snippet(plan)
    for layer in blocks:
        layer.tp_mode = "dp/sp:batch"
    assert "residual stream sharded on the batch" in snippet(plan)
    blocks[1].tp_mode = "dp/sp"
    path = tmp_path / "mixed.json"
    with pytest.raises(UserError, match=r"tp_mode 'dp/sp:batch' keeps the residual stream "
                                        r"sharded on the batch and 'dp/sp' sharded on the "
                                        r"sequence"):
        plan.save(str(path))
    assert not path.exists()
    embedding = next(layer for layer in plan.layers if layer.kind == "embedding")
    embedding.tp_mode = "sp"  # TorchTitan's, where the search looked it up on its dim
    for layer in blocks:
        layer.tp_mode = "sp/sp:rep"
    assert "tensor parallel without sequence parallel" in snippet(plan)
    blocks[0].tp_mode = "sp"
    with pytest.raises(UserError, match=r"tp_mode 'sp' keeps the residual stream sharded on "
                                        r"the sequence and 'sp/sp:rep' whole on every tp rank"):
        plan.save(str(path))
    blocks[0].tp_mode = "dp/sp:rep"
    embedding.tp_mode = "dim"
    with pytest.raises(UserError, match=r"the residual stream is whole on every tp rank and the "
                                        r"embedding's 'dim' leaves its output on a shard"):
        plan.save(str(path))
    assert not path.exists()
    assert LayerPlan("layers.0", "block", "none", True, "dp/sp:batch").describe() == \
        "fsdp+attn:tp_dp/ffn:tp+stream:batch"
    assert LayerPlan("layers.0", "block", "none", True, "sp/dp:rep").describe() == \
        "fsdp+attn:tp/ffn:tp_dp+stream:replicated"
    assert LayerPlan("layers.0", "block", "none", True, "sp/sp:a2a").describe() == \
        "fsdp+attn:tp+a2a/ffn:tp+sp"


def test_sub_block_block_cost_sums_its_parts():
    """``block_cost`` of a sub-block mode charges ``tp_comm_s`` as its TP time, and llama3's
    adapter names the sub-blocks the modes parallelize apart (attention first)."""
    graph, block = llama3_8b_block()
    ctx = context()
    mesh = Mesh(dp_replicate=1, dp_shard=2, tp=4)
    for mode in SUB_BLOCK_TP_MODES:
        s = BlockStrategy("selective", True, mode)
        cost = block_cost(block, mesh, s, 4, ctx)
        assert dict(cost.exposed_parts)["tp"] == pytest.approx(tp_comm_s(block, mesh, s, 4, ctx))
    assert graph.adapter.sub_blocks == (("attention_norm", "attention"),
                                        ("ffn_norm", "feed_forward"))



class _Block(torch.nn.Module):
    """Two (norm, linear) pairs wired as ``wiring`` says: "pre" (x + f(norm(x)), each module
    from its own norm), "post" (norm(x + f(x))) or "parallel" (both modules read one norm)."""

    def __init__(self, wiring: str):
        super().__init__()
        self.wiring = wiring
        self.norm_a, self.mix = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)
        self.norm_b, self.ffn = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

    def forward(self, x):
        if self.wiring == "pre":
            x = x + self.mix(self.norm_a(x))
            return x + self.ffn(self.norm_b(x))
        if self.wiring == "post":
            x = self.norm_a(x + self.mix(x))
            return self.norm_b(x + self.ffn(x))
        a = self.norm_a(x)
        return x + self.mix(a) + self.ffn(a) + 0 * self.norm_b(x)


@pytest.mark.parametrize("wiring,found", [("pre", True), ("post", False), ("parallel", False)])
def test_sub_block_wiring_rule_on_hand_built_blocks(wiring, found):
    """A block shows sub-blocks only where each module reads its own norm's output (pre-norm):
    post-norm blocks and blocks whose modules share one norm show none."""
    with torch.device("meta"):
        block = _Block(wiring)
    inputs = ((torch.empty(1, 4, 8, device="meta"),), {})
    pairs = pre_norm_pairs(block, {"mix", "ffn"}, inputs)
    assert pairs == ((("norm_a", "mix"), ("norm_b", "ffn")) if found else ())


def test_sub_block_discovery_finds_what_llama3_registers():
    """llama3's registration names its sub-blocks; with them removed, they are found again
    from its graph (the inferred TP plan's regions after their norms, wired pre-norm)."""
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_autoparallel.graph.layer_graph import planning_model
    from torchtitan_autoparallel.titan.v0_2.model import measurable_args, meta_model
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    spec = get_train_spec("llama3")
    args, _ = measurable_args(spec.model_args["debugmodel"], 64)
    model = meta_model(lambda: spec.model_cls(args))
    adapter, inputs = planning_model("llama3", model, 64)
    registered = adapter.sub_blocks
    assert registered == (("attention_norm", "attention"), ("ffn_norm", "feed_forward"))
    found = with_found_sub_blocks(dataclasses.replace(adapter, sub_blocks=()), model, inputs,
                                  args.dim, 64)
    assert found.sub_blocks == registered


def test_sub_block_moe_attention_dp_for_the_families_it_runs():
    """On 0.2.2 a MoE block's data-parallel attention ("dp/sp") is offered to deepseek_v3's MoE
    blocks (the apply hands TorchTitan's apply_non_moe_tp the block without its attention);
    a family that does not list it (here deepseek_v3's blocks under an adapter without it,
    as an unregistered MoE model's) is offered "sp/dp" alone, and a plan's "dp/sp" there
    stops in one line; "sp/dp" splits a MoE block into its MoE and the rest."""
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_autoparallel.candidates.exclusions import without_excluded
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.graph.layer_graph import planning_model
    from torchtitan_autoparallel.titan.v0_2 import read_model
    from torchtitan_autoparallel.titan.v0_2.model import measurable_args, meta_model
    from torchtitan_autoparallel.titan.v0_2.registry import register
    from torchtitan_autoparallel.titan.v0_2.tp_dp import sub_blocks_of

    register()
    spec = get_train_spec("deepseek_v3")
    args, _ = measurable_args(spec.model_args["debugmodel"], 64)
    model = meta_model(lambda: spec.model_cls(args))
    adapter, _ = planning_model("deepseek_v3", model, 64)
    block = model.layers["1"]
    attention, rest = sub_blocks_of(block, adapter, "dp/sp")
    assert attention == ("dp", [block.attention_norm, block.attention])
    assert rest[0] == "sp" and block.moe in rest[1] and block.attention not in rest[1]
    assert [mode for mode, _ in sub_blocks_of(block, adapter, "sp/dp")] == ["sp", "dp"]
    other = dataclasses.replace(adapter, moe_sub_block_modes=None)
    with pytest.raises(UserError, match="applied to deepseek_v3, qwen3, llama4 only"):
        sub_blocks_of(block, other, "dp/sp")
    # 0.2.2's MoE TP scatters the MoE's output once: the shared experts apart (0.3.0's
    # ":shared_dp" modes) save nothing there, and a plan file's stops in one line
    for mode, words in (("sp/sp:shared_dp", "MoE blocks take 'sp' or 'sp/dp', 'dp/sp'"),
                        ("dp/sp:shared_dp", "MoE blocks take")):
        with pytest.raises(UserError, match=words):
            sub_blocks_of(block, adapter, mode)
    with pytest.raises(UserError, match="is a MoE block's"):
        sub_blocks_of(model.layers["0"], adapter, "sp/sp:shared_dp")
    asked = Constraints(techniques=("fsdp", "tp", "tp_sub_block"),
                        moe_sub_block_modes=MOE_SUB_BLOCKS_APPLIED)
    graph = read_model("deepseek_v3", "debugmodel", 64)
    assert without_excluded(asked, graph, 8).moe_sub_block_modes == ("sp/dp", "dp/sp")
    unlisted = dataclasses.replace(graph, adapter=other)
    assert without_excluded(asked, unlisted, 8).moe_sub_block_modes == ("sp/dp",)


TECHNIQUES = "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac,tp_sub_block"


def sub_block_plan_parity(references, tmp_path, modes: list[str], acs: list[str],
                          reshard: list[bool], ranks: int = 4, expect: str = "",
                          embedding: str = "", tp: int = 2, family: str = "llama3",
                          options: tuple[str, ...] = ()) -> float:
    """``family``'s debug plan on fsdp 2 x tp 2 (4 CPU ranks; on 2 ranks tp 2 alone; more
    ``options`` where given), its blocks edited to the given tp modes, AC and resharding
    (cycled), its embedding to ``embedding`` where given, saved and replayed from the file:
    losses and gradient norms against the 1-rank run from the same seed checkpoint (``tp`` 1:
    fsdp over every rank)."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.plan.schema import Plan
    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    from tests.support.parity import PARITY_OVERRIDES, assert_parity, run_job

    cpu.install()
    register()
    config = f"{family}_debug_auto.toml"
    options = [f"--parallelism.tensor_parallel_degree={tp}",
               f"--parallelism.data_parallel_shard_degree={ranks // tp}", TECHNIQUES, *options]
    plan = plan_job(parse_config(["--job.config_file", f"train_configs/{config}",
                                  *PARITY_OVERRIDES, *options]), ranks)
    assert (plan.mesh.dp_shard, plan.mesh.tp) == (ranks // tp, tp)
    plan.local_batch_size = 2  # the tp ranks split it
    plan.gradient_accumulation_steps = plan.global_batch_size // (2 * plan.mesh.dp)
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    for i, layer in enumerate(blocks):
        layer.tp_mode = modes[i % len(modes)]
        layer.ac = acs[i % len(acs)]
        layer.reshard_after_forward = reshard[i % len(reshard)]
        layer.fsdp_unit = 1
    # the embedding as asked (the search with tp_sub_block may pick either mode)
    layer = next(layer for layer in plan.layers if layer.kind == "embedding")
    layer.tp_mode, layer.reshard_after_forward = embedding or ("sp" if tp > 1 else "none"), \
        not embedding
    path = tmp_path / "sub_block.json"
    plan.save(str(path))
    assert Plan.load(str(path)).to_json() == plan.to_json()

    seed, reference = references(family)
    result = run_job(config, ranks, tmp_path / "run",
                     [f"--autoparallel.plan_file={path}", *options], seed_checkpoint=seed)
    for mode in set(modes) - {"none"}:
        label = BlockStrategy("none", True, mode).describe().split("+", 1)[1]
        assert label in result.output, result.output[-3000:]
    assert expect in result.output, result.output[-3000:]  # what the apply logs it ran
    assert ("looked up on its embedding dim" in result.output) == bool(embedding), \
        result.output[-3000:]
    worst = assert_parity(reference, result)
    print(f"{modes} {acs} {reshard}: largest relative difference {worst:.2e}; losses "
          f"{result.losses} vs 1-rank {reference.losses}")
    return worst


def test_sub_block_mixed_plan_parity(references, tmp_path):
    """Blocks alternating data-parallel attention + TP + SP feed-forward and the reverse, one
    fully checkpointed, one keeping its parameters, the embedding's columns split over fsdp
    and its rows gathered over tp for the lookup of each tp rank's sequence shard: 1-rank
    losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["dp/sp", "sp/dp"], ["none", "none", "full"],
                          [True, False], embedding="dim:gather")


def test_sub_block_two_rank_parity(references, tmp_path):
    """On 2 ranks (tp 2, no dp_shard) the data-parallel sub-blocks are sharded over tp and the
    TP + SP ones are TorchTitan's TP alone: 1-rank losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["dp/sp", "sp/dp"], ["none", "full"],
                          [True, False], ranks=2)


@pytest.mark.parametrize("embedding", ["dim", "dim:gather"])
def test_sub_block_batch_stream_parity(references, tmp_path, embedding):
    """The stream sharded on the batch over tp (AutoParallel's 70B layout): data-parallel
    attention with no all-to-all beside a TP feed-forward that gathers and scatters the batch,
    the reverse, and both sub-blocks TP on the batch, one block fully checkpointed, the
    embedding looked up on its embedding dim (over fsdp x tp: AutoParallel's 70B on 64 GPUs; or
    over fsdp, its table gathered over tp: on 256) and moved onto the batch shards: 1-rank
    losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["dp/sp:batch", "sp/dp:batch", "sp/sp:batch"],
                          ["none", "full"], [True, False], embedding=embedding)


def test_sub_block_replicated_stream_parity(references, tmp_path):
    """Tensor parallel without sequence parallel (the stream whole on every tp rank):
    TorchTitan's TP without SP, a data-parallel attention on a batch shard beside a TP
    feed-forward, and the reverse, one block fully checkpointed, one keeping its parameters:
    1-rank losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["sp/sp:rep", "dp/sp:rep", "sp/dp:rep"],
                          ["none", "full"], [True, False],
                          expect="tensor parallel without sequence parallel")


def test_sub_block_a2a_parity(references, tmp_path):
    """The attention's output projection on the sequence shard (AutoParallel's 8B layout: wo's
    input through an all-to-all from the heads, its weight whole over fsdp x tp; the embedding
    looked up on its embedding dim) beside TP + SP and data-parallel-attention blocks, one fully
    checkpointed: 1-rank losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["sp/sp:a2a", "sp", "dp/sp"], ["none", "full"],
                          [True, False], expect="blocks run attention.wo on the sequence shard",
                          embedding="dim")


@pytest.mark.parametrize("tp", [2, 1])
def test_sub_block_embedding_dim_two_rank_parity(references, tmp_path, tp):
    """The embedding looked up on its embedding dim on 2 ranks: over tp alone (the ranks'
    token ids the same, no FSDP) and over dp_shard alone (FSDP blocks beside it): 1-rank losses
    and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["sp" if tp > 1 else "none"], ["none", "full"],
                          [tp == 1], ranks=2, embedding="dim", tp=tp)


def test_sub_block_dp_shard_tp_parity(references, tmp_path):
    """The feed-forward tensor parallel over fsdp (2 ranks), its weights gathered over tp,
    beside TP + SP attention on tp (AutoParallel's Llama 3 8B placement on 8 GPUs, its
    embedding looked up on its embedding dim too), next to TP + SP blocks, one fully
    checkpointed: 1-rank losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["sp/tp@dp_shard", "sp"], ["none", "full"],
                          [True, False], embedding="dim",
                          expect="blocks run feed_forward tensor parallel over dp_shard")


# slow (measured passing: largest relative difference 8.75e-05; ``-m slow`` runs it): the
# batch-sharded stream on 2 ranks is also trained by tests/test_own_model.py's discovered-model
# sub-block parity (tp 2 alone)
@pytest.mark.slow
def test_sub_block_batch_stream_two_rank_parity(references, tmp_path):
    """The same on 2 ranks (tp 2 alone): 1-rank losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["dp/sp:batch", "sp/dp:batch"], ["none"],
                          [True], ranks=2)


# slow (measured passing: largest relative difference 1.11e-04, a gradient norm; ``-m slow``
# runs it): a second 4-rank run, out of the CI command for time
@pytest.mark.slow
def test_sub_block_autoparallel_layout_parity(references, tmp_path):
    """Every block with AutoParallel's layout (data-parallel attention beside a TP + SP
    feed-forward) under selective AC, next to whole-block TP + SP and tp-as-data-parallel
    blocks: 1-rank losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["dp/sp", "dp/sp", "sp", "dp"],
                          ["selective"], [True])


def test_sub_block_moe_two_rank_parity(references, tmp_path):
    """deepseek_v3 on tp 2 alone (2 ranks): MoE blocks whose MoE runs data parallel over tp on
    each rank's sequence shard ("sp/dp": its router and shared experts sharded over tp, its
    experts whole on each rank, the load-balancing token counts summed over tp), MoE blocks
    whose attention (MLA) runs data parallel over tp on a batch shard ("dp/sp": the rest
    TorchTitan's TP + SP and MoE TP) beside MoE blocks under TorchTitan's MoE TP and the
    dense first block TP + SP, some fully checkpointed: 1-rank losses and gradient norms
    (the routing's expert bias updated from the counts each step)."""
    sub_block_plan_parity(references, tmp_path, ["sp", "sp/dp", "dp/sp"], ["none", "full"],
                          [False], ranks=2, family="deepseek_v3",
                          expect="MoE blocks run their attention data parallel over tp")


# slow (measured passing: largest relative difference 4.77e-05; ``-m slow`` runs it): a 4-rank
# run, out of the CI command for time (its 2-rank twin above runs there)
@pytest.mark.slow
def test_sub_block_moe_expert_parallel_parity(references, tmp_path):
    """deepseek_v3 on fsdp 2 x tp 2 with ep 4 (etp 1, 4 ranks): "sp/dp" MoE blocks dispatch
    each tp rank's own tokens to the experts over ep, their router and shared experts sharded
    over fsdp x tp, the experts over ep, beside MoE blocks under TorchTitan's MoE TP (tokens
    split over tp by its reorderer), and "dp/sp" MoE blocks (the attention on a batch shard,
    the MoE under TorchTitan's MoE TP and EP): 1-rank losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["sp", "sp/dp", "dp/sp"], ["none", "full"],
                          [True, False], family="deepseek_v3",
                          options=("--parallelism.expert_parallel_degree=4",),
                          expect="MoE blocks run their attention data parallel over tp")


EMBEDDING_ASKED = Constraints(techniques=("fsdp", "tp", "ac", "tp_sub_block"))


def test_sub_block_embedding_dim_collectives_by_hand():
    """The embedding looked up on its embedding dim (AutoParallel's Llama 3 embedding) on
    fsdp 8 x tp 8 of 8-GPU nodes, one 8192-token sequence per rank: no FSDP collective; the
    64 ranks' int64 token ids all-gathered over all 64 ranks (spanning 8 nodes, a rail per
    rank), then two all-to-alls over the 64 ranks (forward, and its gradient in backward) of
    each rank's stream shard (1024 tokens x 4096 bf16); it keeps the 8 dp_shard ranks' ids
    for its backward, and holds the same training state as the default embedding, which
    gathers the table's tp-th (128256 x 4096 / 8, bf16) over dp_shard instead."""
    from torchtitan_autoparallel.cost.common import collective_s
    from torchtitan_autoparallel.cost.model import edge_cost

    graph, _ = llama3_8b_block()
    embedding = graph.edges[0]
    ctx = context()
    dim = BlockStrategy("none", False, "dim")
    assert fsdp_s(embedding, MESH, dim, ctx, 0.0) == (0.0, 0.0, 0.0, 0.0, 0.0)
    ids = collective_s("all_gather", 8192 * 8 * 64, 64, True, ctx.hw, rails=8)
    a2a = collective_s("all_to_all", 1024 * 4096 * 2, 64, True, ctx.hw, rails=8)
    assert tp_comm_s(embedding, MESH, dim, 1, ctx) == pytest.approx(ids + 2 * a2a, rel=1e-12)
    default = fsdp_s(embedding, MESH, BlockStrategy("none", True, "sp"), ctx, 0.0)
    assert default.unsharded_bytes == pytest.approx(128256 * 4096 * 2 / 8)
    ours, theirs = (edge_cost(graph, embedding, MESH, 1, ctx, mode) for mode in ("dim", ""))
    assert ours.kept_bytes == 8192 * 8 * 8
    assert ours.state_bytes == theirs.state_bytes
    assert ours.time_s < theirs.time_s


def test_sub_block_embedding_dim_gather_collectives_by_hand():
    """The embedding's columns split over fsdp 8 and its rows over tp 8, gathered over tp
    (AutoParallel's Llama 3 70B embedding on 256 GPUs), one sequence per fsdp rank: the
    table's 8th gathered over tp inside the node in forward (bf16) and its gradient
    reduce-scattered back (fp32); each tp rank's 1024 tokens of each of the 8 fsdp ranks
    all-gathered over fsdp (8 ranks, one per node: one rail), then the two all-to-alls over
    fsdp of its stream shard; it keeps the 8 x 1024 ids it looked up."""
    from torchtitan_autoparallel.cost.common import collective_s
    from torchtitan_autoparallel.cost.model import edge_cost

    graph, _ = llama3_8b_block()
    embedding = graph.edges[0]
    ctx = context()
    gather = BlockStrategy("none", False, "dim:gather")
    table = 128256 * 4096 / 8
    got = fsdp_s(embedding, MESH, gather, ctx, 0.0)
    assert got.fwd_s == collective_s("all_gather", table * 2, 8, False, ctx.hw)
    assert got.bwd_s == collective_s("reduce_scatter", table * 4, 8, False, ctx.hw)
    assert got.unsharded_bytes == table * 2
    ids = collective_s("all_gather", 1024 * 8 * 8, 8, True, ctx.hw, rails=1)
    a2a = collective_s("all_to_all", 1024 * 4096 * 2, 8, True, ctx.hw, rails=1)
    assert tp_comm_s(embedding, MESH, gather, 1, ctx) == pytest.approx(ids + 2 * a2a,
                                                                       rel=1e-12)
    assert edge_cost(graph, embedding, MESH, 1, ctx, "dim:gather").kept_bytes == 1024 * 8 * 8


def test_sub_block_embedding_dim_legal_in_one_place():
    """The search offers the lookup on the embedding dim only with tp_sub_block, on one
    dp_shard x tp group (no cp, replication or pp) that splits the embedding dim, and not where
    the output shares the embedding's weight; a plan file's embedding passes the same rule and
    no other layer may take the mode."""
    from torchtitan_autoparallel.candidates.layout import embedding_dim_problem
    from torchtitan_autoparallel.candidates.strategies import (
        embedding_dim_refused,
        embedding_modes,
    )
    from torchtitan_autoparallel.plan.schema import LayerPlan, layer_problem

    graph, _ = llama3_8b_block()
    assert embedding_modes(graph, MESH, EMBEDDING_ASKED) == ("", "dim", "dim:gather")
    assert embedding_modes(graph, Mesh(dp_replicate=1, dp_shard=8, tp=1), EMBEDDING_ASKED) == \
        ("", "dim")
    assert "tp_sub_block" in embedding_dim_refused(graph, MESH, Constraints(), "dim")
    assert "dp_shard > 1 and tp > 1" in embedding_dim_refused(
        graph, Mesh(dp_replicate=1, dp_shard=1, tp=8), EMBEDDING_ASKED, "dim:gather")
    assert "vocabulary (128256) divisible by tp (5)" in embedding_dim_problem(
        Mesh(dp_replicate=1, dp_shard=8, tp=5), 4096, 128256, "dim:gather")
    for mesh in (Mesh(dp_replicate=2, dp_shard=4, tp=8), Mesh(dp_replicate=1, dp_shard=4, tp=8,
                                                              cp=2),
                 Mesh(dp_replicate=1, dp_shard=4, tp=8, pp=2)):
        assert "pp = 1, dp_replicate = 1 and cp = 1" in embedding_dim_refused(
            graph, mesh, EMBEDDING_ASKED, "dim")
    odd = Mesh(dp_replicate=1, dp_shard=3, tp=8)  # 4096 is not a multiple of 24
    assert "divisible by dp_shard x tp (24)" in embedding_dim_refused(graph, odd,
                                                                      EMBEDDING_ASKED, "dim")
    output = graph.layers[-1]
    tied = dataclasses.replace(graph, layers=(*graph.layers[:-1], dataclasses.replace(
        output, params=output.params - graph.dim * graph.vocab_size)))
    assert "tied output weights" in embedding_dim_refused(tied, MESH, EMBEDDING_ASKED, "dim")
    layer = LayerPlan("tok_embeddings", "embedding", "none", False, "dim")
    assert layer_problem(layer, MESH, 1) == ""
    assert "cp = 1" in layer_problem(layer, Mesh(dp_replicate=1, dp_shard=4, tp=8, cp=2), 1)
    assert "embedding's alone" in layer_problem(
        LayerPlan("layers.0", "block", "none", True, "dim"), MESH, 1)
    assert layer.describe() == "dim-shard+a2a"
    assert LayerPlan("tok_embeddings", "embedding", "none", False, "dim:gather").describe() == \
        "dim-shard+tp-gather+a2a"


def test_sub_block_embedding_dim_search_takes_the_faster_mode():
    """Llama 3 8B on fsdp 8 x tp 8 (AutoParallel's 8B@64 mesh): each embedding mode's
    candidate solved alone by the MILP; the search with tp_sub_block returns the faster one
    (the lookup on the embedding dim, which drops the table's FSDP collectives), the default
    search the default embedding."""
    from torchtitan_autoparallel.candidates.candidate import build_candidate
    from torchtitan_autoparallel.job.request import plan_job, read_request
    from torchtitan_autoparallel.solve.milp import solve
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    def config(*extra: str):
        return parse_config(["--job.config_file", "train_configs/llama3_8b_auto.toml",
                             "--training.global_batch_size=8",
                             "--parallelism.data_parallel_shard_degree=8",
                             "--parallelism.tensor_parallel_degree=8", *extra])

    llama3_8b_block()  # registers the families
    asked = config(TECHNIQUES)
    inputs = read_request(asked, 64).inputs
    steps = {}
    for mode in ("", "dim"):
        cand = build_candidate(inputs.graph, MESH, 1, 8, inputs.cost_context,
                               inputs.constraints, inputs.pins, embedding=mode)
        steps[mode] = solve(cand, inputs.budget_bytes, 60.0).step_time_s
    assert steps["dim"] < steps[""]
    plan = plan_job(asked, 64)
    assert plan.embedding_mode == "dim"
    assert plan.predicted["step_time_s"] == pytest.approx(steps["dim"], rel=1e-9)
    assert plan_job(config(), 64).embedding_mode == ""


def test_sub_block_a2a_left_out_under_float8_with_a_note():
    """Under float8 linears the search leaves 'sp/sp:a2a' and 'sp/tp@dp_shard' out (their own
    linears run as plain linears) and the plan says so; with bf16 linears it says nothing."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    llama3_8b_block()  # registers the families

    def plan(*extra: str):
        return plan_job(parse_config([
            "--job.config_file", "train_configs/llama3_8b_auto.toml",
            "--autoparallel.hardware=h100_sxm", "--parallelism.tensor_parallel_degree=2",
            "--autoparallel.techniques=fsdp,tp,ac,tp_sub_block", *extra]), 16)

    low = plan("--model.converters=quantize.linear.float8")
    assert not {"sp/sp:a2a", "sp/tp@dp_shard"} & {layer.tp_mode for layer in low.layers}
    assert "autoparallel.techniques: tp_sub_block searched without 'sp/sp:a2a', " \
        "'sp/tp@dp_shard': they run their own linears (the attention output projection, the " \
        "feed-forward over dp_shard) as plain linears, not float8_tensorwise ones" in low.notes
    assert not any("searched without" in note for note in plan().notes)


def test_sub_block_dp_shard_tp_weights_by_hand():
    """"sp/tp@dp_shard" on fsdp 8 x tp 8 of 8-GPU nodes: the attention (and its norm) is one
    FSDP group, split over tp and gathered over dp_shard (8 ranks, one per node), gathered
    again in backward after resharding; the feed-forward (and its norm) is in no FSDP group:
    its dp_shard-th, bf16, all-gathered over tp inside the node in forward and its fp32
    gradient reduce-scattered back; that gathered dp_shard-th is kept for backward."""
    from torchtitan_autoparallel.cost.comm import dp_shard_tp_weight_bytes, sub_block_params
    from torchtitan_autoparallel.cost.common import collective_s

    _, block = llama3_8b_block()
    ctx = context()
    attention, ffn = sub_block_params(block)
    strategy = BlockStrategy("none", True, "sp/tp@dp_shard")
    got = fsdp_s(block, MESH, strategy, ctx, 0.0)
    gather = collective_s("all_gather", attention * 2 / 8, 8, True, ctx.hw, 1)
    own = collective_s("all_gather", ffn * 2 / 8, 8, False, ctx.hw)
    assert got.fwd_s == pytest.approx(gather + own, rel=1e-12)
    assert got.bwd_s == pytest.approx(
        gather + collective_s("reduce_scatter", attention * 4 / 8, 8, True, ctx.hw, 1)
        + collective_s("reduce_scatter", ffn * 4 / 8, 8, False, ctx.hw), rel=1e-12)
    assert got.unsharded_bytes == pytest.approx(attention * 2 / 8)
    assert dp_shard_tp_weight_bytes(block, MESH, strategy, 2) == ffn * 2 / 8
    assert ffn > 2 * attention  # Llama 3 8B: 176 M against 42 M parameters per block


def _moe_counts_worker(rank: int, out_dir: str) -> None:
    """One of 2 gloo ranks: TorchTitan's MoE on this rank's sequence shard of a batch (tp 2,
    ``moe_on_sequence_shard``) beside the same MoE on the whole batch."""
    import copy
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.tp_dp import moe_on_sequence_shard

    cpu.install()  # TorchTitan's MoE on CPU (its histc of expert indices)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # the same model and batch on both ranks
    moe = MoE(MoEArgs(num_experts=8, top_k=2, use_grouped_mm=False), dim=16, hidden_dim=32)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))
    x = torch.randn(2, 24, 16)
    whole = copy.deepcopy(moe)
    expected = whole(x).chunk(2, dim=1)[rank]
    block = torch.nn.Module()
    block.moe = moe
    moe_on_sequence_shard(block, SimpleNamespace(moe="moe"), mesh)
    got = block.moe(x.chunk(2, dim=1)[rank].contiguous())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "output": (got - expected).abs().max().item(),
        "counts": moe.tokens_per_expert.tolist(),
        "whole_counts": whole.tokens_per_expert.tolist()}))


def test_sub_block_moe_counts_tokens_over_tp(tmp_path):
    """A MoE run data parallel over tp ("sp/dp") on each of 2 ranks' sequence shards gives the
    whole batch's outputs on its shard, and its load-balancing token counts are those of the
    same MoE run on the whole batch on 1 rank (each rank routes half the tokens; summed over
    tp, both ranks update their expert bias alike)."""
    import json

    from tests.support.gloo import spawn

    spawn(_moe_counts_worker, tmp_path)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["output"] < 1e-6
        assert report["counts"] == report["whole_counts"]
        assert sum(report["counts"]) == 2 * 24 * 2  # every token's top-2 experts, once


def test_sub_block_moe_routing_pins():
    """The family's default pin of MoE routing leaves a MoE block "sp/dp" (TorchTitan's routing
    and dispatch code runs in it, on each tp rank's tokens), "dp/sp" (the MoE as
    TorchTitan's MoE TP runs it) and the ":shared_dp" modes (its routing too); the same
    region pinned by the user keeps TorchTitan's MoE TP ("sp" only), as any pinned region
    inside a block does."""
    from torchtitan_autoparallel.candidates.strategies import pinned_strategies
    from torchtitan_autoparallel.job.pins import Pin

    asked = Constraints(techniques=("fsdp", "tp", "tp_sub_block"))

    def modes(pin):
        return {s.tp_mode for s in pinned_strategies(MESH, MB, asked, True, pin, 8, 1, True)}

    assert modes(None) == modes(Pin(regions=("moe.router",), defaults_only=True)) \
        == {"sp", "sp/dp", "dp/sp", "sp/sp:shared_dp", "dp/sp:shared_dp"}
    assert modes(Pin(regions=("moe.router",))) == {"sp"}
    assert Pin(regions=("moe.router",)).key != Pin(regions=("moe.router",),
                                                  defaults_only=True).key


# slow (measured passing: largest relative difference 8.73e-05; ``-m slow`` runs it): a second
# MoE family, out of the CI command for time
@pytest.mark.slow
def test_sub_block_moe_llama4_two_rank_parity(references, tmp_path):
    """llama4 (dense and MoE blocks interleaved, scores applied before the experts) on tp 2
    alone (its inferred TP plan): MoE blocks alternating "sp/dp" and "dp/sp" (the rest of the
    block from the inferred plan), half of them fully checkpointed, its dense blocks TP + SP:
    1-rank losses and gradient norms."""
    sub_block_plan_parity(references, tmp_path, ["sp", "sp/dp", "sp", "dp/sp"],
                          ["none", "none", "full", "full"], [False], ranks=2, family="llama4",
                          expect="MoE blocks run their attention data parallel over tp")
