"""Plans as artifacts: byte-identical files, replay, stale plans refused, CLI tools, bad files."""

import json
import os
import subprocess

import pytest

from torchtitan_autoparallel.commands.cli import main
from torchtitan_autoparallel.errors import run_cli

from tests.support.parity import REPO, run_job

DEBUG_AUTO = str(REPO / "train_configs" / "llama3_debug_auto.toml")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = run_cli(lambda: main(list(argv)))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    for name, extra in (("a", []), ("b", []), ("small", ["--memory-gib", "0.2"])):
        argv = ["plan", "--config", DEBUG_AUTO, "--ngpu", "4", "--out",
                str(folder / f"{name}.json"), *extra]
        assert main(argv) == 0
    return folder


def test_same_inputs_give_byte_identical_files(plans):
    assert (plans / "a.json").read_bytes() == (plans / "b.json").read_bytes()
    data = json.loads((plans / "a.json").read_text())
    assert data["version"] == 2 and data["inputs"]["hardware"]["name"] == "cpu"
    assert {"model", "flavor", "model_hash", "world_size", "hardware", "versions"} <= set(
        data["fingerprint"])
    assert data["solver"]["gap"] == 0.0
    # nothing machine- or load-dependent in the file: no wall-clock times, not even buckets
    assert not [k for k in data["solver"] if "time" in k], data["solver"]


def test_json_output_matches_file(plans, capsys):
    code, out, _ = cli(capsys, "plan", "--config", DEBUG_AUTO, "--ngpu", "4", "--json")
    assert code == 0
    assert json.loads(out) == json.loads((plans / "a.json").read_text())


def test_explain_shows_costs_and_runner_up(plans, capsys):
    code, out, _ = cli(capsys, "explain", str(plans / "small.json"))
    assert code == 0
    assert "runner-up" in out and "layers.0" in out
    code, out, _ = cli(capsys, "explain", str(plans / "small.json"), "--json")
    blocks = json.loads(out)["blocks"]
    assert len(blocks) == 6 and all(b["runner_up"] for b in blocks)


def test_diff_exit_codes(plans, capsys):
    code, out, _ = cli(capsys, "diff", str(plans / "a.json"), str(plans / "b.json"))
    assert (code, out.strip()) == (0, "plans are identical")
    code, out, _ = cli(capsys, "diff", str(plans / "a.json"), str(plans / "small.json"))
    assert code == 1
    assert "memory_budget_gib" in out and "predicted effect" in out


def test_predict_expert_recipe_with_snippet(capsys):
    config = str(REPO / "train_configs" / "llama3_debug_fsdp_tp.toml")
    code, out, _ = cli(capsys, "predict", "--config", config, "--ngpu", "4")
    assert code == 0
    assert "dp_shard=2 cp=1 tp=2" in out
    assert "data_parallel_shard_degree = 2" in out and "tensor_parallel_degree = 2" in out


@pytest.mark.parametrize("content,message", [
    ('{"version": 1', "corrupted"),
    ("", "corrupted"),
    ('{"version": 99}', "schema version 99"),
    ('{"version": 1, "mesh": {}}', "missing field 'fingerprint'"),
])
def test_bad_plan_files(tmp_path, capsys, content, message):
    path = tmp_path / "plan.json"
    path.write_text(content)
    code, _, err = cli(capsys, "explain", str(path))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_missing_file_and_unwritable_output(tmp_path, capsys):
    code, _, err = cli(capsys, "explain", str(tmp_path / "none.json"))
    assert code == 2 and "not found" in err
    # a folder path through a regular file cannot be created, not even by root
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = cli(capsys, "plan", "--config", DEBUG_AUTO, "--ngpu", "2", "--out",
                       str(blocker / "sub" / "plan.json"))
    assert code == 2 and "cannot write plan" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    code, _, err = cli(capsys, "plan", "--config", DEBUG_AUTO, "--ngpu", "2", "--out",
                       "/proc/no/such/plan.json")
    assert code == 2 and "cannot write plan" in err


def test_stale_plan_is_refused_with_the_differences(plans):
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": "train_configs/qwen3_debug_auto.toml"}
    result = subprocess.run([str(REPO / "run_train.sh"),
                             f"--autoparallel.plan_file={plans / 'a.json'}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "made for another job" in err[0]
    assert "world_size: plan 4 -> job 2" in err[0]
    assert "model: plan 'llama3' -> job 'qwen3'" in err[0]


def test_replayed_plan_trains_identically(tmp_path):
    saved = tmp_path / "plan.json"
    solved = run_job("llama3_debug_auto.toml", 2, tmp_path / "solve",
                     [f"--autoparallel.save_plan={saved}"])
    assert solved.returncode == 0, solved.output[-3000:]
    replayed = run_job("llama3_debug_auto.toml", 2, tmp_path / "replay",
                       [f"--autoparallel.plan_file={saved}"])
    assert replayed.returncode == 0, replayed.output[-3000:]
    assert replayed.losses == solved.losses and len(solved.losses) == 5


def test_unsharded_meshes_are_labelled_ddp_or_single() -> None:
    """On a pure data-parallel mesh or one device nothing is sharded: tables say ddp / single,
    not fsdp / fsdp-keep."""
    from torchtitan_autoparallel.candidates.layout import Mesh
    from torchtitan_autoparallel.plan.schema import LayerPlan

    assert Mesh(dp_replicate=2, dp_shard=1, tp=1).replicate_only
    assert not Mesh(dp_replicate=2, dp_shard=2, tp=1).replicate_only
    assert not Mesh(dp_replicate=1, dp_shard=1, tp=1).replicate_only
    assert not Mesh(dp_replicate=2, dp_shard=1, tp=2).replicate_only
    assert Mesh(dp_replicate=2, dp_shard=1, tp=1).unsharded_label == "ddp"
    assert Mesh(dp_replicate=1, dp_shard=1, tp=1).unsharded_label == "single"
    assert Mesh(dp_replicate=2, dp_shard=2, tp=1).unsharded_label == ""
    assert Mesh(dp_replicate=1, dp_shard=1, tp=1, cp=2).unsharded_label == ""
    layer = LayerPlan("layers.0", "block", ac="full", reshard_after_forward=False)
    assert layer.describe() == "fsdp-keep+ac:full"
    assert layer.describe("ddp") == "ddp+ac:full"
    one = Mesh(dp_replicate=1, dp_shard=1, tp=1)
    assert layer.describe(one.unsharded_label) == "single+ac:full"


def test_405b_plan_files_are_byte_identical(tmp_path, monkeypatch):
    """The 405B plan on 128 ranks once differed between runs on a loaded box (its planning time
    fell in another bucket): with the planner's clock jumping 2 s per reading (planning looks
    many times slower, still inside the job's 30 s deadline) the files are the same."""
    import time as time_module

    from torchtitan_autoparallel.solve import planner

    config = str(REPO / "train_configs" / "llama3_405b_auto.toml")
    argv = ["plan", "--config", config, "--ngpu", "128", "--out"]
    assert main([*argv, str(tmp_path / "a.json")]) == 0
    real = time_module.perf_counter
    calls = iter(range(10**6))
    monkeypatch.setattr(planner.time, "perf_counter", lambda: real() + 2.0 * next(calls))
    assert main([*argv, str(tmp_path / "b.json")]) == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
