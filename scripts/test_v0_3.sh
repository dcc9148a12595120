#!/usr/bin/env bash
# The TorchTitan 0.3.0 front-end's tests (tests_v0_3), in a venv of their own: 0.3.0 runs on
# the torch a fresh `pip install torchtitan` brings, 2.15.0 (a CUDA build, about 6 GB, that runs
# on CPU; the `titan03` extra pins it), beside the 0.2.2 suite's torch 2.13. The venv's name
# carries the torch, so a venv of an earlier pin is not upgraded in place.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TT030_VENV:-${TMPDIR:-/tmp}/torchtitan-autoparallel-tt030-torch2.15}"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
# a pip constraints file that caps torch below the extra's pin (a machine set up for an
# earlier release) would refuse the install: this one install reads none
PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q -e '.[titan03]' pytest
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" tests_v0_3
