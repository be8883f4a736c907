"""Fast MoE ops (dsv4/ops/moe_triton.py: router, moe_experts) against router_ref / moe_experts_ref.

Fresh random inputs every case; weights from the dsv4.formats quantizers, prepared and stacked as the model does.
Router: expert ids bitwise equal (only a near-tie of the reference's own scores, |a - b| <= 1e-5 relative, may
swap two experts: fp32 summation order; none is expected in these draws), weights within op_fp32_out. Experts:
within op_bf16_out. CPU tier: the Triton interpreter at small and odd shapes (tests/conftest.py sets
TRITON_INTERPRET=1 without CUDA); GPU tier: Flash shapes (D 4096, inter 2048, 256 experts, top-6, FP8 shared
expert), MXFP4 and NVFP4, decode (T = 1, 2, 4) and prefill chunks, determinism and CUDA-graph replay.
"""

import pytest
import torch

from dsv4 import formats
from dsv4.ops.linear import PreparedLinear, prepare_linear, stack_prepared
from dsv4.ops.moe import moe_experts_ref, router_ref
from dsv4.testing import assert_bitwise_equal, assert_close_rel, fp8_blocks_apart

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
cpu_tier = pytest.mark.skipif(CUDA, reason="the interpreted tier runs where there is no GPU")


def _fast():
    try:
        from dsv4.ops import moe_triton
    except ImportError:
        pytest.skip("Triton is not installed")
    return moe_triton


# ---------------------------------------------------------------------------------------------------------
# inputs


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _on(p: PreparedLinear, dev) -> PreparedLinear:
    """Every tensor of p on dev (the NVFP4 quantizer makes its fp32 scalars on the CPU)."""
    mv = (lambda t: None if t is None else t.to(dev))
    return PreparedLinear(p.fmt, p.n, p.k, mv(p.weight), mv(p.scale), mv(p.global_scale))


def _weights(fmt, E, n, k, g, dev, pair=False):
    """E experts [n, k] in fmt, prepared and stacked (pair: a list of two stacks quantized as NVFP4 w1/w3 pairs).
    g: a generator on dev (random weights are drawn where they are used)."""
    w = torch.randn(E, n, k, generator=g, device=g.device) * k ** -0.5
    if pair:
        w3 = torch.randn(E, n, k, generator=g, device=g.device) * k ** -0.5
        ps = [formats.nvfp4_quantize_pair(w[e], w3[e]) for e in range(E)]
        return [_on(stack_prepared([prepare_linear(p[i]) for p in ps]), dev) for i in (0, 1)]
    if fmt == "mxfp4":  # rows are independent: one call quantizes all experts
        q = prepare_linear(formats.Mxfp4Weight.quantize(w.flatten(0, 1)))
        return PreparedLinear("mxfp4", n, k, q.weight.view(E, n, k // 2), q.scale.view(E, n, k // 32))
    if fmt == "nvfp4":
        return _on(stack_prepared([prepare_linear(formats.Nvfp4Weight.quantize(w[e])) for e in range(E)]), dev)
    if fmt == "fp8":
        w = fp8_blocks_apart(w, g)
        return stack_prepared([prepare_linear(formats.Fp8BlockWeight.quantize(w[e])) for e in range(E)])
    return stack_prepared([prepare_linear(formats.DenseWeight.quantize(w[e])) for e in range(E)])


def _single(fmt, n, k, g, dev):
    w = torch.randn(n, k, generator=g, device=g.device) * k ** -0.5
    w = fp8_blocks_apart(w, g) if fmt == "fp8" else w
    cls = {"fp8": formats.Fp8BlockWeight, "mxfp4": formats.Mxfp4Weight, "nvfp4": formats.Nvfp4Weight,
           "dense": formats.DenseWeight}[fmt]
    return _on(prepare_linear(cls.quantize(w)), dev)


def _experts(T, D, N, E, k, fmt, sfmt, dev, seed, x_dtype=torch.bfloat16, distinct=True):
    g = _gen(seed)
    if fmt == "nvfp4":
        w1, w3 = _weights(fmt, E, N, D, g, dev, pair=True)
    else:
        w1, w3 = _weights(fmt, E, N, D, g, dev), _weights(fmt, E, N, D, g, dev)
    w2 = _weights(fmt, E, D, N, g, dev)
    shared = None if sfmt is None else tuple(_single(sfmt, n, kk, g, dev) for n, kk in ((N, D), (D, N), (N, D)))
    x = (torch.randn(T, D, generator=g) * 1.5).to(x_dtype).to(dev)
    if distinct:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    else:  # hash-layer style: any ids, repeats across tokens
        idx = torch.randint(0, E, (T, k), generator=g)
    wts = (torch.rand(T, k, generator=g) + 0.05) * 1.5 / k
    return x, wts.to(dev), idx.to(dev), w1, w2, w3, shared


def _check_experts(T, D, N, E, k, fmt, sfmt, dev, seed, act_quant=True, x_dtype=torch.bfloat16, limit=10.0,
                   distinct=True):
    fast = _fast()
    x, wts, idx, w1, w2, w3, shared = _experts(T, D, N, E, k, fmt, sfmt, dev, seed, x_dtype, distinct)
    y = fast.moe_experts(x, wts, idx, w1, w2, w3, shared, limit, act_quant)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref = moe_experts_ref(x, wts, idx, w1, w2, w3, shared, limit, act_quant)
    assert_close_rel(y, ref, "op_bf16_out" if x_dtype == torch.bfloat16 else "op_fp32_out")
    return fast, (x, wts, idx, w1, w2, w3, shared, limit, act_quant), y


def _router_inputs(T, D, E, k, dev, seed, hashed, vocab=97, x_dtype=torch.bfloat16, w_dtype=torch.bfloat16,
                   logit_scale=1.0):
    g = _gen(seed)
    x = torch.randn(T, D, generator=g).to(x_dtype).to(dev)
    weight = (torch.randn(E, D, generator=g) * logit_scale * D ** -0.5).to(w_dtype).to(dev)
    bias = None if hashed else (torch.randn(E, generator=g) * 0.1).to(dev)
    tid2eid = torch.rand(vocab, E, generator=g).argsort(-1)[:, :k].to(dev) if hashed else None
    ids = torch.randint(0, vocab, (T,), generator=g).to(dev)
    return x, weight, bias, tid2eid, ids


def _check_router(T, D, E, k, func, hashed, dev, seed, norm=True, scale=1.5, x_dtype=torch.bfloat16,
                  w_dtype=torch.bfloat16, logit_scale=1.0, fused=None):
    fast = _fast()
    x, weight, bias, tid2eid, ids = _router_inputs(T, D, E, k, dev, seed, hashed, x_dtype=x_dtype, w_dtype=w_dtype,
                                                   logit_scale=logit_scale)
    args = (x, weight, bias, tid2eid, ids, func, k, norm, scale)
    w, i = fast.router(*args)
    wr, ir = router_ref(*args)
    assert i.dtype == torch.int64 and w.dtype == torch.float32
    from dsv4.ops.triton_util import _COUNTERS
    counters = _COUNTERS.get((x.device, "router", "main"))  # the fused router's arrival counters are left at zero
    fused = not (T >= 16 and w_dtype == torch.bfloat16) if fused is None else fused
    assert not fused or (counters is not None and not counters.any())
    diff = (i != ir).any(-1)
    if bool(diff.any()):  # allowed only where the reference's own scores tie to 1e-5 (fp32 summation order)
        logits = x.float() @ weight.float().T
        s = {"softmax": logits.softmax(-1), "sigmoid": logits.sigmoid()}.get(func, None)
        s = torch.nn.functional.softplus(logits).sqrt() if s is None else s
        v = s + (bias if bias is not None else 0)
        for t in diff.nonzero().flatten().tolist():
            top = v[t].sort(descending=True).values[: k + 1]
            gaps = (top[:-1] - top[1:]).abs() / top.abs().max()
            assert bool((gaps < 1e-5).any()), f"router: token {t} experts {i[t].tolist()} vs {ir[t].tolist()}"
        assert int(diff.sum()) <= max(1, T // 64)
        keep = ~diff
        w, wr = w[keep], wr[keep]
    assert_close_rel(w, wr, "op_fp32_out")
    return fast, args


# ---------------------------------------------------------------------------------------------------------
# CPU tier: the Triton interpreter


@cpu_tier
@pytest.mark.parametrize("T,E,k,func,hashed", [
    (1, 16, 4, "sqrtsoftplus", False), (7, 32, 6, "sqrtsoftplus", False), (4, 16, 3, "sigmoid", False),
    (3, 16, 4, "softmax", False), (5, 16, 6, "sqrtsoftplus", True), (2, 12, 6, "sigmoid", True)])
def test_router_interpreted(T, E, k, func, hashed):
    _check_router(T, 192, E, k, func, hashed, "cpu", seed=T * 31 + E)


@cpu_tier
@pytest.mark.parametrize("func", ["softmax", "sqrtsoftplus"])
def test_router_large_logits_interpreted(func):
    # logits ~ +-100 (exp overflows fp32 past 88.7): the softmax subtracts its row maximum, the softplus takes its
    # large-argument branch
    _check_router(5, 192, 16, 4, func, False, "cpu", seed=9, logit_scale=60.0)


@cpu_tier
def test_router_unnormalised_interpreted():
    _check_router(3, 128, 16, 2, "sigmoid", False, "cpu", seed=4, norm=False, scale=2.5)


@cpu_tier
@pytest.mark.parametrize("hashed", [False, True])
def test_router_fused_token_blocks_interpreted(hashed):
    # an fp32 gate keeps 40 tokens on the one-launch router: three blocks of 16 tokens, each selected by the last
    # of its logits programs to arrive
    _check_router(40, 128, 32, 4, "sqrtsoftplus", hashed, "cpu", seed=40 + hashed, w_dtype=torch.float32)


@cpu_tier
@pytest.mark.parametrize("T,x_dtype", [(20, torch.bfloat16), (20, torch.float32), (40, torch.bfloat16)])
def test_router_gemm_interpreted(T, x_dtype):
    # T >= 16: the logits run as a tensor-core GEMM (fp32 activations split into three bf16 parts on a GPU); 64
    # experts are two expert tiles, 40 tokens two token tiles
    _check_router(T, 256, 64, 6, "sqrtsoftplus", False, "cpu", seed=T, x_dtype=x_dtype)


@cpu_tier
def test_router_unfused_interpreted(monkeypatch):
    # more token blocks than the fused router has arrival counters: logits GEMV then a separate selection launch
    # (40 tokens, 32 experts: a 2 x 3 grid of logits programs)
    monkeypatch.setattr(_fast(), "ROUTER_COUNTERS", 2)
    _check_router(40, 128, 32, 4, "sigmoid", False, "cpu", seed=41, w_dtype=torch.float32, fused=False)


@cpu_tier
@pytest.mark.parametrize("T,fmt,sfmt", [
    (1, "mxfp4", "fp8"), (1, "nvfp4", "fp8"), (2, "nvfp4", "fp8"), (4, "mxfp4", None), (7, "mxfp4", "fp8"),
    (9, "nvfp4", "fp8")])
def test_experts_interpreted(T, fmt, sfmt):
    _check_experts(T, 256, 128, 8, 3, fmt, sfmt, "cpu", seed=T, distinct=T != 7)


@cpu_tier
@pytest.mark.parametrize("B,S", [(1, 1), (1, 3)])
def test_moe_post_interpreted(B, S):
    """The fast moe_post (the fast experts, then Triton's mhc_post, on this path) against moe_post_ref, and against
    mhc_post_ref of the fast experts' own output (both within op_bf16_out)."""
    from dsv4 import ops
    from dsv4.ops.mhc import mhc_post_ref
    from dsv4.ops.moe import moe_post_ref

    _fast()
    x, wts, idx, w1, w2, w3, shared = _experts(B * S, 256, 128, 8, 3, "mxfp4", "fp8", "cpu", seed=40 + S)
    g = _gen(50 + S)
    streams = (torch.randn(B, S, 4, 256, generator=g) * 2).to(torch.bfloat16)
    post, comb = torch.rand(B, S, 4, generator=g) * 2, torch.rand(B, S, 4, 4, generator=g)
    args = (x, wts, idx, w1, w2, w3, shared, 10.0, True, streams, post, comb)
    out = ops.OPS["moe_post"].fast(*args)
    assert out.dtype == torch.bfloat16 and out.shape == streams.shape
    assert_close_rel(out, moe_post_ref(*args), "op_bf16_out")
    f = ops.OPS["moe_experts"].fast(*args[:9])
    assert_close_rel(out, mhc_post_ref(f.view(B, S, 256), streams, post, comb), "op_bf16_out")


@cpu_tier
@pytest.mark.parametrize("B,S", [(1, 1), (1, 3)])
def test_moe_post_pre_interpreted(B, S):
    """The fast moe_post_pre off the CUDA path: moe_post, then mhc_pre_norm on its streams, as bound (the two fast ops'
    own results, bit for bit; with mhc_pre_norm overridden to its reference, that reference's), and within tolerance
    of moe_post_pre_ref (the pre judged on the fast streams, as ab_compare does). Distinct eps values: a swapped
    argument would show."""
    from dsv4 import ops
    from dsv4.ops.mhc import mhc_pre_norm_ref
    from dsv4.ops.moe import moe_post_pre_ref

    _fast()
    D = 256
    x, wts, idx, w1, w2, w3, shared = _experts(B * S, D, 128, 8, 3, "mxfp4", "fp8", "cpu", seed=60 + S)
    g = _gen(70 + S)
    streams = (torch.randn(B, S, 4, D, generator=g) * 2).to(torch.bfloat16)
    post, comb = torch.rand(B, S, 4, generator=g) * 2, torch.rand(B, S, 4, 4, generator=g)
    fn = torch.randn(24, 4 * D, generator=g) * 0.5 * (4 * D) ** -0.5
    base, scale = torch.randn(24, generator=g) * 0.5, 1 + torch.randn(3, generator=g) * 0.3
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16)
    pre = (fn, base, scale, 4, 20, 1e-6, 3e-5, w, 2e-3)
    args = (x, wts, idx, w1, w2, w3, shared, 10.0, True, streams, post, comb)
    ops.configure("fast", "cpu")
    try:
        got = ops.OPS["moe_post_pre"].fast(*args, *pre)
        ops.configure("fast", "cpu", {"mhc_pre_norm": "ref"})
        got_ref_pre = ops.OPS["moe_post_pre"].fast(*args, *pre)
    finally:
        ops.configure("ref", "cpu")
    x_new = ops.OPS["moe_post"].fast(*args)
    for a, b in zip(got, (x_new, *ops.OPS["mhc_pre_norm"].fast(x_new, *pre))):
        assert_bitwise_equal(a, b, "moe_post_pre vs the two ops")
    ref = moe_post_pre_ref(*args, *pre)
    assert_close_rel(got[0], ref[0], "op_bf16_out")
    for a, b, name in zip(got[1:], mhc_pre_norm_ref(got[0], *pre), ("op_bf16_out", "op_fp32_out", "op_fp32_out")):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_close_rel(a, b, name)
    for a, b in zip(got_ref_pre, (x_new, *mhc_pre_norm_ref(x_new, *pre))):
        assert_bitwise_equal(a, b, "moe_post_pre with mhc_pre_norm bound to its reference")


@cpu_tier
def test_experts_interpreted_chunked_shared():
    # inter 512: the decode down kernel stacks the shared expert's K in chunks; hash-style repeated ids
    _check_experts(1, 128, 512, 4, 2, "mxfp4", "fp8", "cpu", seed=11)
    _check_experts(2, 128, 512, 4, 3, "nvfp4", "mxfp4", "cpu", seed=12, distinct=False)
    # an NVFP4 shared expert: its three weights' own global scales (the routed NVFP4 pairs share w1's and w3's)
    _check_experts(1, 128, 256, 4, 2, "mxfp4", "nvfp4", "cpu", seed=14)
    _check_experts(3, 128, 128, 4, 2, "mxfp4", "nvfp4", "cpu", seed=15)


@cpu_tier
def test_experts_interpreted_other_numerics():
    # exact numerics (no activation quantization, fp32 activations, bf16 dense weights) and fp32 + FP8 simulation
    _check_experts(2, 128, 128, 4, 2, "dense", "dense", "cpu", seed=5, act_quant=False, x_dtype=torch.float32)
    _check_experts(6, 256, 256, 4, 2, "fp8", "fp8", "cpu", seed=6, x_dtype=torch.float32)
    _check_experts(3, 128, 128, 4, 2, "mxfp4", "fp8", "cpu", seed=7, act_quant=False, limit=0.0)
    # dense weights whose K (D = 200, inter = 72) no power-of-two BK divides: the masked K tails (EVEN_K false; FP4
    # and FP8 K always split evenly), the one-token decode and the sorted paths
    _check_experts(1, 200, 72, 4, 2, "dense", "dense", "cpu", seed=21, act_quant=False)
    _check_experts(19, 200, 72, 4, 2, "dense", "dense", "cpu", seed=22, act_quant=False)


@pytest.fixture
def stacked_decode():
    """Route T <= 4 tokens through the two-launch decode kernels (the default sends T >= 2 to the sorted path)."""
    mt = _fast()
    saved = dict(mt.CONFIG_OVERRIDES)
    mt.CONFIG_OVERRIDES["decode_max_t"] = 4
    yield
    mt.CONFIG_OVERRIDES.clear()
    mt.CONFIG_OVERRIDES.update(saved)


@cpu_tier
def test_experts_stacked_decode_interpreted(stacked_decode):
    _check_experts(3, 256, 256, 8, 3, "mxfp4", "fp8", "cpu", seed=13, distinct=False)


@cpu_tier
@pytest.mark.parametrize("P,pp", [(700, 1024), (700, 0), (1, 1024), (65, 0)])
def test_prefill_sort_interpreted(P, pp):
    # the prefill's device sort, one tl.sort (pp) or chunks of 64 pairs (pp = 0): the stable sort by expert, the
    # per-expert pair offsets and the work-item offsets (ceil(count / 8) items per expert)
    import triton

    mt = _fast()
    E, bmt = 256, 8
    g = _gen(P + pp)
    idx = torch.randint(0, E, (P,), generator=g)
    idx[: P // 3] = idx[0]  # a crowded expert: its pairs must stay in pair order
    srt, seg, toff = (torch.full((n,), -7, dtype=torch.int32) for n in (P, E + 1, E + 1))
    mt._moe_sort_kernel[(1,)](idx, srt, seg, toff, P, E, BMT=bmt, EP=triton.next_power_of_2(E), CH=64, PP=pp)
    counts = torch.bincount(idx, minlength=E)
    assert torch.equal(srt.long(), torch.argsort(idx, stable=True))
    assert torch.equal(seg.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    items = (counts + bmt - 1) // bmt
    assert torch.equal(toff.long(), torch.cat([torch.zeros(1, dtype=torch.long), items.cumsum(0)]))


@cpu_tier
@pytest.mark.parametrize("shared", [False, True])
def test_combine_interpreted(shared):
    # the prefill's last step alone at a width past one column block (BD = 1024: three blocks, the last partial):
    # per token its k outputs in ascending expert order (ties by slot), then the shared expert's, summed in fp32 and
    # rounded to bf16
    import triton

    mt = _fast()
    T, k, D = 3, 3, 2100
    g = _gen(31 + shared)
    idx = torch.tensor([[5, 1, 5], [0, 7, 2], [3, 3, 3]])
    # in each token's order the first two outputs cancel (B, -B, B ~ 2^20) and the third is ~1: summed in that order
    # the third survives, in any other it is lost to rounding and the sum is 0 or +-B (the shared output, ~1, adds last)
    big = (torch.randn(T, D, generator=g) * 2**20).to(torch.bfloat16)
    ys = torch.randn(T * (k + 1), D, generator=g).to(torch.bfloat16)
    for t, (j0, j1) in enumerate([(1, 0), (0, 2), (0, 1)]):  # the first two slots in ascending (expert, slot) order
        ys[t * k + j0], ys[t * k + j1] = big[t], -big[t]
    y = torch.full((T, D), float("nan"), dtype=torch.bfloat16)
    BD = min(1024, triton.next_power_of_2(D))
    mt._moe_combine_kernel[(T, triton.cdiv(D, BD))](ys, idx, y, T, D, KTOP=k, KP=4, HAS_SHARED=shared, BF16=True,
                                                     BD=BD, num_warps=4)
    want = torch.empty(T, D)
    for t in range(T):
        acc = torch.zeros(D)
        for j in sorted(range(k), key=lambda j: (int(idx[t, j]), j)):
            acc = acc + ys[t * k + j].float()
        want[t] = acc + ys[T * k + t].float() if shared else acc
    assert_bitwise_equal(y, want.to(torch.bfloat16), "moe combine")


@cpu_tier
def test_experts_deterministic_interpreted():
    fast, args, y = _check_experts(5, 128, 128, 8, 2, "mxfp4", "fp8", "cpu", seed=8)
    assert torch.equal(fast.moe_experts(*args), y)


def test_experts_rejects_bad_input():
    fast = _fast()
    x, wts, idx, w1, w2, w3, shared = _experts(1, 128, 128, 2, 1, "dense", "dense", "cpu", seed=3)
    f32 = stack_prepared([prepare_linear(formats.DenseWeight.quantize(torch.randn(128, 128), torch.float32))] * 2)
    with pytest.raises(ValueError, match="must be bf16"):
        fast.moe_experts(x, wts, idx, f32, w2, w3, shared, 10.0, False)
    with pytest.raises(ValueError, match="formats differ"):
        fast.moe_experts(x, wts, idx, w1, _weights("fp8", 2, 128, 128, _gen(1), "cpu"), w3, shared, 10.0, False)
    with pytest.raises(ValueError, match="must be \\[1, k\\]"):
        fast.moe_experts(x, wts, idx[:, :0].repeat(2, 1), w1, w2, w3, shared, 10.0, False)
    with pytest.raises(ValueError, match="func must be one of"):
        fast.router(x, torch.zeros(4, 128), torch.zeros(4), None, idx[:, 0], "relu", 2, True, 1.0)


# ---------------------------------------------------------------------------------------------------------
# GPU tier: Flash shapes

FLASH = dict(D=4096, N=2048, E=256, k=6)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,func,hashed", [(1, "sqrtsoftplus", False), (4, "sqrtsoftplus", False),
                                           (128, "sqrtsoftplus", False), (1, "sqrtsoftplus", True),
                                           (128, "sqrtsoftplus", True), (7, "sigmoid", False), (3, "softmax", False),
                                           (300, "softmax", False)])
def test_router_flash(T, func, hashed):
    _check_router(T, FLASH["D"], FLASH["E"], FLASH["k"], func, hashed, "cuda", seed=100 + T)


@pytest.mark.gpu
@gpu
def test_router_flash_fp32_activations():
    _check_router(64, FLASH["D"], FLASH["E"], FLASH["k"], "sqrtsoftplus", False, "cuda", seed=64,
                  x_dtype=torch.float32)


@pytest.fixture(scope="module")
def flash_weights():
    """MXFP4 and NVFP4 routed experts of one Flash layer and the FP8 shared expert, on the GPU (made once)."""
    if not CUDA:
        pytest.skip("needs CUDA")
    D, N, E = FLASH["D"], FLASH["N"], FLASH["E"]
    g = torch.Generator(device="cuda").manual_seed(7)
    out = {}
    for fmt in ("mxfp4", "nvfp4"):
        w1, w3 = _weights(fmt, E, N, D, g, "cuda", pair=True) if fmt == "nvfp4" else \
            (_weights(fmt, E, N, D, g, "cuda"), _weights(fmt, E, N, D, g, "cuda"))
        out[fmt] = (w1, _weights(fmt, E, D, N, g, "cuda"), w3)
    out["shared"] = tuple(_single("fp8", n, kk, g, "cuda") for n, kk in ((N, D), (D, N), (N, D)))
    return out


def _flash_inputs(T, seed, hashed=False):
    g = _gen(seed)
    E, k = FLASH["E"], FLASH["k"]
    x = (torch.randn(T, FLASH["D"], generator=g) * 1.5).to(torch.bfloat16).cuda()
    idx = torch.randint(0, E, (T, k), generator=g) if hashed else \
        torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = (torch.rand(T, k, generator=g) + 0.05) * 1.5 / k
    return x, wts.cuda(), idx.cuda()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T", [1, 2, 4, 7, 128])
def test_experts_flash(flash_weights, fmt, T):
    fast = _fast()
    x, wts, idx = _flash_inputs(T, seed=T, hashed=T == 2)
    args = (x, wts, idx, *flash_weights[fmt], flash_weights["shared"], 10.0, True)
    y = fast.moe_experts(*args)
    assert_close_rel(y, moe_experts_ref(*args), "op_bf16_out")
    assert torch.equal(fast.moe_experts(*args), y), "two runs differ"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [2, 4])
def test_experts_flash_stacked_decode(flash_weights, stacked_decode, T):
    fast = _fast()
    x, wts, idx = _flash_inputs(T, seed=40 + T, hashed=T == 2)
    args = (x, wts, idx, *flash_weights["nvfp4"], flash_weights["shared"], 10.0, True)
    assert_close_rel(fast.moe_experts(*args), moe_experts_ref(*args), "op_bf16_out")


@pytest.mark.gpu
@gpu
def test_experts_flash_no_shared_and_fp32(flash_weights):
    fast = _fast()
    x, wts, idx = _flash_inputs(3, seed=33)
    args = (x.float(), wts, idx, *flash_weights["mxfp4"], None, 10.0, True)
    assert_close_rel(fast.moe_experts(*args), moe_experts_ref(*args), "op_fp32_out")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 4])
def test_graph_replay_equals_eager(flash_weights, T):
    fast = _fast()
    x, _, _ = _flash_inputs(T, seed=50 + T)
    _, weight, bias, _, ids = _router_inputs(T, FLASH["D"], FLASH["E"], FLASH["k"], "cuda", 9, False)
    w = flash_weights["mxfp4"]

    def step():
        wts, idx = fast.router(x, weight, bias, None, ids, "sqrtsoftplus", FLASH["k"], True, 1.5)
        return fast.moe_experts(x, wts, idx, *w, flash_weights["shared"], 10.0, True)

    from dsv4.testing import graph_replay

    want, out = graph_replay(step)
    assert torch.equal(out, want)
