"""TorchTitan 0.3.0's own AutoParallel path, solved on one CPU process: run with the Python of a
venv that has TorchTitan 0.3.0 and meta-pytorch/autoparallel (see
``autoparallel_side_by_side.py``), not with this project's.

    python autoparallel_peer.py FLAVOR WORLD TP LOCAL_BATCH SEQ

builds TorchTitan 0.3.0's graph_trainer Llama 3 (``model_registry(flavor, attn_backend="sdpa")``,
the backend its AutoParallel integration test uses) on meta, a fake process group of WORLD
ranks with the 2-D mesh (fsdp = WORLD / TP, tp = TP), and asks AutoParallel for placements with
the constraints ``parallelize_autoparallel_llama`` sets (inputs Shard(0) / Replicate, output
Shard(0) / Shard(2), the parameter-memory constraint at its defaults). Prints one JSON line:
the time to trace and build the ILP, the time to solve it, the ILP's size and objective, and
the placement it chose for each parameter (layer indices folded: ``layers.*.attention.wo``).
AutoParallel's cost model reads its device limits from the CUDA device name: with no GPU here,
an H100 SXM's name stands in (the profile our side plans for).
"""

from __future__ import annotations

import json
import re
import sys
import time


def main(argv: list[str]) -> dict:
    import torch

    torch.cuda.get_device_name = lambda *args, **kwargs: "NVIDIA H100 80GB HBM3"
    import pulp
    from autoparallel.api import AutoParallel
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.placement_types import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.experiments.graph_trainer.llama3 import model_registry

    flavor, world, tp, local_batch, seq = argv[0], *map(int, argv[1:5])
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = torch.distributed.device_mesh.init_device_mesh(
        "cpu", (world // tp, tp), mesh_dim_names=("fsdp", "tp"))
    config = model_registry(flavor, attn_backend="sdpa").model
    with torch.device("meta"):
        model = config.build()
    batch = local_batch * (world // tp)

    def input_fn():
        tokens = torch.randint(0, config.vocab_size, (batch, seq))
        positions = torch.arange(seq, dtype=torch.int32).repeat(batch, 1)
        return tokens, positions

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    start = time.perf_counter()
    with AutoParallel(model, input_fn, mesh, mp_policy=mp, reshard_after_forward=True) as autop:
        built = time.perf_counter()
        autop.add_parameter_memory_constraint(low=None, high=None)
        x = (Shard(0), Replicate())
        autop.add_input_constraints([x, x])
        autop.add_output_constraints([(Shard(0), Shard(2))])
        before = time.perf_counter()
        solution = autop.optimize_placement(verbose=False)
        solved = time.perf_counter()
        prob = autop.sharding_optimizer.prob
        stored: dict[str, set[str]] = {}
        computed: dict[str, set[str]] = {}
        for node in autop.gm.graph.nodes:
            target = getattr(node.meta.get("desc"), "target", None)
            if node.op != "placeholder" or not isinstance(target, str) or node not in solution:
                continue
            name = re.sub(r"\.\d+\.", ".*.", target)
            stored.setdefault(name, set()).add(_placements(solution[node].output_specs))
            matmul = _first_matmul(node)
            if matmul is not None and matmul[0] in solution:
                specs = solution[matmul[0]].input_specs
                computed.setdefault(name, set()).add(
                    _placements(specs[matmul[1]], transposed=matmul[2]))
        import torchtitan

        return {
            "versions": {"torch": torch.__version__,
                         "torchtitan": getattr(torchtitan, "__version__", "?")},
            "flavor": flavor, "world": world, "tp": tp, "local_batch": local_batch, "seq": seq,
            "trace_and_build_s": round(built - start, 2),
            "solve_s": round(solved - before, 2),
            "variables": len(prob.variables()), "constraints": len(prob.constraints),
            "objective": pulp.value(prob.objective),
            "stored": {k: sorted(v) for k, v in stored.items()},
            "in_matmul": {k: sorted(v) for k, v in computed.items()},
        }


def _placements(spec, transposed: bool = False) -> str:
    """``(fsdp dim, tp dim)`` placements of ``spec``; ``transposed``: of a 2-D tensor read
    through a transpose, given in the parameter's own (out, in) orientation."""
    spec = spec[0] if isinstance(spec, (list, tuple)) else spec
    swap = {"S(0)": "S(1)", "S(1)": "S(0)"} if transposed else {}
    return "(" + ", ".join(swap.get(str(p), str(p)) for p in spec.placements) + ")"


PASS_THROUGH = ("t", "view", "_to_copy", "convert_element_type", "dtype_cast", "alias", "permute",
                "transpose", "_unsafe_view", "reshape", "expand", "clone")
"""Ops between a parameter and the matmul that reads it (casts, views)."""


TRANSPOSES = ("t", "permute", "transpose")


def _first_matmul(node, hops: int = 8):
    """(the first mm / addmm / bmm / einsum reached from ``node`` through pass-through ops,
    the index of the argument it arrives at, whether an odd number of transposes lies on the
    way), or None."""
    flips = 0
    for _ in range(hops):
        users = list(node.users)
        matmul = next((u for u in users if _op(u) in ("mm", "addmm", "bmm", "einsum")), None)
        if matmul is not None:
            return matmul, list(matmul.all_input_nodes).index(node), flips % 2 == 1
        nxt = [u for u in users if _op(u) in PASS_THROUGH]
        if not nxt:
            return None
        node = nxt[0]
        flips += _op(node) in TRANSPOSES
    return None


def _op(node) -> str:
    return getattr(node.target, "__name__", "").split(".")[0]


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
