"""Context parallel for a family whose adapter names no attention module: found from one block
run on the meta device.

TorchTitan 0.2.2's CP shards the batch's tokens, labels and ``positions`` (the token positions
each rank holds, head-tail load balanced) and hands ``positions`` to the model's forward; torch
turns SDPA on sequence-sharded q / k / v into ring attention. So a block can run under CP when:

- its attention is ``F.scaled_dot_product_attention`` with ``is_causal=True``, no ``attn_mask``,
  no dropout, q / k / v as (batch, heads, seq, head dim): torch's ring attention shards dim 2;
- the model's forward accepts ``positions``, and the block either takes them itself or gets its
  positional encoding as a model buffer indexed by position on dim 0 (a rotary table sliced
  ``[:seq]``): that buffer is handed to each block as the rows of the rank's own positions;
- nothing in the block derives positions from its local length (``torch.arange``), and no other
  block input spans the sequence.

Where one fails, CP is excluded with what was found (``ModelAdapter.excluded``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from .adapters import ModelAdapter
from .tp_trace import _stub, _to_meta

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")


class _Calls(TorchFunctionMode):
    """The calls of one block forward that decide CP: SDPA / flex attention / arange, each
    with the module (relative to the block) it was called in."""

    def __init__(self) -> None:
        super().__init__()
        self.scopes = [""]
        self.seen: list[tuple[str, str, tuple, dict]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("scaled_dot_product_attention", "flex_attention", "arange"):
            self.seen.append((name, self.scopes[-1], args, kwargs))
        return func(*args, **kwargs)


@dataclass(frozen=True)
class RingSDPA:
    """Context parallel found from the block graph: ring attention for the SDPA calls made in
    ``module`` (relative to a block; "" for the block itself), and ``buffers`` (model buffer
    names) handed to the blocks as the rows of the rank's positions. Called like
    ``ModelAdapter.cp_fn``."""

    module: str
    buffers: tuple[str, ...]

    def __call__(self, model: nn.Module, blocks: list[nn.Module], cp_mesh: Any) -> None:
        from ..runtime.ring_sdpa import apply_ring_sdpa

        apply_ring_sdpa(model, [b.get_submodule(self.module) for b in blocks], blocks,
                        self.buffers, cp_mesh)


def _sdpa_problem(args: tuple, kwargs: dict, seq_len: int) -> str | None:
    """Why this SDPA call is not one ring attention replaces, or None."""
    given = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
    if given.get("attn_mask") is not None:
        return "SDPA with an explicit attn_mask (ring attention takes is_causal only)"
    if not given.get("is_causal", False):
        return "SDPA without is_causal=True (not a causal mask ring attention replaces)"
    if given.get("dropout_p", 0.0):
        return "SDPA with attention dropout"
    if given.get("enable_gqa", False):
        return "SDPA with enable_gqa=True (ring attention takes equal q / k / v heads)"
    q = given["query"]
    if q.dim() != 4 or q.shape[2] != seq_len:
        return (f"SDPA on q of shape {tuple(q.shape)}: ring attention needs (batch, heads, "
                f"seq={seq_len}, head dim)")
    return None


def _position_buffers(model: nn.Module, inputs: tuple[tuple, dict], seq_len: int
                      ) -> tuple[str, ...] | str:
    """Names of the model buffers the block gets (or a view of) that span the sequence on
    dim 0; a reason where another block input spans the sequence."""
    args, kwargs = inputs
    buffers = {id(b): n for n, b in model.named_buffers()}
    named = [*((f"argument {i}", a) for i, a in enumerate(args[1:], 1)), *kwargs.items()]
    found: list[str] = []
    for label, value in named:
        if not isinstance(value, torch.Tensor):
            continue
        base = value if value._base is None else value._base
        name = buffers.get(id(value), buffers.get(id(base)))
        if name is not None and base.dim() >= 1 and base.shape[0] >= seq_len:
            found.append(name)
        elif name is None and seq_len in tuple(value.shape):
            return (f"block input {label} of shape {tuple(value.shape)} spans the sequence "
                    "and is computed in the model's forward (CP shards only the tokens, "
                    "labels and positions)")
    return tuple(dict.fromkeys(found))


def find_ring_sdpa(model: nn.Module, block: nn.Module, inputs: tuple[tuple, dict],
                   seq_len: int, dim: int, opaque: nn.Module | None = None) -> RingSDPA | str:
    """Context parallel for ``block`` (run on meta with its captured ``inputs``; ``opaque``:
    routed experts, stubbed), or the reason there is none."""
    for name, module in block.named_modules():
        if "flex" in type(module).__name__.lower():
            return (f"flex attention ({name}: {type(module).__name__}; its CP needs the "
                    "family's attention module, ModelAdapter.inner_attention)")
    calls = _Calls()
    names = {id(m): n for n, m in block.named_modules()}

    def enter(module: nn.Module, args: tuple) -> None:
        calls.scopes.append(names[id(module)])

    def leave(module: nn.Module, args: tuple, out: Any) -> None:
        calls.scopes.pop()

    handles = []
    for name, module in block.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    if opaque is not None:
        opaque.forward = _stub  # type: ignore[method-assign]
    args, kwargs = tree_map(_to_meta, inputs)
    x = torch.empty(1, seq_len, dim, device="meta")
    try:
        with calls:
            block(x, *args[1:], **kwargs)
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:120]
        return f"the block does not run on meta tensors ({type(exc).__name__}: {first})"
    finally:
        for h in handles:
            h.remove()
        if opaque is not None:
            del opaque.forward
    called = [name for name, *_ in calls.seen]
    if "flex_attention" in called:
        return "flex attention (its CP needs the family's attention module)"
    sdpa = [(scope, a, k) for name, scope, a, k in calls.seen
            if name == "scaled_dot_product_attention"]
    if not sdpa:
        return "no F.scaled_dot_product_attention call in the block (attention written out)"
    for _, a, k in sdpa:
        problem = _sdpa_problem(a, k, seq_len)
        if problem:
            return problem
    scopes = {scope for scope, _, _ in sdpa}
    if len(scopes) > 1:
        return f"SDPA called from several modules ({sorted(scopes)})"
    takes = inspect.signature(model.forward).parameters.values()
    if not any(p.name == "positions" or p.kind is p.VAR_KEYWORD for p in takes):
        return ("the model's forward takes no positions (TorchTitan's CP passes each rank's "
                "token positions)")
    if "positions" in inspect.signature(block.forward).parameters:
        return RingSDPA(scopes.pop(), ())
    if "arange" in called:
        return "positions computed inside the block (torch.arange on its local length)"
    buffers = _position_buffers(model, inputs, seq_len)
    if isinstance(buffers, str):
        return buffers
    return RingSDPA(scopes.pop(), buffers)


def with_found_cp(adapter: ModelAdapter, model: nn.Module, inputs: tuple[tuple, dict],
                  seq_len: int, dim: int) -> ModelAdapter:
    """``adapter`` with a found ``cp_fn`` where it names no attention module; where none is
    found, CP excluded with what was found instead."""
    if (adapter.inner_attention is not None or adapter.cp_fn is not None
            or "cp" in adapter.excluded):
        return adapter
    blocks = model.get_submodule(adapter.blocks)
    found: RingSDPA | str = ""
    for block in dict.fromkeys(type(b) for b in blocks.children()):
        first = next(b for b in blocks.children() if type(b) is block)
        one = find_ring_sdpa(model, first, inputs, seq_len, dim,
                             adapter.routed_experts(first))
        if isinstance(one, str) or (found and one != found):
            found = one if isinstance(one, str) else "blocks differ in their attention"
            break
        found = one
    if isinstance(found, RingSDPA):
        return dataclasses.replace(adapter, cp_fn=found)
    reason = (f"no attention module known for ring attention and none found ({found}); "
              "register one to enable (ModelAdapter.inner_attention)")
    return dataclasses.replace(adapter, excluded={**adapter.excluded, "cp": reason})

