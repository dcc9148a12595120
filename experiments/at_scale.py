"""Simulated at-scale sweep: predicted tokens/s of auto vs every recipe on H100s.

For each model preset and world size: the auto plan (``plan_job`` on the ``h100_sxm``
profile), TorchTitan's shipped recipe for the model (its config's degrees and AC, where they
divide the world size), and every legal variant (dp_replicate x dp_shard x cp x tp meshes,
tp <= 8 inside a node, AC none / selective / full), all costed by the same model
(``recipe_plan``). Recipes predicted to exceed device memory do not count as winners. Each auto
plan is then dry-run on fake ranks (``COMM_MODE=fake_backend``, the plan replayed from its
JSON) to show it applies. Weak scaling: the global batch is the shipped local batch x world.
MoE presets (deepseek_v3, llama4) add every legal recipe-parallel layout (ep / etp by
TorchTitan's rules) to the recipe variants. DeepSeek-V3 671B does not fit 80 GB devices at these
sizes (fp32 master weights and AdamW moments: 97.6 GiB per device on 128), so it is costed on
H200s (``MODEL_HW``). Both sides of a row run the same features: the auto job is the shipped
recipe's config with ``parallelism.auto`` on and the settings the search decides left to it
(``auto_config``), so it keeps the recipe's converters, float8 recipe / filter / all-gather,
compile and async TP (llama3 405B: float8 + compile + async TP; DeepSeek-V3: the loss compiled).

Each row also gets the sub-block column (``sub_block_column``): the best per-block plan (the
search with its default techniques) against the best sub-block plan (the same search with
``tp_sub_block``), both predicted on the auto preset (no float8, no compile: ``tp_sub_block``
is not applied to compiled blocks); families whose adapter names no sub-blocks get "n/a".

    python experiments/at_scale.py [--models llama3_8b,...] [--worlds 8,16,...] [--no-dry-run]
        [--redo] [--no-sub-block] [--redo-sub-block]

Writes experiments/results/at_scale.csv, at_scale.md and at_scale.png. Rows are keyed by
(model, world) and finished rows are kept, so the script resumes (``--redo``: evaluate the
rows asked for again); a kept row without the sub-block column gets it. The committed results:
the default grid, and ``--models llama3_8b,llama3_70b,llama3_405b --worlds 256,512`` (the
dense Llama rows where the sub-block search is asked whether it pays at larger scale).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.sweep import _divisors, _heads  # noqa: E402

MODELS: dict[str, tuple[str, str]] = {
    "llama3_8b": ("llama3_8b_auto.toml", "llama3_8b_fsdp.toml"),
    "llama3_70b": ("llama3_70b_auto.toml", "llama3_70b_fsdp_tp.toml"),
    "llama3_405b": ("llama3_405b_auto.toml", "llama3_405b_fsdp_tp.toml"),
    "qwen3_32b": ("qwen3_32b_auto.toml", "qwen3_32b_fsdp.toml"),
    "deepseek_v3_16b": ("deepseek_v3_16b_auto.toml", "deepseek_v3_16b_fsdp_ep.toml"),
    "deepseek_v3_671b": ("deepseek_v3_671b_auto.toml", "deepseek_v3_671b_fsdp.toml"),
    "llama4_17bx16e": ("llama4_17bx16e_auto.toml", "llama4_17bx16e_fsdp_tp.toml"),
}
"""model -> (auto preset, TorchTitan's shipped recipe config), both under train_configs/. The
auto job is the recipe's config with the search's settings left to it (``auto_config``); the
auto preset gives its ``[autoparallel]`` table."""
SEARCHED = {"parallelism": ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                            "tensor_parallel_degree", "context_parallel_degree",
                            "expert_parallel_degree", "expert_tensor_parallel_degree",
                            "pipeline_parallel_degree", "pipeline_parallel_schedule",
                            "pipeline_parallel_microbatch_size", "fsdp_reshard_after_forward"),
            "activation_checkpoint": None}
"""What the auto job leaves to the search (a set key is a constraint under auto): the mesh
degrees, the pipeline schedule, resharding and the whole ``[activation_checkpoint]`` table."""
WORLDS = (8, 16, 32, 64, 128)
HW = "h100_sxm"
MODEL_HW = {"deepseek_v3_671b": "h200_sxm"}
ACS = ("none", "selective", "full")
OLD_COLUMNS = {"best_expert": "best_recipe", "best_expert_tps": "best_recipe_tps",
               "experts_costed": "recipes_costed", "experts_fit": "recipes_fit"}
"""Columns of older at_scale.csv files, read under their current names."""
FIELDS = ["model", "world", "global_batch", "auto_status", "auto_mesh", "auto_tps",
          "auto_peak_gib", "shipped", "shipped_tps", "shipped_fits", "best_recipe",
          "best_recipe_tps", "recipes_costed", "recipes_fit", "vs_best", "vs_shipped",
          "dry_run", "note", "per_block_tps", "sub_block_tps", "sub_block_vs_per_block",
          "sub_block_mesh", "sub_block_modes"]
SUB_BLOCK = "--autoparallel.techniques=fsdp,hsdp,ddp,tp,tp_dp,cp,ep,ac,pp,tp_sub_block"
"""The default techniques and ``tp_sub_block`` (attention and feed-forward each TP + SP or
data parallel over tp: tp modes "dp/sp" and "sp/dp", and with the stream sharded on the batch
"dp/sp:batch", "sp/dp:batch", "sp/sp:batch"; "sp/sp:a2a"; "sp/tp@dp_shard"; the embedding looked
up on its embedding dim, "dim" or "dim:gather"), for the sub-block column."""


@functools.cache
def _config_dir() -> Path:
    import atexit
    import shutil

    path = Path(tempfile.mkdtemp(prefix="at_scale_configs_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def auto_config(model: str) -> str:
    """The auto job's config file: the shipped recipe's TOML (its converters, float8 recipe and
    filter, compile, async TP, batch, everything that changes speed) without the settings the
    search decides (``SEARCHED``), with ``parallelism.auto`` on and the auto preset's
    ``[autoparallel]`` table, so both sides of a row run the same features."""
    from torchtitan_autoparallel.errors import tomllib  # (tomli on Python 3.10)

    auto_cfg, shipped_cfg = MODELS[model]
    with open(REPO / "train_configs" / shipped_cfg, "rb") as f:
        data = tomllib.load(f)
    with open(REPO / "train_configs" / auto_cfg, "rb") as f:
        data["autoparallel"] = tomllib.load(f).get("autoparallel", {})
    for table, keys in SEARCHED.items():
        if keys is None:
            data.pop(table, None)
        else:
            data[table] = {k: v for k, v in data.get(table, {}).items() if k not in keys}
    data["parallelism"]["auto"] = True
    path = _config_dir() / f"{model}_auto_same_features.toml"
    path.write_text("\n".join(_toml_lines(data)) + "\n")
    return str(path)


def _toml_lines(data: dict[str, Any], prefix: str = "") -> list[str]:
    """``data`` (tables of strings, numbers, booleans and lists of them) as TOML."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{prefix}{k}]", *_toml_lines(v, f"{prefix}{k}.")]
    return lines


@functools.cache
def parse_config_file(config: str, extra: tuple[str, ...]) -> Any:
    """``train_configs/<config>`` parsed as TorchTitan 0.2.2's trainer parses it, with the
    ``extra`` command-line overrides."""
    from torchtitan_autoparallel.titan.v0_2.job import parse_config
    from torchtitan_autoparallel.titan.v0_2.registry import register

    register()
    return parse_config(["--job.config_file", str(REPO / "train_configs" / config), *extra])


def memoize_layer_graphs() -> None:
    """Build each (model, flavor, seq_len) layer graph once: every recipe variant of a model
    shares it (the graph does not depend on the parallelization)."""
    from torchtitan_autoparallel.job import inputs as planning_inputs

    if getattr(planning_inputs.layer_graph_for, "_memoized", False):
        return
    original = planning_inputs.layer_graph_for
    cache: dict[tuple[str, str, int], Any] = {}

    def layer_graph_for(job_config: Any) -> Any:
        key = (job_config.model.name, job_config.model.flavor, job_config.training.seq_len)
        if key not in cache:
            cache[key] = original(job_config)
        return cache[key]

    layer_graph_for._memoized = True  # type: ignore[attr-defined]
    planning_inputs.layer_graph_for = layer_graph_for


def recipe_variants(world: int, n_heads: int, n_kv: int, seq_len: int, gpus_per_node: int,
                    global_batch: int, num_experts: int = 0
                    ) -> list[tuple[int, int, int, int, int, int, str]]:
    """Legal (dp_replicate, dp_shard, cp, tp, ep, etp, ac) recipes: tp inside a node and dividing
    the heads, cp with seq_len % (2 cp tp) == 0, the global batch split over dp, and for MoE
    models ep = 1 or any layout TorchTitan accepts (``legal_ep``)."""
    from torchtitan_autoparallel.candidates.strategies import legal_ep

    out = []
    for tp in _divisors(min(world, gpus_per_node)):
        if world % tp or n_heads % tp or n_kv % tp:
            continue
        for cp in _divisors(world // tp):
            if cp > 1 and seq_len % (2 * cp * tp):
                continue
            for dr in _divisors(world // tp // cp):
                ds = world // tp // cp // dr
                if global_batch % (dr * ds):
                    continue
                eps = [(1, 1), *(legal_ep(num_experts, ds, cp, tp) if num_experts else [])]
                out.extend((dr, ds, cp, tp, ep, etp, ac) for ep, etp in eps for ac in ACS)
    return out


def _recipe(config: str, world: int, global_batch: int, degrees: tuple[int, ...] | None,
            ac: str | None, hw: str = HW) -> Any:
    """The recipe plan of ``config`` with the given degrees / AC (None: as shipped). The
    parsed config is copied and edited rather than re-parsed (parsing dominates otherwise)."""
    import copy

    from torchtitan_autoparallel.job.request import recipe_plan

    job = copy.deepcopy(parse_config_file(config, ()))
    job.training.global_batch_size = global_batch
    job.autoparallel.hardware = hw
    if degrees is not None:
        dr, ds, cp, tp, ep, etp = degrees
        local = job.training.local_batch_size
        while global_batch % (local * dr * ds):
            local //= 2
        par = job.parallelism
        par.data_parallel_replicate_degree, par.data_parallel_shard_degree = dr, ds
        par.context_parallel_degree, par.tensor_parallel_degree = cp, tp
        par.expert_parallel_degree, par.expert_tensor_parallel_degree = ep, etp
        job.training.local_batch_size = max(local, 1)
    if ac is not None:
        job.activation_checkpoint.mode = ac
        if ac == "selective":
            job.activation_checkpoint.selective_ac_option = "op"
    return recipe_plan(job, world)


def _fits(plan: Any) -> bool:
    return plan.predicted["peak_memory_gib"] <= plan.predicted["budget_gib"]


def evaluate(model: str, world: int) -> dict[str, Any]:
    """One row: auto plan, shipped recipe and the best legal recipe variant, predicted."""
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.job.request import plan_job

    memoize_layer_graphs()
    auto_cfg, shipped_cfg = auto_config(model), MODELS[model][1]
    base = parse_config_file(auto_cfg, ())
    global_batch = base.training.local_batch_size * world
    row: dict[str, Any] = {"model": model, "world": world, "global_batch": global_batch}
    hw = MODEL_HW.get(model, HW)
    extra = (f"--training.global_batch_size={global_batch}", "--parallelism.auto",
             f"--autoparallel.hardware={hw}")
    try:
        auto = plan_job(parse_config_file(auto_cfg, extra), world)
        m = auto.mesh
        row.update(auto_status="ok", auto_tps=auto.predicted["tokens_per_s"],
                   auto_peak_gib=auto.predicted["peak_memory_gib"],
                   auto_mesh=f"{mesh_label(m)} "
                             f"lb{auto.local_batch_size}x{auto.gradient_accumulation_steps}")
        row["_plan"] = auto
    except UserError as exc:
        row.update(auto_status="no plan", note=str(exc)[:160])
    try:
        shipped = _recipe(shipped_cfg, world, global_batch, None, None, hw)
        m = shipped.mesh
        ac = parse_config_file(shipped_cfg, ()).activation_checkpoint.mode
        row.update(shipped=f"{mesh_label(m)} ac:{ac}",
                   shipped_tps=shipped.predicted["tokens_per_s"], shipped_fits=_fits(shipped))
    except UserError as exc:
        row.update(shipped="not legal here", shipped_fits=False,
                   note=(row.get("note", "") + f" shipped: {exc}")[:240])
    ship = parse_config_file(shipped_cfg, ())
    n_heads, n_kv, n_experts = _heads(ship.model.name, ship.model.flavor)
    best, best_name, costed, fit = None, "", 0, 0
    for dr, ds, cp, tp, ep, etp, ac in recipe_variants(
            world, n_heads, n_kv, ship.training.seq_len, 8, global_batch, n_experts):
        try:
            plan = _recipe(shipped_cfg, world, global_batch, (dr, ds, cp, tp, ep, etp), ac, hw)
        except UserError:
            continue
        costed += 1
        if not _fits(plan):
            continue
        fit += 1
        if best is None or plan.predicted["tokens_per_s"] > best.predicted["tokens_per_s"]:
            best, best_name = plan, f"{mesh_label(plan.mesh)} ac:{ac}"
    row.update(recipes_costed=costed, recipes_fit=fit, best_recipe=best_name or "none fits",
               best_recipe_tps=best.predicted["tokens_per_s"] if best else math.nan)
    if row.get("auto_status") == "ok":
        if best is not None:
            row["vs_best"] = row["auto_tps"] / row["best_recipe_tps"]
        if row.get("shipped_fits"):
            row["vs_shipped"] = row["auto_tps"] / row["shipped_tps"]
    return row


def sub_block_column(model: str, world: int) -> dict[str, Any]:
    """Best per-block plan (the default techniques) against best sub-block plan (the same
    search with ``tp_sub_block``), both predicted by the current model; "n/a" where the model's
    family names no sub-blocks (``ModelAdapter.sub_blocks``) or no plan fits."""
    from torchtitan_autoparallel.candidates.layout import SUB_BLOCK_TP_MODES
    from torchtitan_autoparallel.errors import UserError
    from torchtitan_autoparallel.job.request import plan_job

    memoize_layer_graphs()
    auto_cfg = MODELS[model][0]  # the auto preset: tp_sub_block is not applied under compile
    global_batch = parse_config_file(auto_cfg, ()).training.local_batch_size * world
    extra = (f"--training.global_batch_size={global_batch}", "--parallelism.auto",
             f"--autoparallel.hardware={MODEL_HW.get(model, HW)}")
    try:
        sub = plan_job(parse_config_file(auto_cfg, (*extra, SUB_BLOCK)), world)
    except UserError as exc:
        why = "names no sub-blocks" if "ModelAdapter.sub_blocks" in str(exc) else "no plan fits"
        return {"sub_block_mesh": f"n/a ({why})"}
    per_block = plan_job(parse_config_file(auto_cfg, extra), world)
    modes: dict[str, int] = {}
    for layer in sub.layers:
        if layer.kind == "block" and layer.tp_mode in SUB_BLOCK_TP_MODES:
            modes[layer.tp_mode] = modes.get(layer.tp_mode, 0) + 1
    per, best = (p.predicted["tokens_per_s"] for p in (per_block, sub))
    embedding = [f"embedding {sub.embedding_mode}"] if sub.embedding_mode else []
    return {"per_block_tps": per, "sub_block_tps": best, "sub_block_vs_per_block": best / per,
            "sub_block_mesh": f"{mesh_label(sub.mesh)} lb{sub.local_batch_size}x"
                              f"{sub.gradient_accumulation_steps}",
            "sub_block_modes": " ".join([*(f"{m} x{n}" for m, n in sorted(modes.items())),
                                         *embedding]) or "none"}


def mesh_label(m: Any) -> str:
    """A mesh in the tables' short form ("pp4 dr1 ds16 cp1 tp1 ep16/1")."""
    ep = f" ep{m.ep}/{m.etp}" if m.ep > 1 else ""
    pp = f"pp{m.pp} " if m.pp > 1 else ""
    return f"{pp}dr{m.dp_replicate} ds{m.dp_shard} cp{m.cp} tp{m.tp}{ep}"


def dry_run(model: str, world: int, plan: Any, timeout_s: int = 900) -> str:
    """Replay ``plan`` on ``world`` fake ranks; "ok" or the failure's last line."""
    auto_cfg = auto_config(model)
    with tempfile.TemporaryDirectory(prefix="at_scale_") as tmp:
        path = Path(tmp) / "plan.json"
        plan.save(str(path))
        env = {**os.environ, "NGPU": str(world), "COMM_MODE": "fake_backend",
               "CONFIG_FILE": str(REPO / "train_configs" / auto_cfg),
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [str(REPO / "run_train.sh"), f"--autoparallel.plan_file={path}",
               f"--training.global_batch_size={plan.global_batch_size}",
               f"--job.dump_folder={tmp}/out"]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"timeout after {timeout_s}s"
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 and "dry run OK" in out:
            return "ok"
        lines = [ln for ln in out.splitlines() if ln.strip()]
        return f"failed (exit {proc.returncode}): {lines[-1][:160] if lines else ''}"


def _fmt(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def write_outputs(rows: list[dict[str, Any]], out: Path) -> None:
    order = list(MODELS)
    rows = sorted(rows, key=lambda r: (order.index(r["model"]) if r["model"] in order
                                       else len(order), int(r["world"])))
    with open(out / "at_scale.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: _fmt(r.get(k, "")) for k in FIELDS} for r in rows)
    lines = ["# Simulated at scale: auto vs TorchTitan recipes on H100s (predicted)", "",
             "Cost model: `h100_sxm` profile. Weak scaling (global batch = shipped local batch "
             "x world). Experts: every legal dp_replicate x dp_shard x cp x tp mesh (tp <= 8) "
             "x AC none/selective/full (x every legal ep / etp for MoE); only those predicted "
             "to fit the device (80 GB; 671B on 141 GB H200s) count. Dry run: the "
             "auto plan replayed on fake ranks (`COMM_MODE=fake_backend`). Both sides run the "
             "same features: the auto job is the shipped recipe's config with "
             "`parallelism.auto` on and the mesh degrees, pipeline settings, resharding and "
             "AC left to the search, so it keeps the recipe's converters, float8 filter and "
             "all-gather, compile and async TP (llama3 405B: float8 + compile + async TP; "
             "DeepSeek-V3: the loss compiled).", "",
             "| model | GPUs | auto mesh | auto tok/s | shipped recipe | shipped tok/s | "
             "best recipe | best tok/s | auto / best | auto / shipped | dry run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shipped = (f"{float(r['shipped_tps']):.4g}" + ("" if r.get("shipped_fits") in
                                                       (True, "True") else " (OOM)")
                   if r.get("shipped_tps") not in (None, "") else "")
        lines.append(
            f"| {r['model']} | {r['world']} | {r.get('auto_mesh', r.get('auto_status'))} | "
            f"{_num(r.get('auto_tps'))} | {r.get('shipped', '')} | {shipped} | "
            f"{r.get('best_recipe', '')} | {_num(r.get('best_recipe_tps'))} | "
            f"{_num(r.get('vs_best'), '.3f')} | {_num(r.get('vs_shipped'), '.3f')} | "
            f"{r.get('dry_run', '')} |")
    (out / "at_scale.md").write_text("\n".join(lines + sub_block_lines(rows)) + "\n")
    _plot(rows, out / "at_scale.png")


def sub_block_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The sub-block column's table: best per-block plan against best sub-block plan."""
    lines = ["", "## Per-block against sub-block plans (predicted)", "",
             "Best per-block plan (the search with its default techniques) against best "
             "sub-block plan (the same search with `tp_sub_block`: a block's attention and "
             "feed-forward may each take TP + SP or the tp dim as data parallel, tp modes "
             "`dp/sp` and `sp/dp` on TorchTitan's sequence-sharded stream (a data-parallel "
             "feed-forward per token on the sequence shard, a data-parallel attention "
             "through all-to-alls), or `dp/sp:batch`, "
             "`sp/dp:batch` and `sp/sp:batch` with the stream sharded on the batch over tp, "
             "where a data-parallel sub-block needs no all-to-all; or `sp/sp:a2a`, the "
             "attention's output projection whole on the sequence shard; or `sp/tp@dp_shard`, "
             "the feed-forward TP over dp_shard; and the embedding "
             "looked up on its embedding dim, `dim` over dp_shard x tp or `dim:gather` over "
             "dp_shard with its table gathered over tp), both planned by the current "
             "model in the same run on the auto presets (no float8, no compile: `tp_sub_block` "
             "is not applied to compiled blocks, so llama3 405B's per-block tok/s here is not "
             "its auto tok/s above; the auto rows above are kept from their own run). Dense "
             "blocks take them where the family's adapter names the sub-blocks (llama3; "
             "qwen3 does not); MoE blocks take `sp/dp` (attention TP + SP, the MoE data "
             "parallel over tp on the sequence shard, routed experts expert parallel with "
             "etp = 1 or sharded with the MoE).", "",
             "| model | GPUs | per-block tok/s | sub-block tok/s | sub-block / per-block | "
             "sub-block plan's mesh | blocks in sub-block modes |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("sub_block_mesh") or str(r["sub_block_mesh"]).startswith(
                "n/a (names no"):
            continue
        lines.append(f"| {r['model']} | {r['world']} | {_num(r.get('per_block_tps'), '.6g')} | "
                     f"{_num(r.get('sub_block_tps'), '.6g')} | "
                     f"{_num(r.get('sub_block_vs_per_block'), '.4f')} | {r['sub_block_mesh']} | "
                     f"{r.get('sub_block_modes', '')} |")
    return lines


def _num(value: Any, spec: str = ".4g") -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return ""
    return "" if math.isnan(v) else format(v, spec)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rs = [r for r in rows if r["model"] == model]
        worlds = [int(r["world"]) for r in rs]
        for key, label, marker in (("auto_tps", "auto", "o"), ("best_recipe_tps",
                                   "best recipe", "s"), ("shipped_tps", "shipped", "x")):
            ys = [float(r[key]) if r.get(key) not in (None, "") else math.nan for r in rs]
            if key == "shipped_tps":  # a recipe predicted to run out of memory is no point
                ys = [y if r.get("shipped_fits") in (True, "True") else math.nan
                      for y, r in zip(ys, rs, strict=True)]
            ax.plot(worlds, ys, marker=marker, label=label)
        ax.set_xscale("log", base=2)
        if any(float(r.get("auto_tps") or 0) > 0 or float(r.get("best_recipe_tps") or 0) > 0
               for r in rs):
            ax.set_yscale("log")  # (a model with no feasible plan yet has nothing to scale)
        ax.set_title(model)
        ax.set_xlabel("H100s")
    axes[0][0].set_ylabel("predicted tokens/s")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--no-dry-run", action="store_true")
    parser.add_argument("--redo", action="store_true", help="evaluate the rows of --models x "
                        "--worlds again (finished rows are kept otherwise)")
    parser.add_argument("--no-sub-block", action="store_true", help="leave the sub-block "
                        "column (best per-block vs best sub-block plan) out")
    parser.add_argument("--redo-sub-block", action="store_true", help="evaluate the sub-block "
                        "column of the rows asked for again (the rest of a finished row kept)")
    parser.add_argument("--out", default=str(REPO / "experiments" / "results"))
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"error: unknown models {unknown}; choose from {list(MODELS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done: dict[tuple[str, int], dict[str, Any]] = {}
    if (out / "at_scale.csv").exists():
        with open(out / "at_scale.csv", newline="") as f:
            done = {(r["model"], int(r["world"])): {OLD_COLUMNS.get(k, k): v for k, v in r.items()}
                    for r in csv.DictReader(f)}
    rows = []
    for model in models:
        for world in map(int, args.worlds.split(",")):
            old = done.get((model, world))
            # finished: no auto plan, or its dry run passed (a failed one is tried again)
            if old and not args.redo and (old.get("dry_run") == "ok" or args.no_dry_run
                                          or old["auto_status"] != "ok"):
                row = old
            else:
                row = evaluate(model, world)
                plan = row.pop("_plan", None)
                if plan is not None and not args.no_dry_run:
                    row["dry_run"] = dry_run(model, world, plan)
            if not args.no_sub_block and (args.redo_sub_block or not row.get("sub_block_mesh")):
                row.update(sub_block_column(model, world))
            rows.append(row)
            print(f"{model} x{world}: auto {row.get('auto_mesh', row.get('auto_status'))} "
                  f"{_num(row.get('auto_tps'))} tok/s, best recipe {row['best_recipe']} "
                  f"{_num(row.get('best_recipe_tps'))}, dry run {row.get('dry_run', '-')}, "
                  f"sub-block {row.get('sub_block_mesh', '-')} "
                  f"{_num(row.get('sub_block_vs_per_block'), '.4f')}", flush=True)
            write_outputs(rows + [r for k, r in done.items() if k not in
                                  {(x["model"], int(x["world"])) for x in rows}], out)
    ran = {(r["model"], int(r["world"])) for r in rows}
    write_outputs(rows + [r for k, r in done.items() if k not in ran], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
