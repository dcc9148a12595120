import sys

try:
    from .commands.cli import main
    from .errors import run_cli
except KeyboardInterrupt:  # Ctrl-C while torch imports
    print("error: interrupted; nothing was written", file=sys.stderr)
    sys.exit(130)

sys.exit(run_cli(main))
