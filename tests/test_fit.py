"""The profile fitter against independent references: constants it must give back from runs
the cost model generated with known constants plus noise, the committed CPU and H200 runs, and
the fit command's answers to bad input."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import numpy as np
import pytest

from torchtitan_autoparallel.commands.cli import main
from torchtitan_autoparallel.cost.hardware import load_profile
from torchtitan_autoparallel.errors import run_cli
from torchtitan_autoparallel.fitting.calibrate import benchmark_runs
from torchtitan_autoparallel.fitting.fit import Run, datasheet_caps, fit_profile, predicted_times
from torchtitan_autoparallel.fitting.report import accuracy
from torchtitan_autoparallel.fitting.runs import load_runs
from torchtitan_autoparallel.plan.schema import Plan
from torchtitan_autoparallel.titan.v0_2.registry import register

RESULTS = Path(__file__).resolve().parent.parent / "experiments" / "results"
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _noisy(runs: list[Run], truth, seed: int = 0) -> list[Run]:
    """``runs`` with the times the cost model gives on ``truth``, times 1 + 5 % Gaussian noise."""
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(r, measured_s=t * (1 + 0.05 * rng.standard_normal()))
            for r, t in zip(runs, predicted_times(runs, truth), strict=True)]


def test_fit_recovers_known_constants_from_noisy_runs() -> None:
    """A short sweep (the CPU sweep's plans at local batch 1, 2 and the full batch) and the
    collective micro-benchmarks, timed by a profile whose six constants all differ from the
    starting profile, with 5 % noise: each constant comes back within 10 %."""
    register()
    base = load_profile("cpu")
    truth = dataclasses.replace(base, matmul_efficiency=0.5, intra_node_gbps=0.45,
                                intra_node_latency_us=300.0, block_overhead_us=8000.0,
                                comm_overlap=0.5, host_copy_gbps=0.5)
    runs = []
    for path in sorted((RESULTS / "quiet" / "plans").glob("*.json")):
        plan = Plan.load(str(path))
        per_rank = plan.global_batch_size // plan.mesh.dp
        for lb in sorted({1, 2, per_rank}):
            runs.append(Run(f"{path.stem} lb{lb}", 1.0,
                            plan=dataclasses.replace(plan, local_batch_size=lb)))
    sizes = (1 << 12, 1 << 16, 1 << 20, 1 << 24)
    runs += benchmark_runs({}, {f"{k}:{n}": 1.0 for k in COLLECTIVES for n in sizes}, 2)
    free = ["matmul_efficiency", "intra_node_gbps", "intra_node_latency_us",
            "block_overhead_us", "comm_overlap", "host_copy_gbps"]
    result = fit_profile(_noisy(runs, truth), base, free)
    assert result.free == free and not result.unidentified
    for name in free:
        assert getattr(result.profile, name) == pytest.approx(getattr(truth, name), rel=0.10), name


def test_calibration_benchmarks_give_back_latency_and_bandwidth() -> None:
    """calibrate's fit: collectives over 4 ranks and one matmul, timed by the cost model's
    formulas on known constants with 5 % noise."""
    base = load_profile("cpu")
    truth = dataclasses.replace(base, peak_tflops=0.2, matmul_efficiency=1.0,
                                intra_node_gbps=2.5, intra_node_latency_us=40.0)
    sizes = (1 << 12, 1 << 16, 1 << 20, 1 << 24)
    runs = benchmark_runs({1024: 1.0}, {f"{k}:{n}": 1.0 for k in COLLECTIVES for n in sizes}, 4)
    start = dataclasses.replace(truth, peak_tflops=0.05, intra_node_gbps=0.5,
                                intra_node_latency_us=10.0)
    result = fit_profile(_noisy(runs, truth, seed=1), start,
                         ["peak_tflops", "intra_node_gbps", "intra_node_latency_us"])
    for name in ("peak_tflops", "intra_node_gbps", "intra_node_latency_us"):
        assert getattr(result.profile, name) == pytest.approx(getattr(truth, name), rel=0.10), name


def test_refitted_cpu_profile_predicts_unseen_sweeps_at_least_as_well() -> None:
    """Fitted to the quiet sweep, judged on two sweeps it did not see (other batch sizes, the
    re-planned auto runs): not worse than the committed profile on the same rows."""
    committed = load_profile("cpu")
    result = fit_profile(load_runs(RESULTS / "quiet" / "sweep.csv", committed), committed,
                         caps=datasheet_caps(committed))
    held = [r for name in ("quiet_batch", "quiet_replan")
            for r in load_runs(RESULTS / name / "sweep.csv", committed)]
    measured = [r.measured_s for r in held]
    rho_old, err_old = accuracy(predicted_times(held, committed), measured)
    rho_new, err_new = accuracy(predicted_times(held, result.profile), measured)
    assert len(held) == 26
    assert rho_new >= rho_old and err_new <= err_old


def test_fit_on_the_h200_runs_reproduces_their_accuracy() -> None:
    """The single-H200 runs (experiments/results/h200_model.md): fitting the sustained clock
    and the per-micro-batch host time to them ranks both sweeps right and reaches a median
    error within 5 %. (The shipped h200_sxm profile is not fitted: its kernel constants
    predict these runs within 12-17 % median.)"""
    base = load_profile("h200_sxm")
    sweeps = [load_runs(RESULTS / name / "sweep.csv", base) for name in ("h200", "h200_memory")]
    result = fit_profile([r for runs in sweeps for r in runs], base,
                         ["clock_scale", "block_overhead_us"])
    assert not result.unidentified
    first, second = (accuracy(predicted_times(runs, result.profile),
                              [r.measured_s for r in runs]) for runs in sweeps)
    assert second[0] == pytest.approx(1.0) and second[1] <= 0.035
    assert first[0] >= 0.94 and first[1] <= 0.05


def _csv(tmp_path: Path, header: str, rows: list[str]) -> str:
    path = tmp_path / "runs.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return str(path)


def _plan(config: str, sweep: str = "quiet") -> str:
    return str(RESULTS / sweep / "plans" / f"{config}.json")


def _fit(args: list[str], capsys) -> tuple[int, str, str]:
    code = run_cli(lambda: main(["fit", *args]))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("header,row,expected", [
    ("plan,status", "{p},ok", "lacks column(s) step_time_s"),
    ("step_time_s", "1.0", "lacks column(s) plan (or config and arm)"),
    ("plan,step_time_s", "{p},0", "step_time_s must be a positive number"),
    ("plan,step_time_s", "{p},-1.5", "step_time_s must be a positive number"),
    ("plan,step_time_s", "{h},0.7", "planned for hardware 'h200_sxm', not the base profile "
                                    "'cpu': fit with --base h200_sxm"),
])
def test_fit_rejects_bad_runs_in_one_line(tmp_path: Path, capsys, header: str, row: str,
                                          expected: str) -> None:
    row = row.format(p=_plan("llama3_ws2_b16_s256.ddp2"),
                     h=_plan("llama3_1B_ws1_b8_s4096.single", "h200"))
    out = tmp_path / "fitted.toml"
    code, _, err = _fit([_csv(tmp_path, header, [row]), "--base", "cpu", "--out", str(out)],
                        capsys)
    assert code == 2 and expected in err and err.count("\n") == 1
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["runs.csv"]


def test_fit_reports_what_too_few_runs_cannot_pin_down(tmp_path: Path, capsys) -> None:
    """Two runs for the default constants: the fit names every constant it could not
    determine and keeps its base value; the profile it writes loads."""
    rows = [f"{_plan('llama3_ws2_b16_s256.ddp2')},1.72",
            f"{_plan('llama3_ws2_b16_s256.fsdp2')},1.88"]
    out = tmp_path / "fitted.toml"
    code, text, _ = _fit([_csv(tmp_path, "plan,step_time_s", rows), "--base", "cpu", "--out",
                          str(out), "--no-cv"], capsys)
    base, fitted = load_profile("cpu"), load_profile(str(out))
    assert code == 0 and fitted.name == "cpu"
    lines = [line for line in text.splitlines() if "not identifiable" in line]
    assert {line.split()[0] for line in lines} >= {"inter_node_gbps", "inter_node_latency_us",
                                                   "kernel_launch_us"}
    assert any("only a combination with" in line for line in lines)
    for line in lines:
        name = line.split()[0]
        assert getattr(fitted, name) == getattr(base, name)
    assert "not identifiable" in out.read_text()


def test_fit_names_an_unknown_constant(tmp_path: Path, capsys) -> None:
    rows = [f"{_plan('llama3_ws2_b16_s256.ddp2')},1.72"]
    code, _, err = _fit([_csv(tmp_path, "plan,step_time_s", rows), "--base", "cpu", "--out",
                         str(tmp_path / "p.toml"), "--free", "warp_speed,gpus_per_node"], capsys)
    assert code == 2 and "cannot fit ['warp_speed', 'gpus_per_node']" in err
    assert err.count("\n") == 1


def test_fit_output_that_cannot_be_written_is_one_line(tmp_path: Path, capsys) -> None:
    rows = [f"{_plan('llama3_ws2_b16_s256.ddp2')},1.72"]
    runs = _csv(tmp_path, "plan,step_time_s", rows)
    out = Path(runs) / "fitted.toml"  # under a regular file: fails even as root
    code, _, err = _fit([runs, "--base", "cpu", "--out",
                         str(out), "--no-cv", "--free", "matmul_efficiency"], capsys)
    assert code == 2 and "cannot write profile" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.csv"]


def test_merged_rounds_are_one_run_at_their_median(tmp_path: Path) -> None:
    rows = [f"{_plan('llama3_ws2_b16_s256.ddp2')},{t}" for t in (1.0, 3.0, 1.5)]
    runs = load_runs(_csv(tmp_path, "plan,step_time_s", rows), load_profile("cpu"))
    assert len(runs) == 1 and runs[0].measured_s == statistics.median([1.0, 3.0, 1.5])
