"""Imported before TorchTitan 0.3.0: its qwen3_5 family imports flash-linear-attention, and
fla-core 0.5.2 (the last release with the module layout 0.3.0 imports; 0.6 moved
``fla.modules.conv``) declares one Triton kernel (``fla.ops.cp.chunk_delta_h``'s
``merge_fwd_bwd_kernel``) with an autotune key, ``BT``, that is not one of its arguments.
Triton 3.8 (torch 2.14.1's) drops such a name from the tuning key when the kernel runs; Triton
3.9 (torch 2.15.0's) refuses it when the module is imported, so ``import
torchtitan.models.qwen3_5`` fails on any machine. Where exactly that pair is installed, Triton's
``Autotuner`` is given the key without the names that are no arguments: what Triton 3.8 tuned
on. Nothing changes for other versions. Tested by tests_v0_3's qwen3_5 cases (read and planned
in ``test_multimodal_v0_3.py``, trained on two ranks in ``test_train_v0_3.py``) on torch 2.15.0.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version
from typing import Any


def _needed() -> bool:
    """fla-core 0.5 beside Triton 3.9 or later."""
    try:
        fla, triton = version("fla-core"), version("triton")
    except PackageNotFoundError:
        return False
    major, minor = (int(part) for part in triton.split(".")[:2])
    return fla.startswith("0.5.") and (major, minor) >= (3, 9)


def known_keys_only() -> None:
    """Autotune keys that name no kernel argument left out, as Triton 3.8 did (once)."""
    if not _needed():
        return
    from triton.runtime import autotuner

    init = autotuner.Autotuner.__init__
    if getattr(init, "known_keys_only", False):
        return

    @functools.wraps(init)
    def known(self: Any, fn: Any, arg_names: list[str], configs: Any, key: list[str],
              *args: Any, **kwargs: Any) -> None:
        init(self, fn, arg_names, configs, [k for k in key if k in arg_names], *args, **kwargs)

    known.known_keys_only = True  # type: ignore[attr-defined]
    autotuner.Autotuner.__init__ = known


known_keys_only()
