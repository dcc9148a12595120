"""Gradient-norm clipping across meshes: shared by both releases, in ``titan/grad_norm.py``."""

from ...grad_norm import _combine, _mesh_key, install, needed

__all__ = ["_combine", "_mesh_key", "install", "needed"]
