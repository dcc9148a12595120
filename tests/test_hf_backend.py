"""TorchTitan's HF backend (``torchtitan.experiments.transformers_modeling_backend``) as a
first-class model under auto: a Llama-architecture ``config.json`` written here, the README's
config (4 layers, dim 64 through the ``tiny`` flavor of tests/support/hf_tiny.py), planned
offline and trained at 2 ranks with losses and gradient norms equal to TorchTitan's own 1-rank
recipe for the backend (seed checkpoint, fp32). Skipped without the ``[hf]`` extra."""

import json
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.experiments.transformers_modeling_backend",
                    exc_type=ImportError)

from torchtitan_autoparallel.errors import UserError  # noqa: E402
from torchtitan_autoparallel.plan.schema import Plan  # noqa: E402

from tests.support.parity import assert_parity, make_seed_checkpoint, run_job  # noqa: E402

BACKEND = "transformers_modeling_backend"

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

QWEN2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
         "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False}
"""Qwen2: biased q / k / v projections."""

ARCHS = {
    "mistral": {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": 4096},
    "qwen3": {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "head_dim": 16},
    "gemma": {**LLAMA, "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
              "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"},
    "olmo2": {**LLAMA, "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"},
    "phi3": {**LLAMA, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "mixtral": {**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**LLAMA, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 128},
}
"""Other HF architectures at the ``tiny`` flavor's sizes: sliding window (Mistral), per-head
q / k norms (Qwen3), a scaled embedding (Gemma), whole-projection q / k norms (OLMo2), fused
projections (Phi-3), routed experts (Mixtral, Qwen2-MoE)."""

# the README's example, with the test's tiny flavor
TOML = """\
[job]
dump_folder = "./outputs"
custom_config_module = "torchtitan.experiments.transformers_modeling_backend.job_config"

[experimental]
custom_import = "tests.support.hf_tiny"

[hf_transformers]
model = "{model}"

[model]
name = "transformers_modeling_backend"
flavor = "tiny"
hf_assets_path = "./assets/tokenizer"

[optimizer]
name = "AdamW"
lr = 0.0008

[lr_scheduler]
warmup_steps = 2

[training]
local_batch_size = 2
global_batch_size = 4
seq_len = 128
steps = 5
max_norm = 1.0
dataset = "autoparallel_text"
mixed_precision_param = "float32"
mixed_precision_reduce = "float32"

[parallelism]
{auto}

[autoparallel]
hardware = "cpu"
"""


def write_job(folder: Path, auto: bool, config: dict | None = None) -> str:
    """A local HF model folder (config.json) and a TorchTitan config naming it."""
    model = folder / "hf_model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config or LLAMA, indent=1))
    path = folder / ("auto.toml" if auto else "recipe.toml")
    path.write_text(TOML.format(model=model, auto="auto = true" if auto else ""))
    return str(path)


def _job(config: str, *overrides: str):
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import import_custom_module, register

    register()
    job = parse_config(["--job.config_file", config, *overrides])
    import_custom_module(job)
    return job


def test_model_name_from_experiments():
    from torchtitan_autoparallel.job.validate import check_model_name

    check_model_name(BACKEND)  # TorchTitan's get_train_spec resolves it
    with pytest.raises(UserError, match="not a registered model"):
        check_model_name("no_such_model")


def test_missing_packages_are_one_line(monkeypatch):
    from torchtitan.protocols import train_spec

    from torchtitan_autoparallel.titan.v0_2.registry import train_spec_of

    def missing(name):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(train_spec, "get_train_spec", missing)
    with pytest.raises(UserError, match=r"cannot be imported: No module named 'transformers'; "
                       r"install what it needs \(pip install -e '\.\[hf\]'\)"):
        train_spec_of(BACKEND)


def test_custom_config_module_keeps_the_projects_sections(tmp_path):
    """The backend's ``[hf_transformers]`` and the project's ``[autoparallel]`` / ``auto``
    parse together, whether the module is named in the TOML or on the command line."""
    config = write_job(tmp_path, auto=True)
    job = _job(config)
    assert job.hf_transformers.model == str(tmp_path / "hf_model")
    assert job.parallelism.auto and job.autoparallel.hardware == "cpu"
    cli = _job(config, "--job.custom_config_module="
               "torchtitan.experiments.transformers_modeling_backend.job_config",
               "--hf_transformers.model=elsewhere")
    assert cli.hf_transformers.model == "elsewhere" and cli.parallelism.auto


def test_layer_graph_of_hf_model(tmp_path):
    """Blocks captured on meta (HF's rotary autocast, keyword ``position_embeddings``), named
    as TorchTitan's backend names them; sizes from the flavor over the config.json."""
    from torchtitan_autoparallel.job.inputs import layer_graph_for

    graph = layer_graph_for(_job(write_job(tmp_path, auto=True)))
    assert [layer.fqn for layer in graph.layers] == [
        "tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "output"]
    assert (graph.dim, graph.vocab_size, graph.n_heads, graph.n_kv_heads, graph.head_dim) == (
        64, 2048, 4, 2, 16)
    assert all(b.fwd_flops > b.attn_flops > 0 for b in graph.blocks)
    assert "layers.0.self_attn.q_proj" in graph.module_names
    assert dict(graph.excluded).keys() == {"cp"}


def test_plan_offers_and_names_every_technique(tmp_path, capsys):
    """``plan`` on 8 devices: TP, PP and selective AC offered (not excluded), CP excluded with
    its reason; the fingerprint names the HF config, and ``explain`` rebuilds the graph from
    the plan file alone."""
    from torchtitan_autoparallel.commands import cli

    config = write_job(tmp_path, auto=True)
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", config, "--ngpu", "8", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "excluded cp: HF attention is a function" in table
    for technique in ("tp", "pp", "selective_ac"):
        assert f"excluded {technique}" not in table
    assert "tok_embeddings" in table and "layers.0" in table
    plan = Plan.load(str(out))
    identity = plan.fingerprint["model_config"]
    assert identity["sections"] == {"hf_transformers": {"model": str(tmp_path / "hf_model")}}
    assert len(identity["hf_config_sha256"]) == 16
    assert cli.main(["explain", str(out)]) == 0
    # long module names (HF's own, e.g. model.model.layers.10) keep the columns apart
    for layer in plan.layers:
        layer.fqn = f"model.model.{layer.fqn}"
    lines = plan.table().splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("layers "))
    column = lines[header].index("strategy")
    assert all(line[column - 2:column] == "  " for line in lines[header + 1:])


def test_fingerprint_follows_the_config_json(tmp_path):
    """Editing config.json changes the fingerprint (a plan made from the old one is refused);
    a folder without config.json is one line."""
    from torchtitan_autoparallel.job.inputs import fingerprint_diff, job_inputs

    config = write_job(tmp_path, auto=True)
    before = job_inputs(_job(config), 2).fingerprint
    write_job(tmp_path, auto=True, config={**LLAMA, "rope_theta": 500000.0})
    after = job_inputs(_job(config), 2).fingerprint
    assert any(line.startswith("model_config:") for line in fingerprint_diff(before, after))
    (tmp_path / "hf_model" / "config.json").unlink()
    with pytest.raises(UserError, match="has no config.json"):
        job_inputs(_job(config), 2)


def test_rotary_buffers_after_meta_init(tmp_path):
    """TorchTitan's meta init leaves HF's non-persistent ``inv_freq`` uninitialised; the
    project's train spec recomputes it (runtime/hf.py)."""
    import copy

    import torch

    from torchtitan_autoparallel.job.model_config import model_config_of
    from torchtitan_autoparallel.titan.v0_2.model import graph_job_config
    from torchtitan_autoparallel.titan.v0_2.registry import make_plannable, train_spec_of

    job = _job(write_job(tmp_path, auto=True))
    make_plannable(BACKEND)
    spec = train_spec_of(BACKEND)
    args = copy.deepcopy(spec.model_args["tiny"])
    args.update_from_config(graph_job_config(model_config_of(job), 128))
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    expected = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    torch.testing.assert_close(model.rotary_emb.inv_freq, expected)


def _reference(tmp: Path, config: dict) -> tuple:
    """Seed checkpoint and TorchTitan's own (non-auto) 1-rank recipe for the backend, through
    run_train.sh; and the auto config of the same job."""
    recipe, auto = write_job(tmp, False, config), write_job(tmp, True, config)
    seed = make_seed_checkpoint(recipe, tmp)
    return auto, seed, run_job(recipe, 1, tmp / "ref", seed_checkpoint=seed)


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("hf"), LLAMA)


def _auto_parity(hf_reference, tmp_path, ngpu: int, *overrides: str) -> Plan:
    auto, seed, reference = hf_reference
    path = tmp_path / "plan.json"
    result = run_job(auto, ngpu, tmp_path / "run",
                     [f"--autoparallel.save_plan={path}", *overrides], seed_checkpoint=seed)
    assert path.exists(), result.output[-3000:]
    assert_parity(reference, result)
    return Plan.load(str(path))


def test_fsdp_parity(hf_reference, tmp_path):
    plan = _auto_parity(hf_reference, tmp_path, 2, "--autoparallel.techniques=fsdp,ac")
    assert (plan.mesh.dp_shard, plan.mesh.world) == (2, 2)


@pytest.mark.slow  # measured passing
def test_tensor_parallel_parity(hf_reference, tmp_path):
    """The backend's own TP function on the planned blocks (tp 2, sequence parallel)."""
    plan = _auto_parity(hf_reference, tmp_path, 2, "--parallelism.tensor_parallel_degree=2")
    assert plan.mesh.tp == 2
    assert {layer.tp_mode for layer in plan.layers} == {"sp"}


@pytest.mark.slow  # measured passing
def test_pipeline_parity(hf_reference, tmp_path):
    """The planner's stage split through the backend's pipeline function (pp 2)."""
    plan = _auto_parity(hf_reference, tmp_path, 2, "--parallelism.pipeline_parallel_degree=2")
    assert plan.mesh.pp == 2 and plan.pipeline is not None


@pytest.mark.slow  # measured passing
def test_mixed_plan_parity(hf_reference, tmp_path):
    """A plan (edited, then replayed from its file) whose blocks mix TP + SP, the tp dim used
    as data parallel, selective and full AC, on fsdp 2 x tp 2."""
    from torchtitan_autoparallel.job.request import plan_job

    auto, seed, reference = hf_reference
    techniques = "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,ac"
    plan = plan_job(_job(auto, "--parallelism.tensor_parallel_degree=2", techniques), 4)
    assert (plan.mesh.tp, plan.mesh.dp_shard) == (2, 2)
    plan.local_batch_size = 2  # the tp ranks split it
    plan.gradient_accumulation_steps = plan.global_batch_size // (2 * plan.mesh.dp)
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    for i, layer in enumerate(blocks):
        layer.tp_mode = "dp" if i % 2 else "sp"
        layer.fsdp_unit = 1  # alternating blocks: one FSDP unit each
    blocks[0].ac, blocks[1].ac = "selective", "full"
    path = tmp_path / "mixed.json"
    plan.save(str(path))
    result = run_job(auto, 4, tmp_path / "run",
                     [f"--autoparallel.plan_file={path}",
                      "--parallelism.tensor_parallel_degree=2", techniques],
                     seed_checkpoint=seed)
    assert "tp_dp" in result.output and "ac:selective" in result.output, \
        result.output[-3000:]
    assert_parity(reference, result)


@pytest.mark.slow  # measured passing
def test_qwen2_tensor_parallel_parity(tmp_path):
    """A Qwen2-architecture config.json (biased q / k / v) at tp 2."""
    reference = _reference(tmp_path / "ref", QWEN2)
    plan = _auto_parity(reference, tmp_path, 2, "--parallelism.tensor_parallel_degree=2")
    assert plan.mesh.tp == 2


QWEN2_7B = {**QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
            "max_position_embeddings": 32768}
"""Qwen2.5-7B's config.json sizes (the ``qwen2_7b`` flavor of tests/support/hf_tiny.py sets
them)."""


@pytest.mark.slow  # measured passing (37 s)
def test_qwen2_7b_on_64_h100s_offers_tp_sac_pp_and_builds_them(tmp_path, capsys):
    """A 7B Qwen2.5-shaped HF model on 64 H100s: ``plan`` offers TP, selective AC and PP (none
    excluded), and a 64-rank fake-backend dry run builds tp 4 x pp 2 with op-level selective
    AC on every block, its sharded state as predicted."""
    import os
    import subprocess

    from torchtitan_autoparallel.commands import cli

    from tests.test_dry_run import check_report

    config = write_job(tmp_path, auto=True, config=QWEN2_7B)
    text = Path(config).read_text().replace('flavor = "tiny"', 'flavor = "qwen2_7b"').replace(
        'hardware = "cpu"', 'hardware = "h100_sxm"').replace(
        "local_batch_size = 2\nglobal_batch_size = 4\nseq_len = 128",
        "local_batch_size = 1\nglobal_batch_size = 64\nseq_len = 4096").replace(
        'mixed_precision_param = "float32"', 'mixed_precision_param = "bfloat16"')
    Path(config).write_text(text)
    assert cli.main(["plan", "--config", config, "--ngpu", "64"]) == 0
    table = capsys.readouterr().out
    for technique in ("tp", "pp", "selective_ac"):
        assert f"excluded {technique}" not in table, table
    result = subprocess.run(
        [str(Path(__file__).resolve().parent.parent / "run_train.sh"),
         f"--job.dump_folder={tmp_path / 'out'}", "--parallelism.tensor_parallel_degree=4",
         "--parallelism.pipeline_parallel_degree=2", "--activation_checkpoint.mode=selective",
         "--activation_checkpoint.selective_ac_option=op"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NGPU": "64", "COMM_MODE": "fake_backend", "CONFIG_FILE": config})
    out = check_report(result, 64)
    assert "mesh pp=2 dp_replicate=1 dp_shard=8 cp=1 tp=4 (world 64)" in out
    assert "activation_checkpoint.mode = 'selective' on every block" in out
    assert '"mesh": ["fsdp", "tp"]' in out  # blocks are tensor parallel, FSDP over the rest


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "gemma"])
def test_tp_offered_where_the_backend_shards_the_blocks(tmp_path, arch):
    """The backend's TP function runs these (measured: tp 2 trains at the 1-rank losses, see
    test_other_architectures_train_as_one_rank): planned at tp 2."""
    from torchtitan_autoparallel.job.request import plan_job

    config = write_job(tmp_path, auto=True, config=ARCHS[arch])
    plan = plan_job(_job(config, "--parallelism.tensor_parallel_degree=2"), 2)
    assert plan.mesh.tp == 2


def test_whole_projection_qk_norms_refuse_tp_in_one_line(tmp_path):
    """OLMo2 normalises the whole q / k projections; the backend's TP plan shards them as
    per-head norms and its run crashed at tp 2 ("aten.add.Tensor got mixed torch.Tensor and
    DTensor"). TP is left out with the reason; a job asking for it is one line."""
    from torchtitan_autoparallel.job.request import plan_job

    config = write_job(tmp_path, auto=True, config=ARCHS["olmo2"])
    with pytest.raises(UserError, match=r"needs tp, which .* cannot use: the family's TP plan "
                       r"does not fit this model \(layers\.0: self_attn\.q_norm") as info:
        plan_job(_job(config, "--parallelism.tensor_parallel_degree=2"), 2)
    assert "\n" not in str(info.value)
    assert plan_job(_job(config), 2).mesh.tp == 1


@pytest.mark.parametrize("arch, words", [
    ("phi3", r"cannot run Phi3ForCausalLM .*its init_weights, which every run goes through, "
             r"raises AttributeError: 'Phi3Attention' object has no attribute 'q_proj'"),
    ("mixtral", r"cannot run MixtralForCausalLM .*its init_weights, which every run goes "
                r"through, leaves model\.model\.layers\.0\.block_sparse_moe\.gate\.weight "
                r"\(52 parameters in all\) unwritten"),
    ("qwen2_moe", r"cannot build Qwen2MoeForCausalLM .*: KeyError: 'sdpa_torchtitan'"),
])
def test_an_architecture_the_backend_cannot_run_is_one_line(tmp_path, arch, words):
    """TorchTitan's own 1-rank recipe stops at these with a traceback, or (Mixtral) trains
    on parameters its init never wrote, to NaN losses (measured); planning says so in one
    line, and so does run_train.sh's preflight for the recipe (no auto) before any rank
    starts."""
    from torchtitan_autoparallel.job.request import plan_job

    with pytest.raises(UserError, match=words):
        plan_job(_job(write_job(tmp_path, auto=True, config=ARCHS[arch])), 2)
    result = run_job(write_job(tmp_path, auto=False, config=ARCHS[arch]), 2, tmp_path / "run",
                     preflight=True)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.output[-3000:]
    assert "Traceback" not in result.output and "[rank" not in result.output
    assert arch.split("_")[0] in errors[0].lower()


@pytest.mark.slow  # measured passing
@pytest.mark.parametrize("arch, overrides", [
    ("mistral", ["--parallelism.tensor_parallel_degree=2"]),
    ("qwen3", ["--parallelism.tensor_parallel_degree=2"]),
    ("gemma", ["--parallelism.tensor_parallel_degree=2"]),
    ("olmo2", []),
])
def test_other_architectures_train_as_one_rank(tmp_path, arch, overrides):
    """Sliding window, per-head q / k norms and a scaled embedding at the planned tp 2, OLMo2
    as planned (no TP): TorchTitan's 1-rank recipe losses from one seed checkpoint."""
    plan = _auto_parity(_reference(tmp_path / "ref", ARCHS[arch]), tmp_path, 2, *overrides)
    assert plan.mesh.tp == (2 if overrides else 1)


def test_mixtral_parameters_left_unwritten_by_init_are_refused_at_init(tmp_path):
    """Past the preflight (a run started without it), the rank's own init refuses too: the
    backend's init_weights never writes Mixtral's router and experts."""
    import copy

    import torch

    from torchtitan_autoparallel.job.model_config import model_config_of
    from torchtitan_autoparallel.titan.v0_2.model import graph_job_config
    from torchtitan_autoparallel.titan.v0_2.registry import make_plannable, train_spec_of

    job = _job(write_job(tmp_path, auto=False, config=ARCHS["mixtral"]))
    make_plannable(BACKEND)
    spec = train_spec_of(BACKEND)
    args = copy.deepcopy(spec.model_args["tiny"])
    args.update_from_config(graph_job_config(model_config_of(job), 128))
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with pytest.raises(UserError, match=r"leaves model\.model\.layers\.0\.block_sparse_moe\."
                       r"gate\.weight \(52 parameters in all\) uninitialised"), torch.no_grad():
        model.init_weights(buffer_device=None)
