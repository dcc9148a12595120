"""Discovery: an adapter read from a model and its train spec when none is registered, and the
checks every adapter (registered or discovered) must pass against its model.

What discovery reads: the repeated blocks (the largest ModuleDict / ModuleList whose children
share one forward signature), the token embedding (an ``nn.Embedding`` outside the blocks), the
output (an ``nn.Linear`` outside the blocks onto the vocabulary) and the norm before it, the
attention wrapper inside a block (TorchTitan's ``models.attention`` wrappers, for CP), MoE
blocks (TorchTitan's ``models.moe.MoE``), and from the module of the train spec's parallelize
function the family's own ``apply_tp`` / ``apply_non_moe_tp``, ``apply_moe_ep_tp`` and
``_op_sac_save_list``. What it does not find stays ``None``: the technique it would enable is
excluded from the search (``ModelAdapter.exclusions``), except selective AC, which falls back
to TorchTitan's dense-model save list (``DEFAULT_SAC_SAVE_LIST``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch.nn as nn

from ..errors import UserError
from ..frontend import frontend
from .adapters import ModelAdapter, registered_adapter, submodule_or_none

_TP_FUNCTIONS = ("apply_non_moe_tp", "apply_tp")


def _forward_signature(module: nn.Module) -> str:
    return str(inspect.signature(type(module).forward))


def required_args(module: nn.Module) -> list[str]:
    """Names of the positional arguments without a default of ``module``'s forward."""
    params = inspect.signature(module.forward).parameters.values()
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def view_modules(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` with its fqn as the model presents itself: walked through
    ``named_children``, which a model may override (TorchTitan's HF backend shows HF's
    ``model.model.layers`` as ``layers``, the names its TP and pipeline functions use); for
    other models the same as ``named_modules``. Each module once, at its first name."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def walk(module: nn.Module, fqn: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        out.append((fqn, module))
        for name, child in module.named_children():
            if child is not None:
                walk(child, f"{fqn}.{name}" if fqn else name)

    walk(model, prefix)
    return out


def view_parameters(model: nn.Module) -> list[str]:
    """Every parameter's fqn as ``view_modules`` names its module (each parameter once)."""
    out: list[str] = []
    seen: set[int] = set()
    for fqn, module in view_modules(model):
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                out.append(f"{fqn}.{name}" if fqn else name)
    return out


def _containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in view_modules(model)
            if name and isinstance(m, (nn.ModuleDict, nn.ModuleList)) and len(m) > 0]


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _outside(name: str, blocks: str) -> bool:
    return name != blocks and not name.startswith(blocks + ".")


def _find_blocks(family: str, model: nn.Module) -> str:
    repeated = [(name, m) for name, m in _containers(model)
                if len({_forward_signature(child) for child in m.children()}) == 1]
    if not repeated:
        raise UserError(
            f"model {family!r}: no repeated blocks found (a ModuleDict / ModuleList of modules "
            "with one forward signature): register an adapter naming them (ModelAdapter.blocks)"
        )
    return max(repeated, key=lambda item: _n_params(item[1]))[0]


def _parallelize_module(family: str) -> Any:
    """The module defining the family's own parallelize function (None where it has none)."""
    return frontend().parallelize_module(family)


def _inner_attention(block: nn.Module) -> str | None:
    kinds = frontend().attention_types()
    return next((name for name, m in block.named_modules() if isinstance(m, kinds)), None)


def _moe_module(blocks: nn.Module) -> str | None:
    kinds = frontend().moe_types()
    for block in blocks.children():
        for name, m in block.named_modules():
            if isinstance(m, kinds):
                return name
    return None


def get_adapter(name: str, model: nn.Module | None = None) -> ModelAdapter:
    """The adapter of train spec ``name``: the registered one with its ``None`` fields
    discovered from ``model`` (its train spec's model, on meta). Without ``model``: the
    registered adapter as registered (complete for TorchTitan's families); a family without
    one needs its model."""
    given = registered_adapter(name)
    if model is not None:
        return discover_adapter(name, model, given or ModelAdapter())
    if given is None:
        raise UserError(f"no adapter registered for model {name!r}: its adapter is discovered "
                        "from the model (the layer graph carries it: LayerGraph.adapter)")
    return given


def discover_adapter(family: str, model: nn.Module, given: ModelAdapter) -> ModelAdapter:
    """``given`` (the registered adapter, or an empty one) with its ``None`` fields read from
    ``model`` (on meta) and the train spec of ``family``."""
    found: dict[str, Any] = {}
    blocks = given.blocks or _find_blocks(family, model)
    found["blocks"] = blocks
    if submodule_or_none(model, blocks) is None:
        return dataclasses.replace(given, **found)  # check_adapter names the field
    named = (given.embedding, given.output, given.final_norm)
    outside = [] if None not in named else [
        (n, m) for n, m in view_modules(model) if n and _outside(n, blocks)]
    if given.embedding is None:
        found["embedding"] = next((n for n, m in outside if isinstance(m, nn.Embedding)), None)
        if found["embedding"] is None:
            raise UserError(f"model {family!r}: no nn.Embedding outside {blocks!r}: register "
                            "an adapter naming the token embedding (ModelAdapter.embedding)")
    embedding = submodule_or_none(model, given.embedding or found["embedding"])
    if given.output is None and embedding is not None:
        vocab = embedding.num_embeddings
        found["output"] = next((n for n, m in reversed(outside)
                                if isinstance(m, nn.Linear) and m.out_features == vocab), None)
        if found["output"] is None:
            raise UserError(f"model {family!r}: no nn.Linear onto the {vocab}-token vocabulary "
                            f"outside {blocks!r}: register an adapter naming the output "
                            "projection (ModelAdapter.output)")
    output = given.output or found.get("output")
    if given.final_norm is None:
        names = [n for n, _ in outside]
        end = names.index(output) if output in names else len(outside)
        norms = [n for n, m in outside[:end]
                 if "norm" in type(m).__name__.lower() and "." not in n]
        found["final_norm"] = norms[-1] if norms else ""
    container = model.get_submodule(blocks)
    if given.inner_attention is None and len(container) > 0:
        found["inner_attention"] = _inner_attention(next(iter(container.children())))
    if given.block_args is None and len(container) > 0:
        found["block_args"] = len(required_args(next(iter(container.children()))))
    moe = given.moe or _moe_module(container)
    found["moe"] = moe
    source = _parallelize_module(family)

    def piece(field: str, *names: str) -> None:
        hit = next((n for n in names if source is not None and hasattr(source, n)), None)
        if getattr(given, field) is None and hit:
            found[field] = f"{source.__name__}.{hit}"

    piece("tp_fn", *_TP_FUNCTIONS)
    piece("op_sac_save_list", "_op_sac_save_list")
    if moe:
        piece("moe_fn", "apply_moe_ep_tp")
    if given.default_pins is None:
        found["default_pins"] = (f"*.{moe}.router",) if moe else ()
    return dataclasses.replace(given, **found)


def _fail(family: str, field: str, value: Any, problem: str, fix: str) -> UserError:
    return UserError(f"ModelAdapter.{field} = {value!r} for model {family!r} {problem}: {fix}")


def check_adapter(family: str, adapter: ModelAdapter, model: nn.Module) -> None:
    """One-line errors for an adapter that does not describe ``model``: module names that do
    not exist, blocks that are not a container of one forward signature."""
    top = [n for n, _ in model.named_children()]
    fix = f"name one of the model's modules (top level: {top[:8]})"
    for name in ("blocks", "embedding", "output", "final_norm"):
        value = getattr(adapter, name)
        if value is not None and submodule_or_none(model, value) is None:
            raise _fail(family, name, value, "names no module", fix)
    if adapter.rope_buffer is not None and not hasattr(model, adapter.rope_buffer):
        raise _fail(family, "rope_buffer", adapter.rope_buffer, "names no model buffer",
                    f"set it to None or to one of {[n for n, _ in model.named_buffers()][:6]}")
    blocks = model.get_submodule(adapter.blocks)
    if not isinstance(blocks, (nn.ModuleDict, nn.ModuleList)) or len(blocks) == 0:
        raise _fail(family, "blocks", adapter.blocks, "is not a non-empty ModuleDict / "
                    "ModuleList", "name the container of the repeated blocks")
    signatures: dict[str, str] = {}
    first_of_type: dict[type, str] = {}
    for name, block in blocks.named_children():
        first_of_type.setdefault(type(block), name)
    for kind, name in first_of_type.items():
        signatures.setdefault(_forward_signature(blocks.get_submodule(name)),
                              f"{name} ({kind.__name__})")
    if len(signatures) > 1:
        shown = "; ".join(f"block {where} takes {sig}"
                          for sig, where in list(signatures.items())[:2])
        raise _fail(family, "blocks", adapter.blocks, f"holds blocks with differing forward "
                    f"signatures ({shown})", "every block must take the same inputs; name a "
                    "container of identical-signature blocks")
    first = next(iter(blocks.children()))
    if (adapter.inner_attention is not None
            and submodule_or_none(first, adapter.inner_attention) is None):
        raise _fail(family, "inner_attention", adapter.inner_attention, "names no module of "
                    "its first block", "give the attention module's name relative to a block")


def heads_of(adapter: ModelAdapter, args: Any, dim: int, block: nn.Module
             ) -> tuple[int, int, int] | None:
    """(n_heads, n_kv_heads, head_dim): the adapter's ``heads``, else ``n_heads`` /
    ``n_kv_heads`` (default n_heads) / ``head_dim`` (default dim // n_heads) of the model args,
    else of the first module in ``block`` that has them; None when nothing says."""
    if adapter.heads is not None:
        return tuple(int(v) for v in adapter.heads(args))  # type: ignore[return-value]
    for source in (args, *block.modules()):
        n_heads = getattr(source, "n_heads", None)
        if isinstance(n_heads, int) and n_heads > 0:
            n_kv = getattr(source, "n_kv_heads", None) or n_heads
            head_dim = getattr(source, "head_dim", None) or dim // n_heads
            return n_heads, int(n_kv), int(head_dim)
    return None
