"""What the planner needs to read TorchTitan 0.3.0's multimodal hybrid families (qwen3_5,
Kimi K2.5) on the meta device: a stand-in for the Gated DeltaNet kernel (fla's Triton kernel
has no meta implementation) and the work of a vision encoder for one sequence."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ...graph.layer_graph import EncoderWork, measure_block

DELTA_CHUNK = 64
"""Chunk length of fla's chunked gated delta rule (``chunk_gated_delta_rule``, its default
``BT``): the intra-chunk products are this wide."""


class _ChunkedDeltaRule(torch.autograd.Function):
    """The GEMMs of fla's chunked gated delta rule at their shapes, and what its autograd
    function saves (q, k, v, g, beta and the chunk-local matrix A); values are not computed
    faithfully (the state recurrence across chunks is batched), which on meta nothing reads."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
        b, t, h, dk = q.shape
        n = math.ceil(t / DELTA_CHUNK)
        pad = n * DELTA_CHUNK - t

        def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B, H, N, C, D]
            x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
            return x.transpose(1, 2).reshape(b, h, n, DELTA_CHUNK, x.shape[-1])

        qc, kc, vc = chunks(q), chunks(k), chunks(v)
        a = kc @ kc.transpose(-1, -2)  # intra-chunk K K^T (beta- and decay-weighted)
        w, u = a @ kc, a @ vc  # the WY representation of the chunk's updates
        states = kc.transpose(-1, -2) @ u  # each chunk's K x V state update
        fresh = u - w @ states  # values corrected by the state before the chunk
        out = qc @ states + (qc @ kc.transpose(-1, -2)) @ fresh
        ctx.save_for_backward(q, k, v, g, beta, a)
        out = out.reshape(b, h, n * DELTA_CHUNK, -1)[:, :, :t]
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # never run: measured forward only
        raise NotImplementedError("the chunked delta rule stand-in measures the forward only")


def gated_delta_on_meta(self: torch.nn.Module, xq: torch.Tensor, xk: torch.Tensor,
                        xv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                        cu_seqlens: Any = None, cu_seqlens_cpu: Any = None) -> torch.Tensor:
    """``GatedDeltaKernel.forward`` on meta tensors: the key / query heads expanded to the
    value heads as the real forward does, then the chunked rule's GEMMs (per token and head
    6 C K + 4 C V + 6 K V multiply-adds, C the chunk length) and saved tensors."""
    if xq.shape[2] != xv.shape[2]:
        repeat = xv.shape[2] // xq.shape[2]
        xq, xk = xq.repeat_interleave(repeat, dim=2), xk.repeat_interleave(repeat, dim=2)
    return _ChunkedDeltaRule.apply(xq, xk, xv, g, beta)


def text_inputs(seq_len: int) -> dict[str, Any]:
    """qwen3_5's forward inputs for one plain text sequence besides its tokens: token
    positions (the text path of its multimodal RoPE) and the special token ids it looks up
    (none occurs in the meta tokens)."""
    from torchtitan.models.qwen3_5 import QWEN3_5_SPECIAL_TOKENS

    ids = {f"{key.removesuffix('_token')}_id": -1 - i
           for i, key in enumerate(QWEN3_5_SPECIAL_TOKENS)}
    return {"positions": torch.arange(seq_len, device="meta").unsqueeze(0),
            "special_tokens": ids}


def declared_tp(model: torch.nn.Module, blocks: str) -> dict[str, dict[str, str]]:
    """Each block kind's linears with the TP style their weight's declared ``tp`` placement
    gives (Shard(0): column-wise, Shard(1): row-wise, else replicated): what
    ``model.parallelize`` applies."""
    from spmd_types import Shard

    from ...graph.tp_styles import block_signature

    styles = {0: "colwise", 1: "rowwise"}
    plans: dict[str, dict[str, str]] = {}
    for block in model.get_submodule(blocks).children():
        plan = plans.setdefault(block_signature(block), {})
        for name, module in block.named_modules():
            config = getattr(module, "_sharding_config", None)
            if not isinstance(module, torch.nn.Linear) or config is None:
                continue
            weight = config.state_shardings.get("weight")
            tp = next((p for axis, p in (weight.axis_types.items() if weight else ())
                       if str(getattr(axis, "value", axis)) == "tp"), None)
            plan[name] = styles.get(tp.dim, "replicate") if isinstance(tp, Shard) else \
                "replicate"
    return plans


def qwen35_heads(config: Any) -> tuple[int, int, int]:
    """(query heads, key / value heads, head dim) of qwen3_5's full-attention layers (its
    Gated DeltaNet layers have as many key heads or more)."""
    attention = next(layer.attention for layer in config.layers if layer.attention is not None)
    return attention.n_heads, attention.n_kv_heads, attention.head_dim


def _bidirectional_attention(self: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, *, scale: float | None = None,
                             **_: Any) -> torch.Tensor:
    """A vision encoder's inner attention (flex with a per-item block mask, or SDPA) measured
    as non-causal SDPA over one image's patches ((B, L, heads, dim) in and out)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=False, scale=scale)
    return out.transpose(1, 2)


def merge_unit(encoder: torch.nn.Module) -> tuple[int, int]:
    """(rows, columns) of patches merged into one decoder token (qwen3_5's
    ``spatial_merge_size``, Kimi's ``merge_kernel_size``)."""
    if hasattr(encoder, "merge_kernel_size"):
        rows, cols = encoder.merge_kernel_size
        return int(rows), int(cols)
    size = int(encoder.spatial_merge_size)
    return size, size


IMAGE_TOKENS = 1024
"""Decoder tokens per image where the planner assumes what the data holds: a 1-megapixel
image (1024 x 1024 pixels at qwen3_5's and Kimi's 16-pixel patches merged 2 x 2, 32 x 32
pixels a token). Only the encoder's attention depends on it (quadratically per image)."""


def vision_encoder_work(encoder: torch.nn.Module, seq_len: int) -> EncoderWork:
    """One sequence's work in a vision encoder: the sequence filled with images of
    ``IMAGE_TOKENS`` tokens (every token an image token bounds the encoder's linear work and
    activations from above, as captioned-image data nearly is; the decoder's cost does not
    depend on which tokens are image tokens). Measured on meta: the encoder's own forward on
    one such image, its attention as non-causal SDPA, times the images in a sequence."""
    rows, cols = merge_unit(encoder)
    tokens = min(seq_len, IMAGE_TOKENS)
    across = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
    grid = torch.tensor([[1, rows * across, cols * (tokens // across)]])
    patches = tokens * rows * cols
    images = seq_len / tokens
    attention = {"FlexAttention": _bidirectional_attention,
                 "ScaledDotProductAttention": _bidirectional_attention}
    flops, saved, _, eager, gemm_io = measure_block(
        encoder, ((None,), {"grid_thw": grid}), patches, encoder.patch_embed.in_features,
        stand_ins=attention)
    width = encoder.patch_embed.out_features
    return EncoderWork(images * flops, images * saved,
                       io_bytes=4.0 * len(encoder.layers) * images * patches * width,
                       eager_bytes=images * eager, gemm_io_bytes=images * gemm_io,
                       assumption=f"each sequence all images of {tokens} tokens "
                                  f"({grid[0, 1]} x {grid[0, 2]} patches)")
