"""A small decoder written for the tests, brought to TorchTitan the way a user brings a model:
its own model args and module names, a train spec registered with ``register_train_spec``
from the module ``experimental.custom_import`` names (``tests.support.pocket_lm``). No adapter is
registered here: auto parallelism discovers what it needs (``tests/support/pocket_lm_tp.py`` adds a
TP plan through the public adapter API).

Layout: ``wte`` (token embedding) -> ``stack`` (ModuleList of ``Cell``: LayerNorm, attention
``mix`` with rotary angles passed in by the model, LayerNorm, GELU ``ffn``) -> ``ln_out`` ->
``head``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.protocols.model import BaseModelArgs, ModelProtocol

NAME = "pocket_lm"


@dataclass
class PocketArgs(BaseModelArgs):
    width: int = 96
    depth: int = 3
    n_heads: int = 6
    n_kv_heads: int = 2
    ffn_width: int = 256
    vocab_size: int = 2048
    context: int = 128
    fixed_heads: bool = False
    """Attention views written with the model's head counts (not -1): right on one device,
    wrong on one tp rank's share of the heads (TP inference leaves TP out)."""

    def update_from_config(self, job_config, **kwargs) -> None:
        self.context = job_config.training.seq_len

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        n = sum(p.numel() for p in model.parameters())
        return n, 6 * n + 6 * self.depth * self.width * seq_len


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (batch, seq, heads, head_dim) with real cos / sin."""
    half = x.shape[-1] // 2
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Mix(nn.Module):
    """Causal grouped-query self-attention."""

    def __init__(self, args: PocketArgs) -> None:
        super().__init__()
        self.head_dim = args.width // args.n_heads
        fixed = args.fixed_heads
        self.heads = (args.n_heads, args.n_kv_heads) if fixed else (-1, -1)
        self.q = nn.Linear(args.width, args.n_heads * self.head_dim, bias=False)
        self.k = nn.Linear(args.width, args.n_kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(args.width, args.n_kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(args.n_heads * self.head_dim, args.width, bias=False)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q_heads, kv_heads = self.heads
        q = _rotate(self.q(x).view(b, s, q_heads, self.head_dim), angles[:s])
        k = _rotate(self.k(x).view(b, s, kv_heads, self.head_dim), angles[:s])
        v = self.v(x).view(b, s, kv_heads, self.head_dim)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Cell(nn.Module):
    def __init__(self, args: PocketArgs) -> None:
        super().__init__()
        self.ln_a = nn.LayerNorm(args.width)
        self.mix = Mix(args)
        self.ln_b = nn.LayerNorm(args.width)
        self.ffn = nn.Sequential(nn.Linear(args.width, args.ffn_width), nn.GELU(),
                                 nn.Linear(args.ffn_width, args.width))

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.ln_a(x), angles)
        return x + self.ffn(self.ln_b(x))


class PocketLM(ModelProtocol):
    def __init__(self, args: PocketArgs) -> None:
        super().__init__(args)
        self.model_args = args
        self.wte = nn.Embedding(args.vocab_size, args.width)
        self.stack = nn.ModuleList([Cell(args) for _ in range(args.depth)])
        self.ln_out = nn.LayerNorm(args.width)
        self.head = nn.Linear(args.width, args.vocab_size, bias=False)
        self.register_buffer("angles", self._angles(), persistent=False)

    def _angles(self) -> torch.Tensor:
        args = self.model_args
        half = args.width // args.n_heads // 2
        freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        return torch.outer(torch.arange(args.context, dtype=torch.float32), freqs)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        with torch.device(buffer_device or self.angles.device):
            self.angles = self._angles()
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            else:
                depth = self.model_args.depth if "proj" in name else 0
                nn.init.normal_(p, std=0.02 / math.sqrt(1 + depth))

    def forward(self, tokens: torch.Tensor, **_: object) -> torch.Tensor:
        h = self.wte(tokens)
        for cell in self.stack:
            h = cell(h, self.angles)
        return self.head(self.ln_out(h))


def parallelize_pocket(model: nn.Module, parallel_dims: object, job_config: object) -> nn.Module:
    """The model's own recipe: one device (auto parallelism plans every other case)."""
    return model


FLAVORS = {"tiny": PocketArgs(), "fixed_heads": PocketArgs(fixed_heads=True),
           "wide": PocketArgs(width=192, depth=4, n_heads=6, n_kv_heads=6, ffn_width=512)}


def register() -> None:
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.components.tokenizer import build_hf_tokenizer
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader
    from torchtitan.protocols import train_spec as ts

    if NAME in ts._extra_train_specs:  # imported under two module names (pytest, custom_import)
        return
    ts.register_train_spec(NAME, ts.TrainSpec(
        model_cls=PocketLM, model_args=FLAVORS, parallelize_fn=parallelize_pocket,
        pipelining_fn=None, build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers, build_dataloader_fn=build_text_dataloader,
        build_tokenizer_fn=build_hf_tokenizer, build_loss_fn=build_cross_entropy_loss,
    ))


register()
