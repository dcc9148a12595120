"""llama3 and llama4 with TorchTitan's own TP functions (``apply_tp`` / ``apply_non_moe_tp``)
in place of the inferred plans their built-in adapters use
(``experimental.custom_import = "tests.support.titan_tp"``): the reference the inferred plans are
checked against."""

import dataclasses

from torchtitan_autoparallel import register_adapter
from torchtitan_autoparallel.graph.families import BUILTIN

OWN = {"llama3": "apply_tp", "llama4": "apply_non_moe_tp"}

for _family, _fn in OWN.items():
    register_adapter(_family, dataclasses.replace(
        BUILTIN[_family], tp_fn=f"torchtitan.models.{_family}.infra.parallelize.{_fn}"),
        replace=True)
