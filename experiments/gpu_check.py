"""One command on one GPU: kernel micro-benchmarks for the shapes the planner costs, then auto
against TorchTitan's recipe on llama3 1B / 3B with compile and float8, predicted vs measured.

    python experiments/gpu_check.py [--out experiments/results/gpu_check] [--skip-runs]

Part 1 (about 2 minutes) measures, on the first GPU:
- GEMMs by (m, n, k): bf16 (``torch.mm``), float8 tensorwise and rowwise (``torch._scaled_mm``,
  e4m3 operands, bf16 output), written as ``gemm_<device>.csv`` in the format of
  ``profiles/kernels/gemm_*.csv`` (a profile's ``gemm_table`` can name the file);
- flash attention (``F.scaled_dot_product_attention``, causal, head dim 128) forward and
  backward by sequence length, ``attention_<device>.csv``;
- streaming bandwidth (an elementwise add and a copy of 1 GiB) and the fused / foreach AdamW
  step, ``streaming_<device>.csv``;
- torch's ring attention (context parallel) forward and backward on the rank of a ring of
  1 / 2 / 4 / 8 that the model costs, at TorchTitan's published Llama 3 8B CP shapes (32,768
  tokens per rank), the ring's transfers left out (``ring_rank``): the compute side of CP
  against ``attention_times``, ``ring_attention_<device>.csv``;
- async TP's decomposed forward GEMMs on one TP rank (``async_tp_replay``) at TorchTitan's
  published async-TP shapes (Llama 3 70B and 8B at TP 8, 16,384 / 12,288 rows a shard; 405B
  at TP 8 with the pipeline rows' micro-batch of 4 sequences, 4,096 rows a shard), bf16
  and float8 tensorwise: the unchunked GEMM, the tp chunk GEMMs the model charges, and those
  chunks with the shards' bytes copied on torch's second stream (the HBM and copy-engine
  contention one GPU shows), ``async_tp_<device>.csv``, with a line per model on whether bf16's
  copies slow the GEMMs more than float8's;
- TorchTitan's routed experts (tests/support/moe_replay.py, at most ``MOE_BUDGET_S``):
  torch._grouped_mm (and torchao's float8 rowwise / MXFP8 grouped GEMMs where the GPU has them)
  forward and forward + backward by tokens per expert at DeepSeek-V3 16B's and Llama 4
  17Bx16E's expert shapes, beside cost/moe.py's stacked prediction and one GEMM per group;
  TorchTitan 0.2.2's token permutation forward + backward; the EP dispatcher's device -> host
  sync (``moe_grouped_gemm_<device>.csv``, ``moe_permutation_<device>.csv``,
  ``moe_host_sync_<device>.csv``);
each beside what the device's profile predicts for it (``kernels.md``). Part 2 (about 5
minutes) runs ``experiments/grids/gpu_check.toml`` through ``experiments/sweep.py`` with the
device's profile and writes its report. Everything lands under ``--out/<device>/``. The ring
attention and async-TP replays are tests/support/gpu_replay.py's (tests/test_kernels.py runs them
on CPU).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.gpu_replay import (  # noqa: E402
    async_tp_conclusion,
    async_tp_rows,
    ring_rank,
    timed,
)
from tests.support.moe_replay import (  # noqa: E402
    grouped_gemm_rows,
    host_sync_rows,
    moe_lines,
    permutation_rows,
)

GEMM_SHAPES = [
    # square sweep: the table's grid
    *[(s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192)],
    # llama3 1B / 3B / 8B linears at 4k-16k tokens: (tokens, out, in)
    *[(m, n, k) for m in (4096, 16384) for n, k in (
        (2048, 2048), (512, 2048), (8192, 2048), (2048, 8192),
        (3072, 3072), (1024, 3072), (8192, 3072), (3072, 8192),
        (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))],
]
SEQS = (1024, 2048, 4096, 8192, 16384)
RING_JOBS = [dict(model="llama3_8b", gpus="8", fsdp=str(8 // cp), tp="1", cp=str(cp),
                  seq_len=str(32768 * cp), local_batch="1", global_batch=str(8 // cp),
                  ac="full", compile="yes", float8="yes", async_tp="no") for cp in (1, 2, 4, 8)]
"""TorchTitan's published CP jobs (Table 2 of experiments/data/torchtitan_h100_202412.csv:
Llama 3 8B on 8 GPUs, 32,768 tokens per rank at cp 1-8), in experiments/published.py's fields."""
MOE_BUDGET_S = 90
"""Seconds the MoE grouped-GEMM sweep may take (shapes past it are left out)."""


def gemm_rows(arch: str) -> list[dict[str, object]]:
    import torch

    rows = []
    f8 = torch.float8_e4m3fn
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        t = timed(torch.mm, a, b)
        rows.append(dict(arch=arch, b=1, m=m, n=n, k=k, dtype="bf16", flops_per_s=flops / t))
        a8, b8 = a.to(f8), b.t().contiguous().to(f8).t()  # B column-major, as cuBLAS wants
        one = torch.ones((), device="cuda")
        try:
            t = timed(torch._scaled_mm, a8, b8, one, one, out_dtype=torch.bfloat16)
            rows.append(dict(arch=arch, b=1, m=m, n=n, k=k, dtype="f8_tensorwise",
                             flops_per_s=flops / t))
            sa = torch.ones(m, 1, device="cuda")
            sb = torch.ones(1, n, device="cuda")
            t = timed(torch._scaled_mm, a8, b8, sa, sb, out_dtype=torch.bfloat16)
            rows.append(dict(arch=arch, b=1, m=m, n=n, k=k, dtype="f8_rowwise",
                             flops_per_s=flops / t))
        except RuntimeError as exc:  # no float8 GEMMs on this device
            print(f"float8 GEMM skipped at {m}x{n}x{k}: {str(exc).splitlines()[0]}")
    return rows


def _attention_fwd_bwd(q, k, v, grad) -> None:
    import torch
    import torch.nn.functional as F

    torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v),
                        grad)


def attention_rows() -> list[dict[str, object]]:
    import torch
    import torch.nn.functional as F

    rows = []
    heads, dim = 32, 128
    for seq in SEQS:
        batch = max(1, 16384 // seq)
        q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        flops = 4.0 * batch * heads * seq * seq * dim * 0.5  # causal
        fwd = timed(F.scaled_dot_product_attention, q, k, v, is_causal=True)
        grad = torch.randn_like(q)
        both = timed(_attention_fwd_bwd, q, k, v, grad)
        rows.append(dict(seq_len=seq, head_dim=dim, causal=True, direction="fwd",
                         tflops=flops / fwd / 1e12))
        rows.append(dict(seq_len=seq, head_dim=dim, causal=True, direction="bwd",
                         tflops=2.5 * flops / max(both - fwd, 1e-9) / 1e12))
    return rows


def streaming_rows() -> list[dict[str, object]]:
    import torch

    n = 2**29  # 1 GiB of bf16
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rows = [dict(kernel="add", gbps=3 * 2 * n / timed(torch.add, x, y, out=x) / 1e9),
            dict(kernel="copy", gbps=2 * 2 * n / timed(y.copy_, x) / 1e9)]
    params = [torch.nn.Parameter(torch.randn(2**24, device="cuda")) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    for kind in ("fused", "foreach"):
        opt = torch.optim.AdamW(params, lr=1e-4, **{kind: True})
        t = timed(opt.step, warmup=2, reps=5)
        # fp32 param, grad, exp_avg, exp_avg_sq: 16 B read, 12 B written per parameter
        rows.append(dict(kernel=f"adamw_{kind}", gbps=28 * 2**27 / t / 1e9))
    return rows


def ring_attention_s(cp: int, seq: int, heads: int = 32, dim: int = 128
                     ) -> tuple[float, float]:
    """Measured (forward, backward) seconds of torch's flash ring attention on the last rank
    of a ring of ``cp`` (``seq`` local tokens, causal, head-tail load balanced): plain flash
    attention at cp 1, as TorchTitan runs it. Keys and values have all the query heads (the
    published runs repeated Llama's 8 KV heads before attention), so the ring's key / value
    bookkeeping moves 4x the bytes the model counts for GQA's 8 heads (about 2 % of the cp 8
    backward); the FLOPs are the same."""
    import torch

    aten = torch.ops.aten
    q, k, v = (torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    mesh = types.SimpleNamespace(get_group=object)
    with ring_rank(cp - 1, cp) as ring:
        if cp == 1:
            def forward() -> tuple:
                return aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)

            def backward_op(*args: Any) -> tuple:
                return aten._scaled_dot_product_flash_attention_backward(*args[1:])
        else:
            def forward() -> tuple:
                return ring._scaled_dot_product_ring_flash_attention(mesh, q, k, v,
                                                                     is_causal=True)

            backward_op = ring._scaled_dot_product_ring_flash_attention_backward
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = forward()[:8]
        grad = torch.randn_like(out)
        fwd = timed(forward, warmup=1, reps=3)
        bwd = timed(backward_op, mesh, grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                    0.0, True, seed, offset, warmup=1, reps=3)
    return fwd, bwd


def ring_rows(profile: Any) -> list[dict[str, object]]:
    """The published CP rows' attention, measured on this device (``ring_attention_s``) and
    predicted by ``attention_times`` with the device's profile (flash kernels and the ring's
    bookkeeping at device-memory bandwidth; no transfers on either side)."""
    from published import overrides

    from torchtitan_autoparallel.cost.model import attention_times
    from torchtitan_autoparallel.job.request import recipe_plan
    from torchtitan_autoparallel.plan.recost import inputs_from_plan
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    rows = []
    for f in RING_JOBS:
        cp = int(f["cp"])
        plan = recipe_plan(parse_config(overrides(f, profile.name)), int(f["gpus"]))
        block = next(layer for layer in inputs_from_plan(plan).graph.layers
                     if layer.kind == "block")
        predicted = attention_times(block, plan.mesh, 1, profile)
        measured = ring_attention_s(cp, int(f["seq_len"]) // cp)
        for direction, m, p in zip(("fwd", "bwd"), measured, predicted, strict=True):
            rows.append(dict(cp=cp, seq_len=f["seq_len"], local_seq=int(f["seq_len"]) // cp,
                             direction=direction, measured_s=m, predicted_s=p))
    return rows


def write_csv(path: Path, rows: list[dict[str, object]], header: list[str]) -> None:
    with open(path, "w", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def compare(profile, gemms: list[dict], attention: list[dict], stream: list[dict],
            ring: list[dict], async_tp: list[dict] | None = None) -> list[str]:
    """What the profile predicts for each measured kernel, and the ratio."""
    from torchtitan_autoparallel.cost import kernels

    lines = [f"# Kernels measured against profile {profile.name!r}", "",
             "| kernel | measured | profile | measured / profile |", "|---|---:|---:|---:|"]
    for r in gemms:
        if r["dtype"] != "bf16":
            continue
        pred = kernels.table_flops(profile.gemm_table, "bf16", r["m"], r["n"], r["k"]) \
            * profile.clock_scale
        lines.append(f"| GEMM bf16 {r['m']}x{r['n']}x{r['k']} | {r['flops_per_s'] / 1e12:.0f} "
                     f"TFLOP/s | {pred / 1e12:.0f} | {r['flops_per_s'] / pred:.2f} |")
    by = {(r["m"], r["n"], r["k"], r["dtype"]): r["flops_per_s"] for r in gemms}
    for (m, n, k, dtype), value in by.items():
        if dtype.startswith("f8") and (m, n, k, "bf16") in by:
            large = (profile.float8_gemm_speedup if dtype == "f8_tensorwise"
                     else profile.float8_rowwise_gemm_speedup)
            lines.append(f"| {dtype} / bf16 at {m}x{n}x{k} | "
                         f"{value / by[(m, n, k, 'bf16')]:.2f} | {large:.2f} (large shapes) | |")
    for r in attention:
        peak = (profile.attention_fwd_tflops if r["direction"] == "fwd"
                else profile.attention_bwd_tflops)
        pred = peak * profile.clock_scale * r["seq_len"] / (r["seq_len"]
                                                             + profile.attention_half_seq)
        lines.append(f"| SDPA {r['direction']} seq {r['seq_len']} | {r['tflops']:.0f} TFLOP/s | "
                     f"{pred:.0f} | {r['tflops'] / pred:.2f} |")
    for r in stream:
        lines.append(f"| {r['kernel']} | {r['gbps']:.0f} GB/s | {profile.hbm_gbps:.0f} | "
                     f"{r['gbps'] / profile.hbm_gbps:.2f} |")
    for r in ring:
        lines.append(f"| ring attention cp {r['cp']} {r['direction']} (seq {r['seq_len']}) | "
                     f"{r['measured_s'] * 1e3:.1f} ms | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['measured_s'] / r['predicted_s']:.2f} |")
    for r in async_tp or ():
        label = f"async TP {r['model']} {r['linear']} {r['dtype']} m {r['m']}, tp {r['tp']}"
        for part, key in (("one GEMM", "t_full_s"), ("tp chunk GEMMs", "t_chunks_s"),
                          ("chunks + copies", "t_chunks_with_copies_s")):
            lines.append(f"| {label}: {part} | {r[key] * 1e3:.2f} ms | "
                         f"{r['predicted_chunks_s'] * 1e3:.2f} | "
                         f"{r[key] / r['predicted_chunks_s']:.2f} |")
    for model in dict.fromkeys(r["model"] for r in async_tp or ()):
        lines += ["", async_tp_conclusion(async_tp, model)]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "experiments" / "results" / "gpu_check"))
    parser.add_argument("--skip-runs", action="store_true", help="kernel benchmarks only")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("error: experiments/gpu_check.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from torchtitan_autoparallel.cost.hardware import load_profile, profile_for_device
    from torchtitan_autoparallel.titan.v0_2.checks import device

    found = device()
    name = profile_for_device(found)
    profile = load_profile(name)
    slug = found.name.replace("NVIDIA ", "").replace(" ", "_").lower()
    out = Path(args.out) / slug
    out.mkdir(parents=True, exist_ok=True)
    arch = f"sm_{found.capability[0]}{found.capability[1]}"
    header = [f"measured by experiments/gpu_check.py on {found.name} ({arch}, "
              f"{found.memory_gib:.1f} GiB), torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')}"]
    start = time.time()
    gemms = gemm_rows(arch)
    write_csv(out / f"gemm_{slug}.csv", gemms, header)
    attention = attention_rows()
    write_csv(out / f"attention_{slug}.csv", attention, header)
    stream = streaming_rows()
    write_csv(out / f"streaming_{slug}.csv", stream, header)
    try:
        ring = ring_rows(profile)
        write_csv(out / f"ring_attention_{slug}.csv", ring, header)
    except (ImportError, AttributeError, RuntimeError) as exc:  # torch's private ring moved
        print(f"ring attention skipped: {str(exc).splitlines()[0]}")
        ring = []
    async_tp = async_tp_rows(profile)
    write_csv(out / f"async_tp_{slug}.csv", async_tp, header)
    # MoE: grouped GEMMs by tokens per expert, TorchTitan's permutation, the dispatcher's sync
    grouped = grouped_gemm_rows(profile, time.time() + MOE_BUDGET_S)
    permutation, sync = permutation_rows(profile), host_sync_rows(profile)
    for kind, rows in (("moe_grouped_gemm", grouped), ("moe_permutation", permutation),
                       ("moe_host_sync", sync)):
        if rows:
            write_csv(out / f"{kind}_{slug}.csv", rows, header)
    report = compare(profile, gemms, attention, stream, ring, async_tp)
    report += moe_lines(grouped, permutation, sync)
    (out / "kernels.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    print(f"kernels: {time.time() - start:.0f} s")
    if args.skip_runs:
        return 0
    grid = (REPO / "experiments" / "grids" / "gpu_check.toml").read_text()
    grid_path = out / "grid.toml"
    grid_path.write_text(grid.replace('hardware = "h100_sxm"', f'hardware = "{name}"'))
    code = subprocess.call([sys.executable, str(REPO / "experiments" / "sweep.py"),
                            str(grid_path), "--out", str(out)])
    if code == 0:
        code = subprocess.call([sys.executable, str(REPO / "experiments" / "sweep_report.py"),
                                str(out / "sweep.csv")])
    print(f"gpu_check: {time.time() - start:.0f} s, results in {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
