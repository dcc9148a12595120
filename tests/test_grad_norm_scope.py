"""The mixed-mesh gradient clipping is installed only for plans whose gradients live on several
meshes (a block using the tp dim as data parallel next to TP layers)."""

from torchtitan_autoparallel.candidates.layout import Mesh
from torchtitan_autoparallel.plan.schema import LayerPlan, Plan
from torchtitan_autoparallel.titan.v0_2.patches.grad_norm import needed


def _plan(mesh: Mesh, modes: list[str]) -> Plan:
    layers = [LayerPlan(f"layers.{i}", "block", tp_mode=m) for i, m in enumerate(modes)]
    return Plan({}, mesh, 8, 1, 1, 256, layers, {}, {})


def test_only_plans_with_blocks_on_several_meshes_need_it() -> None:
    assert needed(_plan(Mesh(dp_replicate=1, dp_shard=2, tp=2), ["sp", "dp", "sp"]))
    # embedding / output stay on tp
    assert needed(_plan(Mesh(dp_replicate=1, dp_shard=2, tp=2), ["dp", "dp"]))
    assert not needed(_plan(Mesh(dp_replicate=1, dp_shard=2, tp=2), ["sp", "sp"]))
    assert not needed(_plan(Mesh(dp_replicate=1, dp_shard=4, tp=1), ["none", "none"]))
    assert not needed(None)  # recipes: TorchTitan's own clipping
