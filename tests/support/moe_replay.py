"""Kernel replays of TorchTitan 0.2.2's routed experts for experiments/gpu_check.py (what the MoE
terms of cost/moe.py rest on and the published rows cannot settle), each beside the term's
prediction: grouped GEMMs (torch._grouped_mm, and torchao's float8 rowwise / MXFP8 grouped GEMMs
where the device has them) by tokens per expert, TorchTitan's token permutation forward +
backward, and the EP dispatcher's device -> host sync. tests/test_moe_kernels.py runs the
permutation replay on CPU."""

from __future__ import annotations

import time
from typing import Any

from tests.support.gpu_replay import timed

EXPERT_SHAPES = {"deepseek_v3_16b": (2048, 1408, 8), "llama4_17bx16e": (5120, 8192, 4)}
"""(dim, expert hidden width, local experts) of the published MoE rows' experts: DeepSeek-V3
16B (64 experts at EP 8) and Llama 4 17Bx16E (16 experts at EP 4)."""
TOKENS_PER_EXPERT = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Rows per group: from the small groups of EP 1 / many experts to TorchTitan's EP runs."""
RECIPES = ("bf16", "float8", "mx")


def _grouped_fn(recipe: str) -> Any:
    """The grouped GEMM TorchTitan runs for ``recipe`` (None where this build lacks it)."""
    import torch

    if recipe == "bf16":
        return lambda a, b_t, offs: torch._grouped_mm(a, b_t, offs=offs)
    try:
        from torchao.prototype import moe_training
    except ImportError:
        return None
    return {"float8": getattr(moe_training, "_to_fp8_rowwise_then_scaled_grouped_mm", None),
            "mx": getattr(moe_training, "_to_mxfp8_then_scaled_grouped_mm", None)}[recipe]


def _fwd_bwd(fn, a, b, offs, grad) -> None:
    import torch

    torch.autograd.grad(fn(a, b.transpose(-2, -1), offs), (a, b), grad)


def grouped_gemm_rows(profile: Any, deadline: float, device: str = "cuda"
                      ) -> list[dict[str, object]]:
    """One projection (rows x dim -> hidden) of each expert shape as one grouped GEMM, forward
    and forward + backward by tokens per expert and recipe, until ``deadline`` (time.time());
    beside cost/moe.py's stacked prediction and one dense GEMM per group."""
    import torch

    from torchtitan_autoparallel.cost import kernels, moe

    rows = []
    table, clock = profile.gemm_table, profile.clock_scale
    constants = moe.moe_table(table)
    for model, (dim, hidden, experts) in EXPERT_SHAPES.items():
        for per in TOKENS_PER_EXPERT:
            for recipe in RECIPES:
                fn = _grouped_fn(recipe)
                if fn is None or time.time() > deadline:
                    continue
                m = per * experts
                a = torch.randn(m, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                b = torch.randn(experts, hidden, dim, device=device, dtype=torch.bfloat16,
                                requires_grad=True)
                offs = torch.arange(per, m + 1, per, device=device, dtype=torch.int32)
                grad = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
                try:
                    fwd = timed(fn, a, b.transpose(-2, -1), offs)
                    both = timed(_fwd_bwd, fn, a, b, offs, grad)
                except (RuntimeError, AssertionError, ValueError) as exc:  # not on this GPU
                    print(f"grouped GEMM {recipe} skipped: {str(exc).splitlines()[0]}")
                    continue
                low = "bf16" if recipe == "bf16" else recipe
                speed = {"float8": profile.float8_rowwise_gemm_speedup,
                         "mx": profile.mx_speedup}.get(recipe, 1.0)
                rate = constants.get(f"grouped_efficiency_{low}", 0.0) * speed
                parts = moe.stacked_gemm_s(experts, per, hidden, dim, table, clock)
                per_group = experts * kernels.linear_s(per, dim, hidden, table, clock)
                rows.append(dict(model=model, recipe=recipe, tokens_per_expert=per,
                                 groups=experts, dim=dim, hidden=hidden, fwd_s=fwd,
                                 fwd_bwd_s=both,
                                 predicted_fwd_s=parts[0] / rate if rate else 0.0,
                                 predicted_fwd_bwd_s=sum(parts) / rate if rate else 0.0,
                                 one_gemm_per_group_s=per_group / speed))
                del a, b, grad
    return rows


def permutation_rows(profile: Any, device: str = "cuda", tokens: int = 16384
                     ) -> list[dict[str, object]]:
    """TorchTitan 0.2.2's ``_permute`` + ``_unpermute`` forward and backward for DeepSeek-V3
    16B's routed tokens (``tokens`` x top 6 over 64 experts, 8 local at EP 8), beside
    cost/moe.py's permutation term for the same rows."""
    import torch
    from torchtitan.models.moe import utils

    from torchtitan_autoparallel.cost import moe

    dim, top_k, experts, ep = 2048, 6, 64, 8
    routed = tokens * top_k
    counts = torch.full((experts,), routed // experts, device=device, dtype=torch.int32)
    x = torch.randn(routed, dim, device=device, dtype=torch.bfloat16, requires_grad=True)

    def both() -> None:
        shape, permuted, indices, _ = utils._permute(x, counts, ep, experts // ep)
        out = utils._unpermute(permuted, shape, indices)
        torch.autograd.grad(out, x, torch.ones_like(out))

    measured = timed(both, warmup=2, reps=5) if device == "cuda" else _wall(both)
    shape = moe.MoeShape(tokens=tokens, dim=dim, hidden=1408, local_experts=experts // ep,
                         top_k=top_k, ep=ep, imbalance=1.0)
    fwd, bwd = moe.permutation_s(shape, profile)
    return [dict(model="deepseek_v3_16b", routed_rows=routed, dim=dim, measured_s=measured,
                 predicted_s=fwd + bwd)]


def _wall(fn, reps: int = 3) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def host_sync_rows(profile: Any, device: str = "cuda") -> list[dict[str, object]]:
    """The EP dispatcher's sync as TorchTitan 0.2.2 runs it: split sizes counted on the device
    (histc), read with ``.tolist()`` behind a queued GEMM, then the kernels it launches; host
    wall time minus the same sequence without the read, beside ``host_sync_us``."""
    import torch

    from torchtitan_autoparallel.cost import moe

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (98304,), device=device).float()

    def step(read: bool) -> None:
        torch.mm(a, a)
        counts = torch.histc(ids, bins=64, min=0, max=64)
        if read:
            counts.tolist()
        for _ in range(6):
            counts = counts.cumsum(0)
        torch.cuda.synchronize()

    with_sync, without = (_wall(lambda r=r: step(r), reps=50) for r in (True, False))
    return [dict(kernel="dispatcher host sync", measured_us=(with_sync - without) * 1e6,
                 predicted_us=moe.moe_table(profile.gemm_table).get("host_sync_us", 0.0))]


def moe_lines(grouped: list[dict], permutation: list[dict], sync: list[dict]) -> list[str]:
    """kernels.md lines: each measurement beside its prediction."""
    lines = ["", "| MoE kernel (cost/moe.py) | measured | predicted | measured / predicted |",
             "|---|---:|---:|---:|"]
    for r in grouped:
        label = (f"MoE grouped GEMM {r['model']} {r['recipe']} {r['groups']} x "
                 f"{r['tokens_per_expert']} rows")
        for part, key, pred in (("fwd", "fwd_s", "predicted_fwd_s"),
                                ("fwd + bwd", "fwd_bwd_s", "predicted_fwd_bwd_s")):
            if r[pred]:
                lines.append(f"| {label} {part} | {r[key] * 1e3:.3f} ms | {r[pred] * 1e3:.3f} | "
                             f"{r[key] / r[pred]:.2f} |")
    for r in permutation:
        lines.append(f"| MoE permutation fwd + bwd {r['model']} {r['routed_rows']} rows | "
                     f"{r['measured_s'] * 1e3:.3f} ms | {r['predicted_s'] * 1e3:.3f} | "
                     f"{r['measured_s'] / r['predicted_s']:.2f} |")
    for r in sync:
        lines.append(f"| MoE {r['kernel']} | {r['measured_us']:.0f} us | "
                     f"{r['predicted_us']:.0f} | {r['measured_us'] / r['predicted_us']:.2f} |")
    return lines
