"""torchtitan-autoparallel: a planner that chooses TorchTitan's parallelization for you."""

__version__ = "0.1.0"
