"""dsv4.ops.moe_cuda (the CUDA decode experts, dsv4/kernels/cuda/moe.cu) against `moe_experts_ref` (GPU only).

One token; fresh random MXFP4 routed experts (E8M0 scales that differ per 32-value group), an FP8 128x128-block shared
expert or none, activations whose 128-blocks differ in magnitude (x and h are quantized per block); Flash shapes
(D 4096, inter 2048, 256 experts, top-6) and smaller ones (D 2048, inter 512, k 1-6), hash-style repeated experts,
with and without the SwiGLU clamp; bitwise determinism, CUDA-graph replay == eager with programmatic dependent launch,
and the fast `moe_experts` op routing one-token MXFP4 calls here (and the rest to Triton).
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import formats
from dsv4.ops.linear import PreparedLinear, prepare_linear
from dsv4.ops.moe import moe_experts_ref
from dsv4.testing import assert_bitwise_equal, assert_close_rel, graph_replay

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("built_sm90")]
TOL = "op_fp8_mma_bf16_out"


def _mc():
    from dsv4.ops import moe_cuda
    return moe_cuda


def _mxfp4(E, n, k, g):
    """E experts [n, k]: rows with magnitudes spread over 2^-3..2^3 so the E8M0 group scales differ."""
    w = torch.randn(E * n, k, generator=g, device="cuda") * k ** -0.5
    w = w * torch.exp2(torch.randint(-3, 4, (E * n, k // 32), generator=g, device="cuda").float()).repeat_interleave(32, 1)
    q = prepare_linear(formats.Mxfp4Weight.quantize(w))
    return PreparedLinear("mxfp4", n, k, q.weight.view(E, n, k // 2), q.scale.view(E, n, k // 32))


def _fp8(n, k, g):
    return prepare_linear(formats.Fp8BlockWeight.quantize(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5))


def _case(D, N, E, k, seed, shared=True, repeats=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1, w3, w2 = _mxfp4(E, N, D, g), _mxfp4(E, N, D, g), _mxfp4(E, D, N, g)
    sh = (_fp8(N, D, g), _fp8(D, N, g), _fp8(N, D, g)) if shared else None
    x = torch.randn(1, D, generator=g, device="cuda")
    x = (x * torch.exp2(torch.randint(-4, 5, (1, D // 128), generator=g, device="cuda").float())
         .repeat_interleave(128, 1)).to(torch.bfloat16)
    if repeats:  # hash-layer style: an expert may be named twice
        idx = torch.randint(0, E, (1, k), generator=g, device="cuda")
        idx[0, -1] = idx[0, 0]
    else:
        idx = torch.randperm(E, generator=g, device="cuda")[:k][None]
    wts = (torch.rand(1, k, generator=g, device="cuda") + 0.05) * 1.5 / k
    return x, wts, idx, w1, w2, w3, sh


def _check(args, limit=10.0):
    x, wts, idx, w1, w2, w3, sh = args
    mc = _mc()
    assert mc.applies(x, wts, idx, w1, w2, w3, sh, True)
    y = mc.moe_decode(x, wts, idx, w1, w2, w3, sh, limit)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert_close_rel(y, moe_experts_ref(x, wts, idx, w1, w2, w3, sh, limit, True), TOL)
    return y


@pytest.fixture(scope="module")
def flash():
    return _case(4096, 2048, 256, 6, seed=1)


def test_flash_shapes(flash):
    y = _check(flash)
    x, wts, idx, w1, w2, w3, sh = flash
    assert_bitwise_equal(_mc().moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0), y, "moe_decode rerun")


@pytest.mark.parametrize("seed", [2, 3])
def test_flash_fresh_tokens(flash, seed):
    _, _, _, w1, w2, w3, sh = flash
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(1, 4096, generator=g, device="cuda") * 3).to(torch.bfloat16)
    idx = torch.randperm(256, generator=g, device="cuda")[:6][None]
    wts = torch.rand(1, 6, generator=g, device="cuda") / 3
    _check((x, wts, idx, w1, w2, w3, sh))


@pytest.mark.parametrize("k", [1, 4, 6])
@pytest.mark.parametrize("shared", [True, False])
def test_small_shapes(k, shared):
    _check(_case(2048, 512, 8, k, seed=10 + k, shared=shared))


def test_repeated_expert_and_no_clamp():
    args = _case(2048, 1024, 4, 6, seed=21, repeats=True)
    _check(args)
    _check(args, limit=0.0)


def test_clamp_binds():
    """Large activations: gate and up exceed the clamp, so the clamp decides the result."""
    x, wts, idx, w1, w2, w3, sh = _case(2048, 512, 8, 6, seed=22)
    x = (x.float() * 64).to(torch.bfloat16)
    _check((x, wts, idx, w1, w2, w3, sh), limit=1.0)


def test_zero_token():
    x, wts, idx, w1, w2, w3, sh = _case(2048, 512, 8, 3, seed=23)
    y = _check((torch.zeros_like(x), wts, idx, w1, w2, w3, sh))
    assert not y.float().abs().max().item()


def test_graph_replay_equals_eager(flash):
    x, wts, idx, w1, w2, w3, sh = flash
    want, out = graph_replay(lambda: _mc().moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0))
    assert torch.equal(out, want)


def test_fast_op_dispatch(flash):
    """The registered fast moe_experts runs the CUDA kernels for one MXFP4 token (same bits as moe_decode) and the
    Triton kernels otherwise (NVFP4 here: not an MXFP4 stack, so applies() is False)."""
    from dsv4 import ops

    x, wts, idx, w1, w2, w3, sh = flash
    fast = ops.OPS["moe_experts"].fast
    assert_bitwise_equal(fast(x, wts, idx, w1, w2, w3, sh, 10.0, True),
                         _mc().moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0), "fast op vs moe_decode")
    assert not _mc().applies(x.float(), wts, idx, w1, w2, w3, sh, True)
    assert not _mc().applies(x, wts, idx, w1, w2, w3, sh, False)
    assert not _mc().applies(torch.cat([x, x]), wts.repeat(2, 1), idx.repeat(2, 1), w1, w2, w3, sh, True)
