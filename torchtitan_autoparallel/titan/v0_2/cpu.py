"""CPU + gloo compatibility for TorchTitan 0.2.2.

TorchTitan 0.2.2 assumes an accelerator. Every workaround that lets it train on CPU with the
gloo backend lives in this package (this module and ``cpu_attention``); nothing else in the
project monkeypatches. Each patch names the upstream behaviour it works around and the test
that covers it. ``install()`` is a no-op when a CUDA device is present, so the same code runs
unchanged on GPUs with NCCL.
"""

from __future__ import annotations

import functools
import importlib
import os
import resource
from typing import Any

import torch

_installed = False

# Modules that copy ``torchtitan.tools.utils.device_type`` / ``device_module`` at import time.
_DEVICE_COPIES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiling",
)


def cpu_mode() -> bool:
    """True when no CUDA device is present, i.e. when the CPU patches apply."""
    return not torch.cuda.is_available()


class CpuDeviceModule:
    """The few ``torch.cuda``-style calls TorchTitan makes, answered for the CPU.

    Memory statistics report the process's peak resident set size (VmHWM); resetting the peak
    writes ``5`` to ``/proc/self/clear_refs`` (Linux), so per-phase peaks are measurable.
    Anything not defined here falls through to ``torch.cpu``.
    """

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return type("CpuProperties", (), {"name": "CPU", "total_memory": total})()

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    @staticmethod
    def peak_rss_bytes() -> int:
        """Peak resident set size of this process since the last reset."""
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @classmethod
    def memory_stats(cls, device: Any = None) -> dict[str, int]:
        peak = cls.peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


cpu_device_module = CpuDeviceModule()


def _patch_device() -> None:
    # Upstream: torchtitan.tools.utils.get_device_info() falls back to "cuda" when no accelerator
    # is found, and several modules copy device_type/device_module at import. Rebind every copy.
    # Tested by tests/test_cpu_runtime.py::test_device_is_cpu.
    for name in _DEVICE_COPIES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu_device_module


def _patch_histc() -> None:
    # Upstream: MoE routing (torchtitan.models.moe.moe) calls torch.histc on int64 expert
    # indices; the CPU kernel only exists for floating dtypes. Count in float and return the
    # input's dtype, as the CUDA kernel does (exact for < 2**24 tokens per expert; the counts
    # feed split sizes and slices, which need integers). Other inputs go to torch unchanged.
    # Tested by tests/test_cpu_runtime.py::test_histc_int64.
    if getattr(torch.histc, "_autoparallel_cpu", False):
        return
    original = torch.histc

    @functools.wraps(original)
    def histc(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.device.type == "cpu" and not input.is_floating_point():
            return original(input.float(), *args, **kwargs).to(input.dtype)
        return original(input, *args, **kwargs)

    histc._autoparallel_cpu = True  # type: ignore[attr-defined]
    torch.histc = histc


def _patch_permute_indices() -> None:
    # Upstream: expert parallel's token permutation calls generate_permute_indices, whose
    # default path is a Triton kernel; it has a pure-torch path behind use_cpu=True.
    # Tested by tests/test_cpu_runtime.py::test_permute_indices_cpu.
    moe_utils = importlib.import_module("torchtitan.models.moe.utils")
    original = moe_utils.generate_permute_indices
    if getattr(original, "_autoparallel_cpu", False):
        return

    @functools.wraps(original)
    def generate_permute_indices(tokens_per_expert_group: torch.Tensor, *args: Any, **kwargs: Any):
        if tokens_per_expert_group.device.type == "cpu":
            kwargs["use_cpu"] = True
        return original(tokens_per_expert_group, *args, **kwargs)

    generate_permute_indices._autoparallel_cpu = True  # type: ignore[attr-defined]
    moe_utils.generate_permute_indices = generate_permute_indices


def force_sum_reduction(model: torch.nn.Module) -> None:
    """Make FSDP2 reduce gradients with SUM (plus explicit scaling) instead of PREMUL_SUM.

    Upstream: gloo rejects ``ReduceOp.PREMUL_SUM``, which FSDP2 uses once
    ``set_gradient_divide_factor`` was called (TorchTitan does so for every recipe). Forcing
    sum reductions keeps the math identical. Called on the parallelized model by the project's
    train specs; tested by the loss-parity tests (tests/test_parity.py).
    """
    if not cpu_mode():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def install() -> bool:
    """Apply every CPU patch (idempotent). Returns True when the patches are active."""
    global _installed
    if not cpu_mode():
        return False
    if _installed:
        return True
    _patch_device()
    _patch_histc()
    _patch_permute_indices()
    from .cpu_attention import enable_cpu_ring_attention

    enable_cpu_ring_attention()
    _installed = True
    return True


# torch.compile backends that run on CPU without a C++ toolchain: the CPU runtime compiles with
# these (same graphs as inductor up to code generation; outputs equal to eager).
CPU_COMPILE_BACKENDS = ("aot_eager", "eager")


CUDA_ATTENTION = {
    "flex": "whose backward torch runs on CUDA only (FlexAttention has no CPU backward)",
    "varlen": "which runs on CUDA only (torch's flash-attention kernel)",
}
"""``attn_type`` values of TorchTitan's model args that a CPU cannot train, and why."""


def model_attention(job_config: Any) -> str:
    """The ``attn_type`` of the job's model flavor ("sdpa" where the spec or flavor is not
    known here: the model's own checks report those)."""
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        args = get_train_spec(job_config.model.name).model_args[job_config.model.flavor]
    except (KeyError, ValueError):
        return "sdpa"
    return str(getattr(args, "attn_type", "sdpa"))


def sdpa_flavors(job_config: Any) -> list[str]:
    """The flavors of the job's model that attend with SDPA (what a CPU trains)."""
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        flavors = get_train_spec(job_config.model.name).model_args
    except (KeyError, ValueError):
        return []
    return [name for name, args in flavors.items()
            if str(getattr(args, "attn_type", "sdpa")) == "sdpa"]


def cuda_only_features(job_config: Any) -> list[str]:
    """Settings in a TorchTitan job config that need CUDA, each with the fix to suggest."""
    problems: list[str] = []
    converters = list(getattr(job_config.model, "converters", []) or [])
    # float8 linears emulated (torchao casts in software) run on CPU, as TorchTitan's CI runs
    # them without float8 hardware
    emulated = "quantize.linear.float8" if job_config.quantize.linear.float8.emulate else ""
    for name in converters:
        if ("float8" in name or "mx" in name) and name != emulated:
            problems.append(
                f"model.converters contains {name!r}, which needs a CUDA GPU; "
                "remove it (or use --model.converters '[]') to run on CPU"
            )
    attention = model_attention(job_config)
    if attention in CUDA_ATTENTION:
        fix = ("use a flavor with sdpa attention to run on CPU" if sdpa_flavors(job_config)
               else f"model {job_config.model.name} has no flavor with sdpa attention: plan "
               "it, dry-run it (COMM_MODE=fake_backend) or train it on GPUs")
        problems.append(
            f"model.flavor = {job_config.model.flavor!r} uses {attention} attention, "
            f"{CUDA_ATTENTION[attention]}; {fix}")
    profiling = job_config.profiling
    if profiling.enable_profiling:
        problems.append(
            "profiling.enable_profiling needs a GPU: TorchTitan 0.2.2's profiler asks for a "
            "CUDA / XPU activity, which this machine lacks; turn profiling off to run on CPU")
    if profiling.enable_memory_snapshot:
        problems.append(
            "profiling.enable_memory_snapshot records CUDA allocator history, which a machine "
            "without a GPU lacks; turn it off to run on CPU")
    if job_config.training.enable_cpu_offload:
        problems.append(
            "training.enable_cpu_offload moves FSDP state from the GPU to host memory; on CPU "
            "TorchTitan adds a second gloo backend for it, which gloo refuses; turn it off to "
            "run on CPU")
    if job_config.checkpoint.async_mode == "async_with_pinned_mem":
        problems.append(
            "checkpoint.async_mode = 'async_with_pinned_mem' stages through pinned CUDA host "
            "memory; use 'async' or 'disabled' to run on CPU")
    compile_cfg = job_config.compile
    if getattr(compile_cfg, "enable", False) and compile_cfg.backend not in CPU_COMPILE_BACKENDS:
        problems.append(
            f"compile.backend = {compile_cfg.backend!r} is not run on CPU here; set "
            "compile.backend = \"aot_eager\" (--compile.backend aot_eager) or "
            "compile.enable = false to run on CPU"
        )
    par = job_config.parallelism
    if not par.auto and par.tensor_parallel_degree > 1 and aot_eager_blocks_on_cpu(job_config):
        problems.append(aot_eager_tp_problem(f"tensor_parallel_degree = "
                                             f"{par.tensor_parallel_degree}"))
    return problems


def aot_eager_blocks_on_cpu(job_config: Any) -> bool:
    """Blocks compiled with ``aot_eager`` on CPU: with TP + SP in a block, torch 2.13's
    AOTAutograd hands a plain-tensor gradient to a DTensor redistribute's backward, and the
    first backward fails (TorchTitan's own recipe too; the ``eager`` backend runs)."""
    compile_cfg = job_config.compile
    return (cpu_mode() and bool(compile_cfg.enable) and "model" in compile_cfg.components
            and compile_cfg.backend == "aot_eager")


def check_cpu_plan(job_config: Any, plan: Any) -> None:
    """Refuse a plan this machine cannot train: TP + SP blocks compiled with ``aot_eager``."""
    from ...candidates.layout import sub_block_modes
    from ...errors import UserError

    if aot_eager_blocks_on_cpu(job_config) and any(
            "sp" in sub_block_modes(layer.tp_mode) for layer in plan.layers):
        raise UserError(aot_eager_tp_problem(f"the plan runs TP + SP on mesh {plan.mesh}"))


def aot_eager_tp_problem(what: str) -> str:
    """The one-line error for TP blocks compiled with ``aot_eager`` on CPU."""
    return (f"compile.backend = 'aot_eager' cannot train tensor-parallel blocks on CPU ({what}): "
            "torch's AOTAutograd returns a plain-tensor gradient to a DTensor redistribute; set "
            "compile.backend = \"eager\" (--compile.backend eager), tensor_parallel_degree = 1 "
            "or compile.enable = false")
