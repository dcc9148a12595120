"""The TorchTitan release a job is read and applied with.

Each release has one package (``titan/v0_2``: TOML + JobConfig + train specs; ``titan/v0_3``:
Python config registries + tyro + ``Trainer.Config``) that registers one ``Frontend``. The
planning pipeline (layer graph, costs, search, Plan) asks the front-end of the installed
TorchTitan for what only a release knows (its model built on meta, read into a layer graph) and
imports neither package: ``frontend()`` loads the installed release's package by name, as a
plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .candidates.layout import MOE_SUB_BLOCK_MODES, SUB_BLOCK_TP_MODES
from .errors import UserError

PACKAGES = {"0.2": "torchtitan_autoparallel.titan.v0_2",
            "0.3": "torchtitan_autoparallel.titan.v0_3"}
"""TorchTitan release (major.minor) -> the package that reads and applies its jobs."""


@dataclass(frozen=True)
class Frontend:
    """What one TorchTitan release gives the planner."""

    release: str
    """The TorchTitan release the front-end is written for ("0.2", "0.3")."""
    read_model: Callable[[str, str, int, Any], Any]
    """(model name, flavor, sequence length, the job's model config record or None) -> the
    model's ``LayerGraph``: the model built on meta and measured."""
    attention_types: Callable[[], tuple[type, ...]]
    """The release's attention modules (what context parallel wraps)."""
    moe_types: Callable[[], tuple[type, ...]]
    """The release's MoE modules (routed experts, router, shared experts)."""
    parallelize_module: Callable[[str], Any]
    """Model name -> the module defining its own parallelize function (its ``apply_tp``, SAC
    list, MoE helpers), or None."""
    model_names: Callable[[], list[str]]
    """The model names the release resolves (its families, experiments, registered ones)."""
    prepare_models: Callable[[str], None]
    """Make the release's models (and the user's module, ``experimental.custom_import``, "" for
    none) readable by ``read_model``."""
    node_reshard: bool = True
    """FSDP can reshard a block to one node's ranks after forward (an integer
    ``reshard_after_forward``); TorchTitan 0.3.0's FSDP on its SPMD mesh refuses it."""
    sub_block_modes: tuple[str, ...] = SUB_BLOCK_TP_MODES
    """The sub-block tp modes its apply runs on dense blocks (``layout.SUB_BLOCK_TP_MODES``)."""
    moe_sub_block_modes: tuple[str, ...] = MOE_SUB_BLOCK_MODES
    """The sub-block tp modes its apply runs on MoE blocks (of ``layout.MOE_SUB_BLOCK_MODES``;
    TorchTitan 0.2.2's: the MoE data parallel alone)."""
    embedding_dim: bool = True
    """Its apply looks the embedding up on its embedding dim (``layout.EMBEDDING_DIM``)."""
    moe_routed_on_shard: bool = False
    """Under expert parallel its MoE blocks' router and routed experts run on the tp rank's
    sequence shard with no collective over tp, and only the shared experts gather the stream
    (TorchTitan 0.3.0's MoE sharding); False: the whole MoE gathers its input over tp and
    reduce-scatters its output (0.2.2's MoE TP). ``Features.moe_routed_on_shard``."""
    read_job: Callable[[list[str]], Any] | None = None
    """Command-line arguments (TorchTitan's own, with ``--parallelism.auto`` and
    ``--autoparallel.*``) -> the job as the planner reads it; None where the CLI reads the
    release's TOML itself (0.2.2)."""


_FRONTENDS: dict[str, Frontend] = {}


def register_frontend(frontend: Frontend) -> None:
    """Register the front-end of one TorchTitan release (its package does at import)."""
    _FRONTENDS[frontend.release] = frontend


def installed_release() -> str:
    """The installed TorchTitan's release as major.minor ("0.2", "0.3")."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise UserError("TorchTitan is not installed: pip install -e . (TorchTitan 0.2.2) or "
                        "pip install -e . 'torchtitan==0.3.0'") from None
    return ".".join(version.split(".")[:2])


def frontend() -> Frontend:
    """The front-end of the installed TorchTitan release."""
    release = installed_release()
    if release not in _FRONTENDS:
        if release not in PACKAGES:
            raise UserError(f"TorchTitan {release} is not supported: install TorchTitan 0.2.2 "
                            "or 0.3.0")
        importlib.import_module(PACKAGES[release])
    return _FRONTENDS[release]
