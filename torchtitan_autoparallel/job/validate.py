"""Checks of the job's ``[autoparallel]`` values and the ``[training]`` values planning reads.
Each raises a one-line ``UserError`` naming the field and the fix, before anything is planned.

Values are checked against rule tables (``errors.Rule``: type, finiteness, range), one row per
field; fields of a dataclass without a row get the rule their type annotation implies (a finite
number >= 0, a bool, a string), so a new field is checked without new code, and a row makes its
range exact. Hardware profiles are checked where they are read (``cost/hardware.py``), plan
files where they are built (``plan.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import Rule, UserError, check_fields, check_value, shown

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

MAX_BATCH = 1 << 24
"""Sequences per step the search enumerates batch splits for (16 M, past any real job)."""
MAX_SEQ_LEN = 1 << 26
"""Tokens per sequence (64 M)."""

TRAINING_RULES: dict[str, Rule] = {
    "steps": Rule(int, ge=1),
    "seq_len": Rule(int, ge=1, le=MAX_SEQ_LEN),
    "local_batch_size": Rule(int, ge=1, le=MAX_BATCH),
    "global_batch_size": Rule(int, le=MAX_BATCH),
    "mixed_precision_param": Rule(str, choices=("float32", "bfloat16", "float16")),
    "mixed_precision_reduce": Rule(str, choices=("float32", "bfloat16", "float16")),
}


def check_model_name(name: Any) -> None:
    """``model.name`` names a model the installed TorchTitan resolves (its front-end's
    ``model_names``)."""
    from ..frontend import frontend

    names = frontend().model_names()
    if not isinstance(name, str) or name not in names:
        raise UserError(f"model.name = {shown(name)} is not a registered model: use one of "
                        f"{names}")


def check_job_options(job_config: Any) -> None:
    """``[autoparallel]`` values and the ``[training]`` values planning reads."""
    from .config import Autoparallel

    check_model_name(job_config.model.name)

    ap = job_config.autoparallel
    from ..cost.hardware import HardwareProfile

    values = {f.name: getattr(ap, f.name) for f in dataclasses.fields(Autoparallel)
              if hasattr(ap, f.name)}
    if isinstance(values.get("hardware"), HardwareProfile):
        values.pop("hardware")  # a loaded profile handed in by recost / the profile fitter
    check_fields("autoparallel.", values, Autoparallel, AUTOPARALLEL_RULES)
    check_training(job_config.training)


def check_training(training: Any) -> None:
    """The ``[training]`` values planning and both releases' training entry points read."""
    for key, rule in TRAINING_RULES.items():
        if hasattr(training, key):
            check_value("training.", key, getattr(training, key), rule)
    gbs = training.global_batch_size
    if gbs == 0 or gbs < -1:
        raise UserError(f"training.global_batch_size = {gbs} is invalid: use a positive number "
                        "of sequences, or -1 for local_batch_size x the data-parallel degree")
