"""Explicit means explicit: a ``[parallelism]`` key written in the TOML or on the command line is
a constraint under auto even when its value is TorchTitan's default; an unset key is searched;
the plan's notes list the keys taken as constraints."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import tomllib

from torchtitan_autoparallel.job.explicit import explicit_keys, user_set
from torchtitan_autoparallel.job.inputs import constraint_keys
from torchtitan_autoparallel.job.request import plan_job
from torchtitan_autoparallel.titan.v0_2.job import parse_config
from torchtitan_autoparallel.titan.v0_2.registry import register

from tests.support.parity import REPO
from tests.test_bad_inputs import toml_text

DEBUG_AUTO = REPO / "train_configs" / "llama3_debug_auto.toml"
PP2 = ("--parallelism.pipeline_parallel_degree=2",)


def job(*overrides: str, config: Path = DEBUG_AUTO):
    register()
    return parse_config(["--job.config_file", str(config), *overrides])


def config_with(tmp_path: Path, **parallelism) -> Path:
    data = copy.deepcopy(tomllib.loads(DEBUG_AUTO.read_text()))
    data["parallelism"].update(parallelism)
    path = tmp_path / "job.toml"
    path.write_text(toml_text(data))
    return path


def test_keys_set_in_the_toml_and_on_the_command_line_are_recorded(tmp_path):
    config = config_with(tmp_path, tensor_parallel_degree=1)
    parsed = job("--parallelism.pipeline-parallel-schedule", "1F1B",
                 "--parallelism.no-enable-async-tensor-parallel",
                 "--parallelism.pipeline_parallel_microbatch_size=1", config=config)
    keys = explicit_keys(parsed)
    for key in ("parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_schedule",
                "parallelism.enable_async_tensor_parallel",
                "parallelism.pipeline_parallel_microbatch_size", "parallelism.auto",
                "training.seq_len", "model.name"):
        assert key in keys, key
    for key in ("parallelism.context_parallel_degree", "parallelism.pipeline_parallel_degree",
                "training.steps_typo", "job.custom_config_module"):
        assert key not in keys, key
    # all equal to TorchTitan's defaults, yet set
    assert parsed.parallelism.tensor_parallel_degree == 1
    assert parsed.parallelism.pipeline_parallel_schedule == "1F1B"
    assert sorted(constraint_keys(parsed)) == [
        "parallelism.pipeline_parallel_microbatch_size = 1",
        "parallelism.pipeline_parallel_schedule = '1F1B'",
        "parallelism.tensor_parallel_degree = 1",
    ]


def test_a_config_built_in_code_counts_changed_values_as_set():
    from torchtitan.config import JobConfig

    config = JobConfig()
    assert not user_set(config, "parallelism.tensor_parallel_degree")
    config.parallelism.tensor_parallel_degree = 2
    assert user_set(config, "parallelism.tensor_parallel_degree")
    parsed = job()
    parsed.parallelism.context_parallel_degree = 2  # changed after parsing
    assert user_set(parsed, "parallelism.context_parallel_degree")


def test_schedule_1f1b_on_the_command_line_runs_1f1b():
    """TorchTitan's default schedule, asked for: the plan runs it, and its notes say so."""
    free = plan_job(job(*PP2), 4)
    assert free.pipeline.schedule != "1F1B"  # the search prefers another schedule here
    assert not any("pipeline_parallel_schedule" in note for note in free.notes)
    fixed = plan_job(job(*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"), 4)
    assert fixed.pipeline.schedule == "1F1B"
    assert fixed.pipeline.stages_per_rank == 1
    notes = [n for n in fixed.notes if n.startswith("constraints (set by you): ")]
    assert len(notes) == 1
    assert "parallelism.pipeline_parallel_schedule = '1F1B'" in notes[0]
    assert "parallelism.pipeline_parallel_degree = 2" in notes[0]


def test_schedule_1f1b_in_the_toml_reaches_torchtitan(tmp_path, monkeypatch):
    from torchtitan_autoparallel.titan.v0_2.job import check_config
    from torchtitan_autoparallel.titan.v0_2.train import prepare_planned_job

    monkeypatch.setenv("WORLD_SIZE", "4")
    parsed = job(*PP2, config=config_with(tmp_path, pipeline_parallel_schedule="1F1B"))
    check_config(parsed, cpu=False, dry_run=True)
    plan = prepare_planned_job(parsed, write=False)
    assert plan.pipeline.schedule == parsed.parallelism.pipeline_parallel_schedule == "1F1B"


def test_microbatch_size_1_is_a_constraint():
    free = plan_job(job(*PP2), 4)
    assert free.pipeline.microbatch_size > 1  # searched: larger micro-batches win here
    fixed = plan_job(job(*PP2, "--parallelism.pipeline_parallel_microbatch_size=1"), 4)
    assert fixed.pipeline.microbatch_size == 1


def test_degree_1_in_the_toml_is_a_constraint(tmp_path):
    """131072 tokens of Llama 3 8B on 8 H100s: searched, the plan uses CP; with
    ``context_parallel_degree = 1`` written in the TOML it may not."""
    config = REPO / "train_configs" / "llama3_8b_auto.toml"
    long = ("--training.seq_len=131072", "--autoparallel.hardware=h100_sxm")
    assert plan_job(job(*long, config=config), 8).mesh.cp > 1
    data = tomllib.loads(config.read_text())
    data["parallelism"]["context_parallel_degree"] = 1
    fixed_config = tmp_path / "8b_cp1.toml"
    fixed_config.write_text(toml_text(data))
    plan = plan_job(job(*long, config=fixed_config), 8)
    assert plan.mesh.cp == 1
    assert any("parallelism.context_parallel_degree = 1" in note for note in plan.notes)


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "train_configs").glob(
    "*_auto.toml")) + ["../tests/configs/pocket_lm_auto.toml"])
def test_shipped_auto_configs_leave_the_search_free(config):
    """Under auto a written degree fixes it: the shipped auto configs write none."""
    path = REPO / "train_configs" / config
    data = tomllib.loads(path.read_text())
    parallelism = data["parallelism"]
    assert set(parallelism) - {"auto", "data_parallel_shard_degree"} == set(), parallelism
    assert parallelism.get("data_parallel_shard_degree", -1) == -1
    assert "mode" not in data.get("activation_checkpoint", {})  # AC is chosen per block


MEMORY_BOUND = ("--autoparallel.memory_gib=0.09", "--training.local_batch_size=16")
"""llama3 debug on 4 ranks with a budget that leaves room for AC on some blocks only."""


def _acs(plan) -> set[str]:
    return {layer.ac for layer in plan.layers if layer.kind == "block"}


def test_ac_mode_unset_is_searched_and_set_is_a_constraint():
    """Unset, the search checkpoints only some blocks under a tight budget; written (even as
    "none", TorchTitan's non-default) every block runs that mode, and the notes say so."""
    free = plan_job(job(*MEMORY_BOUND), 4)
    assert len(_acs(free)) > 1, free.table()
    for mode in ("full", "selective"):
        extra = ("--activation_checkpoint.selective_ac_option=op",) if mode == "selective" else ()
        plan = plan_job(job(*MEMORY_BOUND, f"--activation_checkpoint.mode={mode}", *extra), 4)
        assert _acs(plan) == {mode}
        assert any(f"activation_checkpoint.mode = '{mode}'" in n for n in plan.notes)
    roomy = plan_job(job("--activation_checkpoint.mode=none"), 4)
    assert _acs(roomy) == {"none"}


def test_layer_wise_selective_ac_is_a_constraint_and_predicted():
    """TorchTitan's layer-wise selective AC (``selective_ac_option = k``) was refused: under
    auto every k-th block is checkpointed, as TorchTitan's recipe does, the rest of each block
    searched; pinned blocks run the recipe itself; ``predict`` costs the recipe as written."""
    from torchtitan_autoparallel.commands.cli import main as cli_main
    from torchtitan_autoparallel.errors import run_cli

    for k in (2, 3):
        plan = plan_job(job("--activation_checkpoint.mode=selective",
                            f"--activation_checkpoint.selective_ac_option={k}"), 4)
        blocks = [layer for layer in plan.layers if layer.kind == "block"]
        assert [b.ac for b in blocks] == ["full" if (i + 1) % k == 0 else "none"
                                          for i in range(len(blocks))], plan.table()
        assert not any(b.pinned for b in blocks)
    plan = plan_job(job("--activation_checkpoint.mode=selective", "--autoparallel.pin=layers.*",
                        "--parallelism.data_parallel_shard_degree=4"), 4)
    assert [layer.ac for layer in plan.layers if layer.kind == "block"][:2] == ["none", "full"]
    code = run_cli(lambda: cli_main([
        "predict", "--config", "train_configs/llama3_8b_fsdp.toml", "--ngpu", "8",
        "--hardware", "h100_sxm", "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_ac_option=2"]))
    assert code == 0


@pytest.mark.parametrize("pp", [1, 2])
def test_reshard_policy_default_set_is_torchtitans(pp):
    """``fsdp_reshard_after_forward = "default"`` written out: TorchTitan's policy (reshard after
    forward unless pipelined) on every sharded block, where the search keeps parameters."""
    mesh = ("--parallelism.data_parallel_shard_degree=4",) if pp == 1 else (
        "--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2")

    def reshards(*extra: str) -> set[bool]:
        plan = plan_job(job(*mesh, *extra), 4)
        assert plan.mesh.pp == pp and plan.mesh.dp_shard > 1
        return {layer.reshard_after_forward for layer in plan.layers if layer.kind == "block"}

    if pp == 1:
        assert reshards() == {False}  # searched: keeping parameters wins here
    assert reshards("--parallelism.fsdp_reshard_after_forward", "default") == {pp == 1}
