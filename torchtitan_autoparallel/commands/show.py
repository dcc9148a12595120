"""A plan as a picture: the mesh as a grid of ranks, one row per run of identical layers
coloured by strategy, a stacked memory bar per device against the budget, and the predicted
step time by component. ``picture`` computes what is drawn (plain data, tested); ``draw``
and ``html`` render it. Needs matplotlib (``pip install 'torchtitan-autoparallel[show]'``).
"""

import base64
import io
import itertools
import os
from dataclasses import dataclass
from typing import Any

from ..cost.model import (
    STATE_BYTES_PER_PARAM,
    STEP_BYTES_PER_PARAM,
    core_share,
    edges_cost,
    optimizer_step_s,
)
from ..errors import UserError, atomic_write_all, check_output_path
from ..plan.assembly import candidate_for, rank_counts
from ..plan.recost import block_counts, inputs_from_plan
from ..plan.schema import Plan

ASPECTS = ("params", "tp", "ep", "cp", "ac", "pinned")
"""Columns of the layer table: the aspects of ``layout.strategy_parts`` plus the mesh's cp."""
COLOURS = {
    "fsdp": "#4c72b0", "fsdp-keep": "#8fa8d8", "ddp": "#55a868", "single": "#937860",
    "tp+sp": "#dd8452", "tp_dp": "#da8bc3", "ep": "#c44e52", "cp": "#64b5cd",
    "attn:tp_dp/ffn:tp+sp": "#e4a88a", "attn:tp+sp/ffn:tp_dp": "#c9a0b6",
    "attn:tp+a2a/ffn:tp+sp": "#c46a3a", "attn:tp_dp/ffn:tp": "#f0c8b4",
    "attn:tp/ffn:tp_dp": "#e2c4d6", "attn:tp/ffn:tp": "#eeb48c",
    "attn:tp+sp/ffn:tp@dp_shard": "#b5651d", "attn:tp+sp/ffn:tp+sp/shared:tp_dp": "#d99a6c",
    "attn:tp_dp/ffn:tp+sp/shared:tp_dp": "#e8b9a0",
    "dim-shard": "#6a8f4f", "a2a": "#a3c47a", "tp-gather+a2a": "#c7dca8",
    "ac:none": "#e6e6e6", "ac:selective": "#ccb974", "ac:full": "#8c8c8c", "pinned": "#222222",
    "": "#f2f2f2",
}
"""Cell colour per strategy value ("ep4" and "cp2" take the colour of "ep" / "cp"; a tp value
with " stream:batch" that of its tp part; "" = the aspect does not apply)."""
NODE_COLOURS = ("#dfe8f5", "#f5e6d8")
MEMORY_COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer state": "#55a868",
                  "optimizer step temporary": "#937860", "activations": "#c44e52",
                  "logits": "#8172b2", "working set": "#ccb974",
                  "parameters, gradients, optimizer state": "#4c72b0",
                  "embedding / logits": "#8172b2"}
TIME_COLOURS = {"compute": "#4c72b0", "tp": "#dd8452", "cp ring": "#64b5cd",
                "ep all-to-all": "#c44e52", "fsdp / dp": "#55a868", "host copies": "#937860",
                "embedding, output, optimizer, per-layer overhead": "#8c8c8c",
                "pipeline bubble": "#da8bc3", "compute (slowest rank's micro-batches)": "#4c72b0",
                "p2p fill and drain": "#64b5cd"}


def colour(value: str) -> str:
    """The colour of one strategy value (see ``COLOURS``)."""
    value = value.removesuffix(" stream:batch")
    return COLOURS.get(value) or COLOURS[value.rstrip("0123456789")]


@dataclass
class LayerRow:
    """A run of consecutive layers with the same kind and strategy."""

    first: str
    last: str
    count: int
    strategy: str
    cells: dict[str, str]
    """Aspect -> value ("" where it does not apply)."""


@dataclass
class Picture:
    """Everything the picture of one plan shows."""

    title: str
    mesh_dims: list[str]
    """"dp_shard=4 (within a node)" per mesh dim > 1."""
    ranks: list[tuple[int, int, int, int]]
    """(rank, grid row, grid column, node) per rank; rows: data-parallel index, columns: the
    cp x tp index (tp innermost, TorchTitan's order)."""
    rows: list[LayerRow]
    memory: list[tuple[str, float]]
    """Segments of the predicted peak per device, GiB (every rank holds the same)."""
    memory_phase: str
    budget_gib: float
    time: list[tuple[str, float]]
    """Segments of the predicted step time, s."""


def picture(plan: Plan) -> Picture:
    """What ``draw`` shows for ``plan``, costed from the plan alone (its stored inputs)."""
    m = plan.mesh
    gpn = int(plan.fingerprint.get("gpus_per_node") or m.world)
    dims = [f"{name}={size} ({'spans nodes' if m.spans_nodes(name, gpn) else 'within a node'})"
            for name, size in (("pp", m.pp), ("dp_replicate", m.dp_replicate),
                               ("dp_shard", m.dp_shard),
                               ("cp", m.cp), ("tp", m.tp), ("ep", m.ep)) if size > 1]
    inner = m.cp * m.tp
    ranks = [(r, r // inner, r % inner, r // gpn) for r in range(m.world)]
    memory, phase, time = (_pipeline_breakdown(plan) if plan.pipeline is not None
                           else _breakdown(plan))
    step, peak = sum(v for _, v in time), sum(v for _, v in memory)
    p = plan.predicted
    title = (f"{plan.fingerprint.get('model')} {plan.fingerprint.get('flavor')} on {m.world} "
             f"devices: step {step:.4g} s, {plan.global_batch_size * plan.seq_len / step:.4g} "
             f"tokens/s, peak {peak:.3g} of {p['budget_gib']:.3g} GiB")
    if abs(step / p["step_time_s"] - 1) > 1e-6 or abs(peak / p["peak_memory_gib"] - 1) > 1e-6:
        title += (f"\n(this cost model; the plan file predicted step {p['step_time_s']:.4g} s, "
                  f"peak {p['peak_memory_gib']:.3g} GiB)")
    return Picture(title, dims or ["one device"], ranks, _rows(plan), memory, phase,
                   p["budget_gib"], time)


def _rows(plan: Plan) -> list[LayerRow]:
    unsharded = plan.mesh.unsharded_label
    rows = []
    for _, run in itertools.groupby(plan.layers, key=lambda lp: (lp.kind, lp.describe())):
        run = list(run)
        cells = {a: "" for a in ASPECTS}
        parts = run[0].parts(unsharded)
        if "stream" in parts:  # the stream's layout drawn with the tp dim's use
            parts["tp"] += f" {parts['stream']}"
        cells.update({a: v for a, v in parts.items() if a in ASPECTS})
        if plan.mesh.cp > 1 and run[0].kind == "block":
            cells["cp"] = f"cp{plan.mesh.cp}"
        cells["ac"] = cells["ac"] if cells["ac"] else "ac:none"
        rows.append(LayerRow(run[0].fqn, run[-1].fqn, len(run), run[0].describe(unsharded),
                             cells))
    return rows


def _pipeline_breakdown(plan: Plan
                        ) -> tuple[list[tuple[str, float]], str, list[tuple[str, float]]]:
    """``_breakdown`` of a pipeline plan: the fullest pp rank's memory, and the step as the
    slowest rank's micro-batches, the schedule's bubble, per-step FSDP and the P2P fill."""
    inputs = inputs_from_plan(plan)
    cand = candidate_for(inputs, plan.mesh, plan.local_batch_size, plan.pipeline,
                         plan.embedding_mode)
    class_of, _ = block_counts(plan, inputs)
    per_rank, _ = rank_counts(plan, class_of)
    step, times, memory = cand.evaluate(per_rank)
    rank = max(range(plan.mesh.pp), key=lambda r: memory[r])
    t = cand.type_of_rank(rank)
    counts = per_rank[rank]
    working = max((cand.costs[k].transient_bytes for k, n in counts.items() if n), default=0.0)
    resident = sum(n * cand.costs[k].resident_bytes for k, n in counts.items())
    acts = cand.in_flight[t.name] * sum(n * cand.costs[k].kept_bytes for k, n in counts.items())
    gib = 2**-30
    segments = [("parameters, gradients, optimizer state", resident),
                ("activations", acts), ("embedding / logits", cand.edge_memory[t.name]),
                ("working set", working)]
    phase = f"forward / backward, pp rank {rank}"
    if sum(v for _, v in segments) < memory[rank]:  # the optimizer step is the peak
        phase = f"optimizer step, pp rank {rank}"
        segments = [("parameters, gradients, optimizer state", memory[rank])]
    slowest = max(times)
    per_step = step - cand.accum * ((cand.microbatches + cand.beta) * slowest + cand.fill_s) \
        - cand.per_step_s
    # the once-per-step term holds each stage's optimizer step beside its FSDP collectives:
    # the optimizer's share on the rank that sets it, from that rank's parameters
    ctx = inputs.cost_context
    once = [cand.edge_step[s.name] + sum(n * cand.costs[k].step_s for k, n in c.items())
            for s, c in ((cand.type_of_rank(r), per_rank[r]) for r in range(plan.mesh.pp))]
    top = max(range(plan.mesh.pp), key=lambda r: once[r])
    step_bytes = cand.edge_state[cand.type_of_rank(top).name] + sum(
        n * cand.costs[k].step_bytes for k, n in per_rank[top].items())
    optimizer = cand.accum * optimizer_step_s(
        step_bytes * STATE_BYTES_PER_PARAM / STEP_BYTES_PER_PARAM[ctx.features.optimizer], ctx)
    time = [("compute (slowest rank's micro-batches)", cand.accum * cand.microbatches * slowest),
            ("pipeline bubble", cand.accum * cand.beta * slowest),
            ("fsdp / dp", per_step - optimizer), ("p2p fill and drain", cand.accum * cand.fill_s),
            ("embedding, output, optimizer, per-layer overhead", cand.per_step_s + optimizer)]
    return [(k, v * gib) for k, v in segments], phase, time


def _breakdown(plan: Plan) -> tuple[list[tuple[str, float]], str, list[tuple[str, float]]]:
    """Memory segments (GiB) of the peak phase, its name, and step-time segments (s)."""
    inputs = inputs_from_plan(plan)
    cand = candidate_for(inputs, plan.mesh, plan.local_batch_size,
                         embedding=plan.embedding_mode)
    _, counts = block_counts(plan, inputs)
    costs = {key: cand.costs[key] for key in counts}
    edges = edges_cost(inputs.graph, plan.mesh, plan.local_batch_size, inputs.cost_context,
                       plan.embedding_mode)
    t = cand.types[0].name
    per_param = cand.state_bytes / STATE_BYTES_PER_PARAM
    gib = 2**-30
    kept = sum(n * costs[key].kept_bytes for key, n in counts.items())
    working = max((c.transient_bytes for c in costs.values()), default=0.0)
    resident, step_bytes = cand.edge_memory[t], cand.edge_state[t]
    state = resident - edges.kept_bytes  # parameters, moments (and gradients)
    if step_bytes >= resident + kept + working:
        phase = "optimizer step"
        memory = [("parameters", 4 * per_param), ("gradients", 4 * per_param),
                  ("optimizer state", 8 * per_param),
                  ("optimizer step temporary", step_bytes - 16 * per_param)]
    else:
        phase = "forward / backward"
        held = 4 * per_param if state > 0 else 0.0
        memory = [("parameters", held), ("optimizer state", 2 * held),
                  ("gradients", state - 3 * held),
                  ("activations", kept + edges.kept_bytes - edges.logits_bytes),
                  ("logits", edges.logits_bytes), ("working set", working)]
    share = core_share(plan.mesh, inputs.cost_context)
    accum = cand.accum
    time = {"compute": accum * share * sum(n * costs[k].compute_s for k, n in counts.items())}
    for key, n in counts.items():
        for name, seconds in costs[key].exposed_parts:
            time[name] = time.get(name, 0.0) + accum * share * n * seconds
    overhead = sum(n * inputs.hw.block_overhead_us * 1e-6 for n in counts.values())
    time["embedding, output, optimizer, per-layer overhead"] = (
        accum * (cand.edge_time[t] + overhead) + cand.per_step_s)
    time["pipeline bubble"] = 0.0  # no pipeline stages (see _pipeline_breakdown)
    return ([(k, v * gib) for k, v in memory], phase, list(time.items()))


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise UserError("show needs matplotlib: pip install 'torchtitan-autoparallel[show]' "
                        "(or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(pictures: list[Picture]) -> Any:
    """A matplotlib Figure with one column per picture (two for ``diff``)."""
    plt = _matplotlib()
    height = max(6.0, 4.2 + 0.32 * max(len(p.rows) for p in pictures))
    fig = plt.figure(figsize=(9.5 * len(pictures), height))
    outer = fig.add_gridspec(1, len(pictures), wspace=0.3, top=1 - 1.3 / height)
    for i, pic in enumerate(pictures):
        grid = outer[i].subgridspec(3, 2, height_ratios=[3, 1, 1], width_ratios=[3, 2],
                                    hspace=1.3, wspace=0.3)
        _draw_layers(fig.add_subplot(grid[0, 0]), pic)
        _draw_mesh(fig.add_subplot(grid[0, 1]), pic)
        _draw_bar(fig.add_subplot(grid[1, :]), pic.memory, MEMORY_COLOURS,
                  f"memory per device, GiB ({pic.memory_phase} peak; "
                  + ("the fullest pp rank)" if "pp rank" in pic.memory_phase
                     else "every rank holds the same)"),
                  pic.budget_gib)
        _draw_bar(fig.add_subplot(grid[2, :]), pic.time, TIME_COLOURS,
                  "predicted step time, s (exposed communication by collective)", None)
        fig.text(0.5 / len(pictures) + i / len(pictures), 0.99, pic.title, ha="center",
                 va="top", fontsize=10, wrap=True)
    return fig


def _draw_layers(ax: Any, pic: Picture) -> None:
    from matplotlib.patches import Rectangle

    n = len(pic.rows)
    for y, row in enumerate(pic.rows):
        for x, aspect in enumerate(ASPECTS):
            value = row.cells[aspect]
            ax.add_patch(Rectangle((x, n - 1 - y), 1, 1, facecolor=colour(value),
                                   edgecolor="white", gid=f"{row.first}|{aspect}|{value}"))
            if value:
                ax.text(x + 0.5, n - 0.5 - y, value, ha="center", va="center", fontsize=6,
                        color="white" if value in ("pinned", "fsdp") else "black")
    ax.set_xlim(0, len(ASPECTS))
    ax.set_ylim(0, n)
    ax.set_xticks([x + 0.5 for x in range(len(ASPECTS))], ASPECTS, fontsize=7)
    ax.xaxis.tick_top()
    names = [r.first if r.count == 1 else f"{r.first}..{r.last.split('.')[-1]} x{r.count}"
             for r in pic.rows]
    ax.set_yticks([n - 0.5 - y for y in range(n)], names, fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def _draw_mesh(ax: Any, pic: Picture) -> None:
    from matplotlib.patches import Rectangle

    rows = max(r[1] for r in pic.ranks) + 1
    cols = max(r[2] for r in pic.ranks) + 1
    for rank, row, col, node in pic.ranks:
        ax.add_patch(Rectangle((col, rows - 1 - row), 1, 1, edgecolor="white",
                               facecolor=NODE_COLOURS[node % 2], gid=f"rank{rank}|node{node}"))
        if len(pic.ranks) <= 64:
            ax.text(col + 0.5, rows - 0.5 - row, str(rank), ha="center", va="center", fontsize=6)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel("rows: dp_replicate x dp_shard\ncolumns: cp x tp (tp innermost)\n"
                  "shade: node", fontsize=7)
    ax.set_title("mesh of ranks\n" + "\n".join(pic.mesh_dims), fontsize=7)


def _draw_bar(ax: Any, segments: list[tuple[str, float]], colours: dict[str, str], title: str,
              budget: float | None) -> None:
    left = 0.0
    for name, value in segments:
        ax.barh(0, value, left=left, color=colours[name],
                label=f"{name} {value:.3g}" if value else None, gid=f"{name}|{value!r}")
        left += value
    if budget is not None:
        ax.axvline(budget, color="black", linestyle="--", label=f"budget {budget:.3g}")
    ax.set_xlim(0, max(left, budget or 0.0) * 1.05 or 1.0)
    ax.set_yticks([])
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35),
              frameon=False)


def html(pictures: list[Picture], png: bytes) -> str:
    """A self-contained page: the picture (embedded) and its tables."""
    parts = ["<!doctype html><meta charset='utf-8'><title>autoparallel plan</title>",
             "<style>body{font-family:sans-serif}td,th{padding:2px 6px;font-size:12px}</style>",
             f"<img alt='plan' style='max-width:100%' src='data:image/png;base64,"
             f"{base64.b64encode(png).decode()}'>"]
    for pic in pictures:
        parts.append(f"<h2>{_esc(pic.title)}</h2><p>mesh: {_esc('; '.join(pic.mesh_dims))}</p>")
        parts.append("<table><tr><th>layers</th><th>n</th>"
                     + "".join(f"<th>{a}</th>" for a in ASPECTS) + "</tr>")
        for row in pic.rows:
            cells = "".join(f"<td style='background:{colour(row.cells[a])}'>"
                            f"{_esc(row.cells[a])}</td>" for a in ASPECTS)
            parts.append(f"<tr><td>{_esc(row.first)}..{_esc(row.last)}</td>"
                         f"<td>{row.count}</td>{cells}</tr>")
        parts.append("</table>")
        for head, segs, unit in ((f"memory per device ({pic.memory_phase} peak, budget "
                                  f"{pic.budget_gib:.3g} GiB)", pic.memory, "GiB"),
                                 ("step time", pic.time, "s")):
            parts.append(f"<h3>{_esc(head)}</h3><table>" + "".join(
                f"<tr><td>{_esc(k)}</td><td>{v:.4g} {unit}</td></tr>" for k, v in segs)
                + "</table>")
    return "\n".join(parts) + "\n"


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render(plans: list[Plan], out: str = "", html_out: str = "") -> list[Picture]:
    """Draw ``plans`` side by side to ``out`` (png / svg / pdf) and / or ``html_out``; each
    file is written whole or not at all."""
    if not out and not html_out:
        raise UserError("nothing to write: give --out PLAN.png and / or --html PLAN.html")
    if out and os.path.splitext(out)[1].lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--out {out}: use a .png, .svg or .pdf file name")
    for path in (out, html_out):
        if path:
            check_output_path(path, "picture")
    pictures = [picture(plan) for plan in plans]
    fig = draw(pictures)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    files: list[tuple[str, str | bytes]] = []
    if out:
        image = io.BytesIO()
        fig.savefig(image, format=os.path.splitext(out)[1][1:].lower(), dpi=110,
                    bbox_inches="tight")
        files.append((out, image.getvalue()))
    if html_out:
        files.append((html_out, html(pictures, buffer.getvalue()).encode()))
    _matplotlib().close(fig)
    atomic_write_all(files, "picture")
    return pictures
