"""Does a MoE block's data-parallel attention pay? The MoE rows of the at-scale grid, searched
with ``tp_sub_block`` with MoE blocks offered ``sp/dp`` alone (the MoE data parallel over tp)
and ``sp/dp`` and ``dp/sp`` (also the attention data parallel over tp on a batch shard beside
the MoE's TP + SP / EP: what both releases apply to deepseek_v3, qwen3 and llama4), both
predicted by the same cost model on the rows' profiles; and the best plan with every MoE block
forced to ``sp``, ``sp/dp`` and ``dp/sp`` (same mesh, batch, AC and resharding), its predicted
tokens/s and peak memory against the budget.

    python experiments/moe_attention_dp.py [--rows deepseek_v3_671b@128,...]

Prints one table (markdown) and writes it to experiments/results/moe_attention_dp.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

import at_scale  # noqa: E402

from torchtitan_autoparallel.candidates.layout import (  # noqa: E402
    MOE_ATTENTION_DP,
    MOE_SHARED_DP,
    MOE_SUB_BLOCK_MODES,
)
from torchtitan_autoparallel.errors import UserError  # noqa: E402
from torchtitan_autoparallel.job.request import read_request  # noqa: E402
from torchtitan_autoparallel.plan.recost import inputs_from_plan, recost  # noqa: E402
from torchtitan_autoparallel.solve.planner import solve_request  # noqa: E402

ROWS = ("deepseek_v3_16b@8", "deepseek_v3_16b@16", "deepseek_v3_16b@32", "deepseek_v3_16b@64",
        "deepseek_v3_16b@128", "deepseek_v3_671b@128", "llama4_17bx16e@32", "llama4_17bx16e@64",
        "llama4_17bx16e@128")
"""The MoE rows of ``at_scale.py`` that a plan fits."""


def _plan(model: str, world: int, moe_modes: tuple[str, ...]):
    """The best ``tp_sub_block`` plan of the row with ``moe_modes`` offered to MoE blocks."""
    at_scale.memoize_layer_graphs()
    auto_cfg = at_scale.MODELS[model][0]
    global_batch = at_scale.parse_config_file(auto_cfg, ()).training.local_batch_size * world
    config = at_scale.parse_config_file(auto_cfg, (
        f"--training.global_batch_size={global_batch}", "--parallelism.auto",
        f"--autoparallel.hardware={at_scale.MODEL_HW.get(model, at_scale.HW)}",
        at_scale.SUB_BLOCK))
    request = read_request(config, world)
    inputs = request.inputs
    inputs = dataclasses.replace(inputs, constraints=dataclasses.replace(
        inputs.constraints, moe_sub_block_modes=moe_modes))
    return solve_request(dataclasses.replace(request, inputs=inputs))


def _forced(plan, mode: str) -> str:
    """``plan`` with every MoE block (a block with routed experts) set to ``mode``: predicted
    tokens/s and peak / budget GiB, or why it cannot be costed."""
    if plan.mesh.tp == 1 or plan.pipeline is not None:
        return "n/a (tp 1)" if plan.mesh.tp == 1 else "n/a (a pipeline plan)"
    moe = {block.fqn for block in inputs_from_plan(plan).graph.blocks if block.expert_params}
    forced = copy.deepcopy(plan)
    for layer in forced.layers:
        if layer.fqn in moe:
            layer.tp_mode = mode
    try:
        p = recost(forced).predicted
    except UserError as exc:
        return f"n/a ({str(exc).split(': ', 1)[-1][:50]})"
    return f"{p['tokens_per_s']:.4g} ({p['peak_memory_gib']:.1f}/{p['budget_gib']:.1f} GiB)"


def row(model: str, world: int) -> str:
    """One markdown row: searched tokens/s under each vocabulary, the modes the search with
    both MoE modes picks, and the forced plans."""
    try:
        old = _plan(model, world, (MOE_SHARED_DP,))
        new = _plan(model, world, MOE_SUB_BLOCK_MODES)
    except UserError as exc:
        return f"| {model} | {world} | {str(exc)[:60]} | | | | | | |"
    modes: dict[str, int] = {}
    for layer in new.layers:
        if layer.kind == "block":
            modes[layer.tp_mode] = modes.get(layer.tp_mode, 0) + 1
    tps_old, tps_new = old.predicted["tokens_per_s"], new.predicted["tokens_per_s"]
    forced = [_forced(new, mode) for mode in ("sp", MOE_SHARED_DP, MOE_ATTENTION_DP)]
    return (f"| {model} | {world} | {tps_old:.6g} | {tps_new:.6g} | {tps_new / tps_old:.4f} | "
            f"{at_scale.mesh_label(new.mesh)} lb{new.local_batch_size}x"
            f"{new.gradient_accumulation_steps}: "
            f"{' '.join(f'{m} x{n}' for m, n in sorted(modes.items()))} | "
            + " | ".join(forced) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    lines = ["| model | GPUs | tok/s, MoE `sp/dp` alone | tok/s, with `dp/sp` | ratio | "
             "its plan: mesh, block modes | its MoE blocks all `sp` | all `sp/dp` | "
             "all `dp/sp` |", "|---|---|---|---|---|---|---|---|---|"]
    for spec in args.rows.split(","):
        model, world = spec.split("@")
        lines.append(row(model, int(world)))
        print(lines[-1], flush=True)
    out = REPO / "experiments" / "results" / "moe_attention_dp.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
