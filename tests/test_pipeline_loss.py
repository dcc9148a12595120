"""TorchTitan's pipeline-parallel recipe through this project's trainer: the same losses and
gradient norms as one rank (titan/v0_2/patches/pipeline.py normalises the schedule's loss)."""

from tests.support.parity import assert_parity, run_job


def test_pipeline_recipe_matches_one_rank(references, tmp_path):
    seed, reference = references("llama3")
    result = run_job("llama3_debug_fsdp.toml", 2, tmp_path,
                     ["--parallelism.pipeline_parallel_degree=2",
                      "--parallelism.data_parallel_shard_degree=1"], seed_checkpoint=seed)
    assert_parity(reference, result)
    for step, (a, b) in enumerate(zip(reference.rows, result.rows, strict=True), start=1):
        rel = abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
        assert rel <= 1e-4, f"step {step}: grad norm {b['grad_norm']} vs 1-rank {a['grad_norm']}"
