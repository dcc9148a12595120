"""The job's GPU speed features, read from TorchTitan's config: what ``apply_plan`` applies to
every planned block, what the cost model charges for, and what the plan's fingerprint records.

One place decides what each setting means under ``auto`` (see docs/settings.md):
- ``[compile] enable`` with ``"model"`` in components: every block compiled after AC and before
  FSDP, as TorchTitan's recipes do; with ``"loss"``: TorchTitan's trainer compiles the loss
  itself, costed as one fused kernel per direction that keeps no fp32 logits (Inductor only:
  other backends run the loss's eager kernels).
- ``model.converters`` ``quantize.linear.float8`` / ``quantize.linear.mx`` and their
  ``[quantize.linear.*]`` recipe: TorchTitan's converter swaps the linears; FSDP all-gathers
  float8 weights when the tensorwise recipe asks for it; TP uses TorchTitan's float8 styles.
- ``quantize.grouped_mm.float8`` / ``.mx``: MoE grouped GEMMs (needs pp = cp = 1: a
  constraint on the search).
- ``parallelism.enable_async_tensor_parallel``: async TP on the tp mesh (needs compile).
- ``training.enable_cpu_offload``: FSDP's CPU offload policy on every sharded module.
- ``parallelism.fsdp_reshard_after_forward``: unset, the planner chooses per block; "always" /
  "never" fix it for every sharded block (a constraint on the search), and so does "default"
  when set: TorchTitan's own policy, reshard unless pipelined.
- ``optimizer.implementation``: what the optimizer step allocates besides its state.

Planning reads no device: ``check_device`` is called by the entrypoint with the device's
compute capability before any rank starts.
"""

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import UserError
from ..frontend import frontend
from .explicit import user_set

FLOAT8_LINEAR = "quantize.linear.float8"
FLOAT8_GROUPED = "quantize.grouped_mm.float8"
MX_LINEAR = "quantize.linear.mx"
MX_GROUPED = "quantize.grouped_mm.mx"
RESHARD_POLICIES = ("default", "always", "never")


@dataclass(frozen=True)
class Features:
    """Speed features of one job (all off: an eager bf16 / fp32 job)."""

    compile: bool = False
    """Blocks are compiled (``compile.enable`` and ``"model"`` in ``compile.components``)."""
    compile_backend: str = "inductor"
    compile_loss: bool = False
    """TorchTitan's trainer compiles the loss with Inductor (``compile.enable``, ``"loss"`` in
    ``compile.components``, backend ``inductor``)."""
    linear: str = "none"
    """Low-precision linears: "none", "float8_tensorwise", "float8_rowwise",
    "float8_rowwise_with_gw_hp" or "mx"."""
    float8_all_gather: bool = False
    """FSDP all-gathers float8 weights of float8 linears (tensorwise recipe only)."""
    precompute_scale: bool = False
    """One amax all-reduce per step for all float8 weights (after the optimizer step)."""
    grouped_mm: str = "none"
    """Low-precision MoE grouped GEMMs: "none", "float8" or "mx"."""
    async_tp: bool = False
    """TP collectives overlapped with the neighbouring GEMMs (micro-pipelined)."""
    cpu_offload: bool = False
    """FSDP keeps sharded parameters, gradients and optimizer state in host memory."""
    reshard_after_forward: str = "default"
    """"default": the planner chooses per block; "always" / "never": fixed for all blocks;
    "torchtitan": TorchTitan's "default" set by the user (always, never under pp)."""
    optimizer: str = "fused"
    """``optimizer.implementation`` (TorchTitan's default: fused): the optimizer step's
    temporaries."""
    float8_filter: tuple[str, ...] | None = None
    """``quantize.linear.float8.filter_fqns`` in effect (linears matching one stay bf16); None:
    unset under auto, so the planner picks the linears where float8 pays."""
    moe_routed_on_shard: bool = False
    """The release runs a MoE block's router and routed experts under EP on the sequence
    shard, with no collective over tp (``Frontend.moe_routed_on_shard``: TorchTitan 0.3.0)."""

    @property
    def float8(self) -> bool:
        return self.linear.startswith("float8")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Features":
        """Features as ``to_dict`` wrote them (a plan's inputs or fingerprint)."""
        data = dict(data)
        if data.get("float8_filter") is not None:
            data["float8_filter"] = tuple(data["float8_filter"])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["compile_loss"]:
            del data["compile_loss"]  # jobs that do not set it keep their plan files
        if not data["moe_routed_on_shard"]:
            del data["moe_routed_on_shard"]  # 0.2.2's jobs keep their plan files
        if data["float8_filter"] is None:
            del data["float8_filter"]  # jobs that do not set it keep their plan files
        else:
            data["float8_filter"] = list(data["float8_filter"])
        return data


EAGER = Features()
"""No speed feature: the default everywhere features are optional."""


def features_from_config(job_config: Any) -> Features:
    """The job's features; conflicting settings are one-line errors naming the fix."""
    compile_cfg, par = job_config.compile, job_config.parallelism
    converters = list(getattr(job_config.model, "converters", None) or [])
    compiled = bool(compile_cfg.enable and "model" in compile_cfg.components)
    linear, float8_all_gather, precompute = "none", False, False
    float8_filter: tuple[str, ...] | None = None
    if FLOAT8_LINEAR in converters and MX_LINEAR in converters:
        raise UserError(f"model.converters has both {FLOAT8_LINEAR!r} and {MX_LINEAR!r}: keep one")
    if FLOAT8_LINEAR in converters:
        f8 = job_config.quantize.linear.float8
        recipe = f8.recipe_name or "tensorwise"
        if f8.recipe_name is not None and f8.enable_fsdp_float8_all_gather:
            raise UserError(
                "quantize.linear.float8.enable_fsdp_float8_all_gather works with the default "
                "tensorwise recipe only (TorchTitan refuses it with recipe_name): drop one"
            )
        linear = f"float8_{recipe}"
        if user_set(job_config, "quantize.linear.float8.filter_fqns"):
            float8_filter = tuple(str(f) for f in f8.filter_fqns)
        float8_all_gather = bool(f8.enable_fsdp_float8_all_gather)
        precompute = float8_all_gather and bool(f8.precompute_float8_dynamic_scale_for_fsdp)
        if getattr(f8, "emulate", False) and compiled:
            raise UserError("quantize.linear.float8.emulate cannot be combined with compile: "
                            "set compile.enable = false or drop emulate")
    elif MX_LINEAR in converters:
        linear = "mx"
    grouped = ("float8" if FLOAT8_GROUPED in converters
               else "mx" if MX_GROUPED in converters else "none")
    if grouped != "none":
        for key in ("pipeline_parallel_degree", "context_parallel_degree"):
            if getattr(par, key) not in (1,):
                raise UserError(
                    f"model.converters has quantize.grouped_mm.{grouped}, which TorchTitan runs "
                    f"only with pp = cp = 1; parallelism.{key} = {getattr(par, key)}: set it to "
                    "1 or drop the converter"
                )
    async_tp = bool(par.enable_async_tensor_parallel)
    if async_tp and not compiled:
        raise UserError(
            "parallelism.enable_async_tensor_parallel needs compile (as in TorchTitan): set "
            "compile.enable = true with \"model\" in compile.components, or turn async TP off"
        )
    policy = par.fsdp_reshard_after_forward
    if policy not in RESHARD_POLICIES:
        raise UserError(f"parallelism.fsdp_reshard_after_forward = {policy!r}: use one of "
                        f"{list(RESHARD_POLICIES)}")
    if policy == "default" and user_set(job_config, "parallelism.fsdp_reshard_after_forward"):
        policy = "torchtitan"  # asked for TorchTitan's policy: a constraint, as any set key
    return Features(
        compile=compiled,
        compile_backend=str(compile_cfg.backend) if compiled else "inductor",
        compile_loss=bool(compile_cfg.enable and "loss" in compile_cfg.components
                          and str(compile_cfg.backend) == "inductor"),
        linear=linear,
        float8_all_gather=float8_all_gather,
        precompute_scale=precompute,
        grouped_mm=grouped,
        async_tp=async_tp,
        cpu_offload=bool(job_config.training.enable_cpu_offload),
        reshard_after_forward=policy,
        optimizer=str(job_config.optimizer.implementation),
        float8_filter=float8_filter,
        moe_routed_on_shard=frontend().moe_routed_on_shard,
    )


def check_device(features: Features, capability: tuple[int, int] | None) -> None:
    """Refuse features the device cannot run (``capability``: CUDA compute capability, None
    on a machine without a GPU, where the CPU runtime refuses GPU-only kernels itself)."""
    if capability is None:
        return
    sm = f"SM{capability[0]}{capability[1]}"
    if (features.float8 or features.grouped_mm == "float8") and capability < (8, 9):
        raise UserError(f"float8 needs SM89 or newer (this GPU is {sm}): remove "
                        "quantize.*.float8 from model.converters")
    if (features.linear == "mx" or features.grouped_mm == "mx") and capability < (10, 0):
        raise UserError(f"MX formats need SM100 or newer (this GPU is {sm}): remove "
                        "quantize.*.mx from model.converters")


DEVICE_CAPABILITY = {"A100": (8, 0), "H100": (9, 0), "H200": (9, 0), "B200": (10, 0)}
"""CUDA compute capability of the GPUs the shipped profiles name (``device_names``; NVIDIA's
datasheets)."""


def check_profile(features: Features, hardware: Any, emulated: bool) -> None:
    """Refuse, when planning offline for ``hardware`` (a ``HardwareProfile``), the features
    training refuses on that device (``check_device``): low-precision kernels on a GPU too old
    for them, and on the CPU profile (CPU ranks run only emulated float8 linears)."""
    low = [f for f in (features.linear, features.grouped_mm) if f != "none"]
    if hardware.name == "cpu" and low and not (emulated and features.grouped_mm == "none"):
        raise UserError(f"{low[0]} on the 'cpu' hardware profile: CPU ranks refuse float8 and "
                        "MX kernels (float8 linears run there with "
                        "--quantize.linear.float8.emulate only); plan for the GPU the job runs "
                        "on (--hardware h100_sxm, ...) or remove the converter")
    names = " ".join(hardware.device_names).upper()
    capability = next((cap for key, cap in DEVICE_CAPABILITY.items() if key in names), None)
    if capability is not None:
        try:
            check_device(features, capability)
        except UserError as exc:
            raise UserError(f"hardware profile {hardware.name!r}: {exc}") from None

