"""The ``fit`` command: read runs, fit a profile, report predicted vs measured before and
after, leave-one-config-out accuracy and what the data could not pin down, write the profile."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from typing import Any

from ..cost.hardware import HardwareProfile, load_profile
from .fit import FitResult, Run, cross_validate, datasheet_caps, fit_profile


def accuracy(predicted: list[float], measured: list[float]) -> tuple[float, float]:
    """Spearman rank correlation and median relative error (nan where undefined)."""
    from scipy.stats import spearmanr

    pairs = [(p, m) for p, m in zip(predicted, measured, strict=True)
             if not math.isnan(p) and m > 0]
    if len(pairs) < 2:
        return math.nan, math.nan
    rho = float(spearmanr([p for p, _ in pairs], [m for _, m in pairs]).statistic)
    return rho, statistics.median(abs(p / m - 1) for p, m in pairs)


def _pct(pred: float, meas: float) -> str:
    return "" if math.isnan(pred) else f"{pred / meas - 1:+.0%}"


def run_table(runs: list[Run], result: FitResult, left_out: list[float],
              peaks: list[float | None]) -> str:
    """Per run: measured, before, after and left-out predictions, and peak memory."""
    lines = [f"{'run':44s} {'measured s':>10s} {'before':>8s} {'err':>5s} {'after':>8s} "
             f"{'err':>5s} {'left out':>8s} {'err':>5s} {'peak GiB':>8s} {'pred':>6s}"]
    for run, b, a, cv, pk in zip(runs, result.before_s, result.after_s, left_out, peaks,
                                 strict=True):
        m = run.measured_s
        lines.append(
            f"{run.label[:44]:44s} {m:10.4g} {b:8.4g} {_pct(b, m):>5s} {a:8.4g} {_pct(a, m):>5s} "
            f"{'' if math.isnan(cv) else format(cv, '8.4g'):>8s} {_pct(cv, m):>5s} "
            f"{'' if run.peak_memory_gib is None else format(run.peak_memory_gib, '8.3g'):>8s} "
            f"{'' if pk is None else format(pk, '6.3g'):>6s}")
    return "\n".join(lines)


def summary(runs: list[Run], result: FitResult, left_out: list[float]) -> list[str]:
    """Accuracy lines: before, after (in sample), leave one config out."""
    measured = [r.measured_s for r in runs]
    out = []
    for label, pred in (("base profile", result.before_s), ("fitted, in sample", result.after_s),
                        ("leave one config out", left_out)):
        rho, err = accuracy(pred, measured)
        if not math.isnan(err):
            out.append(f"{label}: Spearman {rho:.3f}, median relative error {err:.1%} over "
                       f"{len(runs)} runs")
    return out


def constants_table(base: HardwareProfile, result: FitResult) -> str:
    lines = [f"{'constant':28s} {'base':>12s} {'fitted':>12s}  determined to"]
    for name in result.free:
        se = result.rel_stderr.get(name, math.nan)
        how = ("at its bound" if name in result.at_bound else
               "exact fit" if math.isnan(se) else f"+-{se:.0%}")
        lines.append(f"{name:28s} {getattr(base, name):12.6g} "
                     f"{getattr(result.profile, name):12.6g}  {how}")
    for name, why in result.unidentified.items():
        lines.append(f"{name:28s} {getattr(base, name):12.6g} {'(kept)':>12s}  not identifiable: "
                     f"{why}")
    return "\n".join(lines)


def fit_command(args: argparse.Namespace) -> int:
    from ..cost.profile_file import write_profile
    from ..plan.recost import recost
    from .runs import load_runs

    base = load_profile(args.base)
    runs = [run for path in args.runs for run in load_runs(path, base)]
    free = [f.strip() for f in args.free.split(",") if f.strip()] or None
    if args.datasheet.lower() == "none":
        caps: dict[str, float] = {}
    else:
        caps = datasheet_caps(load_profile(args.datasheet) if args.datasheet else base)
    result = fit_profile(runs, base, free, caps, args.loss)
    if args.name:
        result = dataclasses.replace(result, profile=dataclasses.replace(result.profile,
                                                                         name=args.name))
    left_out = ([math.nan] * len(runs) if args.no_cv else
                cross_validate(runs, base, free, caps, args.loss))
    cache: dict[str, Any] = {}
    peaks = [recost(r.plan, result.profile, cache).predicted["peak_memory_gib"]
             if r.plan is not None else None for r in runs]
    notes = [f"fitted by `python -m torchtitan_autoparallel fit` to {len(runs)} runs "
             f"({', '.join(args.runs)}) from base {base.name!r}"]
    notes += summary(runs, result, left_out)
    notes += [f"not identifiable, kept from the base: {n} ({why})"
              for n, why in result.unidentified.items()] + result.notes
    write_profile(args.out, result.profile, notes,
                  {name: f"fitted: {notes[0]}" for name in result.free
                   if name not in result.unidentified})
    if args.json:
        print(json.dumps({
            "profile": dataclasses.asdict(result.profile), "fitted": result.free,
            "rel_stderr": result.rel_stderr, "at_bound": result.at_bound,
            "unidentified": result.unidentified, "notes": result.notes,
            "runs": [{"label": r.label, "group": r.group, "measured_s": r.measured_s,
                      "before_s": b, "after_s": a, "left_out_s": None if math.isnan(c) else c,
                      "peak_memory_gib": r.peak_memory_gib, "pred_peak_memory_gib": p}
                     for r, b, a, c, p in zip(runs, result.before_s, result.after_s, left_out,
                                              peaks, strict=True)]}, indent=1))
        return 0
    print(run_table(runs, result, left_out, peaks))
    print()
    print("\n".join(summary(runs, result, left_out)))
    print()
    print(constants_table(base, result))
    for note in result.notes:
        print(f"note: {note}")
    print(f"profile written to {args.out}; plan with --hardware {args.out}")
    return 0

