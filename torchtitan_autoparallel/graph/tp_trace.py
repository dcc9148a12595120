"""The recorder TP inference reads a block with: one forward on meta tensors under a
``TorchFunctionMode`` that records every torch call, and every call of a leaf module (an
``nn.Linear``, a module with its own parameters, a module left to other code) as one node, with
the tensors flowing between them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map


@dataclass
class Node:
    kind: str  # "input", "op", "module", "output"
    name: str
    inputs: list[int]
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    in_shapes: list[tuple[int, ...]] = field(default_factory=list)
    scope: str = ""
    args: Any = None


def fqn(scope: str, name: str) -> str:
    return f"{scope}.{name}" if scope else name


def _is_leaf(module: nn.Module, opaque: set[int]) -> bool:
    return (isinstance(module, nn.Linear) or id(module) in opaque
            or any(True for _ in module.parameters(recurse=False)))


class Recorder(TorchFunctionMode):
    """Torch calls and leaf-module calls of one block forward, with their tensor flow."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.producer: dict[int, int] = {}
        self.alive: list[torch.Tensor] = []
        self.leaf_depth = 0
        self.scopes: list[str] = [""]
        self.calls: dict[str, list[Any]] = {}
        self.last = ""

    def add(self, node: Node, outputs: Any) -> None:
        tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        node.shapes = [tuple(t.shape) for t in tensors]
        self.nodes.append(node)
        for t in tensors:
            self.producer[id(t)] = len(self.nodes) - 1
            self.alive.append(t)

    def sources(self, tree: Any) -> tuple[list[int], list[tuple[int, ...]]]:
        tensors = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
        return ([self.producer[id(t)] for t in tensors if id(t) in self.producer],
                [tuple(t.shape) for t in tensors if id(t) in self.producer])

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        self.last = f"{fqn(self.scopes[-1], name)}{show_args(args[1:])}"
        out = func(*args, **kwargs)
        if self.leaf_depth == 0 and any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            inputs, shapes = self.sources((args, kwargs))
            self.add(Node("op", name, inputs, in_shapes=shapes, scope=self.scopes[-1],
                           args=(args, kwargs)), out)
        return out


def show_args(args: tuple) -> str:
    def one(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            return "tensor"
        if isinstance(a, (list, tuple)):
            return ", ".join(one(x) for x in a)
        return repr(a)

    return f"({', '.join(one(a) for a in args)})"


def _to_meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _stub(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty_like(x)


def trace(rec: Recorder, block: nn.Module, inputs: tuple[tuple, dict],
           opaque: set[str]) -> None:
    """Run ``block`` once on meta tensors, recording its graph into ``rec``."""
    handles = []
    opaque_ids = {id(block.get_submodule(n)) for n in opaque}
    names = {id(m): n for n, m in block.named_modules()}
    pending: dict[int, tuple[list[int], list[tuple[int, ...]]]] = {}

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        name = names[id(module)]
        rec.scopes.append(name)
        if name not in rec.calls:  # a module called by keyword only (HF's attention): in order
            given = args or tuple(kwargs.values())
            rec.calls[name] = [rec.producer.get(id(a), -1) if isinstance(a, torch.Tensor)
                               else None for a in given]
        if _is_leaf(module, opaque_ids) and name:
            if rec.leaf_depth == 0:
                pending[id(module)] = rec.sources((args, kwargs))
            rec.leaf_depth += 1

    def post(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        name = rec.scopes.pop()
        if _is_leaf(module, opaque_ids) and name:
            rec.leaf_depth -= 1
            if rec.leaf_depth == 0:
                srcs, shapes = pending.pop(id(module))
                rec.add(Node("module", name, srcs, in_shapes=shapes, scope=rec.scopes[-1]),
                        out)

    for name, module in block.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
    args, kwargs = inputs
    args, kwargs = tree_map(_to_meta, (args, kwargs))
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            rec.add(Node("input", f"input{i}", []), a)
    stubs = [block.get_submodule(n) for n in opaque]
    for module in stubs:  # left to other code (routed experts do not run on meta)
        module.forward = _stub  # type: ignore[method-assign]
    try:
        with rec:
            out = block(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for module in stubs:
            del module.forward
    out = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    rec.nodes.append(Node("output", "output", [rec.producer[id(out)]]))
