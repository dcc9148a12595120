"""Command line, offline (no process group, no GPU): ``python -m torchtitan_autoparallel``.

    plan     --config X.toml --ngpu N [--gpus-per-node G] [--hardware H] [--memory-gib M]
             [--out P] [--section.key value ...]   plan a job, print the table, write the JSON
    explain  P                          per block: strategy, cost breakdown, runner-up
    diff     A B [--out D.png]          what differs and the predicted effect (exit 1 if any);
                                        --out / --html draw the two plans side by side
    show     P --out P.png [--html P.html]   the plan as a picture (mesh, layers, memory, time)
    predict  --config X.toml --ngpu N [--section.key value ...]
                                        a recipe (non-auto) config as a plan, same cost model
    calibrate --ngpu N --out P.toml     measure matmuls and collectives, write a profile
    fit      RUNS.csv --base H --out P.toml   fit a profile to measured runs (fitting/runs.py)

``plan`` and ``predict`` take TorchTitan's ``--section.key value`` overrides as run_train.sh does
(TorchTitan's ConfigManager parses them, with the same errors). Tables by default, ``--json``
for machines. Exit codes: 0 ok, 1 plans differ (diff), 2 a user
error (one line on stderr).
"""

import argparse
import json
import sys
from typing import Any

from ..errors import UserError, check_output_path, run_cli


def _job(args: argparse.Namespace, auto: bool) -> Any:
    from ..frontend import frontend

    release = frontend().release
    if getattr(args, "out", None):
        check_output_path(args.out, "plan")
    job = (_job_by_module(args, auto, release) if args.module or release != "0.2"
           else _job_from_toml(args, auto))
    _check_features_on_profile(job)
    if not job.autoparallel.hardware:
        # offline: no device to match, so say which profile the numbers are for
        print("note: no hardware profile chosen (--hardware or autoparallel.hardware): "
              "planned for 'cpu'; pass --hardware h100_sxm (or h200_sxm, h100_grand_teton, "
              "a100_sxm, b200, a .toml) for a GPU job",
              file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    return job


def _check_features_on_profile(job: Any) -> None:
    """The job's low-precision kernels refused for a profile whose device refuses them (as
    training on that device would)."""
    from ..cost.hardware import CPU_PROFILE, load_profile
    from ..job.features import check_profile, features_from_config

    hardware = job.autoparallel.hardware
    if not isinstance(hardware, str):
        return  # not a profile name: planning's check of the key names it
    profile = load_profile(hardware or CPU_PROFILE)
    emulated = bool(getattr(job.quantize.linear.float8, "emulate", False))
    check_profile(features_from_config(job), profile, emulated)


def _autoparallel_overrides(args: argparse.Namespace, auto: bool) -> list[str]:
    """The command's own options as TorchTitan overrides."""
    out = ["--parallelism.auto"] if auto else []
    if args.hardware:
        out.append(f"--autoparallel.hardware={args.hardware}")
    if args.gpus_per_node is not None:
        out.append(f"--autoparallel.gpus_per_node={args.gpus_per_node}")
    if args.memory_gib is not None:
        out.append(f"--autoparallel.memory_gib={args.memory_gib}")
    return out


def _job_by_module(args: argparse.Namespace, auto: bool, release: str) -> Any:
    """A TorchTitan 0.3.0 job: ``--module M --config FN`` and tyro overrides."""
    from ..frontend import frontend

    if release == "0.2":
        raise UserError("--module names a TorchTitan 0.3.0 config registry, and TorchTitan "
                        "0.2.2 is installed: name a TOML file with --config (or pip install -e "
                        ". 'torchtitan==0.3.0')")
    if not args.module:
        raise UserError(f"TorchTitan {release} names jobs with --module M --config FUNCTION "
                        "(e.g. --module llama3 --config llama3_8b), not a TOML file")
    # the command's own options first: a subcommand (activation-checkpoint:full) takes every
    # argument after it as its own
    job = frontend().read_job(["--module", args.module, "--config", args.config,
                               *_autoparallel_overrides(args, auto), *args.overrides])
    if auto and job.autoparallel.plan_file:
        raise UserError(f"autoparallel.plan_file = {job.autoparallel.plan_file!r} with plan: "
                        "plan solves the job afresh; read a plan file with explain / show / "
                        "diff, or drop the key")
    return job


def _job_from_toml(args: argparse.Namespace, auto: bool) -> Any:
    from ..titan.v0_2.checks import check_auto_settings, check_job_keys
    from ..titan.v0_2.job import parse_config, read_toml
    from ..titan.v0_2.registry import import_custom_module, register

    register()
    for arg in args.overrides:
        if arg.split("=", 1)[0][2:].replace("-", "_") == "job.config_file":
            raise UserError("name the config with --config, not --job.config_file")
    overrides = ["--job.config_file", args.config, *args.overrides,
                 *_autoparallel_overrides(args, auto)]
    job = parse_config(overrides)
    import_custom_module(job)
    if auto and job.autoparallel.plan_file:
        raise UserError(f"autoparallel.plan_file = {job.autoparallel.plan_file!r} with plan: "
                        "plan solves the job afresh; read a plan file with explain / show / "
                        "diff, or drop the key")
    if auto and not (read_toml(args.config).get("parallelism") or {}).get("auto") \
            and not user_set_auto(args.overrides):
        print(f"note: {args.config} does not set parallelism.auto = true: run_train.sh runs "
              "TorchTitan's own recipe for it (python -m torchtitan_autoparallel predict costs "
              "that); this is the plan auto = true would run",
              file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    # what run_train.sh's preflight refuses, refused here too (before any planning)
    check_job_keys(job)
    if auto:
        check_auto_settings(job)
    return job


def user_set_auto(overrides: list[str]) -> bool:
    """Whether the command line's TorchTitan overrides turn ``parallelism.auto`` on."""
    return any(arg.replace("-", "_") in ("__parallelism.auto", "__parallelism.auto=true",
                                         "__parallelism.auto=True") for arg in overrides)


def _emit(args: argparse.Namespace, plan: Any, headline: list[str] = ()) -> None:
    """Print ``plan`` (its table, ``headline`` lines, its TorchTitan settings, its notes) or its
    JSON, and write it where ``--out`` says."""
    from .explain import snippet

    if args.out:
        plan.save(args.out)
    if args.json:
        print(json.dumps({**plan.to_dict(), **({"fit": list(headline)} if headline else {})},
                         indent=1, sort_keys=True))
        return
    print(plan.table())
    for line in headline:
        print(line)
    print(snippet(plan))
    for note in plan.untabled_notes:
        print(f"note: {note}")
    if args.out:
        print(f"plan written to {args.out}")


def _plan(args: argparse.Namespace) -> int:
    from ..job.inputs import reusing_layer_graphs
    from ..job.request import plan_job
    from .explain import model_lines

    job = _job(args, auto=True)
    with reusing_layer_graphs():
        plan = plan_job(job, args.ngpu)
        if not args.module:  # a 0.2.2 TOML job (importing 0.2.2's package registers its adapters)
            from ..titan.v0_2.checks import check_plan_features

            check_plan_features(job, plan)
        margin = _recipe_margin(job, plan, args.ngpu)
        lines = model_lines(plan)
    if margin:
        plan.notes.append(margin)
    plan.notes.extend(f"model: {line}" for line in lines)
    _emit(args, plan)
    return 0


def _recipe_margin(job: Any, plan: Any, world: int) -> str:
    """The plan's predicted gain over TorchTitan's own recipe for the same job, beside the
    model's measured error ("" where the recipe cannot run this job)."""
    import copy

    from ..job.request import recipe_plan
    from .explain import margin_note

    recipe_job = copy.deepcopy(job)
    recipe_job.parallelism.auto = False
    try:
        recipe = recipe_plan(recipe_job, world)
    except UserError:
        return ""
    peak, budget = recipe.predicted["peak_memory_gib"], recipe.predicted["budget_gib"]
    device = ((recipe.inputs or {}).get("hardware") or {}).get("memory_gib") or budget
    if peak > device:
        return (f"TorchTitan's recipe for this job ({recipe.mesh}) is predicted to run out of "
                f"memory (peak {peak:.3g} GiB of the device's {device:.3g} GiB)")
    hw = plan.inputs["hardware"]["name"] if plan.inputs else plan.fingerprint["hardware"]
    note = margin_note(plan.predicted["tokens_per_s"], recipe.predicted["tokens_per_s"],
                       str(recipe.mesh), hw)
    if peak > budget:
        note += f"; the recipe peaks at {peak:.3g} GiB, over the planning budget {budget:.3g} GiB"
    return note


def _predict(args: argparse.Namespace) -> int:
    from ..job.request import recipe_plan
    from .explain import fit_lines

    plan = recipe_plan(_job(args, auto=False), args.ngpu)
    profile = plan.inputs["hardware"]["name"] if plan.inputs else plan.fingerprint["hardware"]
    _emit(args, plan, fit_lines(plan, profile))
    return 0


def _load(path: str, cache: dict[str, Any] | None = None, quiet: bool = False) -> Any:
    """The plan file at ``path``, re-costed (a warning where its predictions differ, unless
    ``quiet``: the same file read a second time)."""
    from ..frontend import frontend
    from ..plan.recost import recosted_file
    from ..plan.schema import SCHEMA_VERSION, Plan

    frontend().prepare_models("")
    plan = Plan.load(path)
    if plan.version < SCHEMA_VERSION:
        print(f"warning: {path} is plan schema version {plan.version}: it stores no planning "
              "inputs, so they are rebuilt from its fingerprint and the hardware profile it "
              "names; re-plan to store them", file=sys.stderr)
    plan, note = recosted_file(plan, cache)
    if note and not quiet:
        print(f"warning: {path}: {note}", file=sys.stderr)
    return plan


def _explain(args: argparse.Namespace) -> int:
    from .explain import explain_rows, explain_text, model_lines, snippet

    cache: dict[str, Any] = {}
    plan = _load(args.plan, cache)
    rows = explain_rows(plan, cache)
    model = model_lines(plan, cache)
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "blocks": rows, "torchtitan": snippet(plan),
                          "model": model}, indent=1, sort_keys=True))
    else:
        print(explain_text(plan, rows, model))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from .explain import diff_lines

    a, b = _load(args.a), _load(args.b, quiet=args.b == args.a)
    lines = diff_lines(a, b)
    if args.out or args.html:
        from .show import render

        render([a, b], args.out, args.html)
    if args.json:
        print(json.dumps({"identical": not lines, "differences": lines}, indent=1))
    else:
        print("\n".join(lines) if lines else "plans are identical")
    return 1 if lines else 0


def _show(args: argparse.Namespace) -> int:
    from .show import render

    render([_load(args.plan)], args.out, args.html)
    print(f"plan drawn to {' and '.join(p for p in (args.out, args.html) if p)}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import platform

    from ..cost.profile_file import write_profile
    from ..fitting.calibrate import calibrate

    # the target is checked before the measurements (minutes on a GPU), not after them
    check_output_path(args.out, "profile")
    if not args.out.endswith(".toml"):
        raise UserError(f"calibrate writes a TOML hardware profile: name --out {args.out!r} "
                        "with a .toml suffix (it is what --hardware and autoparallel.hardware "
                        "read)")
    profile, notes = calibrate(args.ngpu, args.name, args.gpus_per_node or 0, quick=args.quick)
    where = (f"measured by `python -m torchtitan_autoparallel calibrate` on "
             f"{platform.node() or 'this machine'} with {args.ngpu} ranks")
    measured = ("peak_tflops", "memory_gib", "intra_node_gbps", "inter_node_gbps",
                "intra_node_latency_us", "inter_node_latency_us")
    text = write_profile(args.out, profile, [where] + notes,
                         {name: f"measured: {where}" for name in measured})
    print(text, end="")
    print(f"profile written to {args.out}; use it with --hardware {args.out}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from ..fitting.report import fit_command

    return fit_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_autoparallel",
                                     description="Plan and inspect TorchTitan parallelization.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (("plan", _plan, "plan a TorchTitan config for N devices"),
                             ("predict", _predict, "a recipe config's plan and prediction")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", required=True, help="TorchTitan 0.2.2: the TOML config; "
                       "0.3.0: the config function of --module's config_registry")
        p.add_argument("--module", default="", help="TorchTitan 0.3.0: the model family or "
                       "module whose config_registry holds --config (e.g. llama3)")
        p.add_argument("--ngpu", type=int, required=True, help="world size (devices)")
        p.add_argument("--gpus-per-node", type=int, default=None)
        p.add_argument("--hardware", default="", help="profile name or .toml path")
        p.add_argument("--memory-gib", type=float, default=None, help="budget per device")
        p.add_argument("--out", default="", help="write the plan JSON here")
        p.add_argument("--json", action="store_true", help="print JSON instead of tables")
        p.epilog = ("Other --section.key value arguments are TorchTitan config overrides, as "
                    "for run_train.sh (e.g. --training.seq_len 131072).")
        p.set_defaults(func=func)
    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile")
    p.add_argument("--ngpu", type=int, default=2, help="ranks for the collective measurements")
    p.add_argument("--out", required=True, help="profile .toml to write")
    p.add_argument("--name", default="calibrated")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    p.set_defaults(func=_calibrate)
    p = sub.add_parser("fit", help="fit a hardware profile to measured runs (a sweep CSV)")
    p.add_argument("runs", nargs="+", help="CSV of measured runs: plan (or config and arm), "
                   "step_time_s; optional status, peak_memory_gib, group")
    p.add_argument("--base", required=True, help="profile the plans were made for (name or "
                   ".toml); its other constants are kept")
    p.add_argument("--out", required=True, help="fitted profile .toml to write")
    p.add_argument("--free", default="", help="comma-separated fields to fit (default: "
                   "efficiency, bandwidths, latencies, overheads, overlap)")
    p.add_argument("--datasheet", default="", help="profile whose peak and bandwidths bound "
                   "the fit (default: the base; 'none': no bound)")
    p.add_argument("--loss", choices=("squares", "huber"), default="squares",
                   help="relative-error least squares, or Huber (outliers weigh less)")
    p.add_argument("--name", default="", help="name in the written profile (default: the "
                   "base's, so its plans stay comparable)")
    p.add_argument("--no-cv", action="store_true", help="skip the leave-one-config-out check")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_fit)
    p = sub.add_parser("explain", help="per-block costs and runner-up of a plan file")
    p.add_argument("plan")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_explain)
    p = sub.add_parser("diff", help="differences between two plan files")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="", help="draw both plans side by side (.png/.svg/.pdf)")
    p.add_argument("--html", default="", help="the same drawing as a self-contained page")
    p.set_defaults(func=_diff)
    p = sub.add_parser("show", help="draw a plan: mesh, layers by strategy, memory, step time")
    p.add_argument("plan")
    p.add_argument("--out", default="", help="picture file (.png, .svg or .pdf)")
    p.add_argument("--html", default="", help="self-contained HTML page")
    p.set_defaults(func=_show)
    return parser


OVERRIDABLE = ("plan", "predict")
"""Commands that pass the arguments they do not know to TorchTitan's config parser."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if overrides and args.command not in OVERRIDABLE:
        parser.parse_args(argv)  # argparse's own error for the unknown arguments
    args.overrides = overrides
    if getattr(args, "ngpu", 1) < 1:
        raise UserError(f"--ngpu must be a positive integer, got {args.ngpu}")
    _check_own_options(args)
    return args.func(args)


def _check_training_early(args: argparse.Namespace) -> None:
    """The integer ``[training]`` values planning checks (``validate.TRAINING_RULES``), as the
    TOML and the ``--training.<key>`` overrides give them, by the same rules before TorchTitan
    is imported; what only TorchTitan's parser can read is checked after it, as before."""
    import os

    from ..errors import check_value, tomllib
    from ..job.validate import TRAINING_RULES

    rules = {key: rule for key, rule in TRAINING_RULES.items() if rule.kind is int}
    values: dict[str, object] = {}
    config = getattr(args, "config", "")
    if config.endswith(".toml") and os.path.isfile(config):
        try:
            with open(config, "rb") as f:
                section = tomllib.load(f).get("training")
        except (OSError, ValueError):
            section = None  # read (and refused in one line) by the parser later
        if isinstance(section, dict):
            values.update((k, v) for k, v in section.items() if k in rules)
    overrides = getattr(args, "overrides", [])
    for i, arg in enumerate(overrides):
        name, _, value = arg.partition("=")
        key = name.replace("-", "_")[len("__training."):]
        if not name.startswith("--training.") or key not in rules:
            continue
        value = value if "=" in arg else (overrides[i + 1] if i + 1 < len(overrides) else "")
        try:
            values[key] = int(value)
        except ValueError:
            values.pop(key, None)  # not an integer: TorchTitan's parser names it
    for key, value in values.items():
        check_value("training.", key, value, rules[key])


def _check_own_options(args: argparse.Namespace) -> None:
    """The command's own ``--memory-gib`` / ``--gpus-per-node`` by the rules of the keys they
    set, before TorchTitan and the model are imported (seconds), and ``plan``'s ``--out``
    never the config it reads."""
    import os

    from ..errors import check_value
    from ..job.validate import AUTOPARALLEL_RULES

    for key in ("memory_gib", "gpus_per_node"):
        value = getattr(args, key, None)
        if value is not None:
            check_value("autoparallel.", key, value, AUTOPARALLEL_RULES[key])
    _check_training_early(args)
    out, config = getattr(args, "out", ""), getattr(args, "config", "")
    if out and config and os.path.exists(config) and os.path.exists(out) \
            and os.path.samefile(out, config):
        raise UserError(f"--out {out} is the config --config reads: name another file for the "
                        "plan JSON (e.g. plan.json); the config is left as it is")


if __name__ == "__main__":
    sys.exit(run_cli(main))
