"""Training with TorchTitan 0.3.0's own Trainer under ``--parallelism.auto``, on CPU ranks (gloo)
when no GPU is present: ``PYTHONPATH=. python -m pytest -q tests_v0_3/test_train_v0_3.py``.

Reference: a 1-rank run of the same job from the same seed checkpoint, fp32 parameters (so a
mesh changes the losses by rounding only). Data and tokenizer: this repository's ``assets``.
About 3 minutes on 2 cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ASSETS = REPO / "torchtitan_autoparallel" / "assets"
BIN = Path(sys.executable).parent

COMMON = ["--training.seq_len", "256", "--training.global_batch_size", "8",
          "--training.mixed_precision_param", "float32",
          "--hf_assets_path", str(ASSETS / "tokenizer"),
          "--dataloader.dataset_path", str(ASSETS / "data"), "--debug.seed", "0"]
JOB = ["--module", "llama3", "--config", "llama3_debugmodel", *COMMON]
STEPS = ["--training.steps", "3"]


def _require_0_3() -> None:
    from importlib.metadata import version

    if not version("torchtitan").startswith("0.3."):
        raise RuntimeError("tests_v0_3 runs with TorchTitan 0.3.0 installed (see the README)")


_require_0_3()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _torchrun(n: int, *args: str, ranks: str = "0") -> str:
    """``args`` run on ``n`` ranks; the output of ``ranks`` (rank 0 prints the plan; under pp
    the last stage's rank logs the loss)."""
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(n), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "--local-ranks-filter", ranks, "--role", "rank",
           "--tee", "3", "-m", "torchtitan_autoparallel.titan.v0_3.train", *args]
    return _run(cmd)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True,
                          timeout=600)
    out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, out[-3000:]
    return out


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", out)]


def _grad_norms(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+[0-9.]+\s+grad_norm:\s+([0-9.]+)",
                                         out)]


def _reference(root: Path, job: list[str], batch: int = 8) -> SimpleNamespace:
    """A seed checkpoint of ``job`` and the 1-rank losses from it (global batch ``batch``)."""
    _torchrun(1, *job, "--training.local_batch_size", str(batch), "--checkpoint.enable",
              "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree",
              "1", "--dump_folder", str(root / "seed"))
    seed = root / "seed" / "checkpoint" / "step-0"
    assert seed.is_dir()
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed)]
    out = _torchrun(1, *job, *STEPS, "--training.local_batch_size", str(batch), *load,
                    "--dump_folder", str(root / "one"))
    losses = _losses(out)
    assert len(losses) == 3
    return SimpleNamespace(root=root, load=load, losses=losses, grad_norms=_grad_norms(out))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Llama 3's seed checkpoint and the 1-rank losses from it."""
    return _reference(tmp_path_factory.mktemp("train"), JOB)


def _assert_same(losses: list[float], reference: list[float], tol: float = 1e-4) -> None:
    assert len(losses) == len(reference)
    gap = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    assert gap <= tol, (losses, reference)


GRAD_NORM_TOL = 1.5e-4
"""Gradient norms are logged to 4 decimals: equal norms may round one digit apart."""


def test_four_ranks_under_auto_through_run_train_sh_train_as_one_rank(reference):
    """The launcher (MODULE / CONFIG), the plan printed, its mesh run, the 1-rank losses."""
    env = {**_env(), "NGPU": "4", "MODULE": "llama3", "CONFIG": "llama3_debugmodel"}
    out = _run(["bash", str(REPO / "run_train.sh"), "--parallelism.auto", *STEPS, *JOB,
                *reference.load, "--dump_folder", str(reference.root / "auto4")], env=env)
    assert "autoparallel plan " in out and "layers.0..5" in out, out[-3000:]
    mesh = re.search(r"mesh dp_replicate=(\d+) dp_shard=(\d+) cp=(\d+) tp=(\d+)", out)
    assert mesh, out[-3000:]
    built = "pp=1, dp_replicate={}, dp_shard={}, cp={}, tp={}".format(*mesh.groups())
    assert built in out  # TorchTitan built the plan's mesh
    _assert_same(_losses(out), reference.losses)


def test_fsdp_tp_and_full_ac_per_block_from_the_plan(reference):
    """Degrees set on the command line constrain the plan (FSDP 2 x TP 2), ``full`` AC is
    applied per block, and the losses are still the 1-rank losses."""
    out = _torchrun(4, *JOB, *STEPS, "--parallelism.auto", "--parallelism.tensor_parallel_degree",
                    "2", "--parallelism.data_parallel_shard_degree", "2",
                    "--autoparallel.techniques", "fsdp,hsdp,ddp,tp,ac", *reference.load,
                    "--dump_folder", str(reference.root / "fsdp_tp"), "activation-checkpoint:full")
    assert "mesh dp_replicate=1 dp_shard=2 cp=1 tp=2" in out, out[-3000:]
    assert re.search(r"layers\.0\.\.5 +\S*tp\+sp\+ac:full", out), out[-3000:]
    _assert_same(_losses(out), reference.losses)


def _plan(**mesh):
    m = SimpleNamespace(**{"dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 1, "ep": 1,
                           "etp": 1, "pp": 1, **mesh})
    return SimpleNamespace(mesh=m, pipeline=None, local_batch_size=4, layers=[
        SimpleNamespace(fqn="layers.0", kind="block", tp_mode="none", ep=1)])


APPLY_OPTIONS = ("tp_mode", "compiled", "backend", "family", "moe", "bare")


@pytest.mark.parametrize("change, words", [
    ({"tp_mode": "none", "tp": 2}, "tensor parallel on 0 of 1 layers"),
    ({"tp_mode": "dp/sp", "tp": 2, "compiled": True}, "not applied to compiled blocks"),
    ({"tp_mode": "sp/dp", "tp": 2, "backend": "full_dtensor"}, "spmd_backend full_dtensor"),
    ({"tp_mode": "dp", "tp": 2, "family": "qwen3_5"}, "llama3 and qwen3 only"),
    ({"tp_mode": "sp/sp:batch", "tp": 2, "family": "qwen3_5"}, r"stream sharded on the batch "
     r"over tp\) is applied to llama3 and qwen3 only"),
    ({"tp_mode": "dp", "tp": 2, "moe": True}, "MoE block in tp_mode 'dp', which TorchTitan "
     "0.3.0's apply runs on dense blocks only"),
    ({"tp_mode": "sp/sp:a2a", "tp": 2, "moe": True, "family": "qwen3"},
     "MoE block in tp_mode 'sp/sp:a2a'"),
    ({"tp_mode": "dp/sp", "tp": 2, "bare": True}, "needs a dense block"),
    ({"tp_mode": "dp/sp", "tp": 2, "moe": True, "family": "gpt_oss"},
     r"'dp/sp' on MoE blocks \(the attention data parallel over tp\) is applied to llama3, "
     "qwen3, deepseek_v3 only"),
    ({"tp_mode": "dp", "tp": 2, "cp": 2}, "cp = 1"),
    ({"tp_mode": "sp/dp", "tp": 2, "dp_replicate": 2}, "dp_replicate = 1"),
])
def test_what_the_apply_cannot_run_stops_in_one_line(change, words):
    """A layer without TP on a tp mesh (``check_applicable``), and the tp dim as data parallel
    where this apply cannot run it (``tp_dp_parts``: compile, the full_dtensor backend, other
    families, MoE blocks, a mesh ``tp_dp_problem`` refuses): one line each."""
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.titan.v0_3.apply import check_applicable
    from torchtitan_autoparallel.titan.v0_3.tp_dp import SUB_BLOCKS, tp_dp_parts

    change = dict(change)
    plan = _plan(**{k: v for k, v in change.items() if k not in APPLY_OPTIONS})
    plan.layers[0].tp_mode = change["tp_mode"]
    family = change.get("family", "llama3")
    model = type("Model", (), {"__module__": f"torchtitan.models.{family}.model"})()
    parts = () if change.get("bare") else SUB_BLOCKS  # "bare": a block without them
    block = SimpleNamespace(moe_enabled=change.get("moe", False),
                            **{name: object() for pair in parts for name in pair})
    parallelism = SimpleNamespace(spmd_backend=change.get("backend", "spmd_types"))
    with pytest.raises(UserError, match=words) as info:
        check_applicable(plan)
        tp_dp_parts(model, plan, {"0": block}, parallelism, change.get("compiled", False))
    assert "\n" not in str(info.value)


SUB_BLOCK = ["--parallelism.tensor_parallel_degree", "2",
             "--autoparallel.techniques", "fsdp,tp,tp_dp,ac,tp_sub_block"]
"""TP 2 with the tp dim as data parallel, whole blocks and sub-blocks, searched."""


@pytest.mark.parametrize("backend,ranks", [
    ("spmd_types", 4), pytest.param("partial_dtensor", 4, marks=pytest.mark.slow),
    ("spmd_types", 2)])
def test_sub_block_modes_from_a_plan_file_train_as_one_rank(reference, tmp_path, backend, ranks):
    """llama3's debug plan on fsdp 2 x tp 2 (4 CPU ranks; on 2, tp alone), its blocks edited
    to data-parallel attention beside a TP + SP feed-forward ("dp/sp"), the reverse ("sp/dp")
    and, with dp_shard > 1, the whole block data parallel over tp ("dp"), every other one fully
    checkpointed, the "dp" ones keeping their parameters; saved and replayed from the file
    under both SPMD backends that apply it (a local residual stream, a DTensor one): each block
    runs its planned mode, and the losses and gradient norms are the 1-rank run's from the
    same seed checkpoint."""
    from torchtitan_autoparallel.candidates.layout import BlockStrategy
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.plan.schema import Plan
    from torchtitan_autoparallel.titan.v0_3 import read_job

    dp_shard = ranks // 2
    options = [*SUB_BLOCK, "--parallelism.data_parallel_shard_degree", str(dp_shard),
               "--parallelism.spmd_backend", backend]
    plan = plan_job(read_job([*JOB, "--parallelism.auto", *options]), ranks)
    assert plan.local_batch_size % 2 == 0  # the tp ranks split it
    modes = ["dp/sp", "sp/dp", "dp"] if dp_shard > 1 else ["dp/sp", "sp/dp"]
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    for i, layer in enumerate(blocks):
        layer.tp_mode, layer.ac = modes[i % len(modes)], ("none", "full")[i % 2]
        layer.reshard_after_forward, layer.fsdp_unit = layer.tp_mode != "dp", 1
    path = tmp_path / "sub_block.json"
    plan.save(str(path))
    assert Plan.load(str(path)).to_json() == plan.to_json()
    out = _torchrun(ranks, *JOB, *STEPS, *options, f"--autoparallel.plan_file={path}",
                    *reference.load, "--dump_folder", str(tmp_path / "run"))
    assert f"mesh dp_replicate=1 dp_shard={dp_shard} cp=1 tp=2" in out, out[-3000:]
    for layer in blocks:  # the plan's labels, block by block, as rank 0 prints them
        label = BlockStrategy("none", True, layer.tp_mode).describe().split("+", 1)[1]
        assert re.search(rf"{layer.fqn} +\S*\+{re.escape(label)}(\+|\s)", out), out[-3000:]
    _assert_same(_losses(out), reference.losses)
    _assert_same(_grad_norms(out), reference.grad_norms, GRAD_NORM_TOL)


@pytest.mark.parametrize("backend,embedding", [("spmd_types", ""), ("partial_dtensor", "dim")])
def test_sub_block_batch_stream_from_a_plan_file_trains_as_one_rank(reference, tmp_path,
                                                                    backend, embedding):
    """llama3's debug plan on fsdp 2 x tp 2 with the residual stream sharded on the batch
    over tp: blocks cycling through data-parallel attention beside a TP feed-forward
    ("dp/sp:batch"), the reverse ("sp/dp:batch") and TP on both ("sp/sp:batch"), with the
    embedding as the model declares it or looked up on its embedding dim ("dim"), under both
    SPMD backends that apply them: the losses and gradient norms are the 1-rank run's from
    the same seed checkpoint."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    options = [*SUB_BLOCK, "--parallelism.data_parallel_shard_degree", "2",
               "--parallelism.spmd_backend", backend]
    plan = plan_job(read_job([*JOB, "--parallelism.auto", *options]), 4)
    assert plan.local_batch_size % 2 == 0  # the tp ranks split it
    modes = ["dp/sp:batch", "sp/dp:batch", "sp/sp:batch"]
    for i, layer in enumerate(layer for layer in plan.layers if layer.kind == "block"):
        layer.tp_mode, layer.ac, layer.fsdp_unit = modes[i % 3], ("none", "full")[i % 2], 1
    for layer in plan.layers:
        if layer.kind == "embedding":
            layer.tp_mode, layer.reshard_after_forward = embedding or "sp", not embedding
    path = tmp_path / "batch_stream.json"
    plan.save(str(path))
    out = _torchrun(4, *JOB, *STEPS, *options, f"--autoparallel.plan_file={path}",
                    *reference.load, "--dump_folder", str(tmp_path / "run"))
    assert "mesh dp_replicate=1 dp_shard=2 cp=1 tp=2" in out, out[-3000:]
    assert re.search(r"layers\.0 +\S*attn:tp_dp/ffn:tp\+stream:batch", out), out[-3000:]
    _assert_same(_losses(out), reference.losses)
    _assert_same(_grad_norms(out), reference.grad_norms, GRAD_NORM_TOL)


@pytest.mark.parametrize("mode,backend,words", [
    ("sp/sp:a2a", "spmd_types", "attention.wo on the sequence shard"),
    pytest.param("sp/sp:a2a", "partial_dtensor", "attention.wo on the sequence shard",
                 marks=pytest.mark.slow),
    ("sp/tp@dp_shard", "partial_dtensor", "feed_forward tensor parallel over dp_shard"),
    pytest.param("sp/tp@dp_shard", "spmd_types", "feed_forward tensor parallel over dp_shard",
                 marks=pytest.mark.slow),
])
def test_sub_block_linears_apart_from_a_plan_file_train_as_one_rank(reference, tmp_path, mode,
                                                                     backend, words):
    """llama3's debug plan on fsdp 2 x tp 2 with a sub-block's linears placed apart from
    TorchTitan's TP + SP, beside TP + SP blocks and data-parallel attentions, under both SPMD
    backends: the attention's output projection on the sequence shard ("sp/sp:a2a": its input
    moved from the heads by an all-to-all, its row-wise weight gathered over tp, no
    reduce-scatter), or the feed-forward TP over dp_shard ("sp/tp@dp_shard": its input
    gathered over dp_shard on the batch, weights split over dp_shard and gathered over tp).
    The losses and gradient norms are the 1-rank run's from the same seed checkpoint."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    options = [*SUB_BLOCK, "--parallelism.data_parallel_shard_degree", "2",
               "--parallelism.spmd_backend", backend]
    plan = plan_job(read_job([*JOB, "--parallelism.auto", *options]), 4)
    modes = [mode, "sp", "dp/sp"]
    for i, layer in enumerate(layer for layer in plan.layers if layer.kind == "block"):
        layer.tp_mode, layer.ac, layer.fsdp_unit = modes[i % 3], ("none", "full")[i % 2], 1
    for layer in plan.layers:
        if layer.kind == "embedding":
            layer.tp_mode, layer.reshard_after_forward = "sp", True
    path = tmp_path / "apart.json"
    plan.save(str(path))
    out = _torchrun(4, *JOB, *STEPS, *options, f"--autoparallel.plan_file={path}",
                    *reference.load, "--dump_folder", str(tmp_path / "run"))
    assert "mesh dp_replicate=1 dp_shard=2 cp=1 tp=2" in out, out[-3000:]
    assert f"2 blocks run {words}" in out, out[-3000:]
    _assert_same(_losses(out), reference.losses)
    _assert_same(_grad_norms(out), reference.grad_norms, GRAD_NORM_TOL)


@pytest.mark.parametrize("flag", [
    "--parallelism.no-enable-sequence-parallel",
    pytest.param("", marks=pytest.mark.slow),
])
def test_sub_block_tp_without_sp_trains_as_one_rank(reference, tmp_path, flag):
    """TorchTitan's TP without SP (tp_mode 'sp/sp:rep', the residual stream whole on every tp
    rank) on fsdp 2 x tp 2: planned under auto for a job that turns sequence parallel off, or
    from a plan file whose blocks cycle through it and the data-parallel attention or
    feed-forward on a batch shard of that stream ('dp/sp:rep', 'sp/dp:rep'; the apply turns
    the flag off), half the blocks fully checkpointed; the losses and gradient norms are the
    1-rank run's from the same seed checkpoint."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    options = ["--parallelism.tensor_parallel_degree", "2",
               "--parallelism.data_parallel_shard_degree", "2", *([flag] if flag else [])]
    if flag:
        run = ["--parallelism.auto", *options]
    else:
        plan = plan_job(read_job([*JOB, "--parallelism.auto", *options, *SUB_BLOCK[2:]]), 4)
        modes = ["sp/sp:rep", "dp/sp:rep", "sp/dp:rep"]
        for i, layer in enumerate(layer for layer in plan.layers if layer.kind == "block"):
            layer.tp_mode, layer.ac, layer.fsdp_unit = modes[i % 3], ("none", "full")[i % 2], 1
        for layer in plan.layers:
            if layer.kind == "embedding":
                layer.tp_mode, layer.reshard_after_forward = "sp", True
        path = tmp_path / "rep.json"
        plan.save(str(path))
        run = [*options, *SUB_BLOCK[2:], f"--autoparallel.plan_file={path}"]
    out = _torchrun(4, *JOB, *STEPS, *run, *reference.load, "--dump_folder",
                    str(tmp_path / "run"))
    assert "mesh dp_replicate=1 dp_shard=2 cp=1 tp=2" in out, out[-3000:]
    assert "attn:tp/ffn:tp+stream:replicated" in out, out[-3000:]
    assert "tensor parallel without sequence parallel" in out, out[-3000:]
    if not flag:
        assert "4 sub-blocks run data parallel over tp on a batch shard of the replicated " \
            "stream" in out, out[-3000:]
        assert "attn:tp_dp/ffn:tp+stream:replicated" in out, out[-3000:]
    _assert_same(_losses(out), reference.losses)
    _assert_same(_grad_norms(out), reference.grad_norms, GRAD_NORM_TOL)


@pytest.mark.parametrize("mode,ranks,tp,backend,blocks", [
    ("dim", 2, 1, "spmd_types", ["none"]),
    ("dim:gather", 4, 2, "partial_dtensor", ["dp/sp", "sp"]),
    pytest.param("dim", 4, 2, "spmd_types", ["sp/dp", "sp"], marks=pytest.mark.slow),
])
def test_sub_block_embedding_dim_from_a_plan_file_trains_as_one_rank(
        reference, tmp_path, mode, ranks, tp, backend, blocks):
    """llama3's debug plan with its embedding looked up on its embedding dim: 'dim' (the
    table's columns over dp_shard x tp, never gathered; FSDP 2 alone, or FSDP 2 x TP 2 beside
    data-parallel feed-forwards) and 'dim:gather' (columns over dp_shard, rows over tp,
    gathered over tp, beside data-parallel attentions); the losses and gradient norms are the
    1-rank run's from the same seed checkpoint."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    options = ["--parallelism.tensor_parallel_degree", str(tp),
               "--parallelism.data_parallel_shard_degree", "2",
               "--autoparallel.techniques", "fsdp,tp,tp_dp,ac,tp_sub_block",
               "--parallelism.spmd_backend", backend]
    plan = plan_job(read_job([*JOB, "--parallelism.auto", *options]), ranks)
    for layer in plan.layers:
        if layer.kind == "embedding":
            layer.tp_mode, layer.reshard_after_forward = mode, False
    for i, layer in enumerate(layer for layer in plan.layers if layer.kind == "block"):
        layer.tp_mode, layer.fsdp_unit = blocks[i % len(blocks)], 1
    path = tmp_path / "embedding_dim.json"
    plan.save(str(path))
    out = _torchrun(ranks, *JOB, *STEPS, *options, f"--autoparallel.plan_file={path}",
                    *reference.load, "--dump_folder", str(tmp_path / "run"))
    assert f"mesh dp_replicate=1 dp_shard=2 cp=1 tp={tp}" in out, out[-3000:]
    assert "tok_embeddings looked up on its embedding dim" in out, out[-3000:]
    _assert_same(_losses(out), reference.losses)
    _assert_same(_grad_norms(out), reference.grad_norms, GRAD_NORM_TOL)


def test_qwen3_under_auto_on_two_ranks_trains_as_one_rank_and_its_recipe(tmp_path):
    """Another 0.3.0 family (Qwen3's debug flavor: QK norms, its own head dim) under auto on 2
    CPU ranks, against its own 1-rank run from one seed checkpoint and TorchTitan 0.3.0's own
    recipe on 2 ranks (FSDP 2): the same losses and gradient norms."""
    job = ["--module", "qwen3", "--config", "qwen3_debugmodel", *COMMON]
    ref = _reference(tmp_path, job)
    out = _torchrun(2, *job, *STEPS, "--parallelism.auto", *ref.load,
                    "--dump_folder", str(tmp_path / "auto2"))
    assert "autoparallel plan " in out, out[-3000:]
    _assert_same(_losses(out), ref.losses)
    recipe = _torchrun(2, *job, *STEPS, "--parallelism.data_parallel_shard_degree", "2",
                       "--training.local_batch_size", "4", *ref.load,
                       "--dump_folder", str(tmp_path / "recipe2"))
    assert "autoparallel plan " not in recipe
    _assert_same(_losses(out), _losses(recipe))
    _assert_same(_grad_norms(out), _grad_norms(recipe), GRAD_NORM_TOL)


QWEN35 = ["--module", "qwen3_5", "--config", "qwen35_debugmodel", "--training.seq_len", "256",
          "--training.global_batch_size", "2", "--training.mixed_precision_param", "float32",
          "--debug.seed", "0"]
"""Qwen3.5's debug flavor (Gated DeltaNet and full-attention layers, a vision encoder) on its
own image-caption data (this repository's ``assets/cc12m_test``)."""


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """Qwen3.5's seed checkpoint and the 1-rank losses from it."""
    return _reference(tmp_path_factory.mktemp("qwen35"), QWEN35, batch=2)


@pytest.mark.parametrize("args,mesh", [
    # the plan's own choice on 2 CPU ranks: TP 2 (the encoder's linears and the DeltaNet
    # projections as the model declares them)
    ([], r"mesh dp_replicate=\d+ dp_shard=\d+ cp=1 tp=\d+ \(world 2\)"),
    # FSDP 2 alone (slow: about 2 minutes on 2 cores; the plan's own choice above is run)
    pytest.param(["--parallelism.data_parallel_shard_degree", "2"],
                 r"mesh dp_replicate=1 dp_shard=2 cp=1 tp=1 \(world 2\)",
                 marks=pytest.mark.slow),
])
def test_qwen3_5_under_auto_on_two_ranks_trains_as_one_rank(qwen35, args, mesh):
    """qwen3_5 under auto on 2 CPU ranks: the vision encoder planned and FSDP-sharded as one
    unit, the DeltaNet blocks parallelized as the plan says: the 1-rank losses and gradient
    norms from one seed checkpoint."""
    out = _torchrun(2, *QWEN35, *STEPS, "--parallelism.auto", *args, *qwen35.load,
                    "--dump_folder", str(qwen35.root / f"auto2_{len(args)}"))
    assert re.search(mesh, out) and re.search(r"vision_encoder +fsdp", out), out[-3000:]
    _assert_same(_losses(out), qwen35.losses)
    _assert_same(_grad_norms(out), qwen35.grad_norms, GRAD_NORM_TOL)


DEEPSEEK = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", *COMMON]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """DeepSeek-V3's debug flavor: its seed checkpoint and the 1-rank losses from it."""
    return _reference(tmp_path_factory.mktemp("deepseek"), DEEPSEEK)


def test_deepseek_v3_under_auto_with_and_without_ep_trains_as_one_rank_and_its_recipe(
        deepseek, tmp_path):
    """DeepSeek-V3's debug flavor (MLA, routed experts) under auto on 2 CPU ranks. With CUDA
    graphs on (0.3.0's default) EP is held at 1 and the plan says why; with them off and EP 2
    asked for, the routed experts shard over ep through the model's own declarations: both
    give the 1-rank losses, and the EP run the same losses and gradient norms as TorchTitan
    0.3.0's own recipe on that mesh (FSDP 2, EP 2)."""
    job, ref = DEEPSEEK, deepseek
    out = _torchrun(2, *job, *STEPS, "--parallelism.auto", *ref.load,
                    "--dump_folder", str(tmp_path / "auto2"))
    assert "note: parallelism.expert_parallel_degree held at 1" in out, out[-3000:]
    assert re.search(r"mesh dp_replicate=\d+ dp_shard=\d+ cp=1 tp=1 \(world 2\)", out)
    _assert_same(_losses(out), ref.losses)
    no_graphs = ["--training.disable_cuda_graphs", "--parallelism.expert_parallel_degree", "2"]
    out = _torchrun(2, *job, *STEPS, "--parallelism.auto", *no_graphs, *ref.load,
                    "--dump_folder", str(tmp_path / "auto_ep2"))
    assert "mesh dp_replicate=1 dp_shard=2 cp=1 tp=1 ep=2 etp=1 (world 2)" in out, out[-3000:]
    assert re.search(r"layers\.1\.\.5 +\S*ep2", out), out[-3000:]
    _assert_same(_losses(out), ref.losses)
    recipe = _torchrun(2, *job, *STEPS, *no_graphs, "--parallelism.data_parallel_shard_degree",
                       "2", "--training.local_batch_size", "4", *ref.load,
                       "--dump_folder", str(tmp_path / "recipe_ep2"))
    _assert_same(_losses(out), _losses(recipe))
    _assert_same(_grad_norms(out), _grad_norms(recipe), GRAD_NORM_TOL)
    _assert_same(_grad_norms(out), ref.grad_norms, GRAD_NORM_TOL)


@pytest.mark.parametrize("ep,modes,log", [
    pytest.param(2, ["sp/dp", "dp/sp", "sp"], "MoE blocks run their shared experts data "
                 "parallel", marks=pytest.mark.slow),
    (1, ["sp/dp", "dp/sp", "dp/sp:shared_dp", "sp", "sp/sp:shared_dp"], "MoE blocks run "
     "their MoE (router, shared and routed experts) data parallel|2 MoE blocks run their "
     "shared experts (routed experts TP)"),
    pytest.param(4, ["sp/dp", "dp/sp", "sp"], "MoE blocks run their shared experts data "
                 "parallel", marks=pytest.mark.slow),
])
def test_sub_block_moe_with_expert_parallel_trains_as_one_rank(deepseek, tmp_path, ep, modes,
                                                               log):
    """DeepSeek-V3's debug flavor on fsdp 2 x tp 2 with ep 2 (etp 1), ep 1 (the routed experts
    TP) or ep 4 (EP over dp_shard x tp): MoE blocks whose shared experts run data parallel
    over tp ('sp/dp': whole on tp, FSDP over dp_shard x tp, on each tp rank's sequence shard;
    the routed experts on the model's EP; with ep 1 the whole MoE, router and routed experts
    too, their token counts summed over tp), MoE blocks whose attention runs data parallel over
    tp on a batch shard ('dp/sp', the MoE as the model runs it), with ep 1 MoE blocks whose
    shared experts alone run data parallel beside the model's MoE TP on a cut of its gathered
    input ('sp/sp:shared_dp', 'dp/sp:shared_dp'), MoE blocks under the model's MoE TP and the
    dense block, some fully checkpointed: the losses and gradient norms are the 1-rank
    run's."""
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    job, ref = DEEPSEEK, deepseek
    options = ["--training.disable_cuda_graphs", "--parallelism.expert_parallel_degree",
               str(ep), "--parallelism.tensor_parallel_degree", "2",
               "--parallelism.data_parallel_shard_degree", "2",
               "--autoparallel.techniques", "fsdp,tp,ep,ac,tp_sub_block"]
    plan = plan_job(read_job([*job, "--parallelism.auto", *options]), 4)
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    for i, layer in enumerate(blocks[1:]):  # layers.0 is dense
        layer.tp_mode, layer.ac = modes[i % len(modes)], ("none", "none", "full", "none")[i % 4]
    path = tmp_path / "moe.json"
    plan.save(str(path))
    out = _torchrun(4, *job, *STEPS, *options, f"--autoparallel.plan_file={path}", *ref.load,
                    "--dump_folder", str(tmp_path / "run"))
    mesh = "mesh dp_replicate=1 dp_shard=2 cp=1 tp=2" + (f" ep={ep} etp=1" if ep > 1 else "")
    assert mesh in out and all(line in out for line in log.split("|")), out[-3000:]
    assert "attn:tp_dp/ffn:tp+sp" in out, out[-3000:]
    _assert_same(_losses(out), ref.losses)
    _assert_same(_grad_norms(out), ref.grad_norms, GRAD_NORM_TOL)


def test_moe_without_sequence_parallel_under_auto_trains_as_one_rank(deepseek, tmp_path):
    """DeepSeek-V3's debug flavor under auto with sequence parallel off, on fsdp 2 x tp 2 with
    ep 2: planned as TorchTitan's TP without SP on every block (tp_mode 'sp/sp:rep'; the MoE
    blocks' router and routed experts on the sequence shard cut out of the whole stream,
    their shared experts TP), it gives the 1-rank losses and gradient norms."""
    job, ref = DEEPSEEK, deepseek
    options = ["--parallelism.auto", "--parallelism.no-enable-sequence-parallel",
               "--training.disable_cuda_graphs", "--parallelism.expert_parallel_degree", "2",
               "--parallelism.tensor_parallel_degree", "2",
               "--parallelism.data_parallel_shard_degree", "2"]
    out = _torchrun(4, *job, *STEPS, *options, *ref.load, "--dump_folder", str(tmp_path / "run"))
    assert "mesh dp_replicate=1 dp_shard=2 cp=1 tp=2 ep=2 etp=1" in out, out[-3000:]
    assert re.search(r"layers\.1\.\.5 +\S*attn:tp/ffn:tp\+stream:replicated\+ep2", out), \
        out[-3000:]
    assert "tensor parallel without sequence parallel" in out, out[-3000:]
    _assert_same(_losses(out), ref.losses)
    _assert_same(_grad_norms(out), ref.grad_norms, GRAD_NORM_TOL)


def test_pipeline_stages_with_tp_from_the_plan_train_as_one_rank(reference):
    """PP 2 x TP 2 asked for (GPipe) on 4 ranks: TorchTitan's pipeline_llm splits the planned
    stages and each stage part is parallelized from the plan; the last stage's losses and the
    gradient norms are the 1-rank run's."""
    out = _torchrun(4, *JOB, *STEPS, "--parallelism.auto", "--training.disable_cuda_graphs",
                    "--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_schedule", "GPipe", *reference.load,
                    "--dump_folder", str(reference.root / "pp_tp"), ranks="0,3")
    assert "mesh pp=2 dp_replicate=1 dp_shard=1 cp=1 tp=2 (world 4)" in out, out[-3000:]
    assert re.search(r"pipeline: GPipe, 2 ranks x 1 stages", out), out[-3000:]
    out = "\n".join(line for line in out.splitlines() if line.startswith("[rank3]"))
    _assert_same(_losses(out), reference.losses)
    _assert_same(_grad_norms(out), reference.grad_norms, GRAD_NORM_TOL)


@pytest.mark.parametrize("module,config,args,mesh", [
    ("llama3", "llama3_debugmodel", [], r"tp=\d+"),
    ("qwen3", "qwen3_debugmodel", [], r"tp=\d+"),
    ("gpt_oss", "gpt_oss_debugmodel", [], r"tp=\d+"),
    ("qwen3_5", "qwen35_debugmodel", ["--parallelism.tensor_parallel_degree", "2"], r"tp=2"),
    # Kimi K2.5 (MoonViT3d encoder, DeepSeek-V3 decoder) from a config function of the user's
    # own module: its debug config with AdamW for DistMuon (one line under auto)
    ("tests_v0_3.support.kimi_adamw", "kimi_k2_5_debugmodel_adamw",
     ["--parallelism.expert_parallel_degree", "8"], r"tp=1 ep=8 etp=1"),
    ("deepseek_v3", "deepseek_v3_debugmodel",
     ["--training.disable_cuda_graphs", "--parallelism.expert_parallel_degree", "8"],
     r"tp=1 ep=8 etp=1"),
])
def test_dry_run_on_64_fake_ranks(module, config, args, mesh, tmp_path):
    """``COMM_MODE=fake_backend NGPU=64``: the plan for 64 H100s is made, TorchTitan 0.3.0
    builds its mesh and parallelizes the model per block on a fake process group (DeepSeek-V3
    and Kimi K2.5 with their routed experts over EP 8, qwen3_5 with TP 2, the vision encoders
    of both as one FSDP unit)."""
    env = {**_env(), "NGPU": "64", "MODULE": module, "CONFIG": config,
           "COMM_MODE": "fake_backend"}
    out = _run(["bash", str(REPO / "run_train.sh"), "--parallelism.auto",
                "--autoparallel.hardware", "h100_sxm", "--training.seq_len", "256", *args,
                "--dump_folder", str(tmp_path)], env=env)
    assert re.search(rf"mesh dp_replicate=\d+ dp_shard=\d+ cp=\d+ {mesh} \(world 64\)", out), \
        out[-3000:]
    assert "Training completed" in out, out[-3000:]


def test_sub_block_dry_run_on_64_fake_ranks(tmp_path):
    """``COMM_MODE=fake_backend NGPU=64`` with ``tp_sub_block`` on TP 2: the plan for 64 H100s
    runs its blocks on a stream sharded on the batch over tp and its embedding on its
    embedding dim, and TorchTitan 0.3.0 applies it and trains a step on a fake process group
    (the 4-rank parity tests check the numbers)."""
    env = {**_env(), "NGPU": "64", "MODULE": "llama3", "CONFIG": "llama3_debugmodel",
           "COMM_MODE": "fake_backend"}
    out = _run(["bash", str(REPO / "run_train.sh"), "--parallelism.auto",
                "--autoparallel.hardware", "h100_sxm", "--training.seq_len", "256",
                "--training.global_batch_size", "256", "--parallelism.tensor_parallel_degree",
                "2", "--autoparallel.techniques", "fsdp,tp,tp_dp,ac,tp_sub_block",
                "--dump_folder", str(tmp_path)], env=env)
    assert re.search(r"layers\.0\S* +\S*\+stream:batch", out), out[-3000:]
    assert "tok_embeddings looked up on its embedding dim" in out, out[-3000:]
    assert "Training completed" in out, out[-3000:]


def test_moonlight_under_auto_refuses_its_dist_muon_optimizer_in_one_line(tmp_path):
    """Kimi's Moonlight config trains with DistMuon (its own sharded parameter storage, which
    TorchTitan builds for CUDA only): under auto it is one line before any model is built,
    where it would otherwise be costed as AdamW and fail inside the optimizer."""
    env = {**_env(), "NGPU": "64", "MODULE": "kimi_k2_7", "CONFIG": "moonlight_16b_a3b",
           "COMM_MODE": "fake_backend"}
    done = subprocess.run(["bash", str(REPO / "run_train.sh"), "--parallelism.auto",
                           "--dump_folder", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line.strip()
             and not line.startswith("[titan]") and "Warning" not in line]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines and lines[-1].startswith("error: optimizer DistMuon"), done.stderr[-3000:]


def _two_agents(args: list[str], ngpu: int) -> list[str]:
    """``run_train.sh args`` started twice as two "nodes" of ``ngpu`` ranks each (torchrun's
    c10d rendezvous on localhost): the outputs of both agents."""
    from tests.support.gloo import free_port

    env = {**_env(), "NGPU": str(ngpu), "NNODES": "2",
           "RDZV_ENDPOINT": f"localhost:{free_port()}",
           "RDZV_ID": "twonodes", "MODULE": "llama3", "CONFIG": "llama3_debugmodel"}
    agents = [subprocess.Popen(["bash", str(REPO / "run_train.sh"), *args], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = [agent.communicate(timeout=600)[0] for agent in agents]
    for agent, out in zip(agents, outs, strict=True):
        assert agent.returncode == 0, out[-3000:]
    return [re.sub(r"\x1b\[[0-9;]*m", "", out) for out in outs]


def test_two_nodes_under_auto_train_one_job_at_the_four_rank_losses(reference):
    """NNODES=2 NGPU=2 through run_train.sh (two torchrun agents as two nodes) plans once for
    world 4 and trains one job: the losses of NGPU=4 on one node, and of the 1-rank run."""
    args = ["--parallelism.auto", *STEPS, *JOB, *reference.load]
    env = {**_env(), "NGPU": "4", "MODULE": "llama3", "CONFIG": "llama3_debugmodel"}
    one = _run(["bash", str(REPO / "run_train.sh"), *args, "--dump_folder",
                str(reference.root / "node1")], env=env)
    outs = _two_agents([*args, "--dump_folder", str(reference.root / "nodes2")], 2)
    planned = [out for out in outs if "autoparallel plan " in out]
    assert len(planned) == 1 and "(world 4)" in planned[0], outs[0][-3000:]
    assert _losses(planned[0]) == _losses(one) != []
    assert _grad_norms(planned[0]) == _grad_norms(one)
    _assert_same(_losses(planned[0]), reference.losses)
