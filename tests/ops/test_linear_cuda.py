"""dsv4.ops.linear_cuda (the CUDA skinny GEMV, dsv4/kernels/cuda/gemv.cu) against `linear_ref` (GPU only).

Fresh random weights in the official formats (FP8 128x128 blocks, bf16), activations with per-block magnitudes
that differ, 1-8 tokens, bf16 and fp32 x and outputs; Flash production shapes, odd N and K tails, every split /
row-group / step configuration the dispatcher may pick; bitwise determinism, CUDA-graph replay == eager with
programmatic dependent launch, and the fast `linear` op routing decode shapes here.
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import formats
from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.linear import linear_ref, prepare_linear
from dsv4.testing import assert_bitwise_equal, assert_close_rel, graph_replay

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def built():
    if not CUDA:
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the CUDA GEMV needs sm_90+")
    if cuda_kernels.load() is None:
        pytest.fail(f"CUDA kernels did not build: {cuda_kernels.status()[1]}")


def _lc():
    from dsv4.ops import linear_cuda
    return linear_cuda


def _weight(fmt: str, n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda") * k ** -0.5
    if fmt == "fp8":
        return prepare_linear(formats.Fp8BlockWeight.quantize(w))
    return prepare_linear(formats.DenseWeight.quantize(w, torch.bfloat16))


def _x(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda")
    e = torch.randint(-3, 4, (m, -(-k // 64)), generator=g, device="cuda")
    return (x * torch.exp2(e.float()).repeat_interleave(64, -1)[:, :k]).to(dtype)


def _run(x, w, out_dtype, cfg=None):
    out = torch.empty(x.shape[0], w.n, dtype=out_dtype, device="cuda")
    _lc().gemv(x, w, out, cfg)
    return out


def _check(x, w, out_dtype, cfg=None):
    lc = _lc()
    aq = w.fmt == "fp8"
    chosen = lc.config(w.fmt, x.dtype == torch.float32, x.shape[0], w.n, w.k)
    assert lc.applies(x, w, aq, out_dtype) == (chosen is not None)
    if cfg is None and chosen is None:  # the Triton kernel runs this shape: still check the CUDA one here
        cfg = lc.candidates(w.fmt, x.dtype == torch.float32, x.shape[0], w.n, w.k)[0]
    y = _run(x, w, out_dtype, cfg)
    ref = linear_ref(x, w, aq, out_dtype)
    # products are exact and the tensor cores accumulate in fp32 (e4m3 goes through f16 HMMA on sm_90):
    # only the summation order differs from the reference
    assert_close_rel(y, ref, "op_fp32_out" if out_dtype == torch.float32 else "op_bf16_out")
    return y


FLASH = [("fp8", 1536, 4096), ("fp8", 32768, 1024), ("fp8", 4096, 8192), ("fp8", 8192, 1024),
         ("fp8", 2048, 4096), ("fp8", 4096, 2048), ("dense", 1024, 4096), ("dense", 64, 4096)]


@pytest.mark.parametrize("fmt,n,k", FLASH)
@pytest.mark.parametrize("m", [1, 4])
def test_flash_shapes(fmt, n, k, m):
    w = _weight(fmt, n, k, seed=n + k)
    x = _x(m, k, torch.bfloat16, seed=m)
    _check(x, w, torch.bfloat16)
    if fmt == "dense":  # the compressor feeds fp32 activations and reads fp32 out
        _check(_x(m, k, torch.float32, seed=m + 1), w, torch.float32)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("fmt,n,k", [("fp8", 200, 384), ("fp8", 16, 128), ("fp8", 129, 1280),
                                     ("dense", 37, 136), ("dense", 300, 8), ("dense", 17, 4104)])
def test_odd_shapes(fmt, n, k, m):
    w = _weight(fmt, n, k, seed=3 * n + k + m)
    for xd in (torch.bfloat16, torch.float32):
        x = _x(m, k, xd, seed=m + n)
        for od in (torch.bfloat16, torch.float32):
            _check(x, w, od)


@pytest.mark.parametrize("fmt,n,k", [("fp8", 200, 1024), ("dense", 100, 1024), ("fp8", 1536, 4096)])
def test_every_config(fmt, n, k):
    lc = _lc()
    w = _weight(fmt, n, k, seed=5)
    x = _x(3, k, torch.bfloat16, seed=6)
    cands = lc.candidates(fmt, False, 3, n, k)
    assert len(cands) >= 4
    for cfg in cands:
        y = _check(x, w, torch.bfloat16, cfg)
        assert_bitwise_equal(_run(x, w, torch.bfloat16, cfg), y, f"rerun {cfg}")


def test_strided_rows_and_determinism():
    w = _weight("fp8", 1536, 4096, seed=7)
    big = _x(4, 4096 + 256, torch.bfloat16, seed=8)
    x = big[:, 128:128 + 4096]  # row stride 4352, unit column stride
    y = _check(x, w, torch.bfloat16)
    for _ in range(3):
        assert_bitwise_equal(_run(x, w, torch.bfloat16), y, "rerun")


def test_graph_replay_equals_eager():
    ws = [_weight("fp8", 32768, 1024, 1), _weight("fp8", 4096, 8192, 2), _weight("dense", 1024, 4096, 3)]
    xs = [_x(1, 1024, torch.bfloat16, 1), _x(2, 8192, torch.bfloat16, 2), _x(2, 4096, torch.float32, 3)]

    def step():  # back to back: each launch may start (PDL) while the previous one runs
        a = _run(xs[0], ws[0], torch.bfloat16)
        b = _run(xs[1], ws[1], torch.bfloat16)
        c = _run(xs[2], ws[2], torch.float32)
        return torch.cat([a.float().flatten(), b.float().flatten(), c.flatten()])

    want, got = graph_replay(step)
    assert_bitwise_equal(got, want, "graph replay")


def test_chained_dependency_with_pdl():
    # the second GEMV reads the first one's output: griddepcontrol.wait must order it (eager and in a graph)
    w1, w2 = _weight("dense", 4096, 1024, 11), _weight("fp8", 1024, 4096, 12)
    x = _x(1, 1024, torch.bfloat16, 13)

    def chain():
        h = _run(x, w1, torch.bfloat16)
        return _run(h, w2, torch.bfloat16)

    h = linear_ref(x, w1, False, torch.bfloat16)
    assert_close_rel(chain(), linear_ref(h, w2, True, torch.bfloat16), "op_fp8_mma_bf16_out")
    want, got = graph_replay(chain)
    assert_bitwise_equal(got, want, "graph replay")


def test_tuned_table_routes_to_triton_where_it_was_faster():
    lc = _lc()
    w = _weight("dense", 64, 4096, seed=1)
    assert not lc.applies(_x(1, 4096, torch.bfloat16, 1), w, False, torch.bfloat16)
    assert lc.applies(_x(4, 4096, torch.bfloat16, 1), w, False, torch.bfloat16)
    with pytest.raises(ValueError, match="the Triton kernel runs"):
        _run(_x(1, 4096, torch.bfloat16, 1), w, torch.bfloat16)


def test_fast_linear_routes_decode_here(monkeypatch):
    from dsv4 import ops
    from dsv4.ops import linear_cuda

    calls = []
    real = linear_cuda.gemv
    monkeypatch.setattr(linear_cuda, "gemv", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    w = _weight("fp8", 1536, 4096, seed=9)
    fast = ops.OPS["linear"].fast
    for m in (1, 8, 9, 128):  # 9 and 128 tokens: the Triton kernels
        x = _x(m, 4096, torch.bfloat16, seed=m)
        assert_close_rel(fast(x.view(m, 1, 4096), w, True, torch.bfloat16).view(m, -1),
                         linear_ref(x, w, True, torch.bfloat16), "op_fp8_mma_bf16_out")
    assert calls == [1, 8]
