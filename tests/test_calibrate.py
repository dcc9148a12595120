"""calibrate measures this machine and writes a profile the planner accepts."""

from torchtitan_autoparallel.commands.cli import main
from torchtitan_autoparallel.cost.hardware import load_profile
from torchtitan_autoparallel.errors import run_cli


def test_calibrate_writes_a_usable_profile(tmp_path, capfd):
    path = tmp_path / "measured.toml"
    assert main(["calibrate", "--ngpu", "2", "--out", str(path), "--quick"]) == 0
    profile = load_profile(str(path))
    assert profile.peak_tflops > 0.001 and profile.matmul_efficiency == 1.0
    assert 0.001 < profile.intra_node_gbps < 10_000
    assert 0 < profile.intra_node_latency_us < 1e6
    # progress on stderr, the collectives' lines from rank 0's process
    progress = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("[calib")]
    assert progress[-1].startswith("[calibrate 18/18,") and "ETA" in progress[-1]
    config = "train_configs/llama3_debug_auto.toml"
    assert main(["plan", "--config", config, "--ngpu", "2", "--hardware", str(path)]) == 0
    assert "autoparallel plan" in capfd.readouterr().out


def test_calibrate_needs_two_ranks(tmp_path, capsys):
    code = run_cli(lambda: main(["calibrate", "--ngpu", "1", "--out", str(tmp_path / "p.toml")]))
    assert code == 2 and "--ngpu >= 2" in capsys.readouterr().err
