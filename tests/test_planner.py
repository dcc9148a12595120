"""Planner: MILP optimum vs brute force, plan JSON, layer graph, config errors."""

import dataclasses
import itertools
import json
import random

import pytest

from torchtitan_autoparallel.candidates.candidate import build_candidate
from torchtitan_autoparallel.candidates.layout import BlockStrategy
from torchtitan_autoparallel.candidates.strategies import (
    Constraints,
    embedding_modes,
    enumerate_meshes,
    microbatch_sizes,
)
from torchtitan_autoparallel.cost.hardware import load_profile
from torchtitan_autoparallel.cost.model import CostContext, Precision
from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.graph.layer_graph import Layer, LayerGraph
from torchtitan_autoparallel.job.pins import Pin
from torchtitan_autoparallel.plan.schema import Plan
from torchtitan_autoparallel.solve.milp import search


def random_graph(rng: random.Random) -> LayerGraph:
    dim = rng.choice([256, 512, 1024])
    seq = rng.choice([512, 1024, 2048])
    layers = [Layer(fqn="tok_embeddings", kind="embedding", params=32000 * dim, fwd_flops=0.0,
                    saved_bytes=seq * dim * 4, io_bytes=seq * 8, signature="embedding")]
    n_classes = rng.choice([1, 2])
    counts = [rng.randint(1, 5)] if n_classes == 1 else [rng.randint(1, 2), rng.randint(1, 2)]
    i = 0
    for c, count in enumerate(counts):
        params = rng.randint(1, 50) * 10**6
        flops = 2.0 * params * seq * rng.uniform(1.0, 1.5)
        saved = seq * dim * 4 * rng.uniform(10, 40)
        moe = {}
        if c == 1 and rng.random() < 0.6:  # an MoE class: routed experts, top-2
            experts = rng.choice([4, 8])
            expert_params = params * 3 // 4
            moe = {"expert_params": expert_params, "num_experts": experts, "top_k": 2,
                   "expert_flops": 2.0 * seq * 2 * expert_params / experts}
        for _ in range(count):
            layers.append(Layer(fqn=f"layers.{i}", kind="block", params=params,
                                fwd_flops=flops, saved_bytes=saved, io_bytes=seq * dim * 4,
                                signature=f"class{c}", **moe))
            i += 1
    layers.append(Layer(fqn="output", kind="output", params=32000 * dim,
                        fwd_flops=2.0 * seq * dim * 32000, saved_bytes=2 * seq * 32000 * 4,
                        io_bytes=seq * dim * 4, signature="output"))
    heads = rng.choice([4, 8, 16])
    return LayerGraph("synthetic", "random", seq, dim, 32000, heads, heads, dim // heads,
                      tuple(layers))


def compositions(n: int, parts: int):
    """Every way to write n as an ordered sum of ``parts`` non-negative integers."""
    if parts == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in compositions(n - first, parts - 1):
            yield (first, *rest)


def _ctx(hw, prec, gpus_per_node=8):
    """The cost context of a test job: ``hw``, ``prec``, eager, 8 devices a node."""
    return CostContext(hw=hw, prec=prec, gpus_per_node=gpus_per_node)


def flat_meshes(graph, world, gpn, constraints):
    """The meshes without pp (pipeline candidates have their own brute force)."""
    return [m for m in enumerate_meshes(graph, world, gpn, constraints) if m.pp == 1]


def brute_force(graph, world, global_batch, ctx, budget, constraints, pins, one_stream=True):
    best = None
    for mesh in flat_meshes(graph, world, ctx.gpus_per_node, constraints):
        for mb, embedding in itertools.product(microbatch_sizes(global_batch, mesh),
                                               embedding_modes(graph, mesh, constraints)):
            cand = build_candidate(graph, mesh, mb, global_batch, ctx, constraints, pins,
                                   embedding=embedding)
            per_class = []
            for cls, n in cand.classes.items():
                options = []
                for split in compositions(n, len(cand.strategies[cls])):
                    options.append({(cls, s): k for s, k in zip(cand.strategies[cls], split,
                                                                 strict=True)})
                per_class.append(options)
            for combo in itertools.product(*per_class):
                counts = {k: v for part in combo for k, v in part.items()}
                if any(v % s.fsdp_unit for (_, s), v in counts.items()):
                    continue  # FSDP units come whole
                layouts = {s.tp_mode.rpartition(":")[2] if s.tp_mode.endswith(
                    (":batch", ":rep")) else "sequence" for (_, s), v in counts.items()
                    if v and s.tp_mode != "none"}
                if one_stream and len(layouts) > 1:
                    continue  # one residual-stream layout per plan
                if "rep" in layouts and embedding.startswith("dim"):
                    continue  # a lookup on the embedding dim leaves its output on a shard
                if cand.rank_memory(cand.types[0], counts) <= budget:
                    t = cand.evaluate([counts])[0]
                    best = t if best is None or t < best else best
    return best


@pytest.fixture
def single_block_units(monkeypatch):
    """FSDP units of one block only: ``brute_force`` enumerates every split of each class over
    its strategies, which units would triple (they have their own brute force below)."""
    monkeypatch.setattr("torchtitan_autoparallel.candidates.strategies.FSDP_UNIT_SIZES", ())


@pytest.mark.parametrize("seed", range(24))
def test_milp_matches_brute_force(seed, single_block_units):
    rng = random.Random(seed)
    graph = random_graph(rng)
    world = rng.choice([2, 4, 8])
    hw = dataclasses.replace(
        load_profile("h100_sxm"),
        comm_overlap=rng.choice([0.0, 0.5, 0.9]),
        intra_node_gbps=rng.choice([5.0, 50.0, 360.0]),
        inter_node_gbps=rng.choice([1.0, 25.0]),
        peak_tflops=rng.choice([10.0, 100.0, 989.0]),
    )
    gpn = rng.choice([2, 4, 8])
    prec = Precision(rng.choice([2, 4]), 4)
    constraints = Constraints()
    global_batch = rng.choice([4, 8, 12])
    # sometimes a user pin: block 0 fixed to a recipe with full AC
    pins = {"layers.0": Pin("full", True)} if rng.random() < 0.3 else {}
    meshes = flat_meshes(graph, world, gpn, constraints)
    meshes = [m for m in meshes if global_batch % m.dp == 0]
    ctx = CostContext(hw=hw, prec=prec, gpus_per_node=gpn)
    cands = [build_candidate(graph, m, mb, global_batch, ctx, constraints, pins)
             for m in meshes for mb in microbatch_sizes(global_batch, m)]
    lo = min(c.memory_lower_bound() for c in cands)
    hi = max(c.rank_memory(c.types[0], {(cls, c.strategies[cls][-1]): n
                                        for cls, n in c.classes.items()})
             for c in cands)
    budget = rng.uniform(lo * 0.9, hi * 1.1)
    result = search(graph, global_batch, ctx, budget, constraints, meshes, 30.0, pins)
    expected = brute_force(graph, world, global_batch, ctx, budget, constraints, pins)
    if expected is None:
        assert result.best is None
        return
    assert result.best is not None
    assert result.best.gap == 0.0
    assert result.best.step_time_s == pytest.approx(expected, rel=1e-9)


def test_sub_block_stream_layout_matches_brute_force(single_block_units):
    """Sub-block modes, the stream sharded on the sequence or on the batch: the MILP (one
    stream layout per plan) against a brute force over every split of each class that keeps
    one, on random dense models and budgets, block 0 pinned to TorchTitan's recipe (TP + SP on
    the sequence) in every other model; somewhere the batch-sharded stream is chosen and
    somewhere a plan that mixes both layouts would have been faster (the rule binds); the
    embedding looked up on its embedding dim is searched too (the brute force tries both
    modes of every candidate), and chosen somewhere."""
    chosen, bound, embeddings = set(), 0, set()
    for seed in range(10):
        rng = random.Random(2000 + seed)
        graph = random_graph(rng)
        while graph.num_experts or len(graph.blocks) > 3:
            graph = random_graph(rng)
        world = rng.choice([4, 8])
        hw = dataclasses.replace(load_profile("h100_sxm"), intra_node_gbps=rng.choice(
            [5.0, 50.0, 360.0]), peak_tflops=rng.choice([10.0, 100.0, 989.0]))
        constraints = Constraints(tp=rng.choice([2, 4]), techniques=("fsdp", "tp",
                                                                     "tp_sub_block"))
        meshes = flat_meshes(graph, world, 8, constraints)
        ctx = CostContext(hw=hw, prec=Precision(2, 4), gpus_per_node=8)
        pins = {"layers.0": Pin("none", True)} if seed % 2 and len(graph.blocks) > 1 else {}
        cands = [build_candidate(graph, m, mb, 16, ctx, constraints, pins)
                 for m in meshes for mb in microbatch_sizes(16, m)]
        lo = min(c.memory_lower_bound() for c in cands)
        for budget in (lo * 1.05, lo * 3):
            result = search(graph, 16, ctx, budget, constraints, meshes, 30.0, pins)
            expected = brute_force(graph, world, 16, ctx, budget, constraints, pins)
            assert result.best is not None and expected is not None
            assert result.best.step_time_s == pytest.approx(expected, rel=1e-9), (seed, budget)
            modes = {s.tp_mode for counts in result.best.counts.values()
                     for (_, s), k in counts.items() if k}
            assert len({m.endswith(":batch") for m in modes}) == 1, modes
            chosen |= modes
            embeddings.add(result.best.candidate.embedding)
            bound += brute_force(graph, world, 16, ctx, budget, constraints, pins,
                                 one_stream=False) < expected * (1 - 1e-9)
    print(f"modes chosen {sorted(chosen)}; mixed layouts faster in {bound} cases; embedding "
          f"modes chosen {sorted(embeddings)}")
    assert any(m.endswith(":batch") for m in chosen) and bound, (chosen, bound)
    assert "dim" in embeddings, embeddings


def test_sub_block_replicated_stream_matches_brute_force(single_block_units):
    """A job with sequence parallel off: tp blocks take the replicated stream only (TP without
    SP and the data-parallel sub-blocks beside it), never the embedding on its embedding dim
    at tp > 1; the MILP against the brute force on random dense models and budgets."""
    chosen = set()
    for seed in range(6):
        rng = random.Random(3000 + seed)
        graph = random_graph(rng)
        while graph.num_experts or len(graph.blocks) > 3:
            graph = random_graph(rng)
        hw = dataclasses.replace(load_profile("h100_sxm"), intra_node_gbps=rng.choice(
            [5.0, 50.0, 360.0]), peak_tflops=rng.choice([10.0, 100.0, 989.0]))
        constraints = Constraints(tp=2, techniques=("fsdp", "tp", "tp_sub_block"),
                                  sequence_parallel=False)
        meshes = flat_meshes(graph, 4, 8, constraints)
        ctx = CostContext(hw=hw, prec=Precision(2, 4), gpus_per_node=8)
        cands = [build_candidate(graph, m, mb, 16, ctx, constraints, {})
                 for m in meshes for mb in microbatch_sizes(16, m)]
        lo = min(c.memory_lower_bound() for c in cands)
        for budget in (lo * 1.05, lo * 3):
            result = search(graph, 16, ctx, budget, constraints, meshes, 30.0, {})
            expected = brute_force(graph, 4, 16, ctx, budget, constraints, {})
            assert result.best is not None and expected is not None
            assert result.best.step_time_s == pytest.approx(expected, rel=1e-9), (seed, budget)
            assert result.best.candidate.embedding == ""
            chosen |= {s.tp_mode for counts in result.best.counts.values()
                       for (_, s), k in counts.items() if k}
    assert chosen <= {"sp/sp:rep", "dp/sp:rep", "sp/dp:rep"} and "sp/sp:rep" in chosen, chosen
    print(f"modes chosen {sorted(chosen)}")


@pytest.fixture(scope="module")
def planning():
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register
    cpu.install()
    register()

    def plan(config: str, world: int, *overrides: str) -> Plan:
        job = parse_config(["--job.config_file", f"train_configs/{config}", *overrides])
        return plan_job(job, world)

    return plan


def test_plan_json_round_trip(planning, tmp_path):
    plan = planning("llama3_debug_auto.toml", 4)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    again = Plan.load(str(path))
    assert again.to_json() == plan.to_json()
    assert again.digest() == plan.digest()
    assert again.mesh.world == 4
    assert plan.global_batch_size == (
        plan.local_batch_size * plan.mesh.dp_replicate * plan.mesh.dp_shard
        * plan.gradient_accumulation_steps
    )


def test_context_parallel_plans(planning):
    plan = planning("llama3_debug_auto.toml", 4, "--parallelism.context_parallel_degree=2")
    assert plan.mesh.cp == 2 and plan.mesh.world == 4
    # long sequences: the planner turns to CP on its own when memory calls for it
    plan = planning("llama3_8b_auto.toml", 64, "--training.seq_len=131072",
                    "--training.global_batch_size=16")
    assert plan.mesh.cp > 1


def test_plan_respects_fixed_degrees_and_techniques(planning):
    plan = planning("llama3_debug_auto.toml", 4, "--parallelism.tensor_parallel_degree=2")
    assert plan.mesh.tp == 2
    plan = planning("llama3_debug_auto.toml", 4, "--autoparallel.techniques", "fsdp")
    assert (plan.mesh.tp, plan.mesh.dp_replicate) == (1, 1)
    assert all(layer.ac == "none" for layer in plan.layers)


def test_405b_plan_is_heterogeneous_and_fits(planning):
    """Llama 3.1 405B on 128 H100s: 405.9e9 parameters (Meta's model card), 16 B each in fp32
    with AdamW (weights, gradients, two moments) sharded over all 128 ranks: 47.3 GiB per
    device, which leaves room for activations in an 80 GB device only if some blocks
    checkpoint, so no uniform AC choice is forced and the blocks differ."""
    plan = planning("llama3_405b_auto.toml", 128)
    assert plan.solver["gap"] == 0.0
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    assert len(blocks) == 126
    assert len({layer.describe() for layer in blocks}) > 1, plan.table()
    assert plan.predicted["state_memory_gib"] == pytest.approx(405.9e9 * 16 / 128 / 2**30,
                                                               rel=0.01)
    # with 8 GPUs per node TP stays inside a node
    assert plan.mesh.tp <= 8


def test_budget_too_small_names_smallest_budget(planning):
    with pytest.raises(UserError, match="smallest budget that works is") as info:
        planning("llama3_debug_auto.toml", 2, "--autoparallel.memory_gib=0.001")
    smallest = float(str(info.value).split("smallest budget that works is ")[1].split()[0])
    plan = planning("llama3_debug_auto.toml", 2, f"--autoparallel.memory_gib={smallest * 1.01}")
    assert plan.predicted["peak_memory_gib"] <= smallest * 1.01


def test_budget_too_small_names_the_settings_that_narrowed_the_search(planning):
    """A budget only the user's own settings rule out: the refusal names them, and the same
    budget plans once they are dropped."""
    with pytest.raises(UserError) as info:
        planning("llama3_debug_auto.toml", 4, "--autoparallel.memory_gib=0.05",
                 "--autoparallel.techniques=ddp")
    assert "with what you set (autoparallel.techniques = ['ddp'])" in str(info.value)
    assert "relax those settings" in str(info.value)
    assert planning("llama3_debug_auto.toml", 4, "--autoparallel.memory_gib=0.05").mesh.dp_shard > 1


@pytest.mark.parametrize("overrides,message", [
    (("--parallelism.tensor_parallel_degree=3",), "no legal mesh"),
    (("--parallelism.pipeline_parallel_degree=3",), "does not divide the world size 4"),
    (("--parallelism.context_parallel_degree=3",), "no legal mesh"),
    (("--parallelism.context_parallel_degree=2", "--training.seq_len=130"),
     r"cp needs seq_len % \(2 x cp x tp\) == 0"),
    (("--parallelism.context_parallel_degree=2", "--model.flavor=debugmodel_varlen_attn"),
     "context parallel in llama3 needs sdpa or flex attention"),
    (("--autoparallel.hardware=tpu9",), "unknown hardware profile"),
    (("--autoparallel.techniques=fsdp,magic",), "unknown entries"),
    (("--autoparallel.memory_gib=-1",), "memory_gib = -1.0 is invalid"),
    (("--training.global_batch_size=7", "--autoparallel.techniques=fsdp"), "cannot be split"),
])
def test_config_errors(planning, overrides, message):
    with pytest.raises(UserError, match=message):
        planning("llama3_debug_auto.toml", 4, *overrides)


@pytest.mark.parametrize("config,overrides,message", [
    ("deepseek_v3_debug_auto.toml", ("--autoparallel.pin=layers.*.mlp",),
     r"pin 'layers.\*.mlp' matches no module of deepseek_v3 debugmodel"),
    ("deepseek_v3_debug_auto.toml", ("--autoparallel.pin=layers.1.moe.experts.w1",),
     r"names a parameter \(layers.1.moe.experts.w1\), not a module: pin its module instead "
     r"\(e.g. 'layers.1.moe.experts'\)"),
    ("llama3_debug_auto.toml", ("--parallelism.expert_parallel_degree=2",),
     "has no MoE layers: set it to 1"),
    ("deepseek_v3_debug_auto.toml", ("--parallelism.expert_parallel_degree=3",),
     r"does not divide the 8 experts of deepseek_v3 debugmodel: choose one of \[2, 4\]"),
    ("llama4_debug_auto.toml", ("--parallelism.tensor_parallel_degree=2",
                                "--parallelism.expert_tensor_parallel_degree=4"),
     "must be 1 or equal to tensor_parallel_degree"),
    ("llama4_debug_auto.toml", ("--autoparallel.moe_load_imbalance=0.5",),
     "moe_load_imbalance = 0.5 is invalid"),
])
def test_moe_config_errors(planning, config, overrides, message):
    with pytest.raises(UserError, match=message):
        planning(config, 4, *overrides)


def test_fixed_expert_degrees_that_fit_no_mesh_are_the_first_reason(planning):
    """ep 2 with etp 1 beside a fixed tp 4 on 8 ranks (EP borrows all of tp: a multiple of
    it): the refusal gives the expert layout's own rule first, not the other meshes' reasons;
    ep 4, a multiple, plans. etp 4 with ep free on 4 ranks of tp 4 is refused with its fix;
    on 8 ranks it plans ep 2 over the dp_shard ranks."""
    degrees = ("--parallelism.tensor_parallel_degree=4",
               "--parallelism.expert_tensor_parallel_degree=1")
    with pytest.raises(UserError) as info:
        planning("deepseek_v3_debug_auto.toml", 8, *degrees,
                 "--parallelism.expert_parallel_degree=2")
    assert str(info.value).split(": ", 1)[1].startswith(
        "expert_parallel_degree 2: ep 2 with etp = 1 must be tp (4) x a divisor of dp_shard x "
        "cp (2)"), str(info.value)
    plan = planning("deepseek_v3_debug_auto.toml", 8, *degrees,
                    "--parallelism.expert_parallel_degree=4")
    assert (plan.mesh.tp, plan.mesh.ep, plan.mesh.etp) == (4, 4, 1)
    # etp 4 = tp 4 with ep left free on 4 ranks: no rank is left for ep beside tp
    etp = ("--parallelism.tensor_parallel_degree=4",
           "--parallelism.expert_tensor_parallel_degree=4")
    with pytest.raises(UserError, match="expert_tensor_parallel_degree 4 takes no "
                       "expert-parallel layout with tp 4 .*: set it to 1 or plan on more ranks"):
        planning("deepseek_v3_debug_auto.toml", 4, *etp)
    plan = planning("deepseek_v3_debug_auto.toml", 8, *etp)
    assert (plan.mesh.tp, plan.mesh.ep, plan.mesh.etp) == (4, 2, 4)


def test_layer_graph_counts_llama3_8b():
    from torchtitan.models.llama3 import Transformer, llama3_args

    from torchtitan_autoparallel.titan.v0_2.model import build_layer_graph

    graph = build_layer_graph("llama3", "8B", llama3_args["8B"], Transformer, 4096)
    assert len(graph.blocks) == 32
    assert abs(graph.total_params - 8.03e9) / 8.03e9 < 0.01
    block = graph.blocks[0]
    matmul = 2 * block.params * 4096
    # matmuls plus causal attention (4 s^2 d / 2 per layer)
    assert block.fwd_flops == pytest.approx(matmul + 2 * 4096**2 * 4096, rel=0.01)
    # flash attention keeps O(s) per layer: ~20-25 tokens x dim fp32 values, not s^2
    assert 15 < block.saved_bytes / (4096 * 4096 * 4) < 30


def test_memory_terms_measured_on_one_gpu():
    """The memory terms MemTracker showed on one H200 (experiments/results/h200_model.md):
    gradients stay resident while accumulating; under autocast (one device / DDP, bf16) the
    cached bf16 weight copies and fp32 residual activations; bf16 logits beside the fp32 ones."""
    from torchtitan_autoparallel.candidates.layout import Mesh
    from torchtitan_autoparallel.cost.model import edges_cost

    graph = random_graph(random.Random(3))
    hw = load_profile("h200_sxm")
    bf16, fp32 = Precision(2, 4), Precision(4, 4)
    params = sum(layer.params for layer in graph.layers)
    body = params - graph.layers[0].params  # all but the embedding
    logits = graph.seq_len * graph.vocab_size
    single, fsdp = Mesh(dp_replicate=1, dp_shard=1, tp=1), Mesh(dp_replicate=1, dp_shard=2, tp=1)

    def cand(mesh, mb, global_batch, prec):
        return build_candidate(graph, mesh, mb, global_batch, _ctx(hw, prec), Constraints())

    # accumulation: + 4 B per (sharded) parameter; same micro-batch, one step vs two
    one, two = cand(fsdp, 1, 2, bf16), cand(fsdp, 1, 4, bf16)
    assert (one.accum, two.accum) == (1, 2)
    assert two.edge_memory["first"] - one.edge_memory["first"] == pytest.approx(4 * params / 2)
    # autocast: bf16 weight cache of every non-embedding weight; FSDP (mixed precision) or
    # fp32 training caches nothing
    cache = (edges_cost(graph, single, 1, _ctx(hw, bf16)).kept_bytes
             - edges_cost(graph, fsdp, 1, _ctx(hw, bf16)).kept_bytes)
    assert cache == pytest.approx(2 * body, rel=1e-3)
    assert edges_cost(graph, single, 1, _ctx(hw, fp32)).kept_bytes == pytest.approx(
        edges_cost(graph, fsdp, 1, _ctx(hw, fp32)).kept_bytes)
    # bf16 logits (2 B) kept beside the fp32 logits and their gradient (8 B)
    assert edges_cost(graph, fsdp, 1, _ctx(hw, bf16)).kept_bytes - edges_cost(
        graph, fsdp, 1, _ctx(hw, fp32)).kept_bytes == pytest.approx(2 * logits, rel=0.01)
    # block activations: DDP trains under autocast like one device (same activations); FSDP
    # casts the parameters itself and keeps them all in bf16 (half of fp32)
    block = graph.blocks[0]

    def no_ac(c):
        return next(cost for (cls, s), cost in c.costs.items()
                    if cls == block.signature and s.ac == "none")

    single_cost = no_ac(cand(single, 1, 1, bf16))
    ddp = Mesh(dp_replicate=2, dp_shard=1, tp=1)
    assert no_ac(cand(ddp, 1, 2, bf16)).kept_bytes == single_cost.kept_bytes
    assert no_ac(cand(fsdp, 1, 2, bf16)).kept_bytes == pytest.approx(block.saved_bytes / 2)


@pytest.mark.parametrize("local,ac,measured_gib", [
    (8, "none", 121.5), (2, "none", 50.2), (8, "full", 68.6), (2, "full", 35.7),
])
def test_peak_memory_matches_one_h200(planning, local, ac, measured_gib):
    """Tensor peaks MemTracker measured on one H200 (experiments/results/h200_model.md, llama3
    1B, global batch 8 x 4096 tokens, bf16): the predicted peak of TorchTitan's recipe is
    within 5 % of each."""
    from torchtitan_autoparallel.job.request import recipe_plan
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    job = parse_config(["--job.config_file", "train_configs/llama3_1b_auto.toml",
                        "--autoparallel.hardware=h200_sxm", "--training.global_batch_size=8",
                        "--training.seq_len=4096", f"--training.local_batch_size={local}",
                        f"--activation_checkpoint.mode={ac}"])
    job.parallelism.auto = False
    predicted = recipe_plan(job, 1).predicted["peak_memory_gib"]
    assert predicted == pytest.approx(measured_gib, rel=0.05)


def test_one_h200_plans_few_large_micro_batches(planning):
    """Measured on one H200 (experiments/results/h200_model.md): each micro-batch costs ~1.5 ms
    per layer, so llama3 1B at global batch 8 x 4096 tokens runs fastest as one micro-batch of
    8 without AC (0.628 s, the fastest arm measured; 121.5 GiB of the 139.8 GiB device); the
    plan used to be 8 micro-batches of 1 (a predicted tie), 0.75-0.85x TorchTitan's recipe."""
    plan = planning("llama3_1b_auto.toml", 1, "--training.global_batch_size=8",
                    "--training.seq_len=4096")
    assert plan.local_batch_size == 8 and plan.gradient_accumulation_steps == 1
    assert plan.predicted["peak_memory_gib"] <= plan.predicted["budget_gib"] < 139.8
    assert "single" in plan.table() and "fsdp" not in plan.table().split("layers", 1)[1]


def test_model_hash_is_stable_within_and_across_processes():
    """The plan fingerprint's model hash comes from activation bytes measured on meta; with
    MoE blocks that count once varied between runs (a freed saved tensor's id reused), so a
    plan file could be refused by the job it was made for."""
    import subprocess
    import sys

    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    from tests.support.parity import REPO

    register()

    def model_hash(config: str) -> str:
        job = parse_config(["--job.config_file", f"train_configs/{config}"])
        return job_inputs(job, 128).fingerprint["model_hash"]

    first = model_hash("deepseek_v3_671b_auto.toml")
    model_hash("deepseek_v3_16b_auto.toml")
    assert model_hash("deepseek_v3_671b_auto.toml") == first
    code = ("from torchtitan_autoparallel.titan.v0_2.registry import register; register()\n"
            "from torchtitan_autoparallel.titan.v0_2.job import parse_config\n"
            "from torchtitan_autoparallel.job.inputs import job_inputs\n"
            "job = parse_config(['--job.config_file', "
            "'train_configs/deepseek_v3_671b_auto.toml'])\n"
            "print(job_inputs(job, 128).fingerprint['model_hash'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == first


def test_solver_rejects_non_finite_costs_and_time_outs_without_a_plan():
    """A NaN in the costs (a profile built around the validation) is refused before HiGHS runs;
    a solve stopped by its time limit before any feasible point is an error naming the limit,
    not the all-zero vector HiGHS returns (which the search once took as the fastest plan)."""
    from torchtitan_autoparallel.solve.milp import SolveTimeout, solve

    graph = random_graph(random.Random(5))
    hw = load_profile("h100_sxm")
    mesh = enumerate_meshes(graph, 2, 8, Constraints())[0]
    args = (graph, mesh, 1, 2 * mesh.dp)
    bad = dataclasses.replace(hw, clock_scale=float("nan"))
    cand = build_candidate(*args, _ctx(bad, Precision(4, 4)), Constraints())
    with pytest.raises(UserError, match="non-finite"):
        search(graph, 2 * mesh.dp, _ctx(bad, Precision(4, 4)), 1e15, Constraints(), [mesh],
               30.0)
    cand = build_candidate(*args, _ctx(hw, Precision(4, 4)), Constraints())
    with pytest.raises(SolveTimeout):
        solve(cand, 1e15, 0.0)
    assert solve(cand, 1e15, 30.0) is not None


def test_time_limit_without_a_plan_names_the_limit(planning):
    with pytest.raises(UserError, match=r"time_limit_s = 1e-09 s ran out"):
        planning("llama3_debug_auto.toml", 2, "--autoparallel.time_limit_s=1e-9")


def test_pipeline_search_out_of_time_names_the_limit(planning, monkeypatch):
    """A pipeline search whose MILPs all run out of time: the time-limit error, not "no plan
    fits the memory budget" (what it used to say)."""
    from torchtitan_autoparallel.solve import milp as solver
    from torchtitan_autoparallel.solve.milp import SolveTimeout

    def out_of_time(*args, **kwargs):
        raise SolveTimeout

    monkeypatch.setattr(solver, "solve", out_of_time)
    with pytest.raises(UserError, match=r"time_limit_s = 30 s ran out"):
        planning("llama3_debug_auto.toml", 2, "--parallelism.pipeline_parallel_degree=2")


def test_one_time_limit_for_the_whole_job(planning, monkeypatch):
    """``global_batch_size = -1`` searches each data-parallel degree (flat and pipelined): every
    search gets what is left of one deadline, so all solves together keep to time_limit_s."""
    import time

    from torchtitan_autoparallel.solve import planner

    deadlines: list[float] = []

    def recording(original, position):
        def run(*args, **kwargs):
            deadlines.append(time.perf_counter() + args[position])
            time.sleep(0.05)  # the search's own time counts against the same deadline
            return original(*args, **kwargs)
        return run

    monkeypatch.setattr(planner, "search", recording(planner.search, 6))
    start = time.perf_counter()
    planning("llama3_debug_auto.toml", 4, "--training.global_batch_size=-1",
             "--training.local_batch_size=4", "--autoparallel.time_limit_s=20")
    assert len(deadlines) >= 3  # dp 4, 2, 1, each flat and pipelined in one search
    assert max(deadlines) - min(deadlines) < 0.01
    assert start + 20 <= min(deadlines) and max(deadlines) <= start + 20 + 5  # parse, graph


def test_global_batch_minus_one_is_local_times_dp(planning):
    """TorchTitan: global_batch_size = -1 is local_batch_size x the data-parallel degree
    (not x the world size); with tp = 2 on 4 ranks dp is 2, so 2 x 2 = 4 sequences."""
    plan = planning("llama3_debug_auto.toml", 4, "--training.global_batch_size=-1",
                    "--training.local_batch_size=2", "--parallelism.tensor_parallel_degree=2")
    assert plan.mesh.dp == 2 and plan.global_batch_size == 4
    plan = planning("llama3_debug_auto.toml", 4, "--training.global_batch_size=-1",
                    "--training.local_batch_size=2")
    assert plan.global_batch_size == 2 * plan.mesh.dp


def test_embedding_and_output_are_costed_as_applied():
    """apply_plan reshards the embedding after forward and keeps the output's parameters
    (the output's backward follows its forward at once). By hand, on 2 FSDP ranks with free
    compute, no latency and no overlap, a ring all-gather or reduce-scatter of B bytes takes
    B / 2 / bandwidth: the embedding all-gathers twice and reduce-scatters once, the output
    all-gathers once and reduce-scatters once."""
    from torchtitan_autoparallel.candidates.layout import Mesh
    from torchtitan_autoparallel.cost.model import edges_cost

    graph = random_graph(random.Random(7))
    hw = dataclasses.replace(
        load_profile("h100_sxm"), peak_tflops=1e12, gemm_table="", hbm_gbps=0.0,
        intra_node_latency_us=0.0, inter_node_latency_us=0.0, intra_node_half_mib=0.0,
        comm_overlap=0.0, nccl_sm_fraction=0.0, host_copy_gbps=0.0,
        block_overhead_us=0.0, host_cores=0)
    bw = hw.intra_node_gbps * 1e9
    emb, out = graph.layers[0].params * 4, graph.layers[-1].params * 4
    expected = (3 * emb / 2 + 2 * out / 2) / bw
    got = edges_cost(graph, Mesh(dp_replicate=1, dp_shard=2, tp=1), 1,
                     _ctx(hw, Precision(4, 4))).time_s
    assert got == pytest.approx(expected, rel=1e-6)


def test_node_reshard_matches_brute_force(single_block_units):
    """FSDP groups across nodes on a slow network: the MILP with the integer reshard (to the
    ranks of one node) against the brute force, under budgets from "keep everything" down to
    the least memory, on 8 random dense models; the node reshard is the optimum in some."""
    chosen = []
    for seed in range(8):
        rng = random.Random(1000 + seed)
        graph = random_graph(rng)
        while graph.num_experts:  # dense blocks only (MoE blocks keep TorchTitan's expert FSDP)
            graph = random_graph(rng)
        world, gpn = rng.choice([(4, 2), (8, 2), (8, 4)])
        hw = dataclasses.replace(load_profile("h100_sxm"), comm_overlap=0.0,
                                 intra_node_gbps=360.0, inter_node_gbps=rng.choice([1.0, 5.0]),
                                 peak_tflops=989.0)
        prec = Precision(2, 4)
        constraints = Constraints(dp_shard=world, techniques=("fsdp", "ac"))
        meshes = flat_meshes(graph, world, gpn, constraints)
        ctx = CostContext(hw=hw, prec=prec, gpus_per_node=gpn)
        cands = [build_candidate(graph, m, mb, world, ctx, constraints, {})
                 for m in meshes for mb in microbatch_sizes(world, m)]
        lo = min(c.memory_lower_bound() for c in cands)
        hi = max(c.rank_memory(c.types[0], {(cls, BlockStrategy("none", False)): n
                                            for cls, n in c.classes.items()}) for c in cands)
        for fraction in (0.3, 0.5, 0.7, 0.9):
            budget = lo + fraction * (hi - lo)
            result = search(graph, world, ctx, budget, constraints, meshes, 30.0, {})
            expected = brute_force(graph, world, world, ctx, budget, constraints, {})
            assert result.best is not None and expected is not None
            assert result.best.step_time_s == pytest.approx(expected, rel=1e-9), (seed, fraction)
            chosen += [s.reshard_after_forward for counts in result.best.counts.values()
                       for (_, s), k in counts.items() if k]
    assert any(not isinstance(r, bool) for r in chosen), chosen


def test_float8_linears_in_tp_blocks_stay_float8(planning):
    """float8 tensorwise with TP + SP blocks: TorchTitan's float8 TP styles shard only float8
    linears, so the plan keeps none of theirs in bf16, and a plan file edited to keep one is
    refused in one line."""
    plan = planning("llama3_8b_auto.toml", 16, "--autoparallel.hardware=h100_sxm",
                    "--parallelism.tensor_parallel_degree=2",
                    "--model.converters=quantize.linear.float8", "--compile.enable")
    assert {layer.tp_mode for layer in plan.layers if layer.kind == "block"} == {"sp"}
    assert plan.float8_filter_fqns == ["output"]
    data = plan.to_dict()
    data["float8_filter_fqns"] = ["output", "attention.wk"]
    with pytest.raises(UserError, match="TP \\+ SP block"):
        Plan.from_dict(data)


@pytest.mark.parametrize("features", [{}, dict(
    compile=True, linear="float8_tensorwise", float8_all_gather=True, async_tp=True)],
    ids=["eager", "compile+float8+fsdp_float8+async_tp"])
def test_memoized_compute_equals_the_full_mesh_compute(features):
    """The search memoizes block compute on part of the mesh: on every mesh and strategy the
    8B search enumerates on 64 H100s (ep, replication, resharding varied), it equals the
    unmemoized function given the whole mesh and strategy."""
    from torchtitan_autoparallel.candidates.strategies import pinned_strategies
    from torchtitan_autoparallel.cost.model import block_compute_s, clear_compute_memo, compute_s
    from torchtitan_autoparallel.job.features import Features
    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    inputs = job_inputs(parse_config(["--job.config_file", "train_configs/llama3_8b_auto.toml",
                                      "--autoparallel.hardware=h100_grand_teton"]), 64)
    layer, gpn = inputs.graph.blocks[0], inputs.gpus_per_node
    clear_compute_memo()
    checked = 0
    for mesh in enumerate_meshes(inputs.graph, 64, gpn, inputs.constraints):
        for mb in (1, 2):
            for s in pinned_strategies(mesh, mb, inputs.constraints, False, None, gpn):
                args = (layer, mesh, s, mb, CostContext(
                    hw=inputs.hw, prec=inputs.precision, gpus_per_node=gpn,
                    features=Features(**features)))
                assert compute_s(*args) == block_compute_s(*args), (mesh, s, mb)
                checked += 1
    assert checked > 100


def test_plans_after_another_highs_user_in_the_process(planning):
    """The search runs HiGHS single-threaded; a HiGHS solve made earlier in the process with
    its default thread pool (another library's) does not stop it, nor change the plan."""
    import highspy

    before = planning("llama3_debug_auto.toml", 4).to_json()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 2)
    highspy.Highs.resetGlobalScheduler(True)
    h.addCol(1.0, 0.0, 10.0, 0, [], [])
    h.addRow(3.0, highspy.kHighsInf, 1, [0], [1.0])
    h.changeColIntegrality(0, highspy.HighsVarType.kInteger)
    h.run()
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    after = planning("llama3_debug_auto.toml", 4).to_json()
    strip = [line for line in before.splitlines() if "time" not in line]
    assert [line for line in after.splitlines() if "time" not in line] == strip


def unit_as_one_layer(layer: Layer, k: int) -> Layer:
    """k identical blocks as FSDP sees one unit of them: one module with k times every
    extensive size (parameters, FLOPs, saved activations, linears); the input (``io_bytes``)
    is one block's (it only matters under AC, TP or CP, which the test leaves out)."""
    return dataclasses.replace(
        layer, params=k * layer.params, fwd_flops=k * layer.fwd_flops,
        saved_bytes=k * layer.saved_bytes, attn_flops=k * layer.attn_flops,
        kv_bytes=k * layer.kv_bytes, eager_bytes=k * layer.eager_bytes,
        gemm_io_bytes=k * layer.gemm_io_bytes, linear_shapes=layer.linear_shapes * k,
        linear_input_elements=k * layer.linear_input_elements,
        linear_names=layer.linear_names * k, param_bytes=k * layer.param_bytes)


def unit_sequences(n: int, reshards: list):
    """Every way to cut a run of n blocks into consecutive units of 1, 2 or 4 blocks, each
    with one reshard choice: lists of (unit size, reshard)."""
    if n == 0:
        yield []
        return
    for k in (1, 2, 4):
        if k <= n:
            for r in reshards:
                for rest in unit_sequences(n - k, reshards):
                    yield [(k, r), *rest]


def test_fsdp_units_match_brute_force():
    """FSDP units of k blocks: the search against a brute force over every cut of each run of
    identical blocks into units of 1, 2 or 4 with every reshard choice per unit, each unit
    costed as one block of k times the size (``unit_as_one_layer``, the cost model's path for a
    single block), on dense models with FSDP over 4 or 8 ranks, budgets from "keep everything"
    down to the least memory; units are the optimum in some cases and declined in others."""
    from torchtitan_autoparallel.cost.model import BlockCost, block_cost

    chosen = []
    for seed in range(10):
        rng = random.Random(2000 + seed)
        graph = random_graph(rng)
        while graph.num_experts:
            graph = random_graph(rng)
        world, gpn = rng.choice([(4, 4), (8, 8), (8, 4)])
        # no fixed per-block host overhead: the one-layer reference would count it once per unit
        hw = dataclasses.replace(load_profile("h100_sxm"), block_overhead_us=0.0,
                                 comm_overlap=rng.choice([0.0, 0.5]),
                                 intra_node_latency_us=rng.choice([3.0, 200.0]),
                                 inter_node_latency_us=rng.choice([10.0, 500.0]),
                                 inter_node_gbps=rng.choice([5.0, 50.0]))
        prec = Precision(2, 4)
        constraints = Constraints(dp_shard=world, techniques=("fsdp",))
        meshes = flat_meshes(graph, world, gpn, constraints)
        assert [(m.dp_shard, m.tp, m.cp) for m in meshes] == [(world, 1, 1)]
        (mesh,) = meshes
        ctx = CostContext(hw=hw, prec=prec, gpus_per_node=gpn)
        cand = build_candidate(graph, mesh, 1, world, ctx, constraints, {})
        ref_costs, per_class = {}, []
        for cls, n in cand.classes.items():
            layer = next(b for b, c in zip(graph.blocks, [b.signature for b in graph.blocks],
                                           strict=True) if c == cls)
            reshards = sorted({s.reshard_after_forward for s in cand.strategies[cls]}, key=str)
            for k in (1, 2, 4):
                for r in reshards:
                    unit = block_cost(unit_as_one_layer(layer, k), mesh, BlockStrategy("none", r),
                                      1, ctx)
                    ref_costs[(cls, BlockStrategy("none", r, "none", k))] = BlockCost(
                        time_s=unit.time_s / k, compute_s=0.0, comm_s=0.0, exposed_comm_s=0.0,
                        kept_bytes=unit.kept_bytes / k, state_bytes=unit.state_bytes / k,
                        transient_bytes=unit.transient_bytes)
            per_class.append([(cls, seq) for seq in unit_sequences(n, reshards)])
        reference = dataclasses.replace(cand, costs=ref_costs)

        def counts_of(combo):
            counts = {}
            for cls, seq in combo:
                for k, r in seq:
                    key = (cls, BlockStrategy("none", r, "none", k))
                    counts[key] = counts.get(key, 0) + k
            return counts

        options = [counts_of(combo) for combo in itertools.product(*per_class)]
        singles = [c for c in options if all(s.fsdp_unit == 1 for _, s in c)]
        lo = min(reference.rank_memory(reference.types[0], c) for c in options)
        hi = max(reference.rank_memory(reference.types[0], c) for c in singles)
        for fraction in (0.2, 0.5, 0.8, 1.0, 1.5):
            budget = lo + fraction * (hi - lo)
            result = search(graph, world, ctx, budget, constraints, meshes, 30.0, {})
            fits = [reference.evaluate([c])[0] for c in options
                    if reference.rank_memory(reference.types[0], c) <= budget]
            assert result.best is not None and fits
            assert result.best.step_time_s == pytest.approx(min(fits), rel=1e-9), \
                (seed, fraction)
            chosen.append(max(s.fsdp_unit for (_, s), k in result.best.counts["first"].items()
                              if k))
    # the random cases cover both outcomes, so the comparisons above checked the search both
    # where it declines units and where it groups blocks into them
    assert 1 in chosen and {2, 4} & set(chosen), chosen


def test_fsdp_unit_plan_checks(planning):
    """A plan's FSDP units: k consecutive blocks with one strategy, on blocks FSDP shards;
    anything else is refused in one line when the plan is read."""
    plan = planning("llama3_debug_auto.toml", 2, "--parallelism.data_parallel_shard_degree=2")
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    assert len(blocks) % 2 == 0 and all(b.fsdp_unit == 1 for b in blocks)
    assert "fsdp_unit" not in plan.to_json()
    for layer in blocks:
        layer.fsdp_unit = 2
    units = Plan.from_dict(json.loads(plan.to_json())).layers
    assert [layer.fsdp_unit for layer in units if layer.kind == "block"] == [2] * len(blocks)
    blocks[1].ac = "full" if blocks[0].ac != "full" else "none"
    with pytest.raises(UserError, match=f"{blocks[0].fqn} starts an FSDP unit of 2 blocks"):
        Plan.from_dict(json.loads(plan.to_json()))
    blocks[1].ac = blocks[0].ac
    blocks[-1].fsdp_unit = 1
    with pytest.raises(UserError, match=f"{blocks[-2].fqn} starts an FSDP unit of 2 blocks"):
        Plan.from_dict(json.loads(plan.to_json()))
    blocks[-1].fsdp_unit = 2
    plan.layers[0].fsdp_unit = 2
    with pytest.raises(UserError, match="FSDP units group blocks only"):
        Plan.from_dict(json.loads(plan.to_json()))
    ddp = planning("llama3_debug_auto.toml", 2, "--parallelism.data_parallel_replicate_degree=2")
    for layer in ddp.layers:
        layer.fsdp_unit = 2 if layer.kind == "block" else 1
    with pytest.raises(UserError, match="FSDP units need blocks FSDP shards"):
        Plan.from_dict(json.loads(ddp.to_json()))


def test_fsdp_units_explained(planning):
    """explain gives the unit size with its predicted gain where the plan groups blocks (8B on
    128 H100s: FSDP over 64 ranks, latency-bound collectives), and the reason where it does not
    (a DDP plan: nothing FSDP shards)."""
    from torchtitan_autoparallel.commands.explain import unit_lines
    from torchtitan_autoparallel.plan.recost import inputs_from_plan

    plan = planning("llama3_8b_auto.toml", 128, "--autoparallel.hardware=h100_sxm")
    units = {layer.fsdp_unit for layer in plan.layers if layer.kind == "block"}
    assert units - {1}, units
    lines = unit_lines(plan, inputs_from_plan(plan))
    assert any(f"units of {max(units)} blocks, predicted" in line and "faster per block" in line
               for line in lines), lines
    assert f"unit{max(units)}" in plan.table()
    ddp = planning("llama3_debug_auto.toml", 2, "--parallelism.data_parallel_replicate_degree=2")
    assert unit_lines(ddp, inputs_from_plan(ddp)) == [
        "FSDP units: declined: FSDP units need blocks FSDP shards (dp_shard x cp > 1, or tp as "
        "data parallel)"]


@pytest.mark.parametrize("config,world,features", [
    ("llama3_8b_auto.toml", 64, {}),
    ("llama3_8b_auto.toml", 64, dict(compile=True, linear="float8_tensorwise",
                                     float8_all_gather=True, async_tp=True)),
    ("deepseek_v3_16b_auto.toml", 64, {}),
    ("llama4_debug_auto.toml", 8, {}),
], ids=["8b-eager", "8b-compile+float8+async_tp", "dsv3-16b", "llama4-debug"])
def test_search_bounds_are_below_every_strategy(config, world, features):
    """The search skips an option when its floor, then its bound from the fastest strategies
    alone (no AC, no reshard), cannot win, or its state memory exceeds the budget. On a sample
    of the options the job enumerates (pp and DualPipeV's hidden all-to-alls included): floor
    <= that bound == the minimum over every strategy of the fully costed candidate, and the
    state floor is the full candidate's, below its exact memory floor (flat)."""
    from torchtitan_autoparallel.candidates.candidate import flat_options
    from torchtitan_autoparallel.candidates.pipeline import pipeline_options
    from torchtitan_autoparallel.job.features import Features
    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    inputs = job_inputs(parse_config(["--job.config_file", f"train_configs/{config}",
                                      "--autoparallel.hardware=h100_grand_teton"]), world)
    feats = Features(**features)
    args = (inputs.graph, inputs.global_batch, CostContext(
        hw=inputs.hw, prec=inputs.precision, gpus_per_node=inputs.gpus_per_node, features=feats))
    meshes = [m for m in enumerate_meshes(inputs.graph, world, inputs.gpus_per_node,
                                          inputs.constraints)
              if inputs.global_batch % m.dp == 0]
    flat, _, _ = flat_options(*args, inputs.constraints, [m for m in meshes if m.pp == 1],
                              inputs.pins)
    piped, _, _ = pipeline_options(*args, float("inf"), inputs.constraints,
                                   [m for m in meshes if m.pp > 1], inputs.pins)
    rng = random.Random(0)
    checked = pipelined = fewer = 0
    for floor, mesh, schedule, _, _, make in (rng.sample(flat, min(30, len(flat)))
                                              + rng.sample(piped, min(60, len(piped)))):
        fast, full = make(fastest=True), make()
        if full is None:  # block kinds that interleave: no stage split
            assert fast is None
            continue
        fewer += len(fast.keys()) < len(full.keys())
        assert floor <= fast.time_lower_bound() * (1 + 1e-12), (mesh, schedule)
        assert fast.time_lower_bound() == pytest.approx(full.time_lower_bound(),
                                                        rel=1e-12), (mesh, schedule)
        # what the search prunes by memory before costing every strategy
        assert fast.state_floor() == full.state_floor()
        if mesh.pp == 1:
            assert full.state_floor() <= full.memory_lower_bound()
        checked += 1
        pipelined += mesh.pp > 1
    assert checked > 20 and fewer > checked / 2 and (pipelined or world < 64)


@pytest.mark.parametrize("config,world,features", [
    ("llama3_8b_auto.toml", 64, dict(compile=True, linear="float8_tensorwise",
                                     float8_all_gather=True, async_tp=True)),
    ("deepseek_v3_16b_auto.toml", 64, {}),
], ids=["8b-compile+float8+async_tp", "dsv3-16b"])
def test_block_floors_with_fsdp_are_below_every_strategy_of_every_mesh(config, world, features):
    """The search's per-block floors with FSDP (every micro-batch on flat meshes, once per
    step on pipeline stages) against the block's cost under every strategy, on every mesh of
    the job (brute force over mesh x micro-batch x strategy of the costs the floor bounds);
    FSDP makes the floor tighter than the compute alone on some meshes."""
    from torchtitan_autoparallel.candidates.pipeline import stage_tp_modes
    from torchtitan_autoparallel.candidates.strategies import block_strategies, block_tp_modes
    from torchtitan_autoparallel.cost.model import block_cost, block_time_floor
    from torchtitan_autoparallel.cost.pipeline import stage_block_cost
    from torchtitan_autoparallel.job.features import Features
    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    inputs = job_inputs(parse_config(["--job.config_file", f"train_configs/{config}",
                                      "--autoparallel.hardware=h100_grand_teton"]), world)
    graph, gpn = inputs.graph, inputs.gpus_per_node
    ctx = CostContext(hw=inputs.hw, prec=inputs.precision, gpus_per_node=gpn,
                      features=Features(**features))
    moe = graph.num_experts > 0
    layer = graph.blocks[-1]
    checked = tighter = 0
    for mesh in enumerate_meshes(graph, world, gpn, inputs.constraints):
        for mb in (1, 2):
            flat = mesh.pp == 1
            modes = (block_tp_modes(mesh, mb, inputs.constraints, moe) if flat
                     else stage_tp_modes(mesh))
            floor = block_time_floor(layer, mesh, mb, ctx, modes,
                                     fsdp="microbatch" if flat else "step")
            for s in block_strategies(mesh, mb, inputs.constraints, moe, gpn, len(graph.blocks)):
                if flat:
                    time_s = block_cost(layer, mesh, s, mb, ctx, graph.grouped_experts).time_s
                elif s.tp_mode in modes:
                    time_s = stage_block_cost(layer, mesh, s, mb, ctx,
                                              graph.grouped_experts).time_s
                else:
                    continue
                assert floor <= time_s * (1 + 1e-12), (mesh, mb, s)
                checked += 1
            tighter += floor > 1.01 * block_time_floor(layer, mesh, mb, ctx, modes)
    assert checked > 500 and tighter > 10, (checked, tighter)


def test_planning_leaves_garbage_collection_as_it_found_it(planning):
    """Planning keeps the process's older objects out of garbage collection while it runs and
    gives them back when it ends, also when it fails (frozen objects are never collected)."""
    import gc

    before = gc.get_freeze_count()
    planning("llama3_debug_auto.toml", 2)
    assert gc.get_freeze_count() == before
    with pytest.raises(UserError, match="no plan fits the memory budget"):
        planning("llama3_debug_auto.toml", 2, "--autoparallel.memory_gib=0.001")
    assert gc.get_freeze_count() == before


@pytest.mark.parametrize("config,overrides,message", [
    ("llama3_debug_auto.toml", ["--compile.enable"],
     r"autoparallel\.techniques has tp_sub_block, which is not applied to .*compile"),
    ("qwen3_debug_auto.toml", [],
     r"autoparallel\.techniques has tp_sub_block, but model 'qwen3' names no "),
], ids=["compile", "no-sub-blocks"])
def test_sub_block_technique_is_refused_where_it_cannot_run(planning, config, overrides,
                                                           message):
    """``tp_sub_block`` asked for where its modes cannot be applied (compiled blocks, a family
    whose dense blocks' adapter names no sub-blocks: qwen3 on 0.2.2) ends the job in one line
    instead of being dropped; a MoE model's MoE blocks need none (their MoE and the rest)."""
    with pytest.raises(UserError, match=message):
        planning(config, 4, "--autoparallel.techniques=fsdp,tp,tp_dp,ac,tp_sub_block",
                 *overrides)
