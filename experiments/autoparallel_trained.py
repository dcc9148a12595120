"""This planner's plans and TorchTitan 0.3.0's own AutoParallel (graph_trainer,
``--compile.enable_autoparallel``) trained side by side on 4 CPU ranks (gloo), from one seed
checkpoint, in one run of this script.

    python experiments/autoparallel_trained.py [--steps 8] [--out FILE.md]

Run it with the Python of a venv holding TorchTitan 0.3.0 and meta-pytorch/autoparallel (this
project's ``.[titan03]`` venv, then ``pip install --no-deps <autoparallel checkout> pulp``;
measured with autoparallel a54c252). The model is Llama 3's debug flavor (TorchTitan 0.3.0's
``llama3_debugmodel`` and graph_trainer's ``graph_trainer_llama3_debugmodel_sdpa_cross_entropy_
loss``: the same modules, parameter names and shapes, SDPA attention, cross-entropy loss),
sequences of 256, 8 per step, fp32 parameters, this repository's tokenizer and corpus, seed 0.
Jobs, one after the other:

- the seed checkpoint and the 1-rank run from it (the losses every job should reproduce);
- AutoParallel on its 2-D mesh (fsdp 2 x tp 2): its ILP solved on rank 0 at the start of the
  job, its placements applied through graph_trainer's ``aot_fx_trace`` (its cost model reads
  device limits from the CUDA device name: an H100 SXM's stands in, as in
  ``autoparallel_peer.py``);
- this planner under ``--parallelism.auto`` on the same mesh (degrees fixed) and on the mesh it
  searches;
- TorchTitan 0.3.0's FSDP 2 x TP 2 recipe;
- DeepSeek-V3's debug flavor the same way on the mesh of graph_trainer's own DeepSeek-V3
  AutoParallel test (efsdp 4 x ep 2): its 1-rank run, AutoParallel, this planner with those
  degrees fixed, TorchTitan's recipe (a job that fails is reported with the error it ended in).

Reported per job: the planning time (AutoParallel's "took" line; ours: the plan's), the losses
against the 1-rank run's, and the median step time over steps 3..N from the log's timestamps
(this 2-core box runs 4 ranks: times compare as ratios between jobs of one run, not as GPU
times).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SMALL = ["--training.seq_len", "256", "--training.global_batch_size", "8",
         "--training.mixed_precision_param", "float32", "--debug.seed", "0",
         "--hf_assets_path", str(REPO / "torchtitan_autoparallel" / "assets" / "tokenizer"),
         "--dataloader.dataset_path", str(REPO / "torchtitan_autoparallel" / "assets" / "data")]
LLAMA = ["--module", "llama3", "--config", "llama3_debugmodel"]
GRAPH = ["--module", "graph_trainer.llama3", "--config",
         "graph_trainer_llama3_debugmodel_sdpa_cross_entropy_loss"]
MESH = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree",
        "2"]
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
SHIM = f"""import sys, torch
torch.cuda.get_device_name = lambda *a, **k: {DEVICE_NAME!r}
from torchtitan_autoparallel.errors import run_cli
from torchtitan_autoparallel.titan.v0_3.train import run
sys.exit(run_cli(lambda: run(sys.argv[1:])))
"""
"""AutoParallel's entry: this project's 0.3.0 trainer (TorchTitan's Trainer under the CPU
shims) with the device name AutoParallel's cost model asks for."""


def torchrun(n: int, args: list[str], log: Path, script: Path | None = None,
             check: bool = True) -> str:
    entry = [str(script)] if script else ["-m", "torchtitan_autoparallel.titan.v0_3.train"]
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(n), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "--local-ranks-filter", "0", "--role", "rank",
           "--tee", "3", *entry, *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    log.write_text(out)
    if done.returncode != 0 and check:
        raise SystemExit(f"error: {' '.join(cmd[-12:])} failed ({done.returncode}); see {log}")
    return out


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", out)]


def step_ms(out: str) -> float:
    """Median time between consecutive step lines from step 3 on (ms)."""
    stamps = [datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t in
              re.findall(r"\[titan\] (\S+ \S+) - root - INFO - step:", out)]
    gaps = [(b - a).total_seconds() * 1e3 for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return statistics.median(gaps) if gaps else float("nan")


def planning_s(out: str) -> str:
    ours = re.search(r"planning ([0-9.]+) s", out)
    theirs = re.search(r"AutoParallelGraph took ([0-9.]+) seconds", out)
    return f"{float((ours or theirs).group(1)):.2f}" if (ours or theirs) else "-"


def mesh_of(out: str) -> str:
    ours = re.search(r"autoparallel plan \w+: mesh ([^(]+)", out)
    if ours:
        return ours.group(1).strip()
    built = re.search(r"Building device mesh with parallelism: ([^\n]+)", out)
    return built.group(1).strip() if built else "-"


def strategy(out: str) -> str:
    rows = re.findall(r"^\S*\s+(layers\.\S+)\s+(\S+)\s+[0-9.]+", out, re.M)
    return "; ".join(f"{fqn} {label}" for fqn, label in rows) or "-"


def failure(out: str) -> str:
    """The exception line a failed job's rank 0 ended with."""
    found = re.findall(r"^\[rank0\]:(?:\[rank0\]:)?\s*(\w+(?:Error|Exception): .+)$", out, re.M)
    return found[-1].strip() if found else out.strip().splitlines()[-1][:300]


def deepseek_rows(root: Path, steps: list[str], script: Path) -> list[str]:
    """DeepSeek-V3's debug flavor on graph_trainer's efsdp 4 x ep 2 AutoParallel path (the
    mesh of its own integration test) beside this planner and TorchTitan's recipe on that
    mesh, from one seed checkpoint; a job that fails is reported with the error it ended in."""
    ds = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
          "--training.disable_cuda_graphs"]
    mesh = ["--parallelism.data_parallel_shard_degree", "4",
            "--parallelism.expert_parallel_degree", "2"]
    torchrun(1, [*ds, *SMALL, "--training.local_batch_size", "8", "--checkpoint.enable",
                 "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree",
                 "1", "--dump_folder", str(root / "ds_seed")], root / "ds_seed.log")
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path",
            str(root / "ds_seed" / "checkpoint" / "step-0")]
    jobs = {
        "DeepSeek-V3, 1 rank (reference)": (1, [*ds, *SMALL, *steps,
                                                "--training.local_batch_size", "8", *load], None),
        "DeepSeek-V3, AutoParallel, efsdp 4 x ep 2": (
            4, ["--module", "graph_trainer.deepseek_v3", "--config",
                "graph_trainer_deepseek_v3_debugmodel", "--training.disable_cuda_graphs", *SMALL,
                *steps, *mesh, "--training.local_batch_size", "2", "--compile.mode",
                "aot_fx_trace", "--compile.enable_autoparallel", *load], script),
        "DeepSeek-V3, this planner, dp_shard 4 x ep 2 fixed": (
            4, [*ds, *SMALL, *steps, *mesh, "--parallelism.auto", *load], None),
        "DeepSeek-V3, TorchTitan's dp_shard 4 x ep 2 recipe": (
            4, [*ds, *SMALL, *steps, *mesh, "--training.local_batch_size", "2", *load], None),
    }
    outs = {}
    for index, (name, (n, job, entry)) in enumerate(jobs.items()):
        outs[name] = torchrun(n, [*job, "--dump_folder", str(root / f"ds{index}")],
                              root / f"ds{index}.log", entry, check=False)
        print(f"{name}: losses {losses(outs[name])}", flush=True)
    ref = losses(outs["DeepSeek-V3, 1 rank (reference)"])
    base = step_ms(outs["DeepSeek-V3, TorchTitan's dp_shard 4 x ep 2 recipe"])
    rows = []
    for name, out in outs.items():
        got = losses(out)
        if len(got) != len(ref):
            rows.append(f"| {name} | {mesh_of(out)} | - | did not train: `{failure(out)}` | - "
                        "| - |")
            continue
        gap = max(abs(a - b) for a, b in zip(got, ref, strict=True))
        ms = step_ms(out)
        rows.append(f"| {name} | {mesh_of(out)} | {planning_s(out)} | {gap:.1e} | {ms:.0f} | "
                    f"{ms / base:.2f} |")
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "experiments" / "results"
                                             / "autoparallel_trained.md"))
    args = parser.parse_args(argv)
    steps = ["--training.steps", str(args.steps)]
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = root / "autoparallel_entry.py"
        script.write_text(SHIM)
        torchrun(1, [*LLAMA, *SMALL, "--training.local_batch_size", "8", "--checkpoint.enable",
                     "--checkpoint.create_seed_checkpoint",
                     "--parallelism.data_parallel_shard_degree", "1",
                     "--dump_folder", str(root / "seed")], root / "seed.log")
        load = ["--checkpoint.enable", "--checkpoint.initial_load_path",
                str(root / "seed" / "checkpoint" / "step-0")]
        jobs = {
            "1 rank (reference)": (1, [*LLAMA, *SMALL, *steps, "--training.local_batch_size",
                                       "8", *load], None),
            "AutoParallel, fsdp 2 x tp 2": (4, [*GRAPH, *SMALL, *steps, *MESH,
                                                "--training.local_batch_size", "4",
                                                "--compile.mode", "aot_fx_trace",
                                                "--compile.enable_autoparallel", *load], script),
            "this planner, fsdp 2 x tp 2 fixed": (4, [*LLAMA, *SMALL, *steps, *MESH,
                                                      "--parallelism.auto", *load], None),
            "this planner, mesh searched": (4, [*LLAMA, *SMALL, *steps, "--parallelism.auto",
                                                *load], None),
            "TorchTitan's FSDP 2 x TP 2 recipe": (4, [*LLAMA, *SMALL, *steps, *MESH,
                                                      "--training.local_batch_size", "4",
                                                      *load], None),
        }
        results = {}
        for index, (name, (n, job, entry)) in enumerate(jobs.items()):
            out = torchrun(n, [*job, "--dump_folder", str(root / f"job{index}")],
                           root / f"job{index}.log", entry)
            results[name] = out
            print(f"{name}: losses {losses(out)}, step {step_ms(out):.0f} ms", flush=True)
        ds_rows = deepseek_rows(root, steps, script)
    ref = losses(results["1 rank (reference)"])
    base = step_ms(results["TorchTitan's FSDP 2 x TP 2 recipe"])
    lines = [
        "# This planner and TorchTitan 0.3.0's AutoParallel, trained side by side",
        "",
        f"`python experiments/autoparallel_trained.py --steps {args.steps}` (see its "
        "docstring): Llama 3 debug flavor, 4 CPU ranks (gloo) on a 2-core box, one seed "
        "checkpoint, sequences of 256, 8 per step, fp32; all jobs in one run "
        f"({(time.time() - start) / 60:.0f} min). Step time: median gap between step log "
        "lines from step 3 on; CPU ranks, so the ratio to the recipe is what compares.",
        "",
        "| job | mesh | planning s | max loss gap to 1 rank | step ms | vs recipe |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, out in results.items():
        got = losses(out)
        gap = max((abs(a - b) for a, b in zip(got, ref, strict=True)), default=float("nan")) \
            if len(got) == len(ref) else float("nan")
        ms = step_ms(out)
        lines.append(f"| {name} | {mesh_of(out)} | {planning_s(out)} | {gap:.1e} | {ms:.0f} | "
                     f"{ms / base:.2f} |")
    lines += ["", "DeepSeek-V3's debug flavor (routed experts), the same way:", "",
              "| job | mesh | planning s | max loss gap to 1 rank | step ms | vs recipe |",
              "|---|---|---:|---:|---:|---:|", *ds_rows]
    if any("no attribute 'rope'" in row for row in ds_rows):
        lines += ["", "AutoParallel's DeepSeek-V3 path (graph_trainer's "
                  "`parallelize_autoparallel_deepseekv3`) hands TorchTitan 0.3.0's model config "
                  "to autoparallel's own DeepSeek-V3 (`autoparallel/_testing/models/dsv3.py`), "
                  "which reads the RoPE settings at `config.rope`; 0.3.0 keeps them in each "
                  "attention's config, so it stops before any solve (TorchTitan 0.3.0 disables "
                  "this integration test itself)."]
    lines += ["", "Losses per step:", ""]
    for name, out in results.items():
        lines.append(f"- {name}: {', '.join(f'{x:.5f}' for x in losses(out))}")
    lines += ["", "This planner's block strategies:", ""]
    for name in ("this planner, fsdp 2 x tp 2 fixed", "this planner, mesh searched"):
        lines.append(f"- {name}: {strategy(results[name])}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
