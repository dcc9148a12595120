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
each beside what the device's profile predicts for it (``kernels.md``). Part 2 (about 5
minutes) runs ``experiments/grids/gpu_check.toml`` through ``experiments/sweep.py`` with the
device's profile and writes its report. Everything lands under ``--out/<device>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

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


def timed(fn, *args, warmup: int = 3, reps: int = 10, **kwargs) -> float:
    """Median seconds of ``fn(*args, **kwargs)`` on the current CUDA stream (events around
    each call)."""
    import torch

    for _ in range(warmup):
        fn(*args, **kwargs)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kwargs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


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


class LoopbackRotater:
    """A ring rotater that hands every buffer back to the rank that sent it: each step of
    torch's ring attention then runs this rank's kernels at their real shapes, without the
    transfers (the keys and values are this rank's own)."""

    def __init__(self, *_: object, **__: object) -> None:
        self._buffer: Any = None

    def exchange_buffers(self, buffer: Any) -> None:
        self._buffer = buffer

    def next_buffer(self) -> Any:
        return self._buffer


@contextlib.contextmanager
def ring_rank(rank: int, cp: int) -> Iterator[types.ModuleType]:
    """torch's ring attention module (torch/distributed/tensor/experimental/_context_parallel/
    _attention.py) as rank ``rank`` of a ring of ``cp``, in this process alone: ranks and ring
    size answered from the arguments, rotaters replaced by ``LoopbackRotater``."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    saved = ring.dist, ring._create_rotater
    ring.dist = types.SimpleNamespace(ProcessGroup=object, get_rank=lambda group: rank,
                                      get_world_size=lambda group: cp)
    ring._create_rotater = LoopbackRotater
    try:
        yield ring
    finally:
        ring.dist, ring._create_rotater = saved


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


ASYNC_TP_JOBS = (("llama3", "70B", 16), ("llama3", "8B", 12), ("llama3", "405B", 4))
"""TorchTitan's published async-TP jobs (experiments/published.py: Llama 3 70B on 256 H100s at
FSDP 32 x TP 8, local batch 16; 8B on 64 at FSDP 8 x TP 8, local batch 12; sequence 8192): one
TP rank's all-gathered GEMMs have local batch x seq rows (131,072 and 98,304), tp shards of
16,384 and 12,288 rows. The 405B pipeline rows (experiments/published_pp.py, Tables 5-6: TP 8
inside PP 8, a micro-batch of 4 sequences) gather 32,768 rows in shards of 4,096: the chunk
GEMMs and copies of the jobs whose miss the model puts on async TP
(experiments/results/pipeline_terms.md)."""
ASYNC_TP_SEQ, ASYNC_TP_TP = 8192, 8


def async_tp_linears(flavor: str) -> list[tuple[str, str, int, int]]:
    """(name, TP style, in features, out features) of a Llama 3 block's linears, read from the
    layer graph, one per distinct (style, shape): wq, wk (= wv), wo, w1 (= w3), w2."""
    from torchtitan_autoparallel.job.inputs import model_layer_graph

    block = model_layer_graph("llama3", flavor, ASYNC_TP_SEQ).blocks[0]
    seen: dict[tuple[str, int, int], str] = {}
    for name, style, (k, n) in zip(block.linear_names, block.linear_styles, block.linear_shapes,
                                   strict=True):
        seen.setdefault((style, k, n), name.rpartition(".")[2])
    return [(name, style, k, n) for (style, k, n), name in seen.items()]


def _wall_s(fn) -> float:
    """Seconds of one call of ``fn`` on the clock (the CPU stand-in for ``timed``)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def async_tp_replay(tokens: int, k: int, n: int, tp: int, style: str, dtype: str,
                    device: str = "cuda", timer=None) -> dict[str, object]:
    """One TP rank's forward GEMMs of one linear as torch's symmetric-memory fused ops run them
    (torch/distributed/_symmetric_memory/__init__.py), the transfers replaced by device-to-
    device copies of the same bytes on this GPU:

    - colwise (``fused_all_gather_matmul``, ``_pipelined_multi_all_gather_and_consume``): the
      gathered input (``tokens`` x ``k``) in tp shards against the local weight (k x n / tp);
      the own shard copied into the p2p buffer first (exposed), its GEMM, then for each other
      shard, on the backend stream (odd steps) or the current one (even steps), the shard's copy
      and its GEMM (the last copy of the own shard into the gathered output is left out). The
      copies move the gathered operand: bf16 2 bytes an element, float8 tensorwise 1
      (TorchTitan casts before the gather).
    - rowwise (``fused_matmul_reduce_scatter``, ``_pipelined_produce_and_all2all``): the input
      (tokens x k / tp) in tp row blocks against the weight (k / tp x n); for each other rank's
      block, on the alternating streams, its GEMM then the copy of its bf16 partial output
      (tokens / tp x n: bf16 in both dtypes, ``_scaled_mm`` writes bf16), then the own block;
      the final sum of the partials is left out.

    Returns seconds of (a) the unchunked GEMM (``t_full_s``), (b) the tp chunk GEMMs back to
    back on one stream, what the cost model charges (``t_chunks_s``), (c) (b) with the copies
    on torch's two streams (``t_chunks_with_copies_s``), and (c) / (b). On a device without
    streams (CPU) the copies run inline; ``timer`` (default: ``timed`` on CUDA, one wall-clock
    call elsewhere) is called with a no-argument function per variant. On one GPU the copies
    read and write this GPU's memory (a real transfer writes it once and a peer reads it once:
    the same bytes), over the copy engines as torch's ``copy_`` does, without NVLink."""
    import torch

    cuda = torch.device(device).type == "cuda"
    timer = timer or (timed if cuda else _wall_s)
    k_loc, n_loc = (k, n // tp) if style == "colwise" else (k // tp, n)
    a = torch.randn(tokens, k_loc, device=device, dtype=torch.bfloat16)
    w = torch.randn(k_loc, n_loc, device=device, dtype=torch.bfloat16)
    if dtype == "bf16":
        def mm(x: Any) -> Any:
            return torch.mm(x, w)
    else:  # float8 tensorwise, as gemm_rows times it: e4m3 operands, B column-major
        f8 = torch.float8_e4m3fn
        a, w = a.to(f8), w.t().contiguous().to(f8).t()
        one = torch.ones((), device=device)

        def mm(x: Any) -> Any:
            return torch._scaled_mm(x, w, one, one, out_dtype=torch.bfloat16)
    shards = a.chunk(tp)
    if style == "colwise":  # the gathered operand's shards
        src = torch.empty_like(shards[0])
    else:  # the partial outputs, bf16
        src = torch.empty(shards[0].shape[0], n_loc, device=device, dtype=torch.bfloat16)
    dst = [torch.empty_like(src) for _ in range(tp)]
    side = torch.cuda.Stream(device=device) if cuda else None

    def on(step: int) -> Any:
        return torch.cuda.stream(side) if cuda and step % 2 else contextlib.nullcontext()

    def full() -> None:
        mm(a)

    def chunks() -> None:
        for x in shards:
            mm(x)

    def with_copies() -> None:
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        if style == "colwise":
            dst[0].copy_(src)
            mm(shards[0])
            for step in range(1, tp):
                with on(step):
                    dst[step].copy_(src)
                    mm(shards[step])
        else:
            for step in range(1, tp):
                with on(step):
                    mm(shards[step])
                    dst[step].copy_(src)
            mm(shards[0])
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)

    t_full, t_chunks, t_copies = timer(full), timer(chunks), timer(with_copies)
    return dict(style=style, dtype=dtype, m=tokens, n=n_loc, k=k_loc, tp=tp,
                copy_bytes=(tp - 1) * src.numel() * src.element_size()
                + (src.numel() * src.element_size() if style == "colwise" else 0),
                t_full_s=t_full, t_chunks_s=t_chunks, t_chunks_with_copies_s=t_copies,
                overlap_slowdown=t_copies / t_chunks)


def async_tp_rows(profile: Any, device: str = "cuda", jobs=ASYNC_TP_JOBS,
                  seq: int = ASYNC_TP_SEQ, tp: int = ASYNC_TP_TP, timer=None,
                  linears=async_tp_linears) -> list[dict[str, object]]:
    """The published async-TP jobs' forward linears on one TP rank (``async_tp_replay``), bf16
    and float8 tensorwise (``linears``: a flavor's (name, style, in, out), from its layer graph
    unless given), each beside the cost model's charge for its chunk GEMMs (``_linears_s``
    with tp chunks: what ``gemm_times`` adds up under async TP, and where it assumes the
    transfers take nothing from the GEMMs), and a line per model: whether bf16's copies slow
    the chunk GEMMs more than float8's."""
    from torchtitan_autoparallel.cost.compute import _linears_s

    rows: list[dict[str, object]] = []
    for model, flavor, local_batch in jobs:
        tokens = local_batch * seq
        for name, style, k, n in linears(flavor):
            for dtype in ("bf16", "f8_tensorwise"):
                low = dtype != "bf16"
                speedup = profile.float8_gemm_speedup if low else 1.0
                predicted = _linears_s(((k, n),), float(tokens), tp, tp, profile.gemm_table,
                                       profile.clock_scale, speedup, speedup, (low,),
                                       (style,))[0]
                row = async_tp_replay(tokens, k, n, tp, style, dtype, device, timer)
                rows.append(dict(model=f"{model} {flavor}", linear=name, **row,
                                 predicted_chunks_s=predicted))
        print(async_tp_conclusion(rows, f"{model} {flavor}"))
    return rows


def async_tp_conclusion(rows: list[dict[str, object]], model: str) -> str:
    """One line: the model's summed (c) / (b) in bf16 against float8 tensorwise."""
    slow = {}
    for dtype in ("bf16", "f8_tensorwise"):
        mine = [r for r in rows if r["model"] == model and r["dtype"] == dtype]
        slow[dtype] = (sum(float(r["t_chunks_with_copies_s"]) for r in mine)
                       / sum(float(r["t_chunks_s"]) for r in mine))
    bf16, f8 = slow["bf16"], slow["f8_tensorwise"]
    verdict = "more than" if bf16 > f8 * 1.02 else "no more than"
    return (f"async TP {model}: copies slow the chunk GEMMs x{bf16:.3f} in bf16, x{f8:.3f} in "
            f"float8 tensorwise: bf16 copies slow them {verdict} float8 ones")


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
    report = compare(profile, gemms, attention, stream, ring, async_tp)
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
