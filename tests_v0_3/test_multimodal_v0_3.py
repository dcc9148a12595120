"""TorchTitan 0.3.0's multimodal hybrid families under the planner: qwen3_5 (Gated DeltaNet
and full-attention layers, a vision encoder) and Kimi K2.5 / Kimi-VL (a MoonViT3d encoder
before a DeepSeek-V3 decoder).

References: fla's own pure-torch chunked gated delta rule (its ``naive`` module), the linear
shapes and patch counts of the encoders themselves, TorchTitan 0.3.0's parameter count and the
TP its models declare.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]


def _flops(fn, *args) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


@pytest.mark.parametrize("t,h,k,v", [(256, 2, 32, 64), (200, 3, 64, 32)])
def test_delta_rule_stand_in_counts_flas_reference_flops(t, h, k, v):
    """The meta stand-in of the Gated DeltaNet kernel runs the GEMMs fla's pure-torch chunked
    gated delta rule runs (its reference for the Triton kernel), on padded chunks."""
    import importlib

    from torchtitan_autoparallel.titan.v0_3.multimodal import gated_delta_on_meta

    # fla imported after the project's 0.3.0 package, which drops fla-core 0.5's stale
    # autotune key that Triton 3.9 refuses at import (titan/v0_3/triton_keys.py)
    naive = importlib.import_module("fla.ops.gated_delta_rule.naive")
    naive_chunk_gated_delta_rule = naive.naive_chunk_gated_delta_rule
    gen = torch.Generator().manual_seed(0)
    q, kk = (torch.randn(1, t, h, k, generator=gen) for _ in range(2))
    vv = torch.randn(1, t, h, v, generator=gen)
    g = -torch.rand(1, t, h, generator=gen)
    beta = torch.rand(1, t, h, generator=gen)
    reference = _flops(naive_chunk_gated_delta_rule, q, kk, vv, g, beta)
    meta = [x.to("meta") for x in (q, kk, vv, g, beta)]
    assert _flops(gated_delta_on_meta, None, *meta) == reference
    out = gated_delta_on_meta(None, *meta)
    assert out.shape == vv.shape


def _encoder(family: str, flavor: str):
    import copy

    from torchtitan_autoparallel.graph.layer_graph import meta_model
    from torchtitan_autoparallel.titan.v0_3.model import as_sdpa, model_spec, sized_for

    config = copy.deepcopy(model_spec(family, flavor).model)
    as_sdpa(config)
    sized_for(config, 512)
    return meta_model(config.build).vision_encoder


@pytest.mark.parametrize("family,flavor", [("qwen3_5", "debugmodel"),
                                           ("kimi_k2_7", "debugmodel")])
@pytest.mark.parametrize("seq", [512, 2048])
def test_vision_encoder_work_is_its_linears_and_attention_over_the_images(family, flavor, seq):
    """One sequence's encoder FLOPs: every linear of the encoder over the patches it sees
    (the merger's over the merged tokens) plus non-causal attention within each image of
    ``IMAGE_TOKENS`` tokens, counted from the encoder's own modules."""
    from torchtitan_autoparallel.titan.v0_3.multimodal import (
        IMAGE_TOKENS,
        merge_unit,
        vision_encoder_work,
    )

    encoder = _encoder(family, flavor)
    rows, cols = merge_unit(encoder)
    tokens = min(seq, IMAGE_TOKENS)
    patches = tokens * rows * cols
    linears = 0
    for name, module in encoder.named_modules():
        if isinstance(module, torch.nn.Linear):
            merged = not (name.startswith("layers") or name.startswith("patch_embed"))
            linears += 2 * module.in_features * module.out_features * (
                tokens if merged else patches)
    width = encoder.patch_embed.out_features
    attention = 4 * patches * patches * width * len(encoder.layers)
    work = vision_encoder_work(encoder, seq)
    assert work.fwd_flops == pytest.approx((seq / tokens) * (linears + attention), rel=0.02)
    assert work.saved_bytes > 0 and work.io_bytes == 4 * len(encoder.layers) * (
        seq / tokens) * patches * width


@pytest.mark.parametrize("family,config,tp", [("qwen3_5", "qwen35_9b", 2),
                                              ("kimi_k2_7", "kimi_vl_a3b", 1)])
def test_multimodal_family_read_and_planned_on_64(family, config, tp):
    """The encoder is a layer of the graph (parameters: TorchTitan 0.3.0's count of the whole
    model); qwen3_5's Gated DeltaNet blocks take the TP styles the model declares; the plan
    on 64 H100s fits, keeps the job's TP and EP, and says what it assumed of the images."""
    from torchtitan_autoparallel.graph.layer_graph import meta_model
    from torchtitan_autoparallel.job.inputs import model_layer_graph
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job
    from torchtitan_autoparallel.titan.v0_3.model import model_spec, sized_for

    job = read_job(["--module", family, "--config", config, "--parallelism.auto",
                    "--autoparallel.hardware", "h100_sxm"])
    seq = job.training.seq_len
    flavor = job.model.flavor
    graph = model_layer_graph(family, flavor, seq)
    model_config = sized_for(model_spec(family, flavor).model, seq)
    model = meta_model(model_config.build)
    assert graph.total_params == model_config.get_nparams_and_flops(model, seq)[0]
    [encoder] = [layer for layer in graph.layers if layer.kind == "encoder"]
    assert encoder.params == sum(p.numel() for p in model.vision_encoder.parameters())
    if family == "qwen3_5":
        delta = next(layer for layer in graph.blocks if "in_proj_q" in
                     ",".join(layer.linear_names))
        styles = dict(zip(delta.linear_names, delta.linear_styles, strict=True))
        assert styles["attn.in_proj_q"] == "colwise" and styles["attn.out_proj"] == "rowwise"
    plan = plan_job(job, 64)
    assert plan.predicted["peak_memory_gib"] <= plan.predicted["budget_gib"]
    assert plan.mesh.tp == tp and plan.mesh.cp == 1 and plan.mesh.pp == 1
    assert plan.mesh.ep == job.parallelism.expert_parallel_degree
    assert [layer.kind for layer in plan.layers][:2] == ["embedding", "encoder"]
    assert any(note.startswith("encoder vision_encoder: costed") for note in plan.notes)


def test_kimi_k2_5_on_64_gpus_is_one_line_naming_the_memory_it_needs():
    """Kimi K2.5 (about a trillion parameters) does not fit 64 H100s: one line with the
    smallest budget that would."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", "plan", "--module",
                          "kimi_k2_7", "--config", "kimi_k2_5", "--ngpu", "64", "--hardware",
                          "h100_sxm"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no plan fits the memory budget" in errors[0]
    assert "Traceback" not in run.stderr
