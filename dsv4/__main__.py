"""`python -m dsv4`: the dsv4 command line (dsv4/cli.py)."""

import sys

try:
    from dsv4.cli import main
except KeyboardInterrupt:  # Ctrl-C before main() can take it
    print("\ninterrupted", file=sys.stderr)
    sys.exit(130)
sys.exit(main(prog="python -m dsv4"))
