"""``pocket_lm`` with a user adapter that adds its TP plan (``experimental.custom_import =
"tests.support.pocket_lm_tp"``): everything else is still discovered."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from torchtitan_autoparallel import ModelAdapter, register_adapter

from . import pocket_lm  # noqa: F401  (registers the train spec)


def pocket_tensor_parallel(model: nn.Module, tp_mesh: Any, loss_parallel: bool,
                           enable_float8_tensorwise_tp: bool = False) -> None:
    """Megatron-style TP with sequence parallel: the residual stream is sequence-sharded
    (Shard(1)) between cells; attention heads and the FFN hidden units are split over tp."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_out": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1),
                                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel),
    })
    for cell in model.stack:
        parallelize_module(cell, tp_mesh, {
            "ln_a": SequenceParallel(),
            "mix": PrepareModuleInput(input_layouts=(Shard(1), None),
                                      desired_input_layouts=(Replicate(), None)),
            "mix.q": ColwiseParallel(),
            "mix.k": ColwiseParallel(),
            "mix.v": ColwiseParallel(),
            "mix.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_b": SequenceParallel(),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "ffn.0": ColwiseParallel(),
            "ffn.2": RowwiseParallel(output_layouts=Shard(1)),
        })


register_adapter("pocket_lm", ModelAdapter(tp_fn=pocket_tensor_parallel))
