"""Every key of TorchTitan 0.2.2's JobConfig is classified in ``settings.SETTINGS`` (a key
added upstream fails here until it is), and the keys classified last behave as their rows say."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from torchtitan_autoparallel.job.request import plan_job
from torchtitan_autoparallel.titan.keys import check_handling
from torchtitan_autoparallel.titan.v0_2.job import parse_config
from torchtitan_autoparallel.titan.v0_2.registry import register
from torchtitan_autoparallel.titan.v0_2.settings import SETTINGS

from tests.support.parity import REPO


def job_config_keys(cls: type, prefix: str = "") -> list[str]:
    """``section.key`` of every leaf field of TorchTitan's JobConfig (nested sections too)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            keys += job_config_keys(kind, f"{prefix}{field.name}.")
        else:
            keys.append(prefix + field.name)
    return keys


def test_every_torchtitan_key_is_classified():
    from torchtitan.config.job_config import JobConfig

    keys = job_config_keys(JobConfig)
    assert len(keys) > 100
    missing = [key for key in keys if key not in SETTINGS]
    assert not missing, f"TorchTitan keys without a row in settings.SETTINGS: {missing}"
    stale = sorted(set(SETTINGS) - set(keys))
    assert not stale, f"rows naming no TorchTitan key: {stale}"
    for key, (handling, _) in SETTINGS.items():
        check_handling(key, handling)  # KeyHandling words, each once, passed alone


def test_keys_that_change_execution_are_in_the_readme():
    """docs/settings.md explains the keys this change classified."""
    readme = (REPO / "docs" / "settings.md").read_text()
    for key in ("fault_tolerance.enable", "optimizer.early_step_in_backward",
                "optimizer.implementation", "memory_estimation.enable", "checkpoint.async_mode",
                "validation.enable", "debug.moe_force_load_balance", "training.dataloader",
                "profiling.enable_profiling"):
        assert f"`{key}" in readme, key


def _plan(world: int, config: str, *extra: str):
    register()
    return plan_job(parse_config(["--job.config_file", str(REPO / "train_configs" / config),
                                  *extra]), world)


def test_validation_keeps_pp_and_cp_out_of_the_search():
    """TorchTitan's validator runs the training's pipeline schedule and CP buffers: pp is not
    searched with validation on, cp neither when validation.seq_len differs."""
    def searched(plan) -> set[str]:
        return set(plan.fingerprint["constraints"]["techniques"]) & {"cp", "pp"}

    extra = ("--autoparallel.techniques=cp,pp,fsdp",)
    assert searched(_plan(8, "llama3_debug_auto.toml", *extra)) == {"cp", "pp"}
    plan = _plan(8, "llama3_debug_auto.toml", *extra, "--validation.enable",
                 "--validation.seq_len=128")
    assert searched(plan) == set() and plan.mesh.pp == plan.mesh.cp == 1, plan.mesh
    same = _plan(8, "llama3_debug_auto.toml", *extra, "--validation.enable",
                 "--validation.seq_len=256")
    assert searched(same) == {"cp"} and same.mesh.pp == 1, same.mesh


def test_moe_force_load_balance_is_costed():
    """debug.moe_force_load_balance routes tokens evenly: the planner assumes no imbalance."""
    default = _plan(4, "deepseek_v3_debug_auto.toml")
    forced = _plan(4, "deepseek_v3_debug_auto.toml", "--debug.moe_force_load_balance")
    assert default.fingerprint["moe_load_imbalance"] > 1
    assert forced.fingerprint["moe_load_imbalance"] == 1.0


@pytest.mark.parametrize("implementation,bytes_per_param", [
    ("fused", 16), ("foreach", 20), ("for-loop", 16)])
def test_optimizer_implementation_is_costed(implementation, bytes_per_param):
    """The optimizer step's peak: parameters, gradients and AdamW's moments (16 B per
    parameter), plus one foreach temporary of every parameter for foreach (MemTracker on CPU,
    plain and FSDP-sharded: fused 16, foreach 20, for-loop 16 + one parameter's
    temporaries)."""
    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.plan.assembly import candidate_for
    from torchtitan_autoparallel.plan.schema import Mesh

    register()
    job = parse_config(["--job.config_file", str(REPO / "train_configs/llama3_debug_auto.toml"),
                        f"--optimizer.implementation={implementation}"])
    inputs = job_inputs(job, 1)
    cand = candidate_for(inputs, Mesh(dp_replicate=1, dp_shard=1, tp=1), 2)
    assert cand.edge_state["first"] == pytest.approx(cand.state_bytes * bytes_per_param / 16)


def test_validation_runs_under_a_plan(tmp_path):
    """TorchTitan's validator between steps of a planned job (2 ranks, its own batch)."""
    from tests.support.parity import run_job

    result = run_job("llama3_debug_auto.toml", 2, tmp_path, [
        "--validation.enable", "--validation.dataset=autoparallel_text", "--validation.freq=2",
        "--validation.steps=1", "--validation.seq_len=64", "--training.steps=2"])
    assert result.returncode == 0, result.output[-3000:]
    assert "validate step:  2" in result.output.replace("\x1b[32m", ""), result.output[-3000:]
