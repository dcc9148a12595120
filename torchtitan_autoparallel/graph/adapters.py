"""Per-model-family knowledge, one small adapter each: where the blocks are, head counts, and
which TorchTitan helpers parallelize the family. Adding a family is adding one entry."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _titan(family: str, name: str) -> str:
    """Dotted path of ``name`` in TorchTitan's parallelize module of ``family``."""
    return f"torchtitan.models.{family}.infra.parallelize.{name}"


@dataclass(frozen=True)
class FamilyAdapter:
    """How the planner and the applier see one TorchTitan model family."""

    family: str
    rope_buffer: str
    """Model buffer passed to every block as its second argument (RoPE table)."""
    tp_fn: str
    """TorchTitan function applying the family's TP + SP plan (import path)."""
    op_sac_save_list: str
    """The family's selective-AC op save list (import path)."""
    head_dims: Callable[[Any], tuple[int, int, int]]
    """model args -> (n_heads, n_kv_heads, head_dim)."""
    tp_kwargs: dict[str, Any] = field(default_factory=dict)
    blocks: str = "layers"
    embedding: str = "tok_embeddings"
    final_norm: str = "norm"
    output: str = "output"

    block_args: int = 4
    """Positional arguments the model passes to each block (hidden states first)."""
    inner_attention: str = "attention.inner_attention"
    """Module in a block that calls SDPA (what context parallel wraps)."""
    tp_takes_cp: bool = True
    """Whether the family's TP function takes ``cp_enabled``."""
    cp_attention: tuple[str, ...] = ("sdpa", "flex")
    """Attention kernels the family's context parallel supports."""
    moe: str = "moe"
    """Submodule of an MoE block holding router, routed experts and shared experts."""
    moe_fn: str = _titan("llama4", "apply_moe_ep_tp")
    """TorchTitan function applying EP / ETP / TP to the MoE blocks (import path)."""
    default_pins: tuple[str, ...] = ("*.moe.router",)
    """Regions always left to TorchTitan's code (routing and token dispatch)."""

    def routed_experts(self, block: Any) -> Any:
        """The block's routed experts module, or None for a dense block."""
        if not getattr(block, "moe_enabled", False):
            return None
        return block.get_submodule(self.moe).experts

    def top_k(self, block: Any) -> int:
        return int(block.get_submodule(self.moe).router.top_k)

    def apply_tp(self, model: Any, tp_mesh: Any, loss_parallel: bool,
                 block_names: list[str], cp_enabled: bool = False,
                 enable_float8_tensorwise_tp: bool = False) -> None:
        """TorchTitan's TP + SP plan for the embedding, the output and the named blocks only.

        The family's TorchTitan function parallelizes ``model.<embedding/norm/output>`` and
        every block in ``model.<blocks>``; it is handed a container holding the same modules but
        only the chosen blocks, so the other blocks keep their own placement.
        """
        import torch.nn as nn

        view = nn.Module()
        for name in (self.embedding, self.final_norm, self.output):
            setattr(view, name, model.get_submodule(name))
        blocks = model.get_submodule(self.blocks)
        setattr(view, self.blocks, nn.ModuleDict({n: blocks[n] for n in block_names}))
        view.model_args = getattr(model, "model_args", None)
        kwargs = dict(self.tp_kwargs)
        if self.tp_takes_cp:
            kwargs["cp_enabled"] = cp_enabled
        _resolve(self.tp_fn)(view, tp_mesh, loss_parallel=loss_parallel,
                             enable_float8_tensorwise_tp=enable_float8_tensorwise_tp, **kwargs)

    def apply_moe(self, model: Any, parallel_dims: Any) -> None:
        """TorchTitan's EP / ETP / TP for every MoE block (router, token dispatch, experts,
        shared experts), on the job's ep / etp / tp meshes."""
        import torch.nn as nn

        view = nn.Module()
        setattr(view, self.blocks, model.get_submodule(self.blocks))
        _resolve(self.moe_fn)(
            view,
            tp_mesh=parallel_dims.get_optional_mesh("tp"),
            ep_mesh=parallel_dims.get_optional_mesh("ep"),
            etp_mesh=parallel_dims.get_optional_mesh("etp"),
            ep_etp_mesh=parallel_dims.get_optional_mesh(["ep", "etp"]),
        )

    def sac_save_list(self) -> set:
        return _resolve(self.op_sac_save_list)


def _llama_heads(args: Any) -> tuple[int, int, int]:
    kv = args.n_kv_heads or args.n_heads
    return args.n_heads, kv, args.dim // args.n_heads


def _qwen_heads(args: Any) -> tuple[int, int, int]:
    kv = args.n_kv_heads or args.n_heads
    return args.n_heads, kv, args.head_dim


def _mla_heads(args: Any) -> tuple[int, int, int]:
    # multi-head latent attention: keys (nope + rope dims) and values (v dim) per head; the
    # mean of the two is what one K/V head costs in memory and ring-attention traffic
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    return args.n_heads, args.n_heads, (qk + args.v_head_dim) // 2


ADAPTERS: dict[str, FamilyAdapter] = {
    "llama3": FamilyAdapter(
        family="llama3",
        rope_buffer="freqs_cis",
        tp_fn=_titan("llama3", "apply_tp"),
        op_sac_save_list=_titan("llama3", "_op_sac_save_list"),
        head_dims=_llama_heads,
        block_args=2,  # layer(h, freqs_cis, attention_masks=..., positions=...)
    ),
    "qwen3": FamilyAdapter(
        family="qwen3",
        rope_buffer="rope_cache",
        tp_fn=_titan("qwen3", "apply_non_moe_tp"),
        op_sac_save_list=_titan("qwen3", "_op_sac_save_list"),
        head_dims=_qwen_heads,
        tp_kwargs={"enable_async_tp": False},
    ),
    "llama4": FamilyAdapter(
        family="llama4",
        rope_buffer="freqs_cis",
        tp_fn=_titan("llama4", "apply_non_moe_tp"),
        op_sac_save_list=_titan("llama4", "_op_sac_save_list"),
        head_dims=_llama_heads,
        tp_takes_cp=False,
        cp_attention=("sdpa",),
    ),
    "deepseek_v3": FamilyAdapter(
        family="deepseek_v3",
        rope_buffer="freqs_cis",
        tp_fn=_titan("deepseek_v3", "apply_non_moe_tp"),
        op_sac_save_list=_titan("deepseek_v3", "_op_sac_save_list"),
        head_dims=_mla_heads,
        cp_attention=("sdpa",),
    ),
}


def get_adapter(family: str) -> FamilyAdapter:
    if family not in ADAPTERS:
        raise UserError(
            f"auto parallelism does not support model {family!r} yet: supported families are "
            f"{sorted(ADAPTERS)}; set parallelism.auto = false to use TorchTitan's recipe"
        )
    return ADAPTERS[family]
