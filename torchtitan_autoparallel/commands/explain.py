"""Reading plans: per-layer explanation with the runner-up, differences between two plans, and
the equivalent TorchTitan ``[parallelism]`` settings where a plan is uniform."""

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..candidates.layout import (
    DP_SHARD_TP,
    GIB,
    TP_WITHOUT_SP,
    BlockStrategy,
    a2a_mode,
    fsdp_unit_problem,
    reshard_group,
    stream_dim,
    sub_block_modes,
)
from ..cost.model import (
    float8_linear_times,
    input_key,
    linear_names,
    linear_styles,
    linear_tokens,
    low_precision_linears,
)
from ..errors import tomllib
from ..plan.assembly import candidate_for, rank_counts
from ..plan.recost import block_counts, inputs_from_plan
from ..plan.schema import LayerPlan, Plan, check_plan_for_job
from .moe_notes import moe_lines


def explain_rows(plan: Plan, cache: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per block: the chosen strategy's cost breakdown, and the runner-up (the fastest other
    strategy for that block on the same mesh, micro-batch and stage) with its time and memory
    deltas, its memory checked on the block's own pp rank. ``cache`` keeps the layer graph for
    later re-costing."""
    inputs = inputs_from_plan(plan, cache)
    check_plan_for_job(plan, plan.fingerprint["world_size"],
                       [(layer.fqn, layer.kind) for layer in inputs.graph.layers], "to explain")
    cand = candidate_for(inputs, plan.mesh, plan.local_batch_size, plan.pipeline,
                         plan.embedding_mode)
    class_of, _ = block_counts(plan, inputs)
    per_rank, rank_of_fqn = rank_counts(plan, class_of)
    budget = plan.predicted["budget_gib"] * GIB
    rows = []
    for layer in plan.layers:
        if layer.kind != "block":
            continue
        sig, chosen = class_of[layer.fqn], BlockStrategy.of(layer)
        cost = cand.costs[(sig, chosen)]
        first, second = cost.explained()
        row = {"layer": layer.fqn, "strategy": layer.describe(plan.mesh.unsharded_label),
               "columns": cost.EXPLAINED, cost.EXPLAINED[0]: first * 1e3,
               cost.EXPLAINED[1]: second * 1e3,
               "kept_mib": cost.kept_bytes / 2**20, "transient_mib": cost.transient_bytes / 2**20,
               "runner_up": None}
        # under pp the stage keeps its parameters across micro-batches: resharding is the
        # plan's setting, not an alternative the search weighs
        offered = [s for s in cand.strategies[sig] if s != chosen and (
            plan.pipeline is None or s.reshard_after_forward == chosen.reshard_after_forward)]
        if offered:
            runner = min(offered, key=lambda s: (cand.costs[(sig, s)].time_s, s))
            alt = cand.costs[(sig, runner)]
            rank = rank_of_fqn.get(layer.fqn, 0)
            swapped = dict(per_rank[rank])
            swapped[(sig, chosen)] -= 1
            swapped[(sig, runner)] = swapped.get((sig, runner), 0) + 1
            row["runner_up"] = {
                "strategy": runner.describe(layer.ep, plan.mesh.unsharded_label),
                "delta_time_ms": (alt.time_s - cost.time_s) * 1e3,
                "delta_kept_mib": (alt.kept_bytes - cost.kept_bytes) / 2**20,
                "fits_budget": cand.rank_memory(cand.type_of_rank(rank), swapped) <= budget,
            }
        rows.append(row)
    return rows


def schedule_lines(plan: Plan) -> list[str]:
    """Why this pipeline schedule: the best plan of every schedule the job allows on the
    plan's mesh and micro-batch size (bubble, step, peak), as the planner compared them."""
    from ..candidates.pipeline import schedules_for
    from ..solve.milp import search

    pipe = plan.pipeline
    if pipe is None:
        return []
    inputs = inputs_from_plan(plan)
    lines = [f"pipeline schedule: {pipe.schedule} chosen; the best plan of each schedule on "
             f"this mesh with micro-batches of {pipe.microbatch_size}:"]
    mine = plan.predicted["step_time_s"]
    for schedule in schedules_for(inputs.graph, inputs.constraints, inputs.features) or [
            pipe.schedule]:
        constraints = dataclasses.replace(inputs.constraints, pp_schedules=(schedule,),
                                          pp_microbatch=pipe.microbatch_size)
        found = search(inputs.graph, plan.global_batch_size, inputs.cost_context,
                       inputs.budget_bytes, constraints, [plan.mesh], 60.0, inputs.pins)
        best = found.best
        if best is None:
            lines.append(f"  {schedule:<22} does not fit the memory budget "
                         f"({inputs.budget_bytes / GIB:.3g} GiB)")
            continue
        cand = best.candidate
        slowest = max(cand.rank_time(t, best.counts[t.name]) for t in cand.types)
        bubble = cand.beta * slowest / best.step_time_s
        lines.append(f"  {schedule:<22} {cand.stages_per_rank} stages/rank, bubble "
                     f"{bubble:6.1%}, step {best.step_time_s:.4g} s "
                     f"({best.step_time_s / mine:.3f}x), peak {best.peak_bytes / GIB:.3g} GiB")
    return lines


VALIDATION = Path(__file__).resolve().parent.parent / "profiles" / "validation" / "model_error.toml"
"""The cost model's measured error per hardware profile: median and max |error| of predicted
tokens/s and max |error| of peak memory against published runs (written by
experiments/published.py, each entry naming its source), and the GPU each profile models."""


def model_error(profile: str) -> dict[str, Any] | None:
    """The cost model's measured error over published runs on ``profile``'s GPU: the
    profile's own entry, else that of a profile of the same GPU (``measured_with`` names it);
    None where no published row of its GPU was predicted."""
    with open(VALIDATION, "rb") as f:
        data = tomllib.load(f)
    gpus = data.pop("gpu_of_profile", {})
    if profile in data:
        return {**data[profile], "measured_with": profile}
    same = [name for name in sorted(data) if gpus.get(name) and gpus.get(name) ==
            gpus.get(profile)]
    return {**data[same[0]], "measured_with": same[0]} if same else None


def error_source(err: dict[str, Any], profile: str) -> str:
    """Where a ``model_error`` entry comes from, naming the profile it was measured with when
    that is another one of the same GPU."""
    other = err["measured_with"]
    return err["source"] + (f", predicted with {other!r} (same GPU)" if other != profile
                            else "")


NO_ROW = "no published row for this GPU"


def margin_note(auto_tps: float, recipe_tps: float, recipe: str, profile: str) -> str:
    """The predicted gain over TorchTitan's recipe beside the model's measured error."""
    gain = auto_tps / recipe_tps - 1
    err = model_error(profile)
    text = (f"predicted {gain:+.1%} tokens/s over TorchTitan's recipe for this job ({recipe}: "
            f"{recipe_tps:.4g} tokens/s)")
    if err is None:
        return text + f"; the cost model's error on {profile!r}: {NO_ROW}"
    verdict = ("within it: the two are a tie as far as the model can tell"
               if abs(gain) <= err["median_error"] else "beyond it")
    return (text + f"; the model's median |error| on {profile!r} is {err['median_error']:.0%} "
            f"({error_source(err, profile)}): {verdict}")


def error_lines(plan: Plan, profile: str) -> list[str]:
    """The model's measured error on the plan's GPU, and the memory margin the plan keeps
    against its measured memory error."""
    err = model_error(profile)
    if err is None:
        return [f"the cost model's measured error on {profile!r}: {NO_ROW}"]
    peak, budget = plan.predicted["peak_memory_gib"], plan.predicted["budget_gib"]
    margin = 1 - peak / budget if budget else 0.0
    mem = err.get("memory_max_error")
    device = ((plan.inputs or {}).get("hardware") or {}).get("memory_gib", 0)
    lines = [f"the cost model's measured error on {profile!r}: median "
             f"{err['median_error']:.0%}, max {err['max_error']:.0%} of tokens/s over "
             f"{err['runs']} runs ({error_source(err, profile)})"]
    if mem is not None:
        enough = peak * (1 + mem) <= budget
        lines.append(
            f"memory margin: predicted peak {peak:.3g} of {budget:.3g} GiB leaves {margin:.0%}; "
            f"the model's max |memory error| there is {mem:.0%}: "
            + ("the plan fits even at that error" if enough else
               f"at that error the peak would be {peak * (1 + mem):.3g} GiB, over the budget"
               + (f" (the device has {device:.3g} GiB)" if device else "")
               + "; a lower autoparallel.memory_gib plans with more room"))
    return lines


def fit_lines(plan: Plan, profile: str) -> list[str]:
    """Will it fit: the predicted peak against the device's memory and, apart from it, against
    the planning budget (what the planner keeps its own plans under), with the model's measured
    memory error on the GPU."""
    peak, budget = plan.predicted["peak_memory_gib"], plan.predicted["budget_gib"]
    hw = (plan.inputs or {}).get("hardware") or {}
    device, usable = hw.get("memory_gib", 0.0), hw.get("usable_memory_fraction", 1.0)
    err = model_error(profile) or {}
    mem = err.get("memory_max_error")
    high = peak * (1 + mem) if mem is not None else peak
    if not device:
        verdict = f"predicted peak {peak:.3g} GiB per device (the profile names no device memory)"
    elif high <= device:
        verdict = f"fits: predicted peak {peak:.3g} GiB of the device's {device:.3g} GiB"
    elif peak <= device:
        verdict = (f"fits at the prediction ({peak:.3g} of the device's {device:.3g} GiB), but "
                   f"not at the model's max memory error ({high:.3g} GiB)")
    else:
        verdict = (f"does not fit: predicted peak {peak:.3g} GiB is over the device's "
                   f"{device:.3g} GiB: predicted to run out of memory")
    why = (f"{usable:.0%} of the device's memory, usable_memory_fraction of {profile!r}"
           if device and abs(budget - device * usable) < 1e-6 else "autoparallel.memory_gib")
    lines = [f"fit: {verdict}",
             f"fit: planning budget {budget:.3g} GiB ({why}): "
             + ("within it" if peak <= budget else
                f"over it by {peak - budget:.3g} GiB: the planner would not choose this "
                "recipe" + (", which may still run" if device and peak <= device else ""))]
    if mem is None:
        lines.append(f"fit: the model's memory error on {profile!r}: no published memory row "
                     "for this GPU")
    else:
        lines.append(f"fit: the model's max |memory error| on {profile!r} is {mem:.0%} "
                     f"({error_source(err, profile)}): the peak lies in "
                     f"{peak * (1 - mem):.3g}-{high:.3g} GiB")
    return lines


def assumed_lines(plan: Plan, inputs: Any, cache: dict[str, Any]) -> list[str]:
    """The assumed constants of the plan's profile that its predicted step time depends on:
    each moved by +-20 % and the plan re-costed; those that move it by 1 % or more."""
    from ..plan.recost import recost

    hw, base = inputs.hw, plan.predicted["step_time_s"]
    swings = []
    for name in hw.assumed():
        if name == "moe_load_imbalance":
            continue  # weighed with the other MoE terms (moe_notes.moe_lines)
        value = getattr(hw, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value:
            continue
        moved = [recost(plan, dataclasses.replace(hw, **{name: type(value)(value * f)}),
                        cache).predicted["step_time_s"] for f in (0.8, 1.2)]
        swing = max(abs(t - base) for t in moved) / base
        if swing >= 0.01:
            swings.append((swing, name))
    lines = [f"the predicted step time depends on assumed constants of {hw.name!r} (+-20 % -> "
             "step time): " + ", ".join(f"{n} {s:.1%}" for s, n in sorted(swings, reverse=True))
             if swings else f"assumed constants of {hw.name!r}: none moves the predicted step "
             "time by 1 % when moved by 20 %"]
    peak, budget = plan.predicted["peak_memory_gib"], plan.predicted["budget_gib"]
    if "usable_memory_fraction" in hw.assumed() and peak > 0.8 * budget:
        lines.append(f"the plan fits only if usable_memory_fraction = "
                     f"{hw.usable_memory_fraction:g} (assumed) holds: peak {peak:.3g} GiB of a "
                     f"{budget:.3g} GiB budget")
    return lines


def float8_lines(plan: Plan, inputs: Any) -> list[str]:
    """Where the plan chose the float8 linears: each linear of each kind of block with its
    predicted forward + backward time per micro-batch in bf16 and in float8 (casts included)."""
    if plan.float8_filter_fqns is None:
        return []
    if not inputs.hw.gemm_table:
        return [f"float8 choice: not weighed per linear (profile {inputs.hw.name!r} has no "
                "GEMM table to time bf16 against float8): the block linears torchao converts "
                "run float8"]
    strategies = {layer.fqn: BlockStrategy.of(layer) for layer in plan.layers}
    lines, seen = [], set()
    microbatch = plan.pipeline.microbatch_size if plan.pipeline else plan.local_batch_size
    for layer in inputs.graph.blocks:
        strategy = strategies[layer.fqn]
        tokens = linear_tokens(layer, plan.mesh, strategy, microbatch)
        low = low_precision_linears(layer, plan.mesh, strategy, microbatch, inputs.hw,
                                    inputs.features)
        if (layer.signature, tokens, low) in seen:
            continue
        seen.add((layer.signature, tokens, low))
        names = linear_names(layer)
        keys = [input_key(name, style, k) for name, style, (k, _) in zip(
            names, linear_styles(layer), layer.linear_shapes, strict=True)]
        for i, (name, (k, n), is_low) in enumerate(zip(names, layer.linear_shapes, low,
                                                       strict=True)):
            # compiled, an input another float8 linear of the module casts is cast once
            shared = inputs.features.compile and keys[i] is not None and any(
                keys[j] == keys[i] and low[j] for j in range(len(keys)) if j != i)
            bf16, float8 = float8_linear_times(k, n, tokens, inputs.hw, inputs.features,
                                               shared)
            lines.append(f"float8 choice in {layer.fqn} and blocks like it: {name} {k}->{n} x "
                         f"{tokens:.0f} tokens: bf16 {bf16 * 1e3:.3g} ms, float8 "
                         f"{float8 * 1e3:.3g} ms (fwd + bwd"
                         f"{', input cast shared' if shared else ''}) -> "
                         f"{'float8' if is_low else 'bf16'}")
    return lines


def unit_lines(plan: Plan, inputs: Any) -> list[str]:
    """FSDP units, per kind of block in the plan: the unit size chosen with its predicted gain
    per block and micro-batch over units of one block, or why the planner declined units
    (not offered on this plan, no faster, or over the memory budget)."""
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    problem = fsdp_unit_problem(plan.mesh, blocks[0].tp_mode)
    if problem or inputs.graph.num_experts:
        return [f"FSDP units: declined: {problem or 'not searched on MoE models'}"]
    cand = candidate_for(inputs, plan.mesh, plan.local_batch_size,
                         embedding=plan.embedding_mode)
    class_of, counts = block_counts(plan, inputs)
    budget = plan.predicted["budget_gib"] * GIB
    grouped = {sig for sig, s in counts if s.fsdp_unit > 1}
    lines, seen = [], set()
    for layer in blocks:
        key = sig, chosen = class_of[layer.fqn], BlockStrategy.of(layer)
        if key in seen:
            continue
        seen.add(key)
        n, single = counts[key], dataclasses.replace(chosen, fsdp_unit=1)
        one, mine = cand.costs[(sig, single)], cand.costs[key]
        what = f"FSDP units: {n} blocks like {layer.fqn} ({layer.describe()})"
        if chosen.fsdp_unit > 1:
            lines.append(
                f"{what}: units of {chosen.fsdp_unit} blocks, predicted "
                f"{(one.time_s - mine.time_s) * 1e3:.3g} ms faster per block and micro-batch "
                f"than units of one (exposed communication {one.exposed_comm_s * 1e3:.3g} -> "
                f"{mine.exposed_comm_s * 1e3:.3g} ms), working set "
                f"{(mine.transient_bytes - one.transient_bytes) / GIB:+.3g} GiB")
            continue
        if sig in grouped:
            lines.append(f"{what}: the rest of the run, in units of one")
            continue
        offered = [s for s in cand.strategies[sig]
                   if s.fsdp_unit > 1 and dataclasses.replace(s, fsdp_unit=1) == chosen]
        if not offered:
            lines.append(f"{what}: declined: blocks of this kind are not a run of 2 or more "
                         "consecutive blocks")
            continue
        best = min(offered, key=lambda s: (cand.costs[(sig, s)].time_s, s.fsdp_unit))
        alt = cand.costs[(sig, best)]
        gain = (one.time_s - alt.time_s) * 1e3
        if gain <= 0:
            lines.append(f"{what}: declined: units of {best.fsdp_unit} predicted no faster "
                         f"({-gain:.3g} ms slower per block and micro-batch)")
            continue
        moved = n - n % best.fsdp_unit
        swapped = {**counts, key: n - moved, (sig, best): counts.get((sig, best), 0) + moved}
        peak = cand.rank_memory(cand.types[0], swapped)
        lines.append(
            f"{what}: declined: units of {best.fsdp_unit} would be {gain:.3g} ms faster per "
            f"block and micro-batch but need a working set "
            f"{(alt.transient_bytes - one.transient_bytes) / GIB:+.3g} GiB: peak "
            f"{peak / GIB:.3g} GiB " + (f"over the {budget / GIB:.3g} GiB budget"
                                         if peak > budget else "within the budget"))
    return lines


def model_lines(plan: Plan, cache: dict[str, Any] | None = None) -> list[str]:
    """How far to trust the plan's numbers: the assumed constants its step time depends on and
    the model's measured error on its hardware."""
    cache = {} if cache is None else cache
    inputs = inputs_from_plan(plan, cache)
    lines = (assumed_lines(plan, inputs, cache) + moe_lines(plan, inputs, cache)
             + float8_lines(plan, inputs) + unit_lines(plan, inputs))
    return lines + error_lines(plan, inputs.hw.name)


COLUMN_HEADS = {"compute_ms": "compute ms", "exposed_comm_ms": "comm ms",
                "microbatch_ms": "per mb ms", "fsdp_step_ms": "fsdp/step ms"}
"""Headings of the two cost columns of ``explain``'s rows (flat plans: compute and exposed
communication per micro-batch; pipeline stages: time per micro-batch and FSDP per step)."""


def explain_text(plan: Plan, rows: list[dict[str, Any]], extra: list[str] = ()) -> str:
    columns = rows[0]["columns"] if rows else ("compute_ms", "exposed_comm_ms")
    heads = [COLUMN_HEADS[c] for c in columns]
    lines = [plan.table(), "", "per block (per micro-batch): chosen vs runner-up",
             f"  {'layers':<20}{'strategy':<26}{heads[0]:>11}{heads[1]:>13}{'kept MiB':>10}"
             f"  runner-up (delta time ms, delta kept MiB)"]
    groups: list[list[dict[str, Any]]] = []
    def key(row: dict[str, Any]) -> tuple:
        ru = row["runner_up"]
        return (row["strategy"], row[columns[0]], row["kept_mib"], ru and ru["strategy"])

    for row in rows:
        if groups and key(groups[-1][0]) == key(row):
            groups[-1].append(row)
        else:
            groups.append([row])
    for group in groups:
        r = group[0]
        last = group[-1]["layer"].split(".")[-1]
        name = r["layer"] if len(group) == 1 else f"{r['layer']}..{last}"
        ru = r["runner_up"]
        alt = (f"{ru['strategy']} ({ru['delta_time_ms']:+.4g}, {ru['delta_kept_mib']:+.4g})"
               + ("" if ru["fits_budget"] else " over budget") if ru else "none (only strategy)")
        lines.append(f"  {name:<20}{r['strategy']:<26}{r[columns[0]]:>11.4g}"
                     f"{r[columns[1]]:>13.4g}{r['kept_mib']:>10.4g}  {alt}")
    if plan.pipeline is not None:
        lines += ["", *schedule_lines(plan)]
    lines += ["", snippet(plan)]
    lines += [f"note: {n}" for n in plan.untabled_notes]
    lines += [f"model: {line}" for line in extra]
    return "\n".join(lines)


def _tp_mode_words(tp_mode: str) -> str:
    """What a tp mode other than TorchTitan's TP + SP does, in a few words."""
    if tp_mode == "dp":
        return "the tp dim as data parallel for the whole block"
    words = []
    if "dp" in sub_block_modes(tp_mode):
        words.append("the tp dim as data parallel for one sub-block")
    if a2a_mode(tp_mode):
        words.append("the attention's output projection whole on the sequence shard")
    if DP_SHARD_TP in sub_block_modes(tp_mode):
        words.append("the feed-forward tensor parallel over dp_shard, its weights gathered "
                     "over tp")
    if stream_dim(tp_mode) == 0:
        words.append("the residual stream sharded on the batch over tp")
    if stream_dim(tp_mode) is None:
        words.append("tensor parallel without sequence parallel (the residual stream whole "
                     "on every tp rank)")
    return ", ".join(words)


def snippet(plan: Plan) -> str:
    """TorchTitan settings that run this plan, or which layers keep it from being uniform."""
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    kinds = {(b.ac, b.reshard_after_forward, b.tp_mode) for b in blocks}
    release_0_3 = str(plan.fingerprint.get("versions", {}).get("torchtitan", "")).startswith(
        "0.3")
    # TorchTitan 0.3.0 says TP without SP: parallelism.enable_sequence_parallel off
    titan_modes = ("none", "sp", *((TP_WITHOUT_SP,) if release_0_3 else ()))
    if len(kinds) == 1 and blocks[0].tp_mode not in titan_modes:
        return (f"not expressible as TorchTitan settings: every block runs tp mode "
                f"{blocks[0].tp_mode!r} ({_tp_mode_words(blocks[0].tp_mode)}), which no "
                "TorchTitan degree says; the plan file runs it")
    if len(kinds) != 1:
        first = (blocks[0].ac, blocks[0].reshard_after_forward, blocks[0].tp_mode)
        odd = [b.fqn for b in blocks if (b.ac, b.reshard_after_forward, b.tp_mode) != first]
        return (f"not expressible as uniform TorchTitan degrees: {len(odd)} of {len(blocks)} "
                f"blocks differ from {blocks[0].fqn} "
                f"({blocks[0].describe(plan.mesh.unsharded_label)}): {', '.join(odd[:8])}"
                + (" ..." if len(odd) > 8 else ""))
    b = blocks[0]
    if plan.embedding_mode:
        return ("not expressible as TorchTitan settings: the embedding is looked up on its "
                "embedding dim over dp_shard x tp (token ids all-gathered, its output moved "
                "onto the stream by an all-to-all), where TorchTitan's is vocabulary-parallel "
                "and FSDP-gathered; the plan file runs it")
    node = reshard_group(b.reshard_after_forward)
    if node:
        return (f"not expressible as TorchTitan settings: every block reshards to {node} ranks "
                "after forward (FSDP2's integer reshard_after_forward), which "
                "parallelism.fsdp_reshard_after_forward cannot say")
    if any(b.fsdp_unit > 1 for b in blocks):
        return (f"not expressible as TorchTitan settings: blocks share FSDP units of "
                f"{max(b.fsdp_unit for b in blocks)} (one fully_shard over consecutive blocks), "
                "which TorchTitan's apply_fsdp (one per block) cannot say")
    if release_0_3:
        return "\n".join(["equivalent TorchTitan 0.3.0 command line:",
                          " ".join(command_line_0_3(plan, b))])
    m = plan.mesh
    ac = {"none": 'mode = "none"', "full": 'mode = "full"',
          "selective": 'mode = "selective"\nselective_ac_option = "op"'}[b.ac]
    return "\n".join([
        "equivalent TorchTitan settings:",
        "[parallelism]",
        f"data_parallel_replicate_degree = {m.dp_replicate}",
        f"data_parallel_shard_degree = {m.dp_shard}",
        f"tensor_parallel_degree = {m.tp}",
        f"context_parallel_degree = {m.cp}",
        *([f"pipeline_parallel_degree = {m.pp}",
           f'pipeline_parallel_schedule = "{plan.pipeline.schedule}"',
           f"pipeline_parallel_microbatch_size = {plan.pipeline.microbatch_size}",
           f"module_fqns_per_model_part = {json.dumps(plan.pipeline.stages)}"]
          if plan.pipeline is not None else []),
        *([f"expert_parallel_degree = {m.ep}", f"expert_tensor_parallel_degree = {m.etp}"]
          if m.ep > 1 else []),
        f'fsdp_reshard_after_forward = "{"default" if b.reshard_after_forward else "never"}"',
        "[training]",
        f"local_batch_size = {plan.local_batch_size}",
        f"global_batch_size = {plan.global_batch_size}",
        "[activation_checkpoint]",
        ac,
    ])


def command_line_0_3(plan: Plan, block: LayerPlan) -> list[str]:
    """TorchTitan 0.3.0's tyro arguments for a uniform plan whose blocks all run ``block``'s
    strategy (0.3.0 has no expert-TP degree: its ETP is 1)."""
    m, p = plan.mesh, "--parallelism."
    args = [f"{p}data_parallel_replicate_degree {m.dp_replicate}",
            f"{p}data_parallel_shard_degree {m.dp_shard}",
            f"{p}tensor_parallel_degree {m.tp}", f"{p}context_parallel_degree {m.cp}"]
    if plan.pipeline is not None:
        args += [f"{p}pipeline_parallel_degree {m.pp}",
                 f"{p}pipeline_parallel_schedule {plan.pipeline.schedule}",
                 f"{p}pipeline_parallel_microbatch_size {plan.pipeline.microbatch_size}",
                 f"{p}module_fqns_per_model_part '{json.dumps(plan.pipeline.stages)}'"]
    if m.ep > 1:
        args.append(f"{p}expert_parallel_degree {m.ep}")
    if block.tp_mode == TP_WITHOUT_SP:
        args.append(f"{p}no-enable-sequence-parallel")
    reshard = "default" if block.reshard_after_forward else "never"
    return [*args, f"{p}fsdp_reshard_after_forward {reshard}",
            f"--training.local_batch_size {plan.local_batch_size}",
            f"--training.global_batch_size {plan.global_batch_size}",
            f"activation-checkpoint:{block.ac}"]


def diff_lines(a: Plan, b: Plan) -> list[str]:
    """What differs between plans ``a`` and ``b``, and the predicted effect."""
    out = []
    for key in sorted(set(a.fingerprint) | set(b.fingerprint)):
        if a.fingerprint.get(key) != b.fingerprint.get(key):
            out.append(f"job {key}: {a.fingerprint.get(key)!r} -> {b.fingerprint.get(key)!r}")
    if a.inputs and b.inputs:
        for section in sorted(set(a.inputs) | set(b.inputs)):
            va, vb = a.inputs.get(section), b.inputs.get(section)
            if isinstance(va, dict) and isinstance(vb, dict):
                out += [f"inputs {section}.{key}: {va.get(key)!r} -> {vb.get(key)!r}"
                        for key in sorted(set(va) | set(vb))
                        if va.get(key) != vb.get(key) and key != "provenance"]
            elif va != vb and section not in a.fingerprint:
                out.append(f"inputs {section}: {va!r} -> {vb!r}")
    if a.mesh != b.mesh:
        out.append(f"mesh: {vars(a.mesh)} -> {vars(b.mesh)}")
    split_a = (a.local_batch_size, a.gradient_accumulation_steps)
    split_b = (b.local_batch_size, b.gradient_accumulation_steps)
    if split_a != split_b:
        out.append(f"local batch x accumulation: {split_a[0]} x {split_a[1]} -> "
                   f"{split_b[0]} x {split_b[1]}")
    out += pipeline_diff(a, b)
    layers_b = {layer.fqn: layer for layer in b.layers}
    changed: list[tuple[str, str, str]] = []
    for layer in a.layers:
        other = layers_b.get(layer.fqn)
        if other is None:
            out.append(f"{layer.fqn}: only in the first plan")
        elif other.describe(b.mesh.unsharded_label) != layer.describe(a.mesh.unsharded_label):
            changed.append((layer.fqn, layer.describe(a.mesh.unsharded_label),
                            other.describe(b.mesh.unsharded_label)))
    for fqn in layers_b.keys() - {layer.fqn for layer in a.layers}:
        out.append(f"{fqn}: only in the second plan")
    i = 0
    while i < len(changed):  # group consecutive layers with the same change
        j = i
        while j + 1 < len(changed) and changed[j + 1][1:] == changed[i][1:]:
            j += 1
        name = changed[i][0] if i == j else f"{changed[i][0]}..{changed[j][0].split('.')[-1]}"
        out.append(f"{name}: {changed[i][1]} -> {changed[i][2]}")
        i = j + 1
    if out:
        pa, pb = a.predicted, b.predicted
        out.append(
            f"predicted effect: step {pa['step_time_s']:.4g} s -> {pb['step_time_s']:.4g} s "
            f"({pb['step_time_s'] / pa['step_time_s']:.3f}x), tokens/s "
            f"{pa['tokens_per_s']:.4g} -> {pb['tokens_per_s']:.4g}, peak "
            f"{pa['peak_memory_gib']:.3g} -> {pb['peak_memory_gib']:.3g} GiB"
        )
    return out


def pipeline_diff(a: Plan, b: Plan) -> list[str]:
    """Schedule, stages per rank, micro-batches and stage split differences."""
    from ..plan.schema import stage_text

    pa, pb = a.pipeline, b.pipeline
    if pa is None and pb is None:
        return []
    if pa is None or pb is None:
        only = "second" if pa is None else "first"
        return [f"pipeline: only the {only} plan is pipelined"]
    out = []
    for key in ("schedule", "stages_per_rank", "microbatches", "microbatch_size"):
        if getattr(pa, key) != getattr(pb, key):
            out.append(f"pipeline {key}: {getattr(pa, key)!r} -> {getattr(pb, key)!r}")
    if pa.stages != pb.stages:
        for i in range(max(len(pa.stages), len(pb.stages))):
            sa = stage_text(pa.stages[i]) if i < len(pa.stages) else "(none)"
            sb = stage_text(pb.stages[i]) if i < len(pb.stages) else "(none)"
            if sa != sb:
                out.append(f"stage {i}: {sa} -> {sb}")
    return out
