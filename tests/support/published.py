"""TorchTitan's published H100 results (Tables 1-4 of
benchmarks/llama3_h100_202412_torchtitan.md in pytorch/torchtitan, as
experiments/data/torchtitan_h100_202412.csv) and further published runs, each turned into
TorchTitan's own recipe for the job and predicted by ``job.request.recipe_plan``: what
experiments/published.py reports and tests/test_published.py checks.

``published_rows`` reads the table's rows, ``overrides`` makes the model's recipe config run a
row's job (same model, GPUs, degrees, local / global batch, AC, compile, float8 with FSDP
float8 all-gather and the precomputed scale, async TP), ``predict`` sets each row's predicted
tokens/s per GPU and peak memory. ``FURTHER`` holds published feature gains, ``FURTHER_ROWS``
runs on other GPUs, neither in that table.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ANCHORS = REPO / "experiments" / "data" / "torchtitan_h100_202412.csv"
CONFIGS = {"llama3_8b": "llama3_8b_fsdp.toml", "llama3_70b": "llama3_70b_fsdp_tp.toml"}
"""The recipe config of each model the rows name."""
FIT_ROWS: dict[tuple[str, ...], str] = {}
"""Rows a profile constant was fitted on: none (constants come from kernel data)."""
FURTHER = [
    # further published TorchTitan runs (not in that table): (label, fields of the job, the
    # feature turned off for the baseline, the feature's published gain, where it was published)
    ("8B 8 H100 FSDP 8, compile: float8 tensorwise", dict(
        model="llama3_8b", gpus="8", fsdp="8", tp="1", cp="1", seq_len="8192", local_batch="2",
        global_batch="16", ac="selective", compile="yes", float8="yes", async_tp="no"),
     "float8", 0.2503, "torchao/float8/README.md, training benchmarks (pytorch/ao PR 1793)"),
    ("8B 8 H100 FSDP 8, compile: float8 rowwise", dict(
        model="llama3_8b", gpus="8", fsdp="8", tp="1", cp="1", seq_len="8192", local_batch="2",
        global_batch="16", ac="selective", compile="yes", float8="rowwise", async_tp="no"),
     "float8", 0.1005, "torchao/float8/README.md, training benchmarks (pytorch/ao PR 1793)"),
    ("8B 4 H100 FSDP 2 x TP 2, compile: float8 rowwise", dict(
        model="llama3_8b", gpus="4", fsdp="2", tp="2", cp="1", seq_len="8192", local_batch="1",
        global_batch="2", ac="selective", compile="yes", float8="rowwise", async_tp="no"),
     "float8", 5189 / 5378 - 1, "pytorch/torchtitan issue 1207 (bf16 5378, rowwise 5189 tok/s)"),
] + [
    (f"{size.upper()} {gpus} H100 FSDP {fsdp} x TP 8, compile, {name}: async TP", dict(
        model=f"llama3_{size}", gpus=gpus, fsdp=fsdp, tp="8", cp="1", seq_len="8192",
        local_batch=local, global_batch=str(int(local) * int(fsdp)), ac=ac, compile="yes",
        float8=float8, async_tp="yes", loss="compiled"),
     "async_tp", gain, "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md in "
     "pytorch/torchtitan (June 2025)")
    for size, gpus, fsdp, local, ac in (("70b", "256", "32", "16", "full"),
                                        ("8b", "64", "8", "12", "selective"))
    for name, float8, gain in (
        ("bf16", "no", {"70b": 652.4 / 597.3, "8b": 4809.4 / 4378}[size] - 1),
        ("float8 tensorwise", "tensorwise",
         {"70b": 942.4 / 809.8, "8b": 5570.1 / 5078.1}[size] - 1),
        ("float8 rowwise", "rowwise", {"70b": 624.8 / 599.6, "8b": 3914.9 / 3708.5}[size] - 1))
]

FURTHER_ROWS = [
    # further published TorchTitan runs on other GPUs (not in that table): (label, fields of the
    # job, profile, published tok/s/GPU, published GiB, where it was published)
    (f"8B {gpus} H200 FSDP {gpus}, compile + float8", dict(
        model="llama3_8b", gpus=str(gpus), fsdp=str(gpus), tp="1", cp="1", seq_len="8192",
        local_batch="2", global_batch=str(2 * gpus), ac="selective", compile="yes",
        float8="yes", async_tp="no", loss="compiled"), "h200_sxm", tps, gib,
     "benchmarks/llama3_8b_h200_2025-06_torchtitan.md in pytorch/torchtitan (June 2025)")
    for gpus, tps, gib in ((32, 10938, 47.96), (64, 10753, 46.97))
] + [
    # TorchTitan's first published runs (April 2024): Llama 3 on 64 A100 80GB, FSDP 64, local
    # batch 1, seq 8192, eager, bf16 parameters with fp32 gradient reduction; memory not
    # published. Selective "layer" AC is TorchTitan's selective_ac_option = 2 (every other
    # block checkpointed).
    (f"{size.upper()} 64 A100 FSDP 64, eager, {ac_label} AC", dict(
        model=f"llama3_{size}", gpus="64", fsdp="64", tp="1", cp="1", seq_len="8192",
        local_batch="1", global_batch="64", ac=ac, ac_option=option, compile="no",
        float8="no", async_tp="no"), "a100_sxm", tps, None,
     "docs/performance.md in pytorch/torchtitan (1ea476e9f, April 2024)")
    for size, ac_label, ac, option, tps in (("8b", "selective layer", "selective", "2", 2904),
                                            ("8b", "selective op", "selective", "op", 2973),
                                            ("70b", "full", "full", "", 331))
]



@dataclasses.dataclass
class Row:
    fields: dict[str, str]
    tps: float = 0.0
    memory: float = 0.0

    @property
    def key(self) -> tuple[str, ...]:
        f = self.fields
        return (f["table"], f["seq_len"], f["compile"], f["float8"], f["async_tp"])

    @property
    def fit(self) -> str:
        return FIT_ROWS.get(self.key, "")

    def label(self) -> str:
        f = self.fields
        feats = [n for n in ("compile", "float8", "async_tp") if f[n] == "yes"]
        mesh = f"fsdp {f['fsdp']}" + (f" tp {f['tp']}" if f["tp"] != "1" else "") + (
            f" cp {f['cp']}" if f["cp"] != "1" else "")
        return (f"T{f['table']} {f['model']} {f['gpus']} GPUs {mesh} seq {f['seq_len']} "
                f"{'+'.join(feats) or 'eager'}")


def published_rows() -> list[Row]:
    lines = [line for line in ANCHORS.read_text().splitlines() if not line.startswith("#")]
    return [Row(r) for r in csv.DictReader(lines) if r["pp"] == "1"]


def overrides(f: dict[str, str], hardware: str) -> list[str]:
    """TorchTitan CLI overrides that make the model's recipe config run the published job."""
    local, fsdp = int(f["local_batch"]), int(f["fsdp"])
    out = [
        "--job.config_file", str(REPO / "train_configs" / CONFIGS[f["model"]]),
        f"--training.seq_len={f['seq_len']}",
        f"--training.local_batch_size={local}",
        f"--training.global_batch_size={f['global_batch'] or local * fsdp}",
        "--training.mixed_precision_param=bfloat16",
        "--training.mixed_precision_reduce=float32",
        "--parallelism.data_parallel_replicate_degree=1",
        f"--parallelism.data_parallel_shard_degree={fsdp}",
        f"--parallelism.tensor_parallel_degree={f['tp']}",
        f"--parallelism.context_parallel_degree={f['cp']}",
        f"--activation_checkpoint.mode={f['ac']}",
        *([f"--activation_checkpoint.selective_ac_option={f['ac_option']}"]
          if f.get("ac_option") else []),
        f"--autoparallel.hardware={hardware}",
    ]
    if f["compile"] == "yes":
        out.append("--compile.enable")
        if f.get("loss") != "compiled":
            # the blocks only: the trainer of December 2024 did not compile the loss
            # ("compiling loss function causes CUDA errors, turning off for now"); from spring
            # 2025 it did (components/loss.py: torch.compile(loss_fn) with training.compile),
            # as TorchTitan 0.2.2's default components ("model", "loss") do
            out.append("--compile.components=model")
    if f["float8"] == "yes":
        out += ["--model.converters=quantize.linear.float8",
                "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
    elif f["float8"] == "tensorwise":
        # the June 2025 async TP benchmark's commands: --model.converters="float8" alone (FSDP
        # all-gathers the weights in bf16, no precomputed scale)
        out += ["--model.converters=quantize.linear.float8"]
    elif f["float8"] == "rowwise":
        out += ["--model.converters=quantize.linear.float8",
                "--quantize.linear.float8.recipe_name=rowwise"]
    if f["async_tp"] == "yes":
        out.append("--parallelism.enable_async_tensor_parallel")
    return out


def predict(rows: list[Row], hardware: str) -> None:
    from torchtitan_autoparallel.job.request import recipe_plan
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    for row in rows:
        plan = recipe_plan(parse_config(overrides(row.fields, hardware)),
                           int(row.fields["gpus"]))
        row.tps = plan.predicted["tokens_per_s"] / int(row.fields["gpus"])
        row.memory = plan.predicted["peak_memory_gib"]
