"""Memory model vs measurement on this CPU box.

Runs several auto plans for 3 steps each on gloo with ``--autoparallel.measure_memory``: step 2
runs under PyTorch's MemTracker (torch.distributed._tools.mem_tracker), which counts every tensor
byte on the device, by kind (parameters, gradients, optimizer state, activations, temporaries).
That is what the planner predicts (tensor bytes), unlike peak RSS, which adds the Python heap,
allocator caching and TorchTitan's own buffers. Rank 0's peak is compared with the plan's
predicted peak; under pipelining, every pp rank's peak with the plan's per-rank prediction.
Writes experiments/results/memory.md and memory.csv.

    python experiments/memory_validation.py          # every case
    python experiments/memory_validation.py NAME ... # those cases only (results not written)
"""

import csv
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchtitan_autoparallel.plan.schema import Plan  # noqa: E402

from tests.support.parity import run_job  # noqa: E402

BASE = ["--training.steps=3", "--autoparallel.measure_memory", "--autoparallel.hardware=cpu"]
CASES = [
    ("llama3 fsdp 2", "llama3_debug_auto.toml", 2, ["--autoparallel.techniques=fsdp"]),
    ("llama3 auto 2", "llama3_debug_auto.toml", 2, []),
    ("llama3 fsdp+AC under 0.08 GiB", "llama3_debug_auto.toml", 2,
     ["--autoparallel.techniques=fsdp,ac", "--autoparallel.memory_gib=0.08"]),
    ("llama3 fsdp+AC under 0.07 GiB", "llama3_debug_auto.toml", 2,
     ["--autoparallel.techniques=fsdp,ac", "--autoparallel.memory_gib=0.07"]),
    ("llama3 fsdp+AC under 0.2 GiB", "llama3_debug_auto.toml", 2,
     ["--autoparallel.techniques=fsdp,ac", "--autoparallel.memory_gib=0.2"]),
    ("llama3 fsdp2 x tp2", "llama3_debug_auto.toml", 4,
     ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2"]),
    ("llama3 hsdp 2x2", "llama3_debug_auto.toml", 4,
     ["--parallelism.data_parallel_replicate_degree=2"]),
    ("llama3 cp2", "llama3_debug_auto.toml", 2, ["--parallelism.context_parallel_degree=2"]),
    ("qwen3 auto 2", "qwen3_debug_auto.toml", 2, []),
    # pipelines: one row per pp rank (their stages and activations in flight differ)
    ("llama3 pp2 1F1B", "llama3_debug_auto.toml", 2,
     ["--parallelism.pipeline_parallel_degree=2", "--autoparallel.pp_schedules=1F1B"]),
    ("llama3 pp2 1F1B micro-batch 4", "llama3_debug_auto.toml", 2,
     ["--parallelism.pipeline_parallel_degree=2", "--autoparallel.pp_schedules=1F1B",
      "--parallelism.pipeline_parallel_microbatch_size=4"]),
    ("llama3 pp2 GPipe", "llama3_debug_auto.toml", 2,
     ["--parallelism.pipeline_parallel_degree=2", "--autoparallel.pp_schedules=GPipe"]),
    ("llama3 pp2 Interleaved1F1B x 2", "llama3_debug_auto.toml", 2,
     ["--parallelism.pipeline_parallel_degree=2",
      "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
      "--autoparallel.pp_stages_per_rank=2"]),
]


def main() -> None:
    rows = []
    only = sys.argv[1:]  # plan names to run (default: all)
    for name, config, ngpu, extra in CASES:
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            plan_path = Path(tmp) / "plan.json"
            result = run_job(config, ngpu, Path(tmp), [*BASE, *extra,
                                                       f"--autoparallel.save_plan={plan_path}"],
                             parity=False)
            if result.returncode != 0:
                print(f"{name}: run failed\n{result.output[-2000:]}")
                continue
            plan = Plan.load(str(plan_path))
        measured = next(r for r in result.rows if "measured_tensor_peak_gib" in r)
        kinds = measured["measured_tensor_peak_by_kind_gib"]
        m = plan.mesh
        strategies = sorted({layer.describe(m.unsharded_label) for layer in plan.layers
                             if layer.kind == "block"})
        # (label, predicted, measured) per row: rank 0, or every pp rank of a pipeline
        if plan.pipeline is None:
            points = [(name, plan.predicted["peak_memory_gib"],
                       measured["measured_tensor_peak_gib"])]
        else:
            by_rank = measured["measured_tensor_peak_by_rank_gib"]
            per_stage = ngpu // m.pp  # pp is the outermost mesh dim
            points = [(f"{name}, pp rank {r}", predicted, by_rank[r * per_stage])
                      for r, predicted in enumerate(plan.pipeline.rank_memory_gib)]
        for label, predicted, actual in points:
            row = {
                "plan": label, "world": ngpu,
                "mesh": f"{m.dp_replicate}x{m.dp_shard}x{m.cp}x{m.tp}"
                        + (f" pp {m.pp}" if m.pp > 1 else ""),
                "local_batch": plan.local_batch_size, "blocks": " / ".join(strategies),
                "predicted_mib": predicted * 1024, "measured_mib": actual * 1024,
                "error_pct": 100 * (predicted - actual) / actual,
                # by kind: rank 0's (the rank whose metrics TorchTitan logs)
                "measured_params_mib": kinds["Parameter"] * 1024,
                "measured_optstate_mib": kinds["Optstate"] * 1024,
                "measured_grads_mib": kinds["Gradient"] * 1024,
                "measured_acts_mib": kinds["Activation"] * 1024,
                "measured_temp_mib": kinds["Temp"] * 1024,
            }
            rows.append(row)
            print(f"{label}: predicted {row['predicted_mib']:.1f} MiB, measured "
                  f"{row['measured_mib']:.1f} MiB ({row['error_pct']:+.1f}%)", flush=True)
    if only:
        return
    out = REPO / "experiments" / "results"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "memory.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| plan | mesh (rep x shard x cp x tp) | local batch | blocks | predicted MiB | "
             "measured MiB | error | measured at peak: params / opt / grads / acts / temp MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['plan']} | {r['mesh']} | {r['local_batch']} | {r['blocks']} | "
            f"{r['predicted_mib']:.1f} | {r['measured_mib']:.1f} | {r['error_pct']:+.1f}% | "
            f"{r['measured_params_mib']:.1f} / {r['measured_optstate_mib']:.1f} / "
            f"{r['measured_grads_mib']:.1f} / {r['measured_acts_mib']:.1f} / "
            f"{r['measured_temp_mib']:.1f} |")
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
