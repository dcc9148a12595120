"""This planner beside TorchTitan 0.3.0's own AutoParallel path (graph_trainer,
``compile.enable_autoparallel``: meta-pytorch/autoparallel's ILP over per-op placements) on the
jobs that path supports: Llama 3 8B / 70B on a 2-D mesh (fsdp x tp) it is given.

    python experiments/autoparallel_side_by_side.py [--peer-python VENV/bin/python]
        [--jobs 8B@64 ...] [--peer-timeout 2700] [--rerun] [--out FILE.md]

Per job: AutoParallel's time to trace and build its ILP and to solve it, the ILP's size, and the
placements it picks (each parameter as stored, and as the matmul that reads it takes it), from
``autoparallel_peer.py`` run by ``--peer-python`` (a venv with TorchTitan 0.3.0 and
autoparallel; SDPA traced as the GPU op, ``AUTOPARALLEL_PEER_SDPA=cudnn``; results kept under
``experiments/results/autoparallel_peer/cudnn_attention/``, reused unless
``--rerun``). Those placements are turned into this planner's plan in the sub-block vocabulary
(``MAPPINGS``: a mesh, every block's tp mode, no AC, resharded after forward, and whether the
mapping is exact) and costed by this project's model (``h100_sxm``), as AutoParallel's path runs
them and with the AC / resharding this planner's MILP picks for them; beside them this
planner's own plans, with ``tp_sub_block`` among the techniques, on the same mesh and on the
mesh it searches, their solve times, and TorchTitan's FSDP + TP recipe without AC on that mesh.
Writes ``experiments/results/autoparallel_side_by_side.json`` (one object per job) and the .md
made from it (``--md-only``: only the .md, from the JSON). Both planners run on this 2-core box
in one process each, one after the other: their times compare as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CPU_PEER_DIR = REPO / "experiments" / "results" / "autoparallel_peer"
"""AutoParallel traced with the CPU's SDPA op (``_scaled_dot_product_flash_attention_for_cpu``),
which has no DTensor sharding rule: AutoParallel replicates attention whole on every rank
there. Kept for the record; not what it places on a GPU."""
PEER_DIR = CPU_PEER_DIR / "cudnn_attention"
"""AutoParallel traced with the SDPA op a GPU run calls (``AUTOPARALLEL_PEER_SDPA=cudnn``:
heads / batch / replicate, as the flash and efficient kernels' rules): the placements compared."""

JOBS = {
    # name: (our config, peer flavor, world, tp, local batch, seq)
    "8B@8": ("llama3_8b_auto.toml", "8B", 8, 2, 1, 8192),
    "8B@64": ("llama3_8b_auto.toml", "8B", 64, 8, 1, 8192),
    "8B@256": ("llama3_8b_auto.toml", "8B", 256, 8, 1, 8192),
    "70B@64": ("llama3_70b_auto.toml", "70B", 64, 8, 8, 8192),
    "70B@256": ("llama3_70b_auto.toml", "70B", 256, 8, 8, 8192),
}


def peer_result(name: str, python: str, timeout: int, rerun: bool, commit: str
                ) -> dict[str, Any]:
    """AutoParallel's solve of job ``name`` (cached JSON), or ``{"error": why}``."""
    path = PEER_DIR / f"{name.replace('@', '_')}.json"
    if path.exists() and not rerun:
        return json.loads(path.read_text())
    if not python:
        return {"error": "not run (no --peer-python given and no cached result)"}
    _, flavor, world, tp, local, seq = JOBS[name]
    start = time.perf_counter()
    try:
        proc = subprocess.run([python, str(REPO / "experiments" / "autoparallel_peer.py"),
                               flavor, str(world), str(tp), str(local), str(seq)],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "AUTOPARALLEL_PEER_SDPA": "cudnn"})
    except subprocess.TimeoutExpired:
        result = {"error": f"did not finish within {timeout} s on this 2-core box "
                           "(trace, ILP build and CBC solve together)"}
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or [""])[-1]}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["autoparallel_commit"] = commit
    PEER_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


SUB_BLOCK = "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac,pp,tp_sub_block"
"""The default techniques and ``tp_sub_block`` (the sub-block tp modes, and the embedding
looked up on its embedding dim)."""

MAPPINGS: dict[str, dict[str, Any]] = {
    # AutoParallel's placements (GPU attention op) in the sub-block vocabulary: our mesh
    # (dp_shard, tp), the tp mode of every block, and whether the placements map onto it
    # without approximation
    "8B@8": {"dp_shard": 4, "tp": 2, "tp_mode": "sp/tp@dp_shard", "embedding": "dim",
             "expressible": True, "note": (
        "every block maps onto sp/tp@dp_shard exactly: attention TorchTitan's TP + SP over tp "
        "(2 ranks: the fused QKV column-wise, SDPA on the heads, wo row-wise with a "
        "reduce-scatter onto the sequence), the feed-forward tensor parallel over the fsdp dim "
        "(4 ranks: its input all-gathered over fsdp on the batch, w1 / w3 column-wise and w2 "
        "row-wise over fsdp, reduce-scattered back onto the batch) on each tp rank's sequence "
        "shard, its weights stored sharded over fsdp x tp and gathered over tp for the matmuls; "
        "the embedding looked up on its embedding dim over fsdp x tp (tp mode 'dim')")},
    "8B@64": {"dp_shard": 8, "tp": 8, "tp_mode": "sp/sp:a2a", "embedding": "dim",
              "expressible": True, "note": (
        "every block maps onto sp/sp:a2a exactly: the stream sequence-sharded over tp (batch "
        "over fsdp), the fused QKV column-wise over tp on the gathered input and SDPA on the "
        "heads, wo's input through an all-to-all over tp (heads to sequence) and wo's weight, "
        "stored row-wise over tp and sharded over fsdp as TorchTitan's, gathered whole over "
        "fsdp (FSDP) and then over tp for its matmul on the sequence shard, no reduce-scatter "
        "out of it; the feed-forward TorchTitan's TP + SP. The embedding maps onto tp mode "
        "'dim' exactly: tok_embeddings stored sharded on its embedding dim over fsdp x tp, "
        "looked up there for the whole global batch (every rank's token ids), its output "
        "moved onto the stream's shards (batch over fsdp, sequence over tp) by an all-to-all")},
    "8B@256": {"dp_shard": 32, "tp": 8, "tp_mode": "sp/sp:a2a", "embedding": "dim",
               "expressible": True, "note": (
        "as 8B@64: every block sp/sp:a2a exactly, the embedding looked up on its embedding "
        "dim over fsdp x tp (tp mode 'dim') exactly")},
    "70B@64": {"dp_shard": 8, "tp": 8, "tp_mode": "dp/sp:batch", "embedding": "dim",
               "expressible": True, "note": (
        "every block maps onto dp/sp:batch exactly: the stream between blocks sharded on the "
        "batch over both dims (8 sequences per fsdp rank, one per tp rank), attention data "
        "parallel on it (fused QKV and wo read whole, SDPA on the batch, no collective), the "
        "feed-forward TP over tp (w1 / w3 column-wise, w2 row-wise) with ffn_norm's output "
        "all-gathered over tp on the batch and w2's partial sums reduce-scattered back onto "
        "it, every weight stored sharded over fsdp x tp between uses; resharded after forward, "
        "no AC (AutoParallel's path). The embedding maps onto tp mode 'dim' exactly: "
        "tok_embeddings stored sharded on its embedding dim over fsdp x tp, looked up there "
        "for the whole global batch, its output moved onto the stream's batch shards (over "
        "fsdp, then tp) by an all-to-all")},
    "70B@256": {"dp_shard": 32, "tp": 8, "tp_mode": "dp/sp:batch", "embedding": "dim:gather",
                "expressible": True, "note": (
        "as 70B@64 in every block (dp/sp:batch: every matmul weight, the stream and each "
        "collective). The embedding maps onto tp mode 'dim:gather' exactly: tok_embeddings "
        "stored sharded on its embedding dim over fsdp and on the vocabulary over tp, gathered "
        "over tp for the lookup (the tp dim as FSDP for the table), looked up on its embedding "
        "dim over fsdp for the tokens all-gathered over fsdp (each tp rank its batch shard) and "
        "moved onto the stream by an all-to-all over fsdp")},
}


def job_config(config: str, world: int, global_batch: int, mesh: dict[str, int] | None,
               techniques: str = "") -> Any:
    """The TorchTitan config of a job (``mesh``: dp_shard / tp fixed, the other degrees 1)."""
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    fixed = [] if mesh is None else [
        f"--parallelism.data_parallel_shard_degree={mesh['dp_shard']}",
        f"--parallelism.tensor_parallel_degree={mesh['tp']}",
        "--parallelism.data_parallel_replicate_degree=1",
        "--parallelism.context_parallel_degree=1", "--parallelism.pipeline_parallel_degree=1"]
    return parse_config(["--job.config_file", str(REPO / "train_configs" / config),
                         "--autoparallel.hardware=h100_sxm",
                         f"--training.global_batch_size={global_batch}", *fixed,
                         *([techniques] if techniques else [])])


def our_plan(config: str, world: int, global_batch: int, mesh: dict[str, int] | None,
             techniques: str = SUB_BLOCK) -> tuple[Any, float]:
    """This planner's plan of the job (``mesh``: the degrees fixed to AutoParallel's) and its
    planning time (config parsed, layer graph included)."""
    from torchtitan_autoparallel.job.request import plan_job

    start = time.perf_counter()
    plan = plan_job(job_config(config, world, global_batch, mesh, techniques), world)
    return plan, time.perf_counter() - start


def layout_candidate(config: str, world: int, global_batch: int, mapping: dict[str, Any]
                     ) -> tuple[Any, Any]:
    """(planning inputs, candidate) of the job on ``mapping``'s mesh, one micro-batch of the
    local batch, every block offered only ``mapping``'s tp mode (AC none / selective / full,
    resharded after forward or kept). The package costs a sub-block mode only where the local
    batch splits over tp (``tp_dp_problem``); where it does not (the 8B jobs), the same cost
    model is called on the mode directly: a tp-th of the tokens per rank."""
    import dataclasses

    from torchtitan_autoparallel.candidates.candidate import block_classes
    from torchtitan_autoparallel.candidates.layout import AC_MODES, BlockStrategy, Mesh
    from torchtitan_autoparallel.cost.model import block_cost
    from torchtitan_autoparallel.job.inputs import job_inputs
    from torchtitan_autoparallel.plan.assembly import candidate_for

    mesh_degrees = {"dp_shard": mapping["dp_shard"], "tp": mapping["tp"]}
    inputs = job_inputs(job_config(config, world, global_batch, mesh_degrees, SUB_BLOCK),
                        world)
    mesh = Mesh(dp_replicate=1, dp_shard=mapping["dp_shard"], cp=1, tp=mapping["tp"])
    local = global_batch // mesh.dp
    cand = candidate_for(inputs, mesh, local, embedding=mapping.get("embedding", ""))
    graph = inputs.graph
    representative = dict(zip(reversed(block_classes(graph, inputs.pins)),
                              reversed(graph.blocks), strict=True))
    strategies = {cls: [BlockStrategy(ac, reshard, mapping["tp_mode"])
                        for ac in AC_MODES for reshard in (True, False)]
                  for cls in representative}
    costs = dict(cand.costs)
    for cls, layer in representative.items():
        for strategy in strategies[cls]:
            if (cls, strategy) not in costs:
                costs[(cls, strategy)] = block_cost(layer, mesh, strategy, local,
                                                    inputs.cost_context, graph.grouped_experts)
    return inputs, dataclasses.replace(cand, strategies=strategies, costs=costs)


def autoparallel_plans(config: str, world: int, global_batch: int, mapping: dict[str, Any]
                       ) -> tuple[Any, Any]:
    """(AutoParallel's placements as this planner's plan: every block ``mapping``'s tp mode,
    resharded after forward, no AC, as its path runs them; the same placements with the AC
    and resharding this planner's MILP picks for them within the memory budget, or None)."""
    from torchtitan_autoparallel.candidates.candidate import block_classes
    from torchtitan_autoparallel.candidates.layout import BlockStrategy
    from torchtitan_autoparallel.plan.assembly import build_plan, plan_of_solution
    from torchtitan_autoparallel.solve.milp import solve

    inputs, cand = layout_candidate(config, world, global_batch, mapping)
    blocks = len(block_classes(inputs.graph, inputs.pins))
    as_run = build_plan(inputs, cand, [BlockStrategy("none", True, mapping["tp_mode"])] * blocks,
                        {"status": "AutoParallel's placements", "gap": 0.0})
    best = solve(cand, inputs.budget_bytes, 60.0)
    with_ac = None if best is None else plan_of_solution(inputs, best, {})
    return as_run, with_ac


def reading(placement: str) -> str:
    """A weight's ``(fsdp, tp)`` placement as its matmul reads it, in TorchTitan's terms
    (Shard(0) of an out x in weight: column-wise, Shard(1): row-wise)."""
    parts = placement[1:-1].split(", ")
    ways = [f"{'column' if p == 'S(0)' else 'row'}-wise over {dim}"
            for dim, p in zip(("fsdp", "tp"), parts, strict=True) if p in ("S(0)", "S(1)")]
    return " and ".join(ways) or "whole (gathered: data parallel)"


def placement_rows(peer: dict[str, Any]) -> list[str]:
    """One markdown row per parameter: as stored, and as the matmul that reads it takes it."""
    rows = ["| parameter | stored (fsdp, tp) | read by its matmul | in TorchTitan's terms |",
            "|---|---|---|---|"]
    for name, stored in peer["stored"].items():
        used = peer["in_matmul"].get(name, [])
        rows.append(f"| `{name}` | {', '.join(stored)} | {', '.join(used) or '-'} | "
                    f"{'; '.join(reading(u) for u in used) or '-'} |")
    return rows


def recipe_plan_for(config: str, world: int, global_batch: int, tp: int) -> Any:
    """TorchTitan's FSDP + TP recipe on AutoParallel's mesh, without AC (AutoParallel's path
    applies none), costed by this project's model."""
    from torchtitan_autoparallel.job.request import recipe_plan
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    job = parse_config(["--job.config_file", str(REPO / "train_configs" / config),
                        "--autoparallel.hardware=h100_sxm",
                        f"--training.global_batch_size={global_batch}",
                        f"--parallelism.data_parallel_shard_degree={world // tp}",
                        f"--parallelism.tensor_parallel_degree={tp}",
                        "--activation_checkpoint.mode=none"])
    job.parallelism.auto = False
    return recipe_plan(job, world)


def blocks_label(plan: Any) -> str:
    labels = sorted({layer.describe(plan.mesh.unsharded_label) for layer in plan.layers
                     if layer.kind == "block"})
    embedding = [f"embedding {plan.embedding_mode}"] if plan.embedding_mode else []
    return ", ".join([*labels, *embedding])


def plan_fields(prefix: str, plan: Any, world: int) -> dict[str, Any]:
    """``prefix``_tps (predicted tokens/s per GPU), _peak_gib, _fits, _mesh and _blocks."""
    p = plan.predicted
    return {f"{prefix}_tps": round(p["tokens_per_s"] / world, 1),
            f"{prefix}_peak_gib": round(p["peak_memory_gib"], 2),
            f"{prefix}_fits": p["peak_memory_gib"] <= p["budget_gib"],
            f"{prefix}_mesh": str(plan.mesh), f"{prefix}_blocks": blocks_label(plan)}


def job_row(name: str, peer: dict[str, Any]) -> dict[str, Any]:
    """One job of the JSON: AutoParallel's placements as this planner's plan, costed (as its
    path runs them, and with this planner's AC / resharding for them), beside this planner's
    own plans (``tp_sub_block`` among the techniques) on the same mesh and with the mesh
    searched, and TorchTitan's FSDP + TP recipe without AC on that mesh."""
    config, _, world, tp, local, seq = JOBS[name]
    global_batch = local * (world // tp)
    mapping = MAPPINGS[name]
    row: dict[str, Any] = {
        "job": name, "world": world, "global_batch": global_batch, "seq": seq,
        "autoparallel_mesh": f"fsdp {world // tp} x tp {tp}",
        "autoparallel_expressible": mapping["expressible"],
        "autoparallel_mapping": {
            "mesh": f"dp_shard {mapping['dp_shard']} x tp {mapping['tp']}",
            "tp_mode": mapping["tp_mode"], "embedding": mapping.get("embedding") or "default",
            "ac": "none", "reshard_after_forward": True,
            "note": mapping["note"]}}
    if "error" not in peer:
        row.update(autoparallel_trace_and_build_s=peer["trace_and_build_s"],
                   autoparallel_solve_s=peer["solve_s"],
                   autoparallel_ilp=f"{peer['variables']:,} / {peer['constraints']:,}")
    as_run, with_ac = autoparallel_plans(config, world, global_batch, mapping)
    row.update(plan_fields("autoparallel", as_run, world))
    row["autoparallel_mesh"] = f"fsdp {world // tp} x tp {tp}"  # its own, not the mapping's
    if mapping["expressible"]:
        from torchtitan_autoparallel.plan.recost import recost

        recosted = recost(as_run).predicted
        row.update(autoparallel_recosted_tps=round(recosted["tokens_per_s"] / world, 1),
                   autoparallel_recosted_peak_gib=round(recosted["peak_memory_gib"], 2))
    row["budget_gib"] = round(as_run.predicted["budget_gib"], 2)
    if with_ac is not None:
        row.update(plan_fields("autoparallel_layout_with_ac", with_ac, world))
    fixed, fixed_s = our_plan(config, world, global_batch, {"dp_shard": world // tp, "tp": tp})
    free, free_s = our_plan(config, world, global_batch, None)
    row.update(plan_fields("ours_same_mesh", fixed, world), ours_same_mesh_plan_s=round(
        fixed_s, 2))
    row.update(plan_fields("ours", free, world), ours_plan_s=round(free_s, 2))
    row.update(plan_fields("recipe_no_ac", recipe_plan_for(config, world, global_batch, tp),
                           world))
    row["ours_below_autoparallel"] = why_below(row)
    return row


def why_below(row: dict[str, Any]) -> str | None:
    """Why this planner's searched plan is predicted slower than AutoParallel's placements
    (None where it is not)."""
    if row["ours_tps"] >= row["autoparallel_tps"]:
        return None
    if not row["autoparallel_fits"]:
        with_ac = row.get("autoparallel_layout_with_ac_tps")
        fitted = (f"; the same placements with the AC and resharding this planner's MILP "
                  f"picks for them within the budget: {with_ac:.0f} tok/s/GPU"
                  if with_ac is not None else "; no AC makes them fit")
        return (f"AutoParallel's placements without AC need {row['autoparallel_peak_gib']:.0f} "
                f"GiB per GPU, over the {row['budget_gib']:.1f} GiB budget: no plan the search "
                f"may return{fitted}")
    return "search missed it: AutoParallel's placements fit the budget and are predicted faster"


def md_row(row: dict[str, Any]) -> str:
    """One line of the summary table."""
    def tps(prefix: str) -> str:
        if f"{prefix}_tps" not in row:
            return "-"
        fits = "" if row[f"{prefix}_fits"] else " (OOM)"
        return f"{row[f'{prefix}_tps']:.0f} / {row[f'{prefix}_peak_gib']:.1f}{fits}"
    return (f"| {row['job']} | {row['autoparallel_mesh']} | "
            f"{'yes' if row['autoparallel_expressible'] else 'no'} | {tps('autoparallel')} | "
            f"{tps('autoparallel_layout_with_ac')} | {tps('ours_same_mesh')} | {tps('ours')} | "
            f"{row['ours_mesh']} | {row['ours_tps'] / row['autoparallel_tps']:.3f} | "
            f"{row['ours_tps'] / row['autoparallel_layout_with_ac_tps']:.3f} |")


def time_row(row: dict[str, Any]) -> str:
    """One line of the planning-time table."""
    build, solve_s = (row.get(k) for k in ("autoparallel_trace_and_build_s",
                                           "autoparallel_solve_s"))
    return (f"| {row['job']} | {row['autoparallel_mesh']} | "
            f"{'-' if build is None else f'{build:.0f}'} | "
            f"{'-' if solve_s is None else f'{solve_s:.0f}'} | {row.get('autoparallel_ilp', '-')} "
            f"| {row['ours_same_mesh_plan_s']:.2f} | {row['ours_plan_s']:.2f} |")


def embedding_lines(peer: dict[str, Any]) -> list[str]:
    """How AutoParallel's solution looks the token embedding up (``autoparallel_peer.py``'s
    "edges"): the table and the token ids as the lookup reads them, its output, and the
    placement the first block takes it in; nothing for a run that did not record them."""
    edges = peer.get("activations", {}).get("edges", {})
    lookup = edges.get("tok_embeddings embedding#0")
    moved = edges.get("tok_embeddings alias#0")
    if not lookup:
        return []
    table, tokens = lookup["in"]
    line = (f"- Embedding lookup (fsdp, tp): the table read as {table} (stored "
            f"{lookup['from'][0]}), the token ids as {tokens} (arriving {lookup['from'][1]}), "
            f"its output {lookup['out'][0]}")
    if moved:
        line += f", redistributed to {moved['in'][0]} for the blocks"
    return [line + " (Shard on dim 1 of the table: its embedding dim).", ""]


def job_details(row: dict[str, Any], peer: dict[str, Any]) -> list[str]:
    """A job's section: AutoParallel's placements, how they map, every plan costed."""
    out = ["", f"## {row['job']} (global batch {row['global_batch']}, seq {row['seq']})", ""]
    if "error" in peer:
        out.append(f"- AutoParallel: {peer['error']}")
    else:
        out += ["AutoParallel's placements:", "", *placement_rows(peer), "",
                *embedding_lines(peer)]
    m = row["autoparallel_mapping"]
    exact = "exact" if row["autoparallel_expressible"] else "not exact"
    out.append(f"- In the sub-block vocabulary ({exact}): {m['mesh']}, every block tp mode "
               f"`{m['tp_mode']}`, the embedding `{m['embedding']}`, AC {m['ac']}, resharded "
               f"after forward. {m['note']}.")
    if "autoparallel_recosted_tps" in row:
        out.append(f"- Written as a plan file and re-costed by the package (`plan.recost`, "
                   f"which checks every block's strategy is one the planner has for it): "
                   f"{row['autoparallel_recosted_tps']:.0f} tok/s/GPU, peak "
                   f"{row['autoparallel_recosted_peak_gib']:.1f} GiB.")
    for label, prefix in (("AutoParallel's placements, as its path runs them", "autoparallel"),
                          ("the same placements, AC and resharding by this planner's MILP",
                           "autoparallel_layout_with_ac"),
                          ("ours, same mesh", "ours_same_mesh"),
                          ("ours, mesh searched", "ours"),
                          ("TorchTitan's FSDP + TP recipe on that mesh without AC",
                           "recipe_no_ac")):
        if f"{prefix}_tps" in row:
            out.append(f"- {label}: {row[f'{prefix}_mesh']}, blocks {row[f'{prefix}_blocks']}; "
                       f"predicted {row[f'{prefix}_tps']:.0f} tok/s/GPU, peak "
                       f"{row[f'{prefix}_peak_gib']:.1f} of {row['budget_gib']:.1f} GiB")
    if row["ours_below_autoparallel"]:
        out.append(f"- Ours below AutoParallel's placements: {row['ours_below_autoparallel']}.")
    return out


def report(rows: list[dict[str, Any]], peers: dict[str, dict[str, Any]]) -> str:
    """The markdown made from the JSON's rows (and the peer's recorded placements)."""
    lines = [
        "# This planner beside TorchTitan 0.3.0's AutoParallel (graph_trainer)",
        "",
        "`python experiments/autoparallel_side_by_side.py` (see its docstring); every number "
        "below is in",
        "[autoparallel_side_by_side.json](autoparallel_side_by_side.json). AutoParallel:",
        "meta-pytorch/autoparallel (the commit in each `autoparallel_peer/cudnn_attention/*.json`)",
        "on TorchTitan 0.3.0's graph_trainer Llama 3 (SDPA traced as the cuDNN attention op a GPU",
        "run calls), fake process group, CPU, torch 2.14.1;",
        "this planner: TorchTitan 0.2.2's Llama 3 of the same sizes, torch 2.13.0, profile",
        "`h100_sxm`, techniques the default ones and `tp_sub_block`. Same global batch and",
        "sequence on both sides.",
        "",
        "## Placements costed by one model (predicted tokens/s per GPU / peak GiB)",
        "",
        "AutoParallel's placements turned into this planner's plan (sub-block tp modes) and "
        "costed by its cost model; beside them this planner's plans. Budget 71.2 GiB per GPU; "
        "(OOM): over it.",
        "",
        "| job | AutoParallel's mesh | exact | AutoParallel's placements (no AC) | "
        "same placements, AC by the MILP | ours, same mesh | ours, mesh searched | ours' mesh "
        "| ours / AutoParallel's | ours / same placements with AC |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|",
        *(md_row(r) for r in rows),
        "",
        "## Planning time (s, this 2-core box)",
        "",
        "| job | mesh | AutoParallel trace + ILP build | AutoParallel solve | "
        "ILP variables / constraints | ours, same mesh | ours, mesh searched |",
        "|---|---|---:|---:|---:|---:|---:|",
        *(time_row(r) for r in rows),
    ]
    for row in rows:
        lines += job_details(row, peers[row["job"]])
    return "\n".join(lines) + "\n" + READING + trained_section()


READING = """
## Reading

- Which attention op AutoParallel sees: traced on CPU, SDPA is
  `_scaled_dot_product_flash_attention_for_cpu`, which has no DTensor sharding rule, and
  AutoParallel replicates it: q / k / v gathered over both dims and every rank computing the
  whole global batch's attention (exact, 8-256 x redundant). An earlier version of this
  comparison read those CPU-traced placements (fused QKV and wo whole, the feed-forward TP) as
  "data-parallel attention beside a TP feed-forward" on every job; on the 8B jobs that layout
  was the CPU op's artifact. The rows above trace the op a GPU run calls (cuDNN attention; the
  flash and efficient kernels have the same rules: heads, batch or replicate), so they are what
  AutoParallel places on H100s; the CPU-traced results stay in `autoparallel_peer/*.json` and
  solve to objectives 1.01-5.0 x those of `autoparallel_peer/cudnn_attention/*.json`.
- Solve time: AutoParallel takes 4-8 minutes per job on this box (tracing the joint graph and
  building an ILP of ~0.6 M variables, then CBC; these runs shared the 2 cores with other
  work), about the same at 8 and 256 GPUs (the ILP grows with the model's graph and the mesh's
  dimensions, not with the world size); this planner takes 0.2-2 s per job, mesh search and
  `tp_sub_block` included, on TorchTitan 0.2.2's model of the same size.
- Placements with the GPU op: on 8B@64 / 8B@256 AutoParallel's plan is TorchTitan's TP + SP
  except wo, which takes the attention output through an all-to-all (heads to sequence) and
  runs with its weight gathered over tp on the sequence shard: tp mode `sp/sp:a2a`. On 70B (one
  sequence per rank) attention is data parallel over all ranks and the feed-forward TP over tp
  with the stream between blocks sharded on the batch over tp: tp mode `dp/sp:batch`. At 8B@8
  attention is TP + SP over tp (2) while the feed-forward is TP over the fsdp dim (4), a
  second mesh dim inside one block. Outside the blocks,
  every job looks the token embedding up sharded on its embedding dim for tokens gathered from
  the other ranks and moves the result onto the stream with an all-to-all, where TorchTitan's
  embedding is vocabulary-parallel over tp. Over fsdp x tp (8B@8, 8B@64, 8B@256, 70B@64) that
  is `tp_sub_block`'s embedding mode `dim`; 70B@256 shards the table's columns over fsdp alone
  and gathers it over tp (the tp dim as FSDP for the table, the lookup split on the batch over
  tp): mode `dim:gather`. At 8B@8 the feed-forward is TP over the fsdp dim with the tp dim
  splitting the sequence and gathering its weights: tp mode `sp/tp@dp_shard`. So all five jobs
  are exact, embedding and blocks.
- Costed by one model: where AutoParallel's placements fit the budget this planner's plans
  are as fast or faster on the same mesh and on the mesh it searches. On the 8B jobs its
  placements are 2.3-4.0 % faster than TorchTitan's TP + SP on its mesh (wo's all-to-all and
  the gather of its weight over tp move less than the reduce-scatter of its output, and the
  embedding's all-to-alls less than FSDP's gather of the table and reduce-scatter of its
  gradient), and this planner, given the modes, picks both on that mesh too (with its own AC,
  resharding and FSDP units); the mesh it searches (cp 2, where `dim` is not legal) is faster
  still. On the 70B
  jobs AutoParallel's placements as its path runs them (no AC) need 256-265 GiB per GPU
  against a 71 GiB budget; with the AC and resharding this planner's MILP picks for them they
  fit and fall below this planner's plans.
- Memory: AutoParallel's ILP bounds parameter memory only (``add_parameter_memory_constraint``
  at its defaults) and its path applies no activation checkpointing.
"""

TRAINED = REPO / "experiments" / "results" / "autoparallel_trained.md"
"""Both planners' plans trained side by side on CPU ranks (``autoparallel_trained.py``)."""


def trained_section() -> str:
    """``autoparallel_trained.md`` as a section of this report (its heading one level down)."""
    if not TRAINED.exists():
        return ("\n## Trained side by side\n\nNot run: "
                "`python experiments/autoparallel_trained.py`.\n")
    text = TRAINED.read_text().replace("# This planner and TorchTitan 0.3.0's AutoParallel, "
                                       "trained side by side", "## Trained side by side", 1)
    return "\n" + text


JSON_OUT = REPO / "experiments" / "results" / "autoparallel_side_by_side.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-python", default="", help="python of a venv with TorchTitan "
                        "0.3.0 and autoparallel")
    parser.add_argument("--jobs", nargs="*", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--peer-timeout", type=int, default=2700)
    parser.add_argument("--rerun", action="store_true", help="solve again on the peer")
    parser.add_argument("--peer-commit", default="", help="the autoparallel commit the peer "
                        "venv has (recorded with its results)")
    parser.add_argument("--md-only", action="store_true", help="only remake the .md from the "
                        "JSON")
    parser.add_argument("--out", default=str(REPO / "experiments" / "results"
                                             / "autoparallel_side_by_side.md"))
    args = parser.parse_args()
    peers = {name: peer_result(name, args.peer_python, args.peer_timeout, args.rerun,
                               args.peer_commit) for name in args.jobs}
    if not args.md_only:
        rows = [job_row(name, peers[name]) for name in args.jobs]
        JSON_OUT.write_text(json.dumps(rows, indent=1) + "\n")
    rows = [r for r in json.loads(JSON_OUT.read_text()) if r["job"] in peers]
    text = report(rows, peers)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
