"""One validation layer for every input the project reads: ``[autoparallel]`` values, hardware
profiles and plan files. Each check raises a one-line ``UserError`` naming the field and the fix,
before anything is planned, applied or saved.

Values are checked against rule tables (type, finiteness, range), one row per field; fields of
a dataclass without a row get the rule their type annotation implies (a finite number >= 0, a
bool, a string), so a new field is checked without new code, and a row makes its range exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .errors import Rule, UserError, check_fields, check_value, shown

# ---------------------------------------------------------------------------------------------
# [autoparallel] and the [training] values planning reads

AUTOPARALLEL_RULES: dict[str, Rule] = {
    "hardware": Rule(str),
    "gpus_per_node": Rule(int, ge=0),
    "memory_gib": Rule(float, ge=0),
    "techniques": Rule(list, item=str),
    "time_limit_s": Rule(float, gt=0),
    "pin": Rule(list, item=str),
    "moe_load_imbalance": Rule(float, zero_or_ge=1),
    "pp_schedules": Rule(list, item=str),
    "pp_stages_per_rank": Rule(int, ge=0, le=4),
}
"""``[autoparallel]`` fields (config.py). Fields without a row: their annotation's type."""

TRAINING_RULES: dict[str, Rule] = {
    "seq_len": Rule(int, ge=1),
    "local_batch_size": Rule(int, ge=1),
    "global_batch_size": Rule(int),
    "mixed_precision_param": Rule(str, choices=("float32", "bfloat16", "float16")),
    "mixed_precision_reduce": Rule(str, choices=("float32", "bfloat16", "float16")),
}


def check_model_name(name: Any) -> None:
    """``model.name`` names a registered TorchTitan train spec."""
    from torchtitan.models import _supported_models
    from torchtitan.protocols import train_spec

    names = sorted(set(_supported_models) | set(train_spec._extra_train_specs))
    if not isinstance(name, str) or name not in names:
        raise UserError(f"model.name = {shown(name)} is not a registered model: use one of "
                        f"{names}")


def check_job_options(job_config: Any) -> None:
    """``[autoparallel]`` values and the ``[training]`` values planning reads."""
    from .config import Autoparallel

    check_model_name(job_config.model.name)

    ap = job_config.autoparallel
    from .cost.hardware import HardwareProfile

    values = {f.name: getattr(ap, f.name) for f in dataclasses.fields(Autoparallel)
              if hasattr(ap, f.name)}
    if isinstance(values.get("hardware"), HardwareProfile):
        values.pop("hardware")  # a loaded profile handed in by recost / the profile fitter
    check_fields("autoparallel.", values, Autoparallel, AUTOPARALLEL_RULES)
    if not ap.hardware:
        raise UserError("autoparallel.hardware is empty: name a profile (cpu, h100_sxm, ...) or "
                        "a profile .toml path")
    training = job_config.training
    for key, rule in TRAINING_RULES.items():
        if hasattr(training, key):
            check_value("training.", key, getattr(training, key), rule)
    gbs = training.global_batch_size
    if gbs == 0 or gbs < -1:
        raise UserError(f"training.global_batch_size = {gbs} is invalid: use a positive number "
                        "of sequences, or -1 for local_batch_size x the data-parallel degree")


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
    "kind": Rule(str, choices=("embedding", "block", "output")),
    "ac": Rule(str, choices=("none", "selective", "full")),
    "reshard_after_forward": Rule(bool),
    "tp_mode": Rule(str, choices=("none", "sp", "dp")),
    "ep": Rule(int, ge=1),
    "pinned": Rule(bool),
}
PREDICTED_KEYS = ("step_time_s", "tokens_per_s", "peak_memory_gib", "state_memory_gib",
                  "budget_gib")
SOLVER_KEYS = ("status", "gap", "milps_solved", "candidates", "variables", "constraints")
FINGERPRINT_KEYS = ("model", "flavor", "seq_len", "global_batch_size", "world_size")


def check_plan_data(data: Any, source: str) -> None:
    """Schema, types and ranges of a plan's JSON data (before a Plan is built from it)."""
    from .plan import LayerPlan, Mesh, Plan

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
        from .plan import Pipeline

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
    for key in SOLVER_KEYS:
        if key not in data["solver"]:
            raise UserError(f"{where}solver lacks {key!r}; {PLAN_FIX}")
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
    if plan.seq_len != plan.fingerprint.get("seq_len"):
        raise UserError(f"{where}seq_len {plan.seq_len} differs from its fingerprint's "
                        f"{plan.fingerprint.get('seq_len')}; {PLAN_FIX}")
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


def pipeline_problem(plan: Any) -> str:
    """Why the plan's pipeline cannot run as TorchTitan 0.2.2 builds it (empty if it can):
    schedule rules, micro-batch arithmetic, and stages of consecutive layers that cover the
    model once, the first with the embedding and the last with the output."""
    from .schedules import SCHEDULES, SINGLE_STAGE, V_SCHEDULES, microbatch_ok

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


def mesh_problems(m: Any) -> list[str]:
    """Why TorchTitan 0.2.2 cannot build ``m`` (empty if it can)."""
    out = []
    if m.etp not in (1, m.tp):
        out.append(f"etp {m.etp} must be 1 or tp ({m.tp})")
    if m.ep == 1 and m.etp != 1:
        out.append("etp > 1 needs ep > 1")
    if m.ep > 1 and (m.dp_shard * m.cp * m.tp) % (m.ep * m.etp):
        out.append(f"ep x etp ({m.ep} x {m.etp}) must divide dp_shard x cp x tp")
    return out


def layer_problem(layer: Any, m: Any, microbatch: int) -> str:
    """Why ``layer``'s strategy is illegal on mesh ``m`` (empty if it is legal)."""
    if layer.ep not in (1, m.ep):
        return f"ep {layer.ep} must be 1 or the mesh's ep ({m.ep})"
    if m.tp == 1:
        return "" if layer.tp_mode == "none" else f"tp_mode {layer.tp_mode!r} needs tp > 1"
    if layer.tp_mode == "dp" and m.pp > 1:
        return "tp_mode 'dp' is not planned with pipeline parallelism; use 'sp'"
    if layer.tp_mode == "none":
        return ("tp_mode 'none' on a tp mesh leaves its parameters plain tensors next to "
                "DTensors (the optimizer step fails): use 'sp' or 'dp'")
    if layer.tp_mode == "dp":
        if layer.kind != "block":
            return "tp_mode 'dp' applies to blocks only; use 'sp'"
        if m.dp_shard == 1 or m.dp_replicate > 1 or m.cp > 1:
            return "tp_mode 'dp' needs dp_shard > 1, dp_replicate = 1 and cp = 1; use 'sp'"
        if microbatch % m.tp:
            return f"tp_mode 'dp' needs local_batch_size divisible by tp ({m.tp}); use 'sp'"
    return ""


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
