"""TorchTitan 0.3.0: Python config registries (``--module`` / ``--config``), tyro overrides,
``Trainer.Config``, sharding declared on the model."""

from __future__ import annotations

import sys
from typing import Any

from ...candidates.layout import MOE_SUB_BLOCK_MODES
from ...frontend import Frontend, register_frontend
from ...graph.adapters import ModelAdapter, register_adapter
from . import quiet, triton_keys  # noqa: F401  before TorchTitan is imported
from .config import parse_job
from .job import Job, job_of
from .model import HF_BACKEND, family_module, read_model
from .multimodal import qwen35_heads
from .tp_dp import ATTENTION_DP_FAMILIES, SUB_BLOCKS, SUB_BLOCKS_APPLIED, TP_DP_FAMILIES

PARALLELIZE = {"llama3": "parallelize_llama", "qwen3": "parallelize_qwen3",
               "qwen3_5": "parallelize_qwen3_5", "deepseek_v3": "parallelize_deepseekv3",
               "gpt_oss": "parallelize_gptoss", "kimi_k2_7": "parallelize_kimi_k2_5"}
"""TorchTitan 0.3.0's decoder families (its ``torchtitan.models``, flux and muse_glimmer
aside: not decoders of tokens) and the function that parallelizes each: it applies the
sharding the model declares (``Module.parallelize(parallel_dims)``: TP, and EP on the routed
experts), then FSDP."""


def attention_types() -> tuple[type, ...]:
    from torchtitan.models.common import attention

    return (attention.FlexAttention, attention.ScaledDotProductAttention,
            attention.VarlenAttention)


def moe_types() -> tuple[type, ...]:
    from torchtitan.models.common.moe import MoE

    return (MoE,)


def parallelize_module(name: str) -> Any:
    """The module of family ``name``'s ``parallelize`` functions (None for a model that is no
    TorchTitan family)."""
    try:
        module = family_module(name)
    except Exception:
        return None
    return sys.modules.get(f"{module.__name__}.parallelize")


def read_job(argv: list[str]) -> Job:
    """``--module M --config FUNCTION [overrides]`` -> the planner's view of the job (read
    offline: no device check while the config is read, see ``cpu.planning_without_device``)."""
    from .cpu import planning_without_device

    with planning_without_device():
        return job_of(parse_job(argv))


def model_names() -> list[str]:
    """TorchTitan 0.3.0's model families and its HF backend."""
    from torchtitan.models import _supported_models

    return sorted({*_supported_models, HF_BACKEND})


def prepare_models(custom_import: str) -> None:
    """The user's module imported (0.3.0's families need no registration)."""
    if custom_import:
        import importlib

        importlib.import_module(custom_import)


register_frontend(Frontend(release="0.3", read_model=read_model, attention_types=attention_types,
                           moe_types=moe_types, parallelize_module=parallelize_module,
                           model_names=model_names, prepare_models=prepare_models,
                           node_reshard=False, sub_block_modes=SUB_BLOCKS_APPLIED,
                           moe_sub_block_modes=MOE_SUB_BLOCK_MODES,
                           moe_routed_on_shard=True, read_job=read_job))
# 0.3.0's modules are read by discovery (names, TP inferred from the blocks), not by the 0.2.2
# families' adapters (other module names, a rope buffer 0.3.0 does not have)
# The tp dim used as data parallel (a whole block, or its attention / feed-forward under
# tp_sub_block) is applied to the dense families whose blocks have tp_dp.SUB_BLOCKS
# (titan/v0_3/tp_dp.py); the multimodal families and the HF backend keep every block TP + SP.
NOT_APPLIED = {"tp_dp": "TorchTitan 0.3.0's apply runs the tp dim as data parallel on "
                        f"{' and '.join(TP_DP_FAMILIES)} only (dense text decoders)"}
_MULTIMODAL = "torchtitan_autoparallel.titan.v0_3.multimodal"
MULTIMODAL = {
    # Gated DeltaNet layers (fla's Triton kernel measured through a stand-in), multimodal
    # RoPE positions, a vision encoder; its parallelize refuses context parallel
    "qwen3_5": {"forward_kwargs": f"{_MULTIMODAL}.text_inputs", "heads": qwen35_heads,
                "declared_tp": f"{_MULTIMODAL}.declared_tp",
                "meta_forwards": {"GatedDeltaKernel": f"{_MULTIMODAL}.gated_delta_on_meta"},
                "encoders": {"vision_encoder": f"{_MULTIMODAL}.vision_encoder_work"},
                "cp": "TorchTitan 0.3.0's parallelize_qwen3_5 refuses context parallel "
                      "(Gated DeltaNet needs the full sequence)"},
    # Kimi K2.5's MoonViT3d encoder (Moonlight has none); parallelize_kimi_k2_5 refuses CP
    "kimi_k2_7": {"encoders": {"vision_encoder": f"{_MULTIMODAL}.vision_encoder_work"},
                  "cp": "TorchTitan 0.3.0's parallelize_kimi_k2_5 refuses context parallel "
                        "(the vision scatter needs the full sequence)"},
}
"""Per family: what reading its multimodal / hybrid models on meta takes, and the context
parallel its ``parallelize`` refuses."""
for _family, _fn in PARALLELIZE.items():
    _extra = dict(MULTIMODAL.get(_family, {}))
    _cp = _extra.pop("cp", None)
    _tp_dp = _family in TP_DP_FAMILIES
    register_adapter(_family, ModelAdapter(
        experts="routed_experts.inner_experts",
        moe_fn=f"torchtitan.models.{_family}.parallelize.{_fn}",
        sub_blocks=SUB_BLOCKS if _tp_dp else (),
        moe_sub_block_modes=MOE_SUB_BLOCK_MODES if _family in ATTENTION_DP_FAMILIES else None,
        excluded={**({} if _tp_dp else NOT_APPLIED), **({"cp": _cp} if _cp else {})},
        **_extra), replace=True)
# The HF backend's model presents HF's layers as TorchTitan's names (``layers``,
# ``tok_embeddings``, ``norm``) and keeps HF's ``lm_head``; TP comes from the sharding the
# backend declares (``set_hf_sharding_configs``) through ``model.parallelize``
register_adapter(HF_BACKEND, ModelAdapter(
    blocks="layers", embedding="tok_embeddings", final_norm="norm", output="lm_head",
    experts="moe.routed_experts.inner_experts", excluded={
        **NOT_APPLIED,
        "cp": "the HF backend runs context parallel with FlexAttention only (a flex BlockMask "
              "sharded by the ptrr balancer), which the planner does not cost"}), replace=True)

