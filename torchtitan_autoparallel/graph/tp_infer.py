"""Tensor-parallel plan inference for a family without a TP function (``ModelAdapter.tp_fn``).

One block of each kind is run on the meta device under a ``TorchFunctionMode`` that records every
torch call (and every call of an ``nn.Linear``, a module with its own parameters, or the MoE
module, as one node) with the tensors flowing between them. From that graph:

- a linear whose output reaches the block's output (the residual stream) before any other linear
  is row-wise; one whose output reaches only row-wise linears is column-wise; one whose output
  feeds a column-wise linear's input (a low-rank down projection) is replicated;
- the module holding a row-wise linear and its column-wise partners takes the sequence-sharded
  stream and all-gathers it (``PrepareModuleInput`` Shard(1) -> Replicate), the row-wise linear
  reduce-scatters back to Shard(1), norms on the stream are ``SequenceParallel``: TorchTitan's
  ``apply_tp`` layout;
- the block is run again with the column-wise / row-wise weights cut to one tp rank's share
  (tp 2): the ops between the projections must run on local heads (a view or expand written
  with the model's head count fails here) and the shapes of the two runs show which dim is
  sharded, which split / cat / reduction / attention must leave alone;
- where a norm with parameters sits between the projections (per-head q / k norms), or a
  projection is replicated, the module runs on DTensors (TorchTitan's qwen3 / deepseek_v3
  layout): column-wise outputs stay DTensors, those norms are ``SequenceParallel`` over the
  sharded dim, replicated modules ``NoParallel``, the attention kernel's module gets local
  heads.

Anything else (an op outside the known elementwise / shape / attention ops on a sharded tensor,
tied weights, a parameter no style covers) leaves TP out for the model, with the op named.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn as nn

from .adapters import INFER_TP, ModelAdapter, resolve
from .tp_styles import InferredTP, Style, block_signature
from .tp_trace import Node, Recorder, fqn, show_args, trace

__all__ = ["InferredTP", "Style", "TPInferenceError", "block_signature", "infer_block_plan",
           "infer_tp", "with_inferred_tp"]

TP_PROBE = 2
"""tp degree of the local-shape run (every head count the planner accepts is a multiple)."""

_ELEMENTWISE = {
    "add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "mul",
    "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__rtruediv__",
    "__itruediv__", "neg", "__neg__", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "pow",
    "__pow__", "rsqrt", "sqrt", "square", "abs", "erf", "softplus", "clamp", "float", "to",
    "type_as", "type", "half", "bfloat16", "contiguous", "clone", "dropout", "cos", "sin",
    "where", "masked_fill", "real", "imag", "view_as_complex", "view_as_real", "silu_",
    "relu_", "expand", "expand_as", "repeat_interleave", "view", "reshape", "transpose",
    "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "movedim", "swapaxes",
    "detach",
}
_SPLITS = {"split", "chunk", "unbind", "tensor_split", "narrow", "cat", "concat", "stack"}
_REDUCTIONS = {"mean", "sum", "softmax", "log_softmax", "amax", "amin", "max", "min", "norm",
               "var", "std", "cumsum", "logsumexp"}
_ATTENTION = {"scaled_dot_product_attention", "flex_attention"}


class TPInferenceError(Exception):
    """The block is not a clean column-wise -> elementwise -> row-wise chain (message: why)."""


def _sharded_dim(global_shape: tuple[int, ...], local_shape: tuple[int, ...]) -> int | None:
    """The one dim where the local shape is the global one over ``TP_PROBE``; None if equal."""
    diffs = [i for i, (g, loc) in enumerate(zip(global_shape, local_shape, strict=True))
             if g != loc]
    if not diffs:
        return None
    if len(diffs) > 1 or local_shape[diffs[0]] * TP_PROBE != global_shape[diffs[0]]:
        raise TPInferenceError(f"shape {global_shape} becomes {local_shape} on one tp rank")
    return diffs[0]


def _dim_arg(node: Node, position: int, default: int | None) -> int | tuple | None:
    args, kwargs = node.args
    if "dim" in kwargs:
        return kwargs["dim"]
    value = args[position] if len(args) > position else default
    return value if isinstance(value, (int, tuple, list)) or value is None else default


def _within(fqn: str, region: str) -> bool:
    return fqn == region or fqn.startswith(region + ".")


def _common_module(names: list[str]) -> str:
    parents = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*parents, strict=False):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


class _Analysis:
    """The TP plan of one traced block (``graph``) checked against its local-shape run."""

    def __init__(self, block: nn.Module, graph: Recorder, local: Recorder | None,
                 local_error: tuple[str, str] | None, opaque: set[str]) -> None:
        self.block, self.nodes, self.opaque = block, graph.nodes, opaque
        self.calls = graph.calls
        # shapes on one tp rank, node by node (none where the local run failed)
        self.local = local.nodes if local is not None and local_error is None else None
        self.local_error = local_error
        self.consumers: list[list[int]] = [[] for _ in self.nodes]
        for j, node in enumerate(self.nodes):
            for i in node.inputs:
                self.consumers[i].append(j)
        self.linears = {n.name: j for j, n in enumerate(self.nodes) if n.kind == "module"
                        and isinstance(block.get_submodule(n.name), nn.Linear)}

    def reach(self, start: int) -> tuple[set[str], bool]:
        """Linears whose input ``start``'s output reaches before any other linear, and
        whether it reaches the block output that way."""
        hits: set[str] = set()
        out = False
        stack, seen = list(self.consumers[start]), set()
        while stack:
            j = stack.pop()
            if j in seen:
                continue
            seen.add(j)
            node = self.nodes[j]
            if node.kind == "module" and node.name in self.linears:
                hits.add(node.name)
            elif node.kind == "output":
                out = True
            else:
                stack.extend(self.consumers[j])
        return hits, out

    def classify(self) -> dict[str, str]:
        names = [n.name for n in self.nodes if n.kind == "module" and n.name in self.linears]
        if len(names) != len(set(names)):
            raise TPInferenceError("a linear is called twice in one block (shared weights)")
        reach = {name: self.reach(j) for name, j in self.linears.items()}
        role: dict[str, str] = {}
        for name, (_, out) in reach.items():
            if out:  # later linears it reaches read the residual stream
                role[name] = "rowwise"
        for name, (hits, _) in reach.items():
            if name not in role and hits and hits <= set(role):
                role[name] = "colwise"
        changed = True
        while changed:
            changed = False
            for name, (hits, _) in reach.items():
                if name not in role and hits <= set(role) and any(
                        role[h] in ("colwise", "replicate") for h in hits):
                    role[name] = "replicate"
                    changed = True
        for name in reach:
            if name not in role:
                raise TPInferenceError(f"{name}'s output reaches no row-wise projection")
        return role

    def shard_dim(self, j: int, k: int, inputs: bool = True) -> int | None:
        """Sharded dim of input (or output) ``k`` of node ``j``; None without a local run."""
        if self.local is None:
            return None
        g, loc = self.nodes[j], self.local[j]
        pair = (g.in_shapes, loc.in_shapes) if inputs else (g.shapes, loc.shapes)
        return _sharded_dim(pair[0][k], pair[1][k])

    def where(self, node: Node) -> str:
        args = node.args[0][1:] if node.args else ()
        return f"{fqn(node.scope, node.name)}{show_args(args)}"

    def check_op(self, j: int, tainted: set[int]) -> None:
        """An op on sharded tensors must act on local heads as on all of them."""
        node = self.nodes[j]
        name = node.name
        if name in _ELEMENTWISE or name == "__getitem__":
            return
        dims = [self.shard_dim(j, k) for k, i in enumerate(node.inputs) if i in tainted]
        if name in _ATTENTION:
            if any(d not in (None, 1) for d in dims):
                raise TPInferenceError(f"{self.where(node)} gets tensors sharded on dim "
                                       f"{dims}, not on the heads (dim 1)")
            return
        ndim = len(node.in_shapes[0]) if node.in_shapes else 0
        if name in _SPLITS:
            pos = {"narrow": 1, "unbind": 1, "cat": 1, "concat": 1, "stack": 1}.get(name, 2)
            dim = _dim_arg(node, pos, 0)
            if name != "stack" and isinstance(dim, int) and dim % ndim in dims:
                raise TPInferenceError(f"{self.where(node)} splits or joins the sharded dim")
            return
        if name in _REDUCTIONS:
            dim = _dim_arg(node, 1, None)
            reduced = {d % ndim for d in (dim if isinstance(dim, (tuple, list)) else [dim])
                       if d is not None} if dim is not None else set(range(ndim))
            if self.local is None or reduced & set(dims):
                raise TPInferenceError(f"{self.where(node)} reduces over the sharded dim")
            return
        raise TPInferenceError(f"{self.where(node)} on a sharded tensor is not an op tensor "
                               "parallelism is inferred through")

    def plan(self) -> dict[str, Style]:
        role = self.classify()
        rows = [n for n, r in role.items() if r == "rowwise"]
        tainted: set[int] = set()
        sharded_modules: dict[str, int] = {}
        plain_modules: list[str] = []
        for j, node in enumerate(self.nodes):
            hot = any(i in tainted for i in node.inputs)
            if node.kind == "module" and node.name in role:
                kind = role[node.name]
                if kind in ("colwise", "replicate") and hot:
                    raise TPInferenceError(f"{node.name} reads a tensor already sharded by a "
                                           "column-wise projection")
                if kind == "rowwise" and not hot:
                    raise TPInferenceError(f"{node.name} projects onto the residual stream "
                                           "with no column-wise projection before it")
                if kind == "colwise":
                    tainted.add(j)
            elif node.kind == "module":
                if hot and node.name in self.opaque:
                    raise TPInferenceError(f"{node.name} reads a sharded tensor")
                if hot:
                    sharded_modules[node.name] = j
                    tainted.add(j)
                elif node.name not in self.opaque:
                    plain_modules.append(node.name)
            elif node.kind == "output" and hot:
                raise TPInferenceError("a column-wise output reaches the block output")
            elif hot:
                self.check_op(j, tainted)
                tainted.add(j)
                if self.local is not None:
                    for k in range(len(node.shapes)):
                        if self.shard_dim(j, k, inputs=False) is None:
                            raise TPInferenceError(f"{self.where(node)} loses the sharding "
                                                   "(a head count written in the code?)")
        styles: dict[str, Style] = {}
        regions: list[str] = []
        dtensor_regions: list[str] = []
        for row in rows:
            group = [n for n, r in role.items() if r != "rowwise"
                     and row in self.reach(self.linears[n])[0]]
            group += [n for n, r in role.items() if r == "replicate" and n not in group
                      and self.reach(self.linears[n])[0] & set(group)]
            region = _common_module([row, *group])
            if not region:
                raise TPInferenceError(f"{row} and its column-wise projections "
                                       f"{sorted(group)} are not inside one submodule of the "
                                       "block")
            if region in regions:
                raise TPInferenceError(f"{region} holds two row-wise projections")
            regions.append(region)
            found, dtensor = self.region(region, row, group, role, sharded_modules,
                                         plain_modules, tainted)
            styles.update(found)
            if dtensor:
                dtensor_regions.append(region)
        if self.local_error and not any(_within(self.local_error[0], r)
                                        for r in dtensor_regions):
            raise TPInferenceError(self.local_error[1])
        for name in plain_modules:
            if not any(_within(name, r) for r in regions):
                styles[name] = Style("sequence", local_output=False)
        self.check_coverage(styles)
        return styles

    def region(self, region: str, row: str, group: list[str], role: dict[str, str],
               sharded_modules: dict[str, int], plain_modules: list[str], tainted: set[int]
               ) -> tuple[dict[str, Style], bool]:
        """Styles of one module holding a row-wise projection and its partners, and whether
        it runs on DTensors."""
        call = self.calls.get(region, [])
        if not call or not isinstance(call[0], int) or call[0] in tainted:
            raise TPInferenceError(f"{region} does not take the block's hidden states as its "
                                   "first argument")
        inner_sharded = {n: j for n, j in sharded_modules.items() if _within(n, region)}
        inner_plain = [n for n in plain_modules if _within(n, region)]
        dtensor = bool(inner_sharded or inner_plain
                       or any(role[n] == "replicate" for n in group))
        if not dtensor and self.local_error and _within(self.local_error[0], region):
            raise TPInferenceError(self.local_error[1])
        others = tuple("replicate" if dtensor and isinstance(a, int) else None
                       for a in call[1:])
        styles = {region: Style("prepare", inputs=("shard:1", *others),
                                desired=("replicate", *others), local_output=False)}
        for name in group:
            styles[name] = (Style("colwise", local_output=not dtensor)
                            if role[name] == "colwise" else Style("replicate", False))
        styles[row] = Style("rowwise")
        for name, j in inner_sharded.items():
            dim = self.shard_dim(j, 0)
            if dim is None:
                raise TPInferenceError(f"{name} (a module with parameters) reads a sharded "
                                       "tensor and the block fails on one tp rank's shapes: "
                                       f"{self.local_error[1] if self.local_error else ''}")
            styles[name] = Style("sequence", local_output=False, sequence_dim=dim)
        for name in inner_plain:
            styles[name] = Style("replicate", local_output=False)
        if dtensor:
            for node in self.nodes:
                if (node.kind == "op" and node.name in _ATTENTION and node.scope != region
                        and _within(node.scope, region)):
                    layouts = tuple("shard:1" if isinstance(a, int) else None
                                    for a in self.calls.get(node.scope, []))
                    styles[node.scope] = Style("prepare", inputs=layouts, desired=layouts)
        return styles, dtensor

    def check_coverage(self, styles: dict[str, Style]) -> None:
        for name, _ in self.block.named_parameters():
            owner = name.rpartition(".")[0]
            if owner in styles or any(_within(owner, o) for o in self.opaque):
                continue
            raise TPInferenceError(f"parameter {name} is covered by no tensor-parallel style")


def _local_copy(block: nn.Module, role: dict[str, str]) -> nn.Module:
    """``block`` with its column-wise / row-wise weights cut to one tp rank's share."""
    local = copy.deepcopy(block)
    for name, kind in role.items():
        linear = local.get_submodule(name)
        out_f, in_f = linear.weight.shape
        if kind == "colwise":
            if out_f % TP_PROBE:
                raise TPInferenceError(f"{name} has {out_f} outputs, not divisible over tp")
            linear.weight = nn.Parameter(torch.empty(out_f // TP_PROBE, in_f, device="meta"))
            if linear.bias is not None:
                linear.bias = nn.Parameter(torch.empty(out_f // TP_PROBE, device="meta"))
        elif kind == "rowwise":
            if in_f % TP_PROBE:
                raise TPInferenceError(f"{name} has {in_f} inputs, not divisible over tp")
            linear.weight = nn.Parameter(torch.empty(out_f, in_f // TP_PROBE, device="meta"))
    return local


def infer_block_plan(block: nn.Module, inputs: tuple[tuple, dict],
                     opaque: tuple[str, ...] = ()) -> dict[str, Style]:
    """The TP + SP plan of ``block`` (on meta): module fqn relative to the block -> style.
    ``inputs``: the block's (args, kwargs), hidden states first; ``opaque``: submodules left
    to other code (the MoE module). Raises TPInferenceError naming what stops it."""
    if not isinstance(inputs[0][0], torch.Tensor):
        raise TPInferenceError("the block's first argument is not its hidden states")
    owners: dict[int, str] = {}
    for name, param in block.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            raise TPInferenceError(f"{name} is {owners[id(param)]} (tied weights)")
        owners[id(param)] = name
    skip = set(opaque)
    graph = Recorder()
    try:
        trace(graph, block, inputs, skip)
    except Exception as exc:
        raise TPInferenceError(f"the block does not run on the meta device ({graph.last}: "
                               f"{type(exc).__name__})") from None
    analysis = _Analysis(block, graph, None, None, skip)
    role = analysis.classify()
    local = Recorder()
    error: tuple[str, str] | None = None
    try:
        trace(local, _local_copy(block, role), inputs, skip)
        if [n.name for n in local.nodes] != [n.name for n in graph.nodes]:
            error = ("", "the block runs different ops on one tp rank's shapes")
    except TPInferenceError:
        raise
    except Exception as exc:  # the op that fails on local heads is the finding
        message = str(exc).splitlines()[0][:160] if str(exc) else ""
        error = (local.scopes[-1], f"{local.last} fails on one tp rank's heads (a head count "
                                   f"written in the code?): {type(exc).__name__}: {message}")
    return _Analysis(block, graph, local, error, skip).plan()


def infer_tp(adapter: ModelAdapter, model: nn.Module, inputs: tuple[tuple, dict], dim: int,
             seq_len: int) -> InferredTP:
    """The inferred TP function of ``model`` (on meta) as ``adapter`` names its modules.
    ``inputs``: what the model passes its first block (hidden states replaced by a fresh
    (1, seq_len, dim) tensor). Raises TPInferenceError."""
    embedding = model.get_submodule(adapter.embedding) if adapter.embedding else None
    output = model.get_submodule(adapter.output) if adapter.output else None
    if (embedding is not None and output is not None
            and getattr(output, "weight", None) is getattr(embedding, "weight", 0)):
        raise TPInferenceError(f"{adapter.output}.weight is {adapter.embedding}.weight (tied "
                               "weights)")
    args, kwargs = inputs
    x = torch.empty(1, seq_len, dim, device="meta")
    plans: dict[str, dict[str, Style]] = {}
    for name, block in model.get_submodule(adapter.blocks).named_children():
        sig = block_signature(block)
        if sig in plans:
            continue
        opaque = (adapter.moe,) if adapter.routed_experts(block) is not None else ()
        try:
            plans[sig] = infer_block_plan(block, ((x, *args[1:]), kwargs), opaque)
        except TPInferenceError as exc:
            raise TPInferenceError(f"{adapter.blocks}.{name}: {exc}") from None
    return InferredTP(adapter.embedding, adapter.final_norm or None, adapter.output,
                      adapter.blocks, plans)


def with_inferred_tp(adapter: ModelAdapter, model: nn.Module, inputs: tuple[tuple, dict],
                     dim: int, seq_len: int) -> ModelAdapter:
    """``adapter`` with an inferred ``tp_fn`` where it has none; where inference fails, TP
    excluded with the reason (the plan table's ``excluded tp`` line)."""
    if "tp" in adapter.excluded:
        return adapter
    if adapter.tp_fn not in (None, INFER_TP):
        if not adapter.tp_checked:
            return adapter
        try:
            infer_tp(adapter, model, inputs, dim, seq_len)
        except Exception as exc:  # what inference cannot shard, the family's tp_fn cannot
            return _without_tp(adapter, exc, "the family's TP plan does not fit this model",
                               "TP stays off for this model")
        return adapter
    if adapter.declared_tp is not None:
        declared = resolve(adapter.declared_tp)(model, adapter.blocks)
        plans = {sig: {name: Style(kind) for name, kind in styles.items()}
                 for sig, styles in declared.items()}
        return dataclasses.replace(adapter, tp_fn=InferredTP(
            adapter.embedding, adapter.final_norm or None, adapter.output, adapter.blocks,
            plans))
    try:
        fn = infer_tp(adapter, model, inputs, dim, seq_len)
    except Exception as exc:  # whatever stops inference leaves TP out, with the reason
        return _without_tp(adapter, exc, "no TP plan for this family and none inferred",
                           "register one to enable (ModelAdapter.tp_fn)")
    return dataclasses.replace(adapter, tp_fn=fn)


def _without_tp(adapter: ModelAdapter, exc: Exception, what: str, fix: str) -> ModelAdapter:
    """``adapter`` with TP excluded: ``what``, what stopped inference (``exc``), ``fix``."""
    found = str(exc) if isinstance(exc, TPInferenceError) else \
        f"{type(exc).__name__}: {str(exc)[:160]}"
    reason = f"{what} ({found}); {fix}"
    return dataclasses.replace(adapter, tp_fn=None, excluded={**adapter.excluded, "tp": reason})
