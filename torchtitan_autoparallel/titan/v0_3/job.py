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
from ..keys import (
    APPLIED,
    CONSTRAINT,
    COSTED,
    NOTED,
    PASSED,
    REFUSED,
    SEARCHED,
    Handling,
    handling_table,
)
from .config import Config, config_nodes, explicit_of

_FIXED_WHEN_SET = ((CONSTRAINT, SEARCHED), "set: fixed; unset: searched")
DTYPE_NOTE = "bfloat16: refused (the cost model charges float32 state)"
_STAGE_SPLIT = ((REFUSED,), "set: the planner splits the stages")
KEYS: dict[str, tuple[Handling, str]] = {
    # read into the planner's view of the job (named as the 0.2.2 key it stands for)
    "training.local_batch_size": ((SEARCHED,), ""),
    "training.global_batch_size": ((CONSTRAINT,), "-1: local batch x data-parallel degree"),
    "training.seq_len": ((APPLIED, COSTED), "planned for"),
    "training.enable_cpu_offload": ((APPLIED, COSTED), ""),
    "training.dtype": ((APPLIED, REFUSED), DTYPE_NOTE),
    "training.mixed_precision_param": ((APPLIED, COSTED), ""),
    "training.mixed_precision_reduce": ((APPLIED, COSTED), ""),
    # TorchTitan's gradient clipping, on one mesh per parameter group under every 0.3.0 plan
    "training.max_norm": ((APPLIED,), ""),
    # the options every AC policy shares: each planned mode's policy carries them (apply.py)
    "activation_checkpoint.preserve_rng_state": ((APPLIED,), ""),
    "activation_checkpoint.determinism_check": ((APPLIED,), ""),
    "activation_checkpoint.debug": ((APPLIED,), ""),
    "parallelism.auto": ((APPLIED,), "plans the job; off: TorchTitan's own recipe runs it"),
    "parallelism.data_parallel_replicate_degree": _FIXED_WHEN_SET,
    "parallelism.data_parallel_shard_degree": _FIXED_WHEN_SET,
    "parallelism.fsdp_reshard_after_forward": _FIXED_WHEN_SET,
    "parallelism.tensor_parallel_degree": _FIXED_WHEN_SET,
    "parallelism.pipeline_parallel_degree": _FIXED_WHEN_SET,
    "parallelism.module_fqns_per_model_part": _STAGE_SPLIT,
    "parallelism.pipeline_parallel_first_stage_less_layers": _STAGE_SPLIT,
    "parallelism.pipeline_parallel_last_stage_less_layers": _STAGE_SPLIT,
    "parallelism.pipeline_parallel_layers_per_stage": _STAGE_SPLIT,
    "parallelism.pipeline_parallel_schedule": _FIXED_WHEN_SET,
    "parallelism.pipeline_parallel_schedule_csv": _STAGE_SPLIT,
    "parallelism.pipeline_parallel_microbatch_size": _FIXED_WHEN_SET,
    "parallelism.context_parallel_degree": _FIXED_WHEN_SET,
    "parallelism.expert_parallel_degree": _FIXED_WHEN_SET,
    "compile.enable": ((APPLIED, COSTED), ""),
    "compile.components": ((APPLIED, COSTED), ""),
    "compile.backend": ((APPLIED, COSTED), ""),
    "compile.enable_async_tensor_parallel": ((APPLIED, COSTED), ""),
    "optimizer.implementation": ((APPLIED, COSTED, REFUSED),
                                 "the optimizer step's temporaries; bf16 states: refused"),
    "debug.moe_force_load_balance": ((APPLIED, COSTED), "MoE load imbalance 1"),
    "validator.enable": ((APPLIED, CONSTRAINT), "no PP in the search"),
    "autoparallel.": ((APPLIED,), "the planner's own settings"),
    "hf_model": ((APPLIED,), "the HF backend's model (its config.json): planned for"),
    # the planner's assumptions: set otherwise under auto, one line
    "parallelism.enable_sequence_parallel": ((REFUSED,), ""),
    "parallelism.enable_fsdp_symm_mem": ((REFUSED,), ""),
    "parallelism.context_parallel_load_balancer": ((REFUSED,), ""),
    "activation_checkpoint.force_recompute_mm_shapes_by_fqns": ((REFUSED,), ""),
    "activation_checkpoint.memory_budget": ((REFUSED,), ""),
    "activation_checkpoint.visualize_memory_budget_pareto": ((REFUSED,), ""),
    # step time the cost model does not see: the plan says so
    "training.disable_cuda_graphs": ((CONSTRAINT, NOTED),
                                     "off: pp (and ep under a dispatcher that synchronizes with "
                                     "the host) held at 1"),
    "override.imports": ((NOTED,), ""),
    # no effect on placements, memory or step time
    **{key: ((PASSED,), "") for key in (
        "training.steps", "parallelism.spmd_backend",
        "parallelism.context_parallel_ptrr_mask_key", "training.gc_freq", "training.gc_debug",
        "dataloader.", "validator.", "checkpoint.", "comm.", "debug.", "profiler.", "metrics.",
        "lr_scheduler.", "optimizer.", "override.", "loss.", "tokenizer.", "dump_folder",
        "hf_assets_path")},
}
"""Every TorchTitan 0.3.0 command-line key under auto (an exact key, or a section prefix ending
in "."; the longest match wins), with its ``KeyHandling`` words (``titan/keys.py``, shared with
0.2.2's ``settings.SETTINGS``) and a note. A test walks 0.3.0's config dataclasses so that a
key added upstream cannot slip through."""

REFUSED_WHY = {
    "parallelism.enable_sequence_parallel": "TP blocks are planned and costed with sequence "
    "parallel",
    "parallelism.enable_fsdp_symm_mem": "FSDP collectives are costed as NCCL ring collectives",
    "parallelism.context_parallel_load_balancer": "context parallel is costed load-balanced "
    "(headtail)",
    "activation_checkpoint.force_recompute_mm_shapes_by_fqns": "selective AC is costed with "
    "TorchTitan's default save list",
    "activation_checkpoint.memory_budget": "the planner chooses AC per block (none / selective "
    "/ full)",
    "activation_checkpoint.visualize_memory_budget_pareto": "the planner chooses AC per block "
    "(none / selective / full)",
}
"""The keys ``check_keys`` refuses whenever the job sets them (the planner assumes TorchTitan's
default), and why. The stage-split keys are refused by ``job.inputs.check_stage_split_keys``."""


def handling_of(key: str) -> Handling | None:
    """How auto handles a 0.3.0 config key (``KEYS``; None: unclassified)."""
    if key in KEYS:
        return KEYS[key][0]
    prefixes = [p for p in KEYS if p.endswith(".") and key.startswith(p)]
    return KEYS[max(prefixes, key=len)][0] if prefixes else None


def check_keys(config: Config) -> list[str]:
    """Refuse, in one line, keys the planner assumes at TorchTitan's default when the user
    set them under auto, and a training dtype other than float32 (``DTYPE_NOTE``); the notes
    for keys whose effect the cost model does not see."""
    if config.training.dtype != "float32":
        raise UserError(f"--training.dtype {config.training.dtype} with --parallelism.auto: the "
                        "planner costs float32 parameters, gradients and optimizer state; set "
                        "--training.dtype float32 (--training.mixed_precision_param bfloat16 "
                        "computes in bf16) or drop --parallelism.auto")
    notes = []
    for key in sorted(explicit_of(config)):
        if key in REFUSED_WHY:
            raise UserError(f"{key} is set with parallelism.auto: {REFUSED_WHY[key]}; leave it "
                            "at TorchTitan's default or drop --parallelism.auto")
        if key in NOTED_WHY:
            notes.append(NOTED_WHY[key].format(value=override_targets(config)))
    return notes


NOTED_WHY = {
    "training.disable_cuda_graphs": "training.disable_cuda_graphs is set: CUDA graphs change "
    "the host overhead per step, which the cost model charges as without them",
    "override.imports": "override.imports {value}: kernels that replace the model's ops, which "
    "the cost model does not see (step time costed as the ops they replace)",
}
"""What the plan says of a noted key the job sets."""


def keys_table() -> str:
    """Every entry of ``KEYS`` as the Markdown table in docs/settings.md (a key ending in "."
    stands for its section)."""
    def note(key: str, text: str) -> str:
        said = [text, f"set: {REFUSED_WHY[key]}" if key in REFUSED_WHY else "",
                NOTED_WHY.get(key, "").replace(" {value}", "")]
        return "; ".join(part for part in said if part)

    return handling_table([(f"`--{key}*`" if key.endswith(".") else f"`--{key}`", handling,
                            note(key, text)) for key, (handling, text) in KEYS.items()])


def override_targets(config: Any) -> list[str]:
    """The ``module.function`` targets of ``override.imports``."""
    return [item if isinstance(item, str) else str(item[0])
            for item in getattr(getattr(config, "override", None), "imports", None) or []]


FIXED_BY_RELEASE = {"parallelism.expert_tensor_parallel_degree": 1,
                    "parallelism.pipeline_parallel_expert_parallel_overlap": False}
"""Planning keys TorchTitan 0.3.0 has no setting for, at the value it runs."""


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
    from .model import HF_BACKEND, HF_SECTION

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
