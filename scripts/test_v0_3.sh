#!/usr/bin/env bash
# The TorchTitan 0.3.0 front-end's tests (tests_v0_3), in a venv of their own: 0.3.0 needs
# torch 2.14 (a CUDA build, about 6 GB, that runs on CPU) beside the 0.2.2 suite's torch 2.13.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TT030_VENV:-${TMPDIR:-/tmp}/torchtitan-autoparallel-tt030}"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
"$venv/bin/pip" install -q -e '.[titan03]' pytest
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" tests_v0_3
