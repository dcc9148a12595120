import sys

from .cli import main
from .errors import run_cli

sys.exit(run_cli(main))
