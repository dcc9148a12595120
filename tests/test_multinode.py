"""Multi-node launch: two torchrun agents on this machine act as two nodes (c10d rendezvous on
localhost, gloo) and train one job of the whole world under auto, at the losses of one agent
with the same world size (the same plan, so the same initialisation and data)."""

from __future__ import annotations

import os
import subprocess

from tests.support.gloo import free_port
from tests.support.parity import REPO, job_command, read_rows


def two_nodes(cmd: list[str], env: dict[str, str], ngpu: int,
              timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """``cmd`` started twice, each agent with ``ngpu`` ranks, rendezvous on one port."""
    node_env = {**env, "NGPU": str(ngpu), "NNODES": "2",
                "RDZV_ENDPOINT": f"localhost:{free_port()}", "RDZV_ID": "twonodes"}
    agents = [subprocess.Popen(cmd, cwd=REPO, env=node_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    done = []
    for agent in agents:
        out, _ = agent.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(cmd, agent.returncode, out))
    return done


def test_two_nodes_train_one_job_at_the_single_node_losses(tmp_path):
    overrides = ["--training.steps=3"]
    cmd, env, metrics = job_command("llama3_debug_auto.toml", 4, tmp_path / "one", overrides)
    one = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, (one.stdout + one.stderr)[-3000:]
    single = read_rows(metrics)

    cmd, env, metrics = job_command("llama3_debug_auto.toml", 2, tmp_path / "two", overrides)
    agents = two_nodes(cmd, env, 2)
    for agent in agents:
        assert agent.returncode == 0, agent.stdout[-3000:]
    plans = [line for agent in agents for line in agent.stdout.splitlines()
             if "autoparallel plan" in line]
    assert plans and all("(world 4)" in line for line in plans), plans
    rows = read_rows(metrics)
    assert [r["loss"] for r in rows] == [r["loss"] for r in single] != []
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in single]


def test_two_nodes_need_a_rendezvous_endpoint():
    env = {**os.environ, "NGPU": "2", "NNODES": "2", "PREFLIGHT": "0",
           "CONFIG_FILE": str(REPO / "train_configs" / "llama3_debug_auto.toml")}
    env.pop("RDZV_ENDPOINT", None)
    proc = subprocess.run([str(REPO / "run_train.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: RDZV_ENDPOINT=host:port is required when NNODES > 1"]
