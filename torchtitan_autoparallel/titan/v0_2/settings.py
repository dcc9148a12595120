"""Every key of TorchTitan 0.2.2's JobConfig and what ``parallelism.auto = true`` does with it.

One row per ``section.key``: how auto treats it (one or more of ``HOWS``) and a short note. The
docs/settings.md explains the keys that change parallel execution, memory or step time;
``tests/test_settings_keys.py`` fails when TorchTitan's JobConfig has a key without a row here
(or a row names no key), so a key added upstream cannot slip through unclassified.
"""

from __future__ import annotations

HOWS = ("searched", "constraint", "applied", "costed", "error", "none")
"""searched: the planner chooses it; constraint: it restricts the search; applied: run as set
under every plan; costed: the cost model charges for it; error: refused with one line before
any rank starts (for the values the note names); none: changes neither parallel execution,
memory nor step time."""

_NONE = ("none", "")

SETTINGS: dict[str, tuple[str, str]] = {
    # [job]
    "job.config_file": _NONE,
    "job.dump_folder": _NONE,
    "job.description": _NONE,
    "job.print_config": _NONE,
    "job.save_config_file": _NONE,
    "job.custom_config_module": ("applied", "the project's [autoparallel] section is merged in"),
    # [profiling]
    "profiling.enable_profiling": ("applied, error", "without a GPU: error"),
    "profiling.save_traces_folder": _NONE,
    "profiling.profile_freq": _NONE,
    "profiling.profiler_active": _NONE,
    "profiling.profiler_warmup": _NONE,
    "profiling.enable_memory_snapshot": ("applied, error", "without a GPU: error"),
    "profiling.save_memory_snapshot_folder": _NONE,
    # [metrics]
    "metrics.log_freq": _NONE,
    "metrics.enable_tensorboard": _NONE,
    "metrics.disable_color_printing": _NONE,
    "metrics.save_tb_folder": _NONE,
    "metrics.save_for_all_ranks": _NONE,
    "metrics.enable_wandb": _NONE,
    # [model]
    "model.name": ("applied, error", "planned for; not a registered train spec: error"),
    "model.flavor": ("applied, error", "planned for; unknown flavor: error"),
    "model.hf_assets_path": _NONE,
    "model.tokenizer_path": _NONE,
    "model.converters": ("applied, costed, constraint, error",
                         "float8 / MX / grouped-GEMM converters (docs/settings.md); a name no "
                         "converter is registered under: error"),
    "model.print_after_conversion": _NONE,
    # [optimizer]
    "optimizer.name": ("applied, error", "Adam / AdamW (same state, costed); others: error"),
    "optimizer.lr": _NONE,
    "optimizer.beta1": _NONE,
    "optimizer.beta2": _NONE,
    "optimizer.eps": _NONE,
    "optimizer.weight_decay": _NONE,
    "optimizer.implementation": ("applied, costed", "the optimizer step's temporaries"),
    "optimizer.early_step_in_backward": (
        "applied, constraint, error",
        "no DDP, PP, EP or gradient accumulation in the search; fixed degrees needing one: error"),
    # [lr_scheduler]
    "lr_scheduler.warmup_steps": _NONE,
    "lr_scheduler.total_steps": _NONE,
    "lr_scheduler.decay_ratio": _NONE,
    "lr_scheduler.decay_type": _NONE,
    "lr_scheduler.min_lr_factor": _NONE,
    # [training]
    "training.dataset": ("applied", "the project's datasets: its global-batch loader"),
    "training.dataset_path": _NONE,
    "training.local_batch_size": ("searched", ""),
    "training.global_batch_size": ("constraint", "-1: local batch x data-parallel degree"),
    "training.seq_len": ("applied, costed", "planned for"),
    "training.max_norm": ("applied", "not with early_step_in_backward (as in TorchTitan)"),
    "training.steps": _NONE,
    "training.enable_cpu_offload": ("applied, costed, error",
                                    "a plan without FSDP, or a machine without a GPU: error"),
    "training.dtype": ("error", "float32 only"),
    "training.mixed_precision_param": ("applied, costed", ""),
    "training.mixed_precision_reduce": ("applied, costed", ""),
    "training.gc_freq": _NONE,
    "training.gc_debug": _NONE,
    "training.dataloader.num_workers": ("applied, error",
                                        "TorchTitan's datasets; the project's: error if set"),
    "training.dataloader.persistent_workers": ("applied, error",
                                               "TorchTitan's datasets; the project's: error if "
                                               "set"),
    "training.dataloader.pin_memory": ("applied, error",
                                       "TorchTitan's datasets; the project's: error if set"),
    "training.dataloader.prefetch_factor": ("applied, error",
                                            "TorchTitan's datasets; the project's: error if set"),
    # [parallelism]
    "parallelism.data_parallel_replicate_degree": ("constraint, searched", "not 1: fixed"),
    "parallelism.data_parallel_shard_degree": ("constraint, searched", "not -1: fixed"),
    "parallelism.fsdp_reshard_after_forward": ("constraint, searched", "default: searched"),
    "parallelism.tensor_parallel_degree": ("constraint, searched", "not 1: fixed"),
    "parallelism.disable_loss_parallel": ("applied", ""),
    "parallelism.enable_async_tensor_parallel": ("applied, costed, error", "without compile"),
    "parallelism.pipeline_parallel_degree": ("constraint, searched", "not 1: fixed"),
    "parallelism.module_fqns_per_model_part": ("error", "the planner splits the stages"),
    "parallelism.pipeline_parallel_first_stage_less_layers": ("error",
                                                              "the planner splits the stages"),
    "parallelism.pipeline_parallel_last_stage_less_layers": ("error",
                                                             "the planner splits the stages"),
    "parallelism.pipeline_parallel_layers_per_stage": ("error", "the planner splits the stages"),
    "parallelism.pipeline_parallel_schedule": ("constraint, searched", "1F1B: searched"),
    "parallelism.pipeline_parallel_schedule_csv": ("error", "the planner splits the stages"),
    "parallelism.pipeline_parallel_microbatch_size": ("constraint, searched", "1: searched"),
    "parallelism.pipeline_parallel_expert_parallel_overlap": ("applied, costed, error",
                                                              "DualPipeV with AC: error"),
    "parallelism.context_parallel_degree": ("constraint, searched", "not 1: fixed"),
    "parallelism.context_parallel_load_balancer": ("applied", ""),
    "parallelism.context_parallel_rotate_method": ("applied", ""),
    "parallelism.expert_parallel_degree": ("constraint, searched", "not 1: fixed"),
    "parallelism.expert_tensor_parallel_degree": ("constraint, searched", "not 1: fixed"),
    "parallelism.expert_parallel_comm_backend": ("applied, error", "deepep: error"),
    # [checkpoint]: saves and loads happen between steps
    "checkpoint.enable": ("applied", ""),
    "checkpoint.enable_ft_dataloader_checkpoints": ("none", "fault tolerance only (refused)"),
    "checkpoint.folder": _NONE,
    "checkpoint.interval": _NONE,
    "checkpoint.initial_load_path": _NONE,
    "checkpoint.initial_load_model_only": _NONE,
    "checkpoint.initial_load_in_hf": _NONE,
    "checkpoint.initial_load_in_hf_quantized": _NONE,
    "checkpoint.last_save_model_only": _NONE,
    "checkpoint.last_save_in_hf": _NONE,
    "checkpoint.export_dtype": _NONE,
    "checkpoint.async_mode": ("applied, error",
                              "staging copies go to host memory, not the device's; "
                              "async_with_pinned_mem without a GPU: error"),
    "checkpoint.keep_latest_k": _NONE,
    "checkpoint.load_step": _NONE,
    "checkpoint.exclude_from_loading": _NONE,
    "checkpoint.enable_first_step_checkpoint": _NONE,
    "checkpoint.create_seed_checkpoint": ("applied, error", "needs one rank"),
    "checkpoint.load_only": _NONE,
    # [activation_checkpoint]
    "activation_checkpoint.mode": ("searched, constraint, error",
                                   "unset: per block; set: every block; memory_budget: error"),
    "activation_checkpoint.selective_ac_option": (
        "applied, constraint", "pinned blocks; an integer k: every k-th searched block full"),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": ("applied", ""),
    "activation_checkpoint.early_stop": ("applied", ""),
    "activation_checkpoint.memory_budget": ("error", "mode memory_budget only"),
    "activation_checkpoint.visualize_memory_budget_pareto": ("error", "mode memory_budget only"),
    "activation_checkpoint.preserve_rng_state": ("applied", ""),
    "activation_checkpoint.determinism_check": ("applied", ""),
    "activation_checkpoint.debug": ("applied", ""),
    # [compile]
    "compile.enable": ("applied, costed", ""),
    "compile.components": ("applied, costed", ""),
    "compile.backend": ("applied, error", "without CUDA: aot_eager / eager only; TP + SP "
                        "blocks with aot_eager on CPU: error"),
    # [quantize]
    "quantize.linear.float8.enable_fsdp_float8_all_gather": ("applied, costed, error",
                                                             "with recipe_name: error"),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": ("applied", ""),
    "quantize.linear.float8.recipe_name": ("applied, costed", ""),
    "quantize.linear.float8.filter_fqns": ("searched, constraint, costed",
                                           "unset: linears where float8 is predicted slower "
                                           "stay bf16; set: applied and costed as written"),
    "quantize.linear.float8.emulate": ("applied, error", "with compile: error"),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": ("error", "the MX converter: error"),
    "quantize.linear.mx.recipe_name": ("error", "the MX converter: error"),
    "quantize.linear.mx.filter_fqns": ("error", "the MX converter: error"),
    "quantize.grouped_mm.float8.fqns": ("error", "the grouped-GEMM converters: error"),
    "quantize.grouped_mm.mx.recipe_name": ("error", "the grouped-GEMM converters: error"),
    "quantize.grouped_mm.mx.fqns": ("error", "the grouped-GEMM converters: error"),
    # [comm]
    "comm.init_timeout_seconds": _NONE,
    "comm.train_timeout_seconds": _NONE,
    "comm.trace_buf_size": _NONE,
    "comm.save_traces_folder": _NONE,
    "comm.save_traces_file_prefix": _NONE,
    "comm.mode": ("applied", "fake_backend: the dry run"),
    # [memory_estimation]
    "memory_estimation.enable": ("error", "TorchTitan 0.2.2 reads it nowhere; the plan predicts"),
    "memory_estimation.disable_fake_mode": ("none", "read nowhere"),
    # [fault_tolerance]: the other keys are read only with enable
    "fault_tolerance.enable": ("error", "replica groups are not planned"),
    "fault_tolerance.process_group": ("none", "only with enable (refused)"),
    "fault_tolerance.process_group_timeout_ms": ("none", "only with enable (refused)"),
    "fault_tolerance.replica_id": ("none", "only with enable (refused)"),
    "fault_tolerance.group_size": ("none", "only with enable (refused)"),
    "fault_tolerance.min_replica_size": ("none", "only with enable (refused)"),
    "fault_tolerance.semi_sync_method": ("none", "only with enable (refused)"),
    # [experimental]
    "experimental.custom_import": ("applied", "imported before planning"),
    "experimental.custom_args_module": ("applied", ""),
    # [validation]: between training steps
    "validation.enable": ("applied, constraint, error",
                          "no PP in the search, no CP for another seq_len; fixed pp / cp the "
                          "validation batches cannot run: error"),
    "validation.dataset": _NONE,
    "validation.dataset_path": _NONE,
    "validation.local_batch_size": ("applied, error", "under PP: the plan's local batch"),
    "validation.seq_len": ("applied, constraint, error",
                           "above training.seq_len: error; see validation.enable"),
    "validation.freq": _NONE,
    "validation.steps": _NONE,
    "validation.dataloader.num_workers": ("applied", "TorchTitan's validation loader"),
    "validation.dataloader.persistent_workers": ("applied", "TorchTitan's validation loader"),
    "validation.dataloader.pin_memory": ("applied", "TorchTitan's validation loader"),
    "validation.dataloader.prefetch_factor": ("applied", "TorchTitan's validation loader"),
    # [debug]
    "debug.seed": ("applied", ""),
    "debug.deterministic": ("applied", ""),
    "debug.deterministic_warn_only": ("applied", ""),
    "debug.moe_force_load_balance": ("applied, costed", "MoE load imbalance 1"),
}


def settings_table() -> str:
    """Every key of ``SETTINGS`` as the Markdown table in docs/settings.md."""
    from .. import markdown_table

    rows = [(f"`{key}`", how, note) for key, (how, note) in SETTINGS.items()]
    return markdown_table(("key", "under auto", "note"), rows)
