"""Report of a sweep CSV: per-config auto vs expert table, cost-model accuracy, plots.

    python experiments/sweep_report.py [experiments/results/sweep.csv]

The report (tables, Spearman, plots) is tests/support/sweep_report.py, shared with
tests/test_sweep.py; this script runs its ``main``.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.sweep_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
