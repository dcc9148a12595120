"""Re-predict a measured sweep with the current cost model and hardware profiles.

For every measured cell of a sweep CSV, the plan that ran (``plans/<config>.<arm>.json`` next to
the CSV) is costed again (``recost.recost``: same mesh, batch split and per-block strategies) and
set beside the measurement and the prediction stored when the sweep ran: step time, and peak
memory against the best measurement of it the CSV has (MemTracker's tensor peak, else the
device's active peak). Use it after a cost-model or profile change, or with ``--hardware`` on a
profile that ``python -m torchtitan_autoparallel fit`` wrote; the stored predictions are the
out-of-sample ones.

    python experiments/repredict.py experiments/results/h200_memory/sweep.csv \\
        [--hardware FITTED.toml] [--out experiments/results/h200_model.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.sweep_report import spearman  # noqa: E402


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def current_profile(plan: Any) -> Any:
    """The profile the plan names as it is today (the plan stores the one it was made with),
    with the plan's MoE load imbalance; None (the stored one) when the name is not shipped."""
    import dataclasses

    from torchtitan_autoparallel.cost.hardware import available_profiles, load_profile

    fp = plan.fingerprint
    if fp["hardware"] not in available_profiles():
        return None
    hw = load_profile(fp["hardware"])
    return dataclasses.replace(hw, moe_load_imbalance=fp.get("moe_load_imbalance")
                               or hw.moe_load_imbalance)


def rows_for(csv_path: str, hardware: str = "") -> list[dict]:
    """Per measured (or failed) row: measurement, stored and current predictions."""
    from torchtitan_autoparallel.cost.hardware import load_profile
    from torchtitan_autoparallel.fitting.runs import (
        PEAK_COLUMNS,
        measured_peak,
        plan_path,
        read_rows,
    )
    from torchtitan_autoparallel.plan.recost import recost
    from torchtitan_autoparallel.plan.schema import Plan
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    hw = load_profile(hardware) if hardware else None
    cache: dict = {}
    out = []
    for row in read_rows(Path(csv_path)):
        path = plan_path(Path(csv_path), row)
        if row["status"] not in ("ok", "failed") or not path.exists():
            continue
        plan = Plan.load(str(path))
        now = recost(plan, hw or current_profile(plan), cache).predicted
        out.append({
            "config": row["config"], "arm": row["arm"], "status": row["status"],
            "step": _float(row.get("step_time_s")), "peak": measured_peak(row, PEAK_COLUMNS[:2]),
            "old_step": _float(row.get("pred_step_time_s")),
            "old_peak": _float(row.get("pred_peak_gib")),
            "new_step": now["step_time_s"], "new_peak": now["peak_memory_gib"],
        })
    return out


def _err(pred: float | None, actual: float | None) -> float | None:
    return None if pred is None or not actual else pred / actual - 1.0


def summary(rows: list[dict], key: str, actual: str) -> str:
    pairs = [(r[key], r[actual]) for r in rows if r[key] is not None and r[actual]]
    if len(pairs) < 2:
        return "too few measurements"
    errors = [abs(p / a - 1.0) for p, a in pairs]
    rho = spearman([p for p, _ in pairs], [a for _, a in pairs])
    under = sum(1 for p, a in pairs if p < a)
    return (f"Spearman {rho:.3f}, median |error| {100 * statistics.median(errors):.1f} %, "
            f"max {100 * max(errors):.1f} %, {under} of {len(pairs)} under-predicted")


def report(rows: list[dict]) -> str:
    def cell(value: float | None, fmt: str) -> str:
        return "" if value is None else format(value, fmt)

    def pct(value: float | None) -> str:
        return "" if value is None else f"{100 * value:+.0f}%"

    lines = ["| config | arm | status | step s | predicted then | now | error now | "
             "tensor peak GiB | predicted then | now | error now |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['arm']} | {r['status']} | {cell(r['step'], '.3f')} | "
            f"{cell(r['old_step'], '.3f')} | {cell(r['new_step'], '.3f')} | "
            f"{pct(_err(r['new_step'], r['step']))} | {cell(r['peak'], '.1f')} | "
            f"{cell(r['old_peak'], '.1f')} | {cell(r['new_peak'], '.1f')} | "
            f"{pct(_err(r['new_peak'], r['peak']))} |")
    lines += ["", f"- step time, predicted then: {summary(rows, 'old_step', 'step')}",
              f"- step time, predicted now: {summary(rows, 'new_step', 'step')}",
              f"- peak memory, predicted then: {summary(rows, 'old_peak', 'peak')}",
              f"- peak memory, predicted now: {summary(rows, 'new_peak', 'peak')}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--out", default="", help="write the markdown table here")
    parser.add_argument("--hardware", default="", help="profile to cost with (default: the "
                        "one each plan names)")
    args = parser.parse_args(argv)
    text = report(rows_for(args.csv, args.hardware))
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    from torchtitan_autoparallel.errors import run_cli

    sys.exit(run_cli(main))
