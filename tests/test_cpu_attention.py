"""CPU ring attention (context parallelism over gloo) matches unsharded SDPA."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._attention import _disable_context_parallel_dispatcher
from torchtitan.distributed.context_parallel import apply_cp_to_attention_module, cp_shard

from tests.support.gloo import spawn

B, H, S, D = 2, 4, 64, 16
WORLD = 2
TOL = 2e-6


class _Attention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _run_cp(
    mesh: DeviceMesh, full: list[torch.Tensor], load_balancer: str | None
) -> list[torch.Tensor]:
    """CP forward/backward; returns [out, dq, dk, dv] gathered back into global order."""
    module = _Attention()
    apply_cp_to_attention_module([module], mesh, "sdpa")
    # Shard the global positions along with the data to learn where local rows belong.
    pos = torch.arange(S, dtype=torch.float32).view(1, 1, S, 1).expand(B, H, S, 1)
    (q, k, v, dout, pos), _ = cp_shard(mesh, (*full, pos), None, load_balancer, input_seq_dim=2)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v)
    out.backward(dout)
    results = []
    index = torch.cat([torch.empty_like(pos) for _ in range(WORLD)], dim=2)
    dist.all_gather(list(index.chunk(WORLD, dim=2)), pos.contiguous())
    index = index.long().expand(B, H, S, D)
    for local in (out, q.grad, k.grad, v.grad):
        gathered = [torch.empty_like(local) for _ in range(WORLD)]
        dist.all_gather(gathered, local.detach().contiguous())
        results.append(torch.empty(B, H, S, D).scatter_(2, index, torch.cat(gathered, dim=2)))
    return results


def _worker(rank: int, out_dir: str) -> None:
    from torchtitan_autoparallel.titan.v0_2.cpu_attention import (
        _cpu_fwd_cp_strategy,
        _cpu_fwd_strategy,
        enable_cpu_ring_attention,
    )

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    torch.manual_seed(0)  # same global data on every rank
    q, k, v, dout = (torch.randn(B, H, S, D) for _ in range(4))
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out = _Attention()(ref_q, ref_k, ref_v)
    ref_out.backward(dout)
    ref = [ref_out.detach(), ref_q.grad, ref_k.grad, ref_v.grad]

    report: dict[str, object] = {}
    # Without the patch, upstream CP has no strategy/handler for the CPU kernel.
    try:
        _run_cp(mesh, [q, k, v, dout], None)
        report["unpatched_error"] = None
    except Exception as e:
        report["unpatched_error"] = f"{type(e).__name__}: {str(e)[:200]}"

    enable_cpu_ring_attention()  # after TorchTitan enabled the CP dispatcher
    enable_cpu_ring_attention()  # idempotent
    for lb in (None, "headtail"):
        got = _run_cp(mesh, [q, k, v, dout], lb)
        names = ("out", "dq", "dk", "dv")
        report[str(lb)] = {
            n: (g - r).abs().max().item() for n, g, r in zip(names, got, ref, strict=True)
        }

    # Disable then re-enable through TorchTitan: strategies must be re-registered.
    strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert strategies[cpu_fwd] is _cpu_fwd_cp_strategy
    _disable_context_parallel_dispatcher()
    # CP strategy dropped together with upstream CP rules; the TP (head-sharding) one stays
    assert strategies[cpu_fwd] is _cpu_fwd_strategy
    got = _run_cp(mesh, [q, k, v, dout], "headtail")
    assert strategies[cpu_fwd] is _cpu_fwd_cp_strategy  # re-registered by TorchTitan
    report["reenabled"] = max((g - r).abs().max().item() for g, r in zip(got, ref, strict=True))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def test_cpu_ring_attention_matches_sdpa(tmp_path: Path) -> None:
    spawn(_worker, tmp_path, WORLD)
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank}: {report}")
        assert report["unpatched_error"] is not None, "CP on CPU unexpectedly worked unpatched"
        for lb in ("None", "headtail"):
            for name, err in report[lb].items():
                assert err <= TOL, f"load_balancer={lb} {name}: max abs err {err} > {TOL}"
        assert report["reenabled"] <= TOL
