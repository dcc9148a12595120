"""Layer graph: per layer kind, fqn, parameters, FLOPs and saved-activation bytes.

Built from the model on the meta device: every distinct block is run forward once on meta
tensors for the job's sequence length (batch 1) under ``FlopCounterMode`` and a
``saved_tensors_hooks`` that counts what autograd keeps for backward. SDPA is routed to the
flash kernel's op (meta SDPA would otherwise decompose into the math path and count the s x s
score matrix that flash attention never stores). Attention FLOPs are counted by this module's own
rule (causal: half the score matrix), never by the counter: torch 2.14 has no formula for the CPU
flash op, torch 2.15 added one that ignores causality (the full s x s), so the counter's total
would move with the torch version while the work does not.
"""

import contextlib
import functools
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..errors import UserError
from ..runtime.hf import meta_capture
from .adapters import ModelAdapter, resolve, submodule_or_none
from .cp_find import with_found_cp
from .discover import (
    check_adapter,
    get_adapter,
    heads_of,
    required_args,
    view_modules,
    view_parameters,
)
from .sub_block_find import with_found_sub_blocks
from .tp_infer import with_inferred_tp


@dataclass(frozen=True)
class EncoderWork:
    """One sequence's work in an encoder feeding the decoder's embedding (what
    ``ModelAdapter.encoders`` functions measure; fields as ``Layer``'s)."""

    fwd_flops: float
    saved_bytes: float
    io_bytes: float
    """fp32 bytes its TP collectives move per direction: each of its blocks all-reduces its
    attention's and MLP's outputs in forward and their inputs' gradients in backward."""
    eager_bytes: float = 0.0
    gemm_io_bytes: float = 0.0
    assumption: str = ""
    """What was assumed of its input where the model does not say (a plan note)."""


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One schedulable unit: the embedding, a transformer block, or norm + output (built with
    keywords only)."""

    fqn: str
    kind: str
    """"embedding", "encoder" (a vision encoder feeding the embedding), "block" or
    "output"."""
    params: int
    """Parameter count (tied weights counted once, at their first owner)."""
    fwd_flops: float
    """Forward FLOPs for one sequence of the job's length."""
    saved_bytes: float
    """Activation bytes kept for backward for one sequence, no checkpointing, fp32."""
    io_bytes: float
    """Bytes of the layer's input for one sequence (what full AC keeps), fp32."""
    signature: str
    """Layers with equal signatures are interchangeable (aggregated in the MILP)."""
    attn_flops: float = 0.0
    """Part of ``fwd_flops`` in causal attention (what ring attention overlaps with)."""
    kv_bytes: float = 0.0
    """Keys + values of one sequence, fp32 (what ring attention passes around)."""
    expert_params: int = 0
    """Parameters of the routed experts (MoE blocks; part of ``params``)."""
    num_experts: int = 0
    top_k: int = 0
    """Routed experts per token."""
    expert_flops: float = 0.0
    """Part of ``fwd_flops`` in routed experts, for one sequence (uniform routing)."""
    eager_bytes: float = 0.0
    """Forward memory traffic of the ops other than GEMMs and attention (norms, RoPE,
    activations, residual adds, casts, copies), one sequence, in a bf16 forward: bytes read +
    written when each op is its own kernel (eager)."""
    gemm_io_bytes: float = 0.0
    """Activation operands and outputs of the block's GEMMs and attention, one sequence, bf16:
    what fused (compiled) elementwise code still reads and writes once."""
    linear_shapes: tuple[tuple[int, int], ...] = ()
    """(in_features, out_features) of every linear in the block (float8 GEMM shapes)."""
    linear_input_elements: float = 0.0
    """Elements of the linears' inputs for one sequence (what float8 casts read)."""
    linear_names: tuple[str, ...] = ()
    """Each linear's name inside the block, in ``linear_shapes`` order (what float8's
    ``filter_fqns`` match)."""
    linear_styles: tuple[str, ...] = ()
    """Each linear's TP style in ``linear_shapes`` order ("colwise", "rowwise", "replicate";
    "" where the family's TP plan is not inferred): which side of its weight tp splits."""
    param_bytes: int = 0
    """Bytes of the parameters in the dtypes the model builds them in (TorchTitan's gpt_oss
    builds its blocks in bf16); 0: fp32 (a graph written by hand)."""

    @property
    def stored_param_bytes(self) -> float:
        """Bytes of the layer's parameters as stored (4 per parameter where unrecorded)."""
        return float(self.param_bytes or 4 * self.params)

    @property
    def shared_expert_linears(self) -> tuple[int, ...]:
        """The indices (in ``linear_shapes``) of a MoE block's shared experts' linears: those
        named so (TorchTitan's ``moe.shared_experts.w1``, HF's ``mlp.shared_expert.up_proj``;
        none where the graph records no names)."""
        return tuple(i for i, name in enumerate(self.linear_names) if "shared_expert" in name)


@dataclass(frozen=True)
class LayerGraph:
    family: str
    flavor: str
    seq_len: int
    dim: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layers: tuple[Layer, ...]
    attn_type: str = "sdpa"
    """The model's attention kernel ("sdpa", "flex", "varlen")."""
    module_names: tuple[str, ...] = ()
    """Every module fqn of the model (what ``autoparallel.pin`` globs match)."""
    param_names: tuple[str, ...] = ()
    cp_attention: tuple[str, ...] = ("sdpa", "flex")
    """Attention kernels the family's context parallel supports."""
    grouped_experts: bool = True
    """The flavor runs routed experts as grouped GEMMs (else one GEMM per expert); TorchTitan
    uses grouped GEMMs only where the hardware has them (profile ``grouped_mm``)."""
    excluded: tuple[tuple[str, str], ...] = ()
    """(technique, reason) the family's adapter cannot apply (left out of the search)."""
    notes: tuple[str, ...] = ()
    """What reading the model assumed where it does not say (one plan note each)."""
    adapter: ModelAdapter = field(default_factory=ModelAdapter, compare=False, repr=False)
    """The family's adapter as the graph was read with it (registered, completed by
    discovery from the model)."""

    # read on every candidate the search costs: computed once per graph
    @functools.cached_property
    def blocks(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.kind == "block")

    @functools.cached_property
    def edges(self) -> tuple[Layer, ...]:
        """The layers that are not blocks (embedding, norm + output), in model order."""
        return tuple(layer for layer in self.layers if layer.kind != "block")

    @functools.cached_property
    def embedding(self) -> Layer | None:
        """The token embedding's layer (None in a model without one)."""
        return next((layer for layer in self.layers if layer.kind == "embedding"), None)

    @functools.cached_property
    def tied_output(self) -> bool:
        """Whether the output projection reads the embedding's weight (tied weights are
        counted once, at the embedding: the output layer then holds fewer than dim x vocab)."""
        return any(layer.kind == "output" and layer.params < self.dim * self.vocab_size
                   for layer in self.layers)

    @functools.cached_property
    def alike(self) -> tuple[tuple[Layer, int], ...]:
        """One layer of each (kind, signature), in model order, with how many layers share
        it (interchangeable for every cost)."""
        counts: dict[tuple[str, str], list] = {}
        for layer in self.layers:
            counts.setdefault((layer.kind, layer.signature), [layer, 0])[1] += 1
        return tuple((layer, n) for layer, n in counts.values())

    @functools.cached_property
    def num_experts(self) -> int:
        """Routed experts per MoE block (0 for a dense model)."""
        return max((layer.num_experts for layer in self.layers), default=0)

    @functools.cached_property
    def total_params(self) -> int:
        return sum(layer.params for layer in self.layers)


class _NoMetaInit(TorchFunctionMode):
    """Skip ``torch.nn.init``'s initialisers and in-place random fills on meta tensors (there
    are no values to fill): building a large model on meta otherwise spends most of its time
    decomposing ``uniform_`` for every linear."""

    _FILLS = (torch.Tensor.uniform_, torch.Tensor.normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in self._FILLS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


class _FlashSDPA(TorchFunctionMode):
    """Route F.scaled_dot_product_attention to the flash op (what real kernels save)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_flops = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            causal = kwargs.get("is_causal", False)
            if q.shape[1] != k.shape[1]:  # grouped-query attention
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            b, h, s, d = q.shape
            self.attention_flops += 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            dv = v.shape[-1]
            if dv != d:  # MLA: value heads narrower than query/key heads
                v = F.pad(v, (0, d - dv))
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, is_causal=causal, scale=kwargs.get("scale")
            )
            return out[..., :dv] if dv != d else out
        return func(*args, **kwargs)


_OWN_RULE = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu}
"""Ops whose FLOPs ``_FlashSDPA`` counts itself (whatever formula the installed torch has)."""


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
    """``aten._grouped_mm``: 2 FLOPs per multiply-add over every group (torch's counter has no
    formula; torch 2.15 runs it in float32 on meta, where 2.14 refused). Two 2-D operands are
    grouped along the contraction (an output per group, each over its slice of it)."""
    groups = out_shape[0] if len(a_shape) == 2 and len(b_shape) == 2 else 1
    return 2 * math.prod(out_shape) * a_shape[-1] // groups


FLOP_RULES = {torch.ops.aten._grouped_mm: _grouped_mm_flops}
"""FLOP formulas the counter is given for ops it has none for (in any torch this supports)."""


def counted_flops(counter: FlopCounterMode) -> float:
    """FLOPs ``counter`` counted outside the ops in ``_OWN_RULE``."""
    counts = counter.get_flop_counts().get("Global", {})
    return float(sum(n for op, n in counts.items() if op not in _OWN_RULE))


_GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
          torch.ops.aten._grouped_mm.default}
_FREE = {torch.ops.aten.empty.memory_format, torch.ops.aten.detach.default,
         torch.ops.aten._unsafe_view.default,
         torch.ops.aten.lift_fresh.default}


def _nbytes(tree: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class _Traffic(TorchDispatchMode):
    """Count forward memory traffic by kind of op: GEMM / attention activation operands and
    outputs (``gemm_io``) and everything else that moves data (``eager``); views are free."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params
        self.eager = 0
        self.gemm_io = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _GEMMS:
            # weights enter a GEMM as a transposed view of the parameter: skip 2-D operands
            # of matrix products whose base is a parameter
            acts = [a for a in args if isinstance(a, torch.Tensor) and not self._is_param(a)]
            self.gemm_io += _nbytes(acts) + _nbytes(out)
        elif not func.is_view and func not in _FREE:
            ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor) and not self._is_param(a)]
            self.eager += _nbytes(ins) + _nbytes(out)
        return out

    def _is_param(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return id(t) in self.params or id(base) in self.params


def _expert_weight(experts: torch.nn.Module, name: str) -> torch.Tensor:
    """Expert 0's slice of weight ``name`` (TorchTitan 0.2.2's ``w1``; 0.3.0 suffixes the
    layout: ``w1_EFD``)."""
    for param_name, param in experts.named_parameters(recurse=False):
        if param_name == name or param_name.startswith(f"{name}_"):
            return param[0]
    raise AttributeError(f"{type(experts).__name__} has no expert weight {name!r}")


def _experts_as_dense(experts: torch.nn.Module, routed: torch.Tensor, _counts: Any) -> Any:
    """Stand-in forward for routed experts on meta tensors: every routed token through one
    expert's SwiGLU. Same FLOPs and saved activations as the real grouped / looped kernels
    for any routing (whose token split is data dependent and cannot run on meta). gpt_oss's
    experts: one fused, biased gate / up projection and its clamped SwiGLU."""
    names = {n.split("_")[0] if not n.startswith("mlp") else "_".join(n.split("_")[:2])
             for n, _ in experts.named_parameters(recurse=False)}
    if "mlp1_weight" in names:
        w = functools.partial(_expert_weight, experts)
        h = routed @ w("mlp1_weight").transpose(-2, -1) + w("mlp1_bias")
        gate, up = h[..., ::2], h[..., 1::2]
        return (gate * torch.sigmoid(1.702 * gate) * (up + 1)) @ \
            w("mlp2_weight").transpose(-2, -1) + w("mlp2_bias")
    w1, w2, w3 = (_expert_weight(experts, n) for n in ("w1", "w2", "w3"))
    return (F.silu(routed @ w1.transpose(-2, -1)) * (routed @ w3.transpose(-2, -1))) @ \
        w2.transpose(-2, -1)


def _flex_as_causal_sdpa(self: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, *, score_mod: Any = None, block_mask: Any = None,
                         scale: float | None = None, return_lse: bool = False,
                         enable_gqa: bool = False) -> Any:
    """TorchTitan's ``FlexAttentionWrapper.forward`` for measuring on meta: causal SDPA (flex
    kernels with causal, sliding-window or document masks do at most its work), and a zero
    log-sum-exp where the caller asks for one (gpt_oss's attention sinks)."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return (out, q.new_zeros(q.shape[:3])) if return_lse else out


def batch_inputs(model: torch.nn.Module, names: list[str]) -> list[Any]:
    """The inputs of the model's forward besides the tokens, as TorchTitan's trainer builds
    them from the batch: ``attention_masks`` from ``model.get_attention_masks`` on a short
    synthetic batch (flex block masks; only their structure matters on meta, where attention
    is measured as causal SDPA), None for the rest."""
    import types as pytypes

    out: list[Any] = []
    for name in names:
        if name == "attention_masks" and hasattr(model, "get_attention_masks"):
            tokens = torch.ones(1, 128, dtype=torch.long)
            out.append(model.get_attention_masks(tokens, pytypes.SimpleNamespace(eos_id=0)))
        else:
            out.append(None)
    return out


def measure_block(block: torch.nn.Module, inputs: tuple[tuple, dict], seq_len: int, dim: int,
                  experts: torch.nn.Module | None = None,
                  stand_ins: dict[str, Any] | None = None) -> tuple:
    """(forward FLOPs, saved bytes, attention FLOPs, eager traffic, GEMM operand traffic) of
    one block for one sequence, on meta tensors. ``inputs``: the block's (args, kwargs),
    hidden states first (replaced by a fresh tensor). ``experts``: the block's routed experts,
    run through a dense stand-in; ``stand_ins``: module class name -> forward run in place of
    that class's (``ModelAdapter.meta_forwards``)."""
    # flex attention has no meta kernel: measured as causal SDPA
    with swapped_forwards(block, {"FlexAttentionWrapper": _flex_as_causal_sdpa,
                                  **(stand_ins or {})}):
        return _measure_block(block, inputs, seq_len, dim, experts)


def _measure_block(block: torch.nn.Module, inputs: tuple[tuple, dict], seq_len: int, dim: int,
                   experts: torch.nn.Module | None) -> tuple:
    if experts is not None:
        experts.forward = types.MethodType(_experts_as_dense, experts)
    params = {id(p) for p in block.parameters()}
    saved: dict[int, int] = {}
    # every saved base stays referenced until the count is done: a tensor freed mid-forward
    # (a branch autograd drops) would hand its id to a later one and make the count vary
    # between runs (and with it the plan fingerprint's model hash)
    alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params and id(base) not in saved:
            saved[id(base)] = base.numel() * base.element_size()
            alive.append(base)
        return t

    args, kwargs = inputs

    def run(x: torch.Tensor) -> None:
        block(x, *args[1:], **kwargs)

    x = torch.empty(1, seq_len, dim, device="meta", requires_grad=True)
    sdpa = _FlashSDPA()
    with (
        FlopCounterMode(display=False, custom_mapping=FLOP_RULES) as counter,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        sdpa,
    ):
        run(x)
    # memory traffic in the dtype GPUs train in: the block's own upcasts (norms, RoPE) show
    dtypes = [(p, p.dtype) for p in block.parameters()]
    block.to(torch.bfloat16)
    traffic = _Traffic({id(p) for p in block.parameters()})
    with _FlashSDPA(), traffic:
        run(x.detach().to(torch.bfloat16).requires_grad_())
    for p, dtype in dtypes:  # the model's own dtypes again (its parameter bytes are read)
        p.data = p.data.to(dtype)
    if experts is not None:
        del experts.forward
    return (counted_flops(counter) + sdpa.attention_flops, float(sum(saved.values())),
            sdpa.attention_flops, float(traffic.eager), float(traffic.gemm_io))


class _Captured(Exception):
    pass


def _unmeasurable(family: str, extra: list[str], exc: Exception) -> UserError:
    """The one-line error for a model whose blocks cannot run on meta tensors."""
    missing = (f"without {', '.join(extra)} (inputs of its forward besides the tokens, "
               "passed as None)" if extra else "from its tokens alone")
    return UserError(
        f"model {family!r} cannot be measured on the meta device {missing}: "
        f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}; plan it "
        "with parallelism.auto = false, or register an adapter with rope_buffer and "
        "block_args (ModelAdapter)"
    )


def block_inputs(family: str, model: torch.nn.Module, adapter: ModelAdapter, seq_len: int
                 ) -> tuple[tuple, dict]:
    """(args, kwargs) the model passes to its first block for one sequence: the adapter's
    ``rope_buffer`` convention, else captured from a forward of the model on meta tensors."""
    if adapter.rope_buffer is not None:
        rope = getattr(model, adapter.rope_buffer)
        return ((None, rope, None, None) if adapter.block_args == 4 else (None, rope, None)), {}
    first = next(iter(model.get_submodule(adapter.blocks).children()))
    seen: dict[str, Any] = {}

    def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["inputs"] = (args, kwargs)
        raise _Captured

    handle = first.register_forward_pre_hook(capture, with_kwargs=True)
    extra = required_args(model)[1:]
    keywords = resolve(adapter.forward_kwargs)(seq_len) if adapter.forward_kwargs else {}
    try:
        with meta_capture():  # HF rotary embeddings open an autocast on the input's device
            model(torch.zeros(1, seq_len, dtype=torch.long, device="meta"),
                  *batch_inputs(model, extra), **keywords)
    except _Captured:
        pass
    except Exception as exc:
        raise _unmeasurable(family, extra, exc) from None
    finally:
        handle.remove()
    if "inputs" not in seen:
        raise UserError(f"model {family!r} never calls its first block in forward: fix "
                        "ModelAdapter.blocks")
    return seen["inputs"]


def _linear_styles(adapter: ModelAdapter, sig: str, linears: list[tuple[str, Any]]
                   ) -> tuple[str, ...]:
    """The TP style of each linear of a block from the family's inferred TP plan (empty where
    the family has a TP function of its own)."""
    plan = getattr(adapter.tp_fn, "plans", {}).get(sig, {})
    return tuple(getattr(plan.get(name), "kind", "") for name, _ in linears) if plan else ()


def _signature(module: torch.nn.Module) -> str:
    shapes = ",".join(f"{n}:{tuple(p.shape)}" for n, p in module.named_parameters())
    return f"{type(module).__name__}[{shapes}]"


def planning_model(family: str, model: torch.nn.Module, seq_len: int
                   ) -> tuple[ModelAdapter, tuple[tuple, dict]]:
    """The adapter of ``model`` (built on meta; registered, discovered, TP inferred where it
    has no ``tp_fn``, CP found where it names no attention module, sub-blocks found where it
    names none) and its first block's inputs."""
    adapter = get_adapter(family, model)
    check_adapter(family, adapter, model)
    with stand_ins(model, adapter):
        inputs = block_inputs(family, model, adapter, seq_len)
        dim = model.get_submodule(adapter.embedding).embedding_dim
        adapter = with_found_cp(adapter, model, inputs, seq_len, dim)
        adapter = with_inferred_tp(adapter, model, inputs, dim, seq_len)
        return with_found_sub_blocks(adapter, model, inputs, dim, seq_len), inputs


def stand_ins(model: torch.nn.Module, adapter: ModelAdapter
              ) -> contextlib.AbstractContextManager[None]:
    """The adapter's ``meta_forwards`` in place of their modules' forwards while the model is
    traced and measured on meta."""
    return swapped_forwards(model, {name: resolve(fn)
                                    for name, fn in adapter.meta_forwards.items()})


@contextlib.contextmanager
def swapped_forwards(model: torch.nn.Module, forwards: dict[str, Any]) -> Iterator[None]:
    """Every module of ``model`` whose class name ``forwards`` holds runs that forward inside
    the block (the class's own again after it)."""
    swapped = [m for m in model.modules() if type(m).__name__ in forwards]
    for module in swapped:
        module.forward = types.MethodType(forwards[type(module).__name__], module)
    try:
        yield
    finally:
        for module in swapped:
            del module.forward


def meta_model(build: Any) -> torch.nn.Module:
    """``build()`` on the meta device, without initialisers (no values to fill)."""
    with torch.device("meta"), _NoMetaInit():
        return build()


def graph_of_model(family: str, flavor: str, model: torch.nn.Module, seq_len: int,
                   attn_type: str = "sdpa", grouped: bool = True, args: Any = None
                   ) -> LayerGraph:
    """Read ``model`` (built on meta, its attention measurable as causal SDPA) into a
    LayerGraph for sequences of ``seq_len`` tokens. ``attn_type``: the attention kernel the
    job runs; ``grouped``: routed experts run as grouped GEMMs; ``args``: the model's config
    (where its head counts are read first)."""
    with meta_capture():  # routers and rotary embeddings open an autocast on meta inputs
        return _graph_of_model(family, flavor, model, seq_len, attn_type, grouped, args)


def _encoder_layers(adapter: Any, model: torch.nn.Module, seq_len: int,
                    count: Callable[..., dict[str, int]]) -> tuple[list[Layer], tuple[str, ...]]:
    """The model's encoders as layers, each at the work its adapter measures, and the plan
    notes that say what that measurement assumes."""
    layers, encoded = [], []
    for fqn, measure in adapter.encoders.items():
        encoder = submodule_or_none(model, fqn)
        if encoder is not None:
            work = resolve(measure)(encoder, seq_len)
            layers.append(Layer(fqn=fqn, kind="encoder", fwd_flops=work.fwd_flops,
                                saved_bytes=work.saved_bytes, io_bytes=work.io_bytes,
                                signature=f"encoder:{fqn}", eager_bytes=work.eager_bytes,
                                gemm_io_bytes=work.gemm_io_bytes, **count(encoder)))
            encoded.append((layers[-1], work.assumption))
    notes = tuple(f"encoder {layer.fqn}: costed at its measured work with {why}; one FSDP "
                  "unit without activation checkpointing (the job's AC mode applies to the "
                  "blocks)" for layer, why in encoded)
    return layers, notes


def _moe_fields(adapter: Any, block: torch.nn.Module, experts: Any, seq_len: int
                ) -> dict[str, Any]:
    """A block's routed-expert fields of its ``Layer`` (none for a dense block)."""
    if experts is None:
        return {}
    n_expert_params = sum(p.numel() for p in experts.parameters())
    top_k = adapter.top_k(block)
    return {"expert_params": n_expert_params, "num_experts": experts.num_experts,
            "top_k": top_k,
            "expert_flops": 2.0 * seq_len * top_k * n_expert_params / experts.num_experts}


def _graph_of_model(family: str, flavor: str, model: torch.nn.Module, seq_len: int,
                    attn_type: str, grouped: bool, args: Any) -> LayerGraph:
    adapter, inputs = planning_model(family, model, seq_len)
    embedding = model.get_submodule(adapter.embedding)
    dim, vocab = embedding.embedding_dim, embedding.num_embeddings
    heads = heads_of(adapter, args, dim,
                     next(iter(model.get_submodule(adapter.blocks).children())))
    n_heads, n_kv_heads, head_dim = heads or (1, 1, dim)
    fp32 = 4
    seen: set[int] = set()

    def count(*modules: torch.nn.Module) -> dict[str, int]:
        """Parameters and their bytes (tied weights at their first owner)."""
        total = {"params": 0, "param_bytes": 0}
        for p in (p for module in modules for p in module.parameters()):
            if id(p) not in seen:
                seen.add(id(p))
                total["params"] += p.numel()
                total["param_bytes"] += p.numel() * p.element_size()
        return total

    layers = []
    layers.append(Layer(fqn=adapter.embedding, kind="embedding", fwd_flops=0.0,
                        saved_bytes=seq_len * dim * fp32, io_bytes=seq_len * 8,
                        signature="embedding", **count(embedding)))
    encoders, notes = _encoder_layers(adapter, model, seq_len, count)
    layers.extend(encoders)
    measured: dict[str, tuple[float, ...]] = {}
    kv_bytes = 2.0 * seq_len * n_kv_heads * head_dim * fp32
    moe_model = False
    for name, block in model.get_submodule(adapter.blocks).named_children():
        sig = _signature(block)
        experts = adapter.routed_experts(block)
        if sig not in measured:
            try:
                with stand_ins(block, adapter):
                    measured[sig] = measure_block(block, inputs, seq_len, dim, experts)
            except Exception as exc:
                raise _unmeasurable(family, required_args(model)[1:], exc) from None
        flops, saved, attn, eager, gemm_io = measured[sig]
        linears = [(n, m) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
        shapes = tuple((m.in_features, m.out_features) for _, m in linears)
        moe = _moe_fields(adapter, block, experts, seq_len)
        moe_model |= experts is not None
        layers.append(Layer(fqn=f"{adapter.blocks}.{name}", kind="block", fwd_flops=flops,
                            saved_bytes=saved, io_bytes=seq_len * dim * fp32, signature=sig,
                            attn_flops=attn, kv_bytes=kv_bytes, **moe, **count(block),
                            eager_bytes=eager, gemm_io_bytes=gemm_io, linear_shapes=shapes,
                            linear_input_elements=float(seq_len * sum(k for k, _ in shapes)),
                            linear_names=tuple(n for n, _ in linears),
                            linear_styles=_linear_styles(adapter, sig, linears)))
    head = [model.get_submodule(n) for n in (adapter.final_norm, adapter.output) if n]
    # logits are kept in fp32 for the loss, plus their gradient buffer during backward
    layers.append(Layer(fqn=adapter.output, kind="output", fwd_flops=2.0 * seq_len * dim * vocab,
                        saved_bytes=2 * seq_len * vocab * fp32 + 2 * seq_len * dim * fp32,
                        io_bytes=seq_len * dim * fp32, signature="output", **count(*head)))
    excluded = adapter.exclusions(moe_model, heads is not None)
    if any(layer.kind == "encoder" for layer in layers):
        excluded.setdefault("pp", "the model's encoders are planned beside the embedding, "
                                  "outside pipeline stages")
    return LayerGraph(family, flavor, seq_len, dim, vocab, n_heads, n_kv_heads, head_dim,
                      tuple(layers), attn_type,
                      tuple(name for name, _ in view_modules(model) if name),
                      tuple(view_parameters(model)),
                      adapter.cp_attention, grouped, tuple(sorted(excluded.items())), notes,
                      adapter)
