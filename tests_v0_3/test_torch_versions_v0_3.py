"""The llama3_8b plan on 64 H100s pinned across torch releases: a fresh ``pip install
torchtitan`` (0.3.0, no torch bound) brings torch 2.15.0, the ``titan03`` extra tested 2.14.1.

Reference: the plan made under torch 2.14.1, stored beside this file (its mesh, every layer's
strategy, predicted step time, and the hash of what the planner read from the model on meta).
Torch 2.15 gave the CPU flash-attention op a FLOP formula (non-causal) that 2.14 lacks; counted
by the torch counter, it moved this plan's step time by 13 %. Regenerate the file (after a change
that means to move this plan) with ``python tests_v0_3/test_torch_versions_v0_3.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

PINNED = Path(__file__).resolve().parent / "llama3_8b_64_h100_sxm.pinned.json"
STRATEGY_KEYS = ("kind", "fsdp_unit", "reshard_after_forward", "tp_mode", "ep", "ac")
"""A layer's decisions in the plan (its costs are left to the step time)."""


def plan_summary() -> dict[str, Any]:
    """``plan --module llama3 --config llama3_8b --ngpu 64 --hardware h100_sxm`` under the
    installed torch, as the fields the pin compares."""
    import torch

    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_3 import read_job

    job = read_job(["--module", "llama3", "--config", "llama3_8b", "--parallelism.auto",
                    "--autoparallel.hardware", "h100_sxm"])
    plan = plan_job(job, 64).to_dict()
    return {
        "torch": torch.__version__,
        "model_hash": plan["fingerprint"]["model_hash"],
        "mesh": plan["mesh"],
        "strategies": [" ".join([layer["fqn"], *(f"{k}={layer.get(k)}" for k in STRATEGY_KEYS)])
                       for layer in plan["layers"]],
        "step_time_s": plan["predicted"]["step_time_s"],
    }


def test_llama3_8b_plan_on_64_h100s_equals_the_torch_2_14_plan():
    import torch

    pinned = json.loads(PINNED.read_text())
    now = plan_summary()
    where = f"torch {torch.__version__} against the plan of torch {pinned['torch']}"
    assert now["mesh"] == pinned["mesh"], where
    assert now["strategies"] == pinned["strategies"], where
    assert now["step_time_s"] == pytest.approx(pinned["step_time_s"], rel=0.02), where
    # what the planner reads on meta (FLOPs, saved bytes, traffic per layer) is torch's to
    # count only where torch runs the work: it must not move with the release
    assert now["model_hash"] == pinned["model_hash"], where


if __name__ == "__main__":
    summary = plan_summary()
    PINNED.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {PINNED} (torch {summary['torch']})", file=sys.stderr)
