"""TorchTitan 0.3.0's HF backend (``--module transformers_modeling_backend``) under auto: any
Hugging Face causal LM, its config from ``--hf_model`` (here a local folder holding a Llama
config.json, so nothing is downloaded). Reference: TorchTitan's own parameter count, and a
1-rank run from one seed checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_train_v0_3 import COMMON, STEPS, _assert_same, _losses, _reference, _run, _torchrun

from torchtitan_autoparallel.errors import UserError

pytest.importorskip("transformers")

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 2048, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu",
         "tie_word_embeddings": False}
"""A small Llama 3 (the backend's debug flavor overrides dim / layers / heads to these)."""


def _hf_model(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return str(folder)


def _job(model: str) -> list[str]:
    return ["--module", "transformers_modeling_backend", "--config",
            "transformers_modeling_backend_debugmodel", "--hf_model", model]


def test_plan_on_64_gpus_reads_the_hf_model_and_infers_its_tp(tmp_path, capsys):
    """The layer graph counts the parameters TorchTitan's own model has, infers TP on HF's
    keyword-called attention (colwise q / k / v, rowwise o, as the backend declares), and a
    plan with TP 8 on 64 H100s prints."""
    from torchtitan_autoparallel.cli import main
    from torchtitan_autoparallel.graph.layer_graph import meta_model
    from torchtitan_autoparallel.model_config import model_config_of
    from torchtitan_autoparallel.planner import plan_job
    from torchtitan_autoparallel.planning_inputs import model_layer_graph
    from torchtitan_autoparallel.titan.v0_3 import read_job
    from torchtitan_autoparallel.titan.v0_3.model import model_spec, sized_for, trainer_config

    model = _hf_model(tmp_path / "hf")
    job = read_job([*_job(model), "--parallelism.auto", "--parallelism.tensor_parallel_degree",
                    "8", "--autoparallel.hardware", "h100_sxm"])
    plan = plan_job(job, 64)
    assert plan.mesh.tp == 8 and {layer.tp_mode for layer in plan.layers} == {"sp"}
    config = model_spec("transformers_modeling_backend", "debugmodel").model
    sized_for(config, 2048, trainer_config("transformers_modeling_backend",
                                           {"hf_transformers": {"model": model}}))
    titan = sum(p.numel() for p in meta_model(config.build).parameters())
    graph = model_layer_graph("transformers_modeling_backend", "debugmodel", 2048,
                              model_config_of(job))
    assert graph.total_params == titan
    assert plan.fingerprint["model_config"]["sections"] == {"hf_transformers": {"model": model}}

    assert main(["plan", *_job(model), "--ngpu", "64", "--hardware", "h100_sxm"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"autoparallel plan \w+: mesh .* \(world 64\)", out), out


def test_missing_config_json_is_one_line(tmp_path):
    from torchtitan_autoparallel.titan.v0_3 import read_job

    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"hf_model = .*empty' has no config.json") as info:
        read_job([*_job(str(tmp_path / "empty")), "--parallelism.auto"])
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=r"hf_model is empty: .*--hf_model"):
        read_job([*_job(""), "--parallelism.auto"])


def test_hf_backend_under_auto_with_tp_on_two_ranks_trains_as_one_rank(tmp_path):
    """The plan's TP 2 applied the backend's way (its HF modules converted, its sharding
    declared, then ``model.parallelize``) on 2 CPU ranks: the 1-rank losses from one seed
    checkpoint. On CPU the backend's flex attention runs as causal SDPA (logged)."""
    job = [*_job(_hf_model(tmp_path / "hf")), *COMMON]
    ref = _reference(tmp_path, job)
    out = _torchrun(2, *job, *STEPS, "--parallelism.auto", "--parallelism.tensor_parallel_degree",
                    "2", *ref.load, "--dump_folder", str(tmp_path / "auto2"))
    assert re.search(r"autoparallel plan \w+: mesh .*tp=2", out), out[-3000:]
    assert "HF backend flex attention runs as causal SDPA" in out, out[-3000:]
    _assert_same(_losses(out), ref.losses)


@pytest.mark.slow
def test_dry_run_on_64_fake_ranks(tmp_path):
    """The plan for 64 H100s built and applied on a fake process group (the model on meta)."""
    out = _run(["bash", str(Path(__file__).resolve().parents[1] / "run_train.sh"),
                *_job(_hf_model(tmp_path / "hf"))[4:], "--parallelism.auto",
                "--autoparallel.hardware", "h100_sxm", "--parallelism.tensor_parallel_degree",
                "8", "--training.seq_len", "256", "--dump_folder", str(tmp_path / "dry")],
               env=_dry_env())
    assert re.search(r"autoparallel plan \w+: mesh .*tp=8 \(world 64\)", out), out[-3000:]
    assert "Training completed" in out, out[-3000:]


def _dry_env() -> dict[str, str]:
    from test_train_v0_3 import _env

    return {**_env(), "COMM_MODE": "fake_backend", "NGPU": "64",
            "MODULE": "transformers_modeling_backend",
            "CONFIG": "transformers_modeling_backend_debugmodel"}
