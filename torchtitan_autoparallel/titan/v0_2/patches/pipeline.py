"""Pipeline-parallel steps with the same gradients as every other step.

Upstream: TorchTitan 0.2.2 builds its pipeline schedule with the loss function that returns
each micro-batch's loss *sum* and ``scale_grads=False``, so the schedule back-propagates
sums; the non-PP step back-propagates ``sum / global valid tokens``. PP gradients therefore
come out (global valid tokens) times larger: the llama3 debug recipe with pp 2 logs a step-1
gradient norm of ~1,960 against 0.478 without PP, and with clipping and AdamW's epsilon the
losses drift apart. Here the schedule's loss function divides by the step's global valid
token count (set before each schedule step), and the step's reported loss is scaled back so
it stays ``sum / global valid tokens`` as TorchTitan logs it. The loss lives on the last
stage; ``last_stage_loss`` hands its value to every rank for the metrics file and the console
log. Tested by tests/test_pipeline_loss.py (PP recipe vs one rank: losses and gradient norms)
and tests/test_pipeline_parity.py (the loss the default log rank prints under pp x dp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class StepNormalizedLoss:
    """The schedule's loss function divided by the current step's global valid tokens."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.divisor: torch.Tensor | float = 1.0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss_fn(*args, **kwargs) / self.divisor


def normalize_schedule_loss(trainer: Any) -> StepNormalizedLoss | None:
    """Wrap the PP schedule's loss function of ``trainer`` (None without PP)."""
    schedule = getattr(trainer, "pp_schedule", None)
    if schedule is None or getattr(schedule, "_loss_fn", None) is None:
        return None
    if isinstance(schedule._loss_fn, StepNormalizedLoss):
        return schedule._loss_fn
    wrapped = StepNormalizedLoss(schedule._loss_fn)
    schedule._loss_fn = wrapped
    return wrapped


def pipeline_step(trainer: Any, step: Callable[..., torch.Tensor], **kwargs: Any
                  ) -> torch.Tensor:
    """Run TorchTitan's PP ``forward_backward_step`` with the normalised schedule loss and
    return the loss TorchTitan would report (``sum / global valid tokens``)."""
    wrapped = normalize_schedule_loss(trainer)
    tokens = kwargs["global_valid_tokens"]
    wrapped.divisor = tokens
    loss = step(**kwargs)
    # the schedule's losses are already divided once; TorchTitan divides their sum again
    # with data parallel TorchTitan hands the count over as a number, else as a tensor
    tokens = torch.as_tensor(tokens, dtype=loss.dtype, device=loss.device)
    return loss * tokens if trainer.pp_has_last_stage else loss


def last_stage_loss(loss: float, parallel_dims: Any) -> float:
    """The step's loss on every rank: non-last stages hold a negative placeholder (-1, summed
    over data parallel: rank 0 of pp x dp 2 logged -2.0), so the maximum over the pp group is
    the last stage's value. The trainer logs this on every rank."""
    if not parallel_dims.pp_enabled:
        return loss
    import torch.distributed as dist

    value = torch.tensor([float(loss)], dtype=torch.float64)
    group = parallel_dims.get_mesh("pp").get_group()
    if dist.get_backend(group) == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def drop_loss_visibility_warning() -> None:
    """TorchTitan 0.2.2 warns under PP unless LOG_RANK includes the last stage's first rank,
    the only one that logged the loss; the project's trainer logs ``last_stage_loss`` on every
    rank, so the advice no longer applies (idempotent)."""
    import torchtitan.train

    torchtitan.train.ensure_pp_loss_visible = lambda *args, **kwargs: None
