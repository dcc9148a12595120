"""Measured runs from a CSV, as ``fit.Run`` values: what ``fit`` and the sweep scripts read.

Columns (one row per measured run; the sweep's ``sweep.csv`` has them all):

    plan              the plan JSON that ran, relative to the CSV (or absolute); without it,
                      ``config`` and ``arm`` name ``plans/<config>.<arm>.json`` (sweep layout)
    step_time_s       measured seconds per training step (> 0; e.g. the median steady step)
    status            optional: rows other than ``ok`` are skipped
    peak_memory_gib   optional: measured peak memory per device (``tensor_peak_gib`` or
                      ``peak_active_gib`` are preferred when present)
    group             optional: what leave-one-out holds out together (default ``config``,
                      else the plan's model and world size)

Rows naming the same plan are one run: the median of their step times. Every plan must have
been made for the base profile's hardware (its fingerprint names it).
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from ..cost.hardware import HardwareProfile
from ..errors import UserError, read_input, shown
from .fit import Run

COLUMNS_HELP = ("plan (or config and arm), step_time_s; optional status, peak_memory_gib, "
                "group")


MAX_STEP_S = 1e6
"""Longest measured step time accepted (11 days: anything longer is a unit mistake)."""
MAX_PEAK_GIB = 1e4


def _float(value: str | None) -> float | None:
    """A finite number, or None (empty, not a number, inf or nan)."""
    try:
        number = float(value) if value not in (None, "") else None
    except ValueError:
        return None
    return number if number is None or math.isfinite(number) else None


PEAK_COLUMNS = ("tensor_peak_gib", "peak_active_gib", "peak_memory_gib")
"""Measured peak memory columns, best first: MemTracker's tensor peak, the device's active
peak, the peak the user's logs give (on a GPU TorchTitan logs the allocator's reserved peak)."""


def measured_peak(row: dict[str, str], columns: tuple[str, ...] = PEAK_COLUMNS
                  ) -> float | None:
    """Measured peak memory of a row (GiB): the first of ``columns`` it has."""
    for key in columns:
        value = _float(row.get(key))
        if value:
            return value
    return None


def plan_path(csv_path: Path, row: dict[str, str]) -> Path:
    """The plan file a row names."""
    if row.get("plan"):
        path = Path(row["plan"])
        return path if path.is_absolute() else csv_path.parent / path
    return csv_path.parent / "plans" / f"{row['config']}.{row['arm']}.json"


def read_rows(csv_path: Path) -> list[dict[str, str]]:
    """The CSV's rows, its columns checked."""
    try:
        text = read_input(csv_path, "runs file").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"runs file {csv_path} is not UTF-8 text: {shown(exc, 200)}") from exc
    reader = csv.DictReader(row for row in text.splitlines() if not row.startswith("#"))
    rows = list(reader)
    columns = set(reader.fieldnames or [])
    missing = [c for c in ("step_time_s",) if c not in columns]
    if not ({"plan"} <= columns or {"config", "arm"} <= columns):
        missing.append("plan (or config and arm)")
    if missing:
        raise UserError(f"{csv_path} lacks column(s) {', '.join(missing)}: a runs CSV needs "
                        f"{COLUMNS_HELP}")
    return rows


def load_runs(csv_path: str | Path, base: HardwareProfile | None = None,
              statuses: tuple[str, ...] = ("ok",)) -> list[Run]:
    """The measured runs of ``csv_path`` (rows of the same plan merged: median time), checked:
    positive times, existing plan files made for ``base``'s hardware."""
    from ..frontend import frontend
    from ..plan.schema import Plan

    frontend().prepare_models("")  # the installed release's models, read by recost
    path = Path(csv_path)
    merged: dict[Path, list[dict[str, str]]] = {}
    for n, row in enumerate(read_rows(path), start=2):
        if row.get("status", "ok") not in statuses:
            continue
        time = _float(row.get("step_time_s"))
        if time is None or not 0 < time <= MAX_STEP_S:
            raise UserError(f"{path} line {n}: step_time_s must be a positive number of "
                            f"seconds up to {MAX_STEP_S:g}, got {shown(row.get('step_time_s'))}")
        peak = measured_peak(row)
        if peak is not None and not 0 < peak <= MAX_PEAK_GIB:
            raise UserError(f"{path} line {n}: the measured peak memory must be a positive "
                            f"number of GiB up to {MAX_PEAK_GIB:g}, got {shown(peak)}")
        merged.setdefault(plan_path(path, row), []).append(row)
    runs = []
    for file, rows in merged.items():
        if not file.is_file():
            raise UserError(f"{path}: plan file {file} not found (write each run's plan with "
                            "`plan --out` or [autoparallel] save_plan)")
        plan = Plan.load(str(file))
        hardware = plan.fingerprint.get("hardware")
        if base is not None and hardware != base.name:
            raise UserError(f"{file} was planned for hardware {hardware!r}, not the base "
                            f"profile {base.name!r}: fit with --base {hardware} (or a profile "
                            "of that name)")
        peaks = [p for p in (measured_peak(r) for r in rows) if p]
        first = rows[0]
        group = first.get("group") or first.get("config") or (
            f"{plan.fingerprint.get('model')}_ws{plan.mesh.world}")
        label = (f"{first['config']}/{first['arm']}" if first.get("config") and first.get("arm")
                 else file.stem)
        runs.append(Run(label, statistics.median(float(r["step_time_s"]) for r in rows),
                        plan=plan, group=group,
                        peak_memory_gib=statistics.median(peaks) if peaks else None))
    if not runs:
        raise UserError(f"{path} has no measured runs (rows with status ok and a step time)")
    return runs
