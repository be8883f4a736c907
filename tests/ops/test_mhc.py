"""Fast mHC ops (dsv4/ops/mhc_triton.py) against their references: interpreted Triton on the CPU at small
shapes (tests/conftest.py sets TRITON_INTERPRET=1 there), Flash shapes and graph capture on a GPU."""

import pytest
import torch

from dsv4.testing import assert_close_rel

CUDA = torch.cuda.is_available()


def _fast():
    try:
        from dsv4.ops import mhc_triton
    except ImportError:
        pytest.skip("Triton is not installed")
    return mhc_triton


def _inputs(B, S, D, dev, dtype=torch.bfloat16, seed=0, hc=4):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mix = (2 + hc) * hc
    x = torch.randn(B, S, hc, D, generator=g).to(dtype)
    fn = torch.randn(mix, hc * D, generator=g) * 0.5 * (hc * D) ** -0.5
    base = torch.randn(mix, generator=g) * 0.5
    scale = 1 + torch.randn(3, generator=g) * 0.3
    return [t.to(dev) for t in (x, fn, base, scale)]


def _check_pre(B, S, D, dev, dtype=torch.bfloat16):
    from dsv4.ops.mhc import mhc_post_ref, mhc_pre_ref

    fast = _fast()
    x, fn, base, scale = _inputs(B, S, D, dev, dtype, seed=D + S)
    y, post, comb = fast.mhc_pre(x, fn, base, scale, 4, 20, 1e-6, 1e-6)
    ry, rpost, rcomb = mhc_pre_ref(x, fn, base, scale, 4, 20, 1e-6, 1e-6)
    out_name = "op_fp32_out" if dtype == torch.float32 else "op_bf16_out"
    assert_close_rel(y, ry, out_name)
    assert_close_rel(post, rpost, "op_fp32_out")
    assert_close_rel(comb, rcomb, "op_fp32_out")
    f = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
    assert_close_rel(fast.mhc_post(f, x, rpost, rcomb), mhc_post_ref(f, x, rpost, rcomb), out_name)


def _check_fused(B, S, D, dev, dtype=torch.bfloat16):
    # the fused boundary ops against the composition of the references
    from dsv4.ops.mhc import mhc_post_pre_norm_ref, mhc_pre_norm_ref

    fast = _fast()
    x, fn, base, scale = _inputs(B, S, D, dev, dtype, seed=3 * D + S)
    g = torch.Generator().manual_seed(D)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16).to(dev)
    args = (fn, base, scale, 4, 20, 1e-6, 1e-6, w, 1e-6)
    out_name = "op_fp32_out" if dtype == torch.float32 else "op_bf16_out"
    got, want = fast.mhc_pre_norm(x, *args), mhc_pre_norm_ref(x, *args)
    for a, b, name in zip(got, want, (out_name, "op_fp32_out", "op_fp32_out")):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close_rel(a, b, name)
    f = torch.randn(B, S, D, generator=g).to(dtype).to(dev)
    _, post, comb = want
    got = fast.mhc_post_pre_norm(f, x, post, comb, *args)
    # the streams: mhc_post's bit for bit (same per-element arithmetic), the reference's within rounding
    assert torch.equal(got[0], fast.mhc_post(f, x, post, comb))
    assert_close_rel(got[0], mhc_post_pre_norm_ref(f, x, post, comb, *args)[0], out_name)
    # the pre + norm of those streams (one ulp apart in a stream moves comb after 20 Sinkhorn rounds, so the
    # pre is held to the reference on the streams the kernel wrote, as ab_compare feeds every op)
    for a, b, name in zip(got[1:], mhc_pre_norm_ref(got[0], *args), (out_name, "op_fp32_out", "op_fp32_out")):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close_rel(a, b, name)


def _check_quant(B, S, D, dev):
    # quant=True: the same y, streams, post and comb bit for bit, and y's codes act_quant_ref's of that y bit for bit
    from dsv4.ops.act_quant import QuantAct, act_quant_ref

    fast = _fast()
    x, fn, base, scale = _inputs(B, S, D, dev, seed=5 * D + S)
    g = torch.Generator().manual_seed(D + 1)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16).to(dev)
    f = (torch.randn(B, S, D, generator=g) * 4).to(torch.bfloat16).to(dev)
    args = (fn, base, scale, 4, 20, 1e-6, 1e-6, w, 1e-6)
    _, post, comb = fast.mhc_pre_norm(x, *args)
    for plain, quant in ((fast.mhc_pre_norm(x, *args), fast.mhc_pre_norm(x, *args, quant=True)),
                         (fast.mhc_post_pre_norm(f, x, post, comb, *args),
                          fast.mhc_post_pre_norm(f, x, post, comb, *args, quant=True))):
        y = quant[-3]
        assert isinstance(y, QuantAct)
        for a, b in zip(plain[:-3] + (plain[-3], *plain[-2:]), quant[:-3] + (y.x, *quant[-2:])):
            assert torch.equal(a, b)
        q, s = act_quant_ref(y.x, 128)
        assert torch.equal(y.q.view(torch.uint8), q.reshape(-1, D).view(torch.uint8))  # -0 codes included
        assert torch.equal(y.s, s.reshape(-1, D // 128))


def _check_head(B, S, D, dev):
    from dsv4.ops.mhc import mhc_head_ref

    fast = _fast()
    x, _, _, _ = _inputs(B, S, D, dev)
    g = torch.Generator().manual_seed(5)
    fn = (torch.randn(4, 4 * D, generator=g) * (4 * D) ** -0.5).to(dev)
    base, scale = torch.randn(4, generator=g).to(dev), torch.tensor([1.2]).to(dev)
    assert_close_rel(fast.mhc_head(x, fn, base, scale, 1e-6, 1e-6), mhc_head_ref(x, fn, base, scale, 1e-6, 1e-6),
                     "op_bf16_out")


@pytest.mark.skipif(CUDA, reason="the interpreted tier runs where there is no GPU")
# D = 600: two column blocks of BLOCK_D = 512, the second partial
@pytest.mark.parametrize("B,S,D", [(1, 1, 64), (1, 3, 96), (2, 2, 128), (1, 2, 600)])
def test_interpreted_small(B, S, D):
    _check_pre(B, S, D, "cpu")
    _check_pre(B, S, D, "cpu", torch.float32)
    _check_head(B, S, D, "cpu")


@pytest.mark.skipif(CUDA, reason="the interpreted tier runs where there is no GPU")
@pytest.mark.parametrize("B,S,D", [(1, 1, 64), (1, 3, 96), (2, 2, 200)])
def test_interpreted_fused_boundary(B, S, D):
    # D = 96 / 200: partial column blocks (128 columns per program) and a row padded to a power of two
    _check_fused(B, S, D, "cpu")
    _check_fused(B, S, D, "cpu", torch.float32)


@pytest.mark.skipif(CUDA, reason="the interpreted tier runs where there is no GPU")
@pytest.mark.parametrize("B,S,D", [(1, 1, 128), (2, 1, 384)])
def test_interpreted_boundary_with_codes(B, S, D):
    # D = 384: three 128-blocks in a row padded to 512 (the padding block is not stored)
    _check_quant(B, S, D, "cpu")
    with pytest.raises(ValueError, match="multiple of 128"):
        x, fn, base, scale = _inputs(1, 1, 64, "cpu")
        _fast().mhc_pre_norm(x, fn, base, scale, 4, 20, 1e-6, 1e-6, torch.ones(64, dtype=torch.bfloat16), 1e-6,
                             quant=True)


# comb logits whose Sinkhorn converges slowly (three rows share two preferred columns): one round more or fewer
# moves comb ~100x the op_fp32_out tolerance, where random logits converge below it within 20 rounds
SLOW_COMB = 8.0 * torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1.0]])


def _slow_inputs(B, S, D, dev, seed):
    x, fn, base, scale = _inputs(B, S, D, "cpu", seed=seed)
    base[8:] = SLOW_COMB.flatten()
    return [t.to(dev) for t in (x, fn, base, torch.ones(3))]


def _far(a: torch.Tensor, b: torch.Tensor, name: str) -> bool:
    """a and b differ by over 20x the tolerance `name` allows (relative to b's largest magnitude)."""
    from dsv4.testing import TOLERANCES

    return float((a.float() - b.float()).abs().max()) > 20 * TOLERANCES[name][0] * float(b.float().abs().max())


def check_iterations_and_eps_count(fast_pre_norm, dev):
    """fast_pre_norm(x, fn, base, scale, iters, hc_eps, norm_eps, w, eps) -> (y, post, comb) against
    mhc_pre_norm_ref where the Sinkhorn's round count and each eps (and its sign) visibly move the result: the
    reference itself is checked to move by > 20x the tolerance when any of them changes."""
    from dsv4.ops.mhc import mhc_pre_norm_ref

    x, fn, base, scale = _slow_inputs(1, 3, 128, dev, seed=11)
    w = (1 + 0.3 * torch.randn(128, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16).to(dev)
    for cfg in ((20, 1e-6, 1e-6, 1e-6), (20, 1e-2, 0.5, 0.25)):
        def ref(iters, hc_eps, norm_eps, eps):
            return mhc_pre_norm_ref(x, fn, base, scale, 4, iters, hc_eps, norm_eps, w, eps)
        want = ref(*cfg)
        iters, hc_eps, norm_eps, eps = cfg
        if hc_eps < 1e-3:  # one Sinkhorn round more or fewer shows
            moved = [ref(iters - 1, *cfg[1:])[2], ref(iters + 1, *cfg[1:])[2]]
        else:  # each eps large enough that its sign shows
            moved = [ref(iters, -hc_eps, norm_eps, eps)[2], ref(iters, hc_eps, -norm_eps, eps)[1]]
            assert _far(ref(iters, hc_eps, norm_eps, -eps)[0], want[0], "op_bf16_out")
        for m in moved:
            assert _far(m, want[2] if m.shape == want[2].shape else want[1], "op_fp32_out")
        got = fast_pre_norm(x, fn, base, scale, *cfg, w)
        for a, b, name in zip(got, want, ("op_bf16_out", "op_fp32_out", "op_fp32_out")):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert_close_rel(a, b, name)


@(pytest.mark.gpu if CUDA else (lambda f: f))
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_sinkhorn_iterations_and_eps_count(impl):
    """The fast mhc_pre_norm (Triton: interpreted on the CPU, compiled on a GPU; the CUDA boundary kernel of decode
    rows on a GPU) runs the Sinkhorn's given number of rounds and adds each eps where the reference does."""
    if impl == "triton":
        fast = _fast()
        def run(x, fn, base, scale, iters, hc_eps, norm_eps, eps, w):
            return fast.mhc_pre_norm(x, fn, base, scale, 4, iters, hc_eps, norm_eps, w, eps)
    else:
        from dsv4.kernels import cuda as cuda_kernels

        if not CUDA or cuda_kernels.load() is None:
            pytest.skip("needs CUDA and the built kernels")
        from dsv4.ops import mhc_cuda

        def run(x, fn, base, scale, iters, hc_eps, norm_eps, eps, w):
            assert mhc_cuda.applies(x, fn, base, scale, 4, iters, w)
            return mhc_cuda.boundary(x, fn, base, scale, iters, hc_eps, norm_eps, w, eps)
    check_iterations_and_eps_count(run, "cuda" if CUDA else "cpu")


@pytest.mark.parametrize("S,slots", [(1, [2]), (3, [0, 1]), (5, [3, 0, 1, 2])])
def test_pre_norm_keeps_the_last_rows(S, slots):
    """keep = (ring, slots [m]): the reference and the fast op (interpreted Triton on the CPU; the CUDA launch on a
    GPU for one token) write the normed rows of the last m tokens into ring[:, slots], bit for bit the y they return,
    and leave every other slot as it was."""
    from dsv4 import ops
    from dsv4.ops.mhc import mhc_pre_norm_ref

    dev = "cuda" if CUDA else "cpu"
    B, D, r = 2, 128, 4
    x, fn, base, scale = _inputs(B, S, D, dev, seed=S)
    w = torch.ones(D, dtype=torch.bfloat16, device=dev)
    args = (fn, base, scale, 4, 20, 1e-6, 1e-6, w, 1e-6)
    sl = torch.tensor(slots, dtype=torch.int64, device=dev)
    m = len(slots)
    untouched = [i for i in range(r) if i not in slots]
    for fn_ in (mhc_pre_norm_ref, ops.OPS["mhc_pre_norm"].fast):
        if fn_ is None:
            continue
        ring = torch.full((B, r, D), 7.0, dtype=torch.bfloat16, device=dev)
        y = fn_(x, *args, keep=(ring, sl))[0]
        assert torch.equal(ring[:, sl], y[:, S - m:]), fn_
        assert bool((ring[:, untouched] == 7.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("S", [1, 4, 128, 37])
def test_flash_shapes(S):
    _check_pre(1, S, 4096, "cuda")
    _check_head(1, S, 4096, "cuda")
    _check_fused(1, S, 4096, "cuda")
    _check_quant(1, S, 4096, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replay_equals_eager():
    fast = _fast()
    x, fn, base, scale = _inputs(1, 1, 4096, "cuda")
    f = torch.randn(1, 1, 4096, device="cuda").to(torch.bfloat16)
    step = lambda: fast.mhc_post(f, x, *fast.mhc_pre(x, fn, base, scale, 4, 20, 1e-6, 1e-6)[1:])  # noqa: E731
    from dsv4.testing import graph_replay

    want, out = graph_replay(step)
    assert torch.equal(out, want)
    w = torch.rand(4096, device="cuda").to(torch.bfloat16)
    _, post, comb = fast.mhc_pre(x, fn, base, scale, 4, 20, 1e-6, 1e-6)
    args = (fn, base, scale, 4, 20, 1e-6, 1e-6, w, 1e-6)
    def fused():
        return torch.cat([t.float().flatten() for t in fast.mhc_post_pre_norm(f, x, post, comb, *args)])

    want, out = graph_replay(fused)
    assert torch.equal(out, want)
