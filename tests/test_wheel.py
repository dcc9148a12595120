"""The built wheel plans on its own: its profiles, kernel tables and assets ship as package data.

A user who installs from the wheel (not an editable checkout) runs ``plan`` from a folder of
their own; the package must find everything it reads through itself, never through this
repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("torchtitan_autoparallel-*.whl")
    return wheel


def test_wheel_installed_elsewhere_plans_from_another_folder(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("profiles/h100_sxm.toml", "profiles/kernels/gemm_sm_90.csv",
                   "profiles/validation/model_error.toml", "assets/tokenizer/tokenizer.json",
                   "assets/data/corpus.jsonl"):
        assert f"torchtitan_autoparallel/{needed}" in names, needed
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(REPO / "train_configs" / "llama3_8b_auto.toml", job / "job.toml")
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import torchtitan_autoparallel as t; "
                            "print(t.__file__)"], cwd=job, env=env, capture_output=True,
                           text=True, check=True)
    assert where.stdout.strip().startswith(str(site)), where.stdout  # the wheel's copy runs
    proc = subprocess.run([sys.executable, "-m", "torchtitan_autoparallel", "plan", "--config",
                           "job.toml", "--ngpu", "64", "--hardware", "h100_sxm"], cwd=job,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "autoparallel plan" in proc.stdout and "(world 64)" in proc.stdout
    assert "predicted: step" in proc.stdout
