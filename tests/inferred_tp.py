"""TorchTitan's four families with their TP functions taken away (``experimental.custom_import
= "tests.inferred_tp"``): their TP plans are the inferred ones (graph/tp_infer.py); MoE blocks
keep TorchTitan's expert / MoE TP (``moe_fn``)."""

import dataclasses

from torchtitan_autoparallel import register_adapter
from torchtitan_autoparallel.graph.families import BUILTIN

for _family in ("llama3", "qwen3", "llama4", "deepseek_v3"):
    register_adapter(_family, dataclasses.replace(BUILTIN[_family], tp_fn=None), replace=True)
