"""A plan of an MoE model says in its notes which MoE terms it assumes and how far its step time
moves with each off by 20 %; the moves are checked against the plan re-costed with the term's
own constants changed (a profile or kernel table edited by 20 %), not against the hook that
scales the term."""

import dataclasses
import json
import re

import pytest

from torchtitan_autoparallel.commands.cli import main
from torchtitan_autoparallel.commands.moe_notes import OFF_BY, term_swings
from torchtitan_autoparallel.cost import moe
from torchtitan_autoparallel.cost.model import clear_compute_memo
from torchtitan_autoparallel.errors import run_cli
from torchtitan_autoparallel.plan.recost import inputs_from_plan, recost

from tests.support.parity import REPO


@pytest.fixture(scope="module")
def ep_plan():
    """TorchTitan's DeepSeek-V3 16B recipe on 8 H100s (FSDP 8, EP 8, selective AC)."""
    from torchtitan_autoparallel.job.request import recipe_plan
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    job = parse_config(["--job.config_file",
                        str(REPO / "train_configs" / "deepseek_v3_16b_fsdp_ep.toml"),
                        "--autoparallel.hardware=h100_sxm"])
    plan = recipe_plan(job, 8)
    assert plan.mesh.ep == 8
    return plan


def _moved(plan, hw=None) -> float:
    """The plan's predicted step time re-costed (memoized costs dropped first and after)."""
    clear_compute_memo()
    step = recost(plan, hw).predicted["step_time_s"]
    clear_compute_memo()
    return step / plan.predicted["step_time_s"] - 1


def _edited_table(monkeypatch, hw, **factors):
    """The MoE kernel table beside ``hw``'s GEMM table with constants multiplied."""
    table = dict(moe.moe_table(hw.gemm_table))
    for name, factor in factors.items():
        table[name] *= factor
    monkeypatch.setattr(moe, "moe_table", lambda _name: table)


def test_term_moves_match_the_plan_recosted_with_its_constants_changed(ep_plan, monkeypatch):
    swings = term_swings(ep_plan, {})
    hw = inputs_from_plan(ep_plan).hw
    up = 1 + OFF_BY
    # grouped GEMMs 20 % slower: the grouped kernel's efficiency / 1.2
    with monkeypatch.context() as m:
        _edited_table(m, hw, grouped_efficiency_bf16=1 / up)
        assert swings["grouped GEMMs"][1] == pytest.approx(_moved(ep_plan), rel=1e-6)
    # the permutation's passes move 20 % more bytes (each pass's, the measured index backward's
    # too): the same seconds as a 20 % slower permutation
    with monkeypatch.context() as m:
        _edited_table(m, hw, index_backward_bytes=up)
        for name in ("PERMUTE_FWD_BYTES", "UNPERMUTE_BYTES", "SLICE_BACKWARD_BYTES",
                     "COUNTED_GATHER_BYTES"):
            m.setattr(moe, name, getattr(moe, name) * up)
        assert swings["permutation"][1] == pytest.approx(_moved(ep_plan), rel=1e-6)
    # 20 % more router kernels
    with monkeypatch.context() as m:
        m.setattr(moe, "ROUTER_KERNELS", tuple(n * up for n in moe.ROUTER_KERNELS))
        assert swings["router kernels"][1] == pytest.approx(_moved(ep_plan), rel=1e-6)
    # a 20 % longer device -> host round trip
    with monkeypatch.context() as m:
        _edited_table(m, hw, host_sync_us=up)
        assert swings["host sync"][1] == pytest.approx(_moved(ep_plan), rel=1e-6)
    # the job's moe_load_imbalance 1.2 -> 1.16 / 1.24 (its excess over 1 off by 20 %)
    for (low, high), factor in ((swings["load imbalance"], 1 - OFF_BY),
                                (swings["load imbalance"], up)):
        edited = dataclasses.replace(hw, moe_load_imbalance=1 + (hw.moe_load_imbalance - 1)
                                     * factor)
        assert (low if factor < 1 else high) == pytest.approx(_moved(ep_plan, edited),
                                                              rel=1e-6)
    # each term costs something on this plan, slower when it is off upwards
    assert all(low < 0 < high for low, high in swings.values())


def test_moe_plan_notes_name_each_assumed_term(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = run_cli(lambda: main([
        "plan", "--config", str(REPO / "train_configs" / "deepseek_v3_debug_auto.toml"),
        "--ngpu", "4", "--autoparallel.hardware=h100_sxm",
        "--parallelism.expert_parallel_degree=2", "--out", str(out)]))
    capsys.readouterr()
    assert code == 0
    notes = [n for n in json.loads(out.read_text())["notes"] if n.startswith("model: MoE ")]
    by_term = {n.split(":")[1].removeprefix(" MoE "): n for n in notes}
    assert set(by_term) == set(moe.TERMS)
    table = moe.moe_table("gemm_sm_90")
    assert f"grouped_efficiency_bf16 = {table['grouped_efficiency_bf16']:g}" in \
        by_term["grouped GEMMs"]
    assert f"host_sync_us = {table['host_sync_us']:g}" in by_term["host sync"]
    assert "moe_load_imbalance = 1.2, the profile's (assumed" in by_term["load imbalance"]
    assert "moe_sm_90.csv" in by_term["permutation"]
    for note in notes:
        low, high = re.search(r"-> step time ([-+]\d+\.\d)% / ([-+]\d+\.\d)%$", note).groups()
        assert float(low) <= 0 <= float(high)
    # the dense notes no longer weigh moe_load_imbalance (the MoE line does)
    dense = [n for n in json.loads(out.read_text())["notes"] if "assumed constants" in n]
    assert dense and "moe_load_imbalance" not in dense[0]


def test_dense_plans_have_no_moe_notes():
    from torchtitan_autoparallel.commands.explain import model_lines
    from torchtitan_autoparallel.job.request import recipe_plan
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    job = parse_config(["--job.config_file", str(REPO / "train_configs" / "llama3_debug_fsdp.toml"),
                        "--autoparallel.hardware=h100_sxm"])
    lines = model_lines(recipe_plan(job, 2))
    assert lines and not [line for line in lines if line.startswith("MoE")]
