"""Context parallel for attention written inline (``F.scaled_dot_product_attention`` called in
a module that also does other work), as ``graph/cp_find.py`` finds it.

TorchTitan's ``apply_cp_to_attention_module`` puts torch's ``_ContextParallel`` style on a
module whose forward *is* the attention call. Here the same style's input / output functions
wrap each SDPA call made while the found module runs (a ``TorchFunctionMode`` entered by the
module's forward hooks): q / k / v become sequence-sharded DTensors and torch's CP dispatcher
runs ring attention, exactly as under the module wrapper. Rotary tables the model hands its
blocks (a buffer indexed by position on dim 0) are replaced, per block call, by the rows of the
positions TorchTitan's trainer gives this rank (its ``positions`` keyword under CP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class _RingAttention(TorchFunctionMode):
    """Every SDPA call under this mode runs as ring attention over ``mesh``."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor.experimental._attention import _ContextParallel

        self.mesh = mesh
        self.style = _ContextParallel(seq_dim=2,
                                      attention_type=_ContextParallel.AttentionType.SDPA)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        args, kwargs = self.style.sdpa_input_fn(None, args, kwargs, self.mesh)
        return self.style.sdpa_output_fn(None, (args, kwargs), func(*args, **kwargs),
                                         self.mesh)


def _ring_hooks(module: nn.Module, mesh: Any) -> None:
    """``module``'s SDPA calls run as ring attention (the mode is on while it runs)."""
    mode = _RingAttention(mesh)

    def enter(m: nn.Module, args: tuple) -> None:
        mode.__enter__()

    def leave(m: nn.Module, args: tuple, out: Any) -> None:
        mode.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _position_rows(model: nn.Module, blocks: list[nn.Module], buffers: tuple[str, ...]
                   ) -> None:
    """Blocks get the rows of ``buffers`` at this rank's positions (read from the model's
    ``positions`` keyword) wherever they are handed one of them, or a view of one."""
    seen: dict[str, Any] = {}

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["positions"] = kwargs.get("positions")

    def rows(value: Any) -> Any:
        positions = seen.get("positions")
        if not isinstance(value, torch.Tensor) or positions is None:
            return value
        base = value if value._base is None else value._base
        for name in buffers:
            buffer = model.get_buffer(name)
            if base is buffer:
                return buffer.index_select(0, positions[0].to(torch.long))
        return value

    def reindex(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (args[0], *map(rows, args[1:])), {k: rows(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(capture, with_kwargs=True)
    for block in blocks:
        block.register_forward_pre_hook(reindex, with_kwargs=True)


def apply_ring_sdpa(model: nn.Module, attention: list[nn.Module], blocks: list[nn.Module],
                    buffers: tuple[str, ...], cp_mesh: Any) -> None:
    """Ring attention for the SDPA calls of the ``attention`` modules (one per block of
    ``blocks``), and the position-indexed ``buffers`` of ``model`` cut to the rank's
    positions for every block."""
    from torch.distributed.tensor.experimental._attention import (
        _enable_context_parallel_dispatcher,
    )

    _enable_context_parallel_dispatcher()  # as TorchTitan's apply_cp_to_attention_module
    for module in attention:
        _ring_hooks(module, cp_mesh)
    if buffers:
        _position_rows(model, blocks, buffers)
