"""Bad inputs across TOML configs, the command line, hardware profiles and plan files: each one
ends in one line on stderr naming the problem, exit code 2, no traceback (anything but a
UserError would propagate out of ``run_cli`` and fail the test) and no file left behind."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from torchtitan_autoparallel.commands.cli import main as cli_main
from torchtitan_autoparallel.errors import run_cli
from torchtitan_autoparallel.titan.v0_2 import train

from tests.support.parity import REPO

DEBUG_AUTO = REPO / "train_configs" / "llama3_debug_auto.toml"
MAX_LINE = 600


def toml_text(data: dict[str, Any]) -> str:
    """A TOML document for nested dicts of scalars and lists (NaN and inf included)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    top = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    sections = [f"[{k}]\n" + "\n".join(f"{kk} = {value(vv)}" for kk, vv in v.items())
                for k, v in data.items() if isinstance(v, dict)]
    return "\n".join(top + sections) + "\n"


def one_line_error(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert len(lines[0]) <= MAX_LINE, lines[0][:MAX_LINE]
    assert "Traceback" not in err
    return lines[0]


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def cli(capsys, *argv: str) -> tuple[int, str]:
    code = run_cli(lambda: cli_main(list(argv)))
    return code, capsys.readouterr().err


def preflight(capsys, monkeypatch, ngpu: int, *argv: str) -> tuple[int, str]:
    """What ``run_train.sh`` runs before starting ranks: parse, check, plan or replay."""
    monkeypatch.setenv(train.PREFLIGHT_ENV, "1")
    monkeypatch.setenv("WORLD_SIZE", str(ngpu))
    monkeypatch.setenv("RANK", "0")
    code = run_cli(lambda: train.main(list(argv)))
    return code, capsys.readouterr().err


BASE = tomllib.loads(DEBUG_AUTO.read_text())


def config_with(tmp: Path, **sections: dict[str, Any]) -> Path:
    data = copy.deepcopy(BASE)
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = tmp / "job.toml"
    path.write_text(toml_text(data))
    return path


# ------------------------------------------------------------------------------ TOML / options

TOML_CASES = [
    ({"autoparallel": {"memory_gib": "abc"}}, "autoparallel.memory_gib = 'abc'"),
    ({"autoparallel": {"memory_gib": True}}, "autoparallel.memory_gib = True"),
    ({"autoparallel": {"memory_gib": -1.0}}, "autoparallel.memory_gib = -1.0"),
    ({"autoparallel": {"memory_gib": math.inf}}, "autoparallel.memory_gib = inf"),
    ({"autoparallel": {"gpus_per_node": "8"}}, "autoparallel.gpus_per_node = '8'"),
    ({"autoparallel": {"gpus_per_node": 2.5}}, "autoparallel.gpus_per_node = 2.5"),
    ({"autoparallel": {"hardware": 5}}, "autoparallel.hardware = 5"),
    ({"autoparallel": {"hardware": "tpu_v9"}}, "unknown hardware profile 'tpu_v9'"),
    ({"autoparallel": {"techniques": "fsdp"}}, "autoparallel.techniques = 'fsdp'"),
    ({"autoparallel": {"techniques": ["fsdp", "magic"]}}, "unknown entries ['magic']"),
    ({"autoparallel": {"time_limit_s": 0.0}}, "autoparallel.time_limit_s = 0.0"),
    ({"autoparallel": {"time_limit_s": math.nan}}, "autoparallel.time_limit_s = nan"),
    ({"autoparallel": {"moe_load_imbalance": 0.5}}, "autoparallel.moe_load_imbalance = 0.5"),
    ({"autoparallel": {"moe_load_imbalance": math.nan}}, "autoparallel.moe_load_imbalance = nan"),
    ({"autoparallel": {"pin": "layers.0"}}, "autoparallel.pin = 'layers.0'"),
    ({"training": {"global_batch_size": 0}}, "training.global_batch_size = 0"),
    ({"training": {"local_batch_size": 0}}, "training.local_batch_size = 0"),
    ({"training": {"seq_len": -8}}, "training.seq_len = -8"),
    ({"training": {"mixed_precision_param": "float8"}}, "training.mixed_precision_param"),
]


@pytest.mark.parametrize("sections,message", TOML_CASES,
                         ids=[m.split(" =")[0].split(" is")[0] + f"-{i}"
                              for i, (_, m) in enumerate(TOML_CASES)])
def test_bad_toml_values(tmp_path, capsys, sections, message):
    config = config_with(tmp_path, **sections)
    before = files_under(tmp_path)
    line = one_line_error(*cli(capsys, "plan", "--config", str(config), "--ngpu", "2", "--out",
                               str(tmp_path / "plan.json")))
    assert message in line, line
    assert files_under(tmp_path) == before


def test_malformed_and_binary_toml(tmp_path, capsys):
    for name, content in (("bad.toml", b"this is [ not toml\n"), ("bin.toml", os.urandom(256))):
        (tmp_path / name).write_bytes(content)
        line = one_line_error(*cli(capsys, "plan", "--config", str(tmp_path / name),
                                   "--ngpu", "2"))
        assert "not valid TOML" in line, line
    line = one_line_error(*cli(capsys, "plan", "--config", str(tmp_path / "no.toml"),
                               "--ngpu", "2"))
    assert "config file not found" in line


@pytest.mark.parametrize("section,key", [("model", "name"), ("autoparallel", "pin"),
                                         ("autoparallel", "hardware")])
def test_huge_names_give_a_short_line(tmp_path, capsys, section, key):
    """A 50 MB module name once gave a 50 MB error line (1 MB here, to keep the test fast)."""
    name = "m" * 1_000_000
    config = config_with(tmp_path, **{section: {key: [name] if key == "pin" else name}})
    line = one_line_error(*cli(capsys, "plan", "--config", str(config), "--ngpu", "2"))
    assert "mmmm" in line


def test_malformed_toml_through_the_launcher(tmp_path):
    (tmp_path / "bad.toml").write_text("[training\nsteps = 1\n")
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": str(tmp_path / "bad.toml")}
    proc = subprocess.run([str(REPO / "run_train.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "not valid TOML" in one_line_error(proc.returncode, proc.stderr)


# ------------------------------------------------------------------------------ command line

def test_bad_command_line(tmp_path, capsys):
    config = str(DEBUG_AUTO)
    for argv, message in (
        (["--ngpu", "0"], "--ngpu must be a positive integer"),
        (["--ngpu", "-3"], "--ngpu must be a positive integer"),
        (["--ngpu", "2", "--memory-gib", "nan"], "autoparallel.memory_gib = nan"),
        (["--ngpu", "2", "--gpus-per-node", "-1"], "autoparallel.gpus_per_node = -1"),
        (["--ngpu", "2", "--out", str(tmp_path)], "is a directory"),
    ):
        before = files_under(tmp_path)
        line = one_line_error(*cli(capsys, "plan", "--config", config, *argv))
        assert message in line, line
        assert files_under(tmp_path) == before


LLAMA3_8B_AUTO = REPO / "train_configs" / "llama3_8b_auto.toml"


def test_plan_and_predict_take_torchtitan_overrides(capsys):
    """``--section.key value`` after the command's own flags, as run_train.sh passes them."""
    def planned(command: str, config: Path, ngpu: str, *extra: str) -> dict:
        assert cli_main([command, "--config", str(config), "--ngpu", ngpu, "--json",
                         *extra]) == 0
        return json.loads(capsys.readouterr().out)

    short = planned("plan", LLAMA3_8B_AUTO, "8", "--hardware", "h100_sxm")
    assert short["seq_len"] == 8192 and short["mesh"]["cp"] == 1
    long = planned("plan", LLAMA3_8B_AUTO, "8", "--training.seq_len", "131072", "--hardware",
                   "h100_sxm")
    assert long["seq_len"] == 131072 and long["mesh"]["cp"] > 1
    both = planned("plan", DEBUG_AUTO, "4", "--training.global_batch_size=8",
                   "--parallelism.tensor-parallel-degree", "2")
    assert both["global_batch_size"] == 8 and both["mesh"]["tp"] == 2
    expert = planned("predict", REPO / "train_configs" / "llama3_debug_fsdp.toml", "4",
                     "--training.seq_len", "512")
    assert expert["seq_len"] == 512


def test_plan_from_the_command_line_with_an_override():
    """The README's what-if, as a user types it: a plan with CP, exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
         "train_configs/llama3_8b_auto.toml", "--ngpu", "8", "--training.seq_len", "131072",
         "--hardware", "h100_sxm"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    mesh = proc.stdout.splitlines()[0]
    assert "seq 131072" in proc.stdout and " cp=1 " not in mesh and " cp=" in mesh, mesh


@pytest.mark.parametrize("argv,message", [
    (["--training.seq_lenn", "131072"],
     "invalid command-line override: Unrecognized options: --training.seq_lenn, 131072"),
    (["--training.seq_len", "abc"], "Error parsing --training.seq-len"),
    (["--training.seq_len"], "Missing value for argument '--training.seq-len'"),
    (["--parallelism.auto", "maybe"], "Unrecognized options: maybe"),
])
def test_bad_override_is_torchtitans_one_line(tmp_path, capsys, monkeypatch, argv, message):
    """plan, predict and run_train.sh's preflight parse with TorchTitan's ConfigManager: the same
    line from each, exit 2, no traceback, no usage box."""
    plan = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--out", str(tmp_path / "p.json"), *argv))
    assert message in plan, plan
    assert "\u2502" not in plan and "For full helptext" not in plan
    predict = one_line_error(*cli(capsys, "predict", "--config", str(DEBUG_AUTO), "--ngpu",
                                  "2", *argv))
    launcher = one_line_error(*preflight(capsys, monkeypatch, 2, "--job.config_file",
                                         str(DEBUG_AUTO), *argv))
    assert plan == predict == launcher
    assert files_under(tmp_path) == set()


def test_bad_override_through_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
         "train_configs/llama3_8b_auto.toml", "--ngpu", "8", "--training.bogus", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    line = one_line_error(proc.returncode, proc.stderr)
    assert "Unrecognized options: --training.bogus, 1" in line, line
    assert proc.stdout == ""


@pytest.mark.parametrize("ngpu", ["1", "2"])
def test_smallest_budget_named_is_enough(capsys, ngpu):
    """The budget an out-of-memory refusal names works as written (it is rounded up)."""
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", ngpu,
                               "--memory-gib", "0.001"))
    smallest = line.split("the smallest budget that works is ")[1].split()[0]
    assert cli_main(["plan", "--config", str(DEBUG_AUTO), "--ngpu", ngpu, "--memory-gib",
                     smallest, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["predicted"]["peak_memory_gib"] <= float(smallest)


def test_config_file_override_is_refused(capsys):
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--job.config_file", str(LLAMA3_8B_AUTO)))
    assert "--config" in line


# ------------------------------------------------------------------------------ profiles

PROFILE = tomllib.loads((REPO / "torchtitan_autoparallel" / "profiles" / "cpu.toml").read_text())
PROFILE_CASES = [
    ("peak_tflops", math.nan), ("peak_tflops", -1.0), ("peak_tflops", 0.0),
    ("memory_gib", math.nan), ("memory_gib", True), ("moe_load_imbalance", math.nan),
    ("intra_node_gbps", 0.0), ("inter_node_gbps", -5.0), ("usable_memory_fraction", 2.0),
    ("comm_overlap", math.inf), ("gpus_per_node", 1.5), ("name", 3),
    ("grouped_mm", "yes"), ("matmul_efficiency", 0.0), ("host_copy_gbps", -math.inf),
]


@pytest.mark.parametrize("key,value", PROFILE_CASES, ids=[f"{k}={v}" for k, v in PROFILE_CASES])
def test_bad_profile_values(tmp_path, capsys, key, value):
    path = tmp_path / "hw.toml"
    path.write_text(toml_text({**PROFILE, key: value}))
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--hardware", str(path), "--out", str(tmp_path / "p.json")))
    assert f"{key} = " in line and "invalid" in line, line
    assert files_under(tmp_path) == {"hw.toml"}


def test_profile_missing_unknown_and_binary(tmp_path, capsys):
    for name, text, message in (
        ("missing.toml", toml_text({k: v for k, v in PROFILE.items() if k != "peak_tflops"}),
         "missing key 'peak_tflops'"),
        ("unknown.toml", toml_text({**PROFILE, "warp_speed": 9.0}), "unknown key 'warp_speed'"),
        ("broken.toml", "name = \n", "malformed"),
    ):
        (tmp_path / name).write_text(text)
        line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                                   "--hardware", str(tmp_path / name)))
        assert message in line, line


def test_every_profile_field_is_checked():
    """The generic check covers fields added later: each shipped profile passes, and every
    field rejects NaN."""
    import dataclasses

    from torchtitan_autoparallel.cost.hardware import (
        HardwareProfile,
        available_profiles,
        check_profile_data,
    )
    from torchtitan_autoparallel.errors import UserError

    for name in available_profiles():
        text = (REPO / "torchtitan_autoparallel" / "profiles" / f"{name}.toml").read_text()
        check_profile_data(tomllib.loads(text), name)
    for field in dataclasses.fields(HardwareProfile):
        with pytest.raises(UserError, match=field.name):
            check_profile_data({**PROFILE, field.name: math.nan}, "test")


# ------------------------------------------------------------------------------ plan files

@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    """Plans of llama3 debug: DDP on 2 ranks (as solved) and TP on 2 ranks."""
    folder = tmp_path_factory.mktemp("plans")
    tp_config = folder / "tp.toml"
    data = copy.deepcopy(BASE)
    data["parallelism"]["tensor_parallel_degree"] = 2
    tp_config.write_text(toml_text(data))
    for name, config in (("ddp", DEBUG_AUTO), ("tp", tp_config)):
        assert cli_main(["plan", "--config", str(config), "--ngpu", "2", "--out",
                         str(folder / f"{name}.json")]) == 0
    return folder


def edited(plan_files: Path, name: str, edit) -> dict:
    data = json.loads((plan_files / f"{name}.json").read_text())
    edit(data)
    return data


def _set(path: str, value: Any):
    def edit(data: dict) -> None:
        keys = path.split(".")
        target = data
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[keys[-1]] = value
    return edit


def _block(data: dict) -> dict:
    return next(layer for layer in data["layers"] if layer["kind"] == "block")


PLAN_EDITS = [
    ("ddp", _set("gradient_accumulation_steps", 2), "gradient_accumulation_steps 2"),
    ("ddp", _set("mesh.dp_replicate", 3), "multiplies to 3"),
    ("ddp", _set("mesh.dp_replicate", -2), "mesh.dp_replicate = -2"),
    ("ddp", _set("mesh.dp_shard", "2"), "mesh.dp_shard = '2'"),
    ("ddp", _set("local_batch_size", 0), "local_batch_size = 0"),
    ("ddp", lambda d: _block(d).update(ac="sometimes"), ".ac = 'sometimes'"),
    ("ddp", lambda d: _block(d).update(tp_mode="zigzag"), ".tp_mode = 'zigzag'"),
    ("ddp", lambda d: d["layers"].insert(2, dict(d["layers"][1])), "appears more than once"),
    ("ddp", lambda d: d.pop("predicted"), "missing field 'predicted'"),
    ("ddp", lambda d: d["predicted"].pop("step_time_s"), "predicted.step_time_s = None"),
    ("ddp", lambda d: d["layers"].pop(2), "layers are not the model's"),
    ("ddp", _set("mesh.warp", 1), "unknown key 'warp'"),
    ("ddp", _set("solver.gap", -1), "solver.gap = -1"),
    ("ddp", _set("solver.status", 3), "solver.status = 3"),
    ("ddp", _set("inputs.hardware.peak_tflops", -1.0), "peak_tflops = -1.0"),
    ("ddp", _set("inputs.budget_bytes", "4 GiB"), "inputs.budget_bytes = '4 GiB'"),
    ("ddp", _set("version", 99), "schema version 99"),
    ("tp", lambda d: _block(d).update(tp_mode="none"), "tp_mode 'none' on a tp mesh"),
    ("tp", lambda d: _block(d).update(tp_mode="dp"), "tp_mode 'dp' needs dp_shard > 1"),
    ("tp", _set("mesh.etp", 2), "etp > 1 needs ep > 1"),
]


@pytest.mark.parametrize("name,edit,message", PLAN_EDITS,
                         ids=[f"{n}-{m.split()[0]}-{i}" for i, (n, _, m) in enumerate(PLAN_EDITS)])
def test_edited_plans_are_refused_before_training(plan_files, tmp_path, capsys, monkeypatch,
                                                  name, edit, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited(plan_files, name, edit)))
    saved = tmp_path / "out" / "saved.json"
    config = DEBUG_AUTO if name == "ddp" else plan_files / "tp.toml"
    line = one_line_error(*preflight(capsys, monkeypatch, 2, "--job.config_file", str(config),
                                     f"--autoparallel.plan_file={path}",
                                     f"--autoparallel.save_plan={saved}"))
    assert message in line, line
    assert files_under(tmp_path) == {"plan.json"}  # save_plan wrote nothing


def test_unreadable_plan_files(plan_files, tmp_path, capsys):
    cases = {
        "random.json": os.urandom(512),
        "list.json": b"[1, 2, 3]",
        "nan.json": (plan_files / "ddp.json").read_bytes().replace(
            b'"moe_load_imbalance": 1.2', b'"moe_load_imbalance": NaN'),
        "deep.json": b"[" * 100_000,
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        one_line_error(*cli(capsys, "explain", str(tmp_path / name)))
    line = one_line_error(*cli(capsys, "explain", str(tmp_path)))
    assert "is not a regular file" in line
    line = one_line_error(*cli(capsys, "diff", str(tmp_path / "list.json"),
                               str(plan_files / "ddp.json")))
    assert "not a plan" in line


def test_explain_refuses_an_impossible_plan(plan_files, tmp_path, capsys):
    """World 3 in a plan made for 2 ranks: explain no longer prints it."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited(plan_files, "ddp", _set("mesh.dp_replicate", 3))))
    assert "multiplies to 3" in one_line_error(*cli(capsys, "explain", str(path)))


def test_save_plan_under_a_regular_file(tmp_path, capsys, monkeypatch):
    """A folder through a regular file fails for root too; nothing is left behind."""
    (tmp_path / "f").write_text("x")
    line = one_line_error(*preflight(capsys, monkeypatch, 2, "--job.config_file",
                                     str(DEBUG_AUTO), f"--autoparallel.save_plan="
                                     f"{tmp_path / 'f' / 'plan.json'}"))
    assert "cannot write plan" in line
    assert files_under(tmp_path) == {"f"}


def test_edited_accumulation_through_the_launcher(plan_files, tmp_path):
    """The edited plan that once trained to the end with diverging ranks: one line, exit 2."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited(plan_files, "ddp",
                                      _set("gradient_accumulation_steps", 2))))
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": str(DEBUG_AUTO)}
    proc = subprocess.run([str(REPO / "run_train.sh"), f"--autoparallel.plan_file={path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "gradient_accumulation_steps 2" in one_line_error(proc.returncode, proc.stderr)


# ------------------------------------------------------------------------------ writes

def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    """A failing write (here: the disk is full) removes its temp file; the old file stays."""
    from torchtitan_autoparallel import errors

    target = tmp_path / "plan.json"
    target.write_text("old")

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(errors.os, "fsync", full)
    with pytest.raises(errors.UserError, match="No space left on device"):
        errors.atomic_write(str(target), "new", "plan")
    assert files_under(tmp_path) == {"plan.json"} and target.read_text() == "old"


# ------------------------------------------------------------------------ pipeline parallelism

PIPELINE_CASES = [
    ({"parallelism": {"pipeline_parallel_degree": 3}}, "does not divide the world size 4"),
    ({"parallelism": {"pipeline_parallel_degree": 0}}, "pipeline_parallel_degree = 0 is invalid"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 16},
      "training": {"global_batch_size": 16}}, "needs at least 2 micro-batches"),
    ({"parallelism": {"pipeline_parallel_degree": 2,
                      "pipeline_parallel_schedule": "InterleavedZeroBubble"},
      "compile": {"enable": True, "backend": "aot_eager"}}, "splits the backward"),
    ({"model": {"name": "deepseek_v3", "flavor": "debugmodel"},
      "parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "DualPipeV"},
      "activation_checkpoint": {"mode": "full"}}, "cannot combine with activation checkpoint"),
    ({"model": {"name": "qwen3", "flavor": "debugmodel"},
      "parallelism": {"pipeline_parallel_degree": 2}}, "has no pipelining function"),
    ({"parallelism": {"pipeline_parallel_degree": 8}}, "does not divide the world size 4"),
    ({"parallelism": {"pipeline_parallel_schedule": "Looped"}}, "is not one of TorchTitan's"),
    ({"autoparallel": {"pp_schedules": ["1F1B", "Zero"]}}, "is not one of TorchTitan's"),
    ({"autoparallel": {"pp_stages_per_rank": 9}}, "autoparallel.pp_stages_per_rank = 9"),
    ({"parallelism": {"pipeline_parallel_layers_per_stage": 2}}, "chooses the stage split"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "fsdp_reshard_after_forward": "always"}},
     "keep parameters across micro-batches"),
    # the real cause, not "too few micro-batches" (16 here): 4 ranks x 2 stages need 8 blocks,
    # llama3 debugmodel has 6
    ({"parallelism": {"pipeline_parallel_degree": 4,
                      "pipeline_parallel_schedule": "Interleaved1F1B"}},
     "runs at least 2 stages per rank: pipeline_parallel_degree = 4 x 2 = 8 stages"),
    ({"parallelism": {"pipeline_parallel_degree": 4,
                      "pipeline_parallel_schedule": "InterleavedZeroBubble"}}, "has 6 blocks"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "1F1B",
                      "pipeline_parallel_layers_per_stage": 2}},
     "1F1B runs one stage per rank; parallelism.pipeline_parallel_layers_per_stage = 2 makes 4"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "1F1B"},
      "autoparallel": {"pp_stages_per_rank": 2}},
     "pp_stages_per_rank = 2 cannot be run: 1F1B runs one stage per rank"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "GPipe"},
      "autoparallel": {"pp_schedules": ["1F1B"]}}, "is not among autoparallel.pp_schedules"),
    ({"parallelism": {"pipeline_parallel_degree": 2,
                      "pipeline_parallel_schedule": "DualPipeV"}}, "is for MoE models"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "ZBVZeroBubble",
                      "pipeline_parallel_microbatch_size": 2},
      "training": {"global_batch_size": 4}},
     "needs at least 4 micro-batches per step (at least 4 for ZBVZeroBubble): global batch 4 "
     "over the data-parallel ranks in micro-batches of 2 gives 1 or 2"),
    # the real cause, not "too few micro-batches": 3 divides no local batch (16 / dp)
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 3}},
     "pipeline_parallel_microbatch_size = 3 divides no local batch: global batch 16 over the "
     "data-parallel ranks gives 8 or 16 per rank"),
    ({"parallelism": {"data_parallel_replicate_degree": 2, "tensor_parallel_degree": 2,
                      "data_parallel_shard_degree": 1}}, "TorchTitan's DDP, which runs with tp"),
]


@pytest.mark.parametrize("sections,message", PIPELINE_CASES,
                         ids=[f"pp-{i}" for i in range(len(PIPELINE_CASES))])
def test_bad_pipeline_settings_before_ranks_start(tmp_path, capsys, monkeypatch, sections,
                                                  message):
    """What run_train.sh checks in one process before torchrun starts 4 ranks."""
    config = config_with(tmp_path, **sections)
    line = one_line_error(*preflight(capsys, monkeypatch, 4, "--job.config_file", str(config)))
    assert message in line, line
    if "stages" in message or "blocks" in message:
        assert "micro-batches" not in line, line


def test_hsdp_over_cp_without_dp_shard_is_planned(tmp_path, capsys, monkeypatch):
    """TorchTitan's hsdp+cp_without_dp_shard: dp_replicate 2 x cp 2 with dp_shard 1 on 4 ranks
    shards over cp and replicates over dp_replicate; auto plans that mesh."""
    from torchtitan_autoparallel.job.request import plan_job

    degrees = ("--parallelism.data_parallel_replicate_degree=2",
               "--parallelism.data_parallel_shard_degree=1",
               "--parallelism.context_parallel_degree=2")
    code, err = preflight(capsys, monkeypatch, 4, "--job.config_file", str(DEBUG_AUTO), *degrees)
    assert code == 0, err
    plan = plan_job(train.parse_config(["--job.config_file", str(DEBUG_AUTO), *degrees]), 4)
    m = plan.mesh
    assert (m.pp, m.dp_replicate, m.dp_shard, m.cp, m.tp) == (1, 2, 1, 2, 1)
    assert all(layer.describe(m.unsharded_label).startswith("fsdp")
               for layer in plan.layers if layer.kind == "block")


@pytest.mark.slow
def test_hsdp_over_cp_without_dp_shard_trains_as_torchtitan(tmp_path):
    """The same mesh under auto and under TorchTitan's own recipe: the same losses (the same
    sharding initialises the same weights)."""
    from tests.support.parity import assert_parity, run_job

    degrees = ["--parallelism.data_parallel_replicate_degree=2",
               "--parallelism.data_parallel_shard_degree=1",
               "--parallelism.context_parallel_degree=2"]
    recipe = run_job("llama3_debug_fsdp.toml", 4, tmp_path / "recipe", degrees)
    auto = run_job("llama3_debug_auto.toml", 4, tmp_path / "auto", degrees)
    assert "mesh dp_replicate=2 dp_shard=1 cp=2 tp=1" in auto.output
    assert_parity(recipe, auto, rtol=1e-6)


# -------------------------------------------------------------- TorchTitan keys auto refuses

SETTINGS_CASES = [
    # (ranks, sections, message)
    (2, {"profiling": {"enable_profiling": True}}, "profiling.enable_profiling needs a GPU"),
    (2, {"model": {"name": "gpt_oss", "flavor": "debugmodel"}},
     "model gpt_oss has no flavor with sdpa attention"),
    (2, {"profiling": {"enable_memory_snapshot": True}}, "enable_memory_snapshot records CUDA"),
    (4, {"training": {"enable_cpu_offload": True}, "optimizer": {"early_step_in_backward": True},
         "parallelism": {"tensor_parallel_degree": 2, "context_parallel_degree": 2}},
     "training.enable_cpu_offload moves FSDP state"),
    (8, {"validation": {"enable": True},
         "parallelism": {"tensor_parallel_degree": 2, "context_parallel_degree": 2,
                         "pipeline_parallel_degree": 2}},
     "validation.seq_len = 2048 exceeds training.seq_len = 256"),
    (8, {"validation": {"enable": True, "seq_len": 128},
         "parallelism": {"tensor_parallel_degree": 2, "context_parallel_degree": 2,
                         "pipeline_parallel_degree": 2}},
     "validation.enable with parallelism.context_parallel_degree = 2"),
    (4, {"validation": {"enable": True, "seq_len": 256, "local_batch_size": 3},
         "parallelism": {"pipeline_parallel_degree": 2}},
     "validation batches need the training's shape"),
    (2, {"checkpoint": {"async_mode": "async_with_pinned_mem"}}, "pinned CUDA host memory"),
    (2, {"fault_tolerance": {"enable": True}}, "fault_tolerance.enable with auto = true"),
    (2, {"memory_estimation": {"enable": True}}, "memory_estimation.enable with auto = true"),
    (2, {"model": {"converters": ["quantize.linear.fp4"]}}, "no registered converter"),
    (2, {"optimizer": {"name": "SGD"}}, "optimizer.name = 'SGD'"),
    (2, {"training.dataloader": {"num_workers": 2}}, "training.dataloader.num_workers = 2"),
    (2, {"training.dataloader": {"pin_memory": True}}, "training.dataloader.pin_memory = True"),
    (4, {"optimizer": {"early_step_in_backward": True},
         "parallelism": {"pipeline_parallel_degree": 2}}, "does not support with PP"),
    (4, {"optimizer": {"early_step_in_backward": True},
         "parallelism": {"data_parallel_replicate_degree": 4}}, "leaves only DDP"),
]


@pytest.mark.parametrize("ngpu,sections,message", SETTINGS_CASES,
                         ids=[f"settings-{i}" for i in range(len(SETTINGS_CASES))])
def test_settings_refused_before_ranks_start(tmp_path, capsys, monkeypatch, ngpu, sections,
                                             message):
    """What run_train.sh checks in one process before torchrun starts the ranks (each of
    these failed after the ranks started, or trained something else, without the check)."""
    config = config_with(tmp_path, **sections)
    line = one_line_error(*preflight(capsys, monkeypatch, ngpu, "--job.config_file",
                                     str(config)))
    assert message in line, line


def test_profiling_refused_through_the_launcher(tmp_path):
    """run_train.sh itself: one line, exit 2, no rank started."""
    config = config_with(tmp_path, profiling={"enable_profiling": True})
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": str(config), "PREFLIGHT": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([str(REPO / "run_train.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    line = one_line_error(proc.returncode, proc.stderr)
    assert "profiling.enable_profiling needs a GPU" in line
    assert "torchrun" not in proc.stdout + proc.stderr
