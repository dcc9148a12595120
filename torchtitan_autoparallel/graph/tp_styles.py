"""Tensor-parallel styles as plain data (``Style``), the ``ParallelStyle`` objects they stand for,
and the TP function built from inferred block plans (``InferredTP``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn


@dataclass(frozen=True)
class Style:
    """One ``parallelize_module`` entry, as plain data (built by ``build_style``)."""

    kind: str
    """"colwise", "rowwise", "sequence", "prepare" (module input), "replicate" (NoParallel)."""
    local_output: bool = True
    sequence_dim: int = 1
    inputs: tuple[str | None, ...] = ()
    """prepare: per positional argument "shard:<d>", "replicate" or None (left alone)."""
    desired: tuple[str | None, ...] = ()


SEQUENCE_DIM = 1
"""The dim of the residual stream (batch, sequence, hidden) TorchTitan's SP shards."""


def _placement(layout: str | None, stream: int | None = SEQUENCE_DIM) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if layout is None:
        return None
    if layout == "replicate":
        return Replicate()
    dim = int(layout.split(":")[1])
    if dim != SEQUENCE_DIM:
        return Shard(dim)
    return Replicate() if stream is None else Shard(stream)


def stream_placement(stream: int | None) -> Any:
    """The residual stream's placement over tp: ``Shard(stream)``, or ``Replicate()`` for a
    stream whole on every tp rank (None: tensor parallel without sequence parallel)."""
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if stream is None else Shard(stream)


def build_style(style: Style, float8: bool = False, stream: int | None = SEQUENCE_DIM) -> Any:
    """The ``ParallelStyle`` object ``style`` describes (torchao's float8 styles for the
    projections and module inputs with ``float8``, as TorchTitan's ``apply_tp``); ``stream``:
    the dim the residual stream is sharded on between modules (1, the sequence, as
    TorchTitan's SP; 0 for a stream sharded on the batch; None for a stream whole on every
    tp rank, TP without SP), where the inferred plan reads TorchTitan's sequence dim. None
    where the module runs on its own under ``stream`` None (a sequence-parallel norm)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise = Float8ColwiseParallel, Float8RowwiseParallel
        prepare = PrepareFloat8ModuleInput
    if style.kind == "colwise":
        return colwise(use_local_output=style.local_output)
    if style.kind == "rowwise":
        return rowwise(output_layouts=stream_placement(stream))
    if style.kind == "sequence":
        if stream is None and style.sequence_dim == SEQUENCE_DIM:
            return None
        dim = stream if style.sequence_dim == SEQUENCE_DIM else style.sequence_dim
        return SequenceParallel(sequence_dim=dim, use_local_output=style.local_output)
    if style.kind == "replicate":
        from torchtitan.distributed import NoParallel

        return NoParallel(use_local_output=style.local_output)
    # a module's input: the projections' module gets the float8 kind, an attention kernel not
    kind = prepare if style.desired and style.desired[0] == "replicate" else PrepareModuleInput
    return kind(input_layouts=tuple(_placement(p, stream) for p in style.inputs),
                desired_input_layouts=tuple(_placement(p, stream) for p in style.desired),
                use_local_output=style.local_output)


def block_signature(block: nn.Module) -> str:
    """Blocks with equal signatures get the same plan."""
    shapes = ",".join(f"{n}:{tuple(p.shape)}" for n, p in block.named_parameters())
    return f"{type(block).__name__}[{shapes}]"


@dataclass(frozen=True)
class InferredTP:
    """A family's TP function built from the inferred block plans, with TorchTitan's
    embedding / final norm / output styles (``apply_tp``)."""

    embedding: str | None
    final_norm: str | None
    output: str | None
    blocks: str
    plans: dict[str, dict[str, Style]]
    """Block signature -> plan."""

    def top_styles(self, model: nn.Module, loss_parallel: bool,
                   stream: int | None = SEQUENCE_DIM) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        present = {n for n, _ in model.named_modules()}
        styles = {
            self.embedding: RowwiseParallel(input_layouts=Replicate(),
                                            output_layouts=stream_placement(stream)),
            # on a replicated stream the final norm runs whole on every tp rank
            self.final_norm: None if stream is None else SequenceParallel(sequence_dim=stream),
            self.output: ColwiseParallel(input_layouts=stream_placement(stream),
                                         output_layouts=Shard(-1) if loss_parallel
                                         else Replicate(),
                                         use_local_output=not loss_parallel),
        }
        return {k: v for k, v in styles.items() if k and k in present and v is not None}

    def block_styles(self, block: nn.Module, float8: bool = False,
                     stream: int | None = SEQUENCE_DIM) -> dict[str, Any]:
        plan = self.plans.get(block_signature(block))
        if plan is None:
            raise KeyError(f"no inferred TP plan for a {type(block).__name__} block with "
                           "these parameter shapes")
        styles = {name: build_style(style, float8, stream) for name, style in plan.items()}
        return {name: style for name, style in styles.items() if style is not None}

    def __call__(self, model: nn.Module, tp_mesh: Any, loss_parallel: bool,
                 enable_float8_tensorwise_tp: bool = False, stream: int | None = SEQUENCE_DIM
                 ) -> None:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchtitan.tools.logging import logger

        parallelize_module(model, tp_mesh, self.top_styles(model, loss_parallel, stream))
        blocks = list(model.get_submodule(self.blocks).children())
        for block in blocks:
            parallelize_module(block, tp_mesh,
                               self.block_styles(block, enable_float8_tensorwise_tp, stream))
        kind = "float8 tensorwise " if enable_float8_tensorwise_tp else ""
        logger.info(f"applied the inferred {kind}tensor-parallel plan to {len(blocks)} blocks")
