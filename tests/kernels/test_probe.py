"""The stream_read bandwidth probe (dsv4/kernels/cuda/probe.cu) that tools/bench_ops.py times as the read floor: it
must read every byte exactly once (GPU only). Each CTA's xor is checked against the host's xor of the 16-byte elements
that CTA owns (element m belongs to CTA (m mod blocks * threads) // threads in the grid-stride loop), so a skipped
element, one read twice or three times, or one credited to the wrong CTA changes some row. Sizes below, exactly at
and above one grid stride, with tails that do not fill the last unrolled step; 32 to 1024 threads."""

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


def _expected(buf: torch.Tensor, blocks: int, threads: int) -> np.ndarray:
    words = buf.cpu().numpy().view(np.uint32).reshape(-1, 4)
    owner = (np.arange(words.shape[0]) % (blocks * threads)) // threads
    want = np.zeros((blocks, 4), dtype=np.uint32)
    for c in range(4):
        np.bitwise_xor.at(want[:, c], owner, words[:, c])
    return want


@pytest.mark.parametrize("nbytes,blocks,threads", [
    (16, 4, 32), (16 * 100, 3, 64), (16 * 4096 + 16 * 7, 2, 256),  # fewer elements than threads; a tail
    (16 * 33 * 1024, 33, 1024),  # exactly one grid stride, 32 warps per CTA
    (16 * 33 * 1056, 132, 256), (16 * (5 * 132 * 256 * 4 + 3), 132, 256),  # several unrolled steps + a tail
    (8 << 20, 528, 256), (33_589_248, 1056, 256), (33_589_248, 528, 512), (1 << 20, 66, 1024)])
def test_stream_read_reads_every_byte_once(mod, nbytes, blocks, threads):
    g = torch.Generator(device="cuda").manual_seed(nbytes % 1000 + blocks)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    out = torch.full((blocks, 4), -1, dtype=torch.int32, device="cuda")
    mod.stream_read(buf, out, blocks, threads)
    got = out.cpu().numpy().view(np.uint32)
    assert np.array_equal(got, _expected(buf, blocks, threads))


def test_stream_read_refuses_what_it_cannot_read(mod):
    out = torch.empty(4, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        mod.stream_read(torch.zeros(24, dtype=torch.uint8, device="cuda"), out, 4, 32)
    with pytest.raises(RuntimeError, match="out must be int32"):
        mod.stream_read(torch.zeros(32, dtype=torch.uint8, device="cuda"), out, 3, 32)
    shifted = torch.empty(4 * 4 + 1, dtype=torch.int32, device="cuda")[1:]  # 4 bytes off 16-byte alignment
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        mod.stream_read(torch.zeros(32, dtype=torch.uint8, device="cuda"), shifted, 4, 32)
