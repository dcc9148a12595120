"""Report of a sweep CSV: per-config auto vs expert table, cost-model accuracy, plots.

    python experiments/sweep_report.py [experiments/results/sweep.csv]

(experiments/sweep_report.py runs ``main``; tests/test_sweep.py checks the pieces.)

Writes next to the CSV: ``sweep.md`` (headline table, per-arm table, accuracy), and
``sweep_throughput.png`` (auto vs best and median recipe per config) and
``sweep_predicted_vs_measured.png`` (predicted vs measured step time of every measured plan).
An arm's throughput is the median over its rounds of each run's median steady-step tokens/s.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (Pearson correlation of the ranks); nan if undefined."""
    if len(x) != len(y) or len(x) < 2:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx and vy else math.nan


def median_relative_error(predicted: list[float], measured: list[float]) -> float:
    """Median of |predicted - measured| / measured."""
    errors = [abs(p - m) / m for p, m in zip(predicted, measured, strict=True) if m > 0]
    return statistics.median(errors) if errors else math.nan


@dataclass
class Arm:
    config: str
    arm: str
    status: str
    tokens_per_s: float
    step_time_s: float
    min_step_time_s: float
    pred_step_time_s: float
    pred_peak_gib: float
    peak_memory_gib: float
    final_loss: float
    mesh: str
    note: str
    runs: int


def _float(value: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def aggregate(rows: list[dict[str, str]]) -> dict[str, dict[str, Arm]]:
    """config -> arm -> Arm (medians over the successful rounds; a re-run cell's last row
    supersedes its earlier ones)."""
    latest = {row["cell"]: row for row in rows}
    grouped: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    for row in latest.values():
        grouped[(row["config"], row["arm"])].append(row)
    out: dict[str, dict[str, Arm]] = defaultdict(dict)
    for (config, arm), runs in grouped.items():
        ok = [r for r in runs if r["status"] == "ok"]
        first = (ok or runs)[0]
        mesh = (f"dr{first['dp_replicate']} ds{first['dp_shard']} cp{first['cp']} "
                f"tp{first['tp']} lb{first['local_batch']}x{first['accum']} ac:{first['ac']}"
                if first.get("dp_shard") else "")

        def med(key: str, rows: list[dict[str, str]] = ok) -> float:
            vals = [_float(r.get(key)) for r in rows if not math.isnan(_float(r.get(key)))]
            return statistics.median(vals) if vals else math.nan

        out[config][arm] = Arm(
            config, arm, "ok" if ok else first["status"], med("tokens_per_s"),
            med("step_time_s"), med("min_step_time_s"), med("pred_step_time_s", runs),
            med("pred_peak_gib", runs),
            med("peak_memory_gib"), med("final_loss"), mesh, first.get("note", ""), len(ok))
    return out


def headline(arms: dict[str, Arm]) -> dict[str, float | str]:
    """Auto vs the best and the median measured expert that fits the budget."""
    auto = arms.get("auto")
    experts = [a for name, a in arms.items() if name != "auto" and a.status == "ok"]
    best = max(experts, key=lambda a: a.tokens_per_s, default=None)
    out: dict[str, float | str] = {"best_recipe": best.arm if best else "",
                                   "experts_measured": len(experts),
                                   "experts_over_budget": sum(a.status == "over_budget"
                                                              for a in arms.values())}
    if auto is None or auto.status != "ok" or best is None:
        out["auto_status"] = auto.status if auto else "missing"
        return out
    median_tps = statistics.median(a.tokens_per_s for a in experts)
    out.update(auto_status="ok", auto_tps=auto.tokens_per_s, best_tps=best.tokens_per_s,
               median_tps=median_tps, vs_best=auto.tokens_per_s / best.tokens_per_s,
               vs_median=auto.tokens_per_s / median_tps)
    return out


def round_ratios(rows: list[dict[str, str]], config: str, best: str) -> list[float]:
    """Auto / ``best`` throughput within each round of ``config`` (arms of a round ran
    back to back, so this pairs measurements taken under the same machine conditions)."""
    latest = {row["cell"]: row for row in rows if row["config"] == config}
    by_round: dict[str, dict[str, float]] = defaultdict(dict)
    for row in latest.values():
        if row["status"] == "ok":
            by_round[row["round"]][row["arm"]] = _float(row["tokens_per_s"])
    return [arms["auto"] / arms[best] for _, arms in sorted(by_round.items())
            if "auto" in arms and best in arms and arms[best] > 0]


def round_spread(rows: list[dict[str, str]]) -> list[float]:
    """Per arm measured in several rounds: (max - min) / median of its rounds' tokens/s."""
    latest = {row["cell"]: row for row in rows}
    runs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in latest.values():
        if row["status"] == "ok":
            runs[(row["config"], row["arm"])].append(_float(row["tokens_per_s"]))
    return [(max(v) - min(v)) / statistics.median(v) for v in runs.values() if len(v) > 1]


def accuracy(rows: list[dict[str, str]], measure: str = "step_time_s"
             ) -> tuple[float, float, int]:
    """Spearman and median relative error of predicted vs measured step time, over every
    measured plan (config x arm, medians over rounds). ``measure``: ``step_time_s`` (median
    steady step) or ``min_step_time_s`` (fastest steady step, the least disturbed)."""
    pred, meas = [], []
    for arms in aggregate(rows).values():
        for a in arms.values():
            value = getattr(a, measure)
            if a.status == "ok" and not math.isnan(a.pred_step_time_s) and not math.isnan(value):
                pred.append(a.pred_step_time_s)
                meas.append(value)
    return spearman(pred, meas), median_relative_error(pred, meas), len(pred)


def write_markdown(rows: list[dict[str, str]], path: Path, notes: str = "",
                   machine: str = "this CPU box, gloo") -> str:
    agg = aggregate(rows)
    rho, err, n = accuracy(rows)
    lines = [f"# Sweep: auto plans vs TorchTitan recipes ({machine})", "",
             "Tokens/s: median over rounds of each run's median steady-step throughput. "
             "Experts predicted to exceed a memory budget are not run (`over_budget`).", "",
             "| config | auto tok/s | best recipe | best tok/s | median recipe tok/s | "
             "auto / best | auto / best per round | auto / median |",
             "|---|---|---|---|---|---|---|---|"]
    for config in sorted(agg):
        h = headline(agg[config])
        if h.get("auto_status") != "ok":
            lines.append(f"| {config} | auto {h.get('auto_status')} | {h['best_recipe']} | "
                         f"{_tps(agg[config], h['best_recipe'])} | | | | |")
            continue
        per_round = ", ".join(f"{r:.3f}" for r in round_ratios(rows, config, h["best_recipe"]))
        lines.append(f"| {config} | {h['auto_tps']:.0f} | {h['best_recipe']} | "
                     f"{h['best_tps']:.0f} | {h['median_tps']:.0f} | {h['vs_best']:.3f} | "
                     f"{per_round} | {h['vs_median']:.3f} |")
    spread = round_spread(rows)
    if spread:
        lines += ["", f"Noise: the same arm's throughput differs between rounds by a median "
                  f"{statistics.median(spread):.1%} (max {max(spread):.1%}) over "
                  f"{len(spread)} arms."]
    lines += ["", f"Cost model over {n} measured plans: Spearman {rho:.3f}, median relative "
              f"error {err:.1%} (predicted vs measured median steady step time)."]
    rho_min, err_min, n_min = accuracy(rows, "min_step_time_s")
    if n_min:
        lines.append(f"Against the fastest steady step of each run (the least disturbed by "
                     f"other processes): Spearman {rho_min:.3f}, median relative error "
                     f"{err_min:.1%} over {n_min} plans.")
    lines.append("")
    if notes:
        lines += [notes.strip(), ""]
    lines += ["## Every arm", "",
              "| config | arm | status | plan | tok/s | step s | predicted s | error | "
              "predicted peak GiB | peak GiB (CPU RSS, GPU reserved) | final loss | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for config in sorted(agg):
        for name, a in sorted(agg[config].items(), key=lambda kv: (kv[0] != "auto", kv[0])):
            rel = ((a.pred_step_time_s - a.step_time_s) / a.step_time_s
                   if a.status == "ok" else math.nan)
            lines.append(
                f"| {config} | {name} | {a.status} | {a.mesh} | {_num(a.tokens_per_s, 0)} | "
                f"{_num(a.step_time_s, 3)} | {_num(a.pred_step_time_s, 3)} | "
                f"{'' if math.isnan(rel) else f'{rel:+.0%}'} | {_num(a.pred_peak_gib, 3)} | "
                f"{_num(a.peak_memory_gib, 2)} | {_num(a.final_loss, 3)} | {a.note} |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def _tps(arms: dict[str, Arm], name: str) -> str:
    return _num(arms[name].tokens_per_s, 0) if name in arms else ""


def _num(value: float, digits: int) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}f}"


def write_plots(rows: list[dict[str, str]], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    agg = aggregate(rows)
    configs = [c for c in sorted(agg) if headline(agg[c]).get("best_recipe")]
    paths = []
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(configs) + 2), 4.5))
    x = range(len(configs))
    heads = [headline(agg[c]) for c in configs]
    width = 0.27
    for offset, key, label in ((-width, "auto_tps", "auto"), (0, "best_tps", "best recipe"),
                               (width, "median_tps", "median recipe")):
        values = [h.get(key, math.nan) if key != "best_tps" or "best_tps" in h
                  else agg[c][h["best_recipe"]].tokens_per_s
                  for c, h in zip(configs, heads, strict=True)]
        ax.bar([i + offset for i in x], values, width, label=label)
    ax.set_xticks(list(x), configs, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("auto vs TorchTitan recipes (CPU, gloo)")
    ax.legend()
    fig.tight_layout()
    paths.append(folder / "sweep_throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    paths.append(scatter_plot(rows, folder / "sweep_predicted_vs_measured.png"))
    return paths


def scatter_plot(rows: list[dict[str, str]], path: Path, label: str = "") -> Path:
    """Predicted vs measured step time of every measured plan (log-log, with y = x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    agg = aggregate(rows)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for kind, marker in (("auto", "o"), ("expert", "x")):
        pts = [(a.pred_step_time_s, a.step_time_s) for arms in agg.values()
               for a in arms.values() if a.status == "ok" and not math.isnan(a.pred_step_time_s)
               and (a.arm == "auto") == (kind == "auto")]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, label=kind)
    times = [a.step_time_s for arms in agg.values() for a in arms.values() if a.status == "ok"]
    lim = [min(times or [0.1]) * 0.8, max(times or [1.0]) * 1.25]
    ax.plot(lim, lim, "k--", lw=0.8, label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
    rho, err, n = accuracy(rows)
    ax.set_title(f"{label}Spearman {rho:.2f}, median error {err:.0%} (n={n})", fontsize=10)
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("measured step time (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = REPO / "experiments" / "results" / "sweep.csv"
    parser.add_argument("csv", nargs="?", default=str(default))
    parser.add_argument("--notes", default="", help="markdown file appended after the summary")
    parser.add_argument("--machine", default="this CPU box, gloo",
                        help="where the sweep ran, for the title")
    args = parser.parse_args(argv)
    path = Path(args.csv)
    if not path.is_file():
        print(f"error: no sweep results at {path} (run experiments/sweep.py first)",
              file=sys.stderr)
        return 2
    rows = read_rows(path)
    notes = Path(args.notes).read_text() if args.notes else ""
    print(write_markdown(rows, path.with_suffix(".md"), notes, args.machine))
    for p in write_plots(rows, path.parent):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
