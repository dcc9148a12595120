"""TorchTitan 0.3.0's Trainer on CPU ranks (gloo), for checking a plan without a GPU.

Each shim works around one upstream behaviour that assumes CUDA; ``apply_process_shims`` runs
them only when no CUDA device is present, before the Trainer is built (TorchTitan modules
imported earlier get the CPU's ``device_type`` / ``device_module`` in place of the copies they
made). ``sdpa_attention`` edits a parsed config. On a GPU nothing here changes anything.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import torch


def on_cpu() -> bool:
    """No CUDA device: TorchTitan 0.3.0 runs on CPU ranks with gloo under these shims."""
    return not torch.cuda.is_available()


def cpu_device_module() -> None:
    # tools.utils sets device_type = _get_available_device_type() or "cuda": without a GPU the
    # Trainer calls torch.cuda.set_device ("Found no NVIDIA driver"); point it at the CPU.
    import torchtitan.tools.utils as tt_utils

    cpu = types.ModuleType("torchtitan_autoparallel_cpu_device")
    cpu.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu)
                         if not k.startswith("__")})
    cpu.current_device = lambda: 0  # barrier(device_ids=[...]) needs an int, not "cpu"
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=1 << 40)
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.memory_stats = lambda device=None: {}  # no allocator statistics on CPU
    old_type, old_module = tt_utils.device_type, tt_utils.device_module
    # modules imported already copied the names (`from torchtitan.tools.utils import ...`)
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan."):
            continue
        if isinstance(getattr(module, "device_type", None), str) and \
                module.device_type == old_type:
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is old_module:
            module.device_module = cpu
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu


def fsdp_sum_reduction() -> None:
    # The Trainer sets FSDP's gradient divide factor to 1.0, for which FSDP2 reduce-scatters
    # with ReduceOp.PREMUL_SUM, which gloo lacks; take FSDP's SUM path (same result).
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as coll

    original = getattr(coll._get_gradient_divide_factors, "__wrapped__",
                       coll._get_gradient_divide_factors)

    def sum_only(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="",
                 factor=None, force_sum_reduction_for_comms=False):
        return original(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type,
                        factor, True)

    sum_only.__wrapped__ = original  # type: ignore[attr-defined]
    coll._get_gradient_divide_factors = sum_only


def same_global_batch() -> None:
    # The text loader shards the dataset per data-parallel rank (split_dataset_by_node), so a
    # run's samples depend on its dp degree; read the global batch in order on every rank and
    # keep this rank's rows, so any mesh trains on the same batches as one rank does.
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader as Loader

    if getattr(Loader, "_same_global_batch", False):
        return
    original_init, base = Loader.__init__, Loader.__mro__[1]

    def init(self, config, *, dp_world_size, dp_rank, local_batch_size, **kw):
        original_init(self, config, dp_world_size=1, dp_rank=0,
                      local_batch_size=local_batch_size * dp_world_size, **kw)
        self._rows = (dp_rank * local_batch_size, (dp_rank + 1) * local_batch_size)

    def iterate(self):
        lo, hi = self._rows
        for inputs, labels in base.__iter__(self):
            yield {k: v[lo:hi] for k, v in inputs.items()}, labels[lo:hi]

    Loader.__init__, Loader.__iter__, Loader._same_global_batch = init, iterate, True


def uneven_all_to_all() -> None:
    # The token dispatcher's EP exchange (spmd_types' all_to_all) sends a list of chunks of
    # different lengths, which gloo's list all_to_all refuses ("invalid tensor size"); run
    # those as one all_to_all_single with split sizes (gloo's alltoallv), same values.
    import torch.distributed as dist

    if getattr(dist.all_to_all, "_uneven", False):
        return
    original = dist.all_to_all

    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        if async_op or len({t.shape for t in input_tensor_list + output_tensor_list}) <= 1:
            return original(output_tensor_list, input_tensor_list, group=group,
                            async_op=async_op)
        width = math.prod(input_tensor_list[0].shape[1:])
        flat_in = torch.cat([t.reshape(t.shape[0], width) for t in input_tensor_list])
        out_rows = [t.shape[0] for t in output_tensor_list]
        flat_out = flat_in.new_empty((sum(out_rows), width))
        dist.all_to_all_single(flat_out, flat_in, out_rows,
                               [t.shape[0] for t in input_tensor_list], group=group)
        for out, chunk in zip(output_tensor_list, flat_out.split(out_rows), strict=True):
            out.copy_(chunk.reshape(out.shape))
        return None

    all_to_all._uneven = True  # type: ignore[attr-defined]
    dist.all_to_all = all_to_all


class _CopyBack:
    """A receive's work that copies the contiguous buffer into the strided tensor on wait."""

    def __init__(self, work: Any, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        self._work, self._buffer, self._tensor = work, buffer, tensor

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._work.wait(*args, **kwargs)
        with torch.no_grad():  # the stage's input buffer is a leaf that requires grad
            self._tensor.copy_(self._buffer)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def strided_p2p() -> None:
    # Pipeline stages receive into buffers with the sender's strides (torch.distributed.
    # pipelining's _make_tensor_from_meta), non-contiguous when a micro-batch holds several
    # sequences under TP; NCCL sends those (with a warning), gloo refuses ("input tensor has
    # to be contiguous"): send a contiguous copy and receive into one, copied back on wait.
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if getattr(dist.irecv, "_strided", False):
        return
    send, recv = dist.isend, dist.irecv

    def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return send(tensor.contiguous(), *args, **kwargs)

    def irecv(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.is_contiguous():
            return recv(tensor, *args, **kwargs)
        buffer = tensor.contiguous()
        return _CopyBack(recv(buffer, *args, **kwargs), buffer, tensor)

    irecv._strided = True  # type: ignore[attr-defined]
    # P2POp and batch_isend_irecv compare ops with distributed_c10d's own names
    dist.isend, dist.irecv = isend, irecv
    c10d.isend, c10d.irecv = isend, irecv


def sdpa_attention(config: Any) -> list[str]:
    # FlexAttention has no backward on CPU (NotImplementedError) and VarlenAttention no CPU
    # kernel: swap them for causal SDPA in the model config (before the Trainer reads it).
    # Plain causal attention across packed documents instead of 0.3.0's document masking.
    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
        VarlenAttention,
    )

    swapped = ["HF backend flex attention"] if hf_sdpa_attention(config) else []
    for kind in (FlexAttention.Config, VarlenAttention.Config):
        for _fqn, _cfg, parent, attr in list(config.model_spec.model.traverse(kind)):
            if isinstance(parent, list):
                parent[attr] = ScaledDotProductAttention.Config()
            else:
                setattr(parent, attr, ScaledDotProductAttention.Config())
            swapped.append(kind.__qualname__.split(".")[0])
    return sorted(set(swapped))


def hf_sdpa_attention(config: Any) -> bool:
    """The HF backend's attention (flex through its ``flex_torchtitan`` interface, with a
    BlockMask) as causal SDPA, when ``config`` runs that backend; True if swapped."""
    import sys

    module = sys.modules.get("torchtitan.experiments.transformers_modeling_backend.model")
    if module is None or type(config.model_spec.model).__module__ != module.__name__:
        return False
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_sdpa(attention: Any, query: Any, key: Any, value: Any, block_mask: Any = None,
                    **kwargs: Any) -> tuple[Any, None]:
        kwargs.pop("is_causal", None)
        out, _ = sdpa_attention_forward(attention, query, key, value, None, is_causal=True,
                                        **kwargs)
        return out, None

    module.flex_attention_forward = causal_sdpa
    return True


def apply_process_shims() -> bool:
    """The process-wide CPU shims, when no CUDA device is present; True if applied."""
    if not on_cpu():
        return False
    cpu_device_module()
    fsdp_sum_reduction()
    same_global_batch()
    uneven_all_to_all()
    strided_p2p()
    return True
