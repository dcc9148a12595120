"""Every key of TorchTitan 0.2.2's JobConfig and what ``parallelism.auto = true`` does with it.

One row per ``section.key``: how auto handles it (one or more ``KeyHandling`` words of
``titan/keys.py``, the vocabulary both releases share) and a short note. The docs/settings.md
explains the keys that change parallel execution, memory or step time;
``tests/test_settings_keys.py`` fails when TorchTitan's JobConfig has a key without a row here
(or a row names no key), so a key added upstream cannot slip through unclassified.
"""

from __future__ import annotations

from ..keys import APPLIED, CONSTRAINT, COSTED, PASSED, REFUSED, SEARCHED, Handling, handling_table

_PASSED = ((PASSED,), "")

SETTINGS: dict[str, tuple[Handling, str]] = {
    # [job]
    "job.config_file": _PASSED,
    "job.dump_folder": _PASSED,
    "job.description": _PASSED,
    "job.print_config": _PASSED,
    "job.save_config_file": _PASSED,
    "job.custom_config_module": ((APPLIED,), "the project's [autoparallel] section is merged in"),
    # [profiling]
    "profiling.enable_profiling": ((APPLIED, REFUSED), "without a GPU: refused"),
    "profiling.save_traces_folder": _PASSED,
    "profiling.profile_freq": _PASSED,
    "profiling.profiler_active": _PASSED,
    "profiling.profiler_warmup": _PASSED,
    "profiling.enable_memory_snapshot": ((APPLIED, REFUSED), "without a GPU: refused"),
    "profiling.save_memory_snapshot_folder": _PASSED,
    # [metrics]
    "metrics.log_freq": _PASSED,
    "metrics.enable_tensorboard": _PASSED,
    "metrics.disable_color_printing": _PASSED,
    "metrics.save_tb_folder": _PASSED,
    "metrics.save_for_all_ranks": _PASSED,
    "metrics.enable_wandb": _PASSED,
    # [model]
    "model.name": ((APPLIED, REFUSED), "planned for; not a registered train spec: refused"),
    "model.flavor": ((APPLIED, REFUSED), "planned for; unknown flavor: refused"),
    "model.hf_assets_path": _PASSED,
    "model.tokenizer_path": _PASSED,
    "model.converters": ((APPLIED, COSTED, CONSTRAINT, REFUSED),
                         "float8 / MX / grouped-GEMM converters (docs/settings.md); a name no "
                         "converter is registered under: refused"),
    "model.print_after_conversion": _PASSED,
    # [optimizer]
    "optimizer.name": ((APPLIED, REFUSED), "Adam / AdamW (same state, costed); others: refused"),
    "optimizer.lr": _PASSED,
    "optimizer.beta1": _PASSED,
    "optimizer.beta2": _PASSED,
    "optimizer.eps": _PASSED,
    "optimizer.weight_decay": _PASSED,
    "optimizer.implementation": ((APPLIED, COSTED), "the optimizer step's temporaries"),
    "optimizer.early_step_in_backward": (
        (APPLIED, CONSTRAINT, REFUSED),
        "no DDP, PP, EP or gradient accumulation in the search; fixed degrees needing one: "
        "refused"),
    # [lr_scheduler]
    "lr_scheduler.warmup_steps": _PASSED,
    "lr_scheduler.total_steps": _PASSED,
    "lr_scheduler.decay_ratio": _PASSED,
    "lr_scheduler.decay_type": _PASSED,
    "lr_scheduler.min_lr_factor": _PASSED,
    # [training]
    "training.dataset": ((APPLIED,), "the project's datasets: its global-batch loader"),
    "training.dataset_path": _PASSED,
    "training.local_batch_size": ((SEARCHED,), ""),
    "training.global_batch_size": ((CONSTRAINT,), "-1: local batch x data-parallel degree"),
    "training.seq_len": ((APPLIED, COSTED), "planned for"),
    "training.max_norm": ((APPLIED,), "not with early_step_in_backward (as in TorchTitan)"),
    "training.steps": _PASSED,
    "training.enable_cpu_offload": ((APPLIED, COSTED, REFUSED),
                                    "a plan without FSDP, or a machine without a GPU: refused"),
    "training.dtype": ((APPLIED, REFUSED), "bfloat16: refused (the cost model charges float32 "
                                          "state)"),
    "training.mixed_precision_param": ((APPLIED, COSTED), ""),
    "training.mixed_precision_reduce": ((APPLIED, COSTED), ""),
    "training.gc_freq": _PASSED,
    "training.gc_debug": _PASSED,
    "training.dataloader.num_workers": ((APPLIED, REFUSED),
                                        "TorchTitan's datasets; the project's: refused if set"),
    "training.dataloader.persistent_workers": ((APPLIED, REFUSED),
                                               "TorchTitan's datasets; the project's: refused if "
                                               "set"),
    "training.dataloader.pin_memory": ((APPLIED, REFUSED),
                                       "TorchTitan's datasets; the project's: refused if set"),
    "training.dataloader.prefetch_factor": ((APPLIED, REFUSED),
                                            "TorchTitan's datasets; the project's: refused if set"),
    # [parallelism]
    "parallelism.data_parallel_replicate_degree": ((CONSTRAINT, SEARCHED), "not 1: fixed"),
    "parallelism.data_parallel_shard_degree": ((CONSTRAINT, SEARCHED), "not -1: fixed"),
    "parallelism.fsdp_reshard_after_forward": ((CONSTRAINT, SEARCHED), "default: searched"),
    "parallelism.tensor_parallel_degree": ((CONSTRAINT, SEARCHED), "not 1: fixed"),
    "parallelism.disable_loss_parallel": ((APPLIED,), ""),
    "parallelism.enable_async_tensor_parallel": ((APPLIED, COSTED, REFUSED), "without compile"),
    "parallelism.pipeline_parallel_degree": ((CONSTRAINT, SEARCHED), "not 1: fixed"),
    "parallelism.module_fqns_per_model_part": ((REFUSED,), "the planner splits the stages"),
    "parallelism.pipeline_parallel_first_stage_less_layers": ((REFUSED,),
                                                              "the planner splits the stages"),
    "parallelism.pipeline_parallel_last_stage_less_layers": ((REFUSED,),
                                                             "the planner splits the stages"),
    "parallelism.pipeline_parallel_layers_per_stage": ((REFUSED,), "the planner splits the stages"),
    "parallelism.pipeline_parallel_schedule": ((CONSTRAINT, SEARCHED), "1F1B: searched"),
    "parallelism.pipeline_parallel_schedule_csv": ((REFUSED,), "the planner splits the stages"),
    "parallelism.pipeline_parallel_microbatch_size": ((CONSTRAINT, SEARCHED), "1: searched"),
    "parallelism.pipeline_parallel_expert_parallel_overlap": ((APPLIED, COSTED, REFUSED),
                                                              "DualPipeV with AC: refused"),
    "parallelism.context_parallel_degree": ((CONSTRAINT, SEARCHED), "not 1: fixed"),
    "parallelism.context_parallel_load_balancer": ((APPLIED,), ""),
    "parallelism.context_parallel_rotate_method": ((APPLIED,), ""),
    "parallelism.expert_parallel_degree": ((CONSTRAINT, SEARCHED), "not 1: fixed"),
    "parallelism.expert_tensor_parallel_degree": ((CONSTRAINT, SEARCHED), "not 1: fixed"),
    "parallelism.expert_parallel_comm_backend": ((APPLIED, REFUSED), "deepep: refused"),
    # [checkpoint]: saves and loads happen between steps
    "checkpoint.enable": ((APPLIED,), ""),
    "checkpoint.enable_ft_dataloader_checkpoints": ((PASSED,), "fault tolerance only (refused)"),
    "checkpoint.folder": _PASSED,
    "checkpoint.interval": _PASSED,
    "checkpoint.initial_load_path": _PASSED,
    "checkpoint.initial_load_model_only": _PASSED,
    "checkpoint.initial_load_in_hf": _PASSED,
    "checkpoint.initial_load_in_hf_quantized": _PASSED,
    "checkpoint.last_save_model_only": _PASSED,
    "checkpoint.last_save_in_hf": _PASSED,
    "checkpoint.export_dtype": _PASSED,
    "checkpoint.async_mode": ((APPLIED, REFUSED),
                              "staging copies go to host memory, not the device's; "
                              "async_with_pinned_mem without a GPU: refused"),
    "checkpoint.keep_latest_k": _PASSED,
    "checkpoint.load_step": _PASSED,
    "checkpoint.exclude_from_loading": _PASSED,
    "checkpoint.enable_first_step_checkpoint": _PASSED,
    "checkpoint.create_seed_checkpoint": ((APPLIED, REFUSED), "needs one rank"),
    "checkpoint.load_only": _PASSED,
    # [activation_checkpoint]
    "activation_checkpoint.mode": ((SEARCHED, CONSTRAINT, REFUSED),
                                   "unset: per block; set: every block; memory_budget: refused"),
    "activation_checkpoint.selective_ac_option": (
        (APPLIED, CONSTRAINT), "pinned blocks; an integer k: every k-th searched block full"),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": ((APPLIED,), ""),
    "activation_checkpoint.early_stop": ((APPLIED,), ""),
    "activation_checkpoint.memory_budget": ((REFUSED,), "mode memory_budget only"),
    "activation_checkpoint.visualize_memory_budget_pareto": ((REFUSED,), "mode memory_budget only"),
    "activation_checkpoint.preserve_rng_state": ((APPLIED,), ""),
    "activation_checkpoint.determinism_check": ((APPLIED,), ""),
    "activation_checkpoint.debug": ((APPLIED,), ""),
    # [compile]
    "compile.enable": ((APPLIED, COSTED), ""),
    "compile.components": ((APPLIED, COSTED), ""),
    "compile.backend": ((APPLIED, REFUSED), "without CUDA: aot_eager / eager only; TP + SP "
                        "blocks with aot_eager on CPU: refused"),
    # [quantize]
    "quantize.linear.float8.enable_fsdp_float8_all_gather": ((APPLIED, COSTED, REFUSED),
                                                             "with recipe_name: refused"),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": ((APPLIED,), ""),
    "quantize.linear.float8.recipe_name": ((APPLIED, COSTED), ""),
    "quantize.linear.float8.filter_fqns": ((SEARCHED, CONSTRAINT, COSTED),
                                           "unset: linears where float8 is predicted slower "
                                           "stay bf16; set: applied and costed as written"),
    "quantize.linear.float8.emulate": ((APPLIED, REFUSED), "with compile: refused"),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": ((REFUSED,), "the MX converter: refused"),
    "quantize.linear.mx.recipe_name": ((REFUSED,), "the MX converter: refused"),
    "quantize.linear.mx.filter_fqns": ((REFUSED,), "the MX converter: refused"),
    "quantize.grouped_mm.float8.fqns": ((REFUSED,), "the grouped-GEMM converters: refused"),
    "quantize.grouped_mm.mx.recipe_name": ((REFUSED,), "the grouped-GEMM converters: refused"),
    "quantize.grouped_mm.mx.fqns": ((REFUSED,), "the grouped-GEMM converters: refused"),
    # [comm]
    "comm.init_timeout_seconds": _PASSED,
    "comm.train_timeout_seconds": _PASSED,
    "comm.trace_buf_size": _PASSED,
    "comm.save_traces_folder": _PASSED,
    "comm.save_traces_file_prefix": _PASSED,
    "comm.mode": ((APPLIED,), "fake_backend: the dry run"),
    # [memory_estimation]
    "memory_estimation.enable": ((REFUSED,),
                                 "TorchTitan 0.2.2 reads it nowhere; the plan predicts"),
    "memory_estimation.disable_fake_mode": ((PASSED,), "read nowhere"),
    # [fault_tolerance]: the other keys are read only with enable
    "fault_tolerance.enable": ((REFUSED,), "replica groups are not planned"),
    "fault_tolerance.process_group": ((PASSED,), "only with enable (refused)"),
    "fault_tolerance.process_group_timeout_ms": ((PASSED,), "only with enable (refused)"),
    "fault_tolerance.replica_id": ((PASSED,), "only with enable (refused)"),
    "fault_tolerance.group_size": ((PASSED,), "only with enable (refused)"),
    "fault_tolerance.min_replica_size": ((PASSED,), "only with enable (refused)"),
    "fault_tolerance.semi_sync_method": ((PASSED,), "only with enable (refused)"),
    # [experimental]
    "experimental.custom_import": ((APPLIED,), "imported before planning"),
    "experimental.custom_args_module": ((APPLIED,), ""),
    # [validation]: between training steps
    "validation.enable": ((APPLIED, CONSTRAINT, REFUSED),
                          "no PP in the search, no CP for another seq_len; fixed pp / cp the "
                          "validation batches cannot run: refused"),
    "validation.dataset": _PASSED,
    "validation.dataset_path": _PASSED,
    "validation.local_batch_size": ((APPLIED, REFUSED), "under PP: the plan's local batch"),
    "validation.seq_len": ((APPLIED, CONSTRAINT, REFUSED),
                           "above training.seq_len: refused; see validation.enable"),
    "validation.freq": _PASSED,
    "validation.steps": _PASSED,
    "validation.dataloader.num_workers": ((APPLIED,), "TorchTitan's validation loader"),
    "validation.dataloader.persistent_workers": ((APPLIED,), "TorchTitan's validation loader"),
    "validation.dataloader.pin_memory": ((APPLIED,), "TorchTitan's validation loader"),
    "validation.dataloader.prefetch_factor": ((APPLIED,), "TorchTitan's validation loader"),
    # [debug]
    "debug.seed": ((APPLIED,), ""),
    "debug.deterministic": ((APPLIED,), ""),
    "debug.deterministic_warn_only": ((APPLIED,), ""),
    "debug.moe_force_load_balance": ((APPLIED, COSTED), "MoE load imbalance 1"),
}


def settings_table() -> str:
    """Every key of ``SETTINGS`` as the Markdown table in docs/settings.md."""
    return handling_table([(f"`{key}`", handling, note)
                           for key, (handling, note) in SETTINGS.items()])
