"""The optimizer step's device time (``cost.common.optimizer_step_s``) against a brute-force
count of the bytes PyTorch's AdamW and gradient clipping move: every aten op they dispatch
is intercepted, each distinct tensor it reads counted once and each tensor it writes (a new
output, or an argument whose contents it changed) once. The count runs on CPU tensors: it
measures the ops' operands, not a device's kernels."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchtitan_autoparallel.cost.common import (
    STATE_BYTES_PER_PARAM,
    CostContext,
    Precision,
    optimizer_step_s,
)
from torchtitan_autoparallel.cost.hardware import CPU_PROFILE, load_profile
from torchtitan_autoparallel.job.features import EAGER

NUMEL = 4096
PARAMS = 3


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` that are arrays (scalar steps and norms left out)."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.numel() > 1]


class ByteCount(TorchDispatchMode):
    """Bytes read and written by the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = {t.data_ptr(): t for t in _tensors((args, kwargs))}
        written = [
            t for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
            for t in _tensors(args[i] if i < len(args) else kwargs.get(a.name))]
        before = [t.clone() for t in written]
        out = func(*args, **kwargs)
        self.bytes += sum(t.numel() * t.element_size() for t in inputs.values())
        self.bytes += sum(t.numel() * t.element_size()
                          for t, old in zip(written, before, strict=True)
                          if not torch.equal(t, old))
        self.bytes += sum(t.numel() * t.element_size() for t in _tensors(out)
                          if t.data_ptr() not in inputs)
        return out


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(PARAMS)]
    for p in params:
        p.grad = torch.randn(NUMEL)
    return params


def counted_bytes_per_param(implementation: str) -> float:
    """Bytes per fp32 parameter of TorchTitan's per-step work after backward: gradient
    clipping (train.py: clip_grad_norm_ with foreach=True; the gradients' norm is far above
    max_norm 1.0, so the scaling changes every gradient) and an AdamW step (its state made by
    a first step outside the count)."""
    params = _params()
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True},
             "for-loop": {"foreach": False}}[implementation]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **flags)
    opt.step()
    count = ByteCount()
    with count:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
    return count.bytes / (PARAMS * NUMEL)


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_optimizer_step_bytes_match_a_count_of_the_ops(implementation: str) -> None:
    hw = load_profile("h100_sxm")
    ctx = CostContext(hw=hw, prec=Precision(2, 4), gpus_per_node=8,
                      features=dataclasses.replace(EAGER, optimizer=implementation))
    params = 1e9
    modeled = optimizer_step_s(params * STATE_BYTES_PER_PARAM, ctx) * hw.hbm_gbps * 1e9 / params
    assert modeled == pytest.approx(counted_bytes_per_param(implementation), rel=0.01)


def test_no_device_optimizer_step_with_cpu_offload_or_without_hbm() -> None:
    gpu = CostContext(hw=load_profile("b200"), prec=Precision(2, 4), gpus_per_node=8,
                      features=dataclasses.replace(EAGER, cpu_offload=True))
    cpu = CostContext(hw=load_profile(CPU_PROFILE), prec=Precision(), gpus_per_node=8)
    assert optimizer_step_s(1e9, gpu) == 0.0
    assert optimizer_step_s(1e9, cpu) == 0.0
