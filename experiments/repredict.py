"""Re-predict a measured sweep with the current cost model and hardware profiles.

For every measured cell of a sweep CSV (made from ``GRID``), the plan that ran is costed again
(experts, and auto plans with one AC mode, through ``expert_plan``; auto plans that mix AC modes
are planned again, marked "re-planned") and set beside the measurement and
the prediction stored when the sweep ran: step time, and peak memory against the best
measurement of it the CSV has (MemTracker's tensor peak, else the device's active peak).
Use it after a cost-model or profile change; the stored predictions are the out-of-sample ones.

    python experiments/repredict.py experiments/grids/h200_memory.toml \\
        experiments/results/h200_memory/sweep.csv [--out experiments/results/h200_model.md]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "experiments")]

from sweep import Recipe, _cells, load_grid, predict  # noqa: E402
from sweep_report import spearman  # noqa: E402


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def measured_peak(row: dict[str, str]) -> float | None:
    """MemTracker's tensor peak, else the device's active-bytes peak (GiB)."""
    return _float(row.get("tensor_peak_gib")) or _float(row.get("peak_active_gib"))


def as_recipe(row: dict[str, str]) -> Recipe | None:
    """The auto plan a row measured, as the uniform recipe it is (one AC mode for every block),
    so that it is costed as it ran; None for plans that mix AC modes."""
    if "/" in row.get("ac", "/") or not row.get("local_batch"):
        return None
    dp = int(row["dp_replicate"]) * int(row["dp_shard"])
    local = int(row["local_batch"])
    return Recipe(int(row["dp_replicate"]), int(row["dp_shard"]), int(row["tp"]),
                  int(row["cp"]), row["ac"],
                  0 if local * dp == int(row["global_batch"]) else local)


def rows_for(grid_path: str, csv_path: str) -> list[dict]:
    grid = load_grid(grid_path)
    with open(csv_path, newline="") as f:
        measured = {row["cell"]: row for row in csv.DictReader(f)}
    out = []
    for cfg, round_index, arm, recipe in _cells(grid):
        row = measured.get(f"{cfg.id}/{arm}/r{round_index + 1}")
        if row is None or row["status"] not in ("ok", "failed"):
            continue
        measured_plan = recipe or as_recipe(row)
        now = predict(cfg, measured_plan, None)
        if measured_plan is None:
            arm += " (re-planned)"
        out.append({
            "config": cfg.id, "arm": arm, "status": row["status"],
            "step": _float(row.get("step_time_s")), "peak": measured_peak(row),
            "old_step": _float(row.get("pred_step_time_s")),
            "old_peak": _float(row.get("pred_peak_gib")),
            "new_step": now.get("pred_step_time_s"), "new_peak": now.get("pred_peak_gib"),
            "note": row.get("note", "")[:60],
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
    parser.add_argument("grid")
    parser.add_argument("csv")
    parser.add_argument("--out", default="", help="write the markdown table here")
    args = parser.parse_args(argv)
    for path in (args.grid, args.csv):
        if not Path(path).is_file():
            print(f"error: {path} not found", file=sys.stderr)
            return 2
    text = report(rows_for(args.grid, args.csv))
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
