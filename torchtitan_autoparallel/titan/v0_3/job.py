"""A TorchTitan 0.3.0 job (``Config``) as the planner reads a job: the sections and keys of the
planning vocabulary (named as in TorchTitan 0.2.2's ``JobConfig``, which the planner was first
written against), filled from 0.3.0's config and its model spec. Keys 0.3.0 no longer has
(expert tensor parallel, loss parallel off, PP / EP overlap) are fixed at what 0.3.0 runs and
recorded as set, so the search does not choose what 0.3.0 cannot apply."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...cost.model import STEP_BYTES_PER_PARAM
from ...errors import UserError
from ...job.config import Autoparallel
from ...job.explicit import EXPLICIT_ATTR, NOTES_ATTR, RELEASE_FIXED_ATTR
from ...job.model_config import ModelConfig, hf_config_file
from .config import Config, config_nodes, explicit_of
from .model import HF_BACKEND, HF_SECTION
from .settings import check_keys

FIXED_BY_RELEASE = {"parallelism.expert_tensor_parallel_degree": 1,
                    "parallelism.pipeline_parallel_expert_parallel_overlap": False}
"""Planning keys TorchTitan 0.3.0 has no setting for, at the value it runs."""


NO_SP = ("parallelism.enable_sequence_parallel is off: tensor-parallel blocks are planned "
         "without sequence parallel (tp_mode 'sp/sp:rep', the residual stream whole on every "
         "tp rank)")
"""The plan note of a job that turns sequence parallel off (``Constraints.sequence_parallel``)."""

SP_ALWAYS = {HF_BACKEND: "the HF backend",
             "qwen3_5": "TorchTitan 0.3.0's qwen3_5"}
"""The models whose sharding declares sequence parallel whenever tp > 1, whatever
``parallelism.enable_sequence_parallel`` says (family -> its name in a note). The other 0.3.0
families pass the flag to their sharding (tested against their source)."""


def sp_always(config: Config, user: set[str]) -> dict[str, str]:
    """A job that turns sequence parallel off on a model of ``SP_ALWAYS``: its tensor-parallel
    degree held at 1 (key -> why), or a one-line error where the job sets it above 1. Other
    models: nothing."""
    model = SP_ALWAYS.get(family_of(config.model_spec))
    if model is None:
        return {}
    key, why = "parallelism.tensor_parallel_degree", (
        f"parallelism.enable_sequence_parallel is off and {model} runs tensor parallel "
        "with sequence parallel only (its sharding ignores the flag)")
    if key in user and config.parallelism.tensor_parallel_degree > 1:
        raise UserError(f"{key} = {config.parallelism.tensor_parallel_degree}: {why}; turn "
                        f"sequence parallel on or leave {key} to the planner")
    return {key: f"{key} held at 1: {why}"}


def held_by_cuda_graphs(config: Config) -> dict[str, str]:
    """Degrees CUDA graphs (on unless ``training.disable_cuda_graphs``) hold at 1, by
    TorchTitan 0.3.0's own check of the config: pipeline stages always, expert parallel when
    the model's token dispatcher synchronizes with the host. Key -> why."""
    if config.training.disable_cuda_graphs:
        return {}
    held = {"parallelism.pipeline_parallel_degree": "CUDA graphs do not run pipeline stages"}
    probe = copy.copy(config)
    probe.parallelism = dataclasses.replace(config.parallelism, expert_parallel_degree=2)
    try:
        probe._validate_cuda_graphs()
    except ValueError:
        held["parallelism.expert_parallel_degree"] = ("CUDA graphs do not run the model's "
                                                      "token dispatcher under EP")
    return held


@dataclass
class Model:
    name: str = ""
    flavor: str = ""
    converters: list[str] = field(default_factory=list)
    hf_assets_path: str = ""


@dataclass
class Float8:
    recipe_name: str | None = None
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    filter_fqns: list[str] = field(default_factory=list)
    emulate: bool = False


@dataclass
class Linear:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    linear: Linear = field(default_factory=Linear)


@dataclass
class Training:
    local_batch_size: int = 8
    global_batch_size: int = -1
    seq_len: int = 2048
    steps: int = 10000
    enable_cpu_offload: bool = False
    dtype: str = "float32"
    mixed_precision_param: str = "bfloat16"
    mixed_precision_reduce: str = "float32"
    dataset: str = ""


@dataclass
class Parallelism:
    auto: bool = False
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    fsdp_reshard_after_forward: str = "default"
    tensor_parallel_degree: int = 1
    enable_async_tensor_parallel: bool = False
    disable_loss_parallel: bool = False
    pipeline_parallel_degree: int = 1
    module_fqns_per_model_part: Any = None
    pipeline_parallel_first_stage_less_layers: int = 1
    pipeline_parallel_last_stage_less_layers: int = 1
    pipeline_parallel_layers_per_stage: Any = None
    pipeline_parallel_schedule: str = "1F1B"
    pipeline_parallel_schedule_csv: Any = ""
    pipeline_parallel_microbatch_size: int = 1
    pipeline_parallel_expert_parallel_overlap: bool = False
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    expert_tensor_parallel_degree: int = 1
    enable_sequence_parallel: bool = True


@dataclass
class ActivationCheckpoint:
    mode: str = "selective"
    selective_ac_option: str = "op"


@dataclass
class Compile:
    enable: bool = False
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    backend: str = "inductor"


@dataclass
class Optimizer:
    name: str = "AdamW"
    implementation: str = "fused"
    early_step_in_backward: bool = False


@dataclass
class Debug:
    moe_force_load_balance: bool = False


@dataclass
class Experimental:
    custom_import: str = ""


@dataclass
class Validation:
    enable: bool = False
    seq_len: int = 2048


@dataclass
class Job:
    """The planner's view of one TorchTitan 0.3.0 job."""

    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    optimizer: Optimizer = field(default_factory=Optimizer)
    debug: Debug = field(default_factory=Debug)
    experimental: Experimental = field(default_factory=Experimental)
    validation: Validation = field(default_factory=Validation)
    autoparallel: Autoparallel = field(default_factory=Autoparallel)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    """What the model's config reads besides the model spec (the HF backend's ``hf_model``)."""


def _ac_mode(policy: Any) -> str:
    if policy is None:
        return "none"
    name = type(policy).__qualname__.split(".")[0]
    modes = {"SelectiveAC": "selective", "FullAC": "full"}
    if name not in modes:
        raise UserError(f"activation checkpointing {name} under parallelism.auto: the planner "
                        "chooses AC per block among none / selective / full; pick one of "
                        "activation-checkpoint:selective|full|none, or drop --parallelism.auto")
    return modes[name]


def _converters(model_config: Any) -> tuple[list[str], str | None, bool, list[str]]:
    """The quantization converters baked into the model config (0.2.2's converter names), the
    float8 recipe, whether float8 is emulated, and notes on what the cost model does not
    see."""
    configs = config_nodes(model_config)  # the blocks' linears too (lm_head may be bf16)
    names = {type(cfg).__qualname__.split(".")[0] for cfg in configs}
    converters, recipe, notes = [], None, []
    emulate = any(getattr(cfg, "emulate", False) for cfg in configs
                  if type(cfg).__name__ == "Float8LinearConfig")
    if any(name.startswith("Frozen") or "LoRA" in name for name in names):
        notes.append("LoRA: the frozen base weights are costed as trained (their gradients, "
                     "optimizer state and weight-gradient GEMMs): memory and step time are "
                     "upper bounds")
    if "Float8Linear" in names or "FrozenFloat8Linear" in names:
        converters.append("quantize.linear.float8")
        recipe = "rowwise"  # 0.3.0's Float8LinearConverter: rowwise recipes only
    if "MXFP8Linear" in names:
        converters.append("quantize.linear.mx")
    if "NVFP4Linear" in names:
        raise UserError("NVFP4 linears (NVFP4LinearConverter) are not costed by the planner: "
                        "drop the converter or parallelism.auto")
    return converters, recipe, emulate, notes


IMPLEMENTATIONS = tuple(STEP_BYTES_PER_PARAM)
"""``optimizer.implementation`` values the cost model has the step's temporaries of."""
OPTIMIZERS = ("Adam", "AdamW")
"""The optimizers whose state the planner costs (two fp32 moments per parameter)."""


def optimizers_of(optimizer: Any) -> list[str]:
    """The optimizers of 0.3.0's parameter groups (``ParamGroupConfig.optimizer_name``)."""
    return sorted({str(group.optimizer_name)
                   for group in getattr(optimizer, "param_groups", None) or []})


def optimizer_notes(optimizer: Any) -> list[str]:
    """What the cost model assumes of an optimizer it does not cost."""
    return [f"optimizer {name}: costed as AdamW state (two fp32 moments per parameter, an "
            "upper bound for Muon's one) and AdamW's step; training under the plan refuses it"
            for name in optimizers_of(optimizer) if name not in OPTIMIZERS]


def hf_model_config(config: Any) -> ModelConfig:
    """The HF backend's ``hf_model`` as the job's model config (its ``config.json`` checked
    here, one line when missing); empty for other families."""
    if family_of(config.model_spec) != HF_BACKEND:
        return ModelConfig()
    model = str(getattr(config, "hf_model", "") or "")
    if not model:
        raise UserError("hf_model is empty: name a folder holding a Hugging Face config.json "
                        "(or a Hugging Face model id) with --hf_model")
    hf_config_file(model, key="hf_model")
    return ModelConfig("torchtitan.experiments.transformers_modeling_backend",
                       {HF_SECTION: {"model": model}})


def family_of(spec: Any) -> str:
    """The family package a model spec comes from (``torchtitan.models.<family>``; a spec may
    name its model otherwise, e.g. kimi_k2_7's ``kimi_k2_5``)."""
    module = getattr(spec.parallelize_fn, "__module__", "") or ""
    for prefix in ("torchtitan.models.", "torchtitan.experiments."):
        if module.startswith(prefix):
            return module[len(prefix):].rsplit(".", 1)[0]
    return spec.name


CPU_CP = ("TorchTitan 0.3.0 runs context parallel with FlexAttention only (its SDPA on CPU "
          "has no CP sharding rule), and FlexAttention's backward runs on CUDA only")
"""Why context parallel cannot train on CPU ranks (measured: spmd_types and full_dtensor refuse
SDPA + CP; partial_dtensor fails in SDPA's CPU kernel)."""


def job_of(config: Config, cpu_ranks: bool = False) -> Job:
    """The planner's view of ``config`` with the keys the user set recorded."""
    spec = config.model_spec
    if spec is None:
        raise UserError("the config function returned no model_spec: set one (model_registry)")
    converters, recipe, emulate, converter_notes = _converters(spec.model)
    notes = [*check_keys(config), *converter_notes, *optimizer_notes(config.optimizer)] \
        if config.parallelism.auto else []
    implementation = str(getattr(config.optimizer, "implementation", "fused"))
    if implementation not in IMPLEMENTATIONS:
        raise UserError(f"optimizer.implementation {implementation}: the planner costs fp32 "
                        "Adam / AdamW states (bf16 states are not modelled); use one of "
                        f"{', '.join(IMPLEMENTATIONS)}, or drop --parallelism.auto")
    t, p, c = config.training, config.parallelism, config.compile
    if config.parallelism.auto:
        notes += tp_dp_left_out(config) + sub_block_note(config)
    job = Job(
        model=Model(family_of(spec), spec.flavor, converters, config.hf_assets_path),
        training=Training(t.local_batch_size, t.global_batch_size, t.seq_len, t.steps,
                          t.enable_cpu_offload, t.dtype, t.mixed_precision_param,
                          t.mixed_precision_reduce,
                          str(getattr(config.dataloader, "dataset", "") or "")),
        parallelism=Parallelism(**{f: getattr(p, f) for f in Parallelism.__dataclass_fields__
                                   if hasattr(p, f)},
                                enable_async_tensor_parallel=c.enable_async_tensor_parallel),
        activation_checkpoint=ActivationCheckpoint(_ac_mode(config.activation_checkpoint)),
        compile=Compile(c.enable, list(c.components), c.backend),
        quantize=Quantize(Linear(Float8(recipe_name=recipe, emulate=emulate))),
        optimizer=Optimizer("AdamW",
                            implementation,
                            bool(getattr(config.optimizer, "early_step_in_backward", False))),
        debug=Debug(config.debug.moe_force_load_balance),
        # 0.3.0's validator reads batches of the training's length
        validation=Validation(bool(config.validator.enable), t.seq_len),
        autoparallel=config.autoparallel,
        model_config=hf_model_config(config),
    )
    renamed = {"compile.enable_async_tensor_parallel": "parallelism.enable_async_tensor_parallel"}
    user = {renamed.get(k, k) for k in explicit_of(config)}
    held = {k: why for k, why in held_by_cuda_graphs(config).items() if k not in user}
    if config.parallelism.auto:
        notes += [f"{key} held at 1: {why} (training.disable_cuda_graphs is off; set "
                  "--training.disable_cuda_graphs to search it)" for key, why in held.items()]
    if config.parallelism.auto and not config.parallelism.enable_sequence_parallel:
        held.update(sp_always(config, user))
        notes.append(held.get("parallelism.tensor_parallel_degree", NO_SP))
    if cpu_ranks and config.parallelism.auto:
        key = "parallelism.context_parallel_degree"
        if key in user and config.parallelism.context_parallel_degree > 1:
            raise UserError(f"{key} = {config.parallelism.context_parallel_degree} on CPU ranks: "
                            f"{CPU_CP}: drop it here, or run on GPUs")
        held[key] = CPU_CP
        notes.append(f"{key} held at 1 on these CPU ranks: {CPU_CP}")
    fixed = set(FIXED_BY_RELEASE) | set(held)
    setattr(job, EXPLICIT_ATTR, frozenset(user | fixed))
    setattr(job, RELEASE_FIXED_ATTR, frozenset(fixed))
    setattr(job, NOTES_ATTR, notes)
    return job


def tp_dp_left_out(config: Any) -> list[str]:
    """0.3.0's apply runs the tp dim as data parallel (tp_dp) on eager blocks and off the
    full_dtensor backend only: there tp_dp is left out of the search (a note), or refused
    where the job's ``autoparallel.techniques`` names it."""
    c, ap = config.compile, config.autoparallel
    why = ("compiled blocks (drop --compile.enable to search it)"
           if c.enable and "model" in c.components else
           "--parallelism.spmd_backend full_dtensor (use spmd_types or partial_dtensor to "
           "search it)" if getattr(config.parallelism, "spmd_backend", "") == "full_dtensor"
           else "")
    if not why or "tp_dp" not in ap.techniques:
        return []
    if "autoparallel.techniques" in explicit_of(config):
        raise UserError(f"autoparallel.techniques has tp_dp, which TorchTitan 0.3.0's apply does "
                        f"not run with {why.split(' (')[0]}: leave it out")
    ap.techniques = [t for t in ap.techniques if t != "tp_dp"]
    return [f"autoparallel.techniques: tp_dp (the tp dim as data parallel) left out: TorchTitan "
            f"0.3.0's apply does not run it with {why}"]


def sub_block_note(config: Any) -> list[str]:
    """The plan note of a ``tp_sub_block`` search on 0.3.0 (MoE blocks take their sub-block
    modes with any ep); under the full_dtensor backend (DP and TP in one
    DTensor mesh) ``tp_sub_block`` is refused in one line."""
    if "tp_sub_block" not in config.autoparallel.techniques:
        return []
    if getattr(config.parallelism, "spmd_backend", "") == "full_dtensor":
        raise UserError("autoparallel.techniques has tp_sub_block, which TorchTitan 0.3.0's "
                        "apply does not run under --parallelism.spmd_backend full_dtensor: "
                        "leave it out or use spmd_types or partial_dtensor")
    return ["autoparallel.techniques: tp_sub_block searched on dense blocks, the embedding "
            "and MoE blocks ('sp/dp', the MoE data parallel over tp, its routed experts on "
            "the model's expert parallel where ep > 1; 'dp/sp', the attention data parallel "
            "over tp; ending ':shared_dp' with ep = 1, the shared experts alone data parallel "
            "over tp)"]
