"""The sweep runner's pieces without training: grid parsing, recipe enumeration, resume,
interleaving, Spearman and median relative error, the report, and the host-time cost terms."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support import sweep, sweep_report

REPO = Path(__file__).resolve().parent.parent


def _grid(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text)
    return path


def test_grid_expands_lists_to_the_cartesian_product(tmp_path: Path) -> None:
    grid = sweep.load_grid(_grid(tmp_path, """
name = "t"
rounds = 3
[[config]]
family = "llama3"
ngpu = [2, 4]
global_batch = [8, 16]
recipes = ["fsdp2", "tp2"]
[[config]]
family = "qwen3"
ngpu = 2
memory_gib = 0.25
recipe_ac = ["none", "full"]
"""))
    assert grid.rounds == 3 and grid.steps == 6
    assert [c.id for c in grid.configs] == [
        "llama3_ws2_b8_s256", "llama3_ws2_b16_s256", "llama3_ws4_b8_s256",
        "llama3_ws4_b16_s256", "qwen3_ws2_b16_s256_m0.25"]
    assert grid.configs[0].recipes == ("fsdp2", "tp2")
    assert grid.configs[-1].recipe_ac == ("none", "full")


@pytest.mark.parametrize("text", ["bogus = 1\n", "[[config]]\nfamily = 'llama3'\n",
                                  "[[config]]\nfamily = 'llama3'\nngpu = 2\nwat = 1\n"])
def test_grid_errors_name_the_problem(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValueError, match="unknown|needs family and ngpu"):
        sweep.load_grid(_grid(tmp_path, text))


def test_cli_reports_a_bad_grid_in_one_line(tmp_path: Path, capsys) -> None:
    assert sweep.main([str(_grid(tmp_path, "bogus = 1\n"))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def test_legal_recipes_follow_heads_sequence_and_batch() -> None:
    cfg = sweep.Config("llama3", 4, 16, 256)
    names = {r.name for r in sweep.legal_recipes(cfg, n_heads=8, n_kv_heads=8)}
    assert {"fsdp4", "ddp4", "hsdp2x2", "fsdp2_tp2", "tp4", "cp4", "fsdp2_cp2",
            "cp2_tp2"} <= names
    # 6 heads: tp 4 is illegal; batch 2 cannot split over dp 4
    names = {r.name for r in sweep.legal_recipes(sweep.Config("llama3", 4, 2, 256), 6, 6)}
    assert "tp4" not in names and "fsdp4" not in names and "fsdp2_tp2" in names
    # seq 12: cp needs seq % (2 cp tp) == 0
    names = {r.name for r in sweep.legal_recipes(sweep.Config("llama3", 4, 16, 12), 8, 8)}
    assert "cp2_tp2" not in names and "cp4" not in names and "fsdp2_cp2" in names
    ac = sweep.legal_recipes(sweep.Config("llama3", 2, 16, 256, recipes=("fsdp2",),
                                          recipe_ac=("none", "full")), 8, 8)
    assert [r.name for r in ac] == ["fsdp2", "fsdp2+ac_full"]
    # MoE: TorchTitan's ep layouts (etp = tp inside dp_shard x cp, or etp = 1 taking all of tp)
    moe = {r.name for r in sweep.legal_recipes(sweep.Config("deepseek_v3", 4, 16, 256), 8, 8, 8)}
    assert {"fsdp4_ep2", "fsdp4_ep4", "fsdp2_tp2_ep2etp2", "fsdp2_tp2_ep4"} <= moe
    assert not {"ddp4_ep2", "ddp4_ep4", "tp4_ep4"} & moe  # EP needs FSDP ranks beside it


def test_recipe_overrides_set_every_degree_and_the_local_batch() -> None:
    cfg = sweep.Config("llama3", 4, 16, 256)
    over = sweep.recipe_overrides(cfg, sweep.Recipe(1, 2, 2, 1, "selective"))
    assert "--parallelism.tensor_parallel_degree=2" in over
    assert "--training.local_batch_size=8" in over
    assert "--activation_checkpoint.selective_ac_option=op" in over


def test_interleaving_reverses_every_other_round() -> None:
    arms = ["auto", "a", "b"]
    assert sweep.arm_order(arms, 0) == arms
    assert sweep.arm_order(arms, 1) == ["b", "a", "auto"]


def test_steady_stats_skip_warmup_steps() -> None:
    rows = [{"step": s, "step_time_s": t, "tokens_per_s": 100 / t, "loss": 10 - s,
             "peak_memory_gib": 0.5 + s / 10} for s, t in enumerate([9.0, 5.0, 1.0, 2.0, 3.0],
                                                                     start=1)]
    stats = sweep.steady_stats(rows, steady_from=3)
    assert stats["step_time_s"] == 2.0 and stats["steps_measured"] == 3
    assert stats["final_loss"] == 5 and stats["peak_memory_gib"] == pytest.approx(1.0)
    assert sweep.steady_stats(rows[:2], steady_from=3) == {}


def test_finished_cells_are_skipped(tmp_path: Path, monkeypatch) -> None:
    """A second run of the same grid trains nothing: every cell is already in the CSV."""
    grid = sweep.Grid("t", rounds=2, max_foreign_load=math.inf, configs=[
        sweep.Config("llama3", 2, 8, 256, recipes=("fsdp2",))])
    calls = []
    monkeypatch.setattr(sweep, "wait_for_quiet", lambda load, wait: 0.0)
    monkeypatch.setattr(sweep, "_heads", lambda family, flavor: (8, 8, 0))
    monkeypatch.setattr(sweep, "predict", lambda cfg, recipe, path: {
        "pred_step_time_s": 1.0, "pred_peak_gib": 0.1})

    def fake_run(cfg, grid, extra, auto, workdir):
        calls.append(auto)
        rows = [{"step": s, "step_time_s": 1.0 + auto, "tokens_per_s": 2048 / (1.0 + auto),
                 "loss": 5.0, "peak_memory_gib": 1.0} for s in range(1, 7)]
        return 0, rows, ""

    monkeypatch.setattr(sweep, "run_training", fake_run)
    assert sweep.run_grid(grid, tmp_path, tmp_path / "plans") == 4
    assert calls == [True, False, False, True]
    assert sweep.run_grid(grid, tmp_path, tmp_path / "plans") == 0
    assert len(calls) == 4
    done = sweep.read_done(tmp_path / "sweep.csv")
    assert set(done) == {f"llama3_ws2_b8_s256/{a}/r{r}" for a in ("auto", "fsdp2")
                         for r in (1, 2)}
    # cells measured on a busy machine can be re-run; the new row supersedes the old
    assert sweep.run_grid(grid, tmp_path, tmp_path / "plans", rerun_disturbed=-1.0) == 4
    assert len(sweep_report.read_rows(tmp_path / "sweep.csv")) == 8
    # the report reads it back: auto (2 s/step) is half the expert's (1 s/step) speed
    head = sweep_report.headline(sweep_report.aggregate(sweep_report.read_rows(
        tmp_path / "sweep.csv"))["llama3_ws2_b8_s256"])
    assert head["best_recipe"] == "fsdp2" and head["vs_best"] == pytest.approx(0.5)
    assert head["experts_measured"] == 1
    rows = sweep_report.read_rows(tmp_path / "sweep.csv")
    assert sweep_report.round_ratios(rows, "llama3_ws2_b8_s256", "fsdp2") == [
        pytest.approx(0.5), pytest.approx(0.5)]
    assert sweep_report.round_spread(rows) == [0.0, 0.0]  # identical rounds


def test_over_budget_experts_are_not_run(tmp_path: Path, monkeypatch) -> None:
    grid = sweep.Grid("t", rounds=1, max_foreign_load=math.inf, configs=[
        sweep.Config("deepseek_v3", 2, 8, 256, memory_gib=0.5, recipes=("fsdp2",))])
    monkeypatch.setattr(sweep, "_heads", lambda family, flavor: (8, 8, 8))
    monkeypatch.setattr(sweep, "predict", lambda cfg, recipe, path: {
        "pred_step_time_s": 1.0, "pred_peak_gib": 0.7 if recipe else 0.4})
    trained = []

    def fake_run(cfg, grid, extra, auto, workdir):
        trained.append(auto)
        return 0, [{"step": s, "step_time_s": 1.0, "tokens_per_s": 2048.0, "loss": 5.0}
                   for s in range(1, 7)], ""

    monkeypatch.setattr(sweep, "run_training", fake_run)
    sweep.run_grid(grid, tmp_path, tmp_path / "plans")
    done = sweep.read_done(tmp_path / "sweep.csv")
    assert trained == [True]  # the auto plan (within budget) ran; the expert did not
    assert done["deepseek_v3_ws2_b8_s256_m0.5/auto/r1"]["status"] == "ok"
    assert done["deepseek_v3_ws2_b8_s256_m0.5/fsdp2/r1"]["status"] == "over_budget"


def test_runs_on_a_shared_machine_are_repeated(tmp_path: Path, monkeypatch) -> None:
    """Other processes' CPU use during a run triggers a repeat; the quietest attempt is kept."""
    grid = sweep.Grid("t", retries=2, max_foreign_load=0.3)
    monkeypatch.setattr(sweep, "wait_for_quiet", lambda load, wait: 0.0)
    busy = iter([0.0, 1e9, 0.0, 1e9, 0.0, 0.0])  # attempts 1 and 2 shared, 3 quiet
    monkeypatch.setattr(sweep, "_busy_cpu_s", lambda: next(busy))
    monkeypatch.setattr(sweep, "_children_cpu_s", lambda: 0.0)
    runs = []
    monkeypatch.setattr(sweep, "run_training", lambda *a: runs.append(1) or (0, [], ""))
    code, _, _, foreign, attempts = sweep.measure_run(
        sweep.Config("llama3", 2, 8, 256), grid, [], True, tmp_path)
    assert (code, foreign, attempts, len(runs)) == (0, 0.0, 3, 3)


def test_spearman_matches_known_values() -> None:
    assert sweep_report.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert sweep_report.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # textbook example with ties: ranks (1, 2.5, 2.5, 4) vs (1, 2, 3, 4)
    assert sweep_report.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(
        0.9486833, rel=1e-6)
    # no ties: 1 - 6 sum(d^2) / (n (n^2 - 1)) = 1 - 6 * 26 / 120
    assert sweep_report.spearman([1, 5, 2, 4, 3], [2, 1, 4, 3, 5]) == pytest.approx(-0.3)
    assert math.isnan(sweep_report.spearman([1], [1]))


def test_median_relative_error() -> None:
    assert sweep_report.median_relative_error([1.1, 2.0, 2.4], [1.0, 2.0, 3.0]) == \
        pytest.approx(0.1)


def test_host_time_stretches_oversubscribed_ranks() -> None:
    import dataclasses

    from torchtitan_autoparallel.candidates.layout import Mesh
    from torchtitan_autoparallel.cost.hardware import load_profile
    from torchtitan_autoparallel.cost.model import CostContext, Precision, host_time_s, on_host

    def ctx(profile):
        return CostContext(hw=profile, prec=Precision(), gpus_per_node=8)

    hw = dataclasses.replace(load_profile("cpu"), host_cores=2, block_overhead_us=1000.0)
    two, eight = Mesh(dp_replicate=1, dp_shard=2, tp=1), Mesh(dp_replicate=1, dp_shard=8, tp=1)
    assert host_time_s(1.0, two, ctx(hw)) == pytest.approx(1.001)
    assert host_time_s(1.0, eight, ctx(hw)) == pytest.approx(4.001)
    gpu = load_profile("h100_sxm")
    # a GPU's ranks have their own devices: no stretch, only the per-layer host time
    assert host_time_s(1.0, eight, ctx(gpu)) == pytest.approx(1.0 + gpu.block_overhead_us * 1e-6)
    # collectives of oversubscribed ranks wait for a time slice; not so at 2 ranks on 2 cores
    hw = dataclasses.replace(hw, intra_node_latency_us=100.0, oversubscribed_latency_us=5000.0)
    four = Mesh(dp_replicate=1, dp_shard=4, tp=1)
    assert on_host(ctx(hw), four).hw.intra_node_latency_us == 5100.0
    assert on_host(ctx(hw), two).hw is hw
    assert on_host(ctx(gpu), eight).hw is gpu


def test_host_copies_make_sharded_data_parallel_cost_more_than_replication() -> None:
    """``host_copy_gbps``: FSDP2's all-gather / reduce-scatter buffers are copied on the
    training thread (the time DDP saves on CPU); off (0) on GPU profiles."""
    import dataclasses

    from torchtitan_autoparallel.candidates.layout import BlockStrategy, Mesh
    from torchtitan_autoparallel.cost.hardware import load_profile
    from torchtitan_autoparallel.cost.model import CostContext, Precision, block_cost
    from torchtitan_autoparallel.graph.layer_graph import Layer

    layer = Layer(fqn="layers.0", kind="block", params=10**6, fwd_flops=1e9, saved_bytes=1e6,
                  io_bytes=1e5, signature="b")
    hw = dataclasses.replace(load_profile("cpu"), host_copy_gbps=0.0)
    copies = dataclasses.replace(hw, host_copy_gbps=1.0)

    def time(profile, mesh, reshard=True):
        return block_cost(layer, mesh, BlockStrategy("none", reshard), 1,
                          CostContext(hw=profile, prec=Precision(), gpus_per_node=8)).time_s

    ddp, fsdp = Mesh(dp_replicate=2, dp_shard=1, tp=1), Mesh(dp_replicate=1, dp_shard=2, tp=1)
    assert time(copies, ddp) == time(hw, ddp)  # replication: no sharded collectives
    # 4 MB of parameters all-gathered twice (forward, backward) + 4 MB of gradients
    assert time(copies, fsdp) - time(hw, fsdp) == pytest.approx(12e6 / 1e9)
    assert time(copies, fsdp, reshard=False) - time(hw, fsdp, reshard=False) == \
        pytest.approx(8e6 / 1e9)
    assert load_profile("h100_sxm").host_copy_gbps == 0.0


def test_gpu_grids_name_hardware_flavor_and_memory_measurement(tmp_path: Path) -> None:
    """Grid keys for device runs: the profile the plans use, the model flavor (its configs are
    ``<family>_<flavor>_{auto,fsdp}.toml``) and MemTracker on step 2."""
    grid = sweep.load_grid(_grid(tmp_path, """
measure_memory = true
[[config]]
family = "llama3"
flavor = "1B"
hardware = "h200_sxm"
ngpu = 1
global_batch = 8
seq_len = 4096
"""))
    cfg = grid.configs[0]
    assert grid.measure_memory and cfg.id == "llama3_1B_ws1_b8_s4096"
    assert "--autoparallel.hardware=h200_sxm" in sweep.common_overrides(cfg)
    assert sweep.config_file(cfg, True).name == "llama3_1b_auto.toml"
    assert sweep.config_file(cfg, True).is_file() and sweep.config_file(cfg, False).is_file()
    # MemTracker's row and the device's active peak reach the CSV
    rows = [{"step": s, "step_time_s": 1.0, "tokens_per_s": 1.0, "loss": 1.0,
             "peak_memory_gib": 3.0, "peak_active_gib": 2.0 + s} for s in (1, 2, 3)]
    rows[1].update(measured_tensor_peak_gib=2.5,
                   measured_tensor_peak_by_kind_gib={"Total": 2.5, "Activation": 1.25})
    stats = sweep.steady_stats(rows, steady_from=2)
    assert stats["peak_active_gib"] == 5.0 and stats["tensor_peak_gib"] == 2.5
    assert '"Activation": 1.25' in stats["tensor_peak_by_kind"]


def test_repredict_costs_the_plan_that_ran() -> None:
    """``recost.recost`` (behind repredict.py and the CPU profile fit) costs a stored plan,
    mixed AC included, as it ran: unchanged model and profile, unchanged prediction."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.plan.recost import recost
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    job = parse_config(["--job.config_file", str(REPO / "train_configs/llama3_bench_auto.toml"),
                        "--parallelism.auto", "--autoparallel.memory_gib=0.2",
                        # the measured runs were planned before pp was searched
                        "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac"])
    plan = plan_job(job, 2)
    assert len({lp.ac for lp in plan.layers if lp.kind == "block"}) > 1
    again = recost(plan).predicted
    assert again["step_time_s"] == pytest.approx(plan.predicted["step_time_s"])
    assert again["peak_memory_gib"] == pytest.approx(plan.predicted["peak_memory_gib"])
