#!/usr/bin/env python3
"""Single-shot DeepSeek-V4 inference: the `dsv4` command (dsv4/cli.py), runnable from a checkout.

Same options as `dsv4` and `python -m dsv4`; see `--help` or the README. Exit status: 0 ok,
1 runtime error, 2 usage error, 130 interrupted.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout without installing

if __name__ == "__main__":
    try:
        from dsv4.cli import main
    except KeyboardInterrupt:  # Ctrl-C before main() can take it
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
