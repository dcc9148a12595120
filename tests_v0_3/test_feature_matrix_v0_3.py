"""TorchTitan 0.3.0's integration feature matrix (``tests/integration_tests/features.py`` of its
release branch, vendored as data in ``tests/torchtitan_features/features_v0_3_0.json``) run
under ``--parallelism.auto``, classified as the 0.2.2 matrix is (``tests/test_feature_matrix.py``).

Each case runs as TorchTitan's runner runs it: one ``run_train.sh`` call per list of override
arguments (``MODULE=llama3 CONFIG=llama3_debugmodel``, the case's world size, its ``--module`` /
``--config`` where it names one), with ``--parallelism.auto`` and this machine's small job in
front (sequences of 256, 8 per step, fp32 parameters, this repository's tokenizer and corpus,
seed 0, 3 steps; TorchTitan's 10 / 20 step save / resume runs become 3 / 5; compile on the
``aot_eager`` backend). TorchTitan's runner also adds ``--debug.spmd_typechecking`` (and no AC)
to some variants: a debug check left out here. A degree a case sets is a constraint under auto;
what it leaves unset is searched. Every case has one expected outcome in ``EXPECTED``:

- TRAINS: every run exits 0, the plan's mesh has the case's degrees, and where the case keeps
  the model, data and numerics the first run's losses are the 1-rank run's from one seed
  checkpoint (the last stage's, under pp);
- REFUSED: one ``error:`` line naming the setting, a non-zero exit, before any rank starts
  (``at_run``: the runs before it train);
- CPU_IMPOSSIBLE: the case needs what a CPU lacks; it ends in one line on this machine.

``-m "not slow"`` runs one case per feature family; ``-m slow`` the rest. Run with TorchTitan
0.3.0 installed (``scripts/test_v0_3.sh``); ``python tests_v0_3/test_feature_matrix_v0_3.py
[case ...]`` prints each case's outcome without checking it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent
DATA = REPO / "tests" / "torchtitan_features" / "features_v0_3_0.json"
MATRIX = json.loads(DATA.read_text())
DEFINITIONS: dict[str, dict] = {case["test_name"]: case for case in MATRIX["definitions"]}
STEPS = {"10": "3", "20": "5"}
SMALL_JOB = ["--training.seq_len", "256", "--training.global_batch_size", "8",
             "--training.mixed_precision_param", "float32", "--debug.seed", "0",
             "--training.steps", "3"]
"""In front of every run (a case's own settings come after and win)."""
REFERENCE = ["--module", "llama3", "--config", "llama3_debugmodel", *SMALL_JOB]

TRAINS, REFUSED, CPU_IMPOSSIBLE = "TRAINS", "REFUSED", "CPU_IMPOSSIBLE"
SUBCOMMAND = re.compile(r"[a-z][a-z-]*:[a-z][a-z-]*")
"""A tyro subcommand argument (``activation-checkpoint:selective``)."""


@dataclass(frozen=True)
class Expected:
    """One case's outcome under auto on this CPU machine."""

    outcome: str
    message: str = ""
    """REFUSED / CPU_IMPOSSIBLE: a substring of the one error line."""
    reason: str = ""
    """CPU_IMPOSSIBLE: what the case needs that a CPU lacks."""
    mesh: dict[str, int] = field(default_factory=dict)
    """TRAINS: degrees the plan's mesh must have."""
    parity: bool = False
    """TRAINS: the first run's losses are the 1-rank run's from one seed checkpoint."""
    checkpoint: str = ""
    """TRAINS: a glob the runs must leave under the dump folder."""
    log: str = ""
    """TRAINS: a line the output must contain."""
    at_run: int = 0
    ci: bool = False
    """Run by ``-m "not slow"``."""


COMPILED = "Compiling each TransformerBlock with torch.compile"
CPU_CP = ("on CPU ranks: TorchTitan 0.3.0 runs context parallel with FlexAttention only",
          "0.3.0 runs CP with FlexAttention only (SDPA on CPU has no CP sharding rule); its "
          "backward is CUDA only")
OVERRIDE = ("TorchTitan's override kernels run on CUDA only",
            "the fused SwiGLU / grouped-expert overrides are Triton kernels (CUDA custom ops)")
EXPECTED: dict[str, Expected] = {
    "default": Expected(TRAINS, parity=True),
    "1d_compile": Expected(TRAINS, parity=True, log=COMPILED),
    "1d_compile_sac_op": Expected(TRAINS, parity=True, log=COMPILED, ci=True),
    "2d_eager": Expected(TRAINS, mesh={"tp": 2}, parity=True, ci=True),
    "2d_eager_no_sp": Expected(TRAINS, mesh={"tp": 2}, parity=True),
    "2d_compile": Expected(TRAINS, mesh={"tp": 2}, parity=True, log=COMPILED),
    "2d_asynctp_compile": Expected(
        CPU_IMPOSSIBLE, "--compile.enable_async_tensor_parallel is Inductor's micro-pipeline",
        reason="async TP is Inductor's pass over CUDA symmetric memory", ci=True),
    "full_checkpoint": Expected(TRAINS, checkpoint="checkpoint/step-5"),
    "model_only_hf_checkpoint": Expected(TRAINS, checkpoint="hf_checkpoint/step-3/*"),
    "last_save_model_only_bf16": Expected(TRAINS, checkpoint="checkpoint/step-3", ci=True),
    "pp_1f1b": Expected(TRAINS, mesh={"pp": 2, "dp_shard": 1}, parity=True, ci=True),
    "pp_dp_1f1b": Expected(REFUSED, "pipeline_parallel_layers_per_stage is set with auto",
                           at_run=1, mesh={"pp": 2, "dp_shard": 2}),
    "pp_tp_gpipe": Expected(TRAINS, mesh={"pp": 2, "tp": 2}, parity=True),
    "pp_dp_tp": Expected(TRAINS, mesh={"pp": 2, "dp_shard": 2, "tp": 2},
                         checkpoint="checkpoint/step-5"),
    "3d_compile": Expected(TRAINS, mesh={"pp": 2, "dp_shard": 2, "tp": 2}, parity=True,
                           log=COMPILED),
    "pp_looped_1f1b": Expected(REFUSED, "runs at least 2 stages per rank"),
    "pp_looped_zero_bubble": Expected(REFUSED, "runs at least 2 stages per rank"),
    "pp_zbv": Expected(TRAINS, mesh={"pp": 2}, parity=True),
    "pp_custom_csv": Expected(REFUSED, "not a custom CSV schedule"),
    "optimizer_bf16_states": Expected(REFUSED, "optimizer.implementation fused_opt_states_bf16",
                                      ci=True),
    "ddp": Expected(TRAINS, mesh={"dp_replicate": 4, "dp_shard": 1}, parity=True),
    "hsdp": Expected(TRAINS, mesh={"dp_replicate": 2, "dp_shard": 2}, parity=True, ci=True),
    "cp": Expected(CPU_IMPOSSIBLE, CPU_CP[0], reason=CPU_CP[1], ci=True),
    "hsdp+tp": Expected(TRAINS, mesh={"dp_replicate": 2, "dp_shard": 2, "tp": 2}, parity=True),
    # its config lives in TorchTitan's source tree (torchtitan_recipes), not in the wheel
    "fsdp+cp": Expected(REFUSED, "not found in torchtitan_recipes.tests"),
    "hsdp+cp_without_dp_shard": Expected(CPU_IMPOSSIBLE, CPU_CP[0], reason=CPU_CP[1]),
    "hsdp+cp_with_dp_shard": Expected(CPU_IMPOSSIBLE, CPU_CP[0], reason=CPU_CP[1]),
    "fsdp+tp+cp": Expected(CPU_IMPOSSIBLE, CPU_CP[0], reason=CPU_CP[1]),
    "fsdp_reshard_always": Expected(TRAINS, parity=True),
    "optional_checkpoint": Expected(TRAINS, mesh={"tp": 2}, checkpoint="checkpoint/step-5"),
    # 32 sequences a step: not the reference's batch
    "gradient_accumulation": Expected(TRAINS),
    "validation_tp_cp_pp": Expected(CPU_IMPOSSIBLE, CPU_CP[0], reason=CPU_CP[1]),
    "override_fused_swiglu": Expected(CPU_IMPOSSIBLE, OVERRIDE[0], reason=OVERRIDE[1]),
    "override_fused_grouped_experts": Expected(CPU_IMPOSSIBLE, OVERRIDE[0], reason=OVERRIDE[1]),
    "fsdp+varlen_attn+per_op_sac": Expected(
        TRAINS, mesh={"dp_shard": 4}, log="VarlenAttention runs as causal SDPA"),
    "float8_emulate_lora": Expected(TRAINS, mesh={"pp": 2, "tp": 2},
                                    log="LoRA: the frozen base weights are costed as trained"),
    "torchcomms_3d_dp+cp+pp+compile": Expected(REFUSED, "needs the torchcomms package"),
    "torchcomms_3d_dp+tp+pp+compile": Expected(REFUSED, "needs the torchcomms package"),
    "sft": Expected(REFUSED, "data_files tests/assets/sft_test/data.json does not exist"),
    "seed_checkpoint": Expected(REFUSED, "create_seed_checkpoint runs on 1 rank without a plan"),
}


def _mesh_line(out: str) -> dict[str, int]:
    match = re.search(r"autoparallel plan \w+: mesh ([^(]+)\(world", out)
    assert match, out[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", out)]


def _env(ngpu: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "NGPU": str(ngpu),
            "MODULE": "llama3", "CONFIG": "llama3_debugmodel",
            "LOG_RANK": ",".join(map(str, range(ngpu)))}


def case_runs(name: str, dump: Path) -> list[list[str]]:
    """The case's ``run_train.sh`` argument lists under auto, adapted (see the module)."""
    runs = []
    for override_args in DEFINITIONS[name]["override_args"]:
        args = shlex.split(" ".join(override_args).replace(
            MATRIX["checkpoint_path_placeholder"], str(dump / "hf_checkpoint" / "step-3")))
        adapted = ["--parallelism.auto", *SMALL_JOB, "--dump_folder", str(dump)]
        subcommands = []  # tyro reads the options after a subcommand as the subcommand's
        for i, arg in enumerate(args):
            if i and args[i - 1] == "--training.steps":
                arg = STEPS.get(arg, arg)
            if SUBCOMMAND.fullmatch(arg):
                subcommands.append(arg)
                continue
            adapted.append(arg)
            if arg == "--compile.enable":
                adapted += ["--compile.backend", "aot_eager"]
        runs.append([*adapted, *subcommands])
    return runs


@dataclass
class Run:
    returncode: int
    output: str


def run(args: list[str], ngpu: int, timeout: float = 900) -> Run:
    try:
        done = subprocess.run(["bash", str(REPO / "run_train.sh"), *args], cwd=REPO,
                              env=_env(ngpu), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return Run(-1, f"timed out after {timeout} s: {exc}")
    return Run(done.returncode, re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr))


def run_case(name: str, dump: Path, load: list[str] | None = None) -> list[Run]:
    """Every run of the case in order (stopping at a failure); ``load`` goes with the first."""
    results = []
    for index, args in enumerate(case_runs(name, dump)):
        extra = load if (load and index == 0) else []
        # before any tyro subcommand (which takes the options after it as its own)
        at = next((i for i, arg in enumerate(args) if SUBCOMMAND.fullmatch(arg)), len(args))
        results.append(run([*args[:at], *extra, *args[at:]], DEFINITIONS[name]["ngpu"]))
        if results[-1].returncode != 0:
            break
    return results


def one_error_line(result: Run) -> str:
    """The output's single ``error:`` line; fails on a traceback, a started rank or more."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.returncode != 0, result.output[-4000:]
    assert "Traceback" not in result.output and "[rank" not in result.output, \
        result.output[-4000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output[-4000:]
    return lines[0]


def summary(result: Run) -> str:
    """One line about a run: its mesh and losses, or how it ended."""
    if result.returncode == 0:
        mesh = re.search(r"autoparallel plan \w+: (mesh [^(]+)", result.output)
        return f"ok {mesh.group(1) if mesh else ''} losses {_losses(result.output)[-3:]}"
    errors = [line for line in result.output.splitlines()
              if line.startswith("error:") or re.search(r"\w+Error: ", line)]
    return f"rc={result.returncode} {errors[-1][:300] if errors else result.output[-300:]}"


def rank_losses(out: str) -> list[float]:
    """The losses of the first rank that logs every step (under pp: the last stage's)."""
    by_rank: dict[str, list[float]] = {}
    for rank, loss in re.findall(r"^\[rank(\d+)\]:.*step:\s+\d+\s+loss:\s+(-?[0-9.]+)", out,
                                 re.M):
        by_rank.setdefault(rank, []).append(float(loss))
    for rank in sorted(by_rank, key=int):
        if all(loss > 0 for loss in by_rank[rank]):
            return by_rank[rank]
    return []


def check_trains(name: str, results: list[Run], dump: Path, reference: list[float] | None
                 ) -> None:
    """Every run exits 0 with the case's degrees; the first run at the 1-rank losses."""
    expected = EXPECTED[name]
    for index, result in enumerate(results):
        assert result.returncode == 0, f"run {index}: {result.output[-6000:]}"
        assert rank_losses(result.output), result.output[-3000:]
    mesh = _mesh_line(results[-1].output)
    for dim, degree in expected.mesh.items():
        assert mesh.get(dim) == degree, (dim, mesh)
    if expected.log:
        assert expected.log in results[-1].output, results[-1].output[-3000:]
    if expected.checkpoint:
        assert list(dump.glob(expected.checkpoint)), sorted(str(p) for p in dump.rglob("*"))[:40]
    if reference is not None:
        losses = rank_losses(results[0].output)
        assert len(losses) == len(reference), (losses, reference)
        gap = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        assert gap <= 1e-4, (losses, reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[str], list[float]]:
    """A seed checkpoint of the small llama3 job (its load arguments) and the 1-rank losses."""
    root = tmp_path_factory.mktemp("matrix_reference")
    seed = run([*REFERENCE, "--training.local_batch_size", "8", "--checkpoint.enable",
                "--checkpoint.create_seed_checkpoint", "--dump_folder", str(root / "seed")], 1)
    assert seed.returncode == 0, seed.output[-3000:]
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path",
            str(root / "seed" / "checkpoint" / "step-0")]
    one = run([*REFERENCE, "--training.local_batch_size", "8", *load,
               "--dump_folder", str(root / "one")], 1)
    assert one.returncode == 0, one.output[-3000:]
    losses = rank_losses(one.output)
    assert len(losses) == 3, one.output[-3000:]
    return load, losses


def _param(name: str) -> pytest.param:
    return pytest.param(name, marks=[] if EXPECTED[name].ci else [pytest.mark.slow], id=name)


def test_table_covers_the_vendored_matrix():
    """Every vendored case has exactly one expectation: a case added upstream (after
    regenerating the JSON) fails here until it is classified."""
    assert MATRIX["source"].startswith("pytorch/torchtitan release/0.3 @ ")
    assert list(EXPECTED) == list(DEFINITIONS) and len(DEFINITIONS) == 40
    for name, expected in EXPECTED.items():
        assert expected.outcome in (TRAINS, REFUSED, CPU_IMPOSSIBLE), name
        assert (expected.outcome == TRAINS) != bool(expected.message), name
        assert (expected.outcome == CPU_IMPOSSIBLE) == bool(expected.reason), name
        assert not (expected.parity and expected.checkpoint), name


@pytest.mark.parametrize("name", [_param(name) for name in EXPECTED])
def test_feature_case(name, tmp_path, reference):
    expected = EXPECTED[name]
    load, losses = reference
    parity = expected.outcome == TRAINS and expected.parity
    results = run_case(name, tmp_path, load if parity else None)
    if expected.outcome == TRAINS:
        check_trains(name, results, tmp_path, losses if parity else None)
        return
    assert len(results) == expected.at_run + 1, [summary(r) for r in results]
    if expected.at_run:
        check_trains(name, results[:-1], tmp_path, None)
    line = one_error_line(results[-1])
    assert expected.message in line, line


if __name__ == "__main__":
    import tempfile

    for case in sys.argv[1:] or list(DEFINITIONS):
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            results = run_case(case, Path(tmp))
        print(f"{case} [{DEFINITIONS[case]['ngpu']}] {time.monotonic() - start:.0f}s: "
              + " | ".join(summary(r) for r in results), flush=True)
