"""The cost model against TorchTitan's published H100 results (an independent reference:
numbers measured elsewhere), through the rows, recipes and predictions that
experiments/published.py reports (tests/support/published.py), and what the job's GPU features
change in the search."""

import statistics

import pytest

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.job.inputs import job_inputs
from torchtitan_autoparallel.job.request import plan_job
from torchtitan_autoparallel.titan.v0_2.job import parse_config
from torchtitan_autoparallel.titan.v0_2.registry import register

from tests.support import published
from tests.support.parity import REPO


@pytest.fixture(scope="module")
def rows():
    register()
    rows = published.published_rows()
    published.predict(rows, "h100_grand_teton")
    return rows


def test_out_of_sample_throughput_within_targets(rows):
    """No profile constant comes from these rows: every one is out of sample. The kernel-level
    model reaches TorchTitan's 1-D FSDP rows (8B, 8 and 128 GPUs) within 10 % and the median
    row within 10 %; the long-context CP 4-8 rows and async TP are known misses
    (experiments/results/published.md)."""
    assert not any(r.fit for r in rows) and len(rows) >= 12
    errors = {r.label(): r.tps / float(r.fields["tps_per_gpu"]) - 1 for r in rows}
    assert statistics.median(abs(e) for e in errors.values()) <= 0.10
    one_d = [e for r, e in zip(rows, errors.values(), strict=True)
             if r.fields["table"] in ("1", "3")]
    assert len(one_d) == 6 and max(abs(e) for e in one_d) <= 0.10, errors


def test_feature_gains_have_the_published_sign(rows):
    """compile and float8 (tensorwise) were never fitted: their predicted gains have
    TorchTitan's sign and are within 8 points of it at 8 and 128 GPUs (compile within 2,
    float8 7-8 low: the model's bf16 GEMMs are faster than TorchTitan's runs saw)."""
    for gpus in ("8", "128"):
        same = {(r.fields["compile"], r.fields["float8"]): r for r in rows
                if r.fields["gpus"] == gpus and r.fields["seq_len"] == "8192"}
        for base, new in ((("no", "no"), ("yes", "no")), (("yes", "no"), ("yes", "yes"))):
            b, n = same[base], same[new]
            gain = float(n.fields["tps_per_gpu"]) / float(b.fields["tps_per_gpu"]) - 1
            predicted = n.tps / b.tps - 1
            assert predicted > 0 and abs(predicted - gain) <= 0.08, (gpus, new)


def test_float8_rowwise_under_tp_loses_as_published():
    """Llama 3 8B on 4 H100s, FSDP 2 x TP 2, compile (pytorch/torchtitan issue 1207): rowwise
    float8 measured 3.5 % slower than bf16; the model (TP styles, measured rowwise linears)
    predicts a loss too."""
    register()
    label, fields, feature, gain, _ = next(f for f in published.FURTHER if "TP 2" in f[0])
    with_it = published.Row(dict(fields))
    without = published.Row(dict(fields, **{feature: "no"}))
    published.predict([with_it, without], "h100_grand_teton")
    assert gain < 0 and with_it.tps < without.tps, label


def _job(*extra: str):
    register()
    return parse_config(["--job.config_file", str(REPO / "train_configs/llama3_8b_auto.toml"),
                         "--parallelism.auto", "--autoparallel.hardware=h100_grand_teton",
                         "--training.global_batch_size=16", *extra])


FLOAT8 = ("--model.converters=quantize.linear.float8",
          "--quantize.linear.float8.enable_fsdp_float8_all_gather",
          "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp")


def test_auto_beats_the_published_recipe_prediction_with_the_same_features(rows):
    for extra, feats in (((), ("no", "no")), (("--compile.enable",), ("yes", "no")),
                         (("--compile.enable", *FLOAT8), ("yes", "yes"))):
        recipe = next(r for r in rows if r.fields["table"] == "1"
                      and (r.fields["compile"], r.fields["float8"]) == feats)
        plan = plan_job(_job(*extra), 8)
        assert plan.predicted["tokens_per_s"] / 8 >= recipe.tps


@pytest.mark.parametrize("policy", ["always", "never"])
def test_fsdp_reshard_after_forward_fixes_every_block(policy):
    plan = plan_job(_job(f"--parallelism.fsdp_reshard_after_forward={policy}"), 64)
    assert {lp.reshard_after_forward for lp in plan.layers if lp.kind == "block"} == {
        policy == "always"}
    assert plan.fingerprint["constraints"]["reshard_after_forward"] == policy


def test_features_enter_the_fingerprint_only_when_set():
    assert "features" not in job_inputs(_job(), 8).fingerprint
    fp = job_inputs(_job("--compile.enable", *FLOAT8), 8).fingerprint
    assert fp["features"]["compile"] and fp["features"]["linear"] == "float8_tensorwise"
    assert fp["features"]["float8_all_gather"] and fp["features"]["precompute_scale"]
    # TorchTitan's default components compile the loss too, with Inductor only
    assert fp["features"]["compile_loss"]
    for other in ("--compile.components=model", "--compile.backend=aot_eager"):
        assert "compile_loss" not in job_inputs(_job("--compile.enable", other),
                                                8).fingerprint["features"]


def _further_rows(profile: str) -> list[tuple]:
    """``published.FURTHER_ROWS`` of ``profile``, each predicted: (label, row, tok/s, GiB)."""
    out = []
    for label, fields, name, tps, gib, _ in published.FURTHER_ROWS:
        if name == profile:
            row = published.Row(dict(fields))
            published.predict([row], name)
            out.append((label, row, tps, gib))
    return out


def test_h200_runs_published_elsewhere_within_targets():
    """TorchTitan's published H200 runs (June 2025, 8B FSDP 32 / 64, compile with the loss,
    float8; not in that table, no profile constant fitted on them) with the stock h200_sxm
    profile: tok/s/GPU and memory within 10 %. The memory needs the compiled loss costed: with
    the fp32 logits of an eager loss it is predicted about 20 % high."""
    rows = _further_rows("h200_sxm")
    assert len(rows) == 2
    for label, row, tps, gib in rows:
        assert abs(row.tps / tps - 1) <= 0.10, (label, row.tps, tps)
        assert abs(row.memory / gib - 1) <= 0.10, (label, row.memory, gib)


def test_a100_runs_published_elsewhere_within_targets():
    """TorchTitan's first published runs (64 A100 80GB, FSDP 64, eager, April 2024; not in
    that table) with the stock a100_sxm profile, whose constants come from A100 kernel data
    (FlashAttention-2's A100 benchmark, the matmul benchmark's A100 / H100 ratio, nccl-tests):
    tok/s/GPU within 10 %. With the attention fields read as A100 throughputs (costed at a third
    of them through clock_scale) the model was 12-24 % slow on these rows."""
    rows = _further_rows("a100_sxm")
    assert len(rows) == 3
    for label, row, tps, _ in rows:
        assert abs(row.tps / tps - 1) <= 0.10, (label, row.tps, tps)


def test_async_tp_without_compile_is_refused():
    with pytest.raises(UserError, match="needs compile"):
        job_inputs(_job("--parallelism.enable_async_tensor_parallel"), 8)


def _published_md_errors() -> tuple[list[float], list[float]]:
    """|error| of tokens/s and of memory of Tables 1-4 as committed in published.md."""
    text = (REPO / "experiments" / "results" / "published.md").read_text()
    tps, mem = [], []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        # rows of Tables 1-4 ("T1 ..." to "T4 ..."); the pipeline rows (T5, T6) follow
        if len(cells) > 7 and cells[1][:2] in ("T1", "T2", "T3", "T4") \
                and cells[4].endswith("%"):
            tps.append(abs(float(cells[4].rstrip("%")) / 100))
            mem.append(abs(float(cells[7].rstrip("%")) / 100))
    return tps, mem


def test_plan_notes_give_the_measured_error_of_their_gpu():
    """A plan for h100_sxm said "never measured" though published.md measures H100 runs: its
    notes now give that error (measured with the Grand Teton profile of the same GPU) and the
    memory margin against the measured memory error; B200 has no published row."""
    from torchtitan_autoparallel.commands.explain import model_error, model_lines

    tps, mem = _published_md_errors()
    assert len(tps) == 12
    err = model_error("h100_sxm")
    assert err["measured_with"] == "h100_grand_teton"
    assert err["median_error"] == pytest.approx(statistics.median(tps), abs=1e-3)
    assert err["max_error"] == pytest.approx(max(tps), abs=1e-3)
    assert err["memory_max_error"] == pytest.approx(max(mem), abs=1e-3)
    register()
    for hardware, wanted in (("h100_sxm", "same GPU"), ("b200", "no published row")):
        job = parse_config(["--job.config_file", "train_configs/llama3_8b_auto.toml",
                            f"--autoparallel.hardware={hardware}"])
        lines = model_lines(plan_job(job, 64))
        assert any(wanted in line for line in lines), lines
        assert any(line.startswith("memory margin") for line in lines) == (hardware == "h100_sxm")
