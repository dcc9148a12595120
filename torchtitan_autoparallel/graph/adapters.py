"""The public adapter API: what the planner and the applier need to know about a model family.

A family is the name its TorchTitan train spec is registered under (``model.name``). Register an
adapter for it from the module ``experimental.custom_import`` already imports for the train spec::

    from torchtitan_autoparallel import ModelAdapter, register_adapter

    register_adapter("my_model", ModelAdapter(tp_fn="my_pkg.parallel.apply_tp"))

Every field defaults to ``None``: discovered from the model and its train spec
(``graph/discover.py``), or, where that cannot be done safely, the technique it enables is left
out of the search (the plan table names what was excluded and why). A family without a
registered adapter is discovered entirely.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError

FnRef = str | Callable[..., Any]
"""A function, or its dotted import path (resolved when first used)."""

DEFAULT_SAC_SAVE_LIST = "torchtitan.models.llama3.infra.parallelize._op_sac_save_list"
"""Selective AC's save list where an adapter names none: TorchTitan's dense-model list (every
mm, the SDPA / flex / varlen attention kernels, reduce-scatter, max); op-level SAC on any
model recomputes the rest."""

INFER_TP = "infer"
"""``ModelAdapter.tp_fn`` value: use the inferred TP plan, not a discovered function."""


def resolve(ref: FnRef | None) -> Any:
    """The object ``ref`` names (a dotted path is imported), or ``ref`` itself."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ModelAdapter:
    """How the planner and the applier see one model family. Module names are fqns in the
    model (``blocks``, ``embedding``, ``final_norm``, ``output``) or relative to one block
    (``inner_attention``, ``moe``)."""

    blocks: str | None = None
    """The ModuleDict / ModuleList of repeated blocks (each planned on its own). Discovered:
    the largest container whose children share one forward signature."""
    embedding: str | None = None
    """Token embedding (its own FSDP group). Discovered: the first ``nn.Embedding`` outside
    the blocks."""
    final_norm: str | None = None
    """Norm before the output projection (sharded with the output); "" for none. Discovered:
    the last top-level module with "norm" in its class name before the output."""
    output: str | None = None
    """Output projection to the vocabulary (sharded with the final norm). Discovered: the last
    ``nn.Linear`` outside the blocks whose width is the embedding's vocabulary."""
    heads: Callable[[Any], tuple[int, int, int]] | None = None
    """model args -> (n_heads, n_kv_heads, head_dim). Discovered: ``n_heads``, ``n_kv_heads``
    (default n_heads) and ``head_dim`` (default dim // n_heads) of the model args, else of the
    first module in a block that has them; where nothing says, TP and CP are excluded. Used
    for the TP degree checks and the CP costs."""
    rope_buffer: str | None = None
    """Model buffer passed to every block as its second positional argument. None: the block's
    inputs are captured from one forward of the model on the meta device (any signature)."""
    block_args: int | None = None
    """Positional arguments the model passes to each block (hidden states first); None:
    counted from the block's forward signature. Used where tp ranks split a block's batch."""
    sub_blocks: tuple[tuple[str, str], ...] = ()
    """(norm, module) of a dense block's attention and of its feed-forward, relative to the
    block, in that order: the modules the tp modes of ``SUB_BLOCK_TP_MODES`` parallelize on
    their own (each module's input is its norm's output; the block adds it to the residual
    stream). Empty: those modes are not offered for the family."""
    moe_sub_block_modes: tuple[str, ...] | None = None
    """The MoE blocks' sub-block modes (of ``layout.MOE_SUB_BLOCK_MODES``) the family takes
    where its release applies them; None: ``layout.MOE_SHARED_DP`` alone (the MoE data
    parallel on each tp rank's tokens asks nothing of the block's other modules; a family
    whose attention a release runs on a batch shard lists ``MOE_ATTENTION_DP`` too)."""
    tp_fn: FnRef | None = None
    """Function applying the family's TP + sequence-parallel plan, called as
    ``tp_fn(model, tp_mesh, loss_parallel=..., enable_float8_tensorwise_tp=...,
    [cp_enabled=...], **tp_kwargs)`` on a module holding ``embedding``, ``final_norm``,
    ``output`` and the blocks to parallelize under their own names (TorchTitan's ``apply_tp``
    convention: the residual stream is sequence-sharded, Shard(1), between blocks). None:
    discovered (the train spec's ``apply_tp`` / ``apply_non_moe_tp``), else inferred from the
    blocks (``graph/tp_infer.py``); ``INFER_TP``: inferred even where one is discovered. Where
    inference fails, TP (and the tp dim used as data parallel) is excluded from the search,
    with the reason."""
    tp_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``tp_fn``."""
    op_sac_save_list: FnRef | set[Any] | None = None
    """Ops whose outputs selective (op-level) AC keeps. Discovered: ``_op_sac_save_list`` next
    to the train spec's parallelize function; else TorchTitan's llama3 list
    (``DEFAULT_SAC_SAVE_LIST``: matmuls, attention kernels, reduce-scatter, max). To leave
    selective AC out, name it in ``excluded`` (``{"selective_ac": "<reason>"}``)."""
    inner_attention: str | None = None
    """Module in a block that calls SDPA / flex attention (what context parallel wraps).
    Discovered: TorchTitan's attention wrapper inside the first block; else context parallel
    is excluded."""
    cp_attention: tuple[str, ...] = ("sdpa", "flex")
    """Attention kernels the family's context parallel supports."""
    cp_fn: FnRef | None = None
    """Function applying context parallel, called as ``cp_fn(model, blocks, cp_mesh)`` with
    the model's blocks (TorchTitan's trainer shards tokens, labels and ``positions``). None:
    TorchTitan's ``apply_cp_to_attention_module`` on ``inner_attention``; where that is None
    too, found from the block graph (``graph/cp_find.py``: causal SDPA called inline, the
    rotary table cut to each rank's positions), else context parallel is excluded with what
    was found."""
    moe: str | None = None
    """Submodule of an MoE block holding router, routed experts and shared experts
    (TorchTitan's ``models.moe.MoE``); blocks without it are dense. Discovered: the first
    ``MoE`` instance in a block."""
    experts: str = "experts"
    """The routed experts inside ``moe`` (the grouped-GEMM module taking the routed tokens and
    the tokens per expert): TorchTitan 0.2.2's ``experts``, 0.3.0's
    ``routed_experts.inner_experts``."""
    moe_fn: FnRef | None = None
    """Function applying EP / ETP / TP to the MoE blocks (TorchTitan's ``apply_moe_ep_tp``
    signature). Discovered: ``apply_moe_ep_tp`` next to the train spec's parallelize
    function; else, on an MoE model, expert parallel and TP are excluded."""
    default_pins: tuple[str, ...] | None = None
    """Module globs always left to TorchTitan's code. Discovered: the MoE router."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Techniques the family cannot run whatever is found, with the reason the plan table
    shows (e.g. ``{"cp": "..."}``)."""
    tp_checked: bool = False
    """Offer ``tp_fn`` only where TP inference (``graph/tp_infer.py``) also succeeds on the
    blocks: for a ``tp_fn`` written for some models of a family and not others (TorchTitan
    0.2.2's HF backend, whose plan names Llama's projections and shards per-head norms only);
    where inference fails, TP is excluded with its reason."""
    declared_tp: FnRef | None = None
    """``(model, blocks) -> {block signature: {linear name: "colwise" | "rowwise" |
    "replicate"}}``: the TP a model declares on its own modules (TorchTitan 0.3.0's
    ``sharding_config``, which ``model.parallelize`` applies), taken in place of inference
    where set."""
    forward_kwargs: FnRef | None = None
    """``seq_len -> {name: value}``: keyword inputs the model's forward needs for a plain text
    sequence (qwen3_5: token positions, special token ids), given when its blocks' inputs
    are captured on meta."""
    meta_forwards: dict[str, FnRef] = field(default_factory=dict)
    """Module class name -> forward run in its place when blocks are measured on meta, for
    kernels that cannot run there (fla's Triton linear-attention kernels): the same FLOPs and
    the tensors the real kernel saves for backward."""
    encoders: dict[str, FnRef] = field(default_factory=dict)
    """Modules outside the decoder that feed its embedding (vision encoders) -> a function
    ``(module, seq_len) -> EncoderWork`` measuring one sequence's work on meta. Each is a
    layer of kind "encoder" in the graph, sharded by FSDP beside the embedding."""

    def routed_experts(self, block: Any) -> Any:
        """The block's routed experts module, or None for a dense block."""
        moe = submodule_or_none(block, self.moe) if self.moe else None
        return submodule_or_none(moe, self.experts) if moe is not None else None

    def top_k(self, block: Any) -> int:
        return int(block.get_submodule(self.moe).router.top_k)

    def exclusions(self, moe_model: bool, heads_known: bool) -> dict[str, str]:
        """Techniques this adapter cannot apply, with the reason and the field that enables
        them (the planner leaves them out of the search and the plan table lists them)."""
        out: dict[str, str] = {}
        if self.tp_fn is None:
            out["tp"] = "no TP plan for this family; register one to enable (ModelAdapter.tp_fn)"
        elif moe_model and self.moe_fn is None:
            out["tp"] = ("no TP plan for the MoE blocks; register one to enable "
                         "(ModelAdapter.moe_fn)")
        elif not heads_known:
            out["tp"] = ("attention head counts unknown; register them to enable "
                         "(ModelAdapter.heads)")
        if "tp" in out:
            out["tp_dp"] = "needs tp (see above)"
        if self.inner_attention is None and self.cp_fn is None:
            out["cp"] = ("no attention module known for ring attention; register one to "
                         "enable (ModelAdapter.inner_attention)")
        elif not heads_known:
            out["cp"] = "attention head counts unknown (ModelAdapter.heads)"
        if moe_model and self.moe_fn is None:
            out["ep"] = ("no expert-parallel function for this family; register one to enable "
                         "(ModelAdapter.moe_fn)")
        out.update(self.excluded)
        if "tp" in self.excluded:
            out.setdefault("tp_dp", "needs tp (see above)")
        return out

    def apply_tp(self, model: Any, tp_mesh: Any, loss_parallel: bool,
                 block_names: list[str], cp_enabled: bool = False,
                 enable_float8_tensorwise_tp: bool = False, embedding: bool = True,
                 stand_ins: dict[str, Any] | None = None, **options: Any) -> None:
        """The family's TP + SP plan for the embedding (unless ``embedding`` is False), the
        output and the named blocks only.

        ``tp_fn`` parallelizes ``model.<embedding/norm/output>`` and every block in
        ``model.<blocks>``; it is handed a container holding the same modules but only the
        chosen blocks, so the other blocks keep their own placement (``stand_ins``: by block
        name, what it is handed in place of the block). ``cp_enabled`` and ``options`` are
        passed where ``tp_fn`` takes them."""
        import torch.nn as nn

        view = nn.Module()
        for name in (self.embedding if embedding else None, self.final_norm, self.output):
            # a pipeline stage holds the embedding, the norm + output, or neither
            module = submodule_or_none(model, name) if name else None
            if module is not None:
                _set_submodule(view, name, module)
        _set_submodule(view, self.blocks,
                       _blocks_like(model.get_submodule(self.blocks), block_names, stand_ins))
        view.model_args = getattr(model, "model_args", None)
        fn = resolve(self.tp_fn)
        accepted = inspect.signature(fn).parameters
        kwargs = {k: v for k, v in {"cp_enabled": cp_enabled, "enable_async_tp": False,
                                    **options}.items() if k in accepted}
        kwargs.update(self.tp_kwargs)
        with warnings.catch_warnings():
            # a pipeline stage lacks the embedding or the norm + output the TP plan names
            warnings.filterwarnings("ignore", message="Parallelize plan key")
            fn(view, tp_mesh, loss_parallel=loss_parallel,
               enable_float8_tensorwise_tp=enable_float8_tensorwise_tp, **kwargs)

    def apply_moe(self, model: Any, parallel_dims: Any, dual_pipe_v: bool = False,
                  block_names: list[str] | None = None, tp: bool = True) -> None:
        """EP / ETP / TP for the MoE blocks (router, token dispatch, experts, shared
        experts) named (all where None), on the job's ep / etp / tp meshes (``tp`` False:
        no TP, the experts expert parallel alone); ``dual_pipe_v``: TorchTitan's DualPipeV
        expert parallel (its all-to-all overlapped by the schedule), where ``moe_fn`` takes
        it."""
        import torch.nn as nn

        view = nn.Module()
        blocks = model.get_submodule(self.blocks)
        _set_submodule(view, self.blocks, blocks if block_names is None
                       else _blocks_like(blocks, block_names))
        fn = resolve(self.moe_fn)
        # the families' TorchTitan functions differ: gpt_oss takes ``etp_enabled`` where the
        # others take an ``etp_mesh``; each gets the arguments it names
        offered = {
            "tp_mesh": parallel_dims.get_optional_mesh("tp") if tp else None,
            "ep_mesh": parallel_dims.get_optional_mesh("ep"),
            "etp_mesh": parallel_dims.get_optional_mesh("etp"),
            "ep_etp_mesh": parallel_dims.get_optional_mesh(["ep", "etp"]),
            "etp_enabled": parallel_dims.etp_enabled,
            **({"dual_pipe_v": True} if dual_pipe_v else {}),
        }
        taken = inspect.signature(fn).parameters
        fn(view, **{k: v for k, v in offered.items() if k in taken})

    def sac_save_list(self) -> set:
        """The ops selective AC saves: the adapter's list, else ``DEFAULT_SAC_SAVE_LIST``."""
        ops = self.op_sac_save_list
        return resolve(DEFAULT_SAC_SAVE_LIST if ops is None else ops)


def submodule_or_none(module: Any, name: str) -> Any:
    """``module.get_submodule(name)``, or None where there is no such module (or only the
    ``nn.Identity`` a pipeline stage of TorchTitan's HF backend leaves in its place)."""
    import torch.nn as nn

    try:
        found = module.get_submodule(name)
    except AttributeError:
        return None
    return None if isinstance(found, nn.Identity) else found


def _blocks_like(blocks: Any, names: list[str], stand_ins: dict[str, Any] | None = None
                 ) -> Any:
    """A container of ``blocks``' kind holding the named blocks only (the same modules, or
    their ``stand_ins``)."""
    import torch.nn as nn

    stand_ins = stand_ins or {}
    chosen = [stand_ins[n] if n in stand_ins else blocks.get_submodule(n) for n in names]
    if isinstance(blocks, nn.ModuleList):
        return nn.ModuleList(chosen)
    # the model's own dict type: TorchTitan's HF backend iterates its blocks' values
    # (``SliceableModuleDict``), a plain ModuleDict would yield their names
    by_name = dict(zip(names, chosen, strict=True))
    try:
        return type(blocks)(by_name)
    except TypeError:
        return nn.ModuleDict(by_name)


def _set_submodule(root: Any, fqn: str, module: Any) -> None:
    """``root.<fqn> = module``, creating empty containers for dotted names."""
    import torch.nn as nn

    *parents, leaf = fqn.split(".")
    for part in parents:
        if not hasattr(root, part):
            setattr(root, part, nn.Module())
        root = getattr(root, part)
    setattr(root, leaf, module)


_ADAPTERS: dict[str, ModelAdapter] = {}


def register_adapter(name: str, adapter: ModelAdapter, replace: bool = False) -> None:
    """Make ``adapter`` the one used for train spec ``name`` (``model.name``). Registering an
    equal adapter again is a no-op; a different one needs ``replace=True``."""
    if not isinstance(adapter, ModelAdapter):
        raise UserError(f"register_adapter({name!r}, ...) needs a ModelAdapter, got "
                        f"{type(adapter).__name__}")
    if name in _ADAPTERS and _ADAPTERS[name] != adapter and not replace:
        raise UserError(f"an adapter for {name!r} is already registered: pass replace=True to "
                        "register_adapter to override it")
    _ADAPTERS[name] = adapter


def registered_adapter(name: str) -> ModelAdapter | None:
    """The adapter registered for train spec ``name`` (TorchTitan's families are registered
    when the package is imported), or None."""
    return _ADAPTERS.get(name)
