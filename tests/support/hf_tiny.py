"""A tiny flavor of TorchTitan's HF backend (``experimental.custom_import =
"tests.support.hf_tiny"``): the backend's flavors set dim, layers and heads over the HF
config.json's (its own ``debugmodel`` is dim 256, 16 heads)."""

from torchtitan.experiments.transformers_modeling_backend import flavors
from torchtitan.experiments.transformers_modeling_backend.model.args import (
    HFTransformerModelArgs,
    TitanDenseModelArgs,
)

if "tiny" not in flavors:
    flavors["tiny"] = HFTransformerModelArgs(
        titan_dense_args=TitanDenseModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2))

if "qwen2_7b" not in flavors:
    # Qwen2.5-7B's shape: dim 3584, 28 layers, 28 query / 4 kv heads, FFN 18944 (llama's
    # 8/3 x dim rule x 1.982, rounded up to 256), vocabulary 152064
    flavors["qwen2_7b"] = HFTransformerModelArgs(
        titan_dense_args=TitanDenseModelArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                                             vocab_size=152064, ffn_dim_multiplier=1.982))
