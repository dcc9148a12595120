"""Measure this machine and write a hardware profile: matmul throughput and collective
latency/bandwidth (all-gather, reduce-scatter, all-reduce, all-to-all) over a process group.

CPU uses gloo, a GPU machine NCCL. Every measurement becomes a ``fit.Run`` priced by the cost
model's own formulas (``collective_s``: t = factor * ((p - 1) * alpha + (p - 1) / p * bytes / bw);
2 n^3 FLOPs per matmul) and ``fit.fit_profile`` fits peak throughput, bandwidth and latency to all
of them at once, as it fits a sweep's step times.
"""

import dataclasses
import json
import os
import socket
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..candidates.layout import GIB
from ..commands.progress import Progress
from ..cost.hardware import HardwareProfile
from ..cost.model import collective_s
from ..errors import UserError
from .fit import Run, fit_profile


def _time(fn: Any, repeats: int, sync: Any) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def matmul_tflops(device: str, sizes: list[int], repeats: int,
                  progress: Progress | None = None) -> dict[int, float]:
    """Achieved TFLOP/s of square matmuls (fp32 on CPU, bf16 on GPU)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = _time(lambda a=a, b=b: a @ b, repeats, sync)
        out[n] = 2 * n**3 / t / 1e12
        if progress:
            progress.advance(f"matmul {n} x {n}: {out[n]:.3g} TFLOP/s")
    return out


def _ops(full: torch.Tensor, shard: torch.Tensor) -> dict[str, Any]:
    return {
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_reduce": lambda: dist.all_reduce(full),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
    }


def _collectives_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int,
                        out: str, progress: Progress | None = None) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    if device == "cuda":
        torch.cuda.set_device(rank)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = {}
    try:
        for nbytes in sizes:
            n = max(world, nbytes // 4 // world * world)
            ops = _ops(torch.ones(n, device=device), torch.ones(n // world, device=device))
            for name, op in ops.items():
                if device == "cpu" and name == "reduce_scatter":
                    # gloo has no reduce_scatter_tensor: time it as its ring equivalent
                    op = ops["all_gather"]
                dist.barrier()
                results[f"{name}:{n * 4}"] = _time(op, repeats, sync)
                if progress and rank == 0:
                    progress.advance(f"{name} of {n * 4} bytes over {world} ranks")
        dist.barrier()
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        dist.destroy_process_group()
    # skip C++ static destructors: gloo's thread teardown at exit can abort a finished rank
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_times(world: int, sizes: list[int], repeats: int,
                     progress: Progress | None = None) -> dict[str, float]:
    """Median seconds per ``"<collective>:<bytes>"`` over ``world`` local ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.txt")
        mp.spawn(_collectives_worker, args=(world, _free_port(), sizes, repeats, out, progress),
                 nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def _matmul_s(n: int, hw: HardwareProfile) -> float:
    return 2 * n**3 / hw.flops_per_s


def benchmark_runs(matmul_s: dict[int, float], collectives_s: dict[str, float],
                   world: int) -> list[Run]:
    """Micro-benchmark timings as runs for ``fit_profile``: seconds per square matmul of each
    size, and per ``"<collective>:<bytes>"`` over ``world`` ranks of one node."""
    runs = [Run(f"matmul {n}", t, time_of=partial(_matmul_s, n), group="matmul")
            for n, t in matmul_s.items()]
    for key, t in collectives_s.items():
        kind, nbytes = key.split(":")
        runs.append(Run(key, t, time_of=partial(collective_s, kind, int(nbytes), world, False),
                        group=kind))
    return runs


def calibrate(world: int, name: str, gpus_per_node: int, quick: bool = False
              ) -> tuple[HardwareProfile, list[str]]:
    """Measure this machine (``world`` ranks take part in the collective measurements): the
    profile and notes on what the measurements could not determine."""
    if world < 2:
        raise UserError("calibrate needs --ngpu >= 2 to measure collectives")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < world:
        raise UserError(f"--ngpu {world} exceeds the {torch.cuda.device_count()} visible GPUs")
    sizes = ([256, 512] if quick else [512, 1024, 2048]) if device == "cpu" else [4096, 8192]
    comm_sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 24]
    # each size: all-gather, reduce-scatter, all-reduce, all-to-all
    progress = Progress(len(sizes) + 4 * len(comm_sizes), "calibrate")
    flops = matmul_tflops(device, sizes, 3 if quick else 10, progress)
    times = collective_times(world, comm_sizes, 3 if quick else 10, progress)
    if device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory / GIB
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB / world
    start = HardwareProfile(
        name=name,
        peak_tflops=max(flops.values()),
        matmul_efficiency=1.0,  # the measured throughput is already the achieved one
        memory_gib=round(memory, 3),
        usable_memory_fraction=0.9 if device == "cuda" else 1.0,
        gpus_per_node=gpus_per_node or world,
        intra_node_gbps=_rough_gbps(times, world),
        inter_node_gbps=_rough_gbps(times, world),
        intra_node_latency_us=10.0,
        inter_node_latency_us=10.0,
        comm_overlap=0.9 if device == "cuda" else 0.0,
        # TorchTitan runs routed experts as grouped GEMMs from SM90 on
        grouped_mm=device == "cuda" and torch.cuda.get_device_capability()[0] >= 9,
        host_cores=0 if device == "cuda" else (os.cpu_count() or 1),
    )
    # the best size: smaller matmuls pay overheads the profile does not price per GEMM
    n, tflops = max(flops.items(), key=lambda kv: kv[1])
    notes, fitted = [], start
    for runs, free in ((benchmark_runs({n: 2 * n**3 / (tflops * 1e12)}, {}, world),
                        ["peak_tflops"]),
                       (benchmark_runs({}, times, world),
                        ["intra_node_gbps", "intra_node_latency_us"])):
        result = fit_profile(runs, fitted, free)
        fitted = result.profile
        notes += [f"not determined by the measurements, kept at the starting value: {name} "
                  f"({why})" for name, why in result.unidentified.items()]
        notes += result.notes if len(runs) > 1 else []  # one matmul: exact by design
    bw, alpha = round(fitted.intra_node_gbps, 6), round(fitted.intra_node_latency_us, 3)
    # one machine: use a cluster profile for multi-node
    return dataclasses.replace(fitted, peak_tflops=round(fitted.peak_tflops, 6),
                               intra_node_gbps=bw, inter_node_gbps=bw,
                               intra_node_latency_us=alpha, inter_node_latency_us=alpha), notes


def _rough_gbps(times: dict[str, float], world: int) -> float:
    """Bus bandwidth of the largest all-gather (the fit's starting point)."""
    nbytes, t = max((int(k.split(":")[1]), v) for k, v in times.items()
                    if k.startswith("all_gather:"))
    return nbytes * (world - 1) / world / t / 1e9
