"""MoE auto plans (deepseek_v3: dense first layer then MoE; llama4: interleaved dense / MoE)
train exactly like a 1-rank run (fp32, 5 steps, rel <= 1e-4): with expert parallel, with the
planner choosing freely, and with a user pin."""

import math
import re

import pytest

from tests.support.parity import assert_parity, run_job

PLAN_RE = re.compile(r"autoparallel plan \w+: mesh (.*) \(world")

CASES = {
    # ep borrows the 2 data-parallel ranks; routing and dispatch stay TorchTitan's
    "deepseek_v3-ep2": ("deepseek_v3", 2, ["--parallelism.expert_parallel_degree=2"]),
    # 4 ranks, etp = 1: ep takes the tp ranks too (TorchTitan's ReordererSequenceParallel;
    # its router and MoE-input gradients corrected by
    # titan.v0_2.patches.moe.reduce_sequence_parallel_moe_grads)
    "deepseek_v3-ep4-tp2": ("deepseek_v3", 4, ["--parallelism.expert_parallel_degree=4",
                                               "--parallelism.tensor_parallel_degree=2"]),
    # tp 2, ep 1: the routed experts tensor parallel over tp; deepseek_v3 scores after the
    # experts, so the router's gradient is corrected by
    # titan.v0_2.patches.moe.reduce_tensor_parallel_router_grads
    # (TorchTitan 0.2.2 alone: router.gate 62-72 % off 1 rank at step 1, grad norm 1.5e-3 off by
    # step 5; corrected: every parameter's gradient within 5.3e-7, grad norms within 3.2e-5)
    "deepseek_v3-tp2": ("deepseek_v3", 2, ["--parallelism.tensor_parallel_degree=2"]),
    # 4 ranks, etp = tp = 2, ep 2 from dp_shard: the same correction (uncorrected: the same
    # router.gate 62-72 % at step 1, grad norm 1.4e-3 off by step 5; corrected: gradients within
    # 5.1e-7, grad norms within 4.8e-5)
    "deepseek_v3-ep2-etp2-tp2": ("deepseek_v3", 4, ["--parallelism.tensor_parallel_degree=2",
                                                    "--parallelism.expert_parallel_degree=2",
                                                    "--parallelism.expert_tensor_parallel_degree=2"]),
    # a user pin: block 0 runs TorchTitan's recipe (full AC from [activation_checkpoint])
    "llama4-pin": ("llama4", 2, ["--autoparallel.pin=layers.0",
                                 "--activation_checkpoint.mode=full"]),
    "llama4-free4": ("llama4", 4, []),
    # tp 2, ep 1: llama4 scores before the experts, whose input gradient TorchTitan reduces over
    # tp itself (no correction; measured: gradients within 4.1e-7, grad norms within 8.7e-5)
    "llama4-tp2": ("llama4", 2, ["--parallelism.tensor_parallel_degree=2"]),
}


KNOWN_GRAD_NORM_DIVERGENCE: dict[str, str] = {}
"""Cases whose losses match 1 rank but whose gradient norms do not: an open finding, kept
visible (xfail, strict: the test fails once they match, so the entry gets removed)."""


SLOW = {"llama4-tp2", "llama4-free4", "deepseek_v3-ep2", "deepseek_v3-ep2-etp2-tp2",
        "llama4-pin"}
"""Measured passing, kept out of the CI command for time (``-m slow`` runs them): in CI,
deepseek_v3-ep4-tp2 trains expert parallelism with the sequence-parallel correction,
deepseek_v3-tp2 the router correction; llama4's MoE plans (its TP path needs no correction) and
a user pin (llama4-pin, 1.5 minutes) are slow."""


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in CASES])
def test_moe_auto_parity(case, references, tmp_path):
    family, ngpu, overrides = CASES[case]
    seed, reference = references(family)
    result = run_job(f"{family}_debug_auto.toml", ngpu, tmp_path, overrides,
                     seed_checkpoint=seed)
    mesh = PLAN_RE.search(result.output)
    assert mesh, result.output[-3000:]
    if expert_parallel := re.search(r"-ep(\d)", case):  # "deepseek" holds "ep" too
        ep = int(expert_parallel.group(1))
        assert f"ep={ep}" in mesh.group(1), mesh.group(1)
        assert f"+ep{ep}" in result.output  # the MoE blocks' strategy names their ep
    if "pin" in case:
        assert re.search(r"layers\.0\s+\S*ac:full\+pinned", result.output), result.output[-3000:]
    if case not in KNOWN_GRAD_NORM_DIVERGENCE:
        assert_parity(reference, result)
        return
    assert_parity(reference, result, grad_rtol=math.inf)  # the losses still match
    try:
        assert_parity(reference, result)
    except AssertionError as exc:
        pytest.xfail(f"{KNOWN_GRAD_NORM_DIVERGENCE[case]} ({exc})")
    pytest.fail(f"{case}: gradient norms now match 1 rank: drop it from "
                "KNOWN_GRAD_NORM_DIVERGENCE")


@pytest.mark.slow  # its own seed and reference run, measured passing; ``-m slow`` runs it
def test_qwen3_moe_auto_parity(tmp_path):
    """qwen3's MoE flavor (64 experts, top-8, no shared expert): an auto plan with ep = 2 on 2
    ranks matches 1 rank."""
    from tests.support.parity import SINGLE_RANK, make_seed_checkpoint

    flavor = ("--model.flavor=debugmodel_moe",)
    seed = make_seed_checkpoint("qwen3_debug_fsdp.toml", tmp_path / "seed", flavor)
    reference = run_job("qwen3_debug_fsdp.toml", 1, tmp_path / "ref", (*SINGLE_RANK, *flavor),
                        seed_checkpoint=seed)
    result = run_job("qwen3_debug_auto.toml", 2, tmp_path / "auto",
                     [*flavor, "--parallelism.expert_parallel_degree=2"], seed_checkpoint=seed)
    assert "+ep2" in result.output, result.output[-3000:]
    assert_parity(reference, result)
