"""Bad inputs that are files and processes rather than values: plan files that are FIFOs,
devices or far too large, outputs onto things that are not regular files, the user's umask,
SIGTERM / SIGINT while writing or planning, edited plans (inputs, predictions, mesh), profiles
in the wrong units or with a BOM, batches too large to enumerate, node sizes that do not
divide the world, and what ``plan`` must refuse as the launcher's preflight does. Each ends in
one line (exit 2), within a time bound, with no file left behind or replaced."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.parity import REPO
from tests.test_bad_inputs import DEBUG_AUTO, cli, files_under, one_line_error

PROFILE = REPO / "torchtitan_autoparallel" / "profiles" / "h100_sxm.toml"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """A fresh plan of llama3 debug on 4 ranks (DDP as solved)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
                           str(DEBUG_AUTO), "--ngpu", "4", "--out", str(path)], cwd=REPO,
                          capture_output=True, timeout=300).returncode == 0
    return path


def _edited(plan_file: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(plan_file.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


# ------------------------------------------------------------------------------ reading

def test_plan_files_that_are_not_regular_or_too_large(plan_file, tmp_path, capsys):
    """A FIFO without a writer and /dev/zero would block or never end; a 20 MiB file is not a
    plan. Each is one line at once."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big.json"
    big.write_text(plan_file.read_text()[:-2] + ', "pad": "' + "x" * (20 << 20) + '"}')
    for path, message in ((fifo, "is not a regular file"), (zero, "is not a regular file"),
                          (big, "more than the 16 MiB")):
        start = time.monotonic()
        line = one_line_error(*cli(capsys, "explain", str(path)))
        assert message in line and time.monotonic() - start < 20, line


def test_plan_file_with_a_bom_is_read(plan_file, tmp_path, capsys):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + plan_file.read_bytes())
    code, _ = cli(capsys, "explain", str(path))
    assert code == 0


def test_profile_in_wrong_units_and_with_a_bom(tmp_path, capsys):
    """Link bandwidth in bytes/s instead of GB/s is out of range, named with the units; a UTF-8
    BOM (written by some editors) is read."""
    text = PROFILE.read_text()
    wrong = tmp_path / "bytes.toml"
    wrong.write_text("\n".join("intra_node_gbps = 3.6e11" if line.startswith("intra_node_gbps")
                               else line for line in text.splitlines()) + "\n")
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--hardware", str(wrong)))
    assert "intra_node_gbps" in line and "GB/s" in line
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    code, err = cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2", "--hardware",
                    str(bom))
    assert code == 0, err


# ------------------------------------------------------------------------------ writing

@pytest.mark.parametrize("kind", ["fifo", "symlink", "device"])
def test_out_refuses_what_is_not_a_regular_file(tmp_path, capsys, kind):
    """``--out`` onto a FIFO, a symlink or a device node: refused before planning, the target
    left as it was."""
    target = tmp_path / "out.json"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        (tmp_path / "elsewhere.json").write_text("keep")
        target.symlink_to(tmp_path / "elsewhere.json")
    else:
        target = Path("/dev/null")
    before = os.lstat(target)
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--out", str(target)))
    assert "name a new path or a regular file" in line
    after = os.lstat(target)
    assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(before.st_mode),
                                                        before.st_ino)
    if kind == "symlink":
        assert (tmp_path / "elsewhere.json").read_text() == "keep"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_take_the_users_umask(tmp_path, umask):
    from torchtitan_autoparallel.errors import atomic_write

    old = os.umask(umask)
    try:
        atomic_write(str(tmp_path / "plan.json"), "{}", "plan")
        (tmp_path / "reference").write_text("{}")  # what open() makes under this umask
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "plan.json").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "reference").stat().st_mode) == 0o666 & ~umask


def test_sigterm_while_writing_leaves_nothing(tmp_path, monkeypatch):
    """SIGTERM between writing the temp file and renaming it: the temp file is removed, the old
    file stays, and the error says nothing was written."""
    from torchtitan_autoparallel import errors

    target = tmp_path / "plan.json"
    target.write_text("old")
    real_fsync = os.fsync

    def terminated(fd: int) -> None:
        real_fsync(fd)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(errors.os, "fsync", terminated)
    with pytest.raises(errors.UserError, match="terminated while writing"):
        errors.atomic_write(str(target), "new", "plan")
    assert files_under(tmp_path) == {"plan.json"} and target.read_text() == "old"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_show_writes_both_files_or_neither(plan_file, tmp_path, capsys):
    """``show --out ok.png --html <unwritable>`` used to leave ok.png behind."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(*cli(capsys, "show", str(plan_file), "--out",
                               str(tmp_path / "ok.png"), "--html",
                               str(blocker / "plan.html")))
    assert "cannot write picture" in line
    assert files_under(tmp_path) == {"file"}


def test_sigint_during_plan_is_one_line():
    """Ctrl-C while planning (here: while torch imports or the search runs) ends in one line,
    no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
                             str(REPO / "train_configs" / "llama3_8b_auto.toml"), "--ngpu",
                             "64", "--hardware", "h100_sxm"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2)  # inside torch's import or the search: planning takes well over 2 s
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # 130, or killed by the SIGINT itself (-2) when the interpreter re-raises it on its way
    # out (seen about once in five runs); either way the user sees the one line
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err
    # the one line is the last: what torch / torchao print while importing may come before it
    assert err.strip().splitlines()[-1] == "error: interrupted; nothing was written", err
    assert err.count("error:") == 1, err


# ------------------------------------------------------------------------------ planning

def test_huge_batch_is_bounded(capsys):
    """2**62 sequences used to hang the search (divisors by trial up to the batch): now a range
    error; the largest accepted batch plans in seconds."""
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "4",
                               "--training.global_batch_size", str(2**62)))
    assert "training.global_batch_size" in line and "<= 16777216" in line
    start = time.monotonic()
    code, err = cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "4",
                    "--training.global_batch_size", str(2**24))
    assert code == 0 and time.monotonic() - start < 30, err


def test_gpus_per_node_must_divide_the_world(capsys):
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "4",
                               "--gpus-per-node", "3"))
    assert "gpus_per_node = 3 does not divide the world size 4" in line


def test_huge_flavor_is_cut_in_the_error(capsys):
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               "--model.flavor", "x" * 10_000_000))
    assert "unknown flavor" in line and "debugmodel" in line


@pytest.mark.parametrize("overrides,message", [
    (("--training.dtype", "bfloat16"), "training.dtype = 'bfloat16' with auto = true"),
    (("--model.converters", "nope"), "no registered converter"),
])
def test_plan_refuses_what_the_preflight_refuses(capsys, overrides, message):
    """``plan`` runs the launcher's checks: a job training would refuse is not planned."""
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                               *overrides))
    assert message in line, line


def test_cpu_offload_plans_fsdp(capsys):
    """CPU offload is FSDP's: the search keeps to sharded meshes (it used to cost offload on a
    DDP plan that training then refused); one rank cannot shard, which is one line."""
    code = cli_ok(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
                  "--training.enable_cpu_offload", "--json")
    assert code["mesh"]["dp_shard"] * code["mesh"]["cp"] > 1
    line = one_line_error(*cli(capsys, "plan", "--config", str(DEBUG_AUTO), "--ngpu", "1",
                               "--training.enable_cpu_offload"))
    assert "enable_cpu_offload is FSDP's CPU offload" in line


def cli_ok(capsys, *argv: str) -> dict:
    """A successful ``--json`` run's plan."""
    from torchtitan_autoparallel.commands.cli import main as cli_main
    from torchtitan_autoparallel.errors import run_cli

    assert run_cli(lambda: cli_main(list(argv))) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------ edited plans

def test_edited_inputs_are_checked(plan_file, tmp_path, capsys):
    """A negative peak in the stored profile used to show negative times."""
    def edit(data: dict) -> None:
        data["inputs"]["hardware"]["peak_tflops"] = -1

    line = one_line_error(*cli(capsys, "explain", str(_edited(plan_file, tmp_path, edit))))
    assert "peak_tflops = -1" in line


def test_edited_prediction_is_recosted_not_replayed(plan_file, tmp_path, capsys):
    """A step time edited to 1 ms is not shown: the plan is re-costed from its own mesh and
    strategies, with a warning; diff compares what the plans cost, so the two are identical."""
    def edit(data: dict) -> None:
        data["predicted"]["step_time_s"] = 0.001

    path = _edited(plan_file, tmp_path, edit)
    code = run_json(capsys, "explain", str(path), "--json")
    truth = json.loads(plan_file.read_text())["predicted"]["step_time_s"]
    assert code["plan"]["predicted"]["step_time_s"] == pytest.approx(truth, rel=1e-6)
    code, err = cli(capsys, "diff", str(plan_file), str(path))
    assert code == 0 and "the re-costed ones are used" in err


def test_edited_inputs_show_in_diff(plan_file, tmp_path, capsys):
    """A plan whose stored profile was edited is not "identical": diff names the input."""
    def edit(data: dict) -> None:
        data["inputs"]["hardware"]["peak_tflops"] *= 2

    from torchtitan_autoparallel.commands.cli import main as cli_main
    from torchtitan_autoparallel.errors import run_cli

    code = run_cli(lambda: cli_main(["diff", str(plan_file),
                                     str(_edited(plan_file, tmp_path, edit))]))
    out = capsys.readouterr().out
    assert code == 1 and "inputs hardware.peak_tflops" in out, out


@pytest.mark.parametrize("mesh", [{"dp_replicate": 1, "dp_shard": 4},
                                  {"dp_replicate": 2, "dp_shard": 2}])
def test_plan_with_an_edited_mesh_is_explained_and_shown(plan_file, tmp_path, capsys, mesh):
    """Another valid factorisation of the world: explain and show cost it as it now is."""
    def edit(data: dict) -> None:
        data["mesh"].update(mesh)

    path = _edited(plan_file, tmp_path, edit)
    explained = run_json(capsys, "explain", str(path), "--json")
    assert {k: explained["plan"]["mesh"][k] for k in mesh} == mesh
    assert explained["plan"]["predicted"]["step_time_s"] != pytest.approx(
        json.loads(plan_file.read_text())["predicted"]["step_time_s"], rel=1e-6)
    code, err = cli(capsys, "show", str(path), "--out", str(tmp_path / "p.png"))
    assert code == 0 and (tmp_path / "p.png").stat().st_size > 0, err


def run_json(capsys, *argv: str) -> dict:
    from torchtitan_autoparallel.commands.cli import main as cli_main
    from torchtitan_autoparallel.errors import run_cli

    code = run_cli(lambda: cli_main(list(argv)))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


# ------------------------------------------------------------------------------ fit

def test_fit_refuses_absurd_step_times(plan_file, tmp_path, capsys):
    """Step times of 1e300 s used to be fitted and written as a profile."""
    csv = tmp_path / "runs.csv"
    csv.write_text(f"plan,step_time_s\n{plan_file},1e300\n")
    out = tmp_path / "fitted.toml"
    line = one_line_error(*cli(capsys, "fit", str(csv), "--base", "cpu", "--out", str(out)))
    assert "step_time_s" in line and not out.exists()


def test_memory_measurement_keeps_to_schedules_it_can_measure(capsys):
    """MemTracker fails inside torch's split backward (zero-bubble schedules): a fixed one is
    one line, and a searched pipeline keeps to the others."""
    base = ("plan", "--config", str(DEBUG_AUTO), "--ngpu", "2",
            "--parallelism.pipeline_parallel_degree", "2", "--autoparallel.measure_memory")
    line = one_line_error(*cli(capsys, *base, "--parallelism.pipeline_parallel_schedule",
                               "ZBVZeroBubble"))
    assert "cannot measure pipeline schedule ZBVZeroBubble" in line
    plan = cli_ok(capsys, *base, "--json")
    assert plan["pipeline"]["schedule"] in ("1F1B", "GPipe", "Interleaved1F1B")
