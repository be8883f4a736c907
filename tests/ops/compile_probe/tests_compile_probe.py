"""Two kernels for tests/ops/test_triton_compile.py: `bad` runs under the interpreter but the compiler refuses it (a
name typed fp32 before a runtime branch and int64 inside it); `good` compiles."""

import triton
import triton.language as tl


@triton.jit
def bad(x_ptr, n):
    v = tl.load(x_ptr)
    if n > 0:
        v = tl.load(x_ptr).to(tl.int64)
    tl.store(x_ptr, v.to(tl.float32))


@triton.jit
def good(x_ptr, n):
    v = tl.load(x_ptr)
    if n > 0:
        v = v * 2.0
    tl.store(x_ptr, v)
