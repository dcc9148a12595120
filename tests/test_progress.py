"""Progress lines: items done / total, elapsed, ETA from the mean time per item so far; the
sweep prints one per cell it runs (resumed cells are not counted)."""

import math
from pathlib import Path

from torchtitan_autoparallel.commands import progress as progress_module
from torchtitan_autoparallel.commands.progress import Progress

from tests.support import sweep


def test_eta_is_the_mean_time_per_item_times_what_is_left(monkeypatch, capsys):
    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "time", lambda: now[0])
    p = Progress(4, "sweep")
    assert p.line("start") == "[sweep 0/4, 0:00 elapsed, ETA unknown] start"
    now[0] += 30
    p.advance("cell a")
    now[0] += 90  # 2 min for 2 items: 1 min each, 2 left
    p.advance("cell b")
    assert capsys.readouterr().err.splitlines() == [
        "[sweep 1/4, 0:30 elapsed, ETA 1:30] cell a",
        "[sweep 2/4, 2:00 elapsed, ETA 2:00] cell b",
    ]
    now[0] += 7200
    assert p.line("x") == "[sweep 2/4, 2:02:00 elapsed, ETA 2:02:00] x"


def test_sweep_prints_progress_over_the_cells_left(tmp_path: Path, monkeypatch, capsys) -> None:
    grid = sweep.Grid("t", rounds=2, max_foreign_load=math.inf, configs=[
        sweep.Config("llama3", 2, 8, 256, recipes=("fsdp2",))])
    monkeypatch.setattr(sweep, "_heads", lambda family, flavor: (8, 8, 0))
    monkeypatch.setattr(sweep, "predict", lambda cfg, recipe, path: {
        "pred_step_time_s": 1.0, "pred_peak_gib": 0.1})
    assert sweep.run_grid(grid, tmp_path, tmp_path / "plans", dry=True) == 4
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[sweep")]
    assert [ln.split(",")[0] for ln in lines] == [f"[sweep {i}/4" for i in range(1, 5)]
    assert all("ETA" in ln and "dry" in ln for ln in lines)
