"""Pipeline planning offline: the stage-split MILP against a brute force over every split and
strategy assignment, plan files with stages (JSON round trip, validation, explain, diff), and
TorchTitan's own PP recipe costed as it is (its split from TorchTitan's function)."""

import itertools
import json

import pytest

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.plan.schema import Plan


@pytest.fixture(scope="module")
def job():
    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register
    cpu.install()
    register()

    def make(*overrides: str, config: str = "llama3_debug_auto.toml"):
        return parse_config(["--job.config_file", f"train_configs/{config}", *overrides])

    return make


def brute_force(inputs, cand, budget):
    """Cheapest step over every per-rank block count and strategy multiset (pp = 2: rank 0
    holds k blocks, rank 1 the rest), each rank's memory under ``budget``; independent of the
    MILP (it evaluates splits with the candidate's per-rank arithmetic only)."""
    (cls, total), = cand.classes.items()
    strategies = cand.strategies[cls]
    best = float("inf")
    for k in range(cand.stages_per_rank, total - cand.stages_per_rank + 1):
        for first in itertools.combinations_with_replacement(strategies, k):
            for last in itertools.combinations_with_replacement(strategies, total - k):
                per_rank = []
                for chosen in (first, last):
                    counts = {}
                    for s in chosen:
                        counts[(cls, s)] = counts.get((cls, s), 0) + 1
                    per_rank.append(counts)
                step, _, memory = cand.evaluate(per_rank)
                if max(memory) <= budget:
                    best = min(best, step)
    return best


@pytest.mark.parametrize("schedule,squeeze", [("1F1B", 1.0), ("Interleaved1F1B", 1.0),
                                              ("ZBVZeroBubble", 0.9), ("ZBVZeroBubble", 0.8)])
def test_milp_matches_brute_force(job, schedule, squeeze):
    """``squeeze`` < 1: the budget is that fraction of the unconstrained optimum's peak, so
    memory binds and the optimum moves (0.9), or nothing fits (0.8)."""
    from torchtitan_autoparallel.candidates.pipeline import build_pipeline_candidate
    from torchtitan_autoparallel.candidates.strategies import enumerate_meshes
    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.solve.milp import solve

    inputs = job_inputs(job("--parallelism.pipeline_parallel_degree=2",
                            "--training.global_batch_size=8", "--training.seq_len=128"), 2)
    mesh, = enumerate_meshes(inputs.graph, 2, inputs.gpus_per_node, inputs.constraints)
    v = 1 if schedule == "1F1B" else 2
    cand = build_pipeline_candidate(inputs.graph, mesh, schedule, v, 1, 8, inputs.cost_context,
                                    inputs.constraints, inputs.pins)
    free = solve(cand, inputs.budget_bytes, 30.0)
    budget = squeeze * free.peak_bytes if squeeze < 1 else inputs.budget_bytes
    sol = solve(cand, budget, 30.0)
    expected = brute_force(inputs, cand, budget)
    bound = cand.aggregate_bound(budget)  # what the search prunes with, before a MILP
    if squeeze < 0.85:
        assert sol is None and expected == float("inf")
        return
    assert bound <= expected * (1 + 1e-12)
    assert sol is not None and expected < float("inf")
    assert sol.gap == 0.0
    assert sol.step_time_s == pytest.approx(expected, rel=1e-9)
    assert sol.peak_bytes <= budget
    if squeeze < 1:
        assert sol.step_time_s > free.step_time_s


def test_pipeline_plan_file_round_trip_explain_and_diff(job, tmp_path):
    from torchtitan_autoparallel.commands.explain import diff_lines, explain_rows, explain_text
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.plan.recost import recost

    base = ("--parallelism.pipeline_parallel_degree=2", "--training.global_batch_size=8",
            "--training.seq_len=128")
    one = plan_job(job(*base, "--autoparallel.pp_schedules=1F1B"), 4)
    two = plan_job(job(*base, "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                       "--autoparallel.pp_stages_per_rank=2"), 4)
    path = tmp_path / "pp.json"
    one.save(str(path))
    back = Plan.load(str(path))
    assert back.digest() == one.digest() and back.pipeline == one.pipeline
    assert recost(back).predicted["step_time_s"] == pytest.approx(
        one.predicted["step_time_s"], rel=1e-9)
    table = one.table()
    assert "pipeline: 1F1B, 2 ranks x 1 stages" in table
    assert "stage 0 on rank 0: tok_embeddings, layers.0" in table
    assert "stage 1 on rank 1: layers.3..5, norm, output" in table
    rows = explain_rows(one)
    text = explain_text(one, rows)
    assert "pipeline schedule: 1F1B chosen" in text
    # a stage's block is explained by its time per micro-batch and its FSDP per step, labelled
    # so: the first is the plan file's own per-layer time
    assert "per mb ms fsdp/step ms" in text and "compute ms" not in text
    times = {layer.fqn: layer.time_ms for layer in one.layers}
    assert all(r["microbatch_ms"] == pytest.approx(times[r["layer"]], rel=1e-6) for r in rows)
    assert "pipeline_parallel_degree = 2" in text
    lines = diff_lines(one, two)
    assert "pipeline schedule: '1F1B' -> 'Interleaved1F1B'" in lines
    assert any(line.startswith("stage 0: ") for line in lines)

    data = json.loads(path.read_text())
    data["pipeline"]["stages"][0], data["pipeline"]["stages"][1] = (
        data["pipeline"]["stages"][1], data["pipeline"]["stages"][0])
    with pytest.raises(UserError, match="must start with the embedding|in model order"):
        Plan.from_dict(data, "edited")
    data = json.loads(path.read_text())
    data["pipeline"]["microbatches"] = 1
    with pytest.raises(UserError, match="microbatches 1 does not suit 1F1B"):
        Plan.from_dict(data, "edited")


def test_torchtitan_pp_recipe_costed_as_is(job):
    """``predict`` of TorchTitan's PP recipe: its schedule, micro-batches and the stage split
    TorchTitan's ``generate_llm_fqn_per_model_part`` makes (the split its trainer builds)."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    from torchtitan_autoparallel.job.request import recipe_plan

    recipe = job("--parallelism.pipeline_parallel_degree=2",
                 "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                 "--parallelism.data_parallel_shard_degree=2", "--training.global_batch_size=8",
                 config="llama3_debug_fsdp.toml")
    plan = recipe_plan(recipe, 4)
    assert plan.mesh.pp == 2 and plan.mesh.dp_shard == 2
    assert plan.pipeline.schedule == "Interleaved1F1B"
    assert plan.pipeline.stages == generate_llm_fqn_per_model_part(4, 6, 1, 1)
    assert plan.pipeline.microbatches == plan.local_batch_size
    # TorchTitan keeps parameters after forward under pp ("default" resharding)
    assert not any(layer.reshard_after_forward for layer in plan.layers
                   if layer.kind == "block")


def test_show_draws_the_pipeline(job):
    """``show`` of a pipeline plan: its step split into the slowest rank's micro-batches, the
    schedule's bubble, per-step FSDP and the P2P fill (summing to the plan's prediction), the
    fullest pp rank's memory (its predicted peak), and pp among the mesh dims."""
    from torchtitan_autoparallel.commands.show import picture
    from torchtitan_autoparallel.job.request import plan_job

    plan = plan_job(job("--parallelism.pipeline_parallel_degree=2",
                        "--autoparallel.pp_schedules=1F1B", "--training.global_batch_size=8",
                        "--training.seq_len=128"), 4)
    pic = picture(plan)
    time = dict(pic.time)
    assert sum(time.values()) == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    assert time["pipeline bubble"] == pytest.approx(
        plan.pipeline.bubble_fraction * plan.predicted["step_time_s"], rel=1e-4)
    assert sum(v for _, v in pic.memory) == pytest.approx(plan.predicted["peak_memory_gib"],
                                                          rel=1e-6)
    assert pic.mesh_dims[0].startswith("pp=2")
