"""A tiny flavor of TorchTitan's HF backend (``experimental.custom_import = "tests.hf_tiny"``):
the backend's flavors set dim, layers and heads over the HF config.json's (its own
``debugmodel`` is dim 256, 16 heads)."""

from torchtitan.experiments.transformers_modeling_backend import flavors
from torchtitan.experiments.transformers_modeling_backend.model.args import (
    HFTransformerModelArgs,
    TitanDenseModelArgs,
)

if "tiny" not in flavors:
    flavors["tiny"] = HFTransformerModelArgs(
        titan_dense_args=TitanDenseModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2))
