#!/usr/bin/env bash
# The TorchTitan 0.3.0 front-end's tests (tests_v0_3), in a venv of their own: 0.3.0 runs on
# the torch a fresh `pip install torchtitan` brings, 2.15.0 (a CUDA build, about 6 GB, that runs
# on CPU; the `titan03` extra pins it), beside the 0.2.2 suite's torch 2.13. The venv's name
# carries the torch, so a venv of an earlier pin is not upgraded in place.
set -euo pipefail
cd "$(dirname "$0")/.."
here="$(pwd -P)"
venv="${TT030_VENV:-${TMPDIR:-/tmp}/torchtitan-autoparallel-tt030-torch2.15}"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
# the dependencies are installed again when pyproject.toml changed since the venv's last install
stamp="$venv/.torchtitan-autoparallel-pyproject"
if [ "$(cat "$stamp" 2>/dev/null)" != "$(sha256sum pyproject.toml)" ]; then
    # a pip constraints file that caps torch below the extra's pin (a machine set up for an
    # earlier release) would refuse the install: this one install reads none
    PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q -e '.[titan03]' pytest
    sha256sum pyproject.toml > "$stamp"
fi
# the venv may be shared by several checkouts: its editable install must be this one's (the
# tests' subprocesses import the package from elsewhere than the repository root)
imports_here() {
    (cd / && "$venv/bin/python" -c 'import pathlib, sys, torchtitan_autoparallel as t
sys.exit(pathlib.Path(t.__file__).resolve().parents[1] != pathlib.Path(sys.argv[1]))' "$here") \
        2>/dev/null
}
if ! imports_here; then
    PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
    imports_here || { echo "error: $venv does not import $here's torchtitan_autoparallel" >&2
                      exit 2; }
fi
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" tests_v0_3
