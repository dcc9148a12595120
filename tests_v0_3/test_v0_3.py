"""The TorchTitan 0.3.0 front-end, run in a venv with TorchTitan 0.3.0 (README: "TorchTitan
0.3.0"): ``PYTHONPATH=. python -m pytest -q tests_v0_3``.

References: TorchTitan 0.3.0's own parameter count of its model, the plan TorchTitan 0.2.2's
front-end made of the same job (stored beside this file), and 0.3.0's command line itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _require_0_3() -> None:
    from importlib.metadata import version

    if not version("torchtitan").startswith("0.3."):
        raise RuntimeError("tests_v0_3 runs with TorchTitan 0.3.0 installed (see the README)")


_require_0_3()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


def test_the_installed_release_reads_and_builds_the_models():
    from torchtitan_autoparallel.frontend import frontend

    assert frontend().release == "0.3"
    assert "llama3" in frontend().model_names()


def test_llama3_8b_graph_against_torchtitans_own_counts():
    """Parameters: TorchTitan 0.3.0's ``get_nparams_and_flops``; dense FLOPs: 2 per parameter
    and token outside the embedding (its 6N rule counts forward + backward)."""
    from torchtitan.models.llama3 import model_registry

    from torchtitan_autoparallel.graph.layer_graph import meta_model
    from torchtitan_autoparallel.job.inputs import model_layer_graph
    from torchtitan_autoparallel.titan.v0_3.model import sized_for

    seq = 8192
    graph = model_layer_graph("llama3", "8B", seq)
    config = sized_for(model_registry("8B").model, seq)
    model = meta_model(config.build)
    nparams, flops_per_token = config.get_nparams_and_flops(model, seq)
    assert graph.total_params == nparams
    embedding = graph.layers[0].params
    dense = sum(layer.fwd_flops - layer.attn_flops for layer in graph.layers) / seq
    assert dense == pytest.approx(2 * (nparams - embedding), rel=0.01)
    assert graph.attn_type == "flex"  # the flavor's own kernel, measured as causal SDPA
    assert [layer.linear_styles for layer in graph.blocks][0] == (
        "colwise", "rowwise", "colwise", "rowwise", "colwise")  # fused wqkv is column-wise


FAMILIES = [("llama3", "llama3_8b", "8B"), ("qwen3", "qwen3_14b", "14B"),
            ("deepseek_v3", "deepseek_v3_16b", "16B"), ("gpt_oss", "gpt_oss_20b", "20b"),
            ("kimi_k2_7", "moonlight_16b_a3b", "moonlight-16B-A3B")]
"""Each 0.3.0 decoder family (qwen3_5 and Kimi K2.5, with vision encoders:
``test_multimodal_v0_3.py``)."""


@pytest.mark.parametrize("family,config,flavor", FAMILIES[1:])
def test_each_family_read_against_torchtitans_own_counts_and_planned_on_64(family, config,
                                                                          flavor):
    """Parameters equal TorchTitan 0.3.0's ``get_nparams_and_flops``; FLOPs per token equal
    its estimate (6 x active parameters outside the embedding, 12 x layers x heads x head dim
    x tokens for attention, which it counts without the causal half) within 1 %; the job's
    plan on 64 GPUs (routed experts read: MoE blocks plan with EP where the job sets it)."""
    from torchtitan_autoparallel.graph.layer_graph import meta_model
    from torchtitan_autoparallel.job.inputs import model_layer_graph
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job
    from torchtitan_autoparallel.titan.v0_3.model import model_spec, sized_for

    job = read_job(["--module", family, "--config", config, "--parallelism.auto",
                    "--autoparallel.hardware", "h100_sxm"])
    seq = job.training.seq_len
    graph = model_layer_graph(family, flavor, seq)
    model_config = sized_for(model_spec(family, flavor).model, seq)
    model = meta_model(model_config.build)
    nparams, flops_per_token = model_config.get_nparams_and_flops(model, seq)
    # its attention term grows with the sequence, the rest does not
    attention = model_config.get_nparams_and_flops(model, 2 * seq)[1] - flops_per_token
    assert graph.total_params == nparams
    dense = sum(layer.fwd_flops - layer.attn_flops for layer in graph.layers) / seq
    causal_attention = sum(layer.attn_flops for layer in graph.layers) / seq
    assert 3 * dense == pytest.approx(flops_per_token - attention, rel=0.01)
    # MLA (deepseek_v3, Kimi): value heads are narrower than query / key heads; the graph
    # charges the value product at the query head dim (v padded, as the flash kernel runs
    # it), TorchTitan's estimate at the value head dim
    config = model_config.layers[-1].attention
    qk = getattr(config, "qk_nope_head_dim", 0) + getattr(config, "qk_rope_head_dim", 0)
    padded = 2 * qk / (qk + config.v_head_dim) if qk else 1.0
    assert 2 * 3 * causal_attention == pytest.approx(attention * padded, rel=0.01)
    assert any(layer.num_experts for layer in graph.blocks) == (family not in ("qwen3",))
    plan = plan_job(job, 64)
    assert plan.predicted["peak_memory_gib"] <= plan.predicted["budget_gib"]
    assert [layer.fqn for layer in plan.layers] == [layer.fqn for layer in graph.layers]
    if job.parallelism.expert_parallel_degree > 1:
        assert plan.mesh.ep == job.parallelism.expert_parallel_degree
    # Moonlight's config trains with DistMuon: costed as AdamW, and the plan says so
    assert any(note.startswith("optimizer DistMuon: costed as AdamW") for note in plan.notes) \
        == (family == "kimi_k2_7"), plan.notes


def test_plan_matches_the_0_2_front_end_on_the_same_job(tmp_path):
    """``plan --module llama3 --config llama3_8b --ngpu 64`` on 0.3.0 and the same job's TOML
    on 0.2.2 (same model, batch, sequence): the same mesh and block strategies (but the node
    resharding 0.3.0's FSDP cannot run), step times within 2 % (0.3.0 fuses Q, K and V into
    one GEMM)."""
    out = tmp_path / "plan.json"
    run = _cli("plan", "--module", "llama3", "--config", "llama3_8b", "--ngpu", "64",
               "--hardware", "h100_sxm", "--out", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "autoparallel plan" in run.stdout and "lm_head" in run.stdout
    new = json.loads(out.read_text())
    old = json.loads((HERE / "llama3_8b_64_h100_sxm.v0_2.json").read_text())
    assert new["mesh"] == old["mesh"]
    assert new["global_batch_size"] == old["global_batch_size"]

    def strategies(plan: dict) -> list[tuple]:
        keys = ("kind", "fsdp_unit", "reshard_after_forward", "tp_mode", "ac")
        return [tuple(layer.get(key) for key in keys) for layer in plan["layers"]]

    # 0.3.0's FSDP cannot reshard to a node's ranks (an integer reshard_after_forward): where
    # 0.2.2's plan does, 0.3.0's reshards fully
    expected = [(*s[:2], True if isinstance(s[2], int) and not isinstance(s[2], bool) else s[2],
                 *s[3:]) for s in strategies(old)]
    assert strategies(new) == expected
    assert new["predicted"]["step_time_s"] == pytest.approx(old["predicted"]["step_time_s"],
                                                            rel=0.02)


def test_auto_and_set_keys_on_0_3s_command_line():
    from torchtitan_autoparallel.titan.v0_3 import read_job
    from torchtitan_autoparallel.titan.v0_3.config import Config, parse_job

    config = parse_job(["--module", "llama3", "--config", "llama3_debugmodel",
                        "--parallelism.auto", "--parallelism.tensor_parallel_degree", "2",
                        "--autoparallel.hardware", "h100_sxm"])
    assert isinstance(config, Config) and config.parallelism.auto
    job = read_job(["--module", "llama3", "--config", "llama3_debugmodel",
                    "--parallelism.tensor_parallel_degree", "2"])
    from torchtitan_autoparallel.job.explicit import user_set

    assert user_set(job, "parallelism.tensor_parallel_degree")
    assert not user_set(job, "parallelism.context_parallel_degree")
    assert job.model.name == "llama3" and job.training.seq_len == 2048


def test_a_set_degree_is_a_constraint(tmp_path):
    out = tmp_path / "plan.json"
    run = _cli("plan", "--module", "llama3", "--config", "llama3_8b", "--ngpu", "64",
               "--hardware", "h100_sxm", "--parallelism.tensor_parallel_degree", "4",
               "--out", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(out.read_text())["mesh"]["tp"] == 4


@pytest.mark.parametrize("args,words", [
    (["--module", "llama3", "--config", "llama3_8b", "--parallelism.bogus", "3"], "bogus"),
    (["--module", "llama3", "--config", "no_such_fn"], "no_such_fn"),
    (["--module", "qwen3_5", "--config", "qwen35_9b", "--parallelism.context_parallel_degree",
      "2"], "refuses context parallel"),
    (["--module", "llama3", "--config", "llama3_8b", "--autoparallel.plan_file", "p.json"],
     "plan solves the job afresh"),
])
def test_bad_input_is_one_line(args, words):
    run = _cli("plan", *args, "--ngpu", "8", "--hardware", "h100_sxm")
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_every_0_3_config_key_is_classified():
    """Every key of TorchTitan 0.3.0's config dataclasses (the activation checkpointing
    policies' too) has its KeyHandling words (titan/keys.py), the vocabulary 0.2.2 shares: a key
    added upstream fails here until it is classified."""
    from dataclasses import fields

    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC
    from torchtitan.experiments.transformers_modeling_backend.configs import (
        TransformersBackendConfig,
    )

    from torchtitan_autoparallel.job.inputs import STAGE_SPLIT_KEYS
    from torchtitan_autoparallel.titan.keys import NOTED, REFUSED, check_handling
    from torchtitan_autoparallel.titan.v0_3.config import Config, _leaves
    from torchtitan_autoparallel.titan.v0_3.settings import (
        NOTED_WHY,
        REFUSED_WHY,
        SETTINGS,
        handling_of,
    )

    keys = set(_leaves(Config())) | set(_leaves(TransformersBackendConfig()))  # the HF backend's
    for policy in (FullAC.Config(), MemoryBudgetAC.Config()):
        keys |= {f"activation_checkpoint.{f.name}" for f in fields(policy)}
    assert len(keys) > 100
    assert not sorted(k for k in keys if handling_of(k) is None)
    assert handling_of("parallelism.a_key_added_upstream") is None
    for key, (handling, _) in SETTINGS.items():
        check_handling(key, handling)  # KeyHandling words, each once, passed alone
    # refused whenever set: by check_keys (REFUSED_WHY) or the shared stage-split check
    assert {k for k in keys if handling_of(k) == (REFUSED,)} == set(REFUSED_WHY) | {
        f"parallelism.{k}" for k in STAGE_SPLIT_KEYS}
    assert {k for k in keys if NOTED in handling_of(k)} == set(NOTED_WHY)


@pytest.mark.parametrize("flag,key", [
    (["--parallelism.context_parallel_load_balancer", "ptrr"],
     "parallelism.context_parallel_load_balancer"),
])
def test_a_refused_key_is_one_line_under_auto_only(flag, key):
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.titan.v0_3 import read_job

    base = ["--module", "llama3", "--config", "llama3_debugmodel", *flag]
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        read_job([*base, "--parallelism.auto"])
    assert read_job(base).parallelism.auto is False  # TorchTitan's own recipe runs it


def test_sequence_parallel_off_plans_tensor_parallel_without_it():
    """A job that turns sequence parallel off is planned with TorchTitan's TP without SP
    (tp_mode 'sp/sp:rep', the residual stream whole on every tp rank), with a note and
    TorchTitan's flag in the equivalent command line. qwen3_5 declares sequence parallel
    whatever the flag (as the HF backend does): its tp is held at 1 with a note, and a
    tensor-parallel degree above 1 set beside it is one line."""
    from torchtitan_autoparallel.commands.explain import snippet
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    off = ["--parallelism.auto", "--parallelism.no-enable-sequence-parallel"]
    plan = plan_job(read_job(["--module", "llama3", "--config", "llama3_debugmodel", *off,
                              "--parallelism.tensor_parallel_degree", "2"]), 4)
    assert plan.mesh.tp == 2
    assert {layer.tp_mode for layer in plan.layers if layer.kind == "block"} == {"sp/sp:rep"}
    assert plan.inputs["constraints"]["sequence_parallel"] is False
    assert any(note.startswith("parallelism.enable_sequence_parallel is off") for note in
               plan.notes)
    assert "--parallelism.no-enable-sequence-parallel" in snippet(plan)  # uniform blocks
    assert "tp+sp" not in plan.table()  # the embedding and output say "tp" too
    qwen35 = ["--module", "qwen3_5", "--config", "qwen35_debugmodel", *off]
    plan = plan_job(read_job(qwen35), 4)
    assert plan.mesh.tp == 1
    assert any(note.startswith("parallelism.tensor_parallel_degree held at 1: parallelism."
                               "enable_sequence_parallel is off and TorchTitan 0.3.0's "
                               "qwen3_5 runs") for note in plan.notes), plan.notes
    with pytest.raises(UserError, match=r"tensor_parallel_degree = 2: .* qwen3_5 runs tensor "
                                        r"parallel with sequence parallel only"):
        read_job([*qwen35, "--parallelism.tensor_parallel_degree", "2"])


def test_families_that_ignore_the_sequence_parallel_flag_are_the_ones_listed():
    """``job.SP_ALWAYS`` lists the 0.3.0 families whose model never reads
    ``parallelism.enable_sequence_parallel`` (their sharding declares sequence parallel
    whenever tp > 1): read from each family's own model source, so a family that starts (or
    stops) passing the flag upstream fails here."""
    import inspect

    from torchtitan_autoparallel.titan.v0_3 import PARALLELIZE
    from torchtitan_autoparallel.titan.v0_3.job import SP_ALWAYS
    from torchtitan_autoparallel.titan.v0_3.model import family_module

    ignoring = {family for family in PARALLELIZE if "enable_sequence_parallel" not in
                inspect.getsource(sys.modules[f"{family_module(family).__name__}.model"])}
    assert ignoring == set(SP_ALWAYS) & set(PARALLELIZE)


def test_bfloat16_training_state_is_refused_under_auto_only():
    """``--training.dtype bfloat16``: TorchTitan 0.3.0's trainer builds the model, hence its
    gradients and optimizer state, in bf16 (``set_default_dtype``), which the cost model does
    not charge (float32 state): one line under auto, as 0.2.2 refuses it; float32 (set or not)
    plans, and TorchTitan's own recipe runs either."""
    import importlib.util

    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.titan.v0_3 import read_job
    from torchtitan_autoparallel.titan.v0_3 import settings as v0_3

    base = ["--module", "llama3", "--config", "llama3_debugmodel"]
    with pytest.raises(UserError, match=r"--training\.dtype bfloat16 .*float32 parameters"):
        read_job([*base, "--training.dtype", "bfloat16", "--parallelism.auto"])
    assert read_job([*base, "--training.dtype", "bfloat16"]).training.dtype == "bfloat16"
    assert read_job([*base, "--training.dtype", "float32", "--parallelism.auto"]
                    ).training.dtype == "float32"
    # one row on both releases (0.2.2's table read alone: importing its package would register
    # 0.2.2's adapters in this process)
    spec = importlib.util.spec_from_file_location(
        "torchtitan_autoparallel.titan.v0_2.settings",
        Path(v0_3.__file__).parent.parent / "v0_2" / "settings.py")
    v0_2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(v0_2)
    assert v0_3.SETTINGS["training.dtype"] == v0_2.SETTINGS["training.dtype"]


def test_ac_options_reach_every_planned_mode():
    """``preserve_rng_state``, ``determinism_check`` and ``debug`` (fields of every 0.3.0 AC
    policy) reach torch's checkpoint in the blocks the plan checkpoints with the other mode
    too, as 0.2.2's ``apply_ac`` passes them to every planned mode."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from torchtitan_autoparallel.titan.v0_3.apply import _ac_policies
    from torchtitan_autoparallel.titan.v0_3.config import parse_job

    config = parse_job(["--module", "llama3", "--config", "llama3_debugmodel",
                        "activation-checkpoint:full",
                        "--activation-checkpoint.no-preserve-rng-state",
                        "--activation-checkpoint.determinism-check", "none",
                        "--activation-checkpoint.debug"])
    policies = _ac_policies(config.activation_checkpoint, "")
    assert policies["none"] is None
    for mode in ("full", "selective"):
        wrapped = policies[mode]._wrap_block(torch.nn.Linear(2, 2), base_fqn="layers.0")
        assert isinstance(wrapped, CheckpointWrapper), mode
        kwargs = wrapped.checkpoint_fn.keywords  # what torch.utils.checkpoint is called with
        assert (kwargs["preserve_rng_state"], kwargs["determinism_check"], kwargs["debug"]) \
            == (False, "none", True), mode


def test_cuda_graphs_setting_is_noted_in_the_plan():
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    job = read_job(["--module", "llama3", "--config", "llama3_debugmodel", "--parallelism.auto",
                    "--training.disable_cuda_graphs"])
    assert any("disable_cuda_graphs" in note for note in plan_job(job, 2).notes)


def test_explain_gives_0_3_settings_that_0_3_parses_into_the_plan(tmp_path):
    """The "equivalent settings" of a uniform plan made under 0.3.0 are 0.3.0's own command
    line: its tyro parser (no auto) reads them back into the plan's mesh, batch and AC."""
    from torchtitan_autoparallel.titan.v0_3.config import parse_job

    out = tmp_path / "plan.json"
    # without tp_dp (the tp dim as data parallel, which no TorchTitan degree says): a plan
    # uniform TorchTitan settings can state
    run = _cli("plan", "--module", "llama3", "--config", "llama3_debugmodel", "--ngpu", "4",
               "--hardware", "cpu", "--parallelism.tensor_parallel_degree", "2",
               "--autoparallel.techniques", "fsdp", "hsdp", "ddp", "tp", "cp", "ep", "ac", "pp",
               "--out", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    run = _cli("explain", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert "equivalent TorchTitan 0.3.0 command line:" in lines, run.stdout[-3000:]
    args = lines[lines.index("equivalent TorchTitan 0.3.0 command line:") + 1]
    assert "[parallelism]" not in run.stdout
    plan = json.loads(out.read_text())
    import shlex

    argv = shlex.split(args)
    subcommand = [a for a in argv if a.startswith("activation-checkpoint:")]
    config = parse_job(["--module", "llama3", "--config", "llama3_debugmodel",
                        *[a for a in argv if a not in subcommand], *subcommand])
    p = config.parallelism
    mesh = plan["mesh"]
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
            p.tensor_parallel_degree, p.context_parallel_degree) == \
        (mesh["dp_replicate"], mesh["dp_shard"], mesh["tp"], mesh["cp"])
    assert config.training.local_batch_size == plan["local_batch_size"]
    assert config.training.global_batch_size == plan["global_batch_size"]
    blocks = {layer["ac"] for layer in plan["layers"] if layer["kind"] == "block"}
    ac = config.activation_checkpoint
    assert blocks == {{"SelectiveAC": "selective", "FullAC": "full"}.get(
        type(ac).__qualname__.split(".")[0], "none") if ac is not None else "none"}


def test_tp_dp_is_left_out_under_compile_and_refused_where_asked():
    """0.3.0's apply runs the tp dim as data parallel on eager blocks only: with the model
    compiled the search leaves tp_dp out and says so; named in autoparallel.techniques with
    compile, it is a one-line error. Eager, the same job uses it (the cpu profile picks it)."""
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    base = ["--module", "llama3", "--config", "llama3_debugmodel", "--parallelism.auto",
            "--parallelism.tensor_parallel_degree", "2", "--autoparallel.hardware", "cpu"]
    eager = plan_job(read_job(base), 4)
    assert any(layer.tp_mode == "dp" for layer in eager.layers), eager.table()
    compiled = plan_job(read_job([*base, "--compile.enable"]), 4)
    assert {layer.tp_mode for layer in compiled.layers if layer.kind == "block"} == {"sp"}
    assert any("tp_dp (the tp dim as data parallel) left out" in n for n in compiled.notes)
    with pytest.raises(UserError, match="tp_dp, which TorchTitan 0.3.0's apply does not run "
                                        "with compiled blocks"):
        read_job([*base, "--compile.enable", "--autoparallel.techniques", "fsdp", "tp", "tp_dp"])


def _moe_counts_worker(rank: int, out_dir: str) -> None:
    """One of 2 gloo ranks: DeepSeek-V3's debug MoE (TorchTitan 0.3.0's) on this rank's
    sequence shard of a batch (tp 2, ``tp_dp.moe_on_sequence_shard``: what 'sp/dp' runs with
    ep 1) beside the same MoE on the whole batch, two forward passes."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.titan.v0_3.model import model_spec
    from torchtitan_autoparallel.titan.v0_3.tp_dp import moe_on_sequence_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)  # the same model and batches on both ranks
    moe = model_spec("deepseek_v3", "debugmodel").model.layers[1].moe.build()
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.05)
        moe.expert_bias_E.normal_(0.0, 0.01)
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=None)
    whole = copy.deepcopy(moe)
    moe_on_sequence_shard(moe, mesh)
    error = 0.0
    for _ in range(2):
        x = torch.randn(2, 24, 256)
        expected = whole(x).chunk(2, dim=1)[rank]
        got = moe(x.chunk(2, dim=1)[rank].contiguous())
        error = max(error, (got - expected).abs().max().item())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "output": error, "counts": moe.tokens_per_expert_E.tolist(),
        "whole_counts": whole.tokens_per_expert_E.tolist()}))


def test_sub_block_moe_counts_tokens_over_tp_with_ep_1(tmp_path):
    """A whole MoE run data parallel over tp ('sp/dp' with ep 1 on 0.3.0) on each of 2 ranks'
    sequence shards gives the whole batch's outputs on its shard, and its load-balancing
    token counts are those of the same MoE run on the whole batch on 1 rank: each rank routes
    half the tokens, and the counts it adds are summed over tp (TorchTitan's expert-bias
    update sums them over tp only under expert parallel)."""
    from tests.support.gloo import spawn

    spawn(_moe_counts_worker, tmp_path)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["output"] < 1e-5
        assert report["counts"] == report["whole_counts"]
        assert sum(report["counts"]) == 2 * 2 * 24 * 3  # two batches, every token's top-3


MOE_TP_CASES = (("deepseek_v3", "debugmodel", "sp", 1), ("deepseek_v3", "debugmodel", "sp", 2),
                ("deepseek_v3", "debugmodel", "sp/sp:shared_dp", 1),
                ("deepseek_v3", "debugmodel", "dp/sp:shared_dp", 1),
                ("deepseek_v3", "debugmodel", "sp/sp:rep", 1),
                ("deepseek_v3", "debugmodel", "sp/sp:rep", 2),
                ("qwen3", "debugmodel_moe", "sp", 2), ("qwen3", "debugmodel_moe", "sp/sp:rep", 2))
"""(family, flavor, tp mode, ep) of the MoE blocks whose collectives over tp are counted: with
shared experts (DeepSeek-V3) and without (qwen3's MoE), with and without EP, with sequence
parallel ('sp'; the shared experts data parallel beside the MoE TP, 'sp/sp:shared_dp', and
the attention too, 'dp/sp:shared_dp') and without it ('sp/sp:rep')."""


def _moe_collectives_worker(rank: int, out_dir: str) -> None:
    """One of 2 gloo ranks: each of ``MOE_TP_CASES`` (TorchTitan 0.3.0's model, SDPA) on tp 2,
    parallelized by its own sharding declarations (for the MoE sub-block modes with each MoE
    block's data-parallel parts as the apply runs them, ``tp_dp.override_declared_sharding``);
    rank 0 writes the collectives each block issues in one forward and one backward."""
    import importlib

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import get_spmd_context

    from torchtitan_autoparallel.candidates.layout import MOE_SUB_BLOCK_MODES, Mesh
    from torchtitan_autoparallel.titan.v0_3.cpu import uneven_all_to_all
    from torchtitan_autoparallel.titan.v0_3.model import as_sdpa, model_spec
    from torchtitan_autoparallel.titan.v0_3.tp_dp import moe_parts, override_declared_sharding

    uneven_all_to_all()
    report = []
    for family, flavor, mode, ep in MOE_TP_CASES:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=ep, world_size=2)
        config = model_spec(family, flavor).model
        as_sdpa(config)
        sharding = importlib.import_module(f"torchtitan.models.{family}.sharding")
        getattr(sharding, f"set_{family}_sharding_config")(
            config, enable_sp=mode != "sp/sp:rep", enable_ep=ep > 1)
        torch.manual_seed(0)
        model = config.build()
        if mode in MOE_SUB_BLOCK_MODES:  # the block itself: the model's declarations
            mesh = Mesh(dp_replicate=1, dp_shard=1, tp=2, ep=ep)
            override_declared_sharding(
                {name: moe_parts(block, mesh, mode)[:-1]
                 for name, block in model.layers.named_children() if block.moe_enabled},
                init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        model.parallelize(dims)
        with get_spmd_context(parallel_dims=dims)(), CommDebugMode() as counted:
            model(torch.randint(0, 1000, (2, 64))).float().sum().backward()
        report.append({fqn.partition(".")[2]: {phase: {str(op).rpartition(".")[2]: n
                                                       for op, n in ops.items()}
                                               for phase, ops in counts.items()}
                       for fqn, counts in counted.comm_module_counts.items()})
    if rank == 0:
        Path(out_dir, "counts.json").write_text(json.dumps(report))


def test_moe_tp_costs_the_collectives_the_model_issues(tmp_path):
    """The collectives over tp the cost model charges a MoE block on TorchTitan 0.3.0
    (``comm.tp_comm_s``, tp 2, no async TP) are those TorchTitan's own models issue per block
    on 2 gloo ranks, counted by kind: with sequence parallel, with ep 1 the MoE's input
    all-gathered and its routed and shared experts' outputs reduce-scattered apart (with the
    shared experts data parallel on a cut of the gathered input, 'sp/sp:shared_dp', the
    routed experts' alone; with the attention on a batch shard too, 'dp/sp:shared_dp', the
    four all-to-alls around it instead of its pair), under EP only the shared experts' pair
    (none in qwen3's MoE: its router and routed experts run on the sequence shard); without it
    ('sp/sp:rep', planned with tp > 1 now), the MoE's output all-reduced, its input gradient
    all-reduced where something gathered the stream (ep 1, shared experts), and under EP two
    all-gathers more in backward (the router and the routed experts each cut their rank's
    sequence shard out of the whole stream)."""
    from torchtitan_autoparallel.candidates.layout import BlockStrategy, Mesh
    from torchtitan_autoparallel.cost.comm import tp_comm_s
    from torchtitan_autoparallel.cost.common import CostContext, Precision, collective_s
    from torchtitan_autoparallel.cost.hardware import load_profile
    from torchtitan_autoparallel.job.features import Features, features_from_config
    from torchtitan_autoparallel.job.inputs import layer_graph_for
    from torchtitan_autoparallel.titan.v0_3 import read_job

    from tests.support.gloo import spawn

    spawn(_moe_collectives_worker, tmp_path)
    reports = json.loads((tmp_path / "counts.json").read_text())
    features = features_from_config(read_job(["--module", "qwen3", "--config",
                                              "qwen3_moe_debug"]))
    assert features == Features(moe_routed_on_shard=True)  # 0.3.0's rule, in every job
    ctx = CostContext(hw=load_profile("h100_sxm"), prec=Precision(2, 4), gpus_per_node=8,
                      features=features)
    # (kind, bytes per stream byte); gloo runs DTensor's all-to-all of the stream between its
    # sequence and batch shards as an all-gather and a chunk (it warns so)
    kinds = {"allreduce_": ("all_reduce", 1), "_allgather_base_": ("all_gather", 1),
             "_reduce_scatter_base_": ("reduce_scatter", 1),
             "all_gather_into_tensor": ("all_to_all", 1 / 2)}
    graphs = {}
    for (family, flavor, mode, ep), report in zip(MOE_TP_CASES, reports, strict=True):
        graph = graphs.get(family) or graphs.setdefault(family, layer_graph_for(read_job(
            ["--module", family, "--config", f"{family}_{flavor}".replace(
                "qwen3_debugmodel_moe", "qwen3_moe_debug")])))
        index, block = next((i, b) for i, b in enumerate(graph.blocks) if b.expert_params)
        act = block.io_bytes * ctx.act_scale
        counted = sum(n * collective_s(kinds[op][0], act * kinds[op][1], 2, False, ctx.hw)
                      for phase in report[f"layers.{index}"].values()
                      for op, n in phase.items() if op in kinds)
        charged = tp_comm_s(block, Mesh(dp_replicate=1, dp_shard=1, tp=2, cp=1, ep=ep),
                            BlockStrategy("none", False, mode), 1, ctx)
        assert charged == pytest.approx(counted), (family, mode, ep, report[f"layers.{index}"])


def test_sub_block_moe_offered_with_expert_parallel():
    """0.3.0 runs a MoE block's 'sp/dp' beside the model's own expert parallel: the search
    offers it to DeepSeek-V3's MoE blocks with ep 1 (the whole MoE data parallel over tp), and
    with ep 2 and 4 on fsdp 2 x tp 2 (the shared experts data parallel, the routed experts on
    the model's EP, up to all of dp_shard x tp), as 'dp/sp' (the attention data parallel over
    tp), and with ep 1 'sp/sp:shared_dp' and 'dp/sp:shared_dp' (the shared experts alone data
    parallel beside the model's MoE TP; not to qwen3's MoE, which has none). A plan searched
    with ep 2 puts its MoE blocks in one of them on the CPU profile."""
    from torchtitan_autoparallel.candidates.layout import Mesh
    from torchtitan_autoparallel.candidates.strategies import block_tp_modes
    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    base = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--parallelism.auto",
            "--training.disable_cuda_graphs", "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2", "--autoparallel.hardware", "cpu",
            "--autoparallel.techniques", "fsdp", "tp", "ep", "ac", "tp_sub_block"]
    constraints = job_inputs(read_job(base), 4).constraints
    for ep in (1, 2, 4):
        mesh = Mesh(dp_replicate=1, dp_shard=2, tp=2, ep=ep)
        assert block_tp_modes(mesh, 2, constraints, True, experts=True) == (
            "sp", "sp/dp", "dp/sp", *(("sp/sp:shared_dp", "dp/sp:shared_dp") if ep == 1
                                      else ())), ep
    plan = plan_job(read_job([*base, "--parallelism.expert_parallel_degree", "2"]), 4)
    modes = {layer.tp_mode for layer in plan.layers if layer.kind == "block"}
    assert modes & {"sp/dp", "dp/sp"}, plan.table()
    # gpt-oss's attention (sinks, flex masks built for the whole batch) is not run data
    # parallel by the apply: its MoE blocks are offered 'sp/dp' alone
    gpt_oss = ["--module", "gpt_oss", "--config", "gpt_oss_debugmodel", "--parallelism.auto",
               *base[-6:]]
    assert job_inputs(read_job(gpt_oss), 4).constraints.moe_sub_block_modes == ("sp/dp",)
    assert constraints.moe_sub_block_modes == ("sp/dp", "dp/sp", "sp/sp:shared_dp",
                                               "dp/sp:shared_dp")
    qwen3 = ["--module", "qwen3", "--config", "qwen3_moe_debug", "--parallelism.auto",
             *base[-6:]]
    assert job_inputs(read_job(qwen3), 4).constraints.moe_sub_block_modes == ("sp/dp", "dp/sp")


def test_sub_block_search_notes_moe_blocks_and_refuses_full_dtensor():
    """0.3.0's apply runs every dense sub-block mode: a tp_sub_block search offers them all
    (on a job with sequence parallel off, those on a replicated stream) and notes where MoE
    blocks take theirs; under the full_dtensor backend tp_sub_block is refused in one line."""
    from torchtitan_autoparallel.candidates.layout import SUB_BLOCK_TP_MODES, Mesh
    from torchtitan_autoparallel.candidates.strategies import block_tp_modes
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import SUB_BLOCKS_APPLIED, read_job

    assert SUB_BLOCKS_APPLIED == SUB_BLOCK_TP_MODES
    base = ["--module", "llama3", "--config", "llama3_debugmodel", "--parallelism.auto",
            "--parallelism.tensor_parallel_degree", "2", "--autoparallel.hardware", "cpu",
            "--autoparallel.techniques", "fsdp", "tp", "ac", "tp_sub_block"]
    plan = plan_job(read_job(base), 4)
    assert plan.inputs["constraints"]["sub_block_modes"] == list(SUB_BLOCKS_APPLIED)
    assert any("'sp/dp', the MoE data parallel over tp" in note for note in plan.notes)
    off = job_inputs(read_job([*base, "--parallelism.no-enable-sequence-parallel"]), 4)
    assert block_tp_modes(Mesh(dp_replicate=1, dp_shard=2, tp=2), 2, off.constraints) == (
        "sp/sp:rep", "dp/sp:rep", "sp/dp:rep")
    with pytest.raises(UserError, match="tp_sub_block, which TorchTitan 0.3.0's apply does not "
                                        "run under --parallelism.spmd_backend full_dtensor"):
        read_job([*base, "--parallelism.spmd_backend", "full_dtensor"])
