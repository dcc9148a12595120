"""What a plan of an MoE model assumes about its routed experts: one note line per MoE term of
``cost.moe`` (grouped GEMMs, permutation, router kernels, the dispatcher's host sync, the load
imbalance) naming the constants it rests on with their source, and how much the predicted step
time moves when that term is off by -20 % / +20 % (the plan re-costed with the term scaled)."""

from __future__ import annotations

from typing import Any

from ..cost import moe
from ..cost.hardware import HardwareProfile, load_profile
from ..cost.model import clear_compute_memo
from ..errors import UserError
from ..plan.schema import Plan

OFF_BY = 0.2
"""How far each MoE term is moved for its note: -20 % and +20 %."""


def term_swings(plan: Plan, cache: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per MoE term: the relative change of the plan's predicted step time with the term at
    (1 - OFF_BY) and (1 + OFF_BY) x its value (the load imbalance: its excess over 1)."""
    from ..plan.recost import recost

    base = plan.predicted["step_time_s"]
    swings = {}
    for term in moe.TERMS:
        moved = []
        for factor in (1.0 - OFF_BY, 1.0 + OFF_BY):
            clear_compute_memo()  # memoized costs hold the unscaled terms
            with moe.scaled_term(term, factor):
                moved.append(recost(plan, cache=cache).predicted["step_time_s"] / base - 1)
            clear_compute_memo()
        swings[term] = (moved[0], moved[1])
    return swings


def _cited(source: str) -> str:
    """A profile or table source shortened to its kind and reference ("measured: pytorch/ao
    PR 2490")."""
    if not source:
        return "no source given"
    kind, _, rest = source.partition(":")
    ref = rest.strip().split(" (")[0].split(", ")[0].split("; ")[0]
    return f"{kind}: {ref}" if ref else kind


def _imbalance_note(hw: HardwareProfile, ep: int) -> str:
    """Where the plan's moe_load_imbalance comes from (the profile's assumption or the job)."""
    try:
        profile = load_profile(hw.name).moe_load_imbalance
    except UserError:  # a profile given as a file the plan no longer finds
        profile = None
    if hw.moe_load_imbalance == 1.0 and profile != 1.0:
        how = "set by the job (debug.moe_force_load_balance or autoparallel.moe_load_imbalance)"
    elif profile is not None and hw.moe_load_imbalance != profile:
        how = "set by the job (autoparallel.moe_load_imbalance)"
    else:
        how = (f"the profile's ({_cited(hw.source('moe_load_imbalance'))}; "
               "autoparallel.moe_load_imbalance sets the job's)")
    where = ("charged on the busiest EP rank's grouped GEMMs, permutation and all-to-alls"
             if ep > 1 else "no effect without EP")
    return f"moe_load_imbalance = {hw.moe_load_imbalance:g}, {how}; {where}"


def _assumptions(plan: Plan, hw: HardwareProfile, recipe: str) -> dict[str, str]:
    """Per MoE term, the constants it rests on and their sources."""
    table = moe.moe_table(hw.gemm_table)
    sources = moe.moe_sources(hw.gemm_table)
    name = f"profiles/kernels/moe_{hw.gemm_table.removeprefix('gemm_')}.csv"
    launch = f"kernel_launch_us = {hw.kernel_launch_us:g} ({_cited(hw.source('kernel_launch_us'))})"
    if not table:
        return {"load imbalance": _imbalance_note(hw, plan.mesh.ep)}
    low = {"float8": "float8", "mx": "mx"}.get(recipe, "bf16")
    key = f"grouped_efficiency_{low}"
    grouped = (f"{low} grouped GEMMs at {key} = {table[key]:g} of the dense GEMM table "
               f"({name}, {_cited(sources.get(key, ''))})" if hw.grouped_mm else
               f"one GEMM per local expert at the dense GEMM table's rate (grouped_mm = false), "
               f"each at least a launch: {launch}")
    sync = ("none: grouped GEMMs without EP pad their groups on the device"
            if plan.mesh.ep <= 1 and hw.grouped_mm else
            f"host_sync_us = {table['host_sync_us']:g} per forward ({name}, "
            f"{_cited(sources.get('host_sync_us', ''))})")
    return {
        "grouped GEMMs": grouped,
        "permutation": (f"gather_efficiency = {table['gather_efficiency']:g}, "
                        f"index_backward_bytes = {table['index_backward_bytes']:g} B per element "
                        f"at hbm_gbps = {hw.hbm_gbps:g} ({name}, "
                        f"{_cited(sources.get('gather_efficiency', ''))})"),
        "router kernels": (f"{moe.ROUTER_KERNELS[0]} forward + {moe.ROUTER_KERNELS[1]} backward "
                           f"kernels (counted from TorchTitan 0.2.2) at {launch}"),
        "host sync": sync,
        "load imbalance": _imbalance_note(hw, plan.mesh.ep),
    }


def moe_lines(plan: Plan, inputs: Any, cache: dict[str, Any]) -> list[str]:
    """The MoE notes of a plan (none for a dense model): per term, its assumed constants and
    the step time's change with the term off by -20 % / +20 %."""
    if not inputs.graph.num_experts:
        return []
    hw = inputs.hw
    swings = term_swings(plan, cache)
    lines = [] if moe.moe_table(hw.gemm_table) else [
        f"MoE routed experts: at the profile's flat rate (matmul_efficiency = "
        f"{hw.matmul_efficiency:g}): {hw.name!r} has no MoE kernel table, so their kernels are "
        "not weighed term by term"]
    for term, what in _assumptions(plan, hw, inputs.features.grouped_mm).items():
        low, high = (0.0 if abs(v) < 5e-4 else v for v in swings[term])  # no "-0.0%"
        off = "its excess over 1 " if term == "load imbalance" else ""
        lines.append(f"MoE {term}: {what}; {off}off by -20 % / +20 % -> step time {low:+.1%} / "
                     f"{high:+.1%}")
    return lines
