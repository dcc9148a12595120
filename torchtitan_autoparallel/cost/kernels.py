"""Kernel-level times from measured kernel data: GEMMs by shape and dtype, collectives by size.

GEMM throughput comes from per-architecture tables of measured (m, n, k) -> FLOP/s
(``profiles/kernels/gemm_<arch>.csv``, with their sources in the files' headers), interpolated
in log space over the three dimensions; outside the measured grid a GEMM keeps the throughput
of the nearest measured shape (large GEMMs plateau, small ones are launch-bound). A profile
scales the table by ``clock_scale`` (its device's sustained clock / the table device's) and
gives float8 the table's bf16 shape dependence at ``float8_gemm_speedup`` of bf16's
throughput on large shapes, the ratio read from public float8 GEMM benchmarks. Where a profile
names a measured float8 linear table (torchao's rowwise micro-benchmark by M, K, N), a float8
linear's time is read from it instead, its casts included.

Collectives: NCCL bus bandwidth grows with the message size and saturates,
``busbw(S) = peak * S / (S + S_half)``, per link class (NVLink inside a node, the network
between nodes), plus a latency per ring step; ``peak`` and ``S_half`` come from public NCCL
measurements (profile provenance).
"""

from __future__ import annotations

import bisect
import csv
import functools
import math
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent.parent / "profiles" / "kernels"


@functools.cache
def gemm_table(name: str) -> dict[str, dict[tuple[int, int, int], float]]:
    """``profiles/kernels/<name>.csv`` (or a .csv path): dtype -> {(m, n, k): FLOP/s}, batch-1
    rows only."""
    path = Path(name) if name.endswith(".csv") else KERNEL_DIR / f"{name}.csv"
    table: dict[str, dict[tuple[int, int, int], float]] = {}
    with open(path) as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        for row in rows:
            if int(row["b"]) != 1:
                continue
            shape = (int(row["m"]), int(row["n"]), int(row["k"]))
            table.setdefault(row["dtype"], {})[shape] = float(row["flops_per_s"])
    return table


@functools.cache
def _axes(name: str, dtype: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    shapes = gemm_table(name)[dtype]
    return tuple(tuple(sorted({s[i] for s in shapes})) for i in range(3))  # type: ignore[return-value]


def _bracket(axis: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """Grid points around ``x`` (clamped to the grid) and the log-space weight of the upper."""
    x = min(max(x, axis[0]), axis[-1])
    hi = min(bisect.bisect_left(axis, x), len(axis) - 1)
    lo = max(hi - 1, 0)
    if axis[hi] == axis[lo]:
        return lo, hi, 0.0
    return lo, hi, (math.log(x) - math.log(axis[lo])) / (math.log(axis[hi]) - math.log(axis[lo]))


def _interpolate(points: dict[tuple[int, int, int], float],
                 axes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
                 at: tuple[float, float, float]) -> float:
    """``points`` on a full grid (``axes``) at ``at``: trilinear in log space, clamped to the
    grid."""
    (a0, a1, wa), (b0, b1, wb), (c0, c1, wc) = (
        _bracket(axis, x) for axis, x in zip(axes, at, strict=True))
    total = 0.0
    for ia, fa in ((a0, 1 - wa), (a1, wa)):
        for ib, fb in ((b0, 1 - wb), (b1, wb)):
            for ic, fc in ((c0, 1 - wc), (c1, wc)):
                weight = fa * fb * fc
                if weight:
                    total += weight * math.log(points[(axes[0][ia], axes[1][ib], axes[2][ic])])
    return math.exp(total)


@functools.lru_cache(maxsize=65536)
def table_flops(name: str, dtype: str, m: float, n: float, k: float) -> float:
    """Measured FLOP/s of an (m, n, k) GEMM, trilinear in log space over the table's grid."""
    return _interpolate(gemm_table(name)[dtype], _axes(name, dtype), (m, n, k))


@functools.cache
def speedup_table(name: str) -> tuple[dict[tuple[int, int, int], float],
                                      tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """``profiles/kernels/<name>.csv`` (or a .csv path) of measured float8 / bf16 speedups of
    one linear by forward GEMM shape: {(M, K, N): speedup} and its grid axes."""
    path = Path(name) if name.endswith(".csv") else KERNEL_DIR / f"{name}.csv"
    with open(path) as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        points = {(int(r["M"]), int(r["K"]), int(r["N"])): float(r["speedup_vs_bf16"])
                  for r in rows}
    axes = tuple(tuple(sorted({p[i] for p in points})) for i in range(3))
    return points, axes  # type: ignore[return-value]


@functools.lru_cache(maxsize=65536)
def table_speedup(name: str, m: float, k: float, n: float) -> float:
    """Measured float8 / bf16 speedup of an (m x k) @ (k x n) linear, forward and backward,
    trilinear in log space over the table's grid (clamped to it)."""
    points, axes = speedup_table(name)
    return _interpolate(points, axes, (m, k, n))


def gemm_s(m: float, n: float, k: float, table: str, scale: float) -> float:
    """Seconds of one (m, n, k) GEMM: 2mnk FLOPs at the table's throughput x ``scale``."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return 2.0 * m * n * k / (table_flops(table, "bf16", m, n, k) * scale)


def linear_s(tokens: float, k: float, n: float, table: str, scale: float) -> float:
    """Forward + backward seconds of one linear (in ``k``, out ``n``) over ``tokens`` rows:
    the forward GEMM (tokens x k) @ (k x n), the input gradient (tokens x n) @ (n x k) and the
    weight gradient (k x tokens) @ (tokens x n), each at its own shape's throughput."""
    return (gemm_s(tokens, n, k, table, scale) + gemm_s(tokens, k, n, table, scale)
            + gemm_s(k, n, tokens, table, scale))


def bus_gbps(nbytes: float, peak_gbps: float, half_bytes: float) -> float:
    """NCCL bus bandwidth of a ``nbytes`` collective: saturating in the message size."""
    if half_bytes <= 0:
        return peak_gbps
    return peak_gbps * nbytes / (nbytes + half_bytes)
