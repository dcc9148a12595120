"""The planning grid's plans, one line each (model, GPUs, digest of the plan's decisions, mesh):
what a change that must leave plans unchanged is compared on.

    python experiments/plan_digests.py [--out experiments/results/plan_digests.txt]

Same grid as ``bench_planning.py --grid`` (its configs x 8 / 64 / 128 / 256 / 512 GPUs);
``digest`` covers every decision and the job's fingerprint (``Plan.digest``), so equal lines are
byte-identical plans up to timing fields.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_planning import GRID  # noqa: E402


def main() -> None:
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.job.request import plan_job
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "experiments/results/plan_digests.txt"))
    args = parser.parse_args()
    register()
    lines = []
    for name in GRID:
        config = str(REPO / "train_configs" / f"{name}_auto.toml")
        for ngpu in (8, 64, 128, 256, 512):
            try:
                plan = plan_job(parse_config(["--job.config_file", config]), ngpu)
                line = f"{name} {ngpu} {plan.digest()} {plan.mesh}"
            except UserError as exc:
                line = f"{name} {ngpu} error: {exc}"
            print(line, flush=True)
            lines.append(line)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
