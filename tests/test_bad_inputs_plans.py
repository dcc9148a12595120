"""Plan files that were edited or do not fit together, and the smaller holes around them: each
ends in one line (exit 2) with nothing created or replaced, or, where the edit is a plan's own
decision (mesh, strategies), trains with the unchanged job's losses. A plan never changes what
the job computes: its batch, sequence, model and stored inputs are the job's."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.parity import (
    PARITY_OVERRIDES,
    REPO,
    assert_grad_norm_parity,
    assert_parity,
    run_job,
)
from tests.test_bad_inputs import DEBUG_AUTO, cli, files_under, one_line_error, preflight

PROFILES = REPO / "torchtitan_autoparallel" / "profiles"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """The parity job (llama3 debug, PARITY_OVERRIDES) planned for 2 ranks: DDP as solved."""
    from torchtitan_autoparallel.commands.cli import main as cli_main
    from torchtitan_autoparallel.errors import run_cli

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert run_cli(lambda: cli_main(["plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                                     *PARITY_OVERRIDES, "--out", str(path)])) == 0
    assert json.loads(path.read_text())["mesh"]["dp_replicate"] == 2
    return path


def _write(plan_file: Path, folder: Path, edit, name: str = "edited.json") -> Path:
    data = json.loads(plan_file.read_text())
    edit(data)
    path = folder / name
    path.write_text(json.dumps(data))
    return path


def _blocks(data: dict) -> list[dict]:
    return [layer for layer in data["layers"] if layer["kind"] == "block"]


def _fsdp_units_of(size: int):
    def edit(data: dict) -> None:
        data["mesh"].update(dp_replicate=1, dp_shard=2)
        for block in _blocks(data):
            block["fsdp_unit"] = size
    return edit


def _one_layer_fewer(data: dict) -> None:
    data["layers"].pop(3)


def _one_layer_more(data: dict) -> None:
    extra = dict(_blocks(data)[-1], fqn=f"layers.{len(_blocks(data))}")
    data["layers"].insert(len(data["layers"]) - 1, extra)


def _model_edited(data: dict) -> None:
    data["fingerprint"]["model"] = "qwen3"


def _float8_filter_added(data: dict) -> None:
    data["float8_filter_fqns"] = ["output"]


HOLES = {
    "fsdp_unit 6 on 6 blocks": (_fsdp_units_of(6), "fsdp_unit 6"),
    "fsdp_unit 4 on 6 blocks": (_fsdp_units_of(4), "starts an FSDP unit of 4"),
    "one layer fewer": (_one_layer_fewer, "7 planned, 8 in the model"),
    "one layer more": (_one_layer_more, "9 planned, 8 in the model"),
    "fingerprint model edited": (_model_edited, "inputs.model 'llama3' differs"),
    "float8 filter without float8": (_float8_filter_added, "runs no float8 linears"),
}
READERS = ("explain", "show", "diff", "fit", "preflight")


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("hole", list(HOLES))
def test_inconsistent_plans_are_one_line_everywhere(plan_file, tmp_path, capsys, monkeypatch,
                                                    hole, reader):
    """Each of these was a traceback (KeyError, zip ValueError, FileNotFoundError) in some
    reader, or silently ignored by training (the float8 list)."""
    edit, message = HOLES[hole]
    path = _write(plan_file, tmp_path, edit)
    before = files_under(tmp_path)
    if reader == "preflight":
        code, err = preflight(capsys, monkeypatch, 2, "--job.config_file", str(DEBUG_AUTO),
                              *PARITY_OVERRIDES, f"--autoparallel.plan_file={path}")
    elif reader == "show":
        code, err = cli(capsys, "show", str(path), "--out", str(tmp_path / "p.png"))
    elif reader == "diff":
        code, err = cli(capsys, "diff", str(plan_file), str(path))
    elif reader == "fit":
        runs = tmp_path / "runs.csv"
        runs.write_text(f"plan,step_time_s\n{plan_file},0.2\n{path},0.3\n")
        before = files_under(tmp_path)
        code, err = cli(capsys, "fit", str(runs), "--base", "cpu", "--out",
                        str(tmp_path / "fitted.toml"))
    else:
        code, err = cli(capsys, reader, str(path))
    line = one_line_error(code, err)
    assert message in line, line
    assert files_under(tmp_path) == before


def test_edited_batch_is_refused_before_any_rank_starts(plan_file, tmp_path):
    """Global / local batch 32 / 16 where the job says 4: it trained with batch 32 (exit 0,
    only a re-costed warning). Now run_train.sh's preflight ends it; torchrun never starts."""
    def edit(data: dict) -> None:
        data.update(global_batch_size=32, local_batch_size=16)

    path = _write(plan_file, tmp_path, edit)
    result = run_job("llama3_debug_auto.toml", 2, tmp_path / "run",
                     [f"--autoparallel.plan_file={path}"], preflight=True)
    lines = result.output.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.output[-2000:]
    assert "global_batch_size 32 differs from its fingerprint's 4" in lines[0]
    assert "Traceback" not in result.output and not result.rows


def _with(key: str, value) -> object:
    def edit(data: dict) -> None:
        data[key] = value
    return edit


def _nested(section: str, key: str, value) -> object:
    def edit(data: dict) -> None:
        data[section][key] = value
    return edit


def _first_block(**fields) -> object:
    def edit(data: dict) -> None:
        _blocks(data)[0].update(fields)
    return edit


def _pipeline_added(data: dict) -> None:
    data["pipeline"] = {"schedule": "1F1B", "stages_per_rank": 1, "microbatches": 2,
                        "microbatch_size": 1, "stages": [[layer["fqn"] for layer in
                                                          data["layers"]]]}


# Every top-level field of a plan file, edited alone: refused with the line given, or accepted
# as a decision of the plan ("same": nothing the job runs changes, the plan's digest is the
# file's; "trains": the ranks run the edit, with the 1-rank losses).
TOP_LEVEL_EDITS = {
    "version": (_with("version", 1), "same"),
    "fingerprint": (_nested("fingerprint", "model_hash", "0" * 16), "made for another job"),
    "mesh": (lambda d: d["mesh"].update(dp_replicate=1, dp_shard=2), "trains"),
    "global_batch_size": (_with("global_batch_size", 8), "global_batch_size 8 != "),
    "local_batch_size": (_with("local_batch_size", 1), "global_batch_size 4 != "),
    "gradient_accumulation_steps": (_with("gradient_accumulation_steps", 2),
                                    "gradient_accumulation_steps 2"),
    "seq_len": (_with("seq_len", 64), "seq_len 64 differs from its fingerprint's 128"),
    "layers": (_first_block(ac="full"), "trains"),
    "predicted": (_nested("predicted", "step_time_s", 1e-3), "same"),
    "solver": (_nested("solver", "status", "Time limit reached"), "same"),
    "notes": (_with("notes", ["edited"]), "same"),
    "pipeline": (_pipeline_added, "a pipeline section needs mesh pp > 1"),
    "float8_filter_fqns": (_float8_filter_added, "runs no float8 linears"),
    "inputs": (lambda d: d["inputs"].update(budget_bytes=2.0 ** 33),
               "stores planning inputs that are not the job's (budget_bytes"),
}


def test_every_top_level_field_is_edited():
    from torchtitan_autoparallel.plan.schema import Plan

    assert set(TOP_LEVEL_EDITS) == {f.name for f in dataclasses.fields(Plan)}


@pytest.mark.parametrize("field", [k for k, (_, outcome) in TOP_LEVEL_EDITS.items()
                                   if outcome not in ("same", "trains")])
def test_edited_field_is_refused_against_the_job(plan_file, tmp_path, capsys, monkeypatch,
                                                 field):
    edit, message = TOP_LEVEL_EDITS[field]
    path = _write(plan_file, tmp_path, edit)
    saved = tmp_path / "saved.json"
    line = one_line_error(*preflight(capsys, monkeypatch, 2, "--job.config_file",
                                     str(DEBUG_AUTO), *PARITY_OVERRIDES,
                                     f"--autoparallel.plan_file={path}",
                                     f"--autoparallel.save_plan={saved}"))
    assert message in line, line
    assert files_under(tmp_path) == {"edited.json"}


@pytest.mark.parametrize("field", [k for k, (_, outcome) in TOP_LEVEL_EDITS.items()
                                   if outcome == "same"])
def test_edited_field_that_changes_nothing_applies_the_files_decisions(plan_file, tmp_path,
                                                                       monkeypatch, field):
    """What the job runs is the unedited plan's (equal digests apply identically)."""
    from torchtitan_autoparallel.launch import resolve_plan
    from torchtitan_autoparallel.plan.schema import Plan
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    path = _write(plan_file, tmp_path, TOP_LEVEL_EDITS[field][0])
    job = parse_config(["--job.config_file", str(DEBUG_AUTO), *PARITY_OVERRIDES,
                        f"--autoparallel.plan_file={path}"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_plan(job, 2).digest() == Plan.load(str(plan_file)).digest()


@pytest.mark.parametrize("field", [k for k, (_, outcome) in TOP_LEVEL_EDITS.items()
                                   if outcome == "trains"])
def test_edited_decision_trains_with_the_jobs_losses(plan_file, references, tmp_path, field):
    """The DDP plan edited to FSDP (another factorisation of 2 ranks), or with full AC on its
    first block: applied as edited, with the warning that its predictions were re-costed, and
    trained with the 1-rank losses."""
    seed, reference = references("llama3")
    path = _write(plan_file, tmp_path, TOP_LEVEL_EDITS[field][0])
    result = run_job("llama3_debug_auto.toml", 2, tmp_path / "run",
                     [f"--autoparallel.plan_file={path}"], seed_checkpoint=seed)
    assert result.returncode == 0, result.output[-3000:]
    assert "the re-costed ones are used" in result.output
    if field == "mesh":
        assert "mesh dp_replicate=1 dp_shard=2" in result.output
    else:
        assert re.search(r"layers\.0\s+\S*ac:full", result.output), result.output[-3000:]
    assert_parity(reference, result)
    assert_grad_norm_parity(reference, result)


# ------------------------------------------------------------------------------ outputs

@pytest.mark.parametrize("verb", ["plan", "show"])
def test_out_into_a_missing_folder_is_refused(plan_file, tmp_path, capsys, verb):
    """The folders used to be created, even at the filesystem root."""
    for folder in (tmp_path / "missing" / "deeper", Path(f"/nonexistent_{os.getpid()}")):
        target = folder / ("p.json" if verb == "plan" else "p.png")
        argv = (["plan", "--config", str(DEBUG_AUTO), "--ngpu", "2", "--out", str(target)]
                if verb == "plan" else ["show", str(plan_file), "--out", str(target)])
        line = one_line_error(*cli(capsys, *argv))
        assert "its folder does not exist" in line and str(target) in line, line
        assert not folder.exists() and not folder.parent.joinpath("missing").exists()


def test_calibrate_checks_its_target_before_measuring(tmp_path, capsys, monkeypatch):
    """A folder as --out failed only after all the measurements; a .json name got TOML."""
    import torchtitan_autoparallel.fitting.calibrate as calibrate

    def measured(*args, **kwargs):
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(calibrate, "calibrate", measured)
    line = one_line_error(*cli(capsys, "calibrate", "--out", str(tmp_path), "--quick"))
    assert "it is a directory" in line
    line = one_line_error(*cli(capsys, "calibrate", "--out", str(tmp_path / "c.json"),
                               "--quick"))
    assert ".toml suffix" in line and files_under(tmp_path) == set()


# ------------------------------------------------------------------------------ profiles

def test_hardware_that_is_a_directory(capsys):
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--hardware", str(PROFILES)))
    assert "is a directory" in line and "unknown" not in line


@pytest.mark.parametrize("key,value", [("peak_tflops", 1e-30), ("intra_node_gbps", 1e-9),
                                       ("memory_gib", 1e-9), ("matmul_efficiency", 1e-9)])
def test_profile_constants_out_of_any_sane_range(tmp_path, capsys, key, value):
    """peak_tflops = 1e-30 planned a step of 1.7e29 s without a word."""
    lines = (PROFILES / "cpu.toml").read_text().splitlines()
    text = "\n".join(f"{key} = {value}" if line.startswith(f"{key} =") else line
                     for line in lines)
    path = tmp_path / "tiny.toml"
    path.write_text(text + "\n")
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--hardware", str(path)))
    assert f"{key} = {value}" in line


# ------------------------------------------------------------------------------ messages

def test_recosted_warning_is_said_once(plan_file, tmp_path, capsys):
    path = _write(plan_file, tmp_path, TOP_LEVEL_EDITS["predicted"][0])
    code, err = cli(capsys, "diff", str(path), str(path))
    assert code == 0 and err.count("the re-costed ones are used") == 1, err


def test_plan_of_a_config_without_auto_says_so(tmp_path, capsys):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    from torchtitan_autoparallel.commands.cli import main as cli_main
    from torchtitan_autoparallel.errors import run_cli

    assert run_cli(lambda: cli_main(["plan", "--config", str(empty), "--ngpu", "2"])) == 0
    out = capsys.readouterr().out
    assert "does not set parallelism.auto = true" in out
    assert run_cli(lambda: cli_main(["plan", "--config", str(DEBUG_AUTO), "--ngpu", "2"])) == 0
    assert "does not set parallelism.auto" not in capsys.readouterr().out


def test_plan_refuses_a_plan_file(plan_file, capsys):
    """plan solves afresh: a plan_file given to it was ignored."""
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               f"--autoparallel.plan_file={plan_file}"))
    assert "plan solves the job afresh" in line


def test_configs_parse_without_tomllib():
    """Python 3.10 has no tomllib; the package falls back to tomli (a dependency)."""
    code = ("import sys; sys.modules['tomllib'] = None\n"
            "from torchtitan_autoparallel.titan.v0_2.job import read_toml\n"
            f"print(read_toml({str(DEBUG_AUTO)!r})['parallelism']['auto'])\n"
            "from torchtitan_autoparallel.cost.hardware import load_profile\n"
            "print(load_profile('h100_sxm').name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["True", "h100_sxm"], out.stderr


def test_float8_emulate_plans_on_a_profile_without_gemm_tables(capsys):
    """``--quantize.linear.float8.emulate`` on the CPU profile ended in a FileNotFoundError
    traceback (``profiles/kernels/.csv``) while the notes were written."""
    from torchtitan_autoparallel.commands.cli import main as cli_main
    from torchtitan_autoparallel.errors import run_cli

    code = run_cli(lambda: cli_main(["plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                                     "--model.converters", "quantize.linear.float8",
                                     "--quantize.linear.float8.emulate"]))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "has no GEMM table" in captured.out and "Traceback" not in captured.err
