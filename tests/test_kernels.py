"""The kernel-level cost model against the kernel data it is built from (held-out shapes: the
GEMM table, torchao's float8 rowwise linear micro-benchmark), float8's crossover, and the
profiles' provenance."""

import csv
import dataclasses
import statistics
from pathlib import Path

import pytest

import torchtitan_autoparallel.titan.v0_2.job as job_config_module
from torchtitan_autoparallel.candidates.strategies import BlockStrategy
from torchtitan_autoparallel.cost import kernels
from torchtitan_autoparallel.cost.hardware import Device, available_profiles, load_profile
from torchtitan_autoparallel.cost.model import CostContext, Precision, compute_s
from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.graph.layer_graph import Layer
from torchtitan_autoparallel.job.features import Features
from torchtitan_autoparallel.plan.schema import Mesh

KERNELS = kernels.KERNEL_DIR
REPO = Path(__file__).resolve().parent.parent


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


@pytest.mark.parametrize("axis", ["m", "n", "k"])
def test_gemm_interpolation_predicts_held_out_shapes(tmp_path, axis):
    """Drop every shape whose ``axis`` is 2048 (a fifth of the measured sm_90 table) and
    predict those shapes from the rest: median error within 10 %."""
    rows = [r for r in _rows(KERNELS / "gemm_sm_90.csv")
            if r["b"] == "1" and r["dtype"] == "bf16"]
    held = [r for r in rows if r[axis] == "2048"]
    kept = [r for r in rows if r[axis] != "2048"]
    path = tmp_path / f"held_out_{axis}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(kept[0]))
        writer.writeheader()
        writer.writerows(kept)
    name = str(path)
    errors = [abs(kernels.table_flops(name, "bf16", int(r["m"]), int(r["n"]), int(r["k"]))
                  / float(r["flops_per_s"]) - 1) for r in held]
    assert len(held) == 25 and statistics.median(errors) <= 0.10, statistics.median(errors)


def _linear_layer(m: int, k: int, n: int) -> Layer:
    """One linear (k -> n) over m tokens, as the layer graph describes a block."""
    return Layer(fqn="x", kind="block", params=k * n, fwd_flops=2.0 * m * k * n,
                 saved_bytes=0.0, io_bytes=4.0 * m * k, signature="x",
                 gemm_io_bytes=2.0 * m * (k + n), linear_shapes=((k, n),),
                 linear_input_elements=float(m * k))


def _ctx(hw, prec, features):
    return CostContext(hw=hw, prec=prec, gpus_per_node=8, features=features)


def _float8_speedup(m: int, k: int, n: int, recipe: str, hw) -> float:
    layer, mesh = _linear_layer(m, k, n), Mesh(dp_replicate=1, dp_shard=1, tp=1)
    strategy, prec = BlockStrategy("none", False), Precision(2, 4)
    bf16 = compute_s(layer, mesh, strategy, 1, _ctx(hw, prec, Features(compile=True)))[1]
    # every linear float8 (filter_fqns set, empty): the linear's own float8 cost
    f8 = compute_s(layer, mesh, strategy, 1, _ctx(hw, prec, Features(
        compile=True, linear=f"float8_{recipe}", float8_filter=())))[1]
    return bf16 / f8


def test_planner_keeps_a_linear_in_bf16_exactly_where_float8_is_slower():
    """filter_fqns unset: a linear runs float8 in the plan's cost exactly where its own float8
    cost (every linear converted) beats bf16, so the chosen cost is the better of the two."""
    hw = load_profile("h100_sxm")
    for m, k, n in ((1024, 1024, 1024), (8192, 4096, 1024), (16384, 8192, 8192)):
        layer, mesh = _linear_layer(m, k, n), Mesh(dp_replicate=1, dp_shard=1, tp=1)
        strategy, prec = BlockStrategy("none", False), Precision(2, 4)
        bf16 = compute_s(layer, mesh, strategy, 1, _ctx(hw, prec, Features(compile=True)))[1]
        chosen = compute_s(layer, mesh, strategy, 1, _ctx(hw, prec, Features(
            compile=True, linear="float8_tensorwise")))[1]
        assert chosen == pytest.approx(bf16 / max(1.0, _float8_speedup(m, k, n, "tensorwise",
                                                                        hw)))


@pytest.mark.parametrize("axis", ["M", "K", "N"])
def test_float8_rowwise_linears_predict_held_out_shapes(tmp_path, axis):
    """Rowwise float8 linears are costed from torchao's rowwise micro-benchmark on H100: drop
    every shape whose ``axis`` is 4096 (a sixth of it), cost those linears from the rest
    through the whole model (bf16 GEMM table, the benchmark's norm and sigmoid taken off and
    put back): median error within 10 %, and where the benchmark measured a clear loss
    (< 0.9x) or win (> 1.1x) the model predicts it."""
    rows = _rows(KERNELS / "float8_rowwise_torchao_h100.csv")
    held = [r for r in rows if r[axis] == "4096"]
    path = tmp_path / f"held_out_{axis}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(r for r in rows if r[axis] != "4096")
    hw = dataclasses.replace(load_profile("h100_sxm"), float8_rowwise_table=str(path))
    measured = [float(r["speedup_vs_bf16"]) for r in held]
    predicted = [_float8_speedup(int(r["M"]), int(r["K"]), int(r["N"]), "rowwise", hw)
                 for r in held]
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured, strict=True)]
    clear = [(m > 1) == (p > 1) for p, m in zip(predicted, measured, strict=True)
             if abs(m - 1) > 0.1]
    assert len(held) == 36 and statistics.median(errors) <= 0.10, statistics.median(errors)
    assert sum(clear) / len(clear) >= 0.9, sum(clear) / len(clear)


def test_tp_splits_the_side_the_tp_plan_shards():
    """Llama 3's inferred TP plan: wq / wk / wv / w1 / w3 column-wise (outputs split, wk and wv
    too, though their outputs are the narrower side), wo / w2 row-wise (inputs split)."""
    from torchtitan_autoparallel.cost.compute import _tp_split, linear_styles
    from torchtitan_autoparallel.job.inputs import model_layer_graph
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    block = model_layer_graph("llama3", "8B", 8192).blocks[0]
    styles = dict(zip(block.linear_names, linear_styles(block), strict=True))
    assert styles == {"attention.wq": "colwise", "attention.wk": "colwise",
                      "attention.wv": "colwise", "attention.wo": "rowwise",
                      "feed_forward.w1": "colwise", "feed_forward.w2": "rowwise",
                      "feed_forward.w3": "colwise"}
    assert _tp_split(4096, 1024, 8, "colwise") == (4096, 128)
    assert _tp_split(14336, 4096, 8, "rowwise") == (1792, 4096)


def test_ring_attention_work_grows_with_the_ring_at_a_fixed_local_length():
    """torch's ring attention merges one partial output per step in fp32: at the same local
    sequence (32k tokens per rank), more ranks in the ring mean more memory-bound work."""
    from torchtitan_autoparallel.cost.model import ring_attention_bytes
    from torchtitan_autoparallel.job.inputs import model_layer_graph
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    work = [sum(ring_attention_bytes(model_layer_graph("llama3", "8B", 32768 * cp).blocks[0],
                                     Mesh(dp_replicate=1, dp_shard=8 // cp, tp=1, cp=cp), 1))
            for cp in (2, 4, 8)]
    assert work[0] < work[1] < work[2]
    assert work[2] / work[0] > 3


def test_float8_tensorwise_has_a_crossover():
    """Small GEMMs lose under float8 (casts and launch-bound GEMMs), large ones win."""
    hw = load_profile("h100_sxm")
    assert _float8_speedup(1024, 1024, 1024, "tensorwise", hw) < 1.0
    assert _float8_speedup(16384, 8192, 8192, "tensorwise", hw) > 1.2
    assert (_float8_speedup(16384, 8192, 8192, "rowwise", hw)
            < _float8_speedup(16384, 8192, 8192, "tensorwise", hw))


@pytest.mark.parametrize("name", available_profiles())
def test_every_profile_constant_has_a_provenance(name):
    hw = load_profile(name)
    kinds = {v.split(":", 1)[0] for _, v in hw.provenance}
    assert kinds <= {"datasheet", "measured", "fitted", "assumed"}
    assert len(hw.provenance) >= 15


def test_gpu_profiles_run_one_model():
    """Every GPU profile sets the same kernel-level fields (no feature free on one of them)."""
    gpu = [load_profile(n) for n in available_profiles() if n != "cpu"]
    assert {p.name for p in gpu} >= {"h100_sxm", "h100_grand_teton", "h200_sxm", "a100_sxm",
                                     "b200"}
    fields = {frozenset(k for k, _ in p.provenance) for p in gpu}
    assert len(fields) == 1
    assert all(p.gemm_table and p.attention_fwd_tflops and p.hbm_gbps for p in gpu)


def test_profile_provenance_gaps(tmp_path):
    """A user file may leave a field out of [provenance] (it counts as assumed); a shipped
    profile may not, and no file may give a source of an unknown kind."""
    text = (KERNELS.parent / "h100_sxm.toml").read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("hbm_gbps = \""))
    path = tmp_path / "p.toml"
    path.write_text(text)
    assert load_profile(str(path)).source("hbm_gbps").startswith("assumed: p.toml does not say")
    path.write_text(text.replace('clock_scale = "assumed:', 'clock_scale = "guessed:'))
    with pytest.raises(UserError, match="clock_scale has no provenance"):
        load_profile(str(path))
    for name in available_profiles():
        assert not any("does not say" in v for _, v in load_profile(name).provenance), name


@pytest.mark.parametrize("reported,memory,profile", [
    ("NVIDIA H100 80GB HBM3", 79.1, "h100_sxm"), ("NVIDIA H100", 95.0, "h100_grand_teton"),
    ("NVIDIA H200", 139.8, "h200_sxm"), ("NVIDIA A100-SXM4-80GB", 79.2, "a100_sxm"),
    ("NVIDIA B200", 178.0, "b200"),
])
def test_gpu_job_uses_the_profile_of_its_device(monkeypatch, reported, memory, profile):
    """A job whose TOML names no hardware takes the profile of the GPU CUDA reports (faked)."""
    job = _job_without_hardware()
    monkeypatch.setattr(job_config_module, "device",
                        lambda: Device(reported, (9, 0), memory))
    monkeypatch.setattr(job_config_module, "device_capability", lambda: (9, 0))
    job_config_module.check_config(job, cpu=False, dry_run=False)
    assert job.autoparallel.hardware == profile


def test_gpu_without_a_profile_stops_in_one_line(monkeypatch):
    job = _job_without_hardware()
    monkeypatch.setattr(job_config_module, "device",
                        lambda: Device("NVIDIA H100 PCIe", (9, 0), 79.6))
    monkeypatch.setattr(job_config_module, "device_capability", lambda: (9, 0))
    with pytest.raises(UserError) as err:
        job_config_module.check_config(job, cpu=False, dry_run=False)
    text = str(err.value)
    assert "\n" not in text and "H100 PCIe" in text and "autoparallel.hardware" in text


def test_offline_plan_without_hardware_says_which_profile_in_its_first_line(tmp_path, capsys):
    from torchtitan_autoparallel.commands.cli import main

    config = REPO / "train_configs" / "llama3_debug_auto.toml"
    text = config.read_text().replace('hardware = "cpu"\n', "")
    path = tmp_path / "no_hardware.toml"
    path.write_text(text)
    assert main(["predict", "--config", str(path), "--ngpu", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("note: no hardware profile chosen") and "'cpu'" in first


def _job_without_hardware():
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    job = parse_config(["--job.config_file", str(REPO / "train_configs/llama3_debug_auto.toml"),
                        "--parallelism.auto"])
    job.autoparallel.hardware = ""
    return job


def test_plan_and_explain_give_the_margin_and_the_assumptions(tmp_path, capsys):
    """`plan` sets the predicted gain over TorchTitan's recipe beside the model's measured error
    on the hardware, and `explain` names the assumed constants the step time depends on."""
    from torchtitan_autoparallel.commands.cli import main

    out = tmp_path / "plan.json"
    config = str(REPO / "train_configs" / "llama3_debug_auto.toml")
    assert main(["plan", "--config", config, "--ngpu", "2", "--hardware", "h100_grand_teton",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "over TorchTitan's recipe for this job" in text
    assert "median |error| on 'h100_grand_teton' is" in text
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model: the predicted step time depends on assumed constants" in text
    assert "measured error on 'h100_grand_teton': median" in text


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_ring_rank_runs_cp_flash_calls_with_a_cp_th_of_the_causal_work(cp):
    """What the model charges context parallelism's attention (``attention_times``: each rank a
    cp-th of the sequence's causal attention FLOPs; ``ring_attention_bytes``: cp flash calls
    per direction on every rank) against torch's own ring attention, run rank by rank with its
    transfers looped back (tests/support/gpu_replay.py's ``ring_rank``, which
    experiments/gpu_check.py times): the FLOPs of the flash calls it makes, forward and
    backward, on CPU."""
    import torch

    from tests.support.gpu_replay import ring_rank

    aten = torch.ops.aten
    heads, local, dim = 2, 8, 4
    full_causal = 4.0 * heads * (local * cp) ** 2 * dim / 2

    def flops(q: torch.Tensor, k: torch.Tensor, causal: bool) -> float:
        return 4.0 * heads * q.shape[2] * k.shape[2] * dim * (0.5 if causal else 1.0)

    calls: dict[str, list[float]] = {}

    def forward(query, key, value, is_causal, **_):
        calls["fwd"].append(flops(query, key, is_causal))
        return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0,
                                                                is_causal)

    def backward(query, key, value, out, logsumexp, is_causal, grad_out, **_):
        calls["bwd"].append(flops(query, key, is_causal))
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, is_causal)

    for rank in range(cp):
        calls.update(fwd=[], bwd=[])
        q, k, v = (torch.randn(1, heads, local, dim) for _ in range(3))
        with ring_rank(rank, cp) as ring:
            out, lse = ring._templated_ring_attention(object(), 2, forward, q, k, v, is_causal=True)
            grads = ring._templated_ring_attention_backward(
                object(), 2, backward, torch.randn_like(out), "grad_out", q, k, v, out, lse,
                is_causal=True)
        assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
        assert len(calls["fwd"]) == len(calls["bwd"]) == cp
        assert sum(calls["fwd"]) == sum(calls["bwd"]) == full_causal / cp


def _attention_tflops(hw, seq: int) -> tuple[float, float, float]:
    """(forward, backward, forward + backward) causal attention TFLOP/s the model gives the
    profile's GPU at ``seq`` tokens (the fields times clock_scale, saturating in seq)."""
    sat = seq / (seq + hw.attention_half_seq)
    fwd = hw.attention_fwd_tflops * hw.clock_scale * sat
    bwd = hw.attention_bwd_tflops * hw.clock_scale * sat
    return fwd, bwd, 3.5 / (1 / fwd + 2.5 / bwd)


# FlashAttention-2 on A100 80GB SXM4, forward + backward, causal, head dim 128, TFLOP/s by
# sequence length (Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark.png)
FA2_A100_FWD_BWD = {512: 99, 1024: 133, 2048: 155, 4096: 173, 8192: 182, 16384: 189}
# torch SDPA's cuDNN backend on B200, bf16, causal, 128 / 8 heads, head dim 128, TFLOP/s
# (NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/artifacts/
#  sdpa_bf16_benchmark_results_NVIDIA_B200.csv): (forward, backward)
CUDNN_B200 = {4096: (855.7, 701.3), 8192: (1171.3, 942.5), 16384: (1332.4, 1074.8),
              32768: (1419.0, 1108.7)}


def test_a100_profile_reproduces_a100_kernel_benchmarks():
    """The A100 profile against the A100 kernel measurements its provenance cites (not
    end-to-end rows): the large bf16 GEMM within 3 % of the best matmul throughput measured
    on A100 SXM (271.2 TFLOP/s, stas00/ml-engineering), FlashAttention-2's A100 forward +
    backward within 3 % at every sequence length of its benchmark, NCCL's NVLink 3 bus bandwidth
    (230 GB/s, NVIDIA/nccl-tests issue 149) and a 200 Gb/s NIC's (24 of 25 GB/s)."""
    from torchtitan_autoparallel.cost.model import GEMM_PLATEAU

    hw = load_profile("a100_sxm")
    gemm = kernels.table_flops(hw.gemm_table, "bf16", *GEMM_PLATEAU) * hw.clock_scale / 1e12
    assert gemm == pytest.approx(271.2, rel=0.03)
    for seq, published in FA2_A100_FWD_BWD.items():
        assert _attention_tflops(hw, seq)[2] == pytest.approx(published, rel=0.03), seq
    assert hw.intra_node_gbps == pytest.approx(230, rel=0.05)
    assert 0.9 * 25 <= hw.inter_node_gbps <= 25


def test_b200_attention_reproduces_cudnn_benchmark():
    """B200's attention fields give torch SDPA's cuDNN kernels (what PyTorch runs on SM100)
    within 5 % from 4k to 32k tokens, forward and backward."""
    hw = load_profile("b200")
    for seq, (fwd, bwd) in CUDNN_B200.items():
        got_fwd, got_bwd, _ = _attention_tflops(hw, seq)
        assert got_fwd == pytest.approx(fwd, rel=0.05), seq
        assert got_bwd == pytest.approx(bwd, rel=0.05), seq


def test_profile_sources_table_is_current():
    """experiments/results/profile_sources.md is generated from the profiles' [provenance]
    tables: it changes with them (the script run as its docstring says, printing only)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "experiments/profile_sources.py", "--no-write"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    committed = (REPO / "experiments" / "results" / "profile_sources.md").read_text()
    assert done.stdout == committed + "\n"  # print() ends the text with one more newline
def test_float8_tensorwise_linear_against_torchao_readme():
    """torchao's float8 README (pytorch/ao PR 794, Sept. 2024) gives tensorwise Float8Linear /
    bf16 for a linear's forward and backward, casts included, on Meta's H100: 0.80 at
    (M, K, N) = (1024, 2048, 1024), 'leave this linear in bfloat16', and 1.39 at
    (4096, 8192, 16384). The model on the same board (h100_grand_teton) keeps the small linear
    slower than bf16 and puts the large one within 0.25 of 1.39, above the rowwise recipe."""
    hw = load_profile("h100_grand_teton")
    assert _float8_speedup(1024, 2048, 1024, "tensorwise", hw) < 1.0
    large = _float8_speedup(4096, 8192, 16384, "tensorwise", hw)
    assert large == pytest.approx(1.39, abs=0.25), large
    assert large > _float8_speedup(4096, 8192, 16384, "rowwise", hw)


def test_float8_gemm_ratio_on_the_500w_board_matches_fbgemm():
    """FBGEMM's float8 GEMM benchmark on a 500 W H100 (pytorch/FBGEMM PR 2546): the float8 GEMM
    alone against bf16 at its shapes. The model's large float8 GEMM (no casts: the weight-side
    casts are the gathered ones, the input's another linear's) on h100_grand_teton runs that
    faster than bf16 within 3 % of the measured ratios' geometric mean, within 8 % of each, and
    never past the 2x tensor-core peak."""
    from torchtitan_autoparallel.cost.compute import _linears_s

    hw = load_profile("h100_grand_teton")
    model, measured = [], []
    for (m, n, k), ratio in (((8192, 8192, 8192), 1125.51 / 585.23),
                             ((65536, 8192, 7168), 1082.75 / 575.12),
                             ((65536, 3584, 8192), 1141.38 / 546.31)):
        args = ((k, n),), m, 1, 1, hw.gemm_table, hw.clock_scale
        bf16 = sum(_linears_s(*args, 1.0, 1.0, (False,)))
        f8 = sum(_linears_s(*args, hw.float8_gemm_speedup, hw.float8_gemm_speedup, (True,)))
        assert bf16 / f8 == pytest.approx(ratio, rel=0.08), (m, n, k, bf16 / f8)
        assert bf16 / f8 <= 2.0
        model.append(bf16 / f8)
        measured.append(ratio)
    assert statistics.geometric_mean(model) == pytest.approx(statistics.geometric_mean(measured),
                                                             rel=0.03)


def test_async_tp_decomposes_gemms_as_torch_symmetric_memory_does():
    """torch's fused ops (torch/distributed/_symmetric_memory) split the all-gathered operand
    into one shard per rank (``ag_out.chunk(group_size)``) and the reduce-scatter's GEMM into
    one row block per rank (``x.chunk(group.size())``), each consumed by its own GEMM. The
    model's async-TP forward GEMMs are those tp GEMMs of tokens / tp rows each, and the weight
    gradient stays one GEMM."""
    import inspect

    import torch.distributed._symmetric_memory as symm_mem

    from torchtitan_autoparallel.cost.compute import _linears_s

    source = inspect.getsource(symm_mem)
    assert "for i, y in enumerate(x.chunk(group_size)):" in source
    reduce_scatter = inspect.getsource(symm_mem._fused_matmul_reduce_scatter_impl)
    assert "A_shards = x.chunk(group.size())" in reduce_scatter
    assert "mm_out_op(A_shards[rank], B, **kwargs, out=out)" in reduce_scatter

    hw = load_profile("h100_sxm")
    tokens, tp = 2048.0, 8
    for (k, n), style in (((4096, 14336), "colwise"), ((14336, 4096), "rowwise")):
        k_loc, n_loc = (k, n / tp) if style == "colwise" else (k / tp, n)
        fwd, bwd = _linears_s(((k, n),), tokens, tp, tp, hw.gemm_table, hw.clock_scale, 1.0,
                              1.0, (False,), (style,))
        chunk = kernels.gemm_s(tokens / tp, n_loc, k_loc, hw.gemm_table, hw.clock_scale)
        assert fwd == pytest.approx(tp * chunk)
        assert bwd == pytest.approx(
            tp * kernels.gemm_s(tokens / tp, k_loc, n_loc, hw.gemm_table, hw.clock_scale)
            + kernels.gemm_s(k_loc, n_loc, tokens, hw.gemm_table, hw.clock_scale))
        # at this size the chunks fall below the GEMM table's plateau: slower than one GEMM
        whole = kernels.gemm_s(tokens, n_loc, k_loc, hw.gemm_table, hw.clock_scale)
        assert fwd > whole


def test_async_tp_replay_runs_on_cpu():
    """The async-TP replay experiments/gpu_check.py times (tests/support/gpu_replay.py), on CPU
    with tiny shapes (copies inline): per linear and dtype the three timings, and the tp chunk
    GEMMs it times as the model's charge are tp GEMMs whose FLOPs add up to the unchunked
    GEMM's (counted by FlopCounterMode standing in for the timer)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from tests.support.gpu_replay import async_tp_conclusion, async_tp_rows

    aten = torch.ops.aten

    class Calls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.gemms = self.copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.gemms += func in (aten.mm.default, aten._scaled_mm.default)
            self.copies += func is aten.copy_.default
            return func(*args, **(kwargs or {}))

    seen: list[tuple[float, int, int]] = []

    def timer(fn) -> float:
        with FlopCounterMode(display=False) as flops, Calls() as calls:
            fn()
        seen.append((flops.get_total_flops(), calls.gemms, calls.copies))
        return float(flops.get_total_flops())

    tp, seq, batch = 4, 8, 2
    shapes = [("wq", "colwise", 32, 64), ("wo", "rowwise", 64, 32)]
    rows = async_tp_rows(load_profile("h100_sxm"), device="cpu", jobs=(("llama3", "tiny", batch),),
                         seq=seq, tp=tp, timer=timer, linears=lambda flavor: shapes)
    assert [(r["linear"], r["dtype"]) for r in rows] == [
        (name, dtype) for name, *_ in shapes for dtype in ("bf16", "f8_tensorwise")]
    assert len(seen) == 3 * len(rows)
    triples = [seen[i:i + 3] for i in range(0, len(seen), 3)]
    for r, (full, chunks, copies) in zip(rows, triples, strict=True):
        k, n = (32, 64 // tp) if r["style"] == "colwise" else (64 // tp, 32)
        assert (r["m"], r["k"], r["n"], r["tp"]) == (batch * seq, k, n, tp)
        assert full == (2 * batch * seq * k * n, 1, 0)
        assert chunks == (full[0], tp, 0)
        # the copies: the other tp - 1 shards (and the own one into the p2p buffer when gathering)
        assert copies == (full[0], tp, tp - (r["style"] == "rowwise"))
        assert r["t_full_s"] == r["t_chunks_s"] == r["t_chunks_with_copies_s"]
        assert r["overlap_slowdown"] == 1.0 and r["predicted_chunks_s"] > 0
        width = 1 if (r["dtype"], r["style"]) == ("f8_tensorwise", "colwise") else 2
        shard = batch * seq // tp * (k if r["style"] == "colwise" else n)
        assert r["copy_bytes"] == copies[2] * shard * width
    assert "bf16 copies slow them no more than float8 ones" in async_tp_conclusion(
        rows, "llama3 tiny")


def test_async_tp_replay_covers_the_405b_pipeline_rows():
    """gpu_check's async-TP replay includes the 405B pipeline rows' shapes: Llama 3.1 405B's
    published config (dim 16,384, 8 key / value heads of 128, FFN 53,248) at the rows'
    micro-batch of 4 sequences of 8,192 (local batch 32 in 8 micro-batches), so one TP rank
    of 8 gathers 32,768 rows in shards of 4,096."""
    from tests.support.gpu_replay import (
        ASYNC_TP_JOBS,
        ASYNC_TP_SEQ,
        ASYNC_TP_TP,
        async_tp_linears,
    )

    assert ("llama3", "405B", 32 // 8) in ASYNC_TP_JOBS
    assert 4 * ASYNC_TP_SEQ // ASYNC_TP_TP == 4096
    assert async_tp_linears("405B") == [
        ("wq", "colwise", 16384, 16384), ("wk", "colwise", 16384, 8 * 128),
        ("wo", "rowwise", 16384, 16384), ("w1", "colwise", 16384, 53248),
        ("w2", "rowwise", 53248, 16384)]
