"""Auto plans with pipeline parallelism train exactly like one rank (fp32, 5 steps, losses rel
<= 1e-4, gradient norms as every parity test): 1F1B, Interleaved1F1B with 2 stages per rank,
pp x dp_shard, pp x tp, and a user-fixed pp with the rest searched."""

import re

import pytest

from tests.support.parity import assert_parity, run_job

PLAN_RE = re.compile(r"autoparallel plan \w+: mesh (.*) \(world")
SCHEDULE_RE = re.compile(r"pipeline: (\w+), (\d+) ranks x (\d+) stages")
LOGGED_LOSS_RE = re.compile(r"step:\s*(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s*(-?[\d.]+)")

CASES = {
    # name: (ranks, overrides, mesh text expected, schedule, stages per rank)
    "pp2-1f1b": (2, ["--parallelism.pipeline_parallel_degree=2",
                     "--autoparallel.pp_schedules=1F1B"], "pp=2 ", "1F1B", 1),
    "pp2-interleaved": (2, ["--parallelism.pipeline_parallel_degree=2",
                            "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                            "--autoparallel.pp_stages_per_rank=2"], "pp=2 ",
                        "Interleaved1F1B", 2),
    "pp2-fsdp2": (4, ["--parallelism.pipeline_parallel_degree=2",
                      "--parallelism.data_parallel_shard_degree=2",
                      "--autoparallel.pp_schedules=1F1B"], "pp=2 dp_replicate=1 dp_shard=2",
                  "1F1B", 1),
    "pp2-tp2": (4, ["--parallelism.pipeline_parallel_degree=2",
                    "--parallelism.tensor_parallel_degree=2",
                    "--autoparallel.pp_schedules=1F1B"], "tp=2", "1F1B", 1),
    # pp fixed, everything else (mesh, schedule, stages, micro-batches, split) searched
    "pp2-free": (4, ["--parallelism.pipeline_parallel_degree=2"], "pp=2 ", None, None),
}


@pytest.mark.parametrize("case", [
    # pp2-free and pp2-1f1b: measured passing, out of CI for time (pp2-fsdp2 and pp2-tp2 run
    # 1F1B with data and tensor parallelism, pp2-interleaved pipelines 2 ranks alone)
    pytest.param(c, marks=pytest.mark.slow) if c in ("pp2-free", "pp2-1f1b") else c
    for c in CASES])
def test_pipeline_auto_parity(case, references, tmp_path):
    ngpu, overrides, mesh_text, schedule, stages = CASES[case]
    seed, reference = references("llama3")
    result = run_job("llama3_debug_auto.toml", ngpu, tmp_path, overrides, seed_checkpoint=seed)
    mesh = PLAN_RE.search(result.output)
    assert mesh, result.output[-3000:]
    assert mesh_text in mesh.group(1) + " ", mesh.group(1)
    planned = SCHEDULE_RE.search(result.output)
    assert planned, result.output[-3000:]
    if schedule is not None:
        assert (planned.group(1), int(planned.group(3))) == (schedule, stages)
    assert_parity(reference, result)
    assert_console_loss(result)


def assert_console_loss(result) -> None:
    """The default log rank (0, a first-stage rank) prints the step's real loss, not the
    placeholder the other stages hold."""
    logged = {int(step): float(loss) for step, loss in LOGGED_LOSS_RE.findall(result.output)}
    assert sorted(logged) == [row["step"] for row in result.rows], result.output[-3000:]
    for row in result.rows:
        assert abs(logged[row["step"]] - row["loss"]) <= 1e-5 * row["loss"], (
            f"step {row['step']}: console loss {logged[row['step']]} vs {row['loss']}")


def test_pipeline_memory_measured(tmp_path):
    """Each pp rank's predicted peak against PyTorch's MemTracker count of its tensors
    (training step 2) for Interleaved1F1B with 2 stages per rank and 16 micro-batches: the
    ranks differ in activations in flight and in the stages' per-micro-batch receive buffers
    (without those buffers the prediction is 26-28 % low here)."""
    from torchtitan_autoparallel.plan.schema import Plan

    plan_path = tmp_path / "plan.json"
    result = run_job("llama3_debug_auto.toml", 2, tmp_path, [
        "--training.steps=3", "--autoparallel.measure_memory", "--autoparallel.hardware=cpu",
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
        "--autoparallel.pp_stages_per_rank=2",
        "--parallelism.pipeline_parallel_microbatch_size=1",
        f"--autoparallel.save_plan={plan_path}"], parity=False)
    assert result.returncode == 0, result.output[-3000:]
    pipe = Plan.load(str(plan_path)).pipeline
    assert (pipe.schedule, pipe.stages_per_rank, pipe.microbatches) == ("Interleaved1F1B", 2, 16)
    measured = next(r for r in result.rows if "measured_tensor_peak_gib" in r)
    by_rank = measured["measured_tensor_peak_by_rank_gib"]
    assert len(by_rank) == 2
    for predicted, actual in zip(pipe.rank_memory_gib, by_rank, strict=True):
        assert predicted == pytest.approx(actual, rel=0.15), (pipe.rank_memory_gib, by_rank)
