"""Fault injection: SIGKILL one rank mid-run with checkpointing on. The same command run again
resumes from the last checkpoint with the same plan and its losses equal an uninterrupted run;
a restart on fewer ranks re-plans, resumes from the same checkpoint, and matches as well."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.parity import REPO, RunResult, assert_parity, job_command, read_rows, run_job

CONFIG = "llama3_debug_auto.toml"
STEPS = 10
PLAN_RE = re.compile(r"autoparallel plan (\w+): mesh (.*) \(world")


def checkpointed(folder: Path) -> list[str]:
    return [f"--training.steps={STEPS}", "--checkpoint.enable", f"--checkpoint.folder={folder}",
            "--checkpoint.interval=2", "--checkpoint.no-last_save_model_only"]


def rank_pid(root: int, rank: int) -> int | None:
    """The training process of ``rank`` among the descendants of ``root`` (torchrun's
    workers carry RANK in their environment)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"AUTOPARALLEL_PREFLIGHT=1" not in env:
            return pid
    return None


def run_and_kill_rank(tmp_path: Path, folder: Path, ngpu: int, victim: int) -> RunResult:
    """Start the job, SIGKILL rank ``victim`` once a checkpoint exists and a later step has
    run, and wait for the launcher to give up."""
    cmd, env, metrics = job_command(CONFIG, ngpu, tmp_path, checkpointed(folder))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    killed = False
    while time.monotonic() < deadline and proc.poll() is None:
        steps = [row["step"] for row in read_rows(metrics)]
        if steps and steps[-1] >= 3 and (folder / "step-2").is_dir():
            pid = rank_pid(proc.pid, victim)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
        time.sleep(0.05)
    output, _ = proc.communicate(timeout=300)
    assert killed, f"the run ended before a rank could be killed:\n{output[-3000:]}"
    return RunResult(proc.returncode, output, read_rows(metrics))


def resumed_from(result: RunResult) -> int:
    return result.rows[0]["step"] - 1


@pytest.mark.slow  # 55 s on 2 cores, measured passing; ``-m slow`` runs it
def test_killed_rank_resumes_with_the_same_plan(tmp_path):
    full = run_job(CONFIG, 2, tmp_path / "full", checkpointed(tmp_path / "ckpt_full"))
    assert full.returncode == 0, full.output[-3000:]
    assert [r["step"] for r in full.rows] == list(range(1, STEPS + 1))

    folder = tmp_path / "ckpt"
    killed = run_and_kill_rank(tmp_path / "killed", folder, 2, victim=1)
    assert killed.returncode != 0, killed.output[-3000:]
    assert len(killed.rows) < STEPS
    # the same checkpoints, for the restart on fewer ranks
    shutil.copytree(folder, tmp_path / "ckpt_one")

    again = run_job(CONFIG, 2, tmp_path / "again", checkpointed(folder))
    assert again.returncode == 0, again.output[-3000:]
    start = resumed_from(again)
    assert start >= 2 and start % 2 == 0, again.output[-3000:]
    assert [r["step"] for r in again.rows] == list(range(start + 1, STEPS + 1))
    assert PLAN_RE.search(again.output).groups() == PLAN_RE.search(killed.output).groups()
    tail = RunResult(0, "", full.rows[start:])
    worst = assert_parity(tail, again, rtol=1e-6, grad_rtol=1e-6)
    print(f"resumed at step {start} on 2 ranks: max rel diff {worst:.2e}")

    one = run_job(CONFIG, 1, tmp_path / "one", checkpointed(tmp_path / "ckpt_one"))
    assert one.returncode == 0, one.output[-3000:]
    assert PLAN_RE.search(one.output).group(2) != PLAN_RE.search(killed.output).group(2)
    start = resumed_from(one)
    assert [r["step"] for r in one.rows] == list(range(start + 1, STEPS + 1))
    worst = assert_parity(RunResult(0, "", full.rows[start:]), one)
    print(f"resumed at step {start} on 1 rank (re-planned): max rel diff {worst:.2e}")


SHARED_PLAN_SCRIPT = """
import os, sys
from torchtitan_autoparallel.titan.v0_2.registry import register
from torchtitan_autoparallel.titan.v0_2 import cpu
from torchtitan_autoparallel.launch import resolve_plan
from torchtitan_autoparallel.titan.v0_2.job import parse_config
from torchtitan_autoparallel.titan.v0_2.train import shared_plan
cpu.install(); register()
rank = int(os.environ["RANK"])
# rank 1 alone may not replicate: planning on its own, it would pick another plan
budget = ["--autoparallel.techniques=fsdp"] if rank == 1 else []
job = parse_config(["--job.config_file", sys.argv[1], *budget])
own = resolve_plan(job, 2).digest() if rank == 1 else ""
print(f"rank {rank} shared {shared_plan(job, 2).digest()} own {own}", flush=True)
"""


def test_every_rank_runs_rank_zeros_plan(tmp_path):
    """Rank 0 plans and hands the plan to the others through torchrun's store: a rank whose
    own planning would differ still runs rank 0's plan."""
    script = tmp_path / "shared.py"
    script.write_text(SHARED_PLAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        ["torchrun", "--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
         "localhost:0", str(script), str(REPO / "train_configs" / CONFIG)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # digests are 16 hex digits; the two ranks' lines may interleave
    ranks = {rank for rank, _, _ in re.findall(
        r"rank (\d) shared ([0-9a-f]{16}) own ?([0-9a-f]{16})?", proc.stdout)}
    assert ranks == {"0", "1"}, proc.stdout
    shared = set(re.findall(r"rank \d shared ([0-9a-f]{16})", proc.stdout))
    own = re.search(r"rank 1 shared [0-9a-f]{16} own ?([0-9a-f]{16})", proc.stdout).group(1)
    assert len(shared) == 1 and own not in shared, proc.stdout
