"""Every TorchTitan setting in the README's "TorchTitan settings under auto" table is honoured or
refused: each test here names the keys it covers. Plans are built in-process on the meta device
across a fake process group of 8 ranks (``settings_harness``): TorchTitan's converters, then
``apply_plan``, as its Trainer does; what was built is read back from the modules."""

import functools

import pytest
import torch

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.plan.built import block_features, fsdp_group

from tests.support.settings_harness import build, fake_process_group

LLAMA = "llama3_debug_auto.toml"
TP2 = ("--parallelism.tensor_parallel_degree=2", "--autoparallel.techniques=fsdp,tp")
FSDP = ("--parallelism.data_parallel_shard_degree=8",)


@pytest.fixture(scope="module", autouse=True)
def fake_pg():
    with fake_process_group():
        yield


def hook_partials(module: torch.nn.Module) -> list[functools.partial]:
    """The DTensor parallel-style functions (input / output preparation) hooked on ``module``."""
    found = []
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for hook in hooks.values():
            for cell in getattr(hook, "__closure__", None) or ():
                if isinstance(cell.cell_contents, functools.partial):
                    found.append(cell.cell_contents)
    return found


# [parallelism] degrees: a value other than the default fixes the mesh dim (a constraint)
@pytest.mark.parametrize("config,key,value,dim", [
    (LLAMA, "data_parallel_replicate_degree", 2, "dp_replicate"),
    (LLAMA, "data_parallel_shard_degree", 4, "dp_shard"),
    (LLAMA, "tensor_parallel_degree", 2, "tp"),
    (LLAMA, "context_parallel_degree", 2, "cp"),
    ("deepseek_v3_debug_auto.toml", "expert_parallel_degree", 4, "ep"),
    ("deepseek_v3_debug_auto.toml", "expert_tensor_parallel_degree", 2, "etp"),
])
def test_degree_is_a_constraint(config, key, value, dim):
    # etp alone: the planner picks an ep that can use it (etp = tp, so tp is fixed too)
    extra = ("--parallelism.tensor_parallel_degree=2",) if dim == "etp" else ()
    model, job, plan = build(config, f"--parallelism.{key}={value}", *extra)
    assert getattr(plan.mesh, dim) == value
    if dim == "etp":
        assert plan.mesh.ep > 1
    assert getattr(job.parallelism, key) == value  # the mesh TorchTitan builds


def prepared(config: str, *overrides: str):
    """(job config as TorchTitan will run it, plan) of a planned job, without building."""
    from torchtitan_autoparallel.titan.v0_2.job import check_config, parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register
    from torchtitan_autoparallel.titan.v0_2.train import prepare_planned_job

    register()
    job = parse_config(["--job.config_file", f"train_configs/{config}", *overrides])
    check_config(job, cpu=False, dry_run=True)
    return job, prepare_planned_job(job, write=False)


def test_pipeline_settings_reach_torchtitan():
    """pipeline_parallel_degree: a constraint; the schedule, micro-batch size and stage split
    are the plan's and TorchTitan's ``pipeline_llm`` builds exactly those
    (``module_fqns_per_model_part``); a non-default schedule or micro-batch size is a
    constraint. Parity of the built pipelines: test_pipeline_parity.py."""
    job, plan = prepared(LLAMA, "--parallelism.pipeline_parallel_degree=2",
                         "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                         "--parallelism.pipeline_parallel_microbatch_size=2")
    par = job.parallelism
    assert plan.mesh.pp == par.pipeline_parallel_degree == 2
    assert plan.pipeline.schedule == par.pipeline_parallel_schedule == "Interleaved1F1B"
    assert plan.pipeline.microbatch_size == par.pipeline_parallel_microbatch_size == 2
    assert par.module_fqns_per_model_part == plan.pipeline.stages
    assert par.pipeline_parallel_layers_per_stage is None
    assert job.training.local_batch_size == plan.local_batch_size == (
        plan.pipeline.microbatches * 2)


def test_pipeline_schedules_searched():
    """The default schedule (1F1B) leaves the schedule to the search, over
    ``autoparallel.pp_schedules`` when set; ``pp_stages_per_rank`` fixes the stages per rank."""
    _, free = prepared(LLAMA, "--parallelism.pipeline_parallel_degree=2")
    assert free.pipeline.schedule != "1F1B"  # the cheaper zero-bubble schedules win here
    _, fixed = prepared(LLAMA, "--parallelism.pipeline_parallel_degree=2",
                        "--autoparallel.pp_schedules=GPipe")
    assert fixed.pipeline.schedule == "GPipe"
    _, three = prepared(LLAMA, "--parallelism.pipeline_parallel_degree=2",
                        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                        "--autoparallel.pp_stages_per_rank=3")
    assert three.pipeline.stages_per_rank == 3 and len(three.pipeline.stages) == 6


def test_pipeline_expert_overlap_is_costed():
    """pipeline_parallel_expert_parallel_overlap: TorchTitan's DualPipeV overlap of the expert
    all-to-all, applied as is and costed (the same plan without it is predicted slower)."""
    overrides = ("--parallelism.pipeline_parallel_degree=2",
                 "--parallelism.pipeline_parallel_schedule=DualPipeV",
                 "--parallelism.expert_parallel_degree=2", "--training.global_batch_size=16")
    _, on = prepared("deepseek_v3_debug_auto.toml", *overrides)
    _, off = prepared("deepseek_v3_debug_auto.toml", *overrides,
                      "--parallelism.no-pipeline_parallel_expert_parallel_overlap")
    assert on.pipeline.schedule == off.pipeline.schedule == "DualPipeV"
    assert on.mesh.ep == off.mesh.ep == 2
    assert on.predicted["step_time_s"] < off.predicted["step_time_s"]


@pytest.mark.parametrize("policy", ["always", "never", "default", None])
def test_fsdp_reshard_after_forward(policy):
    """always / never: a constraint on every FSDP-sharded block; default, set: TorchTitan's
    policy (reshard, no pp here), a constraint too; unset: chosen per block. Either way every
    FSDP group reshards as its plan entry says."""
    extra = (f"--parallelism.fsdp_reshard_after_forward={policy}",) if policy else ()
    model, _, plan = build(LLAMA, *FSDP, *extra)
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    built = block_features(model)
    for layer in blocks:
        assert built[layer.fqn.split(".")[-1]]["reshard_after_forward"] == \
            layer.reshard_after_forward
    if policy:
        assert {layer.reshard_after_forward for layer in blocks} == {policy != "never"}
    by_fqn = {layer.fqn: layer for layer in plan.layers}
    assert fsdp_group(model.tok_embeddings)["reshard_after_forward"] == \
        by_fqn["tok_embeddings"].reshard_after_forward
    assert fsdp_group(model.norm)["reshard_after_forward"] == by_fqn["output"].reshard_after_forward


@pytest.mark.parametrize("disable", [False, True])
def test_disable_loss_parallel(disable):
    """The output projection's TP output layout: vocabulary-sharded logits for the loss-parallel
    cross entropy, or replicated logits when loss parallel is disabled (as TorchTitan)."""
    model, _, plan = build(LLAMA, *TP2, *(("--parallelism.disable_loss_parallel",) * disable))
    assert plan.mesh.tp == 2
    output = [p for p in hook_partials(model.output) if "_prepare_output_fn" in p.func.__name__]
    layouts, use_local = output[0].args
    assert (repr(layouts[0]), use_local) == (("Replicate()", True) if disable
                                             else ("Shard(dim=-1)", False))


def test_async_tp_and_compile_on_tp_blocks():
    """enable_async_tensor_parallel (with compile): TorchTitan's maybe_enable_async_tp on the tp
    mesh; compile.enable / components / backend: every block wrapped by torch.compile."""
    import torch._inductor.config as inductor_config

    before = inductor_config._micro_pipeline_tp
    try:
        model, job, plan = build(LLAMA, *TP2, "--compile.enable", "--compile.backend=aot_eager",
                                 "--compile.components=model,loss",
                                 "--parallelism.enable_async_tensor_parallel")
        assert inductor_config._micro_pipeline_tp
    finally:
        inductor_config._micro_pipeline_tp = before
    built = block_features(model)
    assert all(block["block_compiled"] for block in built.values())
    assert all(block["mesh"] == ["fsdp", "tp"] for block in built.values())
    model, _, _ = build(LLAMA, "--compile.enable", "--compile.components=loss",
                        "--compile.backend=aot_eager")
    assert not any(block["compiled"] for block in block_features(model).values())


def test_moe_compile_matches_torchtitan_recipe():
    """MoE families: TorchTitan's MoE-aware compile (deepseek_v3 / llama4 recipes): dense blocks
    compiled whole, MoE blocks per submodule with the routed experts left out, as the recipe
    builds the same model with expert parallel 2."""
    from torch._dynamo.eval_frame import OptimizedModule

    compile_ = ("--compile.enable", "--compile.backend=aot_eager", "--compile.components=model")
    auto, _, plan = build("deepseek_v3_debug_auto.toml", "--parallelism.expert_parallel_degree=2",
                          "--autoparallel.techniques=fsdp,ep", *compile_)
    recipe, _, _ = build("deepseek_v3_debug_ep.toml", *compile_)
    assert plan.mesh.ep == 2
    def compiled(model):
        return {name: (block["compiled"], block["block_compiled"])
                for name, block in block_features(model).items()}

    assert compiled(auto) == compiled(recipe)
    moe = auto.layers["1"]
    assert not isinstance(moe, OptimizedModule) and isinstance(moe.attention, OptimizedModule)
    assert not isinstance(moe.moe.experts, OptimizedModule)
    assert isinstance(auto.layers["0"], OptimizedModule)


@pytest.mark.parametrize("recipe,styles", [(None, "Float8ColwiseParallel"),
                                           ("rowwise", "ColwiseParallel")])
def test_float8_recipe_and_tp_styles(recipe, styles):
    """quantize.linear.float8 with tensorwise scaling: Float8Linears and TorchTitan's float8 TP
    styles; rowwise (recipe_name): Float8Linears with the plain TP styles, as TorchTitan."""
    extra = (f"--quantize.linear.float8.recipe_name={recipe}",) if recipe else ()
    model, _, _ = build(LLAMA, *TP2, "--model.converters=quantize.linear.float8", *extra)
    assert all(block["float8_linears"] == 7 for block in block_features(model).values())
    wq = model.layers["0"].attention.wq
    assert {p.func.__qualname__.split(".")[0] for p in hook_partials(wq)} == {styles}


def test_float8_all_gather_filter_and_emulate():
    """enable_fsdp_float8_all_gather: FSDP-sharded float8 weights are torchao's float8 all-gather
    tensors; filter_fqns leaves the named linears in high precision; emulate reaches torchao."""
    model, _, _ = build(LLAMA, *FSDP, "--model.converters=quantize.linear.float8",
                        "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                        "--quantize.linear.float8.filter_fqns=feed_forward",
                        "--quantize.linear.float8.emulate")
    for block in block_features(model).values():
        assert block["float8_linears"] == 4 and block["float8_all_gather"] == 4  # attention
    assert model.layers["0"].attention.wq.config.emulate


def test_cpu_offload_and_mixed_precision():
    """training.enable_cpu_offload: FSDP's CPU offload policy on every sharded group;
    mixed_precision_param / _reduce: the groups' parameter and reduction dtypes."""
    model, _, _ = build(LLAMA, *FSDP, "--training.enable_cpu_offload",
                        "--training.mixed_precision_param=bfloat16",
                        "--training.mixed_precision_reduce=float32")  # its only choice
    groups = [*block_features(model).values(), fsdp_group(model.tok_embeddings),
              fsdp_group(model.norm)]
    assert all(g["cpu_offload"] and g["param_dtype"] == "torch.bfloat16"
               and g["reduce_dtype"] == "torch.float32" for g in groups)


def test_batch_and_sequence():
    """global_batch_size: kept; local_batch_size: searched (the plan's micro-batch is what
    TorchTitan runs); seq_len: planned for and run as is."""
    _, job, plan = build(LLAMA, "--training.global_batch_size=32", "--training.seq_len=128")
    assert plan.global_batch_size == job.training.global_batch_size == 32
    assert job.training.local_batch_size == plan.local_batch_size
    assert job.training.seq_len == 128 and plan.fingerprint["seq_len"] == 128


@pytest.mark.parametrize("overrides,message", [
    (("--training.dtype=bfloat16",), "costs float32 parameters"),
    (("--activation_checkpoint.mode=memory_budget",), "chooses AC per block"),
    (("--parallelism.pipeline_parallel_layers_per_stage=2",), "chooses the stage split"),
    (("--parallelism.pipeline_parallel_first_stage_less_layers=0",), "chooses the stage split"),
    (("--parallelism.pipeline_parallel_last_stage_less_layers=0",), "chooses the stage split"),
    (("--parallelism.pipeline_parallel_schedule_csv=schedule.csv",), "chooses the stage split"),
    (("--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0",
      "layers.1,norm,output"), "chooses the stage split"),
    (("--parallelism.pipeline_parallel_schedule=ZBVZeroBubble", "--compile.enable",
      "--compile.backend=aot_eager"), "splits the backward"),
    (("--training.enable_cpu_offload", "--parallelism.data_parallel_replicate_degree=8"),
     "enable_cpu_offload is FSDP.s CPU offload"),
    (("--model.converters=quantize.linear.float8", "--quantize.linear.float8.recipe_name=rowwise",
      "--quantize.linear.float8.enable_fsdp_float8_all_gather"), "tensorwise recipe only"),
    (("--model.converters=quantize.linear.float8", "--quantize.linear.float8.emulate",
      "--compile.enable"), "emulate cannot be combined with compile"),
    (("--model.converters=quantize.linear.mx",), "needs torchao.prototype.mx_formats.config"),
    (("--model.converters=quantize.grouped_mm.float8",), "MoETrainingConfig, missing"),
    (("--model.converters=quantize.grouped_mm.mx",), "MoETrainingConfig, missing"),
])
def test_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        build(LLAMA, *overrides)


def test_applied_as_is():
    """Keys TorchTitan's trainer reads itself (CP load balancing and rotation, gradient
    clipping): auto leaves them as configured."""
    keys = {"parallelism.context_parallel_load_balancer": None,
            "parallelism.context_parallel_rotate_method": "alltoall",
            "training.max_norm": 0.5}
    _, job, _ = build(LLAMA, "--parallelism.context_parallel_degree=2",
                      "--parallelism.context_parallel_load_balancer=None",
                      "--parallelism.context_parallel_rotate_method=alltoall",
                      "--training.max_norm=0.5")
    for key, value in keys.items():
        section, name = key.split(".")
        assert getattr(getattr(job, section), name) == value, key


def test_pinned_blocks_run_the_configured_ac():
    """activation_checkpoint.mode / selective_ac_option: what pinned blocks run (TorchTitan's
    recipe: selective with option k checkpoints every k-th block fully)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model, job, plan = build(LLAMA, *FSDP, "--autoparallel.pin=layers.*",
                             "--activation_checkpoint.mode=selective",
                             "--activation_checkpoint.selective_ac_option=2")
    assert job.activation_checkpoint.mode == "none"  # TorchTitan's recipe-wide AC is off
    wanted = ["full" if i % 2 else "none" for i in range(len(model.layers))]
    assert [layer.ac for layer in plan.layers if layer.kind == "block"] == wanted
    assert [isinstance(block, CheckpointWrapper) for block in model.layers.values()] == [
        ac == "full" for ac in wanted]


@pytest.mark.parametrize("k", ["2", "3"])
def test_layer_wise_selective_ac_under_auto_checkpoints_what_torchtitan_does(monkeypatch, k):
    """``selective_ac_option = k`` under auto: the built blocks TorchTitan's own recipe
    checkpoints (its ``_apply_layer_sac`` on the recipe config) are the ones checkpointed."""
    import torchtitan.distributed.activation_checkpoint as titan_ac
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    ac = ("--activation_checkpoint.mode=selective",
          f"--activation_checkpoint.selective_ac_option={k}")
    monkeypatch.setattr(titan_ac, "_layer_sac_count", 0)  # TorchTitan counts per process
    recipe, _, _ = build("llama3_debug_fsdp.toml", *FSDP, *ac)
    model, _, plan = build(LLAMA, *FSDP, *ac)
    wrapped = [isinstance(block, CheckpointWrapper) for block in model.layers.values()]
    assert wrapped == [isinstance(block, CheckpointWrapper) for block in recipe.layers.values()]
    assert any(wrapped) and not all(wrapped)
    assert not any(layer.pinned for layer in plan.layers)


def test_activation_checkpoint_options_reach_torchtitan(monkeypatch):
    """AC mode is searched per block (test_auto_parity.py::test_heterogeneous_plan_parity); the
    other [activation_checkpoint] keys reach TorchTitan's AC for the blocks the plan checkpoints:
    full AC's checkpoint arguments, and the config selective op-level AC reads."""
    import torchtitan.distributed.activation_checkpoint as ac

    from torchtitan_autoparallel.titan.v0_2.apply import apply_block_ac

    seen = []
    monkeypatch.setattr(ac, "_apply_op_sac",
                        lambda module, config, **kw: seen.append((config, kw)) or module)
    blocks = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4), "1": torch.nn.Linear(4, 4),
                                  "2": torch.nn.Linear(4, 4)})
    _, job, _ = build(LLAMA, "--activation_checkpoint.no-preserve_rng_state",
                      "--activation_checkpoint.determinism_check=none",
                      "--activation_checkpoint.early_stop", "--activation_checkpoint.debug",
                      "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns=w1")
    apply_block_ac(blocks, {"0": "full", "1": "selective", "2": "none"},
                   job.activation_checkpoint, model_compile_enabled=False,
                   op_sac_save_list={torch.ops.aten.mm.default}, base_folder="")
    full = blocks["0"].checkpoint_fn.keywords
    assert (full["preserve_rng_state"], full["determinism_check"], full["early_stop"],
            full["debug"]) == (False, "none", True, True)
    (config, kw), = seen
    assert config.per_op_sac_force_recompute_mm_shapes_by_fqns == ["w1"]
    assert config.selective_ac_option == "op" and kw["base_fqn"] == "layers.1"
    assert isinstance(blocks["2"], torch.nn.Linear)
