"""``predict`` answers "will my recipe fit" against the device's memory, apart from the planning
budget, with the model's measured memory error on the GPU."""

from __future__ import annotations

import subprocess
import sys

from tests.support.parity import REPO

# TorchTitan's published Table 1 job (experiments/data/torchtitan_h100_202412.csv): Llama 3 8B
# on 8 H100s, FSDP 8, local batch 2 at 8192 tokens, selective AC, eager; it ran at 82.4 GiB of
# the Grand Teton H100's 96 GB.
LLAMA3_8B_AT_8 = ["--config", str(REPO / "train_configs" / "llama3_8b_fsdp.toml"), "--ngpu", "8",
                  "--training.seq_len=8192", "--training.local_batch_size=2",
                  "--training.global_batch_size=16", "--training.mixed_precision_param=bfloat16",
                  "--parallelism.data_parallel_shard_degree=8",
                  "--activation_checkpoint.mode=selective"]


def predict(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", "predict", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("fit: ")]


def test_a_published_run_is_predicted_to_fit_its_device():
    fit = predict(*LLAMA3_8B_AT_8, "--hardware", "h100_grand_teton")
    assert fit[0].startswith("fit: fits"), fit  # it ran
    assert "max |memory error| on 'h100_grand_teton'" in fit[2], fit


def test_over_the_planning_budget_is_not_out_of_memory():
    """A budget set below the recipe's peak changes the budget line only: the device still
    holds it."""
    fit = predict(*LLAMA3_8B_AT_8, "--hardware", "h100_grand_teton",
                  "--autoparallel.memory_gib=40")
    assert fit[0].startswith("fit: fits"), fit
    assert fit[1].startswith("fit: planning budget 40 GiB (autoparallel.memory_gib): over it"), fit
    assert "which may still run" in fit[1]


def test_a_recipe_past_the_device_is_predicted_to_run_out_of_memory():
    """Without AC at local batch 6, the SwiGLU feed-forward alone saves its two 14336-wide
    projections (bf16) per token and block for backward: 32 blocks x 49152 tokens x 57344 bytes
    = 84 GiB, over an H100's 80 GB before weights and optimizer state."""
    saved = 32 * 6 * 8192 * 2 * 14336 * 2 / 2**30
    assert saved > 80
    args = [a for a in LLAMA3_8B_AT_8 if "batch_size" not in a and "activation" not in a]
    fit = predict(*args, "--training.local_batch_size=6", "--training.global_batch_size=48",
                  "--activation_checkpoint.mode=none", "--hardware", "h100_sxm")
    assert fit[0].startswith("fit: does not fit"), fit
    assert "predicted to run out of memory" in fit[0]
