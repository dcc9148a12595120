"""The Plan: plain, versioned data that says how to parallelize one job; JSON in and out, and
the checks every plan passes when it is read or saved (schema, consistency, legality)."""

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..candidates.layout import (
    AC_MODES,
    EMBEDDING_MODES,
    FSDP_UNIT_SIZES,
    MOE_SUB_BLOCK_MODES,
    SUB_BLOCK_TP_MODES,
    TP_MODES,
    Mesh,
    embedding_dim_problem,
    ep_problem,
    fsdp_unit_problem,
    node_reshard_problem,
    reshard_group,
    strategy_label,
    strategy_parts,
    stream_of,
    stream_problem,
    sub_block_modes,
    tp_dp_params,
    tp_dp_problem,
)
from ..candidates.schedules import SCHEDULES, SINGLE_STAGE, V_SCHEDULES, microbatch_ok
from ..errors import Rule, UserError, atomic_write, check_fields, check_value, read_input, shown

SCHEMA_VERSION = 2
"""2: the plan stores its resolved planning inputs (``Plan.inputs``). 1 is still read (the
command line warns): where its inputs are needed they are rebuilt from the fingerprint and the
hardware profile it names (``recost.inputs_from_plan``)."""
READABLE_VERSIONS = (1, SCHEMA_VERSION)
MAX_PLAN_BYTES = 16 << 20
"""A plan of the largest model on 1024 ranks is well under 1 MiB."""
VOLATILE_SOLVER_KEYS = ("solve_time_s", "planning_time_s", "planning_time_within_s")
"""Wall-clock measurements: shown in the table and logs, never written to plan files, so that
the same inputs give a byte-identical file on any machine and under any load."""


@dataclass
class LayerPlan:
    fqn: str
    kind: str
    """"embedding", "encoder" (a vision encoder feeding the embedding), "block" or
    "output"."""
    ac: str = "none"
    """Activation checkpointing: none / selective / full."""
    reshard_after_forward: bool | int = True
    """FSDP2's ``reshard_after_forward``: True, False, or the group size to reshard to (the
    ranks of one node; see ``layout.reshard_group``)."""
    tp_mode: str = "none"
    """What the tp mesh dim does for this layer: "none" (tp = 1); "sp" = tensor parallel with
    sequence parallel (vocab-parallel + loss parallel for embedding and output); "dp" = the tp
    ranks split the micro-batch and the parameters are FSDP-sharded over dp_shard x tp; "dp/sp"
    / "sp/dp" = the attention's / the feed-forward's modes apart (``SUB_BLOCK_TP_MODES``)."""
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
    fsdp_unit: int = 1
    """Blocks in this block's FSDP unit: k consecutive blocks with the same strategy and
    ``fsdp_unit`` k, taken in order from the first, share one ``fully_shard`` call (see
    ``fsdp_units``); written to the file only when above 1."""

    def parts(self, unsharded: str = "") -> dict[str, str]:
        """This layer's strategy by aspect (see ``strategy_parts``)."""
        return strategy_parts(self.ac, self.reshard_after_forward, self.tp_mode, self.ep,
                              self.pinned, unsharded, self.fsdp_unit)

    def describe(self, unsharded: str = "", stream: int | None = 1) -> str:
        """This layer's strategy label (see ``strategy_label``; ``stream``: the plan's
        ``Plan.stream``)."""
        return strategy_label(self.ac, self.reshard_after_forward, self.tp_mode, self.ep,
                              self.pinned, unsharded, self.fsdp_unit, stream)


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
    float8_filter_fqns: list[str] | None = None
    """``quantize.linear.float8.filter_fqns`` the plan runs with: the linears it keeps in bf16
    because float8 is predicted slower there (None: the job does not let the planner choose,
    as without float8 or with filter_fqns set)."""
    inputs: dict[str, Any] | None = None
    """The resolved planning inputs (hardware profile contents, budget, precision, constraints,
    features, pins, ...: ``assembly.inputs_record``), so the plan can be explained, compared
    and costed again without its config or profile file. None in version-1 files."""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in VOLATILE_SOLVER_KEYS:
            data["solver"].pop(key, None)
        if data["inputs"] is None:
            del data["inputs"]  # a version-1 plan is written back as it was read
        if data["pipeline"] is None:
            del data["pipeline"]  # plans without pp keep their files (and digests)
        if data["float8_filter_fqns"] is None:
            del data["float8_filter_fqns"]  # likewise plans without the float8 choice
        for layer in data["layers"]:
            if layer["fsdp_unit"] == 1:
                del layer["fsdp_unit"]  # and blocks in FSDP units of their own
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
        raw = read_input(path, "plan file", MAX_PLAN_BYTES)
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # JSON, UTF-8 and NaN errors
            raise UserError(f"plan file {path} is corrupted or not a plan "
                            f"({shown(exc, 200)})") from exc
        return cls.from_dict(data, path)

    def save(self, path: str) -> None:
        """Validate, then write atomically: a temp file in the target's folder renamed over
        it, removed on any failure, so nothing half-written is ever left behind."""
        check_plan(self, path)
        atomic_write(path, self.to_json(), "plan")

    @property
    def stream(self) -> int | None:
        """The residual stream's layout over tp (``layout.stream_of`` its blocks' tp modes)."""
        return stream_of(layer.tp_mode for layer in self.layers if layer.kind == "block")

    @property
    def embedding_mode(self) -> str:
        """The embedding's mode where not the mesh's default ("": ``edge_strategy``'s)."""
        return next((layer.tp_mode for layer in self.layers
                     if layer.kind == "embedding" and layer.tp_mode in EMBEDDING_MODES), "")

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
            f"  model: {self.fingerprint.get('model')} flavor "
            f"{self.fingerprint.get('flavor')}, hardware {self.fingerprint.get('hardware')!r}",
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
            *self._float8_lines(),
            *(f"  {note}" for note in self.notes if note not in self.untabled_notes),
        ]
        rows = []
        for group in _runs(self.layers):
            first, last = group[0], group[-1]
            name = first.fqn if first is last else f"{first.fqn}..{last.fqn.split('.')[-1]}"
            rows.append((name, first.describe(self.mesh.unsharded_label, self.stream), first,
                         len(group)))
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


    def _float8_lines(self) -> list[str]:
        """Which linears the plan keeps in bf16 where it chose them (float8 elsewhere)."""
        if self.float8_filter_fqns is None:
            return []
        kept = self.float8_filter_fqns
        return [f"  float8: kept in bf16 (float8 predicted slower): {', '.join(kept)}; every "
                "other linear runs float8 (quantize.linear.float8.filter_fqns, chosen)"]

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


# ---------------------------------------------------------------------------------------------
# plan files

PLAN_FIX = "re-plan the job (python -m torchtitan_autoparallel plan ... --out PLAN)"

PLAN_RULES: dict[str, Rule] = {
    "version": Rule(int),
    "fingerprint": Rule(dict),
    "mesh": Rule(dict),
    "global_batch_size": Rule(int, ge=1),
    "local_batch_size": Rule(int, ge=1),
    "gradient_accumulation_steps": Rule(int, ge=1),
    "seq_len": Rule(int, ge=1),
    "layers": Rule(list, item=dict),
    "predicted": Rule(dict),
    "solver": Rule(dict),
    "notes": Rule(list, item=str),
    "inputs": Rule(dict, optional=True),
    "float8_filter_fqns": Rule(list, item=str, optional=True),
    "pipeline": Rule(dict, optional=True),
}
MESH_RULES: dict[str, Rule] = {k: Rule(int, ge=1)
                               for k in ("dp_replicate", "dp_shard", "tp", "cp", "ep", "etp",
                                         "pp")}
PIPELINE_RULES: dict[str, Rule] = {
    "schedule": Rule(str),
    "stages_per_rank": Rule(int, ge=1),
    "microbatches": Rule(int, ge=1),
    "microbatch_size": Rule(int, ge=1),
    "stages": Rule(list, item=list),
    "bubble_fraction": Rule(float, ge=0, le=1),
    "rank_time_ms": Rule(list, item=float),
    "rank_memory_gib": Rule(list, item=float),
    "rank_state_gib": Rule(list, item=float),
}
LAYER_RULES: dict[str, Rule] = {
    "fqn": Rule(str),
    "kind": Rule(str, choices=("embedding", "encoder", "block", "output")),
    "ac": Rule(str, choices=AC_MODES),
    "reshard_after_forward": Rule(bool, or_int_ge=2),
    "tp_mode": Rule(str, choices=("none", *TP_MODES, *SUB_BLOCK_TP_MODES,
                                       *MOE_SUB_BLOCK_MODES, *EMBEDDING_MODES)),
    "ep": Rule(int, ge=1),
    "pinned": Rule(bool),
    "fsdp_unit": Rule(int, ge=1),
}
PREDICTED_KEYS = ("step_time_s", "tokens_per_s", "peak_memory_gib", "state_memory_gib",
                  "budget_gib")
SOLVER_KEYS = {"status": Rule(str), "gap": Rule(float, ge=0), "milps_solved": Rule(int, ge=0),
               "candidates": Rule(int, ge=0), "variables": Rule(int, ge=0),
               "constraints": Rule(int, ge=0)}
FINGERPRINT_KEYS = ("model", "flavor", "seq_len", "global_batch_size", "world_size")
RECORD_KEYS = ("model", "flavor", "seq_len", "global_batch_size", "world_size", "gpus_per_node")
"""What a plan's stored inputs and its fingerprint both say, and must say alike."""


def check_plan_data(data: Any, source: str) -> None:
    """Schema, types and ranges of a plan's JSON data (before a Plan is built from it)."""
    where = f"plan {source}: "
    if not isinstance(data, dict):
        raise UserError(f"{where}not a plan (a JSON object is expected, got "
                        f"{type(data).__name__}); {PLAN_FIX}")
    missing = [f.name for f in dataclasses.fields(Plan)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               and f.name not in data]
    if missing:
        raise UserError(f"{where}missing field {missing[0]!r}; {PLAN_FIX}")
    check_fields(where, data, Plan, PLAN_RULES, PLAN_FIX)
    check_fields(f"{where}mesh.", data["mesh"], Mesh, MESH_RULES, PLAN_FIX)
    if data.get("pipeline") is not None:
        pipe = data["pipeline"]
        missing = [f.name for f in dataclasses.fields(Pipeline)
                   if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING and f.name not in pipe]
        if missing:
            raise UserError(f"{where}pipeline lacks {missing[0]!r}; {PLAN_FIX}")
        check_fields(f"{where}pipeline.", pipe, Pipeline, PIPELINE_RULES, PLAN_FIX)
        if not all(isinstance(f, str) for stage in pipe["stages"] for f in stage):
            raise UserError(f"{where}pipeline.stages must be lists of module names; {PLAN_FIX}")
    if not data["layers"]:
        raise UserError(f"{where}has no layers; {PLAN_FIX}")
    for i, layer in enumerate(data["layers"]):
        if "fqn" not in layer or "kind" not in layer:
            raise UserError(f"{where}layers[{i}] lacks 'fqn' or 'kind'; {PLAN_FIX}")
        check_fields(f"{where}layers[{i}].", layer, LayerPlan, LAYER_RULES, PLAN_FIX)
    for key in PREDICTED_KEYS:
        check_value(f"{where}predicted.", key, data["predicted"].get(key), Rule(float, ge=0),
                    PLAN_FIX)
    for key, rule in SOLVER_KEYS.items():
        if key not in data["solver"]:
            raise UserError(f"{where}solver lacks {key!r}; {PLAN_FIX}")
        check_value(f"{where}solver.", key, data["solver"][key], rule, PLAN_FIX)
    for key in FINGERPRINT_KEYS:
        if key not in data["fingerprint"]:
            raise UserError(f"{where}fingerprint lacks {key!r}; {PLAN_FIX}")


def check_plan(plan: Any, source: str) -> None:
    """A plan's own consistency: batch arithmetic, unique layers, strategies legal on its
    mesh (what ``apply_plan`` and the optimizer step accept)."""
    where = f"plan {source}: "
    m = plan.mesh
    if m.world != plan.fingerprint.get("world_size"):
        raise UserError(f"{where}mesh {m} multiplies to {m.world}, not the world size "
                        f"{plan.fingerprint.get('world_size')} it was made for; {PLAN_FIX}")
    if plan.global_batch_size != plan.local_batch_size * m.dp * plan.gradient_accumulation_steps:
        raise UserError(
            f"{where}global_batch_size {plan.global_batch_size} != local_batch_size "
            f"{plan.local_batch_size} x dp {m.dp} x gradient_accumulation_steps "
            f"{plan.gradient_accumulation_steps}; {PLAN_FIX}")
    for key, value in (("seq_len", plan.seq_len),
                       ("global_batch_size", plan.global_batch_size)):
        if value != plan.fingerprint.get(key):
            raise UserError(f"{where}{key} {value} differs from its fingerprint's "
                            f"{shown(plan.fingerprint.get(key))} (the job's); {PLAN_FIX}")
    if plan.inputs is not None:
        for key in RECORD_KEYS:
            if plan.inputs.get(key) != plan.fingerprint.get(key):
                raise UserError(f"{where}inputs.{key} {shown(plan.inputs.get(key))} differs "
                                f"from its fingerprint's {shown(plan.fingerprint.get(key))}; "
                                f"{PLAN_FIX}")
    fqns = [layer.fqn for layer in plan.layers]
    dup = next((f for f in fqns if fqns.count(f) > 1), None)
    if dup is not None:
        raise UserError(f"{where}layer {shown(dup)} appears more than once; {PLAN_FIX}")
    for problem in mesh_problems(m):
        raise UserError(f"{where}mesh {m}: {problem}; {PLAN_FIX}")
    problem = pipeline_problem(plan)
    if problem:
        raise UserError(f"{where}{problem}; {PLAN_FIX}")
    for layer in plan.layers:
        problem = layer_problem(layer, m, plan.local_batch_size)
        if problem:
            raise UserError(f"{where}{layer.fqn}: {problem}; {PLAN_FIX}")
    problem = stream_problem([layer.tp_mode for layer in plan.layers if layer.kind == "block"],
                             plan.embedding_mode)
    if problem:
        raise UserError(f"{where}{problem}; {PLAN_FIX}")
    fsdp_units(plan.layers, where)
    problem = float8_problem(plan)
    if problem:
        raise UserError(f"{where}{problem}; {PLAN_FIX}")


def float8_problem(plan: Any) -> str:
    """Why the plan's ``float8_filter_fqns`` cannot run (empty if it can): only a job with
    float8 linears and no ``filter_fqns`` of its own lets the planner choose them; with float8
    tensorwise, TorchTitan's float8 TP styles need every linear of a TP + SP block converted,
    so no entry may match inside one."""
    if plan.float8_filter_fqns is None:
        return ""
    features = (plan.inputs if plan.inputs is not None else plan.fingerprint).get(
        "features") or {}
    linear = features.get("linear", "none")
    if not str(linear).startswith("float8"):
        return ("float8_filter_fqns is set, but the job runs no float8 linears "
                "(model.converters without quantize.linear.float8): remove the field")
    if features.get("float8_filter") is not None:
        return ("float8_filter_fqns is set, but the job sets quantize.linear.float8."
                "filter_fqns itself: remove the field (the job's list is what runs)")
    if not plan.float8_filter_fqns or linear != "float8_tensorwise" or plan.mesh.tp == 1:
        return ""
    sp = [layer.fqn for layer in plan.layers
          if layer.kind == "block" and "sp" in sub_block_modes(layer.tp_mode)]
    blocks = {layer.fqn for layer in plan.layers if layer.kind == "block"}
    for entry in plan.float8_filter_fqns:
        relative = not any(entry.startswith(f"{fqn}.") for fqn in blocks)
        if any(entry.startswith(f"{fqn}.") for fqn in sp) or (relative and sp and entry not in
                                                              {x.fqn for x in plan.layers}):
            return (f"float8_filter_fqns entry {shown(entry)} keeps a linear of a TP + SP block "
                    "in bf16, which TorchTitan's float8 tensorwise TP styles cannot shard")
    return ""


def pipeline_problem(plan: Any) -> str:
    """Why the plan's pipeline cannot run as TorchTitan 0.2.2 builds it (empty if it can):
    schedule rules, micro-batch arithmetic, and stages of consecutive layers that cover the
    model once, the first with the embedding and the last with the output."""
    m, pipe = plan.mesh, plan.pipeline
    if pipe is None:
        return "mesh pp > 1 needs a pipeline section" if m.pp > 1 else ""
    if m.pp == 1:
        return "a pipeline section needs mesh pp > 1"
    if pipe.schedule not in SCHEDULES:
        return f"pipeline.schedule {shown(pipe.schedule)} is not one of {list(SCHEDULES)}"
    v = pipe.stages_per_rank
    if (pipe.schedule in SINGLE_STAGE and v != 1) or (pipe.schedule in V_SCHEDULES and v != 2) \
            or (pipe.schedule not in SINGLE_STAGE and v < 2):
        return f"pipeline.stages_per_rank {v} does not suit schedule {pipe.schedule}"
    if not microbatch_ok(pipe.schedule, m.pp, v, pipe.microbatches):
        return (f"pipeline.microbatches {pipe.microbatches} does not suit {pipe.schedule} on "
                f"pp {m.pp} (at least pp; a multiple of pp when interleaved; 2 pp for V shapes)")
    if plan.local_batch_size != pipe.microbatches * pipe.microbatch_size:
        return (f"local_batch_size {plan.local_batch_size} != pipeline.microbatches "
                f"{pipe.microbatches} x microbatch_size {pipe.microbatch_size}")
    if len(pipe.stages) != m.pp * v:
        return f"pipeline.stages has {len(pipe.stages)} stages, not pp x stages_per_rank"
    if any(not stage for stage in pipe.stages):
        return "pipeline.stages has an empty stage"
    order = [layer.fqn for layer in plan.layers]
    flat = [fqn for stage in pipe.stages for fqn in stage if fqn in order]
    if flat != order:
        return "pipeline.stages must hold every planned layer once, in model order"
    kinds = {layer.fqn: layer.kind for layer in plan.layers}
    if kinds[pipe.stages[0][0]] != "embedding" or kinds.get(pipe.stages[-1][-1]) != "output":
        return "pipeline.stages must start with the embedding and end with the output"
    return ""


def mesh_problems(m: Mesh) -> list[str]:
    """Why TorchTitan cannot build ``m`` (empty if it can): the search's own expert-layout
    rule, ``ep_problem``."""
    problem = ep_problem(m)
    return [problem] if problem else []


def layer_problem(layer: Any, m: Any, microbatch: int) -> str:
    """Why ``layer``'s strategy is illegal on mesh ``m`` (empty if it is legal)."""
    if layer.ep not in (1, m.ep):
        return f"ep {layer.ep} must be 1 or the mesh's ep ({m.ep})"
    if layer.tp_mode in EMBEDDING_MODES:
        return (embedding_dim_problem(m, tp_mode=layer.tp_mode) if layer.kind == "embedding"
                else f"tp_mode {layer.tp_mode!r} is the embedding's alone")
    node = reshard_group(layer.reshard_after_forward)
    problem = node and node_reshard_problem(m, layer.tp_mode, node, layer.kind, layer.ep > 1)
    if problem:
        return problem
    if layer.fsdp_unit not in (1, *FSDP_UNIT_SIZES):
        sizes = (1, *FSDP_UNIT_SIZES)
        return (f"fsdp_unit {layer.fsdp_unit}: FSDP units are "
                f"{', '.join(map(str, sizes[:-1]))} or {sizes[-1]} consecutive blocks")
    if layer.fsdp_unit > 1:
        problem = fsdp_unit_problem(m, layer.tp_mode, layer.kind)
        if problem:
            return f"fsdp_unit {layer.fsdp_unit}: {problem}"
    if m.tp == 1:
        return "" if layer.tp_mode == "none" else f"tp_mode {layer.tp_mode!r} needs tp > 1"
    if layer.tp_mode == "none":
        return ("tp_mode 'none' on a tp mesh leaves its parameters plain tensors next to "
                "DTensors (the optimizer step fails): use 'sp' or 'dp'")
    if layer.tp_mode != "sp":  # "dp" and the sub-block modes
        return tp_dp_problem(m, microbatch, layer.kind, layer.tp_mode)
    return ""


def fsdp_units(layers: list[LayerPlan], where: str = "plan: ") -> list[list[LayerPlan]]:
    """The plan's blocks grouped into FSDP units, in order: a block with ``fsdp_unit`` k
    starts a unit of itself and the k - 1 blocks after it, which must have its strategy and
    ``fsdp_unit``; raises UserError (``where`` first) when they do not."""
    blocks = [layer for layer in layers if layer.kind == "block"]
    units: list[list[LayerPlan]] = []
    i = 0
    while i < len(blocks):
        first = blocks[i]
        unit = blocks[i:i + first.fsdp_unit]
        if len(unit) < first.fsdp_unit or any(
                b.describe() != first.describe() or b.fsdp_unit != first.fsdp_unit
                for b in unit):
            raise UserError(f"{where}{first.fqn} starts an FSDP unit of {first.fsdp_unit} "
                            f"blocks: the {first.fsdp_unit - 1} blocks after it must have its "
                            f"strategy and fsdp_unit; {PLAN_FIX}")
        units.append(unit)
        i += first.fsdp_unit
    return units


def check_plan_for_job(plan: Any, world: int, layers: list[tuple[str, str]],
                       source: str) -> None:
    """The plan against the job: mesh x world, and its layers = the model's (fqn, kind)."""
    if plan.mesh.world != world:
        raise UserError(f"plan {source}: mesh {plan.mesh} multiplies to {plan.mesh.world}, the "
                        f"job has {world} ranks; {PLAN_FIX}")
    have = [(layer.fqn, layer.kind) for layer in plan.layers]
    if have != layers:
        extra = [x for x in have if x not in layers] + [x for x in layers if x not in have]
        detail = f"e.g. {shown(extra[0])}" if extra else "in another order"
        raise UserError(f"plan {source}: its layers are not the model's ({len(have)} planned, "
                        f"{len(layers)} in the model; {detail}); {PLAN_FIX}")


def plan_shards_with_fsdp(plan: Plan) -> bool:
    """Whether ``apply_plan`` calls ``fully_shard`` for ``plan`` (FSDP over dp_shard / cp, EP's
    expert sharding, or blocks using tp as data parallel)."""
    m = plan.mesh
    return (m.dp_shard > 1 or m.cp > 1 or m.ep > 1
            or any(tp_dp_params(layer.tp_mode) for layer in plan.layers))
