"""The stream_read bandwidth probe (dsv4/kernels/cuda/probe.cu) that tools/bench_ops.py times as the read floor: it
must read every byte exactly once (GPU only). The CTAs' xors, xored together, equal the xor of the whole buffer
computed on the host; a byte skipped or read twice changes it. Sizes below, at and above one grid stride, with a
tail that does not fill the last unrolled step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.kernels import cuda as cuda_kernels

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mod():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = cuda_kernels.load()
    if m is None:
        pytest.fail(f"CUDA kernels did not build: {cuda_kernels.status()[1]}")
    return m


@pytest.mark.parametrize("nbytes,blocks,threads", [
    (16, 4, 32), (16 * 100, 3, 64), (16 * 4096 + 16 * 7, 2, 256),  # fewer elements than threads; a tail
    (16 * 33 * 1056, 132, 256), (8 << 20, 528, 256), (33_589_248, 1056, 256), (33_589_248, 528, 512)])
def test_stream_read_reads_every_byte_once(mod, nbytes, blocks, threads):
    g = torch.Generator(device="cuda").manual_seed(nbytes % 1000 + blocks)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    out = torch.full((blocks, 4), -1, dtype=torch.int32, device="cuda")
    mod.stream_read(buf, out, blocks, threads)
    got = np.bitwise_xor.reduce(out.cpu().numpy().view(np.uint32).reshape(-1, 4), axis=0)
    want = np.bitwise_xor.reduce(buf.cpu().numpy().view(np.uint32).reshape(-1, 4), axis=0)
    assert np.array_equal(got, want), (got, want)


def test_stream_read_refuses_what_it_cannot_read(mod):
    out = torch.empty(4, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        mod.stream_read(torch.zeros(24, dtype=torch.uint8, device="cuda"), out, 4, 32)
    with pytest.raises(RuntimeError, match="out must be int32"):
        mod.stream_read(torch.zeros(32, dtype=torch.uint8, device="cuda"), out, 3, 32)
