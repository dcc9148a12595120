"""Job-config extension merged into TorchTitan's JobConfig via ``job.custom_config_module``.

TorchTitan merges these dataclasses field by field with its own (``ConfigManager``), so TOML
sections ``[parallelism]`` and ``[autoparallel]`` and CLI flags ``--autoparallel.<key>`` work
as for any built-in option.
"""


from dataclasses import dataclass, field

CONFIG_MODULE = "torchtitan_autoparallel.config"


@dataclass
class Parallelism:
    auto: bool = False
    """Let the planner choose the mesh and per-layer placements (TorchTitan degrees become
    constraints)."""


@dataclass
class Autoparallel:
    metrics_file: str = ""
    """If set, rank 0 appends one JSON line per step (loss, grad norm, step time, tokens/s,
    peak memory) to this file. Used by the parity tests and the experiment sweeps."""


@dataclass
class JobConfig:
    parallelism: Parallelism = field(default_factory=Parallelism)
    autoparallel: Autoparallel = field(default_factory=Autoparallel)
