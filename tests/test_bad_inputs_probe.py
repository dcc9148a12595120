"""Inputs a new user tried on TorchTitan 0.2.2 that once ended in a traceback, planned what
cannot run, or were ignored without a word: each now ends in one line on stderr naming the
problem and the fix (exit 2, no traceback, nothing written) or behaves correctly. The same
cases on TorchTitan 0.3.0: ``tests_v0_3/test_bad_inputs_v0_3.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.parity import REPO
from tests.test_bad_inputs import (
    DEBUG_AUTO,
    cli,
    config_with,
    files_under,
    one_line_error,
    preflight,
)


def planned(capsys, *argv: str) -> dict:
    """A successful ``plan --json``'s plan."""
    from torchtitan_autoparallel.commands.cli import main
    from torchtitan_autoparallel.errors import run_cli

    code = run_cli(lambda: main(["plan", "--config", str(DEBUG_AUTO), "--json", *argv]))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def _run(argv: list[str], cwd: Path = REPO, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           **(env or {})}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------ tracebacks

@pytest.mark.parametrize("command", ["plan", "predict"])
@pytest.mark.parametrize("key", ["tensor_parallel_degree", "context_parallel_degree",
                                 "pipeline_parallel_degree"])
def test_zero_degree_is_one_line(capsys, command, key):
    """tensor_parallel_degree 0 was a ZeroDivisionError in recipe.py (via the recipe margin)."""
    line = one_line_error(*cli(capsys, command, "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               f"--parallelism.{key}", "0"))
    assert f"parallelism.{key} = 0 is invalid: use 1" in line, line


@pytest.mark.parametrize("techniques", [["fsdp"], ["fsdp", "ddp"], ["ddp", "tp"]])
def test_techniques_without_ac_plan_without_ac(capsys, techniques):
    """Any techniques list without "ac" was a KeyError in candidate.rank_time (the recipe
    comparison costs TorchTitan's own AC): it plans, and no block checkpoints."""
    plan = planned(capsys, "--ngpu", "2", f"--autoparallel.techniques={','.join(techniques)}")
    assert {layer["ac"] for layer in plan["layers"] if layer["kind"] == "block"} == {"none"}


def test_selective_ac_without_the_ac_technique_is_one_line(tmp_path, capsys):
    """techniques = ["fsdp"] with selective AC was an IndexError in build_candidate."""
    config = config_with(tmp_path, autoparallel={"techniques": ["fsdp"]},
                         activation_checkpoint={"mode": "selective"})
    line = one_line_error(*cli(capsys, "plan", "--config", str(config), "--ngpu", "2"))
    assert "activation_checkpoint.mode = 'selective'" in line and "leaves out 'ac'" in line
    assert "add 'ac' to autoparallel.techniques" in line


def test_hf_config_json_that_is_not_json(tmp_path, capsys):
    from tests.test_hf_backend import write_job

    config = write_job(tmp_path, auto=True)
    (tmp_path / "hf_model" / "config.json").write_text("{not json")
    # the job's custom_import, tests.support.hf_tiny, imports as the test package does
    line = one_line_error(*cli(capsys, "plan", "--config", config, "--ngpu", "2"))
    assert "config.json is not valid JSON" in line and "hf_transformers.model" in line


# ------------------------------------------------------------------------ plans that cannot run

def test_budget_above_the_devices_memory_is_one_line(capsys):
    """--memory-gib 1000 on an 80 GB H100 profile planned a 172 GiB peak."""
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--hardware", "h100_sxm", "--memory-gib", "1000"))
    assert "memory_gib = 1000 is more than the 79.1 GiB of a 'h100_sxm' device" in line


@pytest.mark.parametrize("hardware,message", [
    ("a100_sxm", "hardware profile 'a100_sxm': float8 needs SM89 or newer"),
    ("cpu", "on the 'cpu' hardware profile: CPU ranks refuse float8"),
])
def test_float8_on_a_device_that_refuses_it_is_one_line(capsys, hardware, message):
    """float8 was planned on a100_sxm (SM80) and on the cpu profile; training then refused it
    (an H100 plan and an emulated one on cpu still plan)."""
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--hardware", hardware, "--model.converters",
                               "quantize.linear.float8"))
    assert message in line, line
    planned(capsys, "--ngpu", "2", "--hardware", "h100_sxm", "--model.converters",
            "quantize.linear.float8")


@pytest.mark.parametrize("ngpu", ["13", "1000003"])
def test_world_the_profiles_nodes_do_not_divide(capsys, ngpu):
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", ngpu,
                               "--hardware", "h100_sxm"))
    assert f"'h100_sxm' has 8 devices per node, which does not divide the world size {ngpu}" \
        in line, line


def test_out_that_is_the_config_is_refused(tmp_path, capsys):
    """``plan --config job.toml --out job.toml`` overwrote the user's TOML with JSON."""
    config = config_with(tmp_path)
    text = config.read_text()
    line = one_line_error(*cli(capsys, "plan", "--config", str(config), "--ngpu", "2",
                               "--out", str(tmp_path / "." / config.name)))
    assert "is the config --config reads" in line
    assert config.read_text() == text and files_under(tmp_path) == {config.name}


# ------------------------------------------------------------------------------ command line

def test_list_options_take_several_values(capsys):
    """``--autoparallel.techniques fsdp ddp ac`` ended in "Unrecognized options: ddp, ac"."""
    plan = planned(capsys, "--ngpu", "2", "--autoparallel.techniques", "fsdp", "ddp", "ac",
                   "--autoparallel.pin", "layers.0", "layers.1")
    assert plan["fingerprint"]["constraints"]["techniques"] == ["ac", "ddp", "fsdp"]
    assert plan["fingerprint"]["pin"] == ["layers.0", "layers.1"]


@pytest.mark.parametrize("arg", [["--parallelism.auto=False"], ["--parallelism.auto", "false"],
                                 ["--autoparallel.measure_memory=true"]])
def test_boolean_with_a_value_says_how_to_set_it(capsys, arg):
    line = one_line_error(*cli(capsys, "predict", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               *arg))
    key = arg[0].split("=")[0]
    section, name = key[2:].split(".")
    assert f"{key} is a flag" in line and f"--{section}.no-{name}" in line, line


def test_auto_yes_in_the_toml_is_one_line(tmp_path, capsys):
    """``auto = "yes"`` ended in "Missing value for argument '--parallelism.auto'"."""
    config = config_with(tmp_path, parallelism={"auto": "yes"})
    line = one_line_error(*cli(capsys, "plan", "--config", str(config), "--ngpu", "2"))
    assert "parallelism.auto = 'yes' is invalid" in line and "auto = true" in line


def test_plan_names_the_model_and_flavor(capsys):
    from torchtitan_autoparallel.commands.cli import main

    assert main(["plan", "--config", str(DEBUG_AUTO), "--ngpu", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1].strip() == \
        "model: llama3 flavor debugmodel, hardware 'cpu'"


@pytest.mark.parametrize("args,message", [
    (["--memory-gib", "-1"], "autoparallel.memory_gib = -1.0 is invalid"),
    (["--gpus-per-node", "-1"], "autoparallel.gpus_per_node = -1 is invalid"),
    (["--training.seq_len", "0"], "training.seq_len = 0 is invalid"),
    (["--training.local-batch-size=-3"], "training.local_batch_size = -3 is invalid"),
    (["--training.steps", "-1"], "training.steps = -1 is invalid"),
])
def test_values_are_checked_before_torchtitan_is_imported(args, message):
    """``seq_len 0`` and ``--memory-gib -1`` came after 5-8 s of imports and model building:
    the same line now comes before torch and TorchTitan are imported."""
    code = ("import sys; from torchtitan_autoparallel.commands.cli import main; "
            "from torchtitan_autoparallel.errors import run_cli; "
            "c = run_cli(lambda: main(sys.argv[1:])); "
            "print('torch' in sys.modules, 'torchtitan' in sys.modules); sys.exit(c)")
    proc = _run([sys.executable, "-c", code, "plan", "--config", str(DEBUG_AUTO), "--ngpu",
                 "2", *args])
    assert message in one_line_error(proc.returncode, proc.stderr)
    assert proc.stdout.split() == ["False", "False"], proc.stdout


def test_no_assets_warning_outside_the_checkout(tmp_path):
    """"HF assets path ./assets/tokenizer does not exist!" before every command run from
    another folder (the package's assets are found; a missing tokenizer is its own line)."""
    proc = _run([sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
                 str(DEBUG_AUTO), "--ngpu", "2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HF assets" not in proc.stdout + proc.stderr
    bad = _run([sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
                str(DEBUG_AUTO), "--ngpu", "2", "--training.seq_len", "abc"], cwd=tmp_path)
    assert "Error parsing --training.seq-len" in one_line_error(bad.returncode, bad.stderr)


# ------------------------------------------------------------------------------ training

def test_plan_refused_as_made_for_another_job_names_only_what_differs(tmp_path, capsys,
                                                                     monkeypatch):
    path = tmp_path / "plan.json"
    assert cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2", "--out",
               str(path))[0] == 0
    line = one_line_error(*preflight(capsys, monkeypatch, 2, "--job.config_file",
                                     str(DEBUG_AUTO), f"--autoparallel.plan_file={path}",
                                     "--parallelism.tensor_parallel_degree=2",
                                     "--training.seq_len=128"))
    assert "constraints: tp plan 0 -> job 2" in line and "seq_len: plan 256 -> job 128" in line
    assert "dp_shard" not in line and "techniques" not in line, line
    assert "plan this job again" in line and len(line) < 500, line
    # the job the plan was made for replays it
    code, err = preflight(capsys, monkeypatch, 2, "--job.config_file", str(DEBUG_AUTO),
                          f"--autoparallel.plan_file={path}")
    assert code == 0, err


@pytest.mark.parametrize("args,message", [
    (["--training.steps", "-1"], "training.steps = -1 is invalid: use an integer >= 1"),
    (["--parallelism.no-auto", "--autoparallel.save_plan=p.json"],
     "save_plan = 'p.json' without parallelism.auto"),
])
def test_training_settings_refused_before_ranks_start(tmp_path, capsys, monkeypatch, args,
                                                      message):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(*preflight(capsys, monkeypatch, 2, "--job.config_file",
                                     str(DEBUG_AUTO), *args))
    assert message in line, line
    assert files_under(tmp_path) == set()


@pytest.mark.parametrize("module", ["", "llama3"])
def test_log_rank_that_no_rank_has_is_one_line(module):
    """LOG_RANK=9 with NGPU=2 showed nothing (both entry points)."""
    proc = _run([str(REPO / "run_train.sh")],
                env={"NGPU": "2", "LOG_RANK": "9", "MODULE": module,
                     "CONFIG_FILE": str(DEBUG_AUTO)})
    line = one_line_error(proc.returncode, proc.stderr)
    assert "LOG_RANK=9" in line and "NGPU=2" in line, line
