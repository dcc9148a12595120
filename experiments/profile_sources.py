"""Which kernel source each GPU profile's constants come from, from the profiles' [provenance].

    python experiments/profile_sources.py          # writes experiments/results/profile_sources.md

For every GPU profile: the count of constants per source class (datasheet / measured / fitted /
assumed), then each kernel-level constant (GEMM, attention, HBM, NCCL) with its value, class and
source as the profile's [provenance] table gives it, and the GEMM and attention throughputs the
model derives from them for this GPU (large bf16 GEMM; causal attention at 8k tokens).
Generated text only: the profiles are the single place the constants and their sources live.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

OUT = REPO / "experiments" / "results" / "profile_sources.md"
PROFILES = ("a100_sxm", "h100_sxm", "h100_grand_teton", "h200_sxm", "b200")
KERNEL_FIELDS = ("peak_tflops", "gemm_table", "clock_scale", "float8_gemm_speedup",
                 "attention_fwd_tflops", "attention_bwd_tflops", "attention_half_seq",
                 "hbm_gbps", "intra_node_gbps", "intra_node_half_mib", "intra_node_latency_us",
                 "inter_node_gbps", "nccl_sm_fraction")
CLASSES = ("datasheet", "measured", "fitted", "assumed")
SEQ = 8192


def derived(hw) -> tuple[float, float, float]:
    """(large bf16 GEMM, attention forward, attention backward) TFLOP/s on the profile's GPU as
    the cost model computes them (the GEMM table's plateau and the attention fields, each
    times clock_scale; attention at ``SEQ`` tokens)."""
    from torchtitan_autoparallel.cost import kernels
    from torchtitan_autoparallel.cost.model import GEMM_PLATEAU

    gemm = kernels.table_flops(hw.gemm_table, "bf16", *GEMM_PLATEAU) * hw.clock_scale / 1e12
    sat = SEQ / (SEQ + hw.attention_half_seq)
    return (gemm, hw.attention_fwd_tflops * hw.clock_scale * sat,
            hw.attention_bwd_tflops * hw.clock_scale * sat)


def report() -> str:
    from torchtitan_autoparallel.cost.hardware import load_profile

    lines = ["# Where each GPU profile's constants come from", "",
             "`python experiments/profile_sources.py`, generated from the [provenance] tables of "
             "`torchtitan_autoparallel/profiles/*.toml`. No constant is fitted on end-to-end "
             "training rows; published TorchTitan runs only validate "
             "(experiments/results/published.md).", "",
             "| profile | " + " | ".join(CLASSES) + " | large bf16 GEMM TFLOP/s | attention "
             f"fwd / bwd TFLOP/s at {SEQ // 1024}k |",
             "|---|" + "---:|" * (len(CLASSES) + 2)]
    profiles = [load_profile(name) for name in PROFILES]
    for hw in profiles:
        kinds = [v.split(":", 1)[0] for _, v in hw.provenance]
        gemm, fwd, bwd = derived(hw)
        lines.append(f"| {hw.name} | " + " | ".join(str(kinds.count(c)) for c in CLASSES)
                     + f" | {gemm:.0f} | {fwd:.0f} / {bwd:.0f} |")
    lines += ["", "Attention fields are multiplied by clock_scale in the model (they are in the "
              "GEMM table device's units): a100_sxm's 628 / 547 are FlashAttention-2's A100 "
              "throughputs (214 / 186) over its clock_scale (0.341)."]
    for hw in profiles:
        lines += ["", f"## {hw.name}", "", "| constant | value | class | source |",
                  "|---|---:|---|---|"]
        for name in KERNEL_FIELDS:
            kind, _, text = hw.source(name).partition(":")
            lines.append(f"| {name} | {getattr(hw, name)} | {kind} | "
                         f"{text.strip().replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    text = report()
    print(text)
    if not args.no_write:
        OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
