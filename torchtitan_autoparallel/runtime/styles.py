"""PyTorch ``ParallelStyle``s of this project's own placements (TorchTitan's TP styles cover the
rest): the attention's output projection on the sequence shard (``layout.A2A_MODES``) and the
token embedding looked up on its embedding dim (``layout.EMBEDDING_MODES``).

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


def embedding_dim_style(dp_shard: int, tp: int, stream: int, dtype: torch.dtype | None,
                        gather: bool = False) -> Any:
    """The style for a mesh of ``dp_shard`` x ``tp`` ranks whose residual stream is split over
    tp on dim ``stream`` (1: the sequence, 0: the batch); ``dtype``: what the table is read in
    (FSDP's parameter dtype, which the blocks compute in), None to keep it. Applied on the 1-D
    mesh over dp_shard x tp (dp_shard-major); ``gather`` (``layout.EMBEDDING_DIM_GATHER``): on
    the 2-D (dp_shard, tp) mesh, the table's columns split over dp_shard and its rows over tp,
    gathered over tp for the lookup, each tp rank looking up its own shard of the tokens."""
    from torch.distributed._functional_collectives import all_gather_single
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    mode = "dim:gather" if gather else "dim"

    class EmbeddingDim(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if not plain_lookup(module):
                raise UserError(f"tp_mode {mode!r} looks up a plain nn.Embedding (no padding, "
                                f"max norm or sparse gradient), not this "
                                f"{type(module).__name__}; use the default")
            if device_mesh.size() != dp_shard * tp or device_mesh.ndim != 1 + gather:
                raise UserError(f"tp_mode {mode!r} needs a {1 + gather}-D mesh of dp_shard x tp "
                                f"= {dp_shard * tp} ranks, not {device_mesh}")
            module.register_parameter("weight", nn.Parameter(distribute_tensor(
                module.weight, device_mesh, [Shard(1), Shard(0)] if gather else [Shard(1)])))
            group = device_mesh.get_group(0)
            tp_rank = device_mesh.get_local_rank(1) if gather else 0

            def forward(tokens: torch.Tensor) -> torch.Tensor:
                table = module.weight  # read at each call: moving the module replaces it
                # rank (i, j) of the stream holds dp_shard rank i's tokens, tp shard j of them
                if gather:
                    mine = tokens.chunk(tp, dim=stream)[tp_rank].contiguous()
                    ids = all_gather_single(mine, 0, group)
                    read = (table.to(dtype) if dtype is not None else table).redistribute(
                        device_mesh, [Shard(1), Replicate()]).to_local(
                        grad_placements=[Shard(1), Partial()])
                    out = nn.functional.embedding(ids, read)
                    return _columns_to_stream(list(out.split(mine.shape[0], dim=0)), group)
                rows = tokens.shape[0]
                # every rank's ids, dp_shard-major; the tp ranks of a dp_shard rank hold the
                # same ones: keep the first of each
                every = all_gather_single(tokens.contiguous(), 0, group)
                ids = every.view(dp_shard, tp, rows, -1)[:, 0].reshape(dp_shard * rows, -1)
                out = nn.functional.embedding(ids, table.to_local())
                if dtype is not None:
                    out = out.to(dtype)
                return _columns_to_stream([piece for batch in out.split(rows, dim=0)
                                           for piece in batch.chunk(tp, dim=stream)], group)

            module.forward = forward
            return module

    return EmbeddingDim()


def plain_lookup(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Embedding`` (TorchTitan 0.3.0's subclass among them)
    whose forward is a plain table lookup: no padding row, max norm or sparse gradient."""
    return isinstance(module, nn.Embedding) and module.padding_idx is None and \
        module.max_norm is None and not module.scale_grad_by_freq and not module.sparse


def _columns_to_stream(pieces: list[torch.Tensor], group: Any) -> torch.Tensor:
    """One all-to-all over ``group``: ``pieces[k]`` (this rank's columns of the tokens rank k
    holds in the stream) to rank k; the columns that arrive, in rank order (the table's column
    shards in order), joined into whole rows."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    sent = torch.cat([piece.reshape(-1) for piece in pieces])
    got = all_to_all_single_autograd(sent, None, None, group)
    return torch.cat(got.view(len(pieces), *pieces[0].shape).unbind(0), dim=-1)


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


def dp_shard_tp_styles(linears: dict[str, str], dtype: torch.dtype | None
                       ) -> tuple[Any, Any]:
    """(the norm's style, the module's style) of a feed-forward tensor parallel over dp_shard
    (``layout.DP_SHARD_TP``) on the 2-D (dp_shard, tp) mesh. The module: its input (this rank's
    shard of the sequence-sharded stream) all-gathered over dp_shard on the batch, its output
    reduce-scattered back; ``linears`` (name in the module -> "colwise" / "rowwise") split over
    dp_shard on their output / input features and stored split over tp too, all-gathered over
    tp for their matmuls (their gradients reduce-scattered back). The norm: its weight stored
    sharded over both dims and read whole (its gradient, a partial sum per rank, reduced back).
    ``dtype``: what the weights are read in (FSDP's parameter dtype), None to keep theirs."""
    from torch.distributed._functional_collectives import (
        all_gather_tensor_autograd,
        reduce_scatter_tensor_autograd,
    )
    from torch.distributed.tensor import Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def cast(param: Any) -> Any:
        return param.to(dtype) if dtype is not None else param

    class WholeNorm(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if not isinstance(module, nn.RMSNorm) or module.weight is None:
                raise UserError(f"tp_mode 'sp/tp@dp_shard' reads a plain nn.RMSNorm, not a "
                                f"{type(module).__name__}; use 'sp'")
            module.register_parameter("weight", nn.Parameter(
                distribute_tensor(module.weight, device_mesh, [Shard(0), Shard(0)])))

            def forward(x: torch.Tensor) -> torch.Tensor:
                weight = cast(module.weight).full_tensor(grad_placements=[Partial(), Partial()])
                return nn.functional.rms_norm(x, module.normalized_shape, weight, module.eps)

            module.forward = forward
            return module

    class TensorParallelOverDpShard(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            for name, kind in linears.items():
                _gathered_linear(module.get_submodule(name), device_mesh,
                                 0 if kind == "colwise" else 1, cast)
            group = device_mesh.get_group(0)
            module.register_forward_pre_hook(
                lambda _, args: (all_gather_tensor_autograd(args[0], 0, group), *args[1:]))
            module.register_forward_hook(
                lambda _, __, out: reduce_scatter_tensor_autograd(out, "sum", 0, group))
            return module

    return WholeNorm(), TensorParallelOverDpShard()


def _gathered_linear(linear: nn.Module, mesh: Any, dim: int, cast: Any) -> None:
    """``linear``'s weight split on ``dim`` (0: output features, column-wise; 1: input features,
    row-wise) over the mesh's dp_shard dim and on dim 0 over its tp dim, gathered over tp for
    each matmul (read through ``cast``), its gradient reduce-scattered back over tp."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        raise UserError(f"tp_mode 'sp/tp@dp_shard' splits plain bias-free nn.Linear layers, not "
                        f"{linear}; use 'sp'")
    linear.register_parameter("weight", nn.Parameter(
        distribute_tensor(linear.weight, mesh, [Shard(dim), Shard(0)])))

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = cast(linear.weight).redistribute(mesh, [Shard(dim), Replicate()]).to_local(
            grad_placements=[Shard(dim), Partial()])
        return nn.functional.linear(x, weight)

    linear.forward = forward
