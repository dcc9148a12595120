"""A block's forward FLOPs as the layer graph measures them on meta do not depend on which
FLOP formulas the installed torch has: torch 2.15 gave the CPU flash-attention op (the one the
graph routes SDPA to) a formula that counts the full s x s score matrix, torch 2.13 / 2.14 have
none. Reference: the textbook counts, 2 FLOPs per multiply-add of each GEMM, and causal
attention's two s x s products over half the scores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import flop_counter

from torchtitan_autoparallel.graph.layer_graph import measure_block

SEQ, DIM, HEADS = 256, 64, 4


class Attention(torch.nn.Module):
    """Causal multi-head self-attention: one fused QKV projection, SDPA, an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.wqkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, DIM))


def _torch_2_15_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register torch 2.15's formula for the CPU flash op (the GPU flash op's) on any torch."""
    registry = flop_counter.flop_registry
    monkeypatch.setitem(registry, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                        registry[torch.ops.aten._scaled_dot_product_flash_attention])


@pytest.mark.parametrize("with_2_15_rule", [False, True])
def test_attention_counted_causal_whatever_torch_counts(monkeypatch, with_2_15_rule):
    if with_2_15_rule:
        _torch_2_15_rule(monkeypatch)
    with torch.device("meta"):
        block = Attention()
    flops, _, attn, _, _ = measure_block(block, ((None,), {}), SEQ, DIM)
    head_dim = DIM // HEADS
    gemms = 2 * SEQ * DIM * (3 * DIM) + 2 * SEQ * DIM * DIM
    causal = 0.5 * 2 * (2 * HEADS * SEQ * SEQ * head_dim)  # QK^T and PV, half the scores
    assert attn == causal
    assert flops == gemms + causal
