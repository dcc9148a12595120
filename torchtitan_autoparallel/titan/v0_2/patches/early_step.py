"""Gradient norms with ``optimizer.early_step_in_backward``.

Upstream: TorchTitan 0.2.2's ``OptimizersInBackwardContainer`` steps and zeroes each parameter
in its post-accumulate-grad hook, so when the trainer clips after backward no gradient is
left: it logs a gradient norm of 0.0 and clips nothing. Here each gradient's norm is recorded
just before its parameter steps (a hook placed ahead of the optimizer's), and the step's norm
is combined from those as TorchTitan combines the gradients' (per mesh, then across meshes).
Clipping cannot apply (the parameters have already stepped); a warning says so. The planner
keeps such jobs off DDP and gradient accumulation (``planning_inputs.early_step_constraints``).
Tested by tests/test_early_step.py (parity with the same job without the key).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .grad_norm import _combine, _mesh_key


class GradNormRecorder:
    """Norms of the gradients of one step, recorded before the optimizer consumes them."""

    def __init__(self, norm_type: float = 2.0) -> None:
        self.norm_type = norm_type
        self.norms: dict[Any, list[torch.Tensor]] = {}

    def __call__(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            norm = torch.linalg.vector_norm(param.grad.detach(), self.norm_type)
            self.norms.setdefault(_mesh_key(param.grad), []).append(norm)

    def total(self) -> torch.Tensor | None:
        """The step's total norm (None when nothing was recorded); clears the record."""
        if not self.norms:
            return None
        totals = []
        for norms in self.norms.values():
            total = torch.linalg.vector_norm(torch.stack(norms), self.norm_type)
            totals.append(total.full_tensor() if isinstance(total, DTensor) else total)
        self.norms = {}
        return totals[0] if len(totals) == 1 else _combine(totals, self.norm_type)


def _register_first(param: torch.Tensor, hook: Any) -> None:
    """Register ``hook`` to run before the post-accumulate-grad hooks ``param`` already has.
    The autograd engine walks the hook dict in its insertion order (an OrderedDict's
    ``move_to_end`` does not change that order), so the dict is refilled in place: the
    existing handles stay valid."""
    hooks = param._post_accumulate_grad_hooks
    earlier = list(hooks.items()) if hooks else []
    if hooks:
        hooks.clear()
    param.register_post_accumulate_grad_hook(hook)
    param._post_accumulate_grad_hooks.update(earlier)


def install(model_parts: list[torch.nn.Module], job_config: Any) -> GradNormRecorder | None:
    """With ``optimizer.early_step_in_backward``: record every gradient's norm ahead of the
    optimizer's hooks (registered by the trainer before this) and report their total as the
    step's gradient norm. None (nothing done) without the key."""
    if not job_config.optimizer.early_step_in_backward:
        return None
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.tools.logging import logger

    recorder = GradNormRecorder()
    for model in model_parts:
        for param in model.parameters():
            if param.requires_grad:
                _register_first(param, recorder)
    original = dist_utils.clip_grad_norm_

    def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                        *args: Any, **kwargs: Any) -> torch.Tensor:
        total = recorder.total()
        return original(parameters, max_norm, *args, **kwargs) if total is None else total

    dist_utils.clip_grad_norm_ = clip_grad_norm_
    max_norm = job_config.training.max_norm
    if max_norm > 0 and math.isfinite(max_norm):
        logger.warning(f"optimizer.early_step_in_backward: each parameter steps before the "
                       f"step's gradient norm is known, so training.max_norm = {max_norm:g} "
                       "clips nothing (as in TorchTitan); grad_norm is logged before the steps")
    return recorder
