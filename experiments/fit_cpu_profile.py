"""Fit the CPU hardware profile's constants to measured step times.

Reads a sweep CSV (``experiments/sweep.py`` output) and the plan JSON of every measured arm
(``plans/<config>.<arm>.json`` next to it), re-costs each plan with candidate profile values and
searches (coordinate descent on a log scale) for the values that minimise the mean squared log
error of predicted vs measured step time. Prints the fitted fields and the accuracy before and
after; with ``--write`` updates ``torchtitan_autoparallel/profiles/cpu.toml``.

    python experiments/fit_cpu_profile.py experiments/results/calibration/sweep.csv [--cv]

Fit on a calibration grid, then judge the profile on a different sweep: fitting and
validating on the same runs would flatter the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "experiments")]

from sweep_report import accuracy, read_rows  # noqa: E402

from torchtitan_autoparallel.cost.hardware import HardwareProfile, load_profile  # noqa: E402

FITTED = ("peak_tflops", "intra_node_gbps", "intra_node_latency_us", "oversubscribed_latency_us",
          "block_overhead_us", "comm_overlap", "host_copy_gbps")
"""Profile fields the fit searches; the rest (host_cores, memory) are facts of the machine."""
BOUNDS = {"comm_overlap": (0.0, 1.0), "host_copy_gbps": (0.05, 50.0)}


def repredict(plan: Any, hw: HardwareProfile, cache: dict[str, Any]) -> float:
    """Predicted step time of ``plan`` (same mesh, batch split, per-block strategies) on ``hw``."""
    from torchtitan_autoparallel.planner import recost
    from torchtitan_autoparallel.registry import register

    register()
    return recost(plan, hw, cache).predicted["step_time_s"]


def load_measured(csv_path: Path) -> list[tuple[Any, float, dict[str, str]]]:
    """(plan, measured median step time, row) for every successful run."""
    from torchtitan_autoparallel.plan import Plan

    out = []
    for row in read_rows(csv_path):
        plan_path = csv_path.parent / "plans" / f"{row['config']}.{row['arm']}.json"
        if row["status"] == "ok" and plan_path.exists():
            out.append((Plan.load(str(plan_path)), float(row["step_time_s"]), row))
    return out


def loss(points: list[tuple[Any, float, dict[str, str]]], hw: HardwareProfile,
         cache: dict[str, Any]) -> float:
    return sum(math.log(repredict(p, hw, cache) / m) ** 2 for p, m, _ in points) / len(points)


def fit(points: list[tuple[Any, float, dict[str, str]]], hw: HardwareProfile,
        rounds: int = 6) -> HardwareProfile:
    """Coordinate descent over FITTED (multiplicative steps, shrinking each round)."""
    cache: dict[str, Any] = {}
    best = loss(points, hw, cache)
    step = 2.0
    for _ in range(rounds):
        for name in FITTED:
            for factor in (step, 1 / step):
                while True:
                    value = getattr(hw, name)
                    new = value * factor if value > 0 else (0.1 if factor > 1 else 0.0)
                    lo, hi = BOUNDS.get(name, (0.0, math.inf))
                    new = min(max(new, lo), hi)
                    if new == value:
                        break
                    trial = dataclasses.replace(hw, **{name: new})
                    value_loss = loss(points, trial, cache)
                    if value_loss >= best:
                        break
                    hw, best = trial, value_loss
        step = math.sqrt(step)
    return hw


def write_profile(path: Path, hw: HardwareProfile) -> None:
    """Replace the fitted fields' values in the profile TOML, keeping its comments."""
    text = path.read_text()
    for name in FITTED:
        value = round(getattr(hw, name), 4)
        pattern = rf"(?m)^{name}\s*=\s*[^#\n]*?(\s*#.*)?$"
        if re.search(pattern, text):
            text = re.sub(pattern, lambda m, n=name, v=value: f"{n} = {v}{m.group(1) or ''}",
                          text)
        else:
            text += f"{name} = {value}\n"
    path.write_text(text)


def _report(points: list[tuple[Any, float, dict[str, str]]], hw: HardwareProfile,
            label: str) -> None:
    cache: dict[str, Any] = {}
    rows = []
    for plan, measured, row in points:
        rows.append({**row, "pred_step_time_s": str(repredict(plan, hw, cache)),
                     "step_time_s": str(measured)})
    rho, err, n = accuracy(rows)
    for row in rows:
        pred, meas = float(row["pred_step_time_s"]), float(row["step_time_s"])
        print(f"  {row['config']:28s} {row['arm']:24s} measured {meas:7.3f} s  predicted "
              f"{pred:7.3f} s  {pred / meas - 1:+.0%}")
    print(f"{label}: Spearman {rho:.3f}, median relative error {err:.1%} over {n} plans")


def cross_validate(points: list[tuple[Any, float, dict[str, str]]], hw: HardwareProfile
                   ) -> list[dict[str, str]]:
    """Leave one config out: each config's plans are predicted by a profile fitted to the other
    configs' runs. Returns rows for ``sweep_report.accuracy``."""
    rows = []
    for config in sorted({row["config"] for _, _, row in points}):
        train = [p for p in points if p[2]["config"] != config]
        fitted = fit(train, hw) if train else hw
        cache: dict[str, Any] = {}
        for plan, measured, row in points:
            if row["config"] == config:
                rows.append({**row, "pred_step_time_s": str(repredict(plan, fitted, cache)),
                             "step_time_s": str(measured)})
    return rows


def write_validation(out: Path, cv_rows: list[dict[str, str]], fitted: HardwareProfile,
                     points: list[tuple[Any, float, dict[str, str]]],
                     label: str = "fitted to all runs (in-sample)") -> None:
    """cost_model.md (the profile's constants and in-sample accuracy, leave-one-config-out
    accuracy, every plan's out-of-sample prediction) and cost_model_cv.png."""
    from sweep_report import aggregate, scatter_plot

    cache: dict[str, Any] = {}
    fitted_rows = [{**row, "pred_step_time_s": str(repredict(plan, fitted, cache)),
                    "step_time_s": str(measured)} for plan, measured, row in points]
    rho_in, err_in, n = accuracy(fitted_rows)
    rho, err, _ = accuracy(cv_rows)
    lines = ["# Cost model vs measured step time (CPU, gloo)", "",
             f"{n} measured plans (config x arm; step time = median over rounds of each run's "
             "median steady step).", "",
             "| profile | Spearman | median relative error |", "|---|---|---|",
             f"| {label} | {rho_in:.3f} | {err_in:.1%} |",
             f"| leave one config out (each config predicted by a profile fitted to the "
             f"others) | {rho:.3f} | {err:.1%} |", "",
             f"Constants ({label}): " + ", ".join(
                 f"`{name} = {getattr(fitted, name):.4g}`" for name in FITTED), "",
             "![leave-one-config-out](cost_model_cv.png)", "",
             "| config | arm | measured s | predicted s (left out) | error |",
             "|---|---|---|---|---|"]
    for config, arms in sorted(aggregate(cv_rows).items()):
        for name, a in sorted(arms.items()):
            lines.append(f"| {config} | {name} | {a.step_time_s:.3f} | "
                         f"{a.pred_step_time_s:.3f} | "
                         f"{a.pred_step_time_s / a.step_time_s - 1:+.0%} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_model.md").write_text("\n".join(lines) + "\n")
    scatter_plot(cv_rows, out / "cost_model_cv.png", "leave one config out: ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="sweep CSVs of measured runs (plans/ next to each)")
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--write", action="store_true", help="update the profile TOML")
    parser.add_argument("--cv", action="store_true",
                        help="also report leave-one-config-out accuracy")
    parser.add_argument("--out", default="",
                        help="with --cv: folder for cost_model.md and its plot")
    parser.add_argument("--max-foreign-load", type=float, default=float("inf"),
                        help="use only runs during which other processes used at most this "
                             "many cores")
    args = parser.parse_args(argv)
    points = [p for csv_path in args.csv for p in load_measured(Path(csv_path))
              if float(p[2].get("foreign_load") or 0.0) <= args.max_foreign_load]
    if not points:
        print(f"error: no measured runs with plans in {args.csv}", file=sys.stderr)
        return 2
    hw = load_profile(args.profile)
    _report(points, hw, "before")
    fitted = fit(points, hw)
    _report(points, fitted, "after")
    for name in FITTED:
        print(f"{name} = {getattr(fitted, name):.4g}")
    if args.cv:
        cv_rows = cross_validate(points, hw)
        rho, err, n = accuracy(cv_rows)
        print(f"leave-one-config-out: Spearman {rho:.3f}, median relative error {err:.1%} "
              f"over {n} plans")
        if args.out:
            # the table describes the profile the planner uses: the refit when it is written,
            # else the profile as loaded (a refit from it may drift to other local optima)
            write_validation(Path(args.out), cv_rows, fitted if args.write else hw, points,
                             "fitted to all runs (in-sample)" if args.write else
                             f"profile `{args.profile}` as committed, on all runs")
    if args.write:
        path = REPO / "torchtitan_autoparallel" / "profiles" / f"{args.profile}.toml"
        write_profile(path, fitted)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
