"""Write train_configs/*.toml: CPU recipe configs and TorchTitan's large presets.

Names follow ``<family>_<flavor>_<recipe>.toml``. The CPU configs are small, fp32, offline
(project tokenizer + corpus) and use TorchTitan's own recipes through plain ``[parallelism]``
degrees. The large presets carry the settings TorchTitan 0.2.2 ships for them, with the data
pointed at the offline corpus and the float8 converter under the key 0.2.2 registers
(``quantize.linear.float8``). Run ``python scripts/make_configs.py`` after editing.
"""

from __future__ import annotations

from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "train_configs"

# recipe -> [parallelism] degrees (dp_shard -1 takes the remaining ranks) and the NGPU it needs.
RECIPES: dict[str, dict] = {
    "fsdp": {"degrees": {}, "ngpu": "any"},
    "tp": {"degrees": {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}, "ngpu": "2"},
    "fsdp_tp": {"degrees": {"tensor_parallel_degree": 2}, "ngpu": "4 (fsdp 2 x tp 2)"},
    "cp": {"degrees": {"context_parallel_degree": 2}, "ngpu": "2 (cp 2), 4 (fsdp 2 x cp 2)"},
    "ep": {"degrees": {"expert_parallel_degree": 2}, "ngpu": "2 or 4 (ep borrows fsdp ranks)"},
    "auto": {"degrees": {"auto": True}, "ngpu": "any (the planner picks the mesh)"},
}
CPU_FAMILIES: dict[str, list[str]] = {
    "llama3": ["fsdp", "tp", "fsdp_tp", "cp", "auto"],
    "qwen3": ["fsdp", "tp", "fsdp_tp", "cp", "auto"],
    "llama4": ["fsdp", "tp", "fsdp_tp", "ep", "cp", "auto"],
    "deepseek_v3": ["fsdp", "tp", "fsdp_tp", "ep", "cp", "auto"],
}
BENCH_RECIPES = ["fsdp", "fsdp_tp"]
# flavor behind <family>_debug_*: qwen3's debugmodel ties embedding and output weights, which
# TorchTitan 0.2.2's FSDP recipe cannot shard; the project registers an untied copy
DEBUG_FLAVOR = {"qwen3": "debugmodel_untied"}
AUTO_FAMILIES = ("llama3", "qwen3", "llama4", "deepseek_v3")  # families the planner covers
# hardware of the large auto presets: 671B's fp32 master weights and AdamW state need more than
# 80 GB per device on 128 devices; 1B / 3B are the single-H200 checks
AUTO_HARDWARE = {"671B": "h200_sxm", "1B": "h200_sxm", "3B": "h200_sxm"}

# Large presets: (family, flavor, recipe name, settings as TorchTitan 0.2.2 ships them).
LARGE: list[tuple[str, str, str, dict]] = [
    # single-GPU presets (Llama 3.2 shapes): TorchTitan's 8B recipe scaled down
    ("llama3", "1B", "fsdp", dict(lr=3e-4, warmup=200, lbs=4, seq=4096, tp=1, ac="selective",
                                   ac_option="op", compile=False, converters=[])),
    ("llama3", "3B", "fsdp", dict(lr=3e-4, warmup=200, lbs=2, seq=8192, tp=1, ac="selective",
                                   ac_option="op", compile=False, converters=[])),
    ("llama3", "8B", "fsdp", dict(lr=3e-4, warmup=200, lbs=1, seq=8192, tp=1, ac="selective",
                                   ac_option="op", compile=False, converters=[])),
    ("llama3", "70B", "fsdp_tp", dict(lr=1.5e-4, warmup=200, lbs=8, seq=8192, tp=8, ac="full",
                                       compile=False, converters=[])),
    ("llama3", "405B", "fsdp_tp", dict(lr=8e-5, warmup=600, lbs=2, seq=8192, tp=8, ac="full",
                                        compile=True, async_tp=True,
                                        converters=["quantize.linear.float8"],
                                        float8_fsdp=True)),
    ("qwen3", "32B", "fsdp", dict(lr=8e-4, warmup=600, lbs=2, seq=4096, tp=1, ac="full",
                                   compile=False, converters=[])),
    ("deepseek_v3", "16B", "fsdp_ep", dict(lr=2.2e-4, warmup=200, lbs=4, seq=4096, tp=1, ep=8,
                                            ac="selective", ac_option="op", compile=True,
                                            compile_components=["loss"], converters=[])),
    ("deepseek_v3", "671B", "fsdp", dict(lr=2.2e-4, warmup=2000, lbs=4, seq=4096, tp=1, ep=1,
                                          ac="selective", ac_option="op", compile=True,
                                          compile_components=["loss"], converters=[])),
    ("llama4", "17bx16e", "fsdp_tp", dict(lr=4e-3, warmup=600, lbs=8, seq=8192, tp=8, etp=8,
                                           ac="full", compile=False, converters=[])),
]


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def _toml(header: str, sections: dict[str, dict]) -> str:
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name, body in sections.items():
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def cpu_config(family: str, flavor: str, recipe: str) -> str:
    parallelism = {
        "data_parallel_replicate_degree": 1,
        "data_parallel_shard_degree": -1,
        "tensor_parallel_degree": 1,
        "context_parallel_degree": 1,
        "expert_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
        **RECIPES[recipe]["degrees"],
    }
    if recipe == "auto":  # a key set under auto is a constraint: the degrees stay unset
        parallelism = dict(RECIPES[recipe]["degrees"])
    what = "auto-parallel plan" if recipe == "auto" else f"TorchTitan recipe '{recipe}'"
    header = (
        f"{family} {flavor}, {what}, CPU (gloo), fp32.\n"
        f"NGPU: {RECIPES[recipe]['ngpu']}. Generated by scripts/make_configs.py."
    )
    sections = {
        "job": {"dump_folder": "./outputs", "description": f"{family} {flavor} {recipe}"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "model": {"name": family, "flavor": flavor, "hf_assets_path": "./assets/tokenizer"},
        "optimizer": {"name": "AdamW", "lr": 8e-4, "eps": 1e-8},
        "lr_scheduler": {"warmup_steps": 2, "decay_ratio": 0.8, "decay_type": "linear",
                         "min_lr_factor": 0.0},
        "training": {"local_batch_size": 2, "global_batch_size": 16, "seq_len": 256,
                     "max_norm": 1.0, "steps": 10, "dataset": "autoparallel_text",
                     "mixed_precision_param": "float32", "mixed_precision_reduce": "float32"},
        "parallelism": parallelism,
        "checkpoint": {"enable": False, "folder": "checkpoint"},
        "activation_checkpoint": {"mode": "none"},
        "compile": {"enable": False},
        "debug": {"seed": 0},
    }
    if recipe == "auto":
        sections["autoparallel"] = {"hardware": "cpu"}
    return _toml(header, sections)


def large_config(family: str, flavor: str, recipe: str, s: dict) -> str:
    header = (
        f"{family} {flavor}: TorchTitan 0.2.2's preset ({recipe}), for GPUs; on CPU use it\n"
        "for dry runs: NGPU=128 COMM_MODE=fake_backend CONFIG_FILE=<this file> ./run_train.sh\n"
        "Data points at the offline corpus. Generated by scripts/make_configs.py."
    )
    ac = {"mode": s["ac"]}
    if "ac_option" in s:
        ac["selective_ac_option"] = s["ac_option"]
    sections = {
        "job": {"dump_folder": "./outputs", "description": f"{family} {flavor} training"},
        "metrics": {"log_freq": 10, "enable_tensorboard": False},
        "model": {"name": family, "flavor": flavor, "hf_assets_path": "./assets/tokenizer",
                  "converters": s["converters"]},
        "optimizer": {"name": "AdamW", "lr": s["lr"], "eps": 1e-8},
        "lr_scheduler": {"warmup_steps": s["warmup"]},
        "training": {"local_batch_size": s["lbs"], "seq_len": s["seq"], "max_norm": 1.0,
                     "steps": 1000, "dataset": "autoparallel_text"},
        "parallelism": {
            "data_parallel_replicate_degree": 1,
            "data_parallel_shard_degree": -1,
            "tensor_parallel_degree": s["tp"],
            "enable_async_tensor_parallel": s.get("async_tp", False),
            "pipeline_parallel_degree": 1,
            "context_parallel_degree": 1,
            "expert_parallel_degree": s.get("ep", 1),
            "expert_tensor_parallel_degree": s.get("etp", 1),
        },
        "checkpoint": {"enable": False, "folder": "checkpoint", "last_save_model_only": True},
        "activation_checkpoint": ac,
        "compile": {"enable": s["compile"],
                    "components": s.get("compile_components", ["model", "loss"])},
    }
    if recipe == "auto":
        # the planner does not model float8 / compile yet: plain bf16 training
        s = {**s, "converters": [], "float8_fsdp": False}
        sections["model"]["converters"] = []
        sections["compile"]["enable"] = False
        # a key set under auto is a constraint: the degrees stay unset (searched)
        sections["parallelism"] = {"auto": True}
        sections["activation_checkpoint"] = {"mode": "none"}
        sections["autoparallel"] = {"hardware": AUTO_HARDWARE.get(flavor, "h100_sxm"),
                                    "gpus_per_node": 8}
    if s.get("float8_fsdp"):
        sections["quantize.linear.float8"] = {
            "enable_fsdp_float8_all_gather": True,
            "precompute_float8_dynamic_scale_for_fsdp": True,
            "filter_fqns": ["output"],
        }
    return _toml(header, sections)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    files: dict[str, str] = {}
    for family, recipes in CPU_FAMILIES.items():
        for recipe in recipes:
            flavor = DEBUG_FLAVOR.get(family, "debugmodel")
            files[f"{family}_debug_{recipe}.toml"] = cpu_config(family, flavor, recipe)
        bench = BENCH_RECIPES + (["auto"] if family in AUTO_FAMILIES else [])
        for recipe in bench:
            files[f"{family}_bench_{recipe}.toml"] = cpu_config(family, "bench", recipe)
    for family, flavor, recipe, settings in LARGE:
        files[f"{family}_{flavor.lower()}_{recipe}.toml"] = large_config(
            family, flavor, recipe, settings
        )
        if family in AUTO_FAMILIES:
            files[f"{family}_{flavor.lower()}_auto.toml"] = large_config(
                family, flavor, "auto", settings
            )
    for name, text in sorted(files.items()):
        (OUT / name).write_text(text)
    print(f"wrote {len(files)} configs to {OUT}")


if __name__ == "__main__":
    main()
