"""Every key of TorchTitan 0.3.0's command line and what ``--parallelism.auto`` does with it.

One row per ``section.key`` (or section prefix): how auto handles it (one or more
``KeyHandling`` words of ``titan/keys.py``, the vocabulary both releases share) and a short note;
the keys refused whenever set and the notes for keys whose effect the cost model does not see.
The docs/settings.md table is generated from it (``scripts/make_docs.py``), as 0.2.2's is from
its ``settings.py``."""

from __future__ import annotations

from typing import Any

from ...errors import UserError
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
from .config import Config, explicit_of

_FIXED_WHEN_SET = ((CONSTRAINT, SEARCHED), "set: fixed; unset: searched")
DTYPE_NOTE = "bfloat16: refused (the cost model charges float32 state)"
_STAGE_SPLIT = ((REFUSED,), "set: the planner splits the stages")
SETTINGS: dict[str, tuple[Handling, str]] = {
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
    "parallelism.enable_fsdp_symm_mem": ((REFUSED,), ""),
    "parallelism.context_parallel_load_balancer": ((REFUSED,), ""),
    "activation_checkpoint.force_recompute_mm_shapes_by_fqns": ((REFUSED,), ""),
    "activation_checkpoint.memory_budget": ((REFUSED,), ""),
    "activation_checkpoint.visualize_memory_budget_pareto": ((REFUSED,), ""),
    # step time the cost model does not see: the plan says so
    "parallelism.enable_sequence_parallel": ((APPLIED, CONSTRAINT),
                                             "off: tensor-parallel blocks run without sequence "
                                             "parallel (tp_mode 'sp/sp:rep'; the HF backend and "
                                             "qwen3_5: tp held at 1)"),
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
    """How auto handles a 0.3.0 config key (``SETTINGS``; None: unclassified)."""
    if key in SETTINGS:
        return SETTINGS[key][0]
    prefixes = [p for p in SETTINGS if p.endswith(".") and key.startswith(p)]
    return SETTINGS[max(prefixes, key=len)][0] if prefixes else None


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


def settings_table() -> str:
    """Every entry of ``SETTINGS`` as the Markdown table in docs/settings.md (a key ending in "."
    stands for its section)."""
    def note(key: str, text: str) -> str:
        said = [text, f"set: {REFUSED_WHY[key]}" if key in REFUSED_WHY else "",
                NOTED_WHY.get(key, "").replace(" {value}", "")]
        return "; ".join(part for part in said if part)

    return handling_table([(f"`--{key}*`" if key.endswith(".") else f"`--{key}`", handling,
                            note(key, text)) for key, (handling, text) in SETTINGS.items()])


def override_targets(config: Any) -> list[str]:
    """The ``module.function`` targets of ``override.imports``."""
    return [item if isinstance(item, str) else str(item[0])
            for item in getattr(getattr(config, "override", None), "imports", None) or []]
