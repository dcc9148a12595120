"""Kernel replays on one device that experiments/gpu_check.py times and tests/test_kernels.py
checks on CPU: torch's ring attention (context parallel) run rank by rank with its transfers
looped back (``ring_rank``), and async TP's decomposed forward GEMMs on one TP rank with the
transfers replaced by copies of the same bytes (``async_tp_replay``, ``async_tp_rows``)."""

from __future__ import annotations

import contextlib
import statistics
import time
import types
from collections.abc import Callable, Iterator
from typing import Any


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


def _operand_and_gemm(m: int, k: int, n: int, dtype: str, device: str
                      ) -> tuple[Any, Callable[[Any], Any]]:
    """A random m x k input in ``dtype`` and the GEMM of a row block of it with a random
    k x n weight: ``torch.mm`` in bf16; in float8 tensorwise (as gpu_check's ``gemm_rows``
    times it) ``torch._scaled_mm`` of e4m3 operands, the weight column-major, bf16 out."""
    import torch

    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    if dtype == "bf16":
        return a, lambda x: torch.mm(x, w)
    f8 = torch.float8_e4m3fn
    a, w = a.to(f8), w.t().contiguous().to(f8).t()
    one = torch.ones((), device=device)
    return a, lambda x: torch._scaled_mm(x, w, one, one, out_dtype=torch.bfloat16)


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
    a, mm = _operand_and_gemm(tokens, k_loc, n_loc, dtype, device)
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
