"""Planning-time benchmark, mesh search included.

Measures (1) planning time from a parsed config to a Plan, in-process, imports excluded
(median of repeats), with the MILP statistics, and (2) the wall time of the whole
``python -m torchtitan_autoparallel plan`` command (median of repeats), for llama3 405B on 128
H100s (``--config train_configs/deepseek_v3_671b_auto.toml`` for DeepSeek-V3 671B on 128 H200s,
expert-parallel degrees included in the search); then (3) the same for a grid of models x
world sizes, as a markdown table (planning time per row: the median of ``--repeats``, each
from a freshly parsed config, the layer graph included; the command once). Targets: <= 2 s
planning with gap 0, <= 15 s for the command.

    python experiments/bench_planning.py [--config train_configs/llama3_405b_auto.toml]
        [--ngpu 128] [--repeats 5] [--grid] [--out experiments/results/planning.md]
    python experiments/bench_planning.py --sub-block [--config ...] [--ngpu 512]
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="train_configs/llama3_405b_auto.toml")
    parser.add_argument("--ngpu", type=int, default=None,
                        help="world size (default 128; 512 with --sub-block)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--grid", action="store_true", help="also run the model x size grid")
    parser.add_argument("--out", default="", help="write the grid table (markdown) here")
    parser.add_argument("--sub-block", action="store_true",
                        help="only: the job (default llama3 405B on 512 GPUs) planned with "
                             "and without tp_sub_block, alternately, and the ratio of the "
                             "median times")
    args = parser.parse_args()
    if args.sub_block:
        sub_block(args.repeats, args.config, args.ngpu or 512)
        return
    args.ngpu = args.ngpu or 128

    t0 = time.perf_counter()
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    print(f"imports + registration: {time.perf_counter() - t0:.2f} s (excluded)")
    job = parse_config(["--job.config_file", str(REPO / args.config)])
    times, plan = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        plan = plan_job(job, args.ngpu)
        times.append(time.perf_counter() - start)
    assert plan is not None
    s = plan.solver
    planning = statistics.median(times)
    print(plan.table())
    print(f"planning time (parsed config -> plan), median of {args.repeats}: {planning:.3f} s "
          f"[min {min(times):.3f}, max {max(times):.3f}]; recorded in plan: "
          f"{s['planning_time_s']:.3f} s")
    print(f"MILPs solved {s['milps_solved']} of {s['candidates']} candidates "
          f"({s['meshes']} meshes, {s['pruned_by_memory']} pruned by memory); variables "
          f"{s['variables']}, constraints {s['constraints']}, gap {s['gap']}, status {s['status']}")

    walls = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
                        str(REPO / args.config), "--ngpu", str(args.ngpu)],
                       cwd=REPO, check=True, capture_output=True)
        walls.append(time.perf_counter() - start)
    wall = statistics.median(walls)
    print(f"whole `plan` command wall time, median of 3: {wall:.2f} s")
    print(f"targets: planning {planning:.3f} s / 2 s = {planning / 2:.2f}x of budget, gap "
          f"{s['gap']} (target 0); command {wall:.2f} s / 15 s = {wall / 15:.2f}x of budget")
    if args.grid:
        grid(args.out, args.repeats)


GRID = ["llama3_8b", "llama3_70b", "llama3_405b", "qwen3_32b", "deepseek_v3_16b",
        "deepseek_v3_671b", "llama4_17bx16e"]


def _timed_plan(config: str, ngpu: int, times: list[float]) -> Any:
    """``plan_job`` on a freshly parsed ``config``; its time appended to ``times``."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    job = parse_config(["--job.config_file", config])
    start = time.perf_counter()
    try:
        return plan_job(job, ngpu)
    finally:
        times.append(time.perf_counter() - start)


def grid(out: str, repeats: int = 3) -> None:
    """Plan every model at 8, 64, 128, 256 and 512 GPUs (pipeline parallelism in the search):
    planning time (median of ``repeats``, each from a freshly parsed config, the layer graph
    included), MILP size, command wall time."""
    from torchtitan_autoparallel.errors import UserError

    rows = ["| model | GPUs | mesh (pp x dp_rep x dp_shard x cp x tp, ep/etp; schedule) "
            "| planning s | MILPs "
            "| variables "
            "| gap | `plan` wall s |", "|---|---|---|---|---|---|---|---|"]
    for name in GRID:
        config = str(REPO / "train_configs" / f"{name}_auto.toml")
        for ngpu in (8, 64, 128, 256, 512):
            times: list[float] = []
            try:
                for _ in range(repeats - 1):
                    try:
                        _timed_plan(config, ngpu, times)
                    except UserError:
                        pass
                plan = _timed_plan(config, ngpu, times)
                t = statistics.median(times)
                m, s = plan.mesh, plan.solver
                ep = f", ep {m.ep}/etp {m.etp}" if m.ep > 1 else ""
                pipe = plan.pipeline
                schedule = (f"; {pipe.schedule} x{pipe.stages_per_rank}, {pipe.microbatches} mb"
                            if pipe else "")
                cells = [f"{m.pp} x {m.dp_replicate} x {m.dp_shard} x {m.cp} x {m.tp}{ep}"
                         f"{schedule}", f"{t:.3f}",
                         str(s["milps_solved"]), str(s["variables"]), str(s["gap"])]
            except UserError as exc:
                t = statistics.median(times)
                need = str(exc).split("device; ")[-1].split(" (")[0]
                budget = str(exc).split("budget of ")[-1].split(" per device")[0]
                cells = [f"does not fit {budget} ({need})", f"{t:.3f}", "-", "-", "-"]
            begin = time.perf_counter()
            subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
                            config, "--ngpu", str(ngpu)], cwd=REPO, capture_output=True)
            wall = time.perf_counter() - begin
            rows.append(f"| {name} | {ngpu} | " + " | ".join(cells) + f" | {wall:.1f} |")
            print(rows[-1], flush=True)
    table = "\n".join(rows) + "\n"
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table)
        print(f"written to {out}")


SUB_BLOCK = "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac,pp,tp_sub_block"


def sub_block(repeats: int, config: str = "train_configs/llama3_405b_auto.toml",
              ngpu: int = 512) -> None:
    """Planning time with the sub-block tp modes in the search beside the default search,
    the two alternating (this box is noisy: the ratio of the medians is the result)."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    jobs = {name: parse_config(["--job.config_file", str(REPO / config), *extra])
            for name, extra in (("default", []), ("tp_sub_block", [SUB_BLOCK]))}
    times: dict[str, list[float]] = {name: [] for name in jobs}
    plans: dict[str, Any] = {}
    for _ in range(repeats):
        for name, job in jobs.items():
            start = time.perf_counter()
            plans[name] = plan_job(job, ngpu)
            times[name].append(time.perf_counter() - start)
    for name, plan in plans.items():
        modes = sorted({layer.tp_mode for layer in plan.layers if layer.kind == "block"})
        print(f"{name}: planning median {statistics.median(times[name]):.3f} s of {repeats} "
              f"(min {min(times[name]):.3f}); gap {plan.solver['gap']}; "
              f"{plan.predicted['tokens_per_s'] / ngpu:.1f} tok/s/GPU; tp modes {modes}")
    ratio = statistics.median(times["tp_sub_block"]) / statistics.median(times["default"])
    print(f"tp_sub_block / default planning time: {ratio:.2f}")


if __name__ == "__main__":
    main()
