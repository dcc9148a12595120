"""Inputs a new user tried on TorchTitan 0.3.0 that once ended in a traceback, planned what
cannot run, or were ignored without a word: each now ends in one line on stderr naming the
problem and the fix (exit 2, no traceback, nothing written) or behaves correctly. The 0.2.2
side: ``tests/test_bad_inputs_probe.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ASSETS = REPO / "torchtitan_autoparallel" / "assets"
BIN = Path(sys.executable).parent
DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel"]


def _require_0_3() -> None:
    from importlib.metadata import version

    if not version("torchtitan").startswith("0.3."):
        raise RuntimeError("tests_v0_3 runs with TorchTitan 0.3.0 installed (see the README)")


_require_0_3()


def one_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in err and len(lines[0]) < 700, lines[0]
    return lines[0]


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """The command in this process (the models TorchTitan registers are read once)."""
    from torchtitan_autoparallel.commands.cli import main
    from torchtitan_autoparallel.errors import run_cli

    code = run_cli(lambda: main(list(argv)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_error(capsys, *argv: str) -> str:
    code, _, err = cli(capsys, *argv)
    return one_line(code, err)


def planned(capsys, *argv: str) -> dict:
    code, out, err = cli(capsys, "plan", *argv, "--json")
    assert code == 0, err[-3000:]
    return json.loads(out)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


def preflight(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """What run_train.sh runs before it starts the ranks (parse, check, plan on rank 0)."""
    env = _env(AUTOPARALLEL_PREFLIGHT="1", NGPU="2", WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    return subprocess.run([sys.executable, "-m", "torchtitan_autoparallel.titan.v0_3.train",
                           *DEBUG, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _errors(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a run whose stderr also carries TorchTitan's log."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


# ------------------------------------------------------------------------------ tracebacks

@pytest.mark.parametrize("command", ["plan", "predict"])
def test_zero_degree_is_one_line(capsys, command):
    line = cli_error(capsys, command, *DEBUG, "--ngpu", "2",
                     "--parallelism.tensor_parallel_degree", "0")
    assert "parallelism.tensor_parallel_degree = 0 is invalid: use 1" in line, line


def test_techniques_without_ac_plan_without_ac(capsys):
    plan = planned(capsys, *DEBUG, "--ngpu", "2", "--autoparallel.techniques", "fsdp")
    assert {layer["ac"] for layer in plan["layers"] if layer["kind"] == "block"} == {"none"}


REGISTRY = '''\
def returns_none():
    return None


def returns_dict():
    return {"model": "llama3"}


def raises():
    raise RuntimeError("no such cluster")
'''


@pytest.mark.parametrize("module,function,message", [
    ("user_configs", "returns_none", "returned NoneType, not a Trainer.Config"),
    ("user_configs", "returns_dict", "returned dict, not a Trainer.Config"),
    ("user_configs", "raises", "raised RuntimeError: no such cluster; fix the function"),
    ("broken_configs", "anything", "config registry does not import: invalid syntax"),
])
def test_config_functions_that_do_not_give_a_config(tmp_path, capsys, monkeypatch, module,
                                                    function, message):
    (tmp_path / "user_configs.py").write_text(REGISTRY)
    (tmp_path / "broken_configs.py").write_text("def f(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = cli_error(capsys, "plan", "--module", module, "--config", function, "--ngpu", "2")
    assert message in line, line


def test_hf_config_json_that_is_not_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    line = cli_error(capsys, "plan", "--module", "transformers_modeling_backend", "--config",
                     "transformers_modeling_backend_debugmodel", "--hf_model", str(tmp_path),
                     "--ngpu", "2")
    assert "hf_model" in line and "config.json is not valid JSON" in line, line


def test_fit_reads_0_3_plans(tmp_path, capsys):
    """``fit`` imported 0.2.2's train specs; it fits a profile to runs of 0.3.0 plans."""
    rows = []
    for name, techniques in (("ddp", "ddp"), ("fsdp", "fsdp,ac")):
        path = tmp_path / f"{name}.json"
        assert cli(capsys, "plan", *DEBUG, "--ngpu", "2", "--out", str(path),
                   f"--autoparallel.techniques={techniques}")[0] == 0
        rows.append(f"{path.name},{1.5 if name == 'ddp' else 1.9}")
    (tmp_path / "runs.csv").write_text("plan,step_time_s\n" + "\n".join(rows) + "\n")
    out = tmp_path / "fitted.toml"
    code, _, err = cli(capsys, "fit", str(tmp_path / "runs.csv"), "--base", "cpu", "--out",
                       str(out), "--no-cv", "--free", "matmul_efficiency")
    assert code == 0 and out.is_file(), err[-2000:]


# ------------------------------------------------------------------------ plans that cannot run

@pytest.mark.parametrize("ngpu", ["13", "1000003"])
def test_world_the_profiles_nodes_do_not_divide(capsys, ngpu):
    line = cli_error(capsys, "plan", "--module", "llama3", "--config", "llama3_8b", "--ngpu",
                     ngpu, "--hardware", "h100_sxm")
    assert f"'h100_sxm' has 8 devices per node, which does not divide the world size {ngpu}" \
        in line, line


def test_budget_above_the_devices_memory_is_one_line(capsys):
    line = cli_error(capsys, "plan", *DEBUG, "--ngpu", "2", "--hardware", "h100_sxm",
                     "--memory-gib", "1000")
    assert "memory_gib = 1000 is more than the 79.1 GiB of a 'h100_sxm' device" in line


def test_float8_config_plans_offline_for_the_gpus_it_runs_on(capsys):
    """llama3_405b (float8 linears) stopped in torchao's "float8 is only supported on SM89" on a
    planning machine without a GPU: it plans for H100s, and a100_sxm / cpu refuse float8 as
    training there would."""
    plan = planned(capsys, "--module", "llama3", "--config", "llama3_405b", "--ngpu", "128",
                   "--hardware", "h100_sxm")
    assert plan["fingerprint"]["features"]["linear"] == "float8_rowwise"
    for hardware, message in (("a100_sxm", "hardware profile 'a100_sxm': float8 needs SM89"),
                              ("cpu", "on the 'cpu' hardware profile: CPU ranks refuse")):
        line = cli_error(capsys, "plan", "--module", "llama3", "--config", "llama3_405b",
                         "--ngpu", "128", "--hardware", hardware)
        assert message in line, line


def test_ep_that_does_not_divide_the_experts_says_so_first(capsys):
    """It was first reported as a CUDA graphs problem (TorchTitan's config check)."""
    line = cli_error(capsys, "plan", "--module", "deepseek_v3", "--config",
                     "deepseek_v3_debugmodel", "--ngpu", "3",
                     "--parallelism.expert_parallel_degree", "3")
    assert "expert_parallel_degree = 3 does not divide the 8 experts" in line, line


# ------------------------------------------------------------------------------ command line

def test_subcommand_after_the_overrides(capsys):
    """``plan ... activation-checkpoint:full`` (the README's syntax) failed: ``plan`` put its
    own ``--parallelism.auto`` after the subcommand."""
    plan = planned(capsys, *DEBUG, "--ngpu", "2", "activation-checkpoint:full")
    assert {layer["ac"] for layer in plan["layers"] if layer["kind"] == "block"} == {"full"}


def test_list_options_take_several_values(capsys):
    plan = planned(capsys, *DEBUG, "--ngpu", "2", "--autoparallel.techniques", "fsdp", "ddp",
                   "ac", "--autoparallel.pin", "layers.0", "layers.1")
    assert plan["fingerprint"]["constraints"]["techniques"] == ["ac", "ddp", "fsdp"]
    assert plan["fingerprint"]["pin"] == ["layers.0", "layers.1"]


def test_values_are_checked_before_torchtitan_is_imported():
    """``seq_len 0`` came after the imports and the config function's model."""
    code = ("import sys; from torchtitan_autoparallel.commands.cli import main; "
            "from torchtitan_autoparallel.errors import run_cli; "
            "c = run_cli(lambda: main(sys.argv[1:])); print('torchtitan' in sys.modules); "
            "sys.exit(c)")
    proc = subprocess.run([sys.executable, "-c", code, "plan", *DEBUG, "--ngpu", "2",
                           "--training.seq_len", "0"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert "training.seq_len = 0 is invalid" in one_line(proc.returncode, proc.stderr)
    assert proc.stdout.split() == ["False"]


def test_commands_on_0_3_leave_0_2s_package_alone():
    """``plan`` and ``predict`` of a 0.3.0 job import nothing of the 0.2.2 front-end, whose
    package registers 0.2.2's adapters when imported (``plan`` did, for a TOML-only check, and
    a process that had read 0.3.0's families first then offered DeepSeek-V3's MoE blocks
    0.2.2's sub-block modes)."""
    code = ("import sys; import torchtitan_autoparallel.titan.v0_3; "
            "from torchtitan_autoparallel.commands.cli import main; "
            "from torchtitan_autoparallel.graph.adapters import registered_adapter; "
            "codes = [main([c, *sys.argv[1:]]) for c in ('plan', 'predict')]; "
            "print(codes, 'torchtitan_autoparallel.titan.v0_2' in sys.modules, "
            "registered_adapter('deepseek_v3').moe_sub_block_modes)")
    proc = subprocess.run([sys.executable, "-c", code, "--module", "deepseek_v3", "--config",
                           "deepseek_v3_debugmodel", "--ngpu", "4"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == ("[0, 0] False ('sp/dp', 'dp/sp', 'sp/sp:shared_dp', "
                                            "'dp/sp:shared_dp')"), proc.stdout[-2000:]


def test_auto_false_says_how_to_turn_auto_off(capsys):
    line = cli_error(capsys, "predict", *DEBUG, "--ngpu", "2", "--parallelism.auto=False")
    assert "--parallelism.auto is a flag" in line and "--parallelism.no-auto" in line


def test_no_checkpoint_default_warning_and_the_model_named():
    """"initial_load_model_only=True has no effect" was in 91 of 142 outputs, sometimes inside
    the error line; the plan names the model and flavor it planned."""
    env = _env()
    ok = subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", "plan", *DEBUG,
                         "--ngpu", "2"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = ok.stdout.splitlines()
    table = next(i for i, line in enumerate(lines) if line.startswith("autoparallel plan "))
    assert lines[table + 1].strip() == "model: llama3 flavor debugmodel, hardware 'cpu'"
    bad = subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", "plan", *DEBUG,
                          "--ngpu", "2", "--parallelism.bogus", "1"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    one_line(bad.returncode, bad.stderr)
    assert "initial_load_model_only" not in ok.stdout + ok.stderr + bad.stderr


# ------------------------------------------------------------------------------ training

def test_plan_file_without_auto_is_replayed_on_cpu_ranks(tmp_path, capsys):
    """A plan file without --parallelism.auto trained TorchTitan's recipe and never read it;
    and the plan ``plan`` made for exactly the job was refused on CPU ranks (they hold CP at
    1). Both replay it; an edited job names only what differs."""
    path = tmp_path / "plan.json"
    assert cli(capsys, "plan", *DEBUG, "--ngpu", "2", "--out", str(path))[0] == 0
    digest = json.loads(path.read_text())["mesh"]
    proc = preflight(f"--autoparallel.plan_file={path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"dp_replicate={digest['dp_replicate']} dp_shard={digest['dp_shard']}" in proc.stdout
    line = _errors(preflight(f"--autoparallel.plan_file={path}", "--training.seq_len", "128"))
    assert "seq_len: plan 2048 -> job 128" in line and "plan this job again" in line, line
    assert "constraints" not in line


def test_save_plan_is_written_and_refused_where_nothing_is_planned(tmp_path):
    saved = tmp_path / "saved.json"
    proc = preflight("--parallelism.auto", f"--autoparallel.save_plan={saved}")
    assert proc.returncode == 0 and json.loads(saved.read_text())["mesh"], proc.stderr[-3000:]
    line = _errors(preflight("--parallelism.auto",
                             f"--autoparallel.save_plan={tmp_path / 'no' / 'p.json'}"))
    assert "its folder does not exist" in line
    line = _errors(preflight(f"--autoparallel.save_plan={tmp_path / 'x.json'}"))
    assert "without parallelism.auto" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved.json"]


def test_steps_below_one_is_one_line():
    line = _errors(preflight("--training.steps", "-1"))
    assert "training.steps = -1 is invalid: use an integer >= 1" in line


def test_log_rank_that_no_rank_has_is_one_line():
    proc = subprocess.run([str(REPO / "run_train.sh")], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env=_env(NGPU="2", LOG_RANK="9", MODULE="llama3"))
    line = one_line(proc.returncode, proc.stderr)
    assert "LOG_RANK=9" in line and "NGPU=2" in line


def test_metrics_file_and_measured_memory(tmp_path):
    """``--autoparallel.metrics_file`` and ``measure_memory`` wrote nothing on 0.3.0: one
    rank, 3 steps, under auto: a row per step, step 2 measured by MemTracker."""
    metrics = tmp_path / "metrics.jsonl"
    args = [*DEBUG, "--parallelism.auto", "--training.steps", "3", "--training.seq_len", "128",
            "--training.local_batch_size", "2", "--training.global_batch_size", "2",
            "--hf_assets_path", str(ASSETS / "tokenizer"), "--dataloader.dataset_path",
            str(ASSETS / "data"), "--metrics.log_freq", "1",
            f"--autoparallel.metrics_file={metrics}", "--autoparallel.measure_memory"]
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "1", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "-m", "torchtitan_autoparallel.titan.v0_3.train",
           *args]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
    out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, out[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["loss"] > 0 and row["step_time_s"] > 0 for row in rows)
    assert rows[1]["measured_tensor_peak_gib"] > 0
