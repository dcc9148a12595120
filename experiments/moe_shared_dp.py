"""Does running a MoE's shared experts data parallel beside the model's MoE TP pay? (TorchTitan
0.3.0, whose MoE TP reduce-scatters the routed and shared experts' outputs apart.) DeepSeek-V3
16B on H100 at global batch 32 (MoE blocks: 26 of 27), planned by the same cost model with
tp 8 and ep 1 set, and unset, each searched three ways: per-block vocabulary only (no
``tp_sub_block``), ``tp_sub_block`` with MoE blocks offered the modes without ``:shared_dp``
(``sp/dp``, ``dp/sp``), and with them (``sp/sp:shared_dp``, ``dp/sp:shared_dp`` too); and
the planning time of DeepSeek-V3 16B (H100) and 671B (H200) on 256 GPUs with and without
``tp_sub_block``.

    <0.3.0 venv>/bin/python experiments/moe_shared_dp.py

Prints one markdown table and writes it to experiments/results/moe_shared_dp.md.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchtitan_autoparallel.candidates.layout import (  # noqa: E402
    MOE_SUB_BLOCK_MODES,
    shared_experts_dp,
)
from torchtitan_autoparallel.job.request import plan_job, read_request  # noqa: E402
from torchtitan_autoparallel.solve.planner import solve_request  # noqa: E402
from torchtitan_autoparallel.titan.v0_3 import read_job  # noqa: E402

JOB = ["--module", "deepseek_v3", "--config", "deepseek_v3_16b", "--parallelism.auto",
       "--training.disable_cuda_graphs", "--autoparallel.hardware", "h100_sxm",
       "--training.global_batch_size", "32"]
SET = ["--parallelism.tensor_parallel_degree", "8", "--parallelism.expert_parallel_degree", "1"]
SUB_BLOCK = ["--autoparallel.techniques", "fsdp,tp,ep,ac,pp,tp_sub_block"]
WORLDS = (8, 16, 64)
SEARCHES = (("per block", (), None),
            ("sub-block, no :shared_dp", SUB_BLOCK,
             tuple(m for m in MOE_SUB_BLOCK_MODES if not shared_experts_dp(m))),
            ("sub-block", SUB_BLOCK, None))
"""(name, extra arguments, the MoE blocks' sub-block modes offered: None as the release says)."""


def _plan(world: int, args: list[str], moe_modes: tuple[str, ...] | None):
    """The plan of the job on ``world`` GPUs, its planning seconds."""
    request = read_request(read_job([*JOB, *args]), world)
    if moe_modes is not None:
        inputs = request.inputs
        request = dataclasses.replace(request, inputs=dataclasses.replace(
            inputs, constraints=dataclasses.replace(inputs.constraints,
                                                    moe_sub_block_modes=moe_modes)))
    start = time.perf_counter()
    plan = solve_request(request)
    return plan, time.perf_counter() - start


def planning_times(repeats: int = 5) -> list[str]:
    """Planning seconds (median of ``repeats``, default search and ``tp_sub_block``
    alternately) of DeepSeek-V3 16B (H100) and 671B (H200) on 256 GPUs, with the settings
    TorchTitan 0.3.0's configs make."""
    lines = ["| model | GPUs | default s | tp_sub_block s | ratio | blocks' tp modes |",
             "|---|---|---|---|---|---|"]
    for config, hardware in (("deepseek_v3_16b", "h100_sxm"), ("deepseek_v3_671b", "h200_sxm")):
        swap = {"deepseek_v3_16b": config, "h100_sxm": hardware}
        args = [swap.get(a, a) for a in JOB[:-2]]
        times: dict[str, list[float]] = {"default": [], "tp_sub_block": []}
        jobs = {name: read_job([*args, *extra])
                for name, extra in (("default", []), ("tp_sub_block", SUB_BLOCK))}
        for round_ in range(repeats + 1):  # the first round warms the model's reading up
            for name, job in jobs.items():
                start = time.perf_counter()
                plan = plan_job(job, 256)
                if round_:
                    times[name].append(time.perf_counter() - start)
        default, sub = (sorted(t)[len(t) // 2] for t in times.values())
        modes = sorted({layer.tp_mode for layer in plan.layers if layer.kind == "block"})
        lines.append(f"| {config} | 256 | {default:.3f} | {sub:.3f} | {sub / default:.2f} | "
                     f"{', '.join(modes)} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    lines = ["| GPUs | tp / ep | search | mesh | MoE blocks' tp modes | step s | vs per block "
             "| planning s |", "|---|---|---|---|---|---|---|---|"]
    for world in WORLDS:
        for degrees in (SET, []):
            base = None
            for name, extra, moe_modes in SEARCHES:
                plan, seconds = _plan(world, [*degrees, *extra], moe_modes)
                step = plan.predicted["step_time_s"]
                base = base or step
                modes = Counter(layer.tp_mode for layer in plan.layers if layer.kind == "block")
                lines.append(f"| {world} | {'8 / 1 set' if degrees else 'searched'} | {name} | "
                             f"{plan.mesh} | "
                             f"{', '.join(f'{m} x{n}' for m, n in sorted(modes.items()))} | "
                             f"{step:.4f} | {step / base:.3f} | {seconds:.2f} |")
                print(lines[-1], flush=True)
    timing = planning_times()
    out = REPO / "experiments" / "results" / "moe_shared_dp.md"
    out.write_text("# MoE shared experts data parallel beside the MoE TP (TorchTitan 0.3.0)\n\n"
                   "Written by `experiments/moe_shared_dp.py`: DeepSeek-V3 16B, H100, global "
                   "batch 32, predicted step time (lower is better).\n\n"
                   + "\n".join(lines) + "\n\nPlanning time on this 2-core box (in-process, "
                   "a warm-up round, then the median of 5, alternating, as "
                   "`bench_planning.py --sub-block`; global batch as the config sets it, the "
                   "mesh searched):\n\n" + "\n".join(timing) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
