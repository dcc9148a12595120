"""FSDP resharding and FSDP units measured on this machine: the planner's choice against the
plans it rejects, side by side.

    python experiments/lever_sweep.py [--rounds 3] [--steps 10]
        [--out experiments/results/lever_sweep.md]

llama3 "bench" on 4 CPU ranks (gloo), FSDP over all 4 with "nodes" of 2 ranks
(``autoparallel.gpus_per_node = 2``): every block may reshard its parameters after forward (to
all 4 ranks), reshard to the 2 ranks of its node (FSDP2's integer ``reshard_after_forward``) or
keep them, and pairs of blocks may share one FSDP unit. Arms: the planner's plan (``auto``) and
that plan with every block set to one choice (the plans it rejects: reshard / node / keep, in
units of 1 and of 2 blocks; the one equal to auto's is left out). Each arm is replayed from its
plan file; arms run interleaved (round 1 in order, round 2 reversed, ...) so machine drift
cancels. Per arm: the step time the cost model predicts (the edited plan re-costed) and the
median measured step time (steps after the first two, median over rounds), their ranks, and
the measured ratio of the best rejected arm to auto (> 1: auto is faster).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIG = REPO / "train_configs" / "llama3_bench_auto.toml"
NGPU = 4
OPTIONS = ["--autoparallel.gpus_per_node=2", "--parallelism.data_parallel_shard_degree=4"]
OUT = REPO / "experiments" / "results" / "lever_sweep.md"
CHOICES = {"reshard": True, "node2": 2, "keep": False}


def plans() -> dict[str, Any]:
    """The planner's plan and the rejected ones, by arm name."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register
    cpu.install()
    register()
    auto = plan_job(parse_config(["--job.config_file", str(CONFIG), *OPTIONS]), NGPU)
    out = {"auto": auto}
    blocks = [i for i, layer in enumerate(auto.layers) if layer.kind == "block"]
    for unit in (1, 2):
        for name, reshard in CHOICES.items():
            plan = copy.deepcopy(auto)
            for i in blocks:
                plan.layers[i].reshard_after_forward = reshard
                plan.layers[i].fsdp_unit = unit if len(blocks) % unit == 0 else 1
            if label(plan) != label(auto):  # the plans the planner rejects
                out[f"{name} unit{unit}"] = plan
    return out


def label(plan: Any) -> str:
    """The blocks' FSDP choices, compressed (e.g. ``fsdp-node2 unit2 x8``)."""
    parts = []
    for layer in plan.layers:
        if layer.kind != "block":
            continue
        r = layer.reshard_after_forward
        name = f"{'reshard' if r is True else 'keep' if r is False else f'node{r}'}" \
               f" unit{layer.fsdp_unit}" + (f" ac:{layer.ac}" if layer.ac != "none" else "")
        if parts and parts[-1][0] == name:
            parts[-1][1] += 1
        else:
            parts.append([name, 1])
    return ", ".join(f"{name} x{n}" for name, n in parts)


def run(plan_path: Path, steps: int, work: Path) -> float:
    """Median step time (steps 3 on) of one training run replaying ``plan_path``, launched as
    ``sweep.py`` launches its arms."""
    from tests.support.sweep import Config, Grid, run_training, steady_stats

    config = Config(family="llama3", ngpu=NGPU, global_batch=16, seq_len=256)  # CONFIG's
    grid = Grid("lever_sweep", steps=steps, timeout_s=1800)
    code, rows, tail = run_training(config, grid,
                                    [*OPTIONS, f"--autoparallel.plan_file={plan_path}"], True,
                                    work)
    if code != 0:
        raise SystemExit(f"run failed ({plan_path.name}):\n{tail}")
    return steady_stats(rows, grid.steady_from)["step_time_s"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()

    from torchtitan_autoparallel.plan.recost import recost

    arms = plans()
    predicted = {name: recost(plan).predicted["step_time_s"] for name, plan in arms.items()}
    measured: dict[str, list[float]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for i, (name, plan) in enumerate(arms.items()):
            paths[name] = Path(tmp) / f"arm{i}.json"
            plan.save(str(paths[name]))
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                measured[name].append(
                    run(paths[name], args.steps, Path(tmp) / f"r{r}_{name.replace(' ', '_')}"))
                print(f"round {r + 1} {name:15s} {measured[name][-1]:.3f} s", flush=True)
    med = {name: statistics.median(v) for name, v in measured.items()}
    by_pred = {n: i + 1 for i, n in enumerate(sorted(arms, key=predicted.get))}
    by_meas = {n: i + 1 for i, n in enumerate(sorted(arms, key=med.get))}
    rejected = min((n for n in arms if n != "auto"), key=med.get)
    lines = [
        f"# FSDP resharding and units on this machine ({NGPU} CPU ranks, nodes of 2, "
        f"llama3 bench)", "",
        f"`python experiments/lever_sweep.py --rounds {args.rounds} --steps {args.steps}`: "
        "each arm replays its plan file; measured = median over rounds of the median step time "
        "(steps 3 on). Predicted = the plan re-costed by the cpu profile.", "",
        "| arm | blocks | predicted s | measured s (rounds' range) | measured / predicted "
        "| rank predicted | rank measured |", "|---|---|---|---|---|---|---|"]
    for name, plan in arms.items():
        spread = f"{min(measured[name]):.3f}-{max(measured[name]):.3f}"
        lines.append(f"| {name} | {label(plan)} | {predicted[name]:.3f} | {med[name]:.3f} "
                     f"({spread}) | {med[name] / predicted[name]:.2f} | {by_pred[name]} | "
                     f"{by_meas[name]} |")
    lines += ["", f"Best rejected arm measured: {rejected} ({med[rejected]:.3f} s); "
              f"best rejected / auto = {med[rejected] / med['auto']:.3f} (> 1: the planner's "
              f"plan is faster); auto is measured #{by_meas['auto']} of {len(arms)}."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
