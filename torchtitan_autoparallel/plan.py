"""The Plan: plain, versioned data that says how to parallelize one job; JSON in and out."""

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError, atomic_write
from .validate import shown

SCHEMA_VERSION = 2
"""2: the plan stores its resolved planning inputs (``Plan.inputs``). 1 is still read (the
command line warns): where its inputs are needed they are rebuilt from the fingerprint and the
hardware profile it names (``planner.inputs_from_plan``)."""
READABLE_VERSIONS = (1, SCHEMA_VERSION)
VOLATILE_SOLVER_KEYS = ("solve_time_s", "planning_time_s", "planning_time_within_s")
"""Wall-clock measurements: shown in the table and logs, never written to plan files, so that
the same inputs give a byte-identical file on any machine and under any load."""


@dataclass
class LayerPlan:
    fqn: str
    kind: str
    """"embedding", "block" or "output"."""
    ac: str = "none"
    """Activation checkpointing: none / selective / full."""
    reshard_after_forward: bool = True
    tp_mode: str = "none"
    """What the tp mesh dim does for this layer: "none" (tp = 1); "sp" = tensor parallel with
    sequence parallel (vocab-parallel + loss parallel for embedding and output); "dp" = the tp
    ranks split the micro-batch and the parameters are FSDP-sharded over dp_shard x tp."""
    time_ms: float = 0.0
    """Predicted forward + backward time per micro-batch."""
    comm_ms: float = 0.0
    """Predicted exposed communication per micro-batch."""
    memory_mib: float = 0.0
    """Predicted memory held for backward per micro-batch plus resident state."""
    ep: int = 1
    """Expert-parallel degree of this block's routed experts (1: dense block, or experts
    sharded like the rest of the block)."""
    pinned: bool = False
    """Fixed by ``autoparallel.pin``: the block runs TorchTitan's own recipe for the job."""

    def parts(self, unsharded: str = "") -> dict[str, str]:
        """This layer's strategy by aspect (see ``strategy_parts``)."""
        return strategy_parts(self.ac, self.reshard_after_forward, self.tp_mode, self.ep,
                              self.pinned, unsharded)

    def describe(self, unsharded: str = "") -> str:
        """This layer's strategy label (see ``strategy_label``)."""
        return strategy_label(self.ac, self.reshard_after_forward, self.tp_mode, self.ep,
                              self.pinned, unsharded)


def strategy_parts(ac: str, reshard_after_forward: bool, tp_mode: str, ep: int = 1,
                   pinned: bool = False, unsharded: str = "") -> dict[str, str]:
    """The one vocabulary of a strategy, by aspect (tables, explain, diff and pictures):
    params "fsdp" / "fsdp-keep" (reshard after forward or not; ``unsharded``: the mesh's label
    when it shards nothing, "ddp" / "single", see ``Mesh.unsharded_label``), tp "tp+sp" /
    "tp-as-dp", ep "ep<k>", ac "ac:<mode>", pinned "pinned"; absent aspects are left out."""
    parts = {"params": unsharded or ("fsdp" if reshard_after_forward else "fsdp-keep")}
    if tp_mode == "sp":
        parts["tp"] = "tp+sp"
    elif tp_mode == "dp":
        parts["tp"] = "tp-as-dp"
    if ep > 1:
        parts["ep"] = f"ep{ep}"
    if ac != "none":
        parts["ac"] = f"ac:{ac}"
    if pinned:
        parts["pinned"] = "pinned"
    return parts


def strategy_label(ac: str, reshard_after_forward: bool, tp_mode: str, ep: int = 1,
                   pinned: bool = False, unsharded: str = "") -> str:
    """A strategy as one string: its ``strategy_parts`` joined by "+"."""
    return "+".join(strategy_parts(ac, reshard_after_forward, tp_mode, ep, pinned,
                                   unsharded).values())


@dataclass(frozen=True, order=True)
class Mesh:
    """pp x dp_replicate x dp_shard x cp x tp = world size (TorchTitan's mesh order: pp
    outermost, tp innermost).

    ``ep`` / ``etp`` follow TorchTitan's rules for routed experts: with ``etp = tp`` the ep ranks
    come from dp_shard x cp; with ``etp = 1`` they also take all of tp (ep a multiple of tp).
    Experts are FSDP-sharded over the remaining ``efsdp`` ranks."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    """Pipeline stages across ranks (1: no pipeline parallelism)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def replicate_only(self) -> bool:
        """Pure data parallel (DDP): replicas only, nothing sharded."""
        return self.dp_replicate > 1 and self.unsharded

    @property
    def unsharded(self) -> bool:
        """No dim splits parameters or sequences (one device, or replicas only)."""
        return self.dp_shard * self.cp * self.tp == 1

    @property
    def unsharded_label(self) -> str:
        """"ddp" for pure data parallel, "single" for one device, "" when something is
        sharded."""
        return "ddp" if self.replicate_only else "single" if self.world == self.pp else ""

    @property
    def efsdp(self) -> int:
        """FSDP degree of routed experts when ep > 1."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    def spans_nodes(self, dim: str, gpus_per_node: int) -> bool:
        """Whether the process groups of ``dim`` cross node boundaries (ranks are node-major)."""
        if dim == "tp":
            inner = self.tp
        elif dim == "cp":
            inner = self.cp * self.tp
        elif dim == "dp_shard":
            inner = self.dp_shard * self.cp * self.tp
        elif dim == "ep":
            inner = self.ep * self.etp
        elif dim == "dp_replicate":
            inner = self.world // self.pp
        else:  # pp: neighbouring stages are world / pp ranks apart
            inner = self.world
        return inner > gpus_per_node

    def __str__(self) -> str:
        text = (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} "
                f"tp={self.tp}")
        text = (f"pp={self.pp} " if self.pp > 1 else "") + text
        return text + (f" ep={self.ep} etp={self.etp}" if self.ep > 1 else "")


@dataclass
class Pipeline:
    """How a pipeline-parallel plan runs (``Plan.pipeline``; None without pp): TorchTitan's
    schedule, stages per rank, micro-batches, and the planned split of the model's modules into
    stages (``parallelism.module_fqns_per_model_part``), with per-rank predictions."""

    schedule: str
    """A TorchTitan 0.2.2 schedule name (``parallelism.pipeline_parallel_schedule``)."""
    stages_per_rank: int
    microbatches: int
    """Micro-batches per step through the pipeline (local batch / microbatch_size)."""
    microbatch_size: int
    """Sequences per micro-batch (``parallelism.pipeline_parallel_microbatch_size``)."""
    stages: list[list[str]]
    """Module fqns of each stage, in stage order (stage s runs on rank s % pp, or on the
    V-shape's rank for ZBVZeroBubble / DualPipeV)."""
    bubble_fraction: float = 0.0
    """Predicted share of the step a rank idles in the pipeline's fill and drain."""
    rank_time_ms: list[float] = field(default_factory=list)
    """Predicted forward + backward time of one micro-batch through each pp rank's stages."""
    rank_memory_gib: list[float] = field(default_factory=list)
    """Predicted peak memory of each pp rank."""
    rank_state_gib: list[float] = field(default_factory=list)
    """Predicted parameters, gradients and AdamW state of each pp rank."""

    @property
    def style(self) -> str:
        """"v" (rank r holds stages r and 2 pp - 1 - r) or "loop" (stages r, r + pp, ...)."""
        return "v" if self.schedule in V_SCHEDULES else "loop"

    def rank_of(self, stage: int, pp: int) -> int:
        """The pp rank that runs ``stage``."""
        if self.style == "v" and stage >= pp:
            return 2 * pp - 1 - stage
        return stage % pp


V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules whose two stages per rank form a V (first and last stage on rank 0)."""


@dataclass
class Plan:
    fingerprint: dict[str, Any]
    mesh: Mesh
    global_batch_size: int
    local_batch_size: int
    gradient_accumulation_steps: int
    seq_len: int
    layers: list[LayerPlan]
    predicted: dict[str, float]
    solver: dict[str, Any]
    version: int = SCHEMA_VERSION
    notes: list[str] = field(default_factory=list)
    pipeline: Pipeline | None = None
    """Schedule, micro-batches and stage split when ``mesh.pp > 1`` (None otherwise)."""
    inputs: dict[str, Any] | None = None
    """The resolved planning inputs (hardware profile contents, budget, precision, constraints,
    features, pins, ...: ``planner.inputs_record``), so the plan can be explained, compared
    and costed again without its config or profile file. None in version-1 files."""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in VOLATILE_SOLVER_KEYS:
            data["solver"].pop(key, None)
        if data["inputs"] is None:
            del data["inputs"]  # a version-1 plan is written back as it was read
        if data["pipeline"] is None:
            del data["pipeline"]  # plans without pp keep their files (and digests)
        if data["mesh"]["pp"] == 1:
            del data["mesh"]["pp"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=False) + "\n"

    def digest(self) -> str:
        """Hash of the decisions (not the solver timings): equal digests apply identically."""
        decisions = {k: v for k, v in self.to_dict().items()
                     if k not in ("solver", "notes", "inputs", "version")}
        text = json.dumps(decisions, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: Any, source: str = "data") -> "Plan":
        """Build a plan from JSON data, validated (schema, types, ranges, consistency)."""
        from .validate import check_plan, check_plan_data

        if isinstance(data, dict) and data.get("version") not in READABLE_VERSIONS:
            raise UserError(
                f"plan schema version {shown(data.get('version'))} is not supported (this "
                f"version reads {list(READABLE_VERSIONS)}); re-plan the job"
            )
        check_plan_data(data, source)
        data = dict(data)
        data["mesh"] = Mesh(**data["mesh"])
        data["layers"] = [LayerPlan(**layer) for layer in data["layers"]]
        if data.get("pipeline") is not None:
            data["pipeline"] = Pipeline(**data["pipeline"])
        plan = cls(**data)
        check_plan(plan, source)
        return plan

    @classmethod
    def load(cls, path: str) -> "Plan":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f, parse_constant=_reject_constant)
        except FileNotFoundError as exc:
            raise UserError(f"plan file not found: {path}") from exc
        except OSError as exc:
            raise UserError(f"cannot read plan file {path}: {exc.strerror}") from exc
        except (ValueError, RecursionError) as exc:  # JSON, UTF-8 and NaN errors
            raise UserError(f"plan file {path} is corrupted or not a plan "
                            f"({shown(exc, 200)})") from exc
        return cls.from_dict(data, path)

    def save(self, path: str) -> None:
        """Validate, then write atomically: a temp file in the target's folder renamed over
        it, removed on any failure, so nothing half-written is ever left behind."""
        from .validate import check_plan

        check_plan(self, path)
        atomic_write(path, self.to_json(), "plan")

    @property
    def untabled_notes(self) -> list[str]:
        """Notes ``table`` does not show (it shows the techniques the model's adapter cannot
        apply, ``exclusions.exclusion_notes``)."""
        return [note for note in self.notes if not note.startswith("excluded ")]

    def table(self) -> str:
        """Readable summary: mesh, batch split, predictions, then one row per layer run."""
        m = self.mesh
        p = self.predicted
        lines = [
            f"autoparallel plan {self.digest()}: mesh {m} (world {m.world})",
            f"  batch: global {self.global_batch_size} = local {self.local_batch_size} x dp "
            f"{m.dp_replicate * m.dp_shard} x accumulation {self.gradient_accumulation_steps}, "
            f"seq {self.seq_len}",
            f"  predicted: step {p['step_time_s']:.4g} s, {p['tokens_per_s']:.4g} tokens/s, "
            f"peak {p['peak_memory_gib']:.3g} GiB of {p['budget_gib']:.3g} GiB per device",
            f"  solver: {self.solver['status']}, gap {self.solver['gap']:.2g}, "
            f"{self.solver['milps_solved']} MILPs over {self.solver['candidates']} candidates, "
            f"{self.solver['variables']} variables, {self.solver['constraints']} constraints, "
            f"planning {_planning_time(self.solver)}",
            *self._pipeline_lines(),
            *(f"  {note}" for note in self.notes if note not in self.untabled_notes),
        ]
        rows = []
        for group in _runs(self.layers):
            first, last = group[0], group[-1]
            name = first.fqn if first is last else f"{first.fqn}..{last.fqn.split('.')[-1]}"
            rows.append((name, first.describe(self.mesh.unsharded_label), first, len(group)))
        # columns widen for long module names (HF models: model.model.layers.10..27)
        wide = max([24, *(len(name) + 2 for name, *_ in rows)])
        label_wide = max([26, *(len(label) + 2 for _, label, *_ in rows)])
        lines.append(f"  {'layers':<{wide}}{'strategy':<{label_wide}}{'time/mb ms':>12}"
                     f"{'exposed comm ms':>17}{'memory MiB':>12}")
        for name, label, first, n in rows:
            lines.append(
                f"  {name:<{wide}}{label:<{label_wide}}{first.time_ms:>12.4g}"
                f"{first.comm_ms:>17.4g}{first.memory_mib:>12.4g}"
                + (f"  x{n}" if n > 1 else "")
            )
        return "\n".join(lines)


    def _pipeline_lines(self) -> list[str]:
        """The schedule, then one line per stage: its rank, modules and that rank's
        predicted time per micro-batch and peak memory."""
        pipe = self.pipeline
        if pipe is None:
            return []
        pp = self.mesh.pp
        lines = [f"  pipeline: {pipe.schedule}, {pp} ranks x {pipe.stages_per_rank} stages, "
                 f"{pipe.microbatches} micro-batches of {pipe.microbatch_size}; bubble "
                 f"{pipe.bubble_fraction:.1%} of the step"]
        for stage, fqns in enumerate(pipe.stages):
            rank = pipe.rank_of(stage, pp)
            cost = ""
            if len(pipe.rank_time_ms) == pp and len(pipe.rank_memory_gib) == pp:
                cost = (f"  (rank {rank}: {pipe.rank_time_ms[rank]:.4g} ms/mb, peak "
                        f"{pipe.rank_memory_gib[rank]:.3g} GiB)")
            lines.append(f"    stage {stage} on rank {rank}: {stage_text(fqns)}{cost}")
        return lines


def stage_text(fqns: list[str]) -> str:
    """A stage's modules, consecutive blocks folded: ``tok_embeddings, layers.0..3``."""
    out: list[str] = []
    run: list[str] = []
    for fqn in [*fqns, ""]:
        head, _, index = fqn.rpartition(".")
        if run and index.isdigit() and run[-1].rpartition(".")[0] == head \
                and int(run[-1].rpartition(".")[2]) + 1 == int(index):
            run.append(fqn)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else f"{run[0]}..{run[-1].rpartition('.')[2]}")
        run = [fqn] if index.isdigit() else []
        if fqn and not index.isdigit():
            out.append(fqn)
    return ", ".join(out)


def _planning_time(solver: dict[str, Any]) -> str:
    if "planning_time_s" in solver:
        return f"{solver['planning_time_s']:.3f} s"
    return "not recorded"


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


def _runs(layers: list[LayerPlan]) -> list[list[LayerPlan]]:
    runs: list[list[LayerPlan]] = []
    for layer in layers:
        prev = runs[-1][0] if runs else None
        same = prev is not None and (prev.kind, prev.describe(), prev.time_ms,
                                     prev.memory_mib) \
            == (layer.kind, layer.describe(), layer.time_ms, layer.memory_mib)
        if same:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs
