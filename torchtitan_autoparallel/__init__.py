"""torchtitan-autoparallel: a planner that chooses TorchTitan's parallelization for you.

Public API for bringing a model: ``ModelAdapter`` and ``register_adapter`` (see
``graph/adapters.py`` and docs/own-model.md)."""

from .graph import families  # noqa: F401  (registers TorchTitan's families)
from .graph.adapters import ModelAdapter, register_adapter

__version__ = "0.1.0"

__all__ = ["ModelAdapter", "__version__", "register_adapter"]
