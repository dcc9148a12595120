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
the placement it chose for each parameter (layer indices folded: ``layers.*.attention.wo``),
and under "activations" how it places a block's activations (see ``_activations``).
AutoParallel's cost model reads its device limits from the CUDA device name: with no GPU here,
an H100 SXM's name stands in (the profile our side plans for).

Traced on CPU, ``F.scaled_dot_product_attention`` becomes
``aten._scaled_dot_product_flash_attention_for_cpu``, an op DTensor has no sharding rule for:
AutoParallel falls back to its all-Replicate rule there, so attention runs replicated on every
rank. ``AUTOPARALLEL_PEER_SDPA=cudnn`` (or ``flash``) traces the op a GPU run calls instead
(``aten._scaled_dot_product_cudnn_attention`` / ``_flash_attention``: the rules shard heads or
batch), K/V passed with their own (GQA) head count; "attention_op" says which op was traced.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time


def main(argv: list[str]) -> dict:
    import torch

    torch.cuda.get_device_name = lambda *args, **kwargs: "NVIDIA H100 80GB HBM3"
    kernel = os.environ.get("AUTOPARALLEL_PEER_SDPA", "")
    if kernel:
        torch.nn.functional.scaled_dot_product_attention = _gpu_sdpa(kernel)
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
            "activations": _activations(autop.sharding_optimizer),
            "attention_op": kernel or "traced on CPU",
        }


def _gpu_sdpa(kernel: str):
    """``F.scaled_dot_product_attention`` (causal, no mask, no dropout) calling the GPU op
    ``kernel`` ("cudnn" or "flash") directly, as a GPU run's backend choice would."""
    import torch

    op = {"cudnn": torch.ops.aten._scaled_dot_product_cudnn_attention,
          "flash": torch.ops.aten._scaled_dot_product_flash_attention}[kernel]

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        assert attn_mask is None and dropout_p == 0.0
        if kernel == "cudnn":
            return op(q, k, v, None, True, 0.0, is_causal, False, scale=scale)[0]
        return op(q, k, v, 0.0, is_causal, False, scale=scale)[0]

    return sdpa


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

MATMULS = ("mm", "addmm", "bmm", "einsum")


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


SITES = {
    "wqkv": ("layers.*.attention.qkv_linear.wqkv", MATMULS),
    "sdpa": ("layers.*.attention.inner_attention", ("scaled_dot_product",)),
    "wo": ("layers.*.attention.wo", MATMULS),
    "w1": ("layers.*.feed_forward.w1", MATMULS),
    "w3": ("layers.*.feed_forward.w3", MATMULS),
    "w2": ("layers.*.feed_forward.w2", MATMULS),
    "residual add": ("layers.*", ("add",)),
}
"""Named forward ops of a block: (module, op names) -> the label the JSON gives them."""
EDGES = ("tok_embeddings", "norm", "lm_head")
"""Modules outside the blocks whose forward ops are recorded as they are (``_activations``:
"edges")."""


def _activations(optimizer) -> dict:
    """How the chosen solution places one block's activations (layer indices folded; each
    value lists the distinct records over the layers, one record when all layers agree).

    For each named op (``SITES``; "residual add" lists both adds, attention's first; "sdpa"
    is the attention kernel the trace recorded, "sdpa backward" its backward): the op name,
    "in" (placements over (fsdp, tp) the op reads each tensor argument in), "from" (the
    placement its producer left that argument in: where the two differ the solution
    redistributes on that edge), "comm_cost" (the solver's cost of that redistribution, per
    argument) and "out" (its output placements, one per tensor output). "block input": the
    placement a block receives (the first residual add's ``from``). "redistributions": every
    edge in a block's forward whose producer placement differs from what its reader takes,
    as "module op#k arg i: from -> to (comm cost)", op#k the k-th such op of that module.
    "edges": every forward op of the embedding, the final norm and the output (``EDGES``) as
    "module op#k", with the same fields."""
    chosen: dict = {}
    for key in optimizer.selected_keys:
        chosen.setdefault(optimizer.nodes[key[0]], {})[key[1]] = (
            key[3], optimizer._resolve_decision_var(key))
    sites: dict[str, set[str]] = {}
    moves: set[str] = set()
    seen: dict[tuple, int] = {}
    edges: dict[str, dict] = {}
    for node in optimizer.graph.nodes:
        if node not in chosen or node.op != "call_function":
            continue
        op, module = _op(node), _module(node)
        if "scaled_dot_product" in op and "backward" in op:
            sites.setdefault("sdpa backward", set()).add(_site(optimizer, chosen, node, 0))
        layer = re.match(r"layers\.(\d+)", module)
        if node.meta.get("partitioner_tag") == "is_forward" and module in EDGES:
            k = seen[module, module, op] = seen.get((module, module, op), -1) + 1
            edges.setdefault(f"{module} {op}#{k}", json.loads(
                _site(optimizer, chosen, node, k)))
        if node.meta.get("partitioner_tag") != "is_forward" or layer is None:
            continue
        folded = re.sub(r"layers\.\d+", "layers.*", module)
        k = seen[layer[1], folded, op] = seen.get((layer[1], folded, op), -1) + 1
        record = _site(optimizer, chosen, node, k)
        for name, (where, ops) in SITES.items():
            if folded == where and any(o in op for o in ops):
                sites.setdefault(name, set()).add(record)
        fields = json.loads(record)
        for i, (came, took) in enumerate(zip(fields["from"], fields["in"], strict=True)):
            if came != took:
                cost = fields["comm_cost"][i]
                moves.add(f"{folded} {op}#{k} arg {i}: {came} -> {took} ({cost})")
    result = {name: [json.loads(r) for r in sorted(v)] for name, v in sites.items()}
    result["residual add"] = sorted(result.get("residual add", []),
                                    key=lambda r: r["index"])
    result["block input"] = sorted({r["from"][0] for r in result["residual add"]
                                    if r["index"] == 0})
    result["redistributions"] = sorted(moves)
    result["edges"] = edges
    return result


def _site(optimizer, chosen, node, index: int) -> str:
    """JSON of what the solution does at ``node``: op name, per tensor argument the placement
    read ("in") and the producer's ("from"), the redistribution's cost, the output placements;
    ``index``: which occurrence of this op in its module (residual adds: 0 after attention)."""
    args = chosen[node]
    preds = optimizer._all_input_nodes(node)
    came, took, costs = [], [], []
    for i, pred in enumerate(preds):
        if i not in args or pred not in chosen:
            continue
        pick, dv = args[i]
        source = optimizer.strats[pred].strategies[pick].output_specs
        if isinstance(source, (list, tuple)):
            source = source[node.args[1]] if _op(node) == "getitem" else source[0]
        if source is None or dv.input_spec is None:
            continue
        came.append(_placements(source))
        took.append(_placements(dv.input_spec))
        costs.append(round(float(dv.comm_cost), 1))
    out = next(iter(args.values()))[1].output_spec
    outs = [_placements(s) for s in (out if isinstance(out, (list, tuple)) else [out])
            if s is not None]
    return json.dumps({"op": _op(node), "in": took, "from": came, "comm_cost": costs,
                       "out": outs, "index": index})


def _module(node) -> str:
    """The innermost module a forward node was traced in (``layers.0.attention.wo``), or ""."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    path = re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", path.replace("L['self']", ""))
    return path.lstrip(".")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
