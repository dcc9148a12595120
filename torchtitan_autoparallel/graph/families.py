"""TorchTitan's four decoder families, registered through the public adapter API like any
user's model (``register_adapter``)."""

from typing import Any

from .adapters import INFER_TP, ModelAdapter, register_adapter


def _titan(family: str, name: str) -> str:
    """Dotted path of ``name`` in TorchTitan's parallelize module of ``family``."""
    return f"torchtitan.models.{family}.infra.parallelize.{name}"


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


def _family(family: str, tp_fn: str, **fields: Any) -> ModelAdapter:
    """A TorchTitan family: its TP plan (``INFER_TP``, or the name of its own TP function),
    its SAC list, TorchTitan's MoE EP / TP, its attention wrapper for CP, MoE routing left to
    TorchTitan (default pin)."""
    defaults: dict[str, Any] = {
        "blocks": "layers",
        "embedding": "tok_embeddings",
        "final_norm": "norm",
        "output": "output",
        "moe": "moe",
        "op_sac_save_list": _titan(family, "_op_sac_save_list"),
        "inner_attention": "attention.inner_attention",
        "moe_fn": _titan("llama4", "apply_moe_ep_tp"),
        "block_args": 4,
        "default_pins": ("*.moe.router",),
    }
    tp = tp_fn if tp_fn == INFER_TP else _titan(family, tp_fn)
    return ModelAdapter(tp_fn=tp, **{**defaults, **fields})


# TP: llama3 and llama4 use the inferred plan (``graph/tp_infer.py``), entry for entry the one
# their ``apply_tp`` / ``apply_non_moe_tp`` install, float8 tensorwise styles included, and
# those functions take no other option this project passes (async TP is
# ``maybe_enable_async_tp``'s, for any plan). qwen3 and deepseek_v3 keep TorchTitan's: under
# CP their attention's ``positions`` input becomes a replicated DTensor, which the inference
# (traced without positions) leaves alone; qwen3's attention kernel also gets DTensors there.
BUILTIN: dict[str, ModelAdapter] = {
    # layer(h, freqs_cis, attention_masks=..., positions=...)
    "llama3": _family("llama3", INFER_TP, rope_buffer="freqs_cis", heads=_llama_heads,
                      block_args=2, sub_blocks=(("attention_norm", "attention"),
                                                ("ffn_norm", "feed_forward"))),
    "qwen3": _family("qwen3", "apply_non_moe_tp", rope_buffer="rope_cache", heads=_qwen_heads),
    "llama4": _family("llama4", INFER_TP, rope_buffer="freqs_cis",
                      heads=_llama_heads, cp_attention=("sdpa",)),
    "deepseek_v3": _family("deepseek_v3", "apply_non_moe_tp", rope_buffer="freqs_cis",
                           heads=_mla_heads, cp_attention=("sdpa",)),
}

_HF = "torchtitan.experiments.transformers_modeling_backend"

# TorchTitan's HF backend (any HF causal LM): its model presents HF's ``model.model.layers`` /
# ``embed_tokens`` / ``norm`` / ``lm_head`` under TorchTitan's names (``named_children`` and
# properties), which its TP function and pipeline split use; blocks take keyword inputs
# (``position_embeddings``), captured on meta. Its TP function names Llama's projections and
# per-head q / k norms: offered where TP inference also shards the blocks (OLMo2's
# whole-projection norms, fused projections are not)
BUILTIN["transformers_modeling_backend"] = ModelAdapter(
    blocks="layers", embedding="tok_embeddings", final_norm="norm", output="output",
    tp_fn=f"{_HF}.infra.parallelize.apply_non_moe_tp", tp_checked=True,
    excluded={"cp": "HF attention is a function inside each attention module, not a module "
                    "ring attention can wrap (the backend's CP only shifts position ids)"},
)

for _name, _adapter in BUILTIN.items():
    register_adapter(_name, _adapter)
