"""Command line: ``python -m torchtitan_autoparallel plan ...`` (offline, no GPU, no process
group)."""

import argparse
import json
import sys

from .errors import UserError, run_cli


def _plan(args: argparse.Namespace) -> int:
    from .planner import plan_job
    from .registry import register
    from .train import parse_config

    register()
    overrides = ["--job.config_file", args.config, "--parallelism.auto"]
    if args.hardware:
        overrides.append(f"--autoparallel.hardware={args.hardware}")
    if args.gpus_per_node is not None:
        overrides.append(f"--autoparallel.gpus_per_node={args.gpus_per_node}")
    if args.memory_gib is not None:
        overrides.append(f"--autoparallel.memory_gib={args.memory_gib}")
    job_config = parse_config(overrides)
    plan = plan_job(job_config, args.ngpu)
    if args.out:
        plan.save(args.out)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1, sort_keys=True))
    else:
        print(plan.table())
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_autoparallel")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan a TorchTitan config for N devices (offline)")
    plan.add_argument("--config", required=True, help="TorchTitan TOML config")
    plan.add_argument("--ngpu", type=int, required=True, help="world size (devices)")
    plan.add_argument("--gpus-per-node", type=int, default=None)
    plan.add_argument("--hardware", default="", help="profile name or .toml path")
    plan.add_argument("--memory-gib", type=float, default=None, help="budget per device")
    plan.add_argument("--out", default="", help="write the plan JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "ngpu", 1) < 1:
        raise UserError(f"--ngpu must be a positive integer, got {args.ngpu}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
