"""For tests/ops/test_triton_compile.py: importing this module takes a minute, as a long compile would."""

import time

time.sleep(60)
