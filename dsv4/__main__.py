"""`python -m dsv4`: the dsv4 command line (dsv4/cli.py)."""

import sys

from dsv4.cli import main

sys.exit(main(prog="python -m dsv4"))
