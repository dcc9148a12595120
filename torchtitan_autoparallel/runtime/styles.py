"""PyTorch ``ParallelStyle``s of this project's own placements (TorchTitan's TP styles cover the
rest): the attention's output projection on the sequence shard (``layout.A2A_MODES``) and the
token embedding looked up on its embedding dim (``layout.EMBEDDING_DIM``).

The embedding: the table stored sharded on its columns over one 1-D mesh of dp_shard x tp
ranks (dp_shard-major, as the mesh flattens them), never gathered; every rank looks up the
token ids of the whole group (all-gathered) in its columns, and one all-to-all moves each
rank's slice of every token onto the rank whose shard of the residual stream holds that token
(its dp_shard rank's batch, split over tp on the sequence, or on the batch for a
batch-sharded stream), whole. The table's gradient is complete on each rank: no reduction."""

from typing import Any

import torch
import torch.nn as nn

from ..candidates.layout import A2A_MODES
from ..errors import UserError


def embedding_dim_style(dp_shard: int, tp: int, stream: int, dtype: torch.dtype | None
                        ) -> Any:
    """The style for a mesh of ``dp_shard`` x ``tp`` ranks whose residual stream is split over
    tp on dim ``stream`` (1: the sequence, 0: the batch); ``dtype``: what the lookup's output
    is cast to (FSDP's parameter dtype, which the blocks compute in), None to keep it."""
    from torch.distributed._functional_collectives import (
        all_gather_single,
        all_to_all_single_autograd,
    )
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class EmbeddingDim(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if type(module) is not nn.Embedding:
                raise UserError(f"tp_mode 'dim' looks up a plain nn.Embedding, not a "
                                f"{type(module).__name__}; use the default")
            if device_mesh.size() != dp_shard * tp:
                raise UserError(f"tp_mode 'dim' needs a mesh of dp_shard x tp = {dp_shard * tp} "
                                f"ranks, not {device_mesh.size()}")
            module.register_parameter("weight", nn.Parameter(
                distribute_tensor(module.weight, device_mesh, [Shard(1)])))
            group = device_mesh.get_group()

            def forward(tokens: torch.Tensor) -> torch.Tensor:
                rows = tokens.shape[0]
                # every rank's ids, dp_shard-major; the tp ranks of a dp_shard rank hold the
                # same ones: keep the first of each
                every = all_gather_single(tokens.contiguous(), 0, group)
                ids = every.view(dp_shard, tp, rows, -1)[:, 0].reshape(dp_shard * rows, -1)
                out = nn.functional.embedding(ids, module.weight.to_local())
                if dtype is not None:
                    out = out.to(dtype)
                # rank k = (i, j) gets dp_shard rank i's tokens, tp shard j of them
                pieces = [piece for batch in out.split(rows, dim=0)
                          for piece in batch.chunk(tp, dim=stream)]
                sent = torch.cat([piece.reshape(-1) for piece in pieces])
                got = all_to_all_single_autograd(sent, None, None, group)
                # the columns arrive in rank order: the table's column shards in order
                return torch.cat(got.view(len(pieces), *pieces[0].shape).unbind(0), dim=-1)

            module.forward = forward
            return module

    return EmbeddingDim()


def heads_to_sequence() -> Any:
    """The style of an output projection run on the sequence shard (``layout.A2A_MODES``):
    its weight stored as TorchTitan's row-wise one (Shard(1) over tp) and all-gathered for the
    matmul (its gradient, a partial sum per tp rank, reduce-scattered back); its input, sharded
    on its features (the heads) over tp, redistributed onto the sequence (an all-to-all); the
    output is the stream's sequence shard, with no reduce-scatter."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class HeadsToSequence(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if type(module) is not nn.Linear:
                raise UserError(f"tp_mode {A2A_MODES[0]!r} runs the output projection as a plain "
                                f"linear, not a {type(module).__name__}; use 'sp'")
            for name, placement in (("weight", Shard(1)), ("bias", Replicate())):
                param = getattr(module, name)
                if param is not None:
                    module.register_parameter(name, nn.Parameter(
                        distribute_tensor(param, device_mesh, [placement])))

            def forward(x: torch.Tensor) -> torch.Tensor:
                x = DTensor.from_local(x, device_mesh, [Shard(2)], run_check=False)
                x = x.redistribute(device_mesh, [Shard(1)]).to_local()
                full = [p.full_tensor(grad_placements=[Partial()]) if p is not None else None
                        for p in (module.weight, module.bias)]
                return nn.functional.linear(x, *full)

            module.forward = forward
            return module

    return HeadsToSequence()
