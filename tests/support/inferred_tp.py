"""TorchTitan's four families with their TP functions replaced by the inferred plans
(``experimental.custom_import = "tests.support.inferred_tp"``; ``INFER_TP``: a plain ``tp_fn=None``
would let discovery find TorchTitan's ``apply_tp`` again; llama3 and llama4 use the inferred
plans already); MoE blocks keep TorchTitan's expert / MoE TP (``moe_fn``)."""

import dataclasses

from torchtitan_autoparallel import register_adapter
from torchtitan_autoparallel.graph.adapters import INFER_TP
from torchtitan_autoparallel.graph.families import BUILTIN

for _family in ("llama3", "qwen3", "llama4", "deepseek_v3"):
    register_adapter(_family, dataclasses.replace(BUILTIN[_family], tp_fn=INFER_TP), replace=True)
