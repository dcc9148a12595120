"""The job's speed features under auto: a compiled plan trains like the eager one, features the
device cannot run or that conflict end before any rank starts, the plan fingerprint records
them, and TorchTitan's float8 post-optimizer hook still runs with the autoparallel converter."""

import re

import pytest

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.job.features import Features, check_device

from tests.support.parity import PARITY_OVERRIDES, assert_grad_norm_parity, assert_parity, run_job

COMPILE = ("--compile.enable", "--compile.backend=aot_eager", "--compile.components=model,loss")
PLAN_RE = re.compile(r"autoparallel plan \w+: mesh (.*) \(world")


@pytest.mark.parametrize("degrees,mesh", [
    # slow (measured passing; ``-m slow`` runs them): out of CI for time; compile under auto is
    # trained in CI by test_feature_matrix.py's 1d_compile_sac_op case
    pytest.param(("--parallelism.data_parallel_shard_degree=2",), "dp_replicate=1 dp_shard=2",
                 marks=pytest.mark.slow),
    pytest.param(("--parallelism.data_parallel_replicate_degree=2",),
                 "dp_replicate=2 dp_shard=1", marks=pytest.mark.slow),
], ids=["fsdp", "ddp"])
def test_compiled_auto_plan_matches_eager(degrees, mesh, references, tmp_path):
    """Every block compiled (aot_eager: TorchTitan's llama3 blocks, fullgraph, on CPU) after AC
    and before FSDP / compiled DDP: losses and gradient norms equal the eager plan's."""
    seed, _ = references("llama3")
    eager = run_job("llama3_debug_auto.toml", 2, tmp_path / "eager", degrees,
                    seed_checkpoint=seed)
    compiled = run_job("llama3_debug_auto.toml", 2, tmp_path / "compiled", [*degrees, *COMPILE],
                       seed_checkpoint=seed)
    assert_parity(eager, compiled)
    for result in (eager, compiled):
        assert mesh in PLAN_RE.search(result.output).group(1), result.output[-3000:]
    assert "Compiling each TransformerBlock with torch.compile" in compiled.output
    assert compiled.rows[-1]["compiled_graphs"] > 0 and eager.rows[-1]["compiled_graphs"] == 0
    worst = assert_grad_norm_parity(eager, compiled)
    print(f"compiled vs eager {mesh}: losses {compiled.losses}, worst grad-norm rel {worst:.1e}")


@pytest.mark.parametrize("features,capability,message", [
    (Features(linear="float8_tensorwise"), (8, 0), "float8 needs SM89"),
    (Features(linear="float8_rowwise"), (8, 6), "float8 needs SM89"),
    (Features(grouped_mm="float8"), (8, 0), "float8 needs SM89"),
    (Features(linear="mx"), (9, 0), "MX formats need SM100"),
    (Features(grouped_mm="mx"), (8, 9), "MX formats need SM100"),
])
def test_check_device_refuses(features, capability, message):
    with pytest.raises(UserError, match=message):
        check_device(features, capability)


@pytest.mark.parametrize("features,capability", [
    (Features(linear="float8_tensorwise"), (8, 9)), (Features(linear="float8_rowwise"), (9, 0)),
    (Features(linear="mx"), (10, 0)), (Features(grouped_mm="mx"), (12, 0)),
    (Features(compile=True, async_tp=True), (7, 0)), (Features(linear="float8_tensorwise"), None),
])
def test_check_device_accepts(features, capability):
    check_device(features, capability)


def test_entrypoint_checks_device_before_ranks(monkeypatch, capsys):
    """The preflight (run_train.sh, one process, before torchrun) refuses float8 on an SM80 GPU:
    a GPU is simulated by answering its capability and leaving the CPU runtime off."""
    from torchtitan_autoparallel.errors import run_cli
    from torchtitan_autoparallel.titan.v0_2 import cpu, job, train
    asked = []
    monkeypatch.setattr(job, "device_capability", lambda: asked.append(1) or (8, 0))
    monkeypatch.setattr(cpu, "install", lambda: False)
    monkeypatch.setenv(train.PREFLIGHT_ENV, "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = run_cli(lambda: train.main([
        "--job.config_file", "train_configs/llama3_debug_auto.toml",
        "--model.converters=quantize.linear.float8"]))
    assert code == 2 and asked
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: float8 needs SM89 or newer (this GPU is SM80)"), err


@pytest.mark.parametrize("config,overrides,message", [
    ("deepseek_v3", ("--model.converters=quantize.grouped_mm.float8",
                     "--parallelism.context_parallel_degree=2"),
     "only with pp = cp = 1; parallelism.context_parallel_degree = 2: set it to 1"),
    ("llama3", ("--parallelism.enable_async_tensor_parallel",),
     "enable_async_tensor_parallel needs compile"),
    ("llama3", ("--compile.enable",), 'compile.backend = "aot_eager"'),
    ("llama3", ("--activation_checkpoint.mode=memory_budget",), "chooses AC per block"),
    ("deepseek_v3", ("--parallelism.expert_parallel_comm_backend=deepep",),
     "standard all-to-all"),
], ids=["float8_grouped_cp2", "async_tp_without_compile", "inductor_on_cpu", "memory_budget",
        "deepep"])
def test_preflight_refuses(config, overrides, message, monkeypatch, capsys):
    """run_train.sh's one-process preflight (before torchrun) ends these jobs with one line
    (tests/test_launcher.py runs the async TP case through run_train.sh)."""
    from torchtitan_autoparallel.errors import run_cli
    from torchtitan_autoparallel.titan.v0_2 import train

    monkeypatch.setenv(train.PREFLIGHT_ENV, "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = f"train_configs/{config}_debug_auto.toml"
    code = run_cli(lambda: train.main(["--job.config_file", path, *overrides]))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1], err[-3:]


def _parsed(*overrides: str):
    from torchtitan_autoparallel.titan.v0_2 import cpu
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register
    cpu.install()
    register()
    return parse_config(["--job.config_file", "train_configs/llama3_debug_auto.toml",
                         *PARITY_OVERRIDES, *overrides])


def test_plan_without_float8_refused_for_float8_job(tmp_path, monkeypatch):
    """A plan saved for the eager bf16 / fp32 job is refused when the job turns float8 on (and
    compile): the fingerprint records the features."""
    from torchtitan_autoparallel.titan.v0_2.train import prepare_planned_job

    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "plan.json"
    prepare_planned_job(_parsed(f"--autoparallel.save_plan={path}"), write=True)
    replay = _parsed(f"--autoparallel.plan_file={path}")
    prepare_planned_job(replay, write=False)  # the same job replays its plan
    for extra in (("--model.converters=quantize.linear.float8",), COMPILE):
        with pytest.raises(UserError, match=r"was made for another job \(.*features"):
            prepare_planned_job(_parsed(f"--autoparallel.plan_file={path}", *extra), write=False)


def test_float8_precompute_hook_runs_with_autoparallel_converter(monkeypatch):
    """TorchTitan's converter container calls every converter's post-optimizer hook: with the
    ``autoparallel`` converter first, float8's precomputed dynamic scale still runs (FSDP
    float8 all-gather of a dp_shard > 1 plan)."""
    import torch.nn as nn
    import torchao.float8
    from torchtitan.components.quantization import float8
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters

    from torchtitan_autoparallel.titan.v0_2.train import prepare_planned_job

    monkeypatch.setenv("WORLD_SIZE", "2")
    job = _parsed("--model.converters=quantize.linear.float8",
                  "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                  "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
                  "--parallelism.data_parallel_shard_degree=2")
    plan = prepare_planned_job(job, write=False)
    assert job.model.converters == ["autoparallel", "quantize.linear.float8"]
    # this CPU box has no SM89 GPU; nothing here runs a float8 kernel
    monkeypatch.setattr(float8, "has_cuda_capability", lambda major, minor: True)
    dims = ParallelDims(dp_replicate=plan.mesh.dp_replicate, dp_shard=plan.mesh.dp_shard,
                        cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    calls = []
    monkeypatch.setattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", calls.append)
    container = build_model_converters(job, dims)
    model = nn.Linear(16, 16)
    container.post_optimizer_hook([model])
    assert calls == [model]
