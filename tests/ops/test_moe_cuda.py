"""dsv4.ops.moe_cuda (the CUDA decode experts, dsv4/kernels/cuda/moe.cu, with the fused mHC post; the decode router,
router.cu) against `moe_experts_ref` / `moe_post_ref` / `router_ref` (GPU only).

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
ITERS, HC_EPS, NORM_EPS, EPS = 20, 1e-4, 0.05, 0.3  # the next pre's Sinkhorn and norms: distinct and large enough that
# an argument taken for another moves the outputs past their tolerances (streams ~2 randn: mean square ~4)
NO_PRE = (None,) * 10 + (1, 0.0, 0.0, 0.0)  # moe_decode's trailing arguments without the next sublayer's pre


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


def test_widest_hidden():
    """D = 8192, the widest the kernels take: a K quarter of 2048 values, 16 blocks, half of them staged by each warp of
    a pair; within tolerance of the reference with x quantized in the up kernel, and its codes given: the same bits."""
    from dsv4.ops.act_quant import quant_act_ref

    x, wts, idx, w1, w2, w3, sh = _case(8192, 512, 4, 2, seed=24)
    y = _check((x, wts, idx, w1, w2, w3, sh))
    assert_bitwise_equal(_mc().moe_decode(quant_act_ref(x), wts, idx, w1, w2, w3, sh, 10.0), y, "codes given")


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


def _streams(D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    streams = (torch.randn(1, 1, 4, D, generator=g, device="cuda") * 2).to(torch.bfloat16)
    return streams, torch.rand(1, 1, 4, generator=g, device="cuda") * 2, torch.rand(1, 1, 4, 4, generator=g, device="cuda")


@pytest.mark.parametrize("shared", [True, False])
def test_moe_post_in_the_down_kernel(flash, shared):
    """The FFN's mHC post in the down kernel's epilogue: bit for bit Triton's mhc_post of the kernel's own y, and
    within tolerance of moe_post_ref; the registered fast moe_post takes this path for one token."""
    from dsv4 import ops
    from dsv4.ops import mhc_triton
    from dsv4.ops.moe import moe_post_ref

    x, wts, idx, w1, w2, w3, sh = flash
    sh = sh if shared else None
    streams, post, comb = _streams(4096, seed=5)
    mc = _mc()
    assert mc.post_applies(x, streams, post, comb)
    out = mc.moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0, (streams, post, comb))
    y = mc.moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0)
    assert_bitwise_equal(out, mhc_triton.mhc_post(y.view(1, 1, -1), streams, post, comb), "fused post vs mhc_post")
    args = (x, wts, idx, w1, w2, w3, sh, 10.0, True, streams, post, comb)
    assert_close_rel(out, moe_post_ref(*args), TOL)
    assert_bitwise_equal(ops.OPS["moe_post"].fast(*args), out, "fast moe_post vs the fused kernel")
    assert not mc.post_applies(x, streams.float(), post, comb)
    assert not mc.post_applies(x, streams, post[..., :3], comb)


@pytest.mark.parametrize("shared", [True, False])
def test_codes_given_equal_codes_made(flash, shared):
    """x with its quantization (a QuantAct, as the mHC boundary hands it over): the up kernel copies the codes instead
    of quantizing x, and the output (y, and the fused post's streams) keeps the same bits; codes of another x are
    read (the output follows them), and codes the kernels cannot take leave the call to the plain path."""
    from dsv4.ops.act_quant import QuantAct, quant_act_ref

    x, wts, idx, w1, w2, w3, sh = flash
    sh = sh if shared else None
    mc = _mc()
    xa = quant_act_ref(x)
    assert mc.applies(xa, wts, idx, w1, w2, w3, sh, True)
    assert_bitwise_equal(mc.moe_decode(xa, wts, idx, w1, w2, w3, sh, 10.0),
                         mc.moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0), "codes given vs made in the kernel")
    streams, post, comb = _streams(4096, seed=7)
    assert mc.post_applies(xa, streams, post, comb)
    assert_bitwise_equal(mc.moe_decode(xa, wts, idx, w1, w2, w3, sh, 10.0, (streams, post, comb)),
                         mc.moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0, (streams, post, comb)), "fused post, codes")
    # the codes are what the up kernel reads: another x's codes give that x's experts output
    g = torch.Generator(device="cuda").manual_seed(11)
    x2 = (torch.randn(1, 4096, generator=g, device="cuda") * 3).to(torch.bfloat16)
    assert_bitwise_equal(mc.moe_decode(QuantAct(x, *quant_act_ref(x2)[1:]), wts, idx, w1, w2, w3, sh, 10.0),
                         mc.moe_decode(x2, wts, idx, w1, w2, w3, sh, 10.0), "another x's codes")
    assert not mc.applies(QuantAct(x, xa.q[:, 1:], xa.s), wts, idx, w1, w2, w3, sh, True)
    assert not mc.applies(QuantAct(x, xa.q, xa.s.double()), wts, idx, w1, w2, w3, sh, True)
    # the binding's own refusals
    from dsv4.kernels import cuda as cuda_kernels

    mod = cuda_kernels.load()
    h = torch.empty(7, 2048, dtype=torch.bfloat16, device="cuda")
    s6 = (None,) * 6 if sh is None else (sh[0].weight, sh[0].scale, sh[2].weight, sh[2].scale, sh[1].weight,
                                         sh[1].scale)
    head = (x, wts, idx, w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale, *s6, h, torch.empty_like(x),
            10.0, False, None, None, None, None)
    with pytest.raises(RuntimeError, match="xq and xqs come together"):
        mod.moe_decode(*head, xa.q, None, *NO_PRE)
    with pytest.raises(RuntimeError, match="xq must be"):
        mod.moe_decode(*head, xa.q.view(torch.uint8), xa.s, *NO_PRE)
    with pytest.raises(RuntimeError, match="xqs must be"):
        mod.moe_decode(*head, xa.q, xa.s[:, 1:], *NO_PRE)


def test_moe_post_graph_replay_equals_eager(flash):
    x, wts, idx, w1, w2, w3, sh = flash
    streams, post, comb = _streams(4096, seed=6)
    want, out = graph_replay(lambda: _mc().moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0, (streams, post, comb)))
    assert torch.equal(out, want)


def _next_pre(D, seed):
    """The next sublayer's mixer (fn, base, scale) and RMSNorm weight, as test_mhc_cuda draws them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    fn = torch.randn(24, 4 * D, generator=g, device="cuda") * 0.5 * (4 * D) ** -0.5
    base = torch.randn(24, generator=g, device="cuda") * 0.5
    scale = 1 + torch.randn(3, generator=g, device="cuda") * 0.3
    w = (1 + 0.3 * torch.randn(D, generator=g, device="cuda")).to(torch.bfloat16)
    return fn, base, scale, w


def _check_next_pre(got, streams_want, fn, base, scale, w):
    """got = (streams, y, post, comb) of the fused pre: the streams bit for bit streams_want (the down kernel's post),
    y / post / comb within the op tolerances of the reference pre + norm of those streams and of the mHC boundary
    kernel's (another grouping of the partial sums)."""
    from dsv4.ops import mhc_cuda
    from dsv4.ops.mhc import mhc_pre_norm_ref

    assert_bitwise_equal(got[0], streams_want, "streams")
    ref = mhc_pre_norm_ref(got[0], fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS, w, EPS)
    kern = mhc_cuda.boundary(got[0], fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, EPS)
    for a, b, c, name in zip(got[1:], ref, kern, ("op_bf16_out", "op_fp32_out", "op_fp32_out")):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert_close_rel(a, b, name)
        assert_close_rel(a, c, name)


@pytest.mark.parametrize("D,N,E,k,shared", [(4096, 2048, 256, 6, True), (4096, 2048, 256, 6, False),
                                            (2048, 512, 8, 3, True), (6144, 1024, 8, 2, True)])
def test_next_pre_in_the_down_kernel(flash, D, N, E, k, shared):
    """The next sublayer's mHC pre + RMSNorm after the fused post (moe_post_pre): the streams bit for bit the fused
    post's, the pre within tolerance of the reference and of the boundary kernel on those streams; the registered
    fast moe_post_pre takes this path for one token (same bits) and holds to moe_post_pre_ref; reruns give the same
    bits and leave the arrival counter at zero."""
    from dsv4 import ops
    from dsv4.ops.moe import moe_post_pre_ref
    from dsv4.ops.triton_util import arrival_counters

    x, wts, idx, w1, w2, w3, sh = flash if D == 4096 and shared else _case(D, N, E, k, seed=D + k, shared=shared)
    mc = _mc()
    streams, post, comb = _streams(D, seed=13)
    fn, base, scale, w = _next_pre(D, seed=D + 1)
    assert mc.pre_applies(x, N, fn, base, scale, 4, ITERS, w)
    pre = (fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, EPS)
    got = mc.moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0, (streams, post, comb), pre)
    _check_next_pre(got, mc.moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0, (streams, post, comb)), fn, base, scale, w)
    args = (x, wts, idx, w1, w2, w3, sh, 10.0, True, streams, post, comb, fn, base, scale, 4, ITERS, HC_EPS, NORM_EPS,
            w, EPS)
    for a, b in zip(ops.OPS["moe_post_pre"].fast(*args), got):
        assert_bitwise_equal(a, b, "fast moe_post_pre vs the fused kernel")
    assert_close_rel(got[0], moe_post_pre_ref(*args)[0], TOL)
    for _ in range(2):
        for a, b in zip(mc.moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0, (streams, post, comb), pre), got):
            assert_bitwise_equal(a, b, "rerun")
    torch.cuda.synchronize()
    assert int(arrival_counters(x.device, "moe next pre", 1).abs().sum()) == 0


def test_next_pre_graph_replay_and_refusals(flash):
    from dsv4.ops.triton_util import arrival_counters

    x, wts, idx, w1, w2, w3, sh = flash
    mc = _mc()
    streams, post, comb = _streams(4096, seed=14)
    fn, base, scale, w = _next_pre(4096, seed=15)
    pre = (fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, EPS)

    def step():
        return torch.cat([t.float().flatten() for t in mc.moe_decode(x, wts, idx, w1, w2, w3, sh, 10.0,
                                                                     (streams, post, comb), pre)])

    first = step()
    want, out = graph_replay(step)
    assert_bitwise_equal(out, want, "graph")
    assert_bitwise_equal(out, first, "graph vs eager")
    # what the fused pre does not take: another hc, an fp32 norm weight, a misaligned mixer, a row past the down
    # kernel's shared memory (D 8192 with inter 512: 80 KB of row and weight against 65 KB)
    assert not mc.pre_applies(x, 2048, fn, base, scale, 2, ITERS, w)
    assert not mc.pre_applies(x, 2048, fn, base, scale, 4, ITERS, w.float())
    fn_off = torch.empty(fn.numel() + 1, device="cuda")[1:].view_as(fn).copy_(fn)
    assert not mc.pre_applies(x, 2048, fn_off, base, scale, 4, ITERS, w)
    x8 = torch.zeros(1, 8192, dtype=torch.bfloat16, device="cuda")
    fn8, base8, scale8, w8 = _next_pre(8192, seed=16)
    assert mc.pre_applies(x8, 2048, fn8, base8, scale8, 4, ITERS, w8)
    assert not mc.pre_applies(x8, 512, fn8, base8, scale8, 4, ITERS, w8)
    # the binding's refusals
    from dsv4.kernels import cuda as cuda_kernels

    mod = cuda_kernels.load()
    h = torch.empty(7, 2048, dtype=torch.bfloat16, device="cuda")
    s6 = (sh[0].weight, sh[0].scale, sh[2].weight, sh[2].scale, sh[1].weight, sh[1].scale)
    out = torch.empty_like(streams)
    head = (x, wts, idx, w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale, *s6, h, torch.empty_like(x),
            10.0, False)
    ny, npost, ncomb = torch.empty(1, 4096, dtype=torch.bfloat16, device="cuda"), torch.empty(4, device="cuda"), \
        torch.empty(16, device="cuda")
    part, sq = torch.empty(24, 256, device="cuda"), torch.empty(256, device="cuda")
    cnt = arrival_counters(x.device, "moe next pre", 1)
    full = (fn, base, scale, w, ny, npost, ncomb, part, sq, cnt, ITERS, HC_EPS, NORM_EPS, EPS)
    with pytest.raises(RuntimeError, match="come together"):
        mod.moe_decode(*head, streams, post, comb, out, None, None, *((None,) + full[1:]))
    with pytest.raises(RuntimeError, match="needs the FFN's post"):
        mod.moe_decode(*head, None, None, None, None, None, None, *full)
    with pytest.raises(RuntimeError, match="part \\[24, D / 16\\]"):
        mod.moe_decode(*head, streams, post, comb, out, None, None, *full[:7], part[1:], *full[8:])
    with pytest.raises(RuntimeError, match="nw and ny"):
        mod.moe_decode(*head, streams, post, comb, out, None, None, *full[:3], w.float(), *full[4:])
    assert int(cnt.abs().sum()) == 0


# ---------------------------------------------------------------------------------------------------------
# the decode router (router.cu)


def _router_case(T, E, D, k, hashed, seed, vocab=50):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    gate = (torch.randn(E, D, generator=g, device="cuda") * D ** -0.5).to(torch.bfloat16)
    bias = None if hashed else torch.randn(E, generator=g, device="cuda") * 0.1
    tid2eid = torch.rand(vocab, E, generator=g, device="cuda").argsort(-1)[:, :k] if hashed else None
    ids = torch.randint(0, vocab, (T,), generator=g, device="cuda")
    return x, gate, bias, tid2eid, ids


def _router_check(args, func, k, norm=True, scale=1.5):
    """The CUDA router against router_ref: the same experts (where the reference's own biased scores do not tie to
    1e-5: fp32 summation order), weights within op_fp32_out, and the arrival counter left at zero."""
    from dsv4.ops.moe import router_ref
    from dsv4.ops.triton_util import _COUNTERS

    x, gate, bias, tid2eid, ids = args
    mc = _mc()
    assert mc.router_applies(x, gate, bias, tid2eid, ids, func, k)
    w, i = mc.router(x, gate, bias, tid2eid, ids, func, k, norm, scale)
    wr, ir = router_ref(x, gate, bias, tid2eid, ids, func, k, norm, scale)
    assert i.dtype == torch.int64 and w.dtype == torch.float32 and i.shape == ir.shape
    assert not _COUNTERS[(x.device, "router decode", "main")].any()
    diff = (i != ir).any(-1)
    for t in diff.nonzero().flatten().tolist():
        # a different choice must still be a top k of the reference's own biased scores, up to 1e-5 (a near-tie)
        logits = x[t].float() @ gate.float().T
        s = {"softmax": logits.softmax(-1), "sigmoid": logits.sigmoid()}.get(func)
        v = (torch.nn.functional.softplus(logits).sqrt() if s is None else s) + (0 if bias is None else bias)
        rest = torch.ones_like(v, dtype=torch.bool)
        rest[i[t]] = False
        assert float(v[i[t]].min()) >= float(v[rest].max()) - 1e-5 * float(v.abs().max()), \
            f"router token {t}: {i[t].tolist()} vs {ir[t].tolist()}"
    assert int(diff.sum()) <= max(1, x.shape[0] // 64)
    assert_close_rel(w[~diff], wr[~diff], "op_fp32_out")
    return w, i


@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("hashed", [False, True])
def test_router_flash(T, hashed):
    _router_check(_router_case(T, 256, 4096, 6, hashed, seed=T + 10 * hashed), "sqrtsoftplus", 6)


@pytest.mark.parametrize("T,E,D,k,func,norm", [(3, 64, 136, 3, "sigmoid", True), (2, 32, 8, 1, "softmax", False),
                                               (5, 96, 2056, 4, "softmax", False), (1, 512, 8192, 16, "sigmoid", True),
                                               (7, 384, 7168, 8, "sqrtsoftplus", False),
                                               (8, 256, 4096, 6, "softmax", False),
                                               (8, 512, 64, 16, "sigmoid", True)])  # the largest selection arrays
def test_router_odd_shapes(T, E, D, k, func, norm):
    _router_check(_router_case(T, E, D, k, False, seed=T * E), func, k, norm, scale=2.5)


def test_router_hash_odd_shapes():
    _router_check(_router_case(3, 64, 520, 5, True, seed=5), "sigmoid", 5, scale=1.0)


def test_router_ties_to_the_lowest_expert():
    """Duplicate gate rows and equal biases make exact ties at the top: the lower expert id is taken first (its twin
    only after it), the same choice as the Triton router's."""
    from dsv4.ops import moe_triton

    x, gate, bias, _, ids = _router_case(4, 64, 256, 6, False, seed=3)
    gate[40:48] = gate[8:16]
    bias[8:16] += 10.0
    bias[40:48] = bias[8:16]  # experts 40..47 tie exactly with 8..15, far above the rest
    _, i = _mc().router(x, gate, bias, None, ids, "sqrtsoftplus", 6, True, 1.5)
    for row in i.tolist():
        for p, e in enumerate(row):
            assert 8 <= e < 16 or (40 <= e < 48 and e - 32 in row[:p]), row
    assert any(e >= 40 for row in i.tolist() for e in row)  # the ties were reached
    _, it = moe_triton.router(x, gate, bias, None, ids, "sqrtsoftplus", 6, True, 1.5)
    assert torch.equal(i, it)


def test_router_nan_scores_give_valid_experts():
    """A NaN in x makes every logit of its token NaN: the experts are still k distinct valid ids (the kernel ranks NaN
    last; the reference's topk may pick any), and the other tokens are unaffected."""
    x, gate, bias, _, ids = _router_case(2, 64, 256, 6, False, seed=8)
    x[1, 7] = float("nan")
    w, i = _mc().router(x, gate, bias, None, ids, "sqrtsoftplus", 6, True, 1.5)
    assert bool(((i[1] >= 0) & (i[1] < 64)).all()) and len(set(i[1].tolist())) == 6
    wc, ic = _mc().router(x[:1], gate, bias, None, ids[:1], "sqrtsoftplus", 6, True, 1.5)
    assert torch.equal(i[0], ic[0]) and torch.equal(w[0], wc[0])


def test_router_deterministic_and_graph_replay():
    args = _router_case(4, 256, 4096, 6, False, seed=77)

    def step():
        return _mc().router(*args, "sqrtsoftplus", 6, True, 1.5)

    w, i = step()
    w2, i2 = step()
    assert_bitwise_equal(w2, w, "router rerun")
    assert torch.equal(i2, i)
    want, out = graph_replay(lambda: torch.cat([t.float() for t in step()], 1))
    assert torch.equal(out, want)


def test_router_fast_op_dispatch():
    """The fast `router` runs the CUDA kernel for 1-8 bf16 tokens (its bits) and the Triton kernels otherwise."""
    from dsv4 import ops

    x, gate, bias, tid2eid, ids = _router_case(2, 256, 4096, 6, False, seed=9)
    fast = ops.OPS["router"].fast
    w, i = fast(x, gate, bias, None, ids, "sqrtsoftplus", 6, True, 1.5)
    wc, ic = _mc().router(x, gate, bias, None, ids, "sqrtsoftplus", 6, True, 1.5)
    assert_bitwise_equal(w, wc, "fast router vs CUDA")
    assert torch.equal(i, ic)
    mc = _mc()
    assert not mc.router_applies(x.float(), gate, bias, None, ids, "sqrtsoftplus", 6)
    assert not mc.router_applies(x.repeat(5, 1), gate, bias, None, ids.repeat(5), "sqrtsoftplus", 6)  # 10 tokens
    assert not mc.router_applies(x, gate[:48], bias[:48], None, ids, "sqrtsoftplus", 6)  # E % 32
    assert not mc.router_applies(x, gate, bias, None, ids, "relu", 6)
    assert not mc.router_applies(x, gate, bias, None, ids, "sqrtsoftplus", 17)


def test_router_binding_refuses_bad_shapes():
    from dsv4.kernels import cuda as cuda_kernels

    mod = cuda_kernels.load()
    x, gate, bias, _, _ = _router_case(2, 48, 64, 2, False, seed=1)
    logits = torch.empty(2, 48, device="cuda")
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    w = torch.empty(2, 2, device="cuda")
    i = torch.empty(2, 2, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="E must be a multiple of 32"):
        mod.router(x, gate, bias, None, None, logits, cnt, w, i, 2, True, 1.0, False)
