"""Sweep: auto plans vs TorchTitan's recipes, measured on this machine.

A grid TOML (``experiments/grids/*.toml``) lists blocks of configs; list-valued keys expand to
their cartesian product. Each config (model, world size, global batch, sequence length, memory
budget) has arms: ``auto`` (the planner's plan, replayed from its JSON) and every legal recipe
recipe (TorchTitan's own parallelization for a mesh, activation checkpointing and local batch).
Arms run interleaved (round 1 in order, round 2 reversed, ...) so machine drift cancels between
auto and the recipes. Each run's median step time over steady steps, peak memory and final loss
go to a CSV keyed by cell id (config / arm / round); rerunning skips finished cells.

    python experiments/sweep.py experiments/grids/quick.toml [--out experiments/results]
    python experiments/sweep_report.py experiments/results/sweep.csv

The planner's prediction for each arm is computed in-process (auto: ``plan_job``; experts:
``recipe_plan``, the same cost model) and stored next to the measurement. The runner measures
this repository's configs (``train_configs/``) through its ``run_train.sh``; the scripts in
experiments/ run ``main`` and use its pieces, tests/test_sweep.py checks them.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan_autoparallel.commands.progress import Progress

REPO = Path(__file__).resolve().parents[2]

CSV_FIELDS = [
    "cell", "config", "family", "ngpu", "global_batch", "seq_len", "memory_gib", "arm", "round",
    "status", "dp_replicate", "dp_shard", "tp", "cp", "local_batch", "accum", "ac",
    "step_time_s", "min_step_time_s", "tokens_per_s", "peak_memory_gib", "peak_active_gib",
    "tensor_peak_gib", "tensor_peak_by_kind", "final_loss", "steps_measured",
    "pred_step_time_s", "pred_peak_gib", "wall_s", "foreign_load", "attempts", "note",
]
AUTO_FAMILIES = ("llama3", "qwen3", "llama4", "deepseek_v3")
"""Families the planner supports; other families get an ``unsupported`` auto row."""


@dataclass(frozen=True)
class Config:
    """One measured configuration: every arm runs the same model, batch and budget."""

    family: str
    ngpu: int
    global_batch: int
    seq_len: int
    memory_gib: float = 0.0
    """Per-device budget; 0 = the hardware profile's. Recipes predicted above it are not run."""
    recipes: tuple[str, ...] = ("all",)
    recipe_ac: tuple[str, ...] = ("none",)
    recipe_local_batch: tuple[int, ...] = (0,)
    """Local batch sizes tried by the recipes; 0 = global batch / dp (no accumulation)."""
    flavor: str = "bench"
    hardware: str = "cpu"
    """Hardware profile the planner and the recipes' predictions use."""
    features: tuple[str, ...] = ()
    """TorchTitan overrides every arm runs with (compile, float8, ...)."""

    @property
    def id(self) -> str:
        mem = f"_m{self.memory_gib:g}" if self.memory_gib else ""
        flavor = "" if self.flavor == "bench" else f"_{self.flavor}"
        feats = "".join(FEATURE_TAGS.get(f, "") for f in self.features)
        return (f"{self.family}{flavor}_ws{self.ngpu}_b{self.global_batch}_s{self.seq_len}{mem}"
                f"{'_' + feats if feats else ''}")


FEATURE_TAGS = {"--compile.enable": "c", "--model.converters=quantize.linear.float8": "f8",
                "--quantize.linear.float8.recipe_name=rowwise": "r"}
"""Short tags of feature overrides in config ids."""


@dataclass(frozen=True)
class Recipe:
    """A recipe: TorchTitan's parallelization for fixed degrees."""

    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    ac: str = "none"
    local_batch: int = 0
    """0 = global batch / dp (no gradient accumulation)."""
    ep: int = 1
    etp: int = 1
    """Expert parallel / expert tensor parallel degrees (MoE models)."""

    @property
    def name(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"hsdp{self.dp_replicate}x{self.dp_shard}" if self.dp_shard > 1
                         else f"ddp{self.dp_replicate}")
        elif self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f"etp{self.etp}" if self.etp > 1 else ""))
        name = "_".join(parts) or "single"
        if self.ac != "none":
            name += f"+ac_{self.ac}"
        if self.local_batch:
            name += f"+lb{self.local_batch}"
        return name


@dataclass
class Grid:
    name: str
    steps: int = 6
    steady_from: int = 3
    """First step counted in the median (earlier steps warm up)."""
    rounds: int = 2
    timeout_s: int = 600
    max_foreign_load: float = 0.3
    """A run during which other processes used more than this many cores on average is
    repeated (the machine is shared); the least disturbed attempt is kept."""
    retries: int = 1
    measure_memory: bool = False
    """Run step 2 under PyTorch's MemTracker: tensor peak by kind (params, grads, optimizer
    state, activations, temporaries) next to the planner's prediction. Slows that step only."""
    quiet_wait_s: float = 90.0
    """Before each run, wait up to this long for other processes to go quiet."""
    configs: list[Config] = field(default_factory=list)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


OLD_KEYS = {"expert_ac": "recipe_ac", "expert_local_batch": "recipe_local_batch"}
"""Config keys by their former names."""


def load_grid(path: str | Path) -> Grid:
    """Parse a grid TOML: top-level run settings and ``[[config]]`` blocks whose list values
    (except ``recipes`` and ``recipe_ac``) expand to their cartesian product."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    blocks = data.pop("config", [])
    known = {f.name for f in dataclasses.fields(Grid)} - {"configs"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown grid keys {sorted(unknown)}")
    grid = Grid(name=data.pop("name", Path(path).stem), **data)
    axes = ("family", "ngpu", "global_batch", "seq_len", "memory_gib")
    seen = set()
    for block in blocks:
        for old, new in OLD_KEYS.items():  # grids written before the keys were renamed
            if old in block:
                block[new] = block.pop(old)
        unknown = set(block) - set(axes) - {"recipes", "recipe_ac", "recipe_local_batch",
                                            "flavor", "hardware", "features"}
        if unknown:
            raise ValueError(f"{path}: unknown config keys {sorted(unknown)}")
        if "family" not in block or "ngpu" not in block:
            raise ValueError(f"{path}: every [[config]] needs family and ngpu")
        values = [_as_list(block.get(k, d)) for k, d in
                  zip(axes, (None, None, 16, 256, 0.0), strict=True)]
        for combo in itertools.product(*values):
            cfg = Config(*combo, recipes=tuple(_as_list(block.get("recipes", "all"))),
                         recipe_ac=tuple(_as_list(block.get("recipe_ac", "none"))),
                         recipe_local_batch=tuple(_as_list(block.get("recipe_local_batch", 0))),
                         flavor=block.get("flavor", "bench"),
                         hardware=block.get("hardware", "cpu"),
                         features=tuple(block.get("features", ())))
            if cfg.id not in seen:
                seen.add(cfg.id)
                grid.configs.append(cfg)
    return grid


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def legal_recipes(cfg: Config, n_heads: int, n_kv_heads: int, num_experts: int = 0
                  ) -> list[Recipe]:
    """Every mesh TorchTitan 0.2.2 accepts for this model and world size (FSDP, HSDP, DDP, TP,
    CP, and for MoE models EP / ETP by TorchTitan's rules, and their products; CP needs
    ``seq_len % (2 cp tp) == 0``; the global batch must split over dp), times the config's
    activation-checkpointing modes."""
    from torchtitan_autoparallel.candidates.strategies import legal_ep

    out = []
    for tp in _divisors(cfg.ngpu):
        if n_heads % tp or n_kv_heads % tp:
            continue
        for cp in _divisors(cfg.ngpu // tp):
            if cp > 1 and cfg.seq_len % (2 * cp * tp):
                continue
            for dr in _divisors(cfg.ngpu // tp // cp):
                ds = cfg.ngpu // tp // cp // dr
                if cfg.global_batch % (dr * ds):
                    continue
                eps = [(1, 1), *(legal_ep(num_experts, ds, cp, tp) if num_experts else [])]
                for (ep, etp), ac in itertools.product(eps, cfg.recipe_ac):
                    for lb in cfg.recipe_local_batch:
                        if lb and (lb >= cfg.global_batch // (dr * ds)
                                   or cfg.global_batch // (dr * ds) % lb):
                            continue  # no accumulation, or uneven micro-batches
                        out.append(Recipe(dr, ds, tp, cp, ac, lb, ep, etp))
    if cfg.recipes != ("all",):
        wanted = set(cfg.recipes)
        out = [r for r in out if r.name in wanted or r.name.split("+")[0] in wanted]
    return out


# ---------------------------------------------------------------- planner (in-process)

def _job_config(cfg: Config, auto: bool, extra: list[str]) -> Any:
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    argv = ["--job.config_file", str(config_file(cfg, auto)), *common_overrides(cfg), *extra]
    if auto:
        argv.append("--parallelism.auto")
    return parse_config(argv)


def config_file(cfg: Config, auto: bool) -> Path:
    name = f"{cfg.family}_{cfg.flavor.lower()}_{'auto' if auto else 'fsdp'}.toml"
    return REPO / "train_configs" / name


def common_overrides(cfg: Config) -> list[str]:
    out = [f"--training.global_batch_size={cfg.global_batch}",
           f"--training.seq_len={cfg.seq_len}", f"--autoparallel.hardware={cfg.hardware}",
           *cfg.features]
    if cfg.memory_gib:
        out.append(f"--autoparallel.memory_gib={cfg.memory_gib}")
    return out


def recipe_overrides(cfg: Config, r: Recipe) -> list[str]:
    dp = r.dp_replicate * r.dp_shard
    local = r.local_batch or cfg.global_batch // dp
    ac = {"none": ["--activation_checkpoint.mode=none"],
          "full": ["--activation_checkpoint.mode=full"],
          "selective": ["--activation_checkpoint.mode=selective",
                        "--activation_checkpoint.selective_ac_option=op"]}[r.ac]
    return [f"--parallelism.data_parallel_replicate_degree={r.dp_replicate}",
            f"--parallelism.data_parallel_shard_degree={r.dp_shard}",
            f"--parallelism.tensor_parallel_degree={r.tp}",
            f"--parallelism.context_parallel_degree={r.cp}",
            f"--parallelism.expert_parallel_degree={r.ep}",
            f"--parallelism.expert_tensor_parallel_degree={r.etp}",
            f"--training.local_batch_size={local}", *ac]


def predict(cfg: Config, recipe: Recipe | None, plan_path: Path | None) -> dict[str, Any]:
    """The planner's plan for auto (``recipe`` None) or the recipe as a plan (written to
    ``plan_path``): predicted step time and peak, mesh, batch split."""
    from torchtitan_autoparallel.errors import UserError

    try:
        if recipe is None:
            from torchtitan_autoparallel.job.request import plan_job

            plan = plan_job(_job_config(cfg, True, []), cfg.ngpu)
            if plan_path is not None:
                plan.save(str(plan_path))
        else:
            from torchtitan_autoparallel.job.request import recipe_plan

            plan = recipe_plan(_job_config(cfg, False, recipe_overrides(cfg, recipe)), cfg.ngpu)
            if plan_path is not None:
                plan.save(str(plan_path))
    except (UserError, NotImplementedError, KeyError, ValueError) as exc:
        return {"error": str(exc).splitlines()[0][:200]}
    acs = sorted({lp.ac for lp in plan.layers if lp.kind == "block"})
    return {"pred_step_time_s": plan.predicted["step_time_s"],
            "pred_peak_gib": plan.predicted["peak_memory_gib"],
            "dp_replicate": plan.mesh.dp_replicate, "dp_shard": plan.mesh.dp_shard,
            "tp": plan.mesh.tp, "cp": plan.mesh.cp, "local_batch": plan.local_batch_size,
            "accum": plan.gradient_accumulation_steps, "ac": "/".join(acs)}


# ---------------------------------------------------------------- running

def steady_stats(rows: list[dict], steady_from: int) -> dict[str, Any]:
    """Median (and fastest) step time and median tokens/s over steps >= ``steady_from``; peak
    memory; final loss. On a shared machine the fastest step is the least disturbed one."""
    steady = [r for r in rows if r.get("step", 0) >= steady_from and "step_time_s" in r]
    if not steady:
        return {}
    return {"step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "min_step_time_s": min(r["step_time_s"] for r in steady),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "peak_memory_gib": max(r.get("peak_memory_gib", 0.0) for r in rows),
            "peak_active_gib": max(r.get("peak_active_gib", 0.0) for r in rows),
            "final_loss": rows[-1]["loss"], "steps_measured": len(steady),
            **_tensor_peak(rows)}


def _tensor_peak(rows: list[dict]) -> dict[str, Any]:
    """MemTracker's tensor peak (GiB) and its split by kind, where a row has them."""
    for r in rows:
        if "measured_tensor_peak_gib" in r:
            kinds = {k: round(v, 3) for k, v in r["measured_tensor_peak_by_kind_gib"].items()}
            return {"tensor_peak_gib": r["measured_tensor_peak_gib"],
                    "tensor_peak_by_kind": json.dumps(kinds, sort_keys=True)}
    return {}


def _busy_cpu_s() -> float:
    """CPU seconds all processes on this machine have used since boot (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_load: float, max_wait_s: float, window_s: float = 3.0) -> float:
    """Sleep until the machine's CPU use over ``window_s`` is at most ``max_load`` cores (this
    process is idle meanwhile) or ``max_wait_s`` has passed; returns the last load seen."""
    deadline = time.time() + max_wait_s
    while True:
        busy = _busy_cpu_s()
        time.sleep(window_s)
        load = (_busy_cpu_s() - busy) / window_s
        if load <= max_load or time.time() >= deadline:
            return load


def measure_run(cfg: Config, grid: Grid, extra: list[str], auto: bool, workdir: Path
                ) -> tuple[int, list[dict], str, float, int]:
    """``run_training`` repeated while other processes loaded the machine more than
    ``grid.max_foreign_load`` cores; returns the least disturbed attempt, its foreign load
    (cores used by processes outside this run, averaged over its wall time) and the attempts."""
    best = None
    for attempt in range(1, grid.retries + 2):
        wait_for_quiet(grid.max_foreign_load, grid.quiet_wait_s)
        busy, mine, t0 = _busy_cpu_s(), _children_cpu_s(), time.time()
        code, rows, tail = run_training(cfg, grid, extra, auto, workdir / f"a{attempt}")
        wall = max(time.time() - t0, 1e-6)
        foreign = max(0.0, (_busy_cpu_s() - busy) - (_children_cpu_s() - mine)) / wall
        if best is None or (code == 0 and foreign < best[3]) or best[0] != 0:
            best = (code, rows, tail, foreign, attempt)
        if code != 0 or foreign <= grid.max_foreign_load:
            break
        print(f"    machine shared ({foreign:.2f} cores used by other processes): repeating",
              flush=True)
    assert best is not None
    return best


def run_training(cfg: Config, grid: Grid, extra: list[str], auto: bool, workdir: Path
                 ) -> tuple[int, list[dict], str]:
    """Launch ``run_train.sh`` for one arm; return exit code, metrics rows, output tail."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    env = {**os.environ, "NGPU": str(cfg.ngpu), "CONFIG_FILE": str(config_file(cfg, auto)),
           "LOG_RANK": "0", "PREFLIGHT": "0",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [str(REPO / "run_train.sh"), *common_overrides(cfg), *extra,
           *(["--autoparallel.measure_memory"] if grid.measure_memory else []),
           f"--training.steps={grid.steps}", "--metrics.log_freq=1",
           f"--job.dump_folder={workdir / 'outputs'}", f"--autoparallel.metrics_file={metrics}"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=grid.timeout_s)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f"timeout after {exc.timeout}s"
    rows = ([json.loads(line) for line in metrics.read_text().splitlines() if line]
            if metrics.exists() else [])
    return code, rows, output[-3000:]


def read_done(csv_path: Path) -> dict[str, dict[str, str]]:
    """Finished cells by id (the last row wins)."""
    if not csv_path.exists():
        return {}
    with open(csv_path, newline="") as f:
        return {row["cell"]: row for row in csv.DictReader(f)}


def append_row(csv_path: Path, row: dict[str, Any]) -> None:
    new = not csv_path.exists()
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: _fmt(row.get(k, "")) for k in CSV_FIELDS})


def _fmt(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """Interleaving: even rounds run the arms in order, odd rounds reversed, so a linear drift
    in machine speed affects auto and the recipes alike."""
    return list(arms) if round_index % 2 == 0 else list(reversed(arms))


def _heads(family: str, flavor: str) -> tuple[int, int, int]:
    """(query heads, kv heads, routed experts or 0)."""
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    args = get_train_spec(family).model_args[flavor]
    experts = args.moe_args.num_experts if getattr(args, "moe_args", None) else 0
    if (hasattr(args, "moe_enabled") and not args.moe_enabled) or (
            getattr(args, "n_dense_layers", None) == args.n_layers):
        experts = 0
    return args.n_heads, getattr(args, "n_kv_heads", None) or args.n_heads, experts


def run_grid(grid: Grid, out: Path, plans_dir: Path, dry: bool = False,
             rerun_disturbed: float | None = None) -> int:
    """Run every unfinished cell of ``grid``; return the number of cells run. With
    ``rerun_disturbed``, cells measured while other processes used more than that many cores
    count as unfinished (the new row supersedes the old one)."""
    csv_path = out / "sweep.csv"
    done = read_done(csv_path)
    if rerun_disturbed is not None:
        done = {cell: row for cell, row in done.items()
                if float(row.get("foreign_load") or 0.0) <= rerun_disturbed}
    plans_dir.mkdir(parents=True, exist_ok=True)
    cells = [(f"{cfg.id}/{arm}/r{round_index + 1}", cfg, round_index, arm, recipe)
             for cfg, round_index, arm, recipe in _cells(grid)]
    progress = Progress(sum(1 for cell, *_ in cells if cell not in done), "sweep")
    ran = 0
    for cell, cfg, round_index, arm, recipe in cells:
        if cell in done:
            continue
        row = {"cell": cell, "config": cfg.id, "family": cfg.family, "ngpu": cfg.ngpu,
               "global_batch": cfg.global_batch, "seq_len": cfg.seq_len,
               "memory_gib": cfg.memory_gib, "arm": arm, "round": round_index + 1}
        plan_path = plans_dir / f"{cfg.id}.{arm}.json"
        unsupported = recipe is None and cfg.family not in AUTO_FAMILIES
        pred = {} if unsupported else predict(cfg, recipe, plan_path)
        row.update({k: v for k, v in pred.items() if k != "error"})
        budget = cfg.memory_gib or None
        if unsupported:
            row.update(status="unsupported",
                       note=f"auto planning supports {', '.join(AUTO_FAMILIES)}")
        elif "error" in pred and recipe is None:
            row.update(status="plan_error", note=pred["error"])
        elif recipe is not None and budget and pred.get("pred_peak_gib", 0.0) > budget:
            row.update(status="over_budget",
                       note=f"predicted peak {pred['pred_peak_gib']:.3g} GiB > {budget:g} GiB")
        elif dry:
            row.update(status="dry")
        else:
            extra = ([f"--autoparallel.plan_file={plan_path}"] if recipe is None
                     else recipe_overrides(cfg, recipe))
            with tempfile.TemporaryDirectory(prefix="sweep_") as tmp:
                t0 = time.time()
                code, rows, tail, foreign, attempts = measure_run(
                    cfg, grid, extra, recipe is None, Path(tmp))
                row.update(wall_s=time.time() - t0, foreign_load=foreign, attempts=attempts)
            stats = steady_stats(rows, grid.steady_from)
            if code == 0 and stats:
                # a recipe the cost model cannot express is measured without a prediction
                row.update(status="ok", note=pred.get("error", ""), **stats)
            else:
                error = [ln for ln in tail.splitlines() if "Error:" in ln or "error:" in ln]
                row.update(status="failed", note=f"exit {code}: "
                           + (error[-1].strip()[:200] if error else "no metrics"))
                print("    " + "\n    ".join(tail.splitlines()[-15:]), flush=True)
        if not dry:
            append_row(csv_path, row)
        ran += 1
        pred_tps = (cfg.global_batch * cfg.seq_len / row["pred_step_time_s"]
                    if row.get("pred_step_time_s") else float("nan"))
        measured = (f"{row['tokens_per_s']:.0f} tok/s (predicted {pred_tps:.0f})"
                    if row.get("status") == "ok" else
                    f"predicted {pred_tps:.0f} tok/s" if row.get("status") == "dry"
                    else row.get("note", ""))
        progress.advance(f"{cell}: {row['status']} {measured}", stream=sys.stdout)
    return ran


def _cells(grid: Grid):
    """(config, round, arm name, recipe or None for auto) in run order."""
    heads: dict[tuple[str, str], tuple[int, int, int]] = {}
    for cfg in grid.configs:
        key = (cfg.family, cfg.flavor)
        if key not in heads:
            heads[key] = _heads(*key)
        recipes = {r.name: r for r in legal_recipes(cfg, *heads[key])}
        arms = ["auto", *recipes]
        for round_index in range(grid.rounds):
            for arm in arm_order(arms, round_index):
                yield cfg, round_index, arm, recipes.get(arm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", help="grid TOML, e.g. experiments/grids/quick.toml")
    parser.add_argument("--out", default=str(REPO / "experiments" / "results"),
                        help="results folder (sweep.csv is appended; finished cells skipped)")
    parser.add_argument("--dry", action="store_true",
                        help="plan and predict every cell without training")
    parser.add_argument("--rerun-disturbed", type=float, default=None, metavar="CORES",
                        help="re-run cells during which other processes used more than CORES")
    args = parser.parse_args(argv)
    try:
        grid = load_grid(args.grid)
    except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    ran = run_grid(grid, out, out / "plans", dry=args.dry, rerun_disturbed=args.rerun_disturbed)
    print(f"{ran} cells run; results in {out / 'sweep.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
