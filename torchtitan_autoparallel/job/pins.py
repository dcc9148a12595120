"""``autoparallel.pin``: module fqn globs left to TorchTitan's own code.

A pin is resolved against the model's module names (on meta). For a block, a pin either fixes the
whole block (the glob matches the block or a module containing it): the block runs exactly what
TorchTitan's recipe would run for the job (its TP plan, the job's ``[activation_checkpoint]`` and
FSDP ``fsdp_reshard_after_forward`` settings) and the MILP counts its cost as a constant; or it
names a region inside the block (e.g. ``layers.*.moe.router``, ``layers.3.attention``): that
region keeps TorchTitan's own parallelization (its TP plan, routing and token dispatch from
``apply_moe_ep_tp``), so the block may not use the tp dim as data parallel, while its AC and
resharding stay free. Each family pins its MoE routing by default.
"""

import fnmatch
from dataclasses import dataclass
from typing import Any

from ..errors import UserError, shown
from ..graph.layer_graph import LayerGraph


@dataclass(frozen=True)
class Pin:
    """What the pins fix for one block."""

    recipe_ac: str | None = None
    """Set when the whole block is pinned: TorchTitan's AC mode for this block."""
    recipe_reshard: bool = True
    """TorchTitan's ``reshard_after_forward`` for the block (whole-block pins)."""
    regions: tuple[str, ...] = ()
    """Pinned modules inside the block (relative names)."""
    ac: str | None = None
    """The AC mode the job fixes for this searched block (TorchTitan's layer-wise selective
    AC, ``selective_ac_option = k``: every k-th block full, the others none); None: free."""
    defaults_only: bool = False
    """Every region is one of the family's default pins (its MoE routing): TorchTitan's code
    runs it under ``layout.MOE_SUB_BLOCK_MODES`` too (on each tp rank's own tokens in
    ``MOE_SHARED_DP``, as under "sp" in ``MOE_ATTENTION_DP``)."""

    @property
    def whole(self) -> bool:
        return self.recipe_ac is not None

    @property
    def key(self) -> str:
        """Suffix of the block's MILP class (blocks with equal keys are interchangeable)."""
        if self.whole:
            return f"|pinned:{self.recipe_ac}:{self.recipe_reshard}"
        regions = "|keep-tp" + ("" if self.defaults_only else ":asked") if self.regions else ""
        return regions + (f"|ac:{self.ac}" if self.ac else "")


def recipe_block_ac(mode: str, option: str, index: int) -> str:
    """TorchTitan's AC for block ``index`` under ``[activation_checkpoint]`` ``mode`` /
    ``selective_ac_option``: "selective" with an integer k checkpoints every k-th block fully
    (0: every block); "op" is op-level selective AC."""
    if mode in ("none", "full"):
        return mode
    if mode == "selective" and option == "op":
        return "selective"
    if mode == "selective" and option.isdigit():
        # TorchTitan 0.2.2 counts blocks from 1 and wraps each k-th; k = 0 wraps them all
        k = int(option)
        return "full" if k == 0 or (index + 1) % k == 0 else "none"
    raise UserError(f"activation_checkpoint mode {shown(mode)} / selective_ac_option "
                    f"{shown(option)} is not modelled by the planner")


def recipe_of(recipe: dict[str, str]) -> Any:
    """``index -> (ac, reshard_after_forward)`` of TorchTitan's recipe described by ``recipe``
    (keys ``ac_mode``, ``selective_ac_option``, ``fsdp_reshard_after_forward``)."""
    reshard = {"default": True, "always": True, "never": False}.get(
        recipe["fsdp_reshard_after_forward"])
    if reshard is None:
        raise UserError(f"parallelism.fsdp_reshard_after_forward "
                        f"{shown(recipe['fsdp_reshard_after_forward'])} is not one of default / "
                        "always / never")
    return lambda index: (recipe_block_ac(recipe["ac_mode"], recipe["selective_ac_option"],
                                          index), reshard)


def recipe_from_config(job_config: Any) -> dict[str, str]:
    """The job's own recipe settings that ``recipe_of`` reads."""
    ac = job_config.activation_checkpoint
    return {"ac_mode": ac.mode, "selective_ac_option": str(ac.selective_ac_option),
            "fsdp_reshard_after_forward": job_config.parallelism.fsdp_reshard_after_forward}


def _matches(names: tuple[str, ...], glob: str) -> list[str]:
    return [name for name in names if fnmatch.fnmatchcase(name, glob)]


def check_globs(graph: LayerGraph, globs: list[str]) -> None:
    """One-line errors for globs that match no module (or name a parameter)."""
    for glob in globs:
        if not glob or not isinstance(glob, str):
            raise UserError("autoparallel.pin entries must be non-empty fqn globs, got "
                            f"{shown(glob)}")
        if _matches(graph.module_names, glob):
            continue
        params = _matches(graph.param_names, glob)
        if params:
            owner = params[0].rpartition(".")[0]
            raise UserError(
                f"autoparallel.pin {shown(glob)} names a parameter ({params[0]}), not a module: "
                f"pin its module instead (e.g. {owner!r})"
            )
        examples = [n for n in graph.module_names if n.count(".") <= 2][:4]
        raise UserError(
            f"autoparallel.pin {shown(glob)} matches no module of {graph.family} {graph.flavor}: "
            f"globs match module fqns such as {examples} (remove it or fix the pattern)"
        )


def resolve_pins(graph: LayerGraph, globs: list[str], defaults: tuple[str, ...],
                 recipe: Any) -> dict[str, Pin]:
    """Pins per block fqn for the user's ``globs`` (checked) and the family's ``defaults``
    (silently skipped where they match nothing). ``recipe(index) -> (ac, reshard)`` gives
    TorchTitan's own choice for block ``index``."""
    check_globs(graph, globs)
    matched = sorted({m for glob in [*globs, *defaults]
                      for m in _matches(graph.module_names, glob)})
    asked = {m for glob in globs for m in _matches(graph.module_names, glob)}
    pins: dict[str, Pin] = {}
    for index, block in enumerate(graph.blocks):
        whole = any(block.fqn == m or block.fqn.startswith(m + ".") for m in matched)
        regions = tuple(m[len(block.fqn) + 1:] for m in matched
                        if m.startswith(block.fqn + "."))
        if whole:
            ac, reshard = recipe(index)
            pins[block.fqn] = Pin(ac, reshard, regions)
        elif regions:
            pins[block.fqn] = Pin(regions=regions, defaults_only=not any(
                f"{block.fqn}.{region}" in asked for region in regions))
    return pins
