"""Job-config extension merged into TorchTitan's JobConfig via ``job.custom_config_module``.

TorchTitan merges these dataclasses field by field with its own (``ConfigManager``), so TOML
sections ``[parallelism]`` and ``[autoparallel]`` and CLI flags ``--autoparallel.<key>`` work
as for any built-in option.
"""


from dataclasses import dataclass, field

from ..candidates.layout import DEFAULT_TECHNIQUES

CONFIG_MODULE = "torchtitan_autoparallel.job.config"


@dataclass
class Parallelism:
    auto: bool = False
    """Let the planner choose the mesh and per-layer placements (TorchTitan degrees set in the
    TOML or on the command line, at any value, become constraints; unset ones are searched)."""


@dataclass
class Autoparallel:
    hardware: str = ""
    """Hardware profile: a name under torchtitan_autoparallel/profiles (h100_sxm, h200_sxm,
    h100_grand_teton, a100_sxm, b200, cpu) or a path to a profile .toml. Unset: a job on a GPU
    uses the profile that names its device (or stops in one line), a CPU job ``cpu``; offline
    ``plan`` / ``predict`` plan for ``cpu`` and say so in their first line."""
    gpus_per_node: int = 0
    """Devices per node; 0 takes the profile's value. TP stays inside a node."""
    memory_gib: float = 0.0
    """Memory budget per device in GiB; 0 takes the profile's usable memory."""
    techniques: list[str] = field(
        default_factory=lambda: list(DEFAULT_TECHNIQUES)
    )
    """Techniques the search may use (restrict it to compare or to debug): fsdp, hsdp, ddp
    (replicate only, gradients all-reduced), tp
    (tensor + sequence parallel), tp_dp (a block may use the tp dim as data parallel), cp
    (context parallel), ep (expert parallel, MoE models), ac, pp (pipeline parallel: degree,
    schedule, stages per rank, micro-batches and stage split); tp_sub_block (not in the default
    list: a dense block's attention and feed-forward may each take TP + SP or the tp dim as data
    parallel, tp modes "dp/sp" and "sp/dp")."""
    pp_schedules: list[str] = field(default_factory=list)
    """Pipeline schedules the search may choose from (empty: all of TorchTitan's: 1F1B,
    Interleaved1F1B, GPipe, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV for MoE models). A
    ``parallelism.pipeline_parallel_schedule`` set in the TOML or on the command line (1F1B
    included) fixes the schedule instead."""
    pp_stages_per_rank: int = 0
    """Pipeline stages per pp rank (0: searched; 1 for 1F1B / GPipe, 2 for the V schedules,
    2-4 for the interleaved ones)."""
    time_limit_s: float = 30.0
    """Wall-clock limit for the whole search of a job: every MILP of every data-parallel degree
    and pipeline candidate together; the best plan found so far is returned with its gap."""
    pin: list[str] = field(default_factory=list)
    """Module fqn globs left to TorchTitan's own code, e.g. ``["layers.0", "layers.*.attention"]``.
    A pinned block runs TorchTitan's recipe for the job ([activation_checkpoint], FSDP
    resharding, its TP plan); a pinned region inside a block keeps TorchTitan's parallelization
    of that region. MoE routing and token dispatch are always pinned. A glob that matches no
    module is an error."""
    moe_load_imbalance: float = 0.0
    """MoE routing imbalance assumed by the cost model (busiest expert-parallel rank's tokens /
    mean); 0 takes the hardware profile's value."""
    plan_file: str = ""
    """Replay this plan instead of solving."""
    save_plan: str = ""
    """Write the plan to this path (JSON) at job start."""
    measure_memory: bool = False
    """Track tensor memory of training step 2 with PyTorch's MemTracker (parameters, gradients,
    optimizer state, activations, temporaries) and add its peak to the metrics file."""
    metrics_file: str = ""
    """If set, rank 0 appends one JSON line per step (loss, grad norm, step time, tokens/s,
    peak memory) to this file. Used by the parity tests and the experiment sweeps."""


@dataclass
class JobConfig:
    parallelism: Parallelism = field(default_factory=Parallelism)
    autoparallel: Autoparallel = field(default_factory=Autoparallel)
