"""A TorchTitan job config -> the planning inputs (layer graph, constraints, hardware profile,
budget, batch, precision, pins, features, fingerprint), with every config error the planner
raises. Offline: no process group, no device."""

import contextlib
import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator
from typing import Any

from .. import __version__
from ..candidates.exclusions import without_excluded
from ..candidates.layout import (
    AC_MODES,
    DP_SHARD_TP_MODES,
    GIB,
    SUB_BLOCK_TP_MODES,
    TECHNIQUES,
    a2a_mode,
)
from ..candidates.strategies import Constraints
from ..cost.hardware import CPU_PROFILE, HardwareProfile, load_profile
from ..cost.model import Precision
from ..errors import UserError, shown
from ..frontend import frontend
from ..graph.layer_graph import Layer, LayerGraph
from ..plan.assembly import (
    JobInputs,
)
from .explicit import release_fixed, user_set
from .features import Features, features_from_config
from .model_config import (
    ModelConfig,
    config_identity,
    model_config_of,
)
from .pins import Pin, recipe_block_ac, recipe_from_config, recipe_of, resolve_pins
from .validate import check_job_options

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


DEGREE_KEYS = {"dp_replicate": "data_parallel_replicate_degree",
               "dp_shard": "data_parallel_shard_degree", "tp": "tensor_parallel_degree",
               "cp": "context_parallel_degree", "ep": "expert_parallel_degree",
               "etp": "expert_tensor_parallel_degree", "pp": "pipeline_parallel_degree"}
"""Mesh dims (``Constraints`` fields) and their ``[parallelism]`` keys."""


def _fixed(job_config: Any, key: str) -> bool:
    """Whether ``parallelism.<key>`` is a constraint: the user set it (TOML or command line),
    whatever its value; an unset key is searched."""
    return user_set(job_config, f"parallelism.{key}")


def constraint_keys(job_config: Any) -> list[str]:
    """The ``[parallelism]`` keys the search takes as constraints, as ``key = value``."""
    par = job_config.parallelism
    keys = [*DEGREE_KEYS.values(), "pipeline_parallel_schedule",
            "pipeline_parallel_microbatch_size", "fsdp_reshard_after_forward"]
    fixed = [f"parallelism.{key} = {getattr(par, key)!r}" for key in keys
             if _fixed(job_config, key) and f"parallelism.{key}" not in release_fixed(job_config)
             and not (key == "data_parallel_shard_degree" and getattr(par, key) == -1)]
    if user_set(job_config, "activation_checkpoint.mode"):
        fixed.append(f"activation_checkpoint.mode = {job_config.activation_checkpoint.mode!r}")
    return fixed


def ac_constraints(job_config: Any, constraints: Constraints, graph: LayerGraph,
                   pins: dict[str, Pin]) -> tuple[Constraints, dict[str, Pin]]:
    """``activation_checkpoint.mode`` set by the user (even to "none") is every searched
    block's AC mode; unset, the mode is searched per block. Whole-block pins run TorchTitan's
    recipe from the same keys. Layer-wise selective AC (an integer ``selective_ac_option`` k)
    fixes each searched block's mode as TorchTitan's recipe does (every k-th block full, the
    others none; ``Pin.ac``), the rest of each block's strategy still searched."""
    if not user_set(job_config, "activation_checkpoint.mode"):
        return constraints, pins
    ac = job_config.activation_checkpoint
    searched = [i for i, b in enumerate(graph.blocks)
                if not (b.fqn in pins and pins[b.fqn].whole)]
    if not searched:
        return constraints, pins
    modes = (ac.mode,)
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        option = str(ac.selective_ac_option)
        fixed = {i: recipe_block_ac(ac.mode, option, i) for i in searched}
        modes = tuple(m for m in AC_MODES if m in fixed.values())
        pins = dict(pins)
        for i, mode in fixed.items():
            fqn = graph.blocks[i].fqn
            pins[fqn] = dataclasses.replace(pins.get(fqn, Pin()), ac=mode)
    if "ac" not in constraints.techniques and set(modes) != {"none"}:
        raise UserError(
            f"activation_checkpoint.mode = {ac.mode!r} checkpoints blocks, and "
            f"autoparallel.techniques = {list(constraints.techniques)} leaves out 'ac': add "
            "'ac' to autoparallel.techniques, or leave activation_checkpoint.mode unset")
    missing = [m for m in modes if m not in constraints.ac_modes]
    if missing:
        raise UserError(
            f"activation_checkpoint.mode = {ac.mode!r} (AC {missing[0]!r}): model "
            f"{graph.family!r} can run {list(constraints.ac_modes)} (see the plan's "
            "exclusions); set one of them or leave mode unset")
    return dataclasses.replace(constraints, ac_modes=modes), pins


def constraints_from_config(job_config: Any, features: Features) -> Constraints:
    """Degrees the user set in [parallelism] become constraints, even at TorchTitan's default
    value (and what the job's ``features`` require of the mesh); unset ones are searched;
    unsupported ones are errors."""
    par = job_config.parallelism
    techniques = tuple(job_config.autoparallel.techniques)
    unknown = sorted(set(techniques) - set(TECHNIQUES))
    if unknown:
        raise UserError(
            f"autoparallel.techniques has unknown entries {unknown}; allowed: {list(TECHNIQUES)}"
        )
    if "tp_sub_block" in techniques and features.compile:
        raise UserError("autoparallel.techniques has tp_sub_block, which is not applied to "
                        "compiled blocks yet: leave it out or turn compile off")
    for dim, key in DEGREE_KEYS.items():
        degree = getattr(par, key)
        if isinstance(degree, int) and not (degree >= 1 or (dim == "dp_shard" and degree == -1)):
            free = " or -1 (the remaining ranks)" if dim == "dp_shard" else ""
            raise UserError(f"parallelism.{key} = {degree} is invalid: use 1 (none), a degree "
                            f"that divides the world size{free}, or leave it unset (searched "
                            "under auto)")
    degrees = {dim: getattr(par, key) if _fixed(job_config, key) else 0
               for dim, key in DEGREE_KEYS.items() if dim != "pp"}
    if degrees["dp_shard"] == -1:
        degrees["dp_shard"] = 0  # TorchTitan's "the remaining ranks": searched
    if features.grouped_mm != "none":
        degrees["cp"] = 1  # TorchTitan's low-precision grouped GEMMs run with cp = 1 only
    return Constraints(
        **degrees,
        reshard_after_forward=features.reshard_after_forward,
        node_reshard=frontend().node_reshard,
        # A2A's output projection and DP_SHARD_TP's feed-forward run as plain linears: not
        # with low-precision linears
        sub_block_modes=tuple(m for m in frontend().sub_block_modes
                              if not (plain_linears(m) and features.linear != "none")),
        moe_sub_block_modes=frontend().moe_sub_block_modes,
        embedding_dim=frontend().embedding_dim,
        # TorchTitan 0.3.0's parallelism.enable_sequence_parallel (0.2.2 has no such key)
        sequence_parallel=bool(getattr(par, "enable_sequence_parallel", True)),
        fsdp_required=features.cpu_offload,
        **pipeline_constraints(job_config, features, techniques),
    )


def plain_linears(tp_mode: str) -> bool:
    """Whether ``tp_mode`` runs some linears with a style of its own, as plain linears (the
    ``A2A_MODES``' output projection, the ``DP_SHARD_TP_MODES``' feed-forward)."""
    return a2a_mode(tp_mode) or tp_mode in DP_SHARD_TP_MODES


def sub_block_notes(constraints: Constraints, features: Features) -> list[str]:
    """The plan note of a ``tp_sub_block`` search that leaves out a sub-block mode the
    release applies, for the job's features: ``plain_linears`` modes, not with low-precision
    linears (``job_constraints``)."""
    if "tp_sub_block" not in constraints.techniques:
        return []
    dropped = [mode for mode in frontend().sub_block_modes
               if mode not in constraints.sub_block_modes]
    if not dropped:
        return []
    return [f"autoparallel.techniques: tp_sub_block searched without "
            f"{', '.join(map(repr, dropped))}: they run their own linears (the attention output "
            f"projection, the feed-forward over dp_shard) as plain linears, not "
            f"{features.linear} ones"]


EARLY_STEP_EXCLUDES = ("ddp", "pp", "ep")
"""Techniques ``optimizer.early_step_in_backward`` rules out: DDP all-reduces a gradient after
the optimizer has stepped on it; TorchTitan refuses optimizers in backward with PP and EP."""


def early_step_constraints(job_config: Any, constraints: Constraints, world: int
                           ) -> Constraints:
    """``optimizer.early_step_in_backward`` steps each parameter as soon as its gradient is
    ready, so the gradient must be final then: no pure data-parallel replication (DDP), no
    gradient accumulation (the local batch is the micro-batch), no PP or EP (TorchTitan refuses
    both). A constraint on the search; fixed degrees that need one of them are errors."""
    if not job_config.optimizer.early_step_in_backward:
        return constraints
    why = ("optimizer.early_step_in_backward = true steps each parameter when its gradient is "
           "ready")
    for key, degree, name in (("pipeline_parallel_degree", constraints.pp, "PP"),
                              ("expert_parallel_degree", constraints.ep, "EP")):
        if degree > 1:
            raise UserError(f"{why}, which TorchTitan does not support with {name}: set "
                            f"parallelism.{key} = 1 or early_step_in_backward = false")
    replicate = constraints.dp_replicate
    if replicate > 1 and (constraints.dp_shard == 1 or world == replicate):
        raise UserError(f"{why}, before DDP all-reduces it: parallelism."
                        f"data_parallel_replicate_degree = {replicate} on {world} ranks leaves "
                        "only DDP; let dp_shard be > 1 (HSDP) or set early_step_in_backward = "
                        "false")
    return dataclasses.replace(
        constraints, accumulation=False,
        techniques=tuple(t for t in constraints.techniques if t not in EARLY_STEP_EXCLUDES))


def validation_constraints(job_config: Any, constraints: Constraints) -> Constraints:
    """``validation.enable``: TorchTitan's validator runs the training's pipeline schedule
    (its micro-batches) and CP buffers on the validation batches. The search leaves out PP
    (a fixed pp is checked against the plan: ``titan.v0_2.checks.check_plan_features``), and CP
    too when ``validation.seq_len`` differs from ``training.seq_len`` (fixed: an error)."""
    val = job_config.validation
    if not val.enable:
        return constraints
    seq, val_seq = job_config.training.seq_len, val.seq_len
    if val_seq != seq:
        for key, degree, name in (("context_parallel_degree", constraints.cp, "CP"),
                                  ("pipeline_parallel_degree", constraints.pp, "PP")):
            if degree > 1:
                raise UserError(
                    f"validation.enable with parallelism.{key} = {degree}: TorchTitan's "
                    f"validator runs the training's {name} layout, which "
                    f"needs validation.seq_len = training.seq_len ({val_seq} != {seq}); set "
                    f"validation.seq_len = {seq} or {key} = 1")
    excluded = {"pp"} | ({"cp"} if val_seq != seq else set())
    return dataclasses.replace(
        constraints, techniques=tuple(t for t in constraints.techniques if t not in excluded))


def pipeline_constraints(job_config: Any, features: Features, techniques: tuple[str, ...]
                         ) -> dict[str, Any]:
    """What ``[parallelism]``'s pipeline keys fix under auto (``Constraints`` fields): the
    degree, the schedule (else ``autoparallel.pp_schedules``) and the micro-batch size when
    the user set them. The stage split is the planner's: keys that would set it are errors, as
    are schedules the job cannot run."""
    from ..candidates.schedules import SCHEDULES, ZERO_BUBBLE, schedule_stages

    par, ap = job_config.parallelism, job_config.autoparallel
    pp = par.pipeline_parallel_degree  # >= 1 (constraints_from_config checks every degree)
    schedules = tuple(ap.pp_schedules)
    if _fixed(job_config, "pipeline_parallel_schedule"):
        schedule = par.pipeline_parallel_schedule
        if schedules and schedule not in schedules:
            raise UserError(f"parallelism.pipeline_parallel_schedule = {schedule!r} is not "
                            f"among autoparallel.pp_schedules {list(schedules)}: drop one")
        schedules = (schedule,)
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown and par.pipeline_parallel_schedule_csv:
        raise UserError(f"pipeline schedule {unknown[0]!r} with parallelism."
                        "pipeline_parallel_schedule_csv: auto plans TorchTitan's schedules "
                        f"{list(SCHEDULES)}, not a custom CSV schedule; remove both or set "
                        "parallelism.auto = false")
    if unknown:
        raise UserError(f"pipeline schedule {unknown[0]!r} is not one of TorchTitan's "
                        f"{list(SCHEDULES)}")
    v = ap.pp_stages_per_rank
    if v and schedules and all(v not in schedule_stages(s) for s in schedules):
        runs = "; ".join(f"{s} runs {_stages_text(schedule_stages(s))} per rank"
                         for s in schedules)
        raise UserError(f"autoparallel.pp_stages_per_rank = {v} cannot be run: {runs}; "
                        "change one or the other")
    if features.compile and schedules and all(s in ZERO_BUBBLE for s in schedules):
        raise UserError(f"pipeline schedule {schedules[0]} splits the backward, which compiled "
                        "blocks cannot: set compile.enable = false or choose 1F1B, GPipe or "
                        "Interleaved1F1B")
    if getattr(ap, "measure_memory", False):
        # MemTracker's module hooks fail in torch's split backward (autograd.grad on stage
        # inputs: "A leaf node was passed to _will_engine_execute_node"), measured on 2 ranks
        if schedules and all(s in ZERO_BUBBLE for s in schedules):
            raise UserError(f"autoparallel.measure_memory cannot measure pipeline schedule "
                            f"{schedules[0]}, which splits the backward: choose 1F1B, GPipe or "
                            "Interleaved1F1B, or drop measure_memory")
        schedules = tuple(s for s in schedules or SCHEDULES if s not in ZERO_BUBBLE)
    if (schedules == ("DualPipeV",) and par.pipeline_parallel_expert_parallel_overlap
            and user_set(job_config, "activation_checkpoint.mode")
            and job_config.activation_checkpoint.mode != "none"):
        raise UserError("pipeline schedule DualPipeV overlaps expert parallel, which TorchTitan "
                        "cannot combine with activation checkpointing: set "
                        "activation_checkpoint.mode = 'none' (auto then checkpoints no expert-"
                        "parallel block) or pipeline_parallel_expert_parallel_overlap = false")
    if pp > 1 and features.reshard_after_forward == "always":
        raise UserError("parallelism.fsdp_reshard_after_forward = 'always' with "
                        f"pipeline_parallel_degree = {pp}: under pp the stages keep "
                        "parameters across micro-batches; use 'default' or 'never'")
    mb = par.pipeline_parallel_microbatch_size
    if mb < 1:
        raise UserError(f"parallelism.pipeline_parallel_microbatch_size = {mb} is invalid: use "
                        "1 or more sequences, or leave it unset (searched under auto)")
    return {"pp": pp if _fixed(job_config, "pipeline_parallel_degree") else 0,
            "pp_schedules": schedules,
            "pp_microbatch": mb if _fixed(job_config, "pipeline_parallel_microbatch_size")
            else 0,
            "pp_stages_per_rank": v,
            "pp_ep_overlap": bool(par.pipeline_parallel_expert_parallel_overlap),
            "techniques": tuple(t for t in techniques if t != "pp" or (
                features.reshard_after_forward != "always"))}


STAGE_SPLIT_KEYS = ("module_fqns_per_model_part", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_schedule_csv")
"""``[parallelism]`` keys that set TorchTitan's stage split (the planner's choice under auto)."""


def check_stage_split_keys(job_config: Any, graph: LayerGraph, constraints: Constraints
                           ) -> None:
    """Stage-split keys set under auto are errors; where the fixed schedule could not run the
    split they ask for either, that is the reason given (as TorchTitan's ``pipeline_llm``
    computes it: ceil((blocks + first + last stage less layers) / layers per stage) stages)."""
    from ..candidates.schedules import schedule_stages

    par = job_config.parallelism
    if not par.auto:
        return
    layers = par.pipeline_parallel_layers_per_stage
    if (constraints.pp > 1 and len(constraints.pp_schedules) == 1 and layers
            and _fixed(job_config, "pipeline_parallel_layers_per_stage")):
        schedule = constraints.pp_schedules[0]
        stages = math.ceil((len(graph.blocks) + par.pipeline_parallel_first_stage_less_layers
                            + par.pipeline_parallel_last_stage_less_layers) / layers)
        per_rank = stages / constraints.pp
        if per_rank not in schedule_stages(schedule):
            raise UserError(
                f"pipeline schedule {schedule} runs {_stages_text(schedule_stages(schedule))} "
                f"per rank; parallelism.pipeline_parallel_layers_per_stage = {layers} makes "
                f"{stages} stages of {graph.family} {graph.flavor}'s {len(graph.blocks)} blocks "
                f"over pipeline_parallel_degree = {constraints.pp} ({per_rank:g} per rank). "
                "Under auto the planner chooses the stage split: remove "
                "pipeline_parallel_layers_per_stage (autoparallel.pp_stages_per_rank fixes "
                "stages per rank)")
    for key in STAGE_SPLIT_KEYS:
        if _fixed(job_config, key):
            raise UserError(f"parallelism.{key} is set with auto = true: the planner chooses "
                            "the stage split; remove it or set parallelism.auto = false")


def _stages_text(options: tuple[int, ...]) -> str:
    if len(options) == 1:
        return "one stage" if options[0] == 1 else f"{options[0]} stages"
    return f"{options[0]}-{options[-1]} stages"


def layer_graph_for(job_config: Any) -> LayerGraph:
    name, flavor = job_config.model.name, job_config.model.flavor
    model_config = model_config_of(job_config)
    config_identity(model_config)  # a missing HF config.json: one line before the model builds
    graph = model_layer_graph(name, flavor, job_config.training.seq_len, model_config)
    cp_attention = graph.cp_attention
    if job_config.parallelism.context_parallel_degree > 1 and graph.attn_type not in cp_attention:
        raise UserError(
            f"context parallel in {name} needs {' or '.join(cp_attention)} attention; {flavor} "
            f"uses {graph.attn_type!r}: set parallelism.context_parallel_degree = 1"
        )
    return graph


_REUSED_GRAPHS: dict[tuple[str, str, int, str], LayerGraph] | None = None


@contextlib.contextmanager
def reusing_layer_graphs() -> Iterator[None]:
    """Inside the block, each model, flavor and length is captured once (a plan, then its
    recipe and its re-costings, in one command)."""
    global _REUSED_GRAPHS
    _REUSED_GRAPHS = {}
    try:
        yield
    finally:
        _REUSED_GRAPHS = None


def model_layer_graph(name: str, flavor: str, seq_len: int,
                      model_config: ModelConfig | None = None) -> LayerGraph:
    """The layer graph of a model flavor at ``seq_len``, read by the installed TorchTitan's
    front-end; ``model_config``: the job's custom config sections the model args read (e.g.
    the HF backend's ``[hf_transformers]``)."""
    key = (name, flavor, seq_len, repr(model_config))
    if _REUSED_GRAPHS is not None and key in _REUSED_GRAPHS:
        return _REUSED_GRAPHS[key]
    graph = frontend().read_model(name, flavor, seq_len, model_config)
    if _REUSED_GRAPHS is not None:
        _REUSED_GRAPHS[key] = graph
    return graph


def _hardware(job_config: Any, world: int) -> tuple[HardwareProfile, int, float]:
    """The job's hardware profile (with its MoE load imbalance), devices per node and memory
    budget in bytes, each checked against the world and the device."""
    ap = job_config.autoparallel
    hw = (ap.hardware if isinstance(ap.hardware, HardwareProfile)
          else load_profile(ap.hardware or CPU_PROFILE))
    imbalance = getattr(ap, "moe_load_imbalance", 0.0)
    if job_config.debug.moe_force_load_balance:
        imbalance = 1.0  # TorchTitan routes tokens evenly over the experts
    if imbalance:
        hw = dataclasses.replace(hw, moe_load_imbalance=float(imbalance))
    gpus_per_node = ap.gpus_per_node or hw.gpus_per_node
    if world > gpus_per_node and world % gpus_per_node:
        where = (f"autoparallel.gpus_per_node = {gpus_per_node}" if ap.gpus_per_node else
                 f"hardware profile {hw.name!r} has {gpus_per_node} devices per node, which")
        raise UserError(f"{where} does not divide the world size {world}: every node holds as "
                        f"many devices; use a multiple of {gpus_per_node} devices, or set "
                        f"autoparallel.gpus_per_node (--gpus-per-node) to a divisor of {world} "
                        f"(or {world} for one node)")
    dry_run = getattr(getattr(job_config, "comm", None), "mode", "") == "fake_backend"
    if ap.memory_gib > hw.memory_gib and not dry_run:
        raise UserError(f"autoparallel.memory_gib = {ap.memory_gib:g} is more than the "
                        f"{hw.memory_gib:g} GiB of a {hw.name!r} device: set at most "
                        f"{hw.memory_gib:g} (0 takes the profile's usable "
                        f"{hw.budget_bytes / GIB:.3g} GiB), or name the hardware the job "
                        "runs on (--hardware); a dry run (COMM_MODE=fake_backend) may exceed it")
    budget = ap.memory_gib * GIB if ap.memory_gib > 0 else hw.budget_bytes
    return hw, gpus_per_node, budget


def _constraints_record(job_config: Any, constraints: Constraints, ac_option: str
                        ) -> dict[str, Any]:
    """The constraints a plan's fingerprint records: the degrees and techniques always, the
    rest only when set (other plans keep their digests)."""
    return {"dp_replicate": constraints.dp_replicate,
            "dp_shard": constraints.dp_shard, "tp": constraints.tp,
            "cp": constraints.cp, "ep": constraints.ep, "etp": constraints.etp,
            "techniques": sorted(constraints.techniques),
            **({"reshard_after_forward": constraints.reshard_after_forward}
               if constraints.reshard_after_forward != "default" else {}),
            **({"accumulation": False} if not constraints.accumulation else {}),
            **({"node_reshard": False} if not constraints.node_reshard else {}),
            **({"sub_block_modes": list(constraints.sub_block_modes)}
               if constraints.sub_block_modes != SUB_BLOCK_TP_MODES
               and "tp_sub_block" in constraints.techniques else {}),
            **({"sequence_parallel": False} if not constraints.sequence_parallel else {}),
            **({"embedding_dim": False} if not constraints.embedding_dim
               and "tp_sub_block" in constraints.techniques else {}),
            **({"ac_modes": list(constraints.ac_modes)}
               if user_set(job_config, "activation_checkpoint.mode") else {}),
            # layer-wise selective AC: every k-th searched block full (Pin.ac)
            **({"ac_layerwise": int(ac_option)} if ac_option.isdigit() else {}),
            # pipeline constraints only when set: other plans keep their digests
            **{key: list(value) if isinstance(value, tuple) else value
               for key, value in (("pp", constraints.pp),
                                  ("pp_schedules", constraints.pp_schedules),
                                  ("pp_microbatch", constraints.pp_microbatch),
                                  ("pp_stages_per_rank",
                                   constraints.pp_stages_per_rank),
                                  ("pp_ep_overlap",
                                   "off" if not constraints.pp_ep_overlap else ""))
               if value}}


def job_inputs(job_config: Any, world: int, features: Features | None = None, dp: int = 0
               ) -> JobInputs:
    """Resolve the planning inputs of ``job_config`` on ``world`` devices (validating them).
    ``features``: the job's speed features when rebuilt from a plan (default: from the
    config). ``training.global_batch_size = -1`` means local batch x data-parallel degree
    (TorchTitan's rule): ``dp`` is that degree where known (a plan's mesh), else the world
    size, and ``plan_job`` re-resolves it per data-parallel degree it searches."""
    from importlib.metadata import version

    import torch

    ap = job_config.autoparallel
    check_job_options(job_config)
    features = features or features_from_config(job_config)
    constraints = validation_constraints(job_config, early_step_constraints(
        job_config, constraints_from_config(job_config, features), world))
    hw, gpus_per_node, budget = _hardware(job_config, world)
    training = job_config.training
    global_batch = (training.global_batch_size if training.global_batch_size > 0
                    else training.local_batch_size * (dp or world))
    try:
        prec = Precision(DTYPE_BYTES[training.mixed_precision_param],
                         DTYPE_BYTES[training.mixed_precision_reduce])
    except KeyError as exc:
        raise UserError(f"unsupported mixed precision dtype {exc}") from exc
    # the model config the sections name (an HF config.json) is read and checked before the
    # model is built from it
    identity = config_identity(model_config_of(job_config))
    graph = layer_graph_for(job_config)
    check_stage_split_keys(job_config, graph, constraints)
    constraints = without_excluded(constraints, graph, world)
    recipe = recipe_from_config(job_config)
    globs = list(getattr(ap, "pin", []))
    pins = resolve_pins(graph, globs, graph.adapter.default_pins, recipe_of(recipe))
    constraints, pins = ac_constraints(job_config, constraints, graph, pins)
    ac_option = (str(job_config.activation_checkpoint.selective_ac_option)
                 if any(pin.ac for pin in pins.values()) else "")
    layers_text = json.dumps([layer_identity(layer) for layer in graph.layers])
    fingerprint = {
        "model": job_config.model.name,
        "flavor": job_config.model.flavor,
        "model_hash": hashlib.sha256(layers_text.encode()).hexdigest()[:16],
        "seq_len": graph.seq_len,
        "global_batch_size": global_batch,
        "world_size": world,
        "gpus_per_node": gpus_per_node,
        "hardware": hw.name,
        "hardware_hash": hashlib.sha256(
            json.dumps({k: v for k, v in hw.to_dict().items() if k != "provenance"},
                       sort_keys=True).encode()).hexdigest()[:16],
        "memory_budget_gib": round(budget / GIB, 6),
        "mixed_precision_param": training.mixed_precision_param,
        "mixed_precision_reduce": training.mixed_precision_reduce,
        "constraints": _constraints_record(job_config, constraints, ac_option),
        "moe_load_imbalance": hw.moe_load_imbalance,
        "pin": globs,
        "pin_recipe": recipe if any(p.whole for p in pins.values()) else {},
        "versions": {"torchtitan_autoparallel": __version__, "torch": torch.__version__,
                     "torchtitan": version("torchtitan")},
    }
    if identity:  # the custom config sections the model read (the HF config.json's hash)
        fingerprint["model_config"] = identity
    custom = getattr(getattr(job_config, "experimental", None), "custom_import", "")
    if custom:  # the user's module with the train spec and adapter (explain / diff import it)
        fingerprint["custom_import"] = custom
    if features != Features():
        # only when set: plans of eager jobs keep their files (and digests) unchanged
        fingerprint["features"] = features.to_dict()
    return JobInputs(graph, constraints, hw, gpus_per_node, budget, global_batch, prec, world,
                     fingerprint, pins, features)


def layer_identity(layer: Layer) -> list[Any]:
    """What a model's hash covers of one layer: every field, except the linears' names and TP
    styles (they only name what the shapes cost, and follow from the model) and parameter bytes
    where they restate fp32, so that models hash as they did before those were recorded (and
    their plan files stay valid)."""
    out = [getattr(layer, f.name) for f in dataclasses.fields(layer)
           if f.name not in ("linear_names", "linear_styles", "param_bytes")]
    return out + ([layer.param_bytes] if layer.param_bytes not in (0, 4 * layer.params) else [])


def fingerprint_diff(plan_fp: dict[str, Any], job_fp: dict[str, Any]) -> list[str]:
    """Readable differences ``key: plan X -> job Y`` (package versions excluded: they warn);
    within a record (the constraints, the features) only the entries that differ, as
    ``key: entry plan X -> job Y``."""
    values, records = [], []
    for k in sorted((set(plan_fp) | set(job_fp)) - {"versions"}):
        a, b = plan_fp.get(k), job_fp.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            records += [f"{k}: {line}" for line in _entries_diff(a, b)]
        elif a != b:
            values.append(f"{k}: plan {shown(a)} -> job {shown(b)}")
    causes = ("model:", "flavor:", "seq_len:", "model_config:")
    if any(line.startswith(causes) for line in values + records):
        # the model's hash follows from its name, flavor, sequence length and config
        values = [line for line in values if not line.startswith("model_hash:")]
    return values + records  # the model, world and batch first, then the records' entries


def _entries_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """``entry plan X -> job Y`` for each entry of two records that differs (nested ones as
    ``outer.inner``; an entry one side lacks shows as None)."""
    out = []
    for k in sorted(set(a) | set(b), key=str):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _entries_diff(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k} plan {shown(x)} -> job {shown(y)}")
    return out
