"""dsv4.ops.mhc_cuda (one mHC boundary per launch, dsv4/kernels/cuda/mhc.cu) against the references (GPU only).

mhc_post_pre_norm and mhc_pre_norm of 1-8 tokens on fresh random streams, mixers and norm weights: Flash (D 4096)
and Pro (D 7168) widths and odd ones (D 64, 192: one and three CTAs per token); the new streams bit for bit
mhc_post's (Triton), y / post / comb within the op tolerances of the reference fed the same streams; bitwise
determinism, the arrival counters back at zero, CUDA-graph replay == eager, the binding's refusals, and the fast ops
routing decode calls here (prefill chunks to Triton).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.mhc import mhc_post_ref, mhc_pre_norm_ref
from dsv4.testing import assert_bitwise_equal, assert_close_rel, graph_replay

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("built_sm90")]
ITERS, HC_EPS, NORM_EPS, EPS = 20, 1e-6, 1e-6, 1e-6


def _mods():
    from dsv4.ops import mhc_cuda, mhc_triton
    return mhc_cuda, mhc_triton


def _case(B, S, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # streams whose magnitudes differ per stream and token (the statistic and the mixes see it)
    x = torch.randn(B, S, 4, D, generator=g, device="cuda") * torch.exp2(
        torch.randint(-3, 4, (B, S, 4, 1), generator=g, device="cuda").float())
    fn = torch.randn(24, 4 * D, generator=g, device="cuda") * 0.5 * (4 * D) ** -0.5
    base = torch.randn(24, generator=g, device="cuda") * 0.5
    scale = 1 + torch.randn(3, generator=g, device="cuda") * 0.3
    w = (1 + 0.3 * torch.randn(D, generator=g, device="cuda")).to(torch.bfloat16)
    f = torch.randn(B, S, D, generator=g, device="cuda").to(torch.bfloat16)
    post = 2 * torch.rand(B, S, 4, generator=g, device="cuda")
    comb = torch.rand(B, S, 4, 4, generator=g, device="cuda")
    comb = comb / comb.sum(-2, keepdim=True)
    return x.to(torch.bfloat16), fn, base, scale, w, f, post, comb


def _check_pre_norm(got, x, fn, base, scale, w):
    want = mhc_pre_norm_ref(x, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS, w, EPS)
    for a, b, name in zip(got, want, ("op_bf16_out", "op_fp32_out", "op_fp32_out")):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close_rel(a, b, name)


# launch variants: rows of 1-4 vectors per finishing thread (D <= 1792, <= 3584, <= 5376, <= 7168), one or two CTAs
# per SM (more CTAs than SMs: Flash at 4 tokens, 8 tokens of 2048 / 1856), several waves (Pro at 8 tokens)
@pytest.mark.parametrize("B,S,D", [(1, 1, 4096), (1, 4, 4096), (1, 1, 7168), (2, 3, 192), (1, 1, 64), (8, 1, 128),
                                   (8, 1, 2048), (4, 2, 1856), (1, 1, 1792), (8, 1, 7168)])
def test_post_pre_norm_against_reference(B, S, D):
    mc, tri = _mods()
    x, fn, base, scale, w, f, post, comb = _case(B, S, D, seed=D + 10 * S + B)
    assert mc.applies(x, fn, base, scale, 4, ITERS, w, f, post, comb)
    got = mc.boundary(x, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, EPS, f, post, comb)
    # the new streams: mhc_post's per-element arithmetic, bit for bit; the reference's within rounding
    assert_bitwise_equal(got[0], tri.mhc_post(f, x, post, comb), "streams")
    assert_close_rel(got[0], mhc_post_ref(f, x, post, comb), "op_bf16_out")
    # the pre + norm of those streams (as ab_compare feeds every op the streams it was given)
    _check_pre_norm(got[1:], got[0], fn, base, scale, w)


@pytest.mark.parametrize("B,S,D", [(1, 1, 4096), (1, 2, 7168), (3, 1, 320)])
def test_pre_norm_against_reference(B, S, D):
    mc, _ = _mods()
    x, fn, base, scale, w, *_ = _case(B, S, D, seed=7 * D + S)
    assert mc.applies(x, fn, base, scale, 4, ITERS, w)
    _check_pre_norm(mc.boundary(x, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, EPS), x, fn, base, scale, w)


# a row of 3 blocks (D 384: the last warp's second half-warp past the row), Flash, Pro (4 vectors per thread), tokens
@pytest.mark.parametrize("B,S,D", [(1, 1, 4096), (1, 1, 7168), (2, 1, 384), (1, 4, 4096), (8, 1, 1024)])
def test_codes_of_y(B, S, D):
    """quant=True: the same streams, y, post and comb bit for bit, and y's codes and scales act_quant_ref's of that
    y bit for bit (as the MoE's up kernel would make them); a D that is no multiple of 128 stays off this path."""
    from dsv4.ops.act_quant import QuantAct, act_quant_ref

    mc, _ = _mods()
    x, fn, base, scale, w, f, post, comb = _case(B, S, D, seed=3 * D + S)
    f = f * torch.exp2(torch.arange(D // 128, device="cuda").repeat_interleave(128) % 9 - 4.0).to(torch.bfloat16)
    hc = (ITERS, HC_EPS, NORM_EPS, w, EPS)
    for extra in ((), (f, post, comb)):
        assert mc.applies(x, fn, base, scale, 4, ITERS, w, *extra, quant=True)
        plain = mc.boundary(x, fn, base, scale, *hc, *extra)
        got = mc.boundary(x, fn, base, scale, *hc, *extra, quant=True)
        y = got[-3]
        assert isinstance(y, QuantAct)
        for a, b in zip(plain, got[:-3] + (y.x,) + got[-2:]):
            assert_bitwise_equal(b, a, "quant=True vs quant=False")
        q, sc = act_quant_ref(y.x, 128)
        assert_bitwise_equal(y.q.view(torch.uint8), q.reshape(B * S, D).view(torch.uint8), "codes")
        assert_bitwise_equal(y.s, sc.reshape(B * S, D // 128), "scales")
    x, fn, base, scale, w, *_ = _case(1, 1, 192, seed=1)
    assert mc.applies(x, fn, base, scale, 4, ITERS, w) and not mc.applies(x, fn, base, scale, 4, ITERS, w, quant=True)


# Flash and Pro widths, three sequences (a ring per sequence), the last slot of a CSA and an HCA window
@pytest.mark.parametrize("B,D,r,slot", [(1, 4096, 4, 3), (1, 7168, 128, 127), (3, 4096, 4, 1), (2, 384, 128, 0)])
def test_keep_writes_the_ring_row(B, D, r, slot):
    """keep = (ring, slot): the same launch also writes y's row of each sequence into its ring at the device slot, bit
    for bit y; every other slot untouched; y, post, comb (and with quant the codes) bit for bit the launch without keep;
    the fast op routes it here, and keeps (index_copy) after the Triton kernels where the launch cannot (two tokens)."""
    from dsv4 import ops

    mc, _ = _mods()
    x, fn, base, scale, w, *_ = _case(B, 1, D, seed=D + r + B)
    hc = (ITERS, HC_EPS, NORM_EPS, w, EPS)
    # the ring as BlockState holds it: [B, r, D], here inside a larger buffer (a batch stride of its own)
    buf = torch.randn(B, r + 2, D, device="cuda").to(torch.bfloat16)
    ring = buf[:, 1:r + 1]
    before, outside = ring.clone(), buf[:, [0, r + 1]].clone()
    slots = torch.full((1,), slot, dtype=torch.int64, device="cuda")
    assert mc.keeps(x, (ring, slots)) and not mc.keeps(x, (ring, slots.int()))
    for quant in (False, True):
        plain = mc.boundary(x, fn, base, scale, *hc, quant=quant)
        got = mc.boundary(x, fn, base, scale, *hc, quant=quant, keep=(ring, slots))
        for a, b in zip(plain, got):  # (with quant, y is a QuantAct: its x, codes and scales)
            for ta, tb in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                assert_bitwise_equal(tb, ta, "keep vs no keep")
        y = got[0].x if quant else got[0]
        assert_bitwise_equal(ring[:, slot], y[:, 0], "the kept row")
        other = torch.arange(r, device="cuda") != slot
        assert_bitwise_equal(ring[:, other], before[:, other], "the other slots")
        assert_bitwise_equal(buf[:, [0, r + 1]], outside, "outside the ring")
    ring.copy_(before)
    args = (fn, base, scale, 4, *hc[:1], HC_EPS, NORM_EPS, w, EPS)
    y = ops.OPS["mhc_pre_norm"].fast(x, *args, keep=(ring, slots))[0]
    assert_bitwise_equal(ring[:, slot], y[:, 0], "the fast op's kept row")
    # two tokens: the Triton kernels, then the last token's row kept
    x2, *_ = _case(B, 2, D, seed=D + r)
    ring.copy_(before)
    assert not mc.keeps(x2, (ring, slots))
    y2 = ops.OPS["mhc_pre_norm"].fast(x2, *args, keep=(ring, slots))[0]
    assert_bitwise_equal(ring[:, slot], y2[:, 1], "a chunk's last row kept")


def test_deterministic_counters_and_graph():
    mc, _ = _mods()
    from dsv4.ops.triton_util import arrival_counters

    x, fn, base, scale, w, f, post, comb = _case(1, 4, 4096, seed=3)

    def step():
        return torch.cat([t.float().flatten() for t in
                          mc.boundary(x, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, EPS, f, post, comb)])

    first = step()
    for _ in range(3):
        assert_bitwise_equal(step(), first, "rerun")
    torch.cuda.synchronize()
    assert int(arrival_counters(x.device, "mhc boundary", mc.MAX_T).abs().sum()) == 0
    want, out = graph_replay(step)
    assert_bitwise_equal(out, want, "graph")
    assert_bitwise_equal(out, first, "graph vs first")
    assert int(arrival_counters(x.device, "mhc boundary", mc.MAX_T).abs().sum()) == 0


def test_fast_ops_route_decode_here():
    from dsv4 import ops

    mc, _ = _mods()
    x, fn, base, scale, w, f, post, comb = _case(1, 1, 4096, seed=11)
    args = (fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS, w, EPS)
    for a, b in zip(ops.OPS["mhc_post_pre_norm"].fast(f, x, post, comb, *args),
                    mc.boundary(x, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, EPS, f, post, comb)):
        assert_bitwise_equal(a, b, "mhc_post_pre_norm")
    for a, b in zip(ops.OPS["mhc_pre_norm"].fast(x, *args),
                    mc.boundary(x, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, EPS)):
        assert_bitwise_equal(a, b, "mhc_pre_norm")
    # a prefill chunk (more than 8 tokens) and fp32 streams stay on Triton
    xl, fnl, basel, scalel, wl, *_ = _case(1, 9, 4096, seed=12)
    assert not mc.applies(xl, fnl, basel, scalel, 4, ITERS, wl)
    assert not mc.applies(x.float(), fn, base, scale, 4, ITERS, w)
    # a misaligned or non-contiguous mixer stays on Triton too (the kernel reads it as given, before the wait)
    fn_off = torch.empty(fn.numel() + 1, device="cuda")[1:].view_as(fn).copy_(fn)
    assert not mc.applies(x, fn_off, base, scale, 4, ITERS, w)
    assert not mc.applies(x, fn.t().contiguous().t(), base, scale, 4, ITERS, w)


def test_binding_refuses_bad_calls():
    mc, _ = _mods()
    mod = cuda_kernels.load()
    x, fn, base, scale, w, f, post, comb = _case(1, 1, 4096, seed=5)
    T, D = 1, 4096
    y = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    po, co = torch.empty(T, 4, device="cuda"), torch.empty(T, 4, 4, device="cuda")
    part, sq = torch.empty(T, 24, D // 64, device="cuda"), torch.empty(T, D // 64, device="cuda")
    cnt = torch.zeros(8, dtype=torch.int32, device="cuda")
    xs = x.view(T, 4, D)
    tail = (0.0, 1e-6, 1e-6, False, None, None, None, None)
    with pytest.raises(RuntimeError, match="come together"):
        mod.mhc_boundary(f.view(T, D), xs, None, comb, fn, base, scale, w, None, y, po, co, part, sq, cnt, 20, *tail)
    with pytest.raises(RuntimeError, match=r"D a multiple of 64 up to 7168 \(got T = 1, D = 100\)"):
        mod.mhc_boundary(None, xs[:, :, :100].contiguous(), None, None, fn, base, scale, w, None, y, po, co, part, sq,
                         cnt, 20, *tail)
    with pytest.raises(RuntimeError, match="fn must be fp32"):
        mod.mhc_boundary(None, xs, None, None, fn.double(), base, scale, w, None, y, po, co, part, sq, cnt, 20, *tail)
    with pytest.raises(RuntimeError, match="iters must be"):
        mod.mhc_boundary(None, xs, None, None, fn, base, scale, w, None, y, po, co, part, sq, cnt, 0, *tail)
    yq = torch.empty(T, D, dtype=torch.float8_e4m3fn, device="cuda")
    yqs = torch.empty(T, D // 128, device="cuda")
    with pytest.raises(RuntimeError, match="yq and yqs come together"):
        mod.mhc_boundary(None, xs, None, None, fn, base, scale, w, None, y, po, co, part, sq, cnt, 20, *tail[:4], yq,
                         None, None, None)
    with pytest.raises(RuntimeError, match="yq must be"):
        mod.mhc_boundary(None, xs, None, None, fn, base, scale, w, None, y, po, co, part, sq, cnt, 20, *tail[:4],
                         yq.view(torch.uint8), yqs, None, None)
    with pytest.raises(RuntimeError, match="yqs must be"):
        mod.mhc_boundary(None, xs, None, None, fn, base, scale, w, None, y, po, co, part, sq, cnt, 20, *tail[:4], yq,
                         yqs[:, 1:], None, None)
    ring = torch.empty(T, 4, D, dtype=torch.bfloat16, device="cuda")
    slot = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="keep and keep_slot come together"):
        mod.mhc_boundary(None, xs, None, None, fn, base, scale, w, None, y, po, co, part, sq, cnt, 20, *tail[:6], ring,
                         None)
    with pytest.raises(RuntimeError, match="keep must be"):
        mod.mhc_boundary(None, xs, None, None, fn, base, scale, w, None, y, po, co, part, sq, cnt, 20, *tail[:6],
                         ring[:, :, 1:], slot)
    with pytest.raises(RuntimeError, match="keep_slot must be"):
        mod.mhc_boundary(None, xs, None, None, fn, base, scale, w, None, y, po, co, part, sq, cnt, 20, *tail[:6], ring,
                         slot.int())
