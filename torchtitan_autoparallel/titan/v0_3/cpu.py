"""TorchTitan 0.3.0's Trainer on CPU ranks (gloo), for checking a plan without a GPU.

Each shim works around one upstream behaviour that assumes CUDA; ``apply_process_shims`` runs
them only when no CUDA device is present, before the Trainer is built (TorchTitan modules
imported earlier get the CPU's ``device_type`` / ``device_module`` in place of the copies they
made). ``sdpa_attention`` edits a parsed config, and for the kernels its model still holds
(a vision encoder's FlexAttention, Gated DeltaNet) swaps in torch versions. On a GPU nothing here
changes anything.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import types
from collections.abc import Iterator
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
    # A vision encoder's FlexAttention (non-causal, per image) keeps its config, and so does a
    # model with Gated DeltaNet (whose per-document state resets need the offsets the Trainer
    # builds for a masked attention only; its VarlenAttention becomes FlexAttention): they run
    # as SDPA with the block mask made dense (``dense_flex_attention``).
    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
        VarlenAttention,
    )

    swapped = ["HF backend flex attention"] if hf_sdpa_attention(config) else []
    deltanet, dense = torch_gated_delta(config), False
    for kind in (FlexAttention.Config, VarlenAttention.Config):
        for _fqn, _cfg, parent, attr in list(config.model_spec.model.traverse(kind)):
            if deltanet or type(parent).__qualname__ == "VisionAttention.Config":
                dense = True
                if kind is FlexAttention.Config:
                    continue
                new: Any = FlexAttention.Config()
            else:
                new = ScaledDotProductAttention.Config()
                swapped.append(kind.__qualname__.split(".")[0])
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
    if dense:
        dense_flex_attention()
    return sorted(set(swapped))


def _log_once(flag: list[bool], message: str) -> None:
    """``message`` in TorchTitan's log, on rank 0, the first time only."""
    if not flag:
        flag.append(True)
        if os.environ.get("RANK", "0") == "0":
            from torchtitan.tools.logging import logger

            logger.info(message)


def dense_flex_attention() -> None:
    # FlexAttention has no backward on CPU, compiled or eager ("FlexAttention does not support
    # backward on CPU"), and a vision encoder's block mask (each image attends to its own
    # patches, in both directions) is no causal mask: run FlexAttention's kernel as SDPA with
    # the block mask's mask_mod materialised as a dense boolean mask (same values).
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    if getattr(FlexAttention.compiled_flex_attn, "_dense", False):
        return
    original, logged = FlexAttention.compiled_flex_attn, []

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any,
              block_mask: Any, scale: float | None, enable_gqa: bool, return_aux: Any,
              kernel_options: dict) -> tuple[torch.Tensor, Any]:
        if score_mod is not None or return_aux.lse or q.is_cuda:
            return original(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            enable_gqa=enable_gqa, return_aux=return_aux,
                            kernel_options=kernel_options)
        _log_once(logged, "CPU ranks: FlexAttention (vision encoder, or beside Gated DeltaNet) "
                          "runs as SDPA with its block mask made dense (no CPU backward)")
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2],
                           device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, None

    dense._dense = True  # type: ignore[attr-defined]
    FlexAttention.compiled_flex_attn = staticmethod(dense)  # type: ignore[method-assign]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's ``l2norm`` (eps 1e-6 under the square root), in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def torch_gated_delta(config: Any) -> bool:
    """Qwen3.5's Gated DeltaNet kernel as FLA's pure-torch chunked reference, when ``config``
    has one; True if swapped."""
    # GatedDeltaKernel calls FLA's chunk_gated_delta_rule, a Triton kernel, which needs a GPU
    # (FLA warns "Triton is not supported on current platform, roll back to CPU", then fails).
    # FLA ships naive_chunk_gated_delta_rule, the same recurrence in torch ops (with autograd):
    # q and k l2-normalised first (the model asks for use_qk_l2norm_in_kernel), per document
    # when the kernel gets document offsets.
    if "torchtitan.models.qwen3_5.model" not in sys.modules:
        return False
    from torchtitan.models.qwen3_5.model import GatedDeltaKernel

    if not any(True for _ in config.model_spec.model.traverse(GatedDeltaKernel.Config)):
        return False
    if getattr(GatedDeltaKernel.forward, "_torch", False):
        return True
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

    logged: list[bool] = []

    def forward(self: Any, xq_BLNK: torch.Tensor, xk_BLNK: torch.Tensor,
                xv_BLNV: torch.Tensor, g_BLN: torch.Tensor, beta_BLN: torch.Tensor, *,
                cu_seqlens: torch.Tensor | None = None,
                cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
        _log_once(logged, "CPU ranks: Gated DeltaNet runs FLA's pure-torch chunked gated delta "
                          "rule (its Triton kernel needs a GPU)")
        if xq_BLNK.shape[2] != xv_BLNV.shape[2]:  # Q/K heads expanded to V's, as upstream
            repeat = xv_BLNV.shape[2] // xq_BLNK.shape[2]
            xq_BLNK = xq_BLNK.repeat_interleave(repeat, dim=2)
            xk_BLNK = xk_BLNK.repeat_interleave(repeat, dim=2)
        args = (_l2norm(xq_BLNK), _l2norm(xk_BLNK), xv_BLNV, g_BLN, beta_BLN)
        if cu_seqlens is None:
            out = naive_chunk_gated_delta_rule(*args)[0]
        else:
            # chunks no longer than the documents (padding tokens are documents of length 1)
            out = _per_document(lambda *xs: naive_chunk_gated_delta_rule(
                *xs, chunk_size=min(64, xs[0].shape[1]))[0],
                cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens, *args)
        return out.to(xv_BLNV.dtype)

    forward._torch = True  # type: ignore[attr-defined]
    GatedDeltaKernel.forward = forward  # type: ignore[method-assign]
    qwen35 = sys.modules["torchtitan.models.qwen3_5.model"]
    qwen35._causal_conv1d_varlen = _causal_conv1d_varlen  # FLA's Triton conv, per document
    return True


def _per_document(fn: Any, cu_seqlens: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
    """``fn`` over each document of the packed ``xs`` ([1, T, ...], documents ending at
    ``cu_seqlens``), documents of one length batched in one call (padding tokens are documents
    of length 1); the outputs in ``xs``' order along dim 1."""
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b > a:
            by_length.setdefault(b - a, []).append(a)
    pieces, order = [], []
    for length, starts in by_length.items():
        index = torch.tensor([a + i for a in starts for i in range(length)],
                             device=xs[0].device)
        out = fn(*(x[0, index].unflatten(0, (len(starts), length)) for x in xs))
        pieces.append(out.flatten(0, 1))
        order.append(index)
    out = torch.cat(pieces)
    return out[torch.argsort(torch.cat(order))].unsqueeze(0)


def _causal_conv1d_varlen(x_BTD: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                          cu_seqlens_cpu: torch.Tensor | None) -> torch.Tensor:
    """Qwen3.5's depthwise causal conv + SiLU restarted per document (FLA's ``causal_conv1d``
    with ``cu_seqlens``, a Triton kernel) in torch ops."""
    width = weight.shape[-1]

    def conv(x_NTD: torch.Tensor) -> torch.Tensor:
        x_NDT = torch.nn.functional.pad(x_NTD.transpose(1, 2), [width - 1, 0])
        out = torch.nn.functional.conv1d(x_NDT, weight.reshape(-1, 1, width),
                                         groups=x_NDT.shape[1])
        return torch.nn.functional.silu(out).transpose(1, 2)

    return _per_document(conv, cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens,
                         x_BTD)


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


@contextlib.contextmanager
def planning_without_device() -> Iterator[None]:
    """Planning offline (``plan`` / ``predict``; planning runs no kernel): TorchTitan 0.3.0's
    ``Float8LinearConverter`` refuses to be configured on a machine without an SM89 GPU
    ("float8 is only supported on NVIDIA SM89 or later"), so a float8 config function such as
    llama3_405b could not be read for the GPUs it is planned for. Its capability check passes
    while the config is read; the hardware profile planned for then refuses float8 where that
    device would (``features.check_profile``). Tested by tests_v0_3/test_bad_inputs_v0_3.py."""
    from torchtitan.components.quantization import float8

    original = float8.has_cuda_capability
    float8.has_cuda_capability = lambda major, minor: True
    try:
        yield
    finally:
        float8.has_cuda_capability = original
