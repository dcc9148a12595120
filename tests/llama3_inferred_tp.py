"""TorchTitan's llama3 with its TP function taken away (``experimental.custom_import =
"tests.llama3_inferred_tp"``): its TP plan is the inferred one (graph/tp_infer.py)."""

import dataclasses

from torchtitan_autoparallel import register_adapter
from torchtitan_autoparallel.graph.families import BUILTIN

register_adapter("llama3", dataclasses.replace(BUILTIN["llama3"], tp_fn=None), replace=True)
