"""What a compiled Llama 3 block saves for backward, against an eager one (profile constant
``compile_saved_fraction``).

    python experiments/compile_saved.py

Eager: every tensor autograd saves in one block's forward (parameters excluded), as the layer
graph measures ``saved_bytes``. Compiled: the tensors the forward graph hands to the backward
graph after AOT autograd's min-cut partitioner, the one Inductor uses (fused pointwise chains such
as RMSNorm, RoPE and SiLU * mul keep their inputs and are recomputed in backward). Same shapes,
fp32, on CPU: the partition depends on the graph, not on the device. Llama 3 8B / 70B proportions
(4 or 8 query heads per kv head, FFN 3.5 x dim) at a reduced width; the ratio does not depend on
the width or the sequence length (every saved tensor scales with tokens x a multiple of dim).
"""

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import TransformerBlock, precompute_freqs_cis

SEQ = 256
SHAPES = {  # name: (dim, n_heads, n_kv_heads), FFN multiplier 1.3 as in 8B / 70B
    "8B proportions (dim 512)": (512, 4, 1),
    "8B proportions (dim 1024)": (1024, 8, 2),
    "70B proportions (dim 1024)": (1024, 8, 1),
}


def saved_bytes(dim: int, heads: int, kv_heads: int) -> tuple[float, float]:
    args = TransformerModelArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads,
                                vocab_size=256, ffn_dim_multiplier=1.3, multiple_of=256,
                                max_seq_len=SEQ)
    torch.manual_seed(0)
    block = TransformerBlock(0, args)
    freqs = precompute_freqs_cis(dim // heads, SEQ, 500000.0)
    x = torch.randn(1, SEQ, dim, requires_grad=True)
    params = {id(p) for p in block.parameters()}
    eager: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            eager.setdefault(id(base), base)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, freqs, None)
    param_shapes = [tuple(p.shape) for p in block.parameters()]
    compiled = {}

    def forward_graph(gm: torch.fx.GraphModule, _inputs: list) -> torch.fx.GraphModule:
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        total = 0
        for node in outputs[1:]:  # the block output first, then what backward reads
            value = node.meta.get("val") if hasattr(node, "meta") else None
            if not isinstance(value, torch.Tensor):
                continue
            if node.op == "placeholder" and tuple(value.shape) in param_shapes:
                continue  # a parameter, not an activation
            total += value.numel() * value.element_size()
        compiled["bytes"] = total
        return gm

    def backend(gm: torch.fx.GraphModule, example: list):
        return aot_module_simplified(gm, example, fw_compiler=forward_graph,
                                     bw_compiler=lambda g, _: g,
                                     partition_fn=min_cut_rematerialization_partition)

    torch.compile(block, backend=backend, fullgraph=True)(x, freqs, None).sum().backward()
    return sum(t.numel() * t.element_size() for t in eager.values()), compiled["bytes"]


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    print("| block | eager saved B/token | compiled saved B/token | compiled / eager |")
    print("|---|---:|---:|---:|")
    for name, shape in SHAPES.items():
        eager, compiled = saved_bytes(*shape)
        print(f"| {name} | {eager / SEQ:.0f} | {compiled / SEQ:.0f} | {compiled / eager:.3f} |")


if __name__ == "__main__":
    main()
