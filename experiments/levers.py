"""Plans no recipe expresses, at scale (predicted): each lever against the same search without it.

    python experiments/levers.py

On TorchTitan's published H100 jobs (experiments/data/torchtitan_h100_202412.csv, Tables 1-4,
and the June 2025 async TP benchmark's 8B / 70B jobs) and on larger FSDP jobs, the planner
(``auto``, the job's features and global batch, mesh free) runs with and without each lever:

- float8 per linear: with ``quantize.linear.float8.filter_fqns`` unset the planner keeps in
  bf16 the linears where float8 is predicted slower; without, every block linear runs float8
  (``filter_fqns = ["output"]``, TorchTitan's own configs).
- FSDP resharding to a node (FSDP2's integer ``reshard_after_forward``): offered per block
  where the FSDP group spans nodes; without, only reshard / keep.
- FSDP units of k blocks (one ``fully_shard`` over k consecutive identical blocks, k = 2 or 4):
  offered where FSDP shards the blocks (no pp, no EP); without, one unit per block. Declined
  with ``explain``'s reason.

Per job: predicted tokens/s per GPU with and without, the gain, and what the plan did with the
lever (or why the planner declined it). Profile: h100_grand_teton (the published machine).
Writes experiments/results/levers.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "experiments")]

import published  # noqa: E402  (the Tables 1-4 script: auto_overrides)

from tests.support.published import CONFIGS, FURTHER, published_rows  # noqa: E402

CONFIGS["llama3_405b"] = "llama3_405b_fsdp_tp.toml"
published.AUTO_CONFIGS["llama3_405b"] = "llama3_405b_auto.toml"
OUT = REPO / "experiments" / "results" / "levers.md"
HW = "h100_grand_teton"
ALL_FLOAT8 = "--quantize.linear.float8.filter_fqns=output"
"""Every block linear in float8 (the output layer bf16, as TorchTitan's configs have it)."""


def jobs() -> list[tuple[str, dict[str, str]]]:
    """(label, published.py fields) of the jobs: Tables 1, 3, 4 with float8 or at 128+ GPUs
    (Table 2's long-context jobs run on one node, where neither lever has room), the
    async TP benchmark's jobs, and 70B / 405B FSDP-only jobs at 256 / 512 GPUs."""
    out = []
    for row in published_rows():
        f = row.fields
        if f["table"] != "2" and (f["float8"] == "yes" or int(f["gpus"]) >= 128):
            out.append((row.label(), dict(f)))
    for label, fields, *_ in FURTHER:
        if fields["async_tp"] == "yes":
            out.append((label.removesuffix(": async TP"), dict(fields)))
    for model, gpus in (("llama3_70b", "256"), ("llama3_405b", "512")):
        out.append((f"{model} {gpus} GPUs FSDP, compile+float8", dict(
            model=model, gpus=gpus, fsdp=gpus, tp="1", cp="1", seq_len="8192", local_batch="1",
            global_batch=gpus, ac="full", compile="yes", float8="yes", async_tp="no")))
    return out


@contextmanager
def switched_off(name: str, value: Any) -> Iterator[None]:
    """The planner with ``strategies.<name>`` replaced by ``value``: the node reshard
    (``node_reshard_group`` giving 0: only reshard / keep) or FSDP units
    (``FSDP_UNIT_SIZES`` empty: one unit per block) switched off."""
    from torchtitan_autoparallel.candidates import strategies

    saved = getattr(strategies, name)
    setattr(strategies, name, value)
    try:
        yield
    finally:
        setattr(strategies, name, saved)


LEVERS_OFF = {"reshard to node": ("node_reshard_group", lambda *args, **kwargs: 0),
              "FSDP units": ("FSDP_UNIT_SIZES", ())}


def plan(fields: dict[str, str], extra: tuple[str, ...] = ()) -> Any:
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config

    # a time limit no job reaches, so that with and without differ by the lever only
    argv = published.auto_overrides(fields, HW) + ["--autoparallel.time_limit_s=600", *extra]
    return plan_job(parse_config(argv), int(fields["gpus"]))


def tps(p: Any, fields: dict[str, str]) -> float:
    return p.predicted["tokens_per_s"] / int(fields["gpus"])


def float8_use(p: Any) -> str:
    kept = (p.float8_filter_fqns or [])[1:]
    return f"bf16: {', '.join(kept)}" if kept else "every block linear float8"


def node_use(p: Any) -> str:
    from torchtitan_autoparallel.candidates.layout import reshard_group

    blocks = [layer for layer in p.layers if layer.kind == "block"]
    nodes = [layer for layer in blocks if reshard_group(layer.reshard_after_forward)]
    return (f"{len(nodes)} of {len(blocks)} blocks reshard to "
            f"{reshard_group(nodes[0].reshard_after_forward)} ranks" if nodes else "")


def node_declined(p: Any) -> str:
    """Why no block reshards to a node on this plan's mesh."""
    m = p.mesh
    gpn = p.inputs["gpus_per_node"]
    if m.pp > 1:
        return "declined: not offered with pp (TorchTitan keeps parameters under pp)"
    if m.dp_shard * m.cp * m.tp <= gpn:
        return "declined: the FSDP group lies in one node"
    if gpn // m.tp <= 1:
        return f"declined: one FSDP rank per node (tp {m.tp} fills the node)"
    return "declined: predicted slower than resharding fully or keeping"


def unit_use(p: Any) -> str:
    blocks = [layer for layer in p.layers if layer.kind == "block"]
    grouped = [layer for layer in blocks if layer.fsdp_unit > 1]
    sizes = sorted({layer.fsdp_unit for layer in grouped})
    return (f"{len(grouped)} of {len(blocks)} blocks in units of "
            f"{' / '.join(map(str, sizes))}" if grouped else "")


def unit_declined(p: Any) -> str:
    """``explain``'s reason for the first kind of block."""
    from torchtitan_autoparallel.commands.explain import unit_lines
    from torchtitan_autoparallel.plan.recost import inputs_from_plan

    line = unit_lines(p, inputs_from_plan(p))[0]
    return line[line.index("declined"):] if "declined" in line else line


def row(label: str, fields: dict[str, str], lever: str,
        run: Callable[[], tuple[Any, Any]], use: Callable[[Any], str],
        declined: Callable[[Any], str]) -> str:
    with_it, without = run()
    a, b = tps(with_it, fields), tps(without, fields)
    what = use(with_it) or declined(with_it)
    return f"| {label} | {lever} | {b:.0f} | {a:.0f} | {a / b - 1:+.2%} | {what} |"


UNITS_NOTE = (
    "FSDP units of k blocks are costed as one all-gather / reduce-scatter (and HSDP all-reduce) "
    "of the k blocks' parameters per unit, each block paying 1/k of it (per-step latency "
    "amortised, bus bandwidth at the larger message size), against a working set of the unit's "
    "and the prefetched next unit's parameters and the unit's gradients. Not modelled: the "
    "first unit's all-gather, which nothing hides, grows with k. Where the planner declines, "
    "the reason is `explain`'s (`explain.unit_lines`) for the plan's first kind of block.")


def main() -> int:
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    lines = ["# Levers no recipe expresses, predicted at scale", "",
             f"`python experiments/levers.py`; profile `{HW}`; the planner with each lever "
             "against the same search without it (mesh, batch split, AC, resharding and FSDP "
             "units free; a time limit no job reaches).", "", UNITS_NOTE,
             "", "| job | lever | tok/s/GPU without | with | gain | what the plan does |",
             "|---|---|---:|---:|---:|---|"]
    for label, fields in jobs():
        if fields["float8"] != "no":
            lines.append(row(
                label, fields, "float8 per linear",
                lambda f=fields: (plan(f), plan(f, (ALL_FLOAT8,))),
                float8_use, lambda p: "declined: TP + SP blocks (TorchTitan's float8 TP styles "
                                      "need every linear converted)"
                if p.mesh.tp > 1 else "declined: float8 pays on every linear"))

        for lever, use, declined in (("reshard to node", node_use, node_declined),
                                     ("FSDP units", unit_use, unit_declined)):

            def run(f: dict[str, str] = fields, off: tuple = LEVERS_OFF[lever]
                    ) -> tuple[Any, Any]:
                with_it = plan(f)
                with switched_off(*off):
                    return with_it, plan(f)

            lines.append(row(label, fields, lever, run, use, declined))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    OUT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
