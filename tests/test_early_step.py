"""``optimizer.early_step_in_backward`` under auto: each parameter steps as soon as its gradient
is ready, so the planner keeps the job off DDP (the all-reduce would come after the step), PP,
EP and gradient accumulation (one step per micro-batch), and the job trains like the same job
without the key (losses and gradient norms, clipping off in both)."""

from __future__ import annotations

import pytest

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.job.request import plan_job
from torchtitan_autoparallel.plan.schema import Plan
from torchtitan_autoparallel.titan.v0_2.job import parse_config
from torchtitan_autoparallel.titan.v0_2.registry import register

from tests.support.parity import REPO, assert_parity, run_job

EARLY = "--optimizer.early_step_in_backward"
NO_CLIP = "--training.max_norm=1e9"
"""Clipping cannot apply after the parameters stepped (TorchTitan's note): off in both runs."""


def _plan(world: int, *extra: str) -> Plan:
    register()
    config = str(REPO / "train_configs" / "llama3_debug_auto.toml")
    return plan_job(parse_config(["--job.config_file", config, *extra]), world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_no_ddp_and_no_accumulation(world):
    """Without the key these jobs plan DDP (2 ranks) or local batch 1 x 16 micro-batches
    (1 rank); with it, every plan has final gradients when each parameter steps."""
    plan = _plan(world, EARLY)
    assert not plan.mesh.replicate_only, plan.mesh
    assert plan.mesh.pp == plan.mesh.ep == 1, plan.mesh
    assert plan.gradient_accumulation_steps == 1
    assert plan.local_batch_size * plan.mesh.dp == plan.global_batch_size
    assert any("early_step_in_backward" in note for note in plan.notes), plan.notes
    assert plan.fingerprint["constraints"]["accumulation"] is False


def test_without_the_key_the_search_is_free():
    """The constraint is the key's alone: the same jobs without it still plan DDP and
    accumulation (what the test above rules out)."""
    assert _plan(2).mesh.replicate_only
    assert _plan(1).gradient_accumulation_steps > 1


@pytest.mark.parametrize("extra,message", [
    (("--parallelism.pipeline_parallel_degree=2",), "does not support with PP"),
    (("--parallelism.data_parallel_replicate_degree=4",), "leaves only DDP"),
    (("--parallelism.data_parallel_replicate_degree=2",
      "--parallelism.data_parallel_shard_degree=1"), "leaves only DDP"),
    (("--autoparallel.memory_gib=0.01",), "without gradient accumulation"),
])
def test_impossible_plans_are_one_line(extra, message):
    with pytest.raises(UserError, match=message):
        _plan(4, EARLY, *extra)


def test_hsdp_is_allowed():
    plan = _plan(4, EARLY, "--parallelism.data_parallel_replicate_degree=2")
    assert (plan.mesh.dp_replicate, plan.mesh.dp_shard) == (2, 2)


def test_parity_with_the_same_job_without_the_key(references, tmp_path):
    """2 ranks: the planner would pick DDP without the constraint (the step before the
    all-reduce trained differently); the gradient norm is the one before the steps."""
    seed, _ = references("llama3")
    plan_path = tmp_path / "plan.json"
    plain = run_job("llama3_debug_auto.toml", 2, tmp_path / "plain", [NO_CLIP],
                    seed_checkpoint=seed)
    early = run_job("llama3_debug_auto.toml", 2, tmp_path / "early",
                    [NO_CLIP, EARLY, f"--autoparallel.save_plan={plan_path}"],
                    seed_checkpoint=seed)
    assert_parity(plain, early)
    plan = Plan.load(str(plan_path))
    assert not plan.mesh.replicate_only and plan.gradient_accumulation_steps == 1, plan.mesh
    assert "clips nothing" in early.output
