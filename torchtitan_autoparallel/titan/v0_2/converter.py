"""The ``autoparallel`` model converter (``register_model_converter``).

TorchTitan runs converters on the meta model before its parallelize function. This one checks
that the job's plan describes this model and attaches the plan to it; the project's train specs
then apply the plan in place of the family's parallelize function (``apply.apply_plan``).
"""

from typing import Any

import torch.nn as nn

from ...errors import UserError
from ...graph.adapters import submodule_or_none
from ...plan.schema import Plan

NAME = "autoparallel"
PLAN_ATTR = "_autoparallel_plan"


def job_plan(job_config: Any) -> Plan | None:
    """The plan the entrypoint prepared for this job (attached to the job config)."""
    return getattr(job_config, PLAN_ATTR, None)


class AutoparallelConverter:
    """Model converter: attach the job's plan to the (meta) model after checking it fits."""

    def __init__(self, job_config: Any, parallel_dims: Any) -> None:
        self.plan = job_plan(job_config)
        if self.plan is None:
            raise UserError(
                "model converter 'autoparallel' needs parallelism.auto = true "
                "(or autoparallel.plan_file); launch through run_train.sh"
            )

    def convert(self, model: nn.Module) -> None:
        plan_blocks = sum(1 for layer in self.plan.layers if layer.kind == "block")
        missing = [layer.fqn for layer in self.plan.layers
                   if submodule_or_none(model, layer.fqn) is None]
        if missing:
            raise UserError(
                f"the plan names modules this model does not have ({missing[:3]}...; "
                f"{plan_blocks} blocks planned); re-plan for this model"
            )
        setattr(model, PLAN_ATTR, self.plan)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        return None


def register_converter() -> None:
    from torchtitan.protocols.model_converter import (
        _registry_model_converter_cls,
        register_model_converter,
    )

    if NAME not in _registry_model_converter_cls:
        register_model_converter(AutoparallelConverter, NAME)  # type: ignore[arg-type]
