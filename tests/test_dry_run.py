"""Auto plans at scale on a fake process group: they build, shard, and the sharded state per
rank matches the plan's prediction, whose peak fits the budget."""

import json
import os
import re
import subprocess

import pytest

from tests.support.parity import REPO

REPORT = re.compile(
    r"dry run OK: world (\d+) .*; plan \w+: sharded state ([0-9.]+) GiB \(predicted ([0-9.]+) "
    r"GiB\), predicted peak ([0-9.]+) GiB of budget ([0-9.]+) GiB"
)


def dry_run(flavor: str, ngpu: int, tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """``flavor``: "8b" (llama3) or "<family>_<flavor>" (e.g. "deepseek_v3_671b")."""
    name = flavor if "_" in flavor else f"llama3_{flavor}"
    return subprocess.run(
        [str(REPO / "run_train.sh"), f"--job.dump_folder={tmp_path}", *overrides],
        cwd=REPO,
        env={**os.environ, "NGPU": str(ngpu), "COMM_MODE": "fake_backend",
             "CONFIG_FILE": f"train_configs/{name}_auto.toml"},
        capture_output=True, text=True, timeout=300,
    )


# 405B on 64 ranks cannot run its optimizer step (fp32 params, grads and two AdamW moments,
# TorchTitan's fused AdamW: 16 B/param / 64 = 94 GiB) on an 80 GB H100: it is planned for H200s
# with a 128 GiB budget there; the H100 case must fail naming the smallest budget.
H200 = ("--autoparallel.hardware=h200_sxm", "--autoparallel.memory_gib=128")
# slow (measured passing; ``-m slow`` runs them): the 64-rank cases, out of CI for time (8B on
# 128, 18 s, is the FSDP units case)
CASES = [pytest.param("8b", 64, (), marks=pytest.mark.slow),
         pytest.param("70b", 64, (), marks=pytest.mark.slow),
         pytest.param("405b", 64, H200, marks=pytest.mark.slow),
         ("8b", 128, ()), ("70b", 128, ()), ("405b", 128, ())]


@pytest.mark.parametrize("flavor,ngpu,hardware", CASES)
def test_auto_plan_dry_run(flavor, ngpu, hardware, tmp_path):
    """Each block's FSDP group resharding as planned (70B on 128 H100s reshards its last
    blocks to the 8 ranks of a node: FSDP2's integer reshard_after_forward), and the blocks
    sharing each FSDP group as the plan's FSDP units (8B on 128 H100s groups its blocks in
    pairs: one fully_shard over two blocks)."""
    from torchtitan_autoparallel.plan.schema import Plan

    path = tmp_path / "plan.json"
    result = dry_run(flavor, ngpu, tmp_path, *(hardware or ("--autoparallel.hardware=h100_sxm",)),
                     f"--autoparallel.save_plan={path}")
    check_report(result, ngpu)
    plan = Plan.load(str(path))
    planned = {layer.fqn.rpartition(".")[2]: layer.reshard_after_forward
               for layer in plan.layers if layer.kind == "block"}
    blocks = built_blocks(result)
    built = {name: block["reshard_after_forward"] for name, block in blocks.items()}
    assert built == planned
    assert {name: block["fsdp_unit"] for name, block in blocks.items()} == planned_units(plan)
    if (flavor, ngpu) == ("70b", 128):
        assert 8 in built.values(), built
    if (flavor, ngpu) == ("8b", 128):
        assert blocks["0"]["fsdp_unit"] == ["0", "1"], blocks["0"]


def planned_units(plan) -> dict[str, list[str]]:
    """Per block name: the names of the blocks in its FSDP unit, as the plan groups them."""
    from torchtitan_autoparallel.plan.schema import fsdp_units

    return {layer.fqn.rpartition(".")[2]: [u.fqn.rpartition(".")[2] for u in unit]
            for unit in fsdp_units(plan.layers) for layer in unit}


def check_report(result: subprocess.CompletedProcess, ngpu: int) -> str:
    """The dry run built the plan on ``ngpu`` ranks, the sharded state per rank equals the
    prediction and the predicted peak fits the budget. Returns the output."""
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    match = REPORT.search(out)
    assert match, out[-3000:]
    world, measured, predicted, peak, budget = match.groups()
    assert int(world) == ngpu
    assert abs(float(measured) - float(predicted)) <= 0.02 * float(predicted) + 0.01
    assert float(peak) <= float(budget)
    return out


def test_405b_on_64_h100_reports_smallest_budget(tmp_path):
    result = dry_run("405b", 64, tmp_path)
    assert result.returncode == 2
    assert re.search(r"smallest budget that works is 9\d(\.\d)? GiB", result.stderr), result.stderr


@pytest.mark.parametrize("flavor,hardware", [
    pytest.param("70b", ("--autoparallel.hardware=h100_sxm",), marks=pytest.mark.slow),
    ("405b", H200)])
def test_four_dimensional_long_context_dry_run(flavor, hardware, tmp_path):
    """64k-token sequences with HSDP replication fixed: the planner adds FSDP, CP and TP, so all
    four mesh dims are > 1, and the plan applies on 128 fake ranks."""
    result = dry_run(flavor, 128, tmp_path, *hardware,
                     "--training.seq_len=65536", "--training.global_batch_size=16",
                     "--parallelism.data_parallel_replicate_degree=2")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    dims = re.search(r"dry run OK: world 128 \(dp_replicate=(\d+), dp_shard=(\d+), cp=(\d+), "
                     r"tp=(\d+)", out)
    assert dims and all(int(d) > 1 for d in dims.groups()), out[-3000:]
    match = REPORT.search(out)
    assert match and float(match.group(4)) <= float(match.group(5))


# MoE. 671B on 64 ranks: fp32 master weights + AdamW need 168 GiB per rank before any
# activation (195 GiB in the optimizer step), more than any 80-141 GB device: planned with an
# explicit 200 GiB budget there; on 128 ranks it fits an H200 (its config's profile).
# slow (measured passing; ``-m slow`` runs them): one world size per model stays in CI
MOE_CASES = [("deepseek_v3_16b", 64, ()),
             pytest.param("deepseek_v3_16b", 128, (), marks=pytest.mark.slow),
             pytest.param("deepseek_v3_671b", 64, ("--autoparallel.memory_gib=200",),
                          marks=pytest.mark.slow),
             ("deepseek_v3_671b", 128, ()),
             pytest.param("llama4_17bx16e", 64, (), marks=pytest.mark.slow),
             ("llama4_17bx16e", 128, ())]


@pytest.mark.parametrize("flavor,ngpu,overrides", MOE_CASES)
def test_moe_auto_plan_dry_run(flavor, ngpu, overrides, tmp_path):
    out = check_report(dry_run(flavor, ngpu, tmp_path, *overrides), ngpu)
    # the mesh TorchTitan built has the plan's expert-parallel degree
    planned = re.search(r"autoparallel plan \w+: mesh .*?(?: ep=(\d+) etp=\d+)? \(world", out)
    built = re.search(r"dry run OK: world \d+ \(.*ep=(\d+)\)", out)
    assert planned and built, out[-3000:]
    assert int(planned.group(1) or 1) == int(built.group(1))
    if int(built.group(1)) > 1:
        # TorchTitan's explicit FSDP prefetch under EP: each block gathers the next one (with
        # its experts) in forward and the previous one in backward
        blocks = built_blocks(subprocess.CompletedProcess([], 0, out, ""))
        first, *middle, last = (blocks[k]["prefetch"] for k in sorted(blocks, key=int))
        assert first[0] >= 1 and last[1] >= 1, (first, last)
        assert all(f >= 1 and b >= 1 for f, b in middle), middle


@pytest.mark.parametrize("ngpu", [1, 2])
def test_bf16_plan_without_fsdp_dry_run(ngpu, tmp_path):
    """One device, or a plan that replicates (DDP): TorchTitan trains these under autocast,
    which has no meta backend; the dry run still builds them."""
    result = dry_run("3b", ngpu, tmp_path, f"--parallelism.data_parallel_replicate_degree={ngpu}",
                     "--training.seq_len=2048")
    out = check_report(result, ngpu)
    assert f"dp_replicate={ngpu}, dp_shard=1" in out


FLOAT8_COMPILE = (
    "--autoparallel.hardware=h100_sxm", "--model.converters=quantize.linear.float8",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "--compile.enable", "--compile.components=model,loss",
)
BLOCKS = re.compile(r"dry run blocks: (\{.*\})")


def built_blocks(result: subprocess.CompletedProcess) -> dict:
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    match = BLOCKS.search(out)
    assert match, out[-3000:]
    return json.loads(match.group(1))


def test_float8_compile_dry_run(tmp_path):
    """64 fake ranks, llama3 8B, tensorwise float8 with FSDP float8 all-gather, compile and async
    TP, on a plan (fsdp 8 x tp 8) whose blocks alternate TP + SP and tp used as data parallel:
    every block holds the Float8Linears and compile wrapper of TorchTitan's own recipe (its
    FSDP dry run with the same features is the reference), every float8 weight is torchao's
    float8 all-gather tensor, also in blocks sharded over dp_shard x tp."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register
    features = (*FLOAT8_COMPILE, "--parallelism.enable_async_tensor_parallel",
                "--parallelism.tensor_parallel_degree=8",
                "--autoparallel.techniques=fsdp,tp,tp_dp,ac", "--training.global_batch_size=64")
    cpu.install()
    register()
    job = parse_config(["--job.config_file", "train_configs/llama3_8b_auto.toml", *features])
    plan = plan_job(job, 64)
    assert (plan.mesh.dp_shard, plan.mesh.tp) == (8, 8)
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    for i, layer in enumerate(blocks):
        layer.tp_mode = "dp" if i % 2 else "sp"
        layer.fsdp_unit = 1  # alternating blocks: one FSDP unit each
    # every block linear float8, as in the recipe (TP + SP blocks need them all converted)
    plan.float8_filter_fqns = None
    # tp used as data parallel splits the local batch over tp: 8 sequences per dp rank
    plan.local_batch_size, plan.gradient_accumulation_steps = 8, 1
    path = tmp_path / "plan.json"
    plan.save(str(path))

    auto = dry_run("8b", 64, tmp_path / "auto", *features, f"--autoparallel.plan_file={path}")
    out = auto.stdout + auto.stderr
    built = built_blocks(auto)
    recipe = built_blocks(subprocess.run(
        [str(REPO / "run_train.sh"), f"--job.dump_folder={tmp_path / 'recipe'}",
         *FLOAT8_COMPILE],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NGPU": "64", "COMM_MODE": "fake_backend",
             "CONFIG_FILE": "train_configs/llama3_8b_fsdp.toml"}))
    assert sorted(built) == sorted(recipe) and len(built) == 32
    for name, block in built.items():
        reference = recipe[name]
        assert reference["float8_linears"] == 7 and reference["block_compiled"]
        for key in ("float8_linears", "compiled", "block_compiled"):
            assert block[key] == reference[key], (name, block, reference)
        assert block["float8_all_gather"] == block["float8_linears"], (name, block)
        tp_mode = blocks[int(name)].tp_mode
        assert block["mesh"] == (["fsdp_tp"] if tp_mode == "dp" else ["fsdp", "tp"]), block
    assert "applied the inferred float8 tensorwise tensor-parallel plan" in out
    assert "Async TP is enabled" in out
    assert "ignoring" not in out
    check_report(auto, 64)


def test_float8_linears_chosen_by_the_plan_dry_run(tmp_path):
    """llama3 8B on 8 fake H100 ranks with float8 (tensorwise) and compile, filter_fqns unset:
    the plan keeps in bf16 the output layer and the block linears the cost model predicts
    slower in float8 (``low_precision_linears`` at the plan's shapes: wk / wv, 4096 -> 1024,
    are the close call; compiled, they share the input q's cast), writes them into
    filter_fqns, and TorchTitan's converter builds exactly that (read back from the modules)."""
    from torchtitan_autoparallel.plan.schema import Plan

    path = tmp_path / "plan.json"
    auto = dry_run("8b", 8, tmp_path / "auto", *FLOAT8_COMPILE,
                   f"--autoparallel.save_plan={path}")
    plan = Plan.load(str(path))
    assert plan.float8_filter_fqns[0] == "output"
    kept = plan.float8_filter_fqns[1:]
    assert set(kept) <= {"attention.wk", "attention.wv"}
    built = built_blocks(auto)
    assert len(built) == 32
    for block in built.values():
        assert block["bf16_linears"] == kept, block
        assert block["float8_linears"] == 7 - len(kept)
    assert "float8: kept in bf16 (float8 predicted slower): " + ", ".join(
        ["output", *kept]) in auto.stdout + auto.stderr
    # compiled float8 blocks in the plan's FSDP units (one fully_shard over each unit)
    assert {name: block["fsdp_unit"] for name, block in built.items()} == planned_units(plan)


# Pipeline parallel at scale. The published 405B layout (TorchTitan's Table 5: FSDP 8 x TP 8 x
# PP 8 on 512 H100s with compile, float8 and async TP) with the planner choosing schedule,
# micro-batches, stage split and per-block strategies; the planner's own choice for the same
# job; deepseek_v3 671B on 256 ranks with pp fixed. This process builds pp rank 0's stages.
PUBLISHED_405B = (
    "--autoparallel.hardware=h100_grand_teton", "--training.global_batch_size=256",
    "--model.converters=quantize.linear.float8",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "--compile.enable", "--compile.components=model",
    "--parallelism.enable_async_tensor_parallel",
)
STAGE = re.compile(r"stage (\d+) on rank 0: (\S.*?)(?:  \(|$)", re.M)


def rank0_blocks(out: str) -> list[str]:
    """The block indices the plan table puts on pp rank 0 (``layers.a..b`` folded)."""
    names = []
    for _, text in STAGE.findall(out):
        for part in text.split(", "):
            if part.startswith("layers."):
                first, _, last = part[len("layers."):].partition("..")
                names += [str(i) for i in range(int(first), int(last or first) + 1)]
    return names


@pytest.mark.parametrize("fixed", [True, False], ids=["published-layout", "planner-choice"])
def test_405b_pipeline_dry_run(fixed, tmp_path):
    layout = ("--parallelism.pipeline_parallel_degree=8",
              "--parallelism.tensor_parallel_degree=8",
              "--parallelism.data_parallel_shard_degree=8") if fixed else ()
    result = dry_run("405b", 512, tmp_path, *PUBLISHED_405B, *layout)
    out = check_report(result, 512)
    blocks = built_blocks(result)
    if not fixed:
        assert "dry run OK: world 512" in out
        return
    assert "dry run OK: world 512 (dp_replicate=1, dp_shard=8, cp=1, tp=8, pp=8" in out
    assert re.search(r"pipeline: Interleaved1F1B, 8 ranks x \d stages", out), out[-3000:]
    assert sorted(blocks, key=int) == rank0_blocks(out)
    for block in blocks.values():  # TorchTitan's recipe features on every planned block
        assert block["float8_linears"] == 7 and block["block_compiled"], block
        assert block["float8_all_gather"] == 7 and not block["reshard_after_forward"], block


def test_671b_pipeline_dry_run(tmp_path):
    result = dry_run("deepseek_v3_671b", 256, tmp_path, "--parallelism.pipeline_parallel_degree=4")
    out = check_report(result, 256)
    assert re.search(r"dry run OK: world 256 \(.*pp=4, ep=(\d+)\)", out), out[-3000:]
    blocks = built_blocks(result)
    assert sorted(blocks, key=int) == rank0_blocks(out)


@pytest.mark.slow  # measured passing (40 s); the 20b case below runs in CI
def test_gpt_oss_120b_plans_and_dry_runs_on_64_ranks(tmp_path):
    """gpt_oss's blocks take flex-attention block masks the model builds from the batch: the
    layer graph asks the model for them (``get_attention_masks`` on a synthetic batch) and
    measures flex attention as causal SDPA, so gpt_oss 120b is planned (EP over the experts)
    and built on 64 fake ranks."""
    out = check_report(dry_run("gpt_oss_120b", 64, tmp_path, "--autoparallel.hardware=h100_sxm"),
                       64)
    assert "ep=64" in out


def test_gpt_oss_bf16_state_dry_run(tmp_path):
    """TorchTitan builds gpt_oss's blocks in bf16 (embedding and output fp32): parameters,
    gradients and AdamW moments of those blocks take 8 B per parameter, not 16. The layer graph
    reads each parameter's dtype, so the predicted state is the one the built model holds
    (before: 38.96 GiB predicted for 20.56 GiB)."""
    out = check_report(dry_run("gpt_oss_120b", 8, tmp_path, "--model.flavor=20b",
                               "--autoparallel.hardware=h100_sxm"), 8)
    assert '"param_dtype": "torch.bfloat16"' in out


def test_sub_block_batch_stream_dry_run(tmp_path):
    """llama3 8B on 8 fake H100 ranks with tp_sub_block: the search picks data-parallel
    attention beside a TP feed-forward on a stream sharded on the batch (fsdp 4 x tp 2,
    ``at_scale.md``'s sub-block column) and the plan applies at that size: every block's
    data-parallel part sharded over fsdp x tp."""
    from torchtitan_autoparallel.plan.schema import Plan

    path = tmp_path / "plan.json"
    result = dry_run("8b", 8, tmp_path, "--autoparallel.hardware=h100_sxm",
                     "--training.global_batch_size=8",
                     "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac,pp,tp_sub_block",
                     f"--autoparallel.save_plan={path}")
    check_report(result, 8)
    plan = Plan.load(str(path))
    assert {layer.tp_mode for layer in plan.layers if layer.kind == "block"} == {"dp/sp:batch"}
    assert all(block["mesh"] == ["fsdp_tp"] for block in built_blocks(result).values())
    assert plan.embedding_mode == "dim"
    assert "tok_embeddings looked up on its embedding dim over dp_shard x tp (8 ranks)" in \
        result.stdout + result.stderr


def test_sub_block_autoparallel_8b_layout_dry_run(tmp_path):
    """TorchTitan 0.3.0's AutoParallel's placement of Llama 3 8B on 8 GPUs
    (``autoparallel_side_by_side.md``: the feed-forward TP over fsdp beside TP + SP attention,
    the embedding looked up on its embedding dim over fsdp x tp), written as a plan file,
    applies on 8 fake ranks with the sharded state predicted."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    flags = ["--autoparallel.hardware=h100_sxm", "--training.global_batch_size=4",
             "--parallelism.data_parallel_shard_degree=4",
             "--parallelism.tensor_parallel_degree=2",
             "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac,pp,tp_sub_block"]
    plan = plan_job(parse_config(["--job.config_file", "train_configs/llama3_8b_auto.toml",
                                  *flags]), 8)
    for layer in plan.layers:
        if layer.kind == "block":
            layer.tp_mode, layer.ac, layer.reshard_after_forward, layer.fsdp_unit = \
                "sp/tp@dp_shard", "none", True, 1
        elif layer.kind == "embedding":
            layer.tp_mode, layer.reshard_after_forward = "dim", False
    path = tmp_path / "autoparallel_8b.json"
    plan.save(str(path))
    out = check_report(dry_run("8b", 8, tmp_path, *flags, f"--autoparallel.plan_file={path}"),
                       8)
    assert "32 blocks run feed_forward tensor parallel over dp_shard (4 ranks)" in out
    assert "tok_embeddings looked up on its embedding dim over dp_shard x tp (8 ranks)" in out



def test_sub_block_moe_dry_run(tmp_path):
    """llama4 17Bx16E on 64 H100s, FSDP 32 x TP 2 with ep 8 (etp 1), every MoE block in
    "sp/dp" (the MoE data parallel over tp beside TP + SP attention: the search's plan for
    this job in at_scale.md's sub-block column), written as a plan file: it applies on 64
    fake ranks with its sharded state predicted."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    flags = ["--autoparallel.hardware=h100_sxm", "--training.global_batch_size=512",
             "--parallelism.tensor_parallel_degree=2", "--parallelism.expert_parallel_degree=8",
             "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac,pp,tp_sub_block"]
    plan = plan_job(parse_config(["--job.config_file", "train_configs/llama4_17bx16e_auto.toml",
                                  *flags]), 64)
    assert (plan.mesh.dp_shard, plan.mesh.tp, plan.mesh.ep, plan.mesh.etp) == (32, 2, 8, 1)
    for layer in plan.layers:
        if layer.kind == "block":
            layer.tp_mode = "sp/dp"
    path = tmp_path / "llama4_sp_dp.json"
    plan.save(str(path))
    check_report(dry_run("llama4_17bx16e", 64, tmp_path, *flags,
                         f"--autoparallel.plan_file={path}"), 64)
