"""Sweep: auto plans vs TorchTitan's recipes, measured on this machine.

    python experiments/sweep.py experiments/grids/quick.toml [--out experiments/results]

The runner (grid TOML, recipes, interleaved rounds, resumable CSV) is tests/support/sweep.py,
shared with tests/test_sweep.py and the other experiments; this script runs its ``main``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
