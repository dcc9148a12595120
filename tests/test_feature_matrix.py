"""TorchTitan 0.2.2's integration feature matrix (``tests/integration_tests/features.py``, vendored
as data in ``torchtitan_features/``) run under ``[parallelism] auto = true``.

Each case runs as TorchTitan runs it (one ``run_train.sh`` call per list of override arguments,
the same world size) on ``llama3_debug_auto.toml``: 3 steps of PARITY_OVERRIDES' small fp32 job
(``--training.steps 10 / 20`` of the save / resume cases become 3 / 5), the last checkpoint a
full one (as TorchTitan's base config), compile on the ``aot_eager`` backend, validation
sequences as long as the training's, the HF checkpoint path the first run writes. A degree a case
sets is a constraint under auto; everything it leaves unset is searched. Every vendored case has
one expected outcome in ``EXPECTED``:

- TRAINS: exit 0, the asked-for features in effect (read from the saved plan and the log; a
  setting the plan makes moot is named in its notes), and, from a seed checkpoint, the losses of
  TorchTitan's own recipe running the same case (``recipe``) or of the 1-rank reference
  (``assert_parity``) where the case keeps the model, the data and the numerics;
- REFUSED: one ``error:`` line naming the setting, exit 2, before any rank starts (``at_run``:
  the runs before it train);
- CPU_IMPOSSIBLE: the case needs a GPU; the project refuses it the same way on this machine.

``-m "not slow"`` runs one case per feature family; ``-m slow`` the rest.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from torchtitan_autoparallel.plan.schema import Plan, plan_shards_with_fsdp

from tests.support.parity import PARITY_OVERRIDES, RunResult, assert_parity, run_job

DATA = Path(__file__).resolve().parent / "torchtitan_features" / "features_v0_2_2.json"
MATRIX = json.loads(DATA.read_text())
DEFINITIONS: dict[str, dict] = {case["test_name"]: case for case in MATRIX["definitions"]}
CONFIG = "llama3_debug_auto.toml"
RECIPE = "llama3_debug_fsdp.toml"
SIGABRT = "Signal 6 (SIGABRT)"
"""How torchrun reports a rank that aborted."""
STEPS = {"10": "3", "20": "5"}
BASE = ("--training.steps=3", "--checkpoint.no-last_save_model_only")
"""Every run: 3 steps, and the last checkpoint a full one, as TorchTitan's
``tests/integration_tests/base_config.toml`` sets it (TorchTitan's default saves the model only,
which a resume cannot load)."""
SEQ_LEN = next(int(arg.split("=")[1]) for arg in PARITY_OVERRIDES
               if arg.startswith("--training.seq_len="))
"""TorchTitan's save (10) and resume (20) step counts, shortened; a run without one runs 3."""

TRAINS, REFUSED, CPU_IMPOSSIBLE = "TRAINS", "REFUSED", "CPU_IMPOSSIBLE"


@dataclass(frozen=True)
class Expected:
    """One case's outcome under auto on this CPU machine."""

    outcome: str
    message: str = ""
    """REFUSED / CPU_IMPOSSIBLE: a substring of the one error line."""
    reason: str = ""
    """CPU_IMPOSSIBLE: what the case needs that a CPU lacks."""
    mesh: dict[str, int] = field(default_factory=dict)
    """TRAINS: mesh degrees the plan must have."""
    tp_blocks: bool = False
    """TRAINS: some block runs TP + SP (not the tp dim used as data parallel)."""
    schedule: str = ""
    """TRAINS: the pipeline schedule the plan runs."""
    ac: str = ""
    """TRAINS: the activation checkpointing every block runs (pinned by the case)."""
    compiled: bool = False
    checkpoint: str = ""
    """TRAINS: a file the runs must leave under the dump folder (glob)."""
    parity: bool = True
    """TRAINS: compare the first run's losses with the 1-rank reference from a seed checkpoint
    (False where the case writes its own checkpoints or changes the model or its numerics)."""
    log: str = ""
    """TRAINS: a line the log must contain."""
    fsdp_only: str = ""
    """TRAINS: an FSDP-only setting the case sets: on a plan without FSDP the plan's notes
    say it has no effect (``fsdp_reshard_after_forward``: otherwise every block reshards)."""
    local_batch: int = 0
    """TRAINS: the ``training.local_batch_size`` the case sets: the plan runs it, or its notes
    say it was searched (auto picks the local batch for the global one)."""
    recipe: bool = False
    """TRAINS: compare with TorchTitan's own recipe running the case's first override list
    (``llama3_debug_fsdp.toml``: explicit degrees, no auto) instead of the 1-rank reference."""
    at_run: int = 0
    """REFUSED: the run (index into the case's override lists) that is refused; the runs
    before it train (and are checked as TRAINS)."""
    skip_run: tuple[int, str] | None = None
    """A run that is not ``run_train.sh`` in TorchTitan either, and why it is left out."""
    ci: bool = False
    xfail: str = ""


SET_AC = "activation checkpointing from the plan (activation_checkpoint.mode = '{}' on every block)"
"""A written AC mode is a constraint on every block under auto; the log says so (README:
settings table)."""
RESHARD = "parallelism.fsdp_reshard_after_forward"
FLEX = "uses flex attention, whose backward torch runs on CUDA only"
AOT_EAGER_TP = "compile.backend = 'aot_eager' cannot train tensor-parallel blocks on CPU"

EXPECTED: dict[str, Expected] = {
    "default": Expected(CPU_IMPOSSIBLE, "profiling.enable_profiling needs a GPU",
                        reason="TorchTitan's profiler traces CUDA kernels", ci=True),
    "1d_compile": Expected(TRAINS, compiled=True),
    "1d_compile_sac_op": Expected(TRAINS, compiled=True, ac="selective",
                                  log=SET_AC.format("selective"), ci=True),
    "2d_eager": Expected(TRAINS, mesh={"tp": 2}, tp_blocks=True, ci=True),
    "2d_compile": Expected(REFUSED, AOT_EAGER_TP),
    "2d_asynctp_compile": Expected(REFUSED, AOT_EAGER_TP, ci=True),
    "full_checkpoint": Expected(TRAINS, checkpoint="checkpoint/step-5", parity=False),
    "model_only_hf_checkpoint": Expected(TRAINS, checkpoint="hf_checkpoint/step-3/*.safetensors",
                                         parity=False),
    "last_save_model_only_fp32": Expected(TRAINS, checkpoint="checkpoint/step-3", parity=False),
    "last_save_model_only_bf16": Expected(TRAINS, checkpoint="checkpoint/step-3", parity=False),
    "pp_looped_zero_bubble": Expected(REFUSED, "has 6 blocks"),
    "pp_zbv": Expected(TRAINS, mesh={"pp": 2}, schedule="ZBVZeroBubble"),
    "pp_1f1b": Expected(TRAINS, mesh={"pp": 2, "dp_shard": 1}, schedule="1F1B", recipe=True,
                        ci=True),
    "pp_gpipe": Expected(TRAINS, mesh={"pp": 2, "dp_shard": 1}, schedule="GPipe", recipe=True),
    "pp_dp_1f1b": Expected(REFUSED, "pipeline_parallel_layers_per_stage is set with auto = true",
                           at_run=1, mesh={"pp": 2, "dp_shard": 2}, schedule="1F1B"),
    "pp_dp_gpipe": Expected(TRAINS, mesh={"pp": 2, "dp_shard": 2}, schedule="GPipe",
                            recipe=True),
    "pp_tp": Expected(TRAINS, mesh={"pp": 2, "tp": 2}, tp_blocks=True, recipe=True),
    "pp_dp_tp": Expected(TRAINS, mesh={"pp": 2, "dp_shard": 2, "tp": 2}, tp_blocks=True,
                         checkpoint="checkpoint/step-5", parity=False),
    "3d_compile": Expected(REFUSED, AOT_EAGER_TP),
    "pp_looped_1f1b": Expected(REFUSED, "runs at least 2 stages per rank"),
    "pp_custom_csv": Expected(REFUSED, "not a custom CSV schedule"),
    "optimizer_foreach": Expected(TRAINS),
    # not against TorchTitan's DDP recipe: it averages gradients on top of its global-token loss
    # normalisation (gradient norms 1 / dp of one rank's; README, strategies.py)
    "ddp": Expected(TRAINS, mesh={"dp_replicate": 4, "dp_shard": 1}),
    "hsdp": Expected(TRAINS, mesh={"dp_replicate": 2, "dp_shard": 2}, recipe=True),
    "fsdp+flex_attn": Expected(CPU_IMPOSSIBLE, FLEX, reason="FlexAttention has no CPU backward",
                               ci=True),
    "fsdp+flex_attn+per_op_sac": Expected(CPU_IMPOSSIBLE, FLEX,
                                          reason="FlexAttention has no CPU backward"),
    "fsdp+varlen_attn+per_op_sac": Expected(
        CPU_IMPOSSIBLE, "uses varlen attention, which runs on CUDA only",
        reason="varlen attention is torch's flash-attention kernel, CUDA only"),
    # one run of four ended in a SIGSEGV of a rank inside the ring attention's backward (gloo)
    "cp_allgather": Expected(TRAINS, mesh={"cp": 4}),
    "cp_alltoall": Expected(TRAINS, mesh={"cp": 4}, recipe=True),
    "hsdp+tp": Expected(TRAINS, mesh={"dp_replicate": 2, "dp_shard": 2, "tp": 2}, tp_blocks=True,
                        recipe=True),
    "fsdp+cp": Expected(TRAINS, mesh={"dp_shard": 2, "cp": 2}, recipe=True, ci=True),
    "hsdp+cp_without_dp_shard": Expected(TRAINS, mesh={"dp_replicate": 2, "dp_shard": 1, "cp": 2},
                                         recipe=True),
    "hsdp+cp_with_dp_shard": Expected(TRAINS, mesh={"dp_replicate": 2, "dp_shard": 2, "cp": 2},
                                      recipe=True),
    "fsdp+tp+cp": Expected(TRAINS, mesh={"dp_shard": 2, "tp": 2, "cp": 2}, tp_blocks=True,
                           recipe=True),
    "cpu_offload+opt_in_bwd+TP+DP+CP": Expected(
        CPU_IMPOSSIBLE, "training.enable_cpu_offload moves FSDP state",
        reason="TorchTitan adds a second gloo backend for CPU offload, which gloo refuses"),
    "fsdp2_memory_estimation": Expected(REFUSED, "memory_estimation.enable with auto = true"),
    "test_generate": Expected(TRAINS, checkpoint="checkpoint/step-3/*.distcp", parity=False,
                              skip_run=(1, "TorchTitan's second run is its generation script "
                                        "(scripts/generate, not in the torchtitan wheel), not "
                                        "run_train.sh")),
    "fsdp_reshard_always": Expected(TRAINS, fsdp_only=RESHARD, recipe=True),
    "optional_checkpoint": Expected(TRAINS, mesh={"tp": 2}, checkpoint="checkpoint/step-5",
                                    parity=False),
    "float8_emulation": Expected(TRAINS, parity=False,
                                 log="Float8 tensorwise scaled training active",
                                 fsdp_only="quantize.linear.float8.enable_fsdp_float8_all_gather"),
    "gradient_accumulation": Expected(TRAINS, local_batch=8, recipe=True),
    "validation_tp_cp_pp": Expected(
        REFUSED, "validation.enable with pipeline_parallel_degree = 2: TorchTitan's validator "
        "runs the training's pipeline schedule"),
    "dataloader_kwargs": Expected(REFUSED, "training.dataloader.num_workers = 2"),
}


def case_runs(name: str, dump: Path) -> list[list[str]]:
    """The case's ``run_train.sh`` override lists, adapted: step counts shortened, compile on
    ``aot_eager``, the HF checkpoint path the first run writes, the plan saved per run."""
    runs = []
    skip = EXPECTED[name].skip_run
    for index, override_args in enumerate(DEFINITIONS[name]["override_args"]):
        if skip is not None and index == skip[0]:
            continue
        args = shlex.split(" ".join(override_args).replace(
            MATRIX["checkpoint_path_placeholder"], str(dump / "outputs/hf_checkpoint/step-3")))
        adapted = list(BASE)
        for i, arg in enumerate(args):
            if i and args[i - 1] == "--training.steps":
                arg = STEPS.get(arg, arg)
            adapted.append(arg)
            if arg == "--compile.enable":
                adapted.append("--compile.backend=aot_eager")
            if arg == "--validation.enable":  # TorchTitan's sequences are 2048 in both
                adapted.append(f"--validation.seq_len={SEQ_LEN}")
        runs.append([*adapted, f"--autoparallel.save_plan={dump / f'plan_{index}.json'}"])
    return runs


def run_case(name: str, tmp_path: Path, seed: Path | None) -> tuple[list[RunResult], float]:
    """Run every override list of the case in order (stopping at a failure); the results and
    the wall time."""
    expected = EXPECTED[name]
    start = time.monotonic()
    results = []
    for index, overrides in enumerate(case_runs(name, tmp_path)):
        result = run_job(CONFIG, DEFINITIONS[name]["ngpu"], tmp_path, overrides, timeout=600,
                         seed_checkpoint=seed if expected.parity and index == 0 else None,
                         preflight=expected.outcome != TRAINS)
        results.append(result)
        (tmp_path / f"run_{index}.log").write_text(result.output)
        if result.returncode != 0:
            break
    return results, time.monotonic() - start


def one_error_line(result: RunResult) -> str:
    """The output's single ``error:`` line; fails on a traceback, a started rank or more."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.returncode == 2, result.output[-4000:]
    assert "Traceback" not in result.output and "torchrun" not in result.output, \
        result.output[-4000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output[-4000:]
    return lines[0]


def check_trains(name: str, results: list[RunResult], dump: Path, reference: RunResult | None
                 ) -> None:
    """Every run exits 0 and runs what the case asks for."""
    expected = EXPECTED[name]
    for index, result in enumerate(results):
        assert result.returncode == 0, f"run {index}: {result.output[-6000:]}"
        assert result.rows, result.output[-3000:]
    # the case's degrees and features are those of its last run (a save run before it may set
    # none: optional_checkpoint)
    result = results[-1]
    plan = Plan.load(str(dump / f"plan_{len(results) - 1}.json"))
    for dim, degree in expected.mesh.items():
        assert getattr(plan.mesh, dim) == degree, (dim, plan.mesh)
    blocks = [layer for layer in plan.layers if layer.kind == "block"]
    if expected.tp_blocks:
        assert any(layer.tp_mode == "sp" for layer in blocks), plan.table()
    if expected.ac:
        assert {layer.ac for layer in blocks} == {expected.ac}, plan.table()
    if expected.schedule:
        assert plan.pipeline is not None and plan.pipeline.schedule == expected.schedule
    if expected.compiled:
        assert result.rows[-1]["compiled_graphs"] > 0, result.rows[-1]
    if expected.local_batch and plan.local_batch_size != expected.local_batch:
        assert any(note.startswith("searched: training.local_batch_size = "
                                   f"{expected.local_batch}") for note in plan.notes)
    if expected.fsdp_only and not plan_shards_with_fsdp(plan):
        assert any(note.startswith("no effect: ") and expected.fsdp_only in note
                   for note in plan.notes), plan.notes
    elif expected.fsdp_only == RESHARD:
        assert all(layer.reshard_after_forward for layer in blocks), plan.table()
    if expected.log:
        assert expected.log in result.output, result.output[-3000:]
    if expected.checkpoint:
        assert list((dump / "outputs").glob(expected.checkpoint)), \
            sorted(str(p) for p in (dump / "outputs").rglob("*"))[:50]
    if reference is not None:
        first = results[0]
        assert_parity(RunResult(reference.returncode, reference.output,
                                reference.rows[:len(first.rows)]), first)


def check_case(name: str, tmp_path: Path, references: Callable) -> float:
    """Run the case and check its expected outcome; returns its wall time."""
    expected = EXPECTED[name]
    seed, reference = references("llama3") if expected.outcome == TRAINS and expected.parity \
        else (None, None)
    results, seconds = run_case(name, tmp_path, seed)
    if expected.outcome == TRAINS and expected.recipe and results[0].returncode == 0:
        # the recipe's local batch must split the global one over its data-parallel ranks:
        # auto's (a local batch the case sets comes later and wins)
        local = Plan.load(str(tmp_path / "plan_0.json")).local_batch_size
        overrides = [f"--training.local_batch_size={local}",
                     *(arg for arg in case_runs(name, tmp_path)[0]
                       if not arg.startswith("--autoparallel."))]
        reference = run_job(RECIPE, DEFINITIONS[name]["ngpu"], tmp_path / "recipe", overrides,
                            seed_checkpoint=seed)
        if SIGABRT in reference.output:
            # TorchTitan's own recipe under CP on gloo: rank 0 aborts inside gloo about once
            # in 30 runs of fsdp+cp on this 2-core box (its peers then fail in FSDP's
            # reduce-scatter); the reference is run once more
            reference = run_job(RECIPE, DEFINITIONS[name]["ngpu"], tmp_path / "recipe_again",
                                overrides, seed_checkpoint=seed)
    if expected.outcome == TRAINS:
        check_trains(name, results, tmp_path, reference)
    else:
        assert len(results) == expected.at_run + 1, f"run {expected.at_run} is refused"
        if expected.at_run:
            check_trains(name, results[:-1], tmp_path, reference)
        line = one_error_line(results[-1])
        assert expected.message in line, line
        if expected.outcome == CPU_IMPOSSIBLE:
            assert expected.reason
    print(f"{name}: {expected.outcome} in {seconds:.0f} s")
    return seconds


def _param(name: str) -> pytest.param:
    expected = EXPECTED[name]
    marks = [] if expected.ci else [pytest.mark.slow]
    if expected.xfail:
        marks.append(pytest.mark.xfail(reason=expected.xfail, strict=True))
    return pytest.param(name, marks=marks, id=name)


def test_table_covers_the_vendored_matrix():
    """Every vendored case has exactly one expectation, and only those: a case added upstream
    (after regenerating the JSON) fails here until it is classified."""
    assert MATRIX["source"] == "pytorch/torchtitan v0.2.2:tests/integration_tests/features.py"
    assert list(EXPECTED) == list(DEFINITIONS)
    for name, expected in EXPECTED.items():
        assert expected.outcome in (TRAINS, REFUSED, CPU_IMPOSSIBLE), name
        assert (expected.outcome == TRAINS) != bool(expected.message), name
        assert (expected.outcome == CPU_IMPOSSIBLE) == bool(expected.reason), name


def test_the_regenerators_parser_reads_torchtitans_definitions():
    """``regenerate.py``'s parser on a snippet of TorchTitan's ``features.py`` (its f-strings,
    ``ngpu`` and ``disabled``), and the vendored JSON's counts: runs everywhere."""
    from tests.torchtitan_features.regenerate import definitions

    assert len(DEFINITIONS) == len(MATRIX["definitions"]) == 43
    assert sum(case["disabled"] for case in DEFINITIONS.values()) == 2
    snippet = """OverrideDefinitions([["--a", f"--b {checkpoint_path}"]], "A", "a", ngpu=2),
OverrideDefinitions([["--c"]], "C", "c", disabled=True)"""
    assert definitions(snippet) == [
        {"override_args": [["--a", "--b {checkpoint_path}"]], "test_descr": "A",
         "test_name": "a", "ngpu": 2, "disabled": False, "skip_rocm_test": False},
        {"override_args": [["--c"]], "test_descr": "C", "test_name": "c", "ngpu": 4,
         "disabled": True, "skip_rocm_test": False}]


def test_vendored_data_matches_the_regenerator():
    """The JSON is what ``regenerate.py`` makes of TorchTitan's ``features.py`` at the tag,
    kept beside it: the kept file is the tag's (its git blob id, recorded from TorchTitan's
    repository), and parsing it gives the JSON."""
    from tests.torchtitan_features.regenerate import (
        VENDORED,
        VENDORED_BLOB,
        definitions,
        git_blob_id,
    )

    assert git_blob_id(VENDORED.read_bytes()) == VENDORED_BLOB
    assert definitions(VENDORED.read_text()) == MATRIX["definitions"]


@pytest.mark.parametrize("name", [_param(name) for name in EXPECTED])
def test_feature_case(name, tmp_path, references):
    check_case(name, tmp_path, references)
