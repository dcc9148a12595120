"""Refit the CPU hardware profile to measured sweeps through the profile fitter (fitting/fit.py)
and set it beside the committed profile on the same rows.

Reads sweep CSVs (``experiments/sweep.py`` output, plans in ``plans/`` next to each), fits the
profile's constants to the first (``fit_profile``: one convex program per iteration), and prints
for the committed and the refitted profile: in-sample accuracy on the fitted sweep,
leave-one-config-out accuracy (each config predicted by a profile fitted to the other configs),
and accuracy on the ``--holdout`` sweeps, which neither fit saw.

    python experiments/fit_cpu_profile.py experiments/results/quiet/sweep.csv \\
        --holdout experiments/results/quiet_batch/sweep.csv [--out experiments/results] \\
        [--write PROFILE.toml]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchtitan_autoparallel.cost.hardware import HardwareProfile, load_profile  # noqa: E402
from torchtitan_autoparallel.cost.profile_file import write_profile  # noqa: E402
from torchtitan_autoparallel.errors import run_cli  # noqa: E402
from torchtitan_autoparallel.fitting.fit import (  # noqa: E402
    Run,
    cross_validate,
    datasheet_caps,
    fit_profile,
    predicted_times,
)
from torchtitan_autoparallel.fitting.report import accuracy, constants_table  # noqa: E402
from torchtitan_autoparallel.fitting.runs import load_runs  # noqa: E402

COORDINATE_DESCENT_LOCO = (0.938, 0.068)
"""Leave-one-config-out Spearman and median error of the coordinate-descent fit this script
used before (quiet sweep, 44 plans, cost model of commit 8fd5c22): the committed profile's
out-of-sample record."""


def _cell(pred: list[float], runs: list[Run]) -> str:
    rho, err = accuracy(pred, [r.measured_s for r in runs])
    return "n/a" if math.isnan(err) else f"{rho:.3f} / {err:.1%}"


def compare(fit_csv: str, holdout: list[str], committed: HardwareProfile, loss: str = "squares"
            ) -> tuple[list[str], HardwareProfile, list[Run], list[float]]:
    """Markdown rows (evaluation, runs, committed, refit), the refitted profile, the fitted
    runs and their left-out predictions."""
    runs = load_runs(fit_csv, committed)
    caps = datasheet_caps(committed)
    result = fit_profile(runs, committed, caps=caps, loss=loss)
    left_out = cross_validate(runs, committed, caps=caps, loss=loss)
    name = Path(fit_csv).parent.name
    rho, err = COORDINATE_DESCENT_LOCO
    rows = [f"| {name}: in sample | {len(runs)} | {_cell(result.before_s, runs)} | "
            f"{_cell(result.after_s, runs)} |",
            f"| {name}: leave one config out (each config by a fit to the others) | "
            f"{len(runs)} | {rho:.3f} / {err:.1%} (coordinate descent) | "
            f"{_cell(left_out, runs)} |"]
    for csv_path in holdout:
        held = load_runs(csv_path, committed)
        rows.append(f"| {Path(csv_path).parent.name}: not fitted | {len(held)} | "
                    f"{_cell(predicted_times(held, committed), held)} | "
                    f"{_cell(predicted_times(held, result.profile), held)} |")
    print(constants_table(committed, result))
    return rows, result.profile, runs, left_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="sweep CSV to fit (plans/ next to it)")
    parser.add_argument("--holdout", nargs="*", default=[], help="sweep CSVs to judge on")
    parser.add_argument("--profile", default="cpu", help="the committed profile")
    parser.add_argument("--out", default="", help="folder for profile_fit.md")
    parser.add_argument("--write", default="", help="write the refitted profile here")
    parser.add_argument("--loss", choices=("squares", "huber"), default="squares")
    args = parser.parse_args(argv)
    committed = load_profile(args.profile)
    rows, refit, runs, left_out = compare(args.csv, args.holdout, committed, args.loss)
    lines = ["| evaluation | runs | committed `cpu`: Spearman / median error | refit (cvxpy) |",
             "|---|---|---|---|", *rows]
    print("\n".join(lines))
    if args.out:
        per_run = ["", "| run | measured s | left out s | error |", "|---|---|---|---|"]
        per_run += [f"| {r.label} | {r.measured_s:.3f} | {p:.3f} | {p / r.measured_s - 1:+.0%} |"
                    for r, p in zip(runs, left_out, strict=True)]
        doc = (__doc__ or "").splitlines()[0]
        about = ("Committed `cpu`: torchtitan_autoparallel/profiles/cpu.toml (a "
                 "coordinate-descent fit to the quiet sweep); its leave-one-config-out figure "
                 "is that fit's, re-run under the current cost model before it was removed "
                 "(coordinate_descent_loco.txt). Refit: `fitting.fit.fit_profile` with its "
                 "default constants and bounds. Cells: Spearman / median relative error of "
                 "predicted vs measured step time. Command: `python "
                 "experiments/fit_cpu_profile.py " + " ".join(argv or sys.argv[1:]) + "`.")
        text = "\n".join([f"# {doc}", "", about, "", *lines, *per_run]) + "\n"
        Path(args.out, "profile_fit.md").write_text(text)
    if args.write:
        write_profile(args.write, refit, [f"refitted by experiments/fit_cpu_profile.py to "
                                          f"{args.csv}"])
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
