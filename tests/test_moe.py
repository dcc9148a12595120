"""MoE planning: layer graph of MoE blocks, TorchTitan's ep / etp rules, pins, and plans with
expert parallel as artifacts (JSON round trip, explain)."""

import pytest

from torchtitan_autoparallel.candidates.layout import Mesh
from torchtitan_autoparallel.candidates.strategies import Constraints, legal_ep, pinned_strategies
from torchtitan_autoparallel.job.pins import Pin, recipe_block_ac
from torchtitan_autoparallel.plan.schema import Plan


@pytest.fixture(scope="module")
def planning():
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()

    def plan(config: str, world: int, *overrides: str) -> Plan:
        job = parse_config(["--job.config_file", f"train_configs/{config}", *overrides])
        return plan_job(job, world)

    return plan


def test_layer_graph_of_hybrid_moe_model():
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_autoparallel.titan.v0_2.model import build_layer_graph
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    spec = get_train_spec("deepseek_v3")
    graph = build_layer_graph("deepseek_v3", "debugmodel", spec.model_args["debugmodel"],
                              spec.model_cls, 256)
    dense, moe = graph.blocks[0], graph.blocks[1]
    assert dense.expert_params == 0 and dense.num_experts == 0
    # 8 experts x (w1, w2, w3) of 256 x 256, top-3 routing
    assert moe.expert_params == 8 * 3 * 256 * 256 and moe.top_k == 3 and moe.num_experts == 8
    assert moe.expert_flops == pytest.approx(2.0 * 256 * 3 * 3 * 256 * 256)
    assert moe.expert_flops < moe.fwd_flops
    assert len({b.signature for b in graph.blocks}) == 2
    assert graph.num_experts == 8 and "layers.1.moe.router" in graph.module_names
    # flex-attention flavors keep their kernel name (CP legality) but are measured as SDPA
    big = build_layer_graph("deepseek_v3", "16B", spec.model_args["16B"], spec.model_cls, 512)
    assert big.attn_type == "flex" and big.blocks[1].attn_flops > 0


def test_ep_follows_torchtitan_rules():
    # etp = tp: ep divides dp_shard x cp; etp = 1: ep = k x tp (ep takes all of tp)
    assert legal_ep(8, dp_shard=2, cp=1, tp=2) == [(2, 1), (2, 2), (4, 1)]
    assert legal_ep(8, dp_shard=4, cp=1, tp=1) == [(2, 1), (4, 1)]
    assert legal_ep(6, dp_shard=4, cp=1, tp=1) == [(2, 1)]  # ep must divide the experts
    assert legal_ep(8, dp_shard=1, cp=1, tp=4) == []  # TorchTitan needs FSDP beside EP
    assert Mesh(dp_replicate=1, dp_shard=4, tp=2, ep=4).efsdp == 2


def test_pins_fix_or_restrict_strategies():
    mesh, constraints = Mesh(dp_replicate=1, dp_shard=2, tp=2), Constraints()
    free = pinned_strategies(mesh, 4, constraints, False, None)
    assert any(s.tp_mode == "dp" for s in free)
    region = pinned_strategies(mesh, 4, constraints, False, Pin(regions=("attention",)))
    assert region and all(s.tp_mode == "sp" for s in region)
    assert len(region) == len(free) // 2
    (whole,) = pinned_strategies(mesh, 4, constraints, False, Pin("full", True))
    assert (whole.ac, whole.reshard_after_forward, whole.tp_mode) == ("full", True, "sp")
    assert [recipe_block_ac("selective", "2", i) for i in range(4)] == [
        "none", "full", "none", "full"]


def test_llama4_17bx16e_picks_expert_parallel_on_128_h100s(planning):
    """Top-1 routing over 16 experts: dispatching tokens is cheaper than all-gathering every
    expert of every block, so the planner turns EP on by itself."""
    plan = planning("llama4_17bx16e_auto.toml", 128)
    assert plan.mesh.ep > 1
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    assert all(layer.ep == plan.mesh.ep for layer in blocks)
    assert plan.solver["gap"] == 0.0
    assert plan.predicted["peak_memory_gib"] <= plan.predicted["budget_gib"]


def test_pinned_moe_plan_round_trip_and_explain(planning, tmp_path):
    from torchtitan_autoparallel.commands.explain import explain_rows

    plan = planning("deepseek_v3_debug_auto.toml", 4, "--parallelism.expert_parallel_degree=2",
                    "--autoparallel.pin=layers.1", "--activation_checkpoint.mode=selective",
                    "--activation_checkpoint.selective_ac_option=op")
    assert plan.mesh.ep == 2
    layers = {layer.fqn: layer for layer in plan.layers}
    assert layers["layers.1"].pinned and layers["layers.1"].ac == "selective"
    assert layers["layers.1"].ep == 2 and layers["layers.0"].ep == 1
    assert "+ep2+ac:selective+pinned" in plan.table()
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = Plan.load(str(path))
    assert loaded.digest() == plan.digest() and loaded.mesh == plan.mesh
    rows = {row["layer"]: row for row in explain_rows(loaded)}
    assert rows["layers.1"]["runner_up"] is None  # pinned: TorchTitan's recipe, no choice
    assert rows["layers.2"]["runner_up"] is not None


def test_looped_experts_run_plain_gemms_with_a_host_sync_and_ep_splits_them():
    import dataclasses

    from torchtitan_autoparallel.candidates.layout import BlockStrategy
    from torchtitan_autoparallel.cost.hardware import load_profile
    from torchtitan_autoparallel.cost.model import CostContext, Precision, block_cost
    from torchtitan_autoparallel.graph.layer_graph import Layer

    layer = Layer(fqn="layers.1", kind="block", params=10**8, fwd_flops=1e12, saved_bytes=1e8,
                  io_bytes=4096 * 1024 * 4, signature="moe", attn_flops=0.0, kv_bytes=0.0,
                  expert_params=9 * 10**7, num_experts=64, top_k=2, expert_flops=5e11)
    hw = dataclasses.replace(load_profile("h100_sxm"), moe_load_imbalance=1.0)
    s = BlockStrategy("none", True, "none")
    ctx = CostContext(hw=hw, prec=Precision(2, 4), gpus_per_node=8)

    def cost(mesh, grouped):
        return block_cost(layer, mesh, s, 2, ctx, grouped).compute_s

    # TorchTitan's for-loop experts: plain GEMMs at the dense table's rate, one per expert and
    # projection (counted here GEMM by GEMM), a host sync for the token counts, and without EP
    # no permutation (grouped GEMMs without EP pad on the device: no sync)
    from torchtitan_autoparallel.cost.kernels import gemm_s
    from torchtitan_autoparallel.cost.moe import moe_cost, moe_shape

    for mesh in (Mesh(dp_replicate=1, dp_shard=8, tp=1),
                 Mesh(dp_replicate=1, dp_shard=8, tp=1, ep=8)):
        looped, grouped = (dict(moe_cost(layer, mesh, 2, ctx, "none", g).parts)
                           for g in (False, True))
        shape = moe_shape(layer, mesh, 2, 1.0)
        m, d, h = shape.group_rows, shape.dim, shape.hidden
        # per expert: x @ w1, x @ w3, h @ w2 forward; their input and weight gradients
        gemms = [(m, h, d), (m, h, d), (m, d, h), (m, d, h), (m, d, h), (m, h, d),
                 (h, d, m), (h, d, m), (d, h, m)]
        by_hand = shape.local_experts * sum(gemm_s(*g, hw.gemm_table, hw.clock_scale)
                                            for g in gemms)
        assert looped["grouped GEMMs"] == pytest.approx(by_hand)
        assert looped["host sync"] > 0 and (grouped["host sync"] > 0) == (mesh.ep > 1)
        assert (looped["permutation"] > 0) == (mesh.ep > 1) and grouped["permutation"] > 0
        assert cost(mesh, False) - cost(mesh, True) == pytest.approx(
            sum(looped.values()) - sum(grouped.values()))
    # EP moves tokens (all-to-all) and FSDP-gathers experts over efsdp only
    no_ep = block_cost(layer, Mesh(dp_replicate=1, dp_shard=8, tp=1), s, 2, ctx)
    ep = block_cost(layer, Mesh(dp_replicate=1, dp_shard=8, tp=1, ep=8), s, 2, ctx)
    assert ep.transient_bytes < no_ep.transient_bytes
