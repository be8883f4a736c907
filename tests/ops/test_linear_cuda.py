"""dsv4.ops.linear_cuda (the CUDA skinny GEMV, dsv4/kernels/cuda/gemv.cu, and the prefill GEMM, gemm.cu) against
`linear_ref` (GPU only).

Fresh random weights in the official formats (FP8 128x128 blocks, bf16), activations with per-block magnitudes
that differ. GEMV: 1-8 tokens, bf16 and fp32 x and outputs; Flash production shapes, odd N and K tails, every split /
row-group / step configuration the dispatcher may pick. GEMM: 9 to 300 tokens (several M tiles), partial N tiles,
every split-K count, its act_quant bit for bit against act_quant_ref. The grouped wo_a GEMV on its FP8 weight with bf16
x against `wo_a_ref` and an fp64 product. All: bitwise determinism, CUDA-graph replay == eager with programmatic
dependent launch, and the fast `linear` / `wo_a` ops routing each shape to its kernel.
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import formats
from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.act_quant import act_quant_ref
from dsv4.ops.linear import PreparedLinear, linear_ref, prepare_linear
from dsv4.testing import assert_bitwise_equal, assert_close_rel, fp8_blocks_apart, graph_replay

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("built_sm90")]


def _lc():
    from dsv4.ops import linear_cuda
    return linear_cuda


def _weight(fmt: str, n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda") * k ** -0.5
    if fmt == "fp8":
        return prepare_linear(formats.Fp8BlockWeight.quantize(fp8_blocks_apart(w, g)))
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


FLASH = [("fp8", 1536, 4096), ("fp8", 32768, 1024), ("fp8", 40960, 1024), ("fp8", 4096, 8192), ("fp8", 8192, 1024),
         ("fp8", 2048, 4096), ("fp8", 4096, 2048), ("dense", 1024, 4096), ("dense", 2624, 4096), ("dense", 64, 4096)]


@pytest.mark.parametrize("fmt,n,k", FLASH)
@pytest.mark.parametrize("m", [1, 4])
def test_flash_shapes(fmt, n, k, m):
    w = _weight(fmt, n, k, seed=n + k)
    x = _x(m, k, torch.bfloat16, seed=m)
    _check(x, w, torch.bfloat16)
    if fmt == "dense":  # the compressor projections read fp32 out of the bf16 input; fp32 x is split exactly
        _check(x, w, torch.float32)
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
    w = _weight("fp8", 32768, 1024, seed=1)  # wq_b: this GEMV for one token, Triton's swap-AB MMA for 2-8
    assert lc.applies(_x(1, 1024, torch.bfloat16, 1), w, True, torch.bfloat16)
    assert not lc.applies(_x(4, 1024, torch.bfloat16, 1), w, True, torch.bfloat16)
    with pytest.raises(ValueError, match="the Triton kernel runs"):
        _run(_x(4, 1024, torch.bfloat16, 1), w, torch.bfloat16)
    hca = _weight("dense", 1024, 4096, seed=2)  # an HCA layer's compressor projections: Triton at 1 and 4 tokens
    assert not any(lc.applies(_x(m, 4096, torch.bfloat16, 1), hca, False, torch.float32) for m in (1, 4))


def test_fast_linear_routes_decode_here(monkeypatch):
    from dsv4 import ops
    from dsv4.ops import linear_cuda

    calls = []
    for name in ("gemv", "gemm"):
        real = getattr(linear_cuda, name)
        monkeypatch.setattr(linear_cuda, name,
                            lambda *a, real=real, name=name, **k: (calls.append((name, a[0].shape[0])), real(*a, **k)))
    fast = ops.OPS["linear"].fast
    w = _weight("fp8", 1536, 4096, seed=9)  # wq_a || wkv: the CUDA GEMM from 9 tokens (its GEMM_TUNED min_m)
    wq_b = _weight("fp8", 32768, 1024, seed=10)  # Triton up to 31 tokens, the CUDA GEMM from 32
    assert linear_cuda.GEMM_TUNED[(1536, 4096)].min_m == 9 and linear_cuda.GEMM_TUNED[(32768, 1024)].min_m == 32
    for ww, ms in ((w, (1, 8, 9, 128)), (wq_b, (16, 31, 32, 128))):
        for m in ms:
            x = _x(m, ww.k, torch.bfloat16, seed=m)
            assert_close_rel(fast(x.view(m, 1, ww.k), ww, True, torch.bfloat16).view(m, -1),
                             linear_ref(x, ww, True, torch.bfloat16), "op_fp8_mma_bf16_out")
    # fp32 out: the MMA's block accumulation is outside op_fp32_out, so Triton's exact path runs it
    x = _x(128, 1024, torch.bfloat16, seed=3)
    assert_close_rel(fast(x, wq_b, True, torch.float32), linear_ref(x, wq_b, True, torch.float32), "op_fp32_out")
    assert calls == [("gemv", 1), ("gemv", 8), ("gemm", 9), ("gemm", 128), ("gemm", 32), ("gemm", 128)]
    wo_b = _weight("fp8", 4096, 8192, seed=11)  # wo_b: as tuned from GEMM_MIN_M rows, Triton below
    assert linear_cuda.gemm_choice(_x(128, 8192, torch.bfloat16, 4), wo_b, True, torch.bfloat16) == \
        linear_cuda.GEMM_TUNED[(4096, 8192)]
    assert linear_cuda.gemm_choice(_x(linear_cuda.GEMM_MIN_M - 1, 8192, torch.bfloat16, 4), wo_b, True,
                                   torch.bfloat16) is None
    # a shape outside the table: GEMM_MIN_M rows at least, and tiles that fill half the SMs
    other = _weight("fp8", 16384, 1024, seed=12)
    assert linear_cuda.gemm_choice(_x(linear_cuda.GEMM_MIN_M - 1, 1024, torch.bfloat16, 5), other, True,
                                   torch.bfloat16) is None
    assert linear_cuda.gemm_choice(_x(128, 1024, torch.bfloat16, 5), other, True, torch.bfloat16) == \
        linear_cuda.GemmPlan(1)


# ---- the grouped wo_a on its FP8 weight (bf16 x, no activation quantization) ----

def _wo_a_case(groups: int, r: int, k: int, m: int, seed: int):
    """o [m, G, K] bf16 with per-64 magnitudes that differ, the FP8 weight [G R, K] (E8M0 scales) and its exact bf16
    twin [G, R, K], as the model holds them."""
    w8 = _weight("fp8", groups * r, k, seed)
    wg = w8.dequantize().to(torch.bfloat16).unflatten(0, (groups, r))
    return _x(m, groups * k, torch.bfloat16, seed + 1).view(m, groups, k), wg, w8


def _wo_a(o, w8, cfg=None):
    m, groups = o.shape[0], o.shape[1]
    out = torch.empty(m, w8.n, dtype=torch.bfloat16, device="cuda")
    _lc().wo_a(o.reshape(m, -1), w8, groups, out, cfg)
    return out.view(m, groups, -1)


@pytest.mark.parametrize("groups,r,k,m", [(8, 1024, 4096, 1), (8, 1024, 4096, 2), (8, 1024, 4096, 4),
                                          (8, 1024, 4096, 8), (2, 128, 256, 1), (3, 256, 1152, 5)])
def test_wo_a_grouped_gemv(groups, r, k, m):
    from dsv4.ops.linear import wo_a_ref

    o, wg, w8 = _wo_a_case(groups, r, k, m, seed=groups + r + k + m)
    assert _lc().wo_a_applies(o.reshape(m, -1), w8, groups)
    z = _wo_a(o, w8)
    # products exact (e4m3 -> f16 exactly, x staged as f16 exactly), fp32 accumulation per 128-K block: only the
    # summation order differs from the bf16 einsum on the dequantized weight
    assert_close_rel(z, wo_a_ref(o, wg, w8), "op_bf16_out")
    exact = torch.einsum("mgk,grk->mgr", o.double(), wg.double())
    assert_close_rel(z, exact, "op_bf16_out")
    assert_bitwise_equal(_wo_a(o, w8), z, "rerun")


def test_wo_a_x_staging_wide_ranges():
    # x is staged as f16 scaled by a power of two per 128-column block (products exact down to 2^-28 of the block's
    # max). Each (token, group) is checked against its own fp64 product: elements spanning 2^-20..2^20 inside
    # blocks; a group of zeros (exact zeros out); a group of ~1e-32 (max below 2^-100: the clamped scale); a group
    # scaled by 2^100
    o, wg, w8 = _wo_a_case(2, 128, 1024, 3, seed=4)
    g = torch.Generator(device="cuda").manual_seed(5)
    spread = torch.exp2(torch.randint(-20, 21, o.shape, generator=g, device="cuda").float())
    o = (o.float() * spread).bfloat16()
    o[0, 0] = 0
    o[1, 1] = (o[1, 1].float() * 1e-32 / o[1, 1].float().abs().max()).bfloat16()
    o[2, 0] = (o[2, 0].float() * 2.0 ** 100).bfloat16()
    z = _wo_a(o, w8)
    assert torch.isfinite(z).all()
    assert not z[0, 0].any()
    exact = torch.einsum("mgk,grk->mgr", o.double(), wg.double())
    for m in range(3):
        for grp in range(2):
            if (m, grp) != (0, 0):
                assert_close_rel(z[m, grp], exact[m, grp], "op_bf16_out")


def test_wo_a_unaligned_rows():
    # o rows not 16-byte aligned: x is staged element by element (no vector loads), with the group offset
    o, wg, w8 = _wo_a_case(2, 128, 256, 2, seed=7)
    big = torch.zeros(2, 2 * 256 + 1, dtype=torch.bfloat16, device="cuda")
    big[:, 1:] = o.reshape(2, -1)
    o2 = big[:, 1:]
    assert o2.data_ptr() % 16 != 0
    out = torch.empty(2, w8.n, dtype=torch.bfloat16, device="cuda")
    _lc().wo_a(o2, w8, 2, out)
    assert_close_rel(out.view(2, 2, -1), torch.einsum("mgk,grk->mgr", o.double(), wg.double()), "op_bf16_out")


def test_wo_a_every_config():
    o, wg, w8 = _wo_a_case(2, 128, 1024, 3, seed=6)
    ref = torch.einsum("mgk,grk->mgr", o.double(), wg.double())
    cands = _lc().candidates("fp8_bf16", False, 3, w8.n, w8.k)
    assert len(cands) >= 4
    for cfg in cands:
        z = _wo_a(o, w8, cfg)
        assert_close_rel(z, ref, "op_bf16_out")
        assert_bitwise_equal(_wo_a(o, w8, cfg), z, f"rerun {cfg}")


def test_fast_wo_a_routes_decode_here(monkeypatch):
    from dsv4 import ops
    from dsv4.ops import linear_cuda
    from dsv4.ops.linear import wo_a_ref

    calls = []
    real = linear_cuda.wo_a
    monkeypatch.setattr(linear_cuda, "wo_a", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    fast = ops.OPS["wo_a"].fast
    for m in (1, 8, 9):  # the GEMV up to 8 tokens, the bf16 einsum beyond
        o, wg, w8 = _wo_a_case(2, 128, 256, m, seed=m)
        o = o.view(1, m, 2, 256)
        assert_close_rel(fast(o, wg, w8), wo_a_ref(o, wg), "op_bf16_out")
        fast(o, wg, None)  # no FP8 twin: the reference's einsum (no GEMV call)
    assert calls == [1, 8]
    o, wg, w8 = _wo_a_case(2, 64, 256, 1, seed=3)  # 64-row groups: not the GEMV's (falls back)
    assert not linear_cuda.wo_a_applies(o.reshape(1, -1), w8, 2)
    assert_bitwise_equal(fast(o, wg, w8), wo_a_ref(o, wg), "fallback")


def test_wo_a_graph_replay_equals_eager():
    o, wg, w8 = _wo_a_case(8, 1024, 4096, 1, seed=8)
    w = _weight("fp8", 4096, 8192, 9)  # wo_b reads wo_a's output (PDL: its weights load while wo_a runs)

    def step():
        z = _wo_a(o, w8)
        return _run(z.reshape(1, -1), w, torch.bfloat16)

    want, got = graph_replay(step)
    assert_bitwise_equal(got, want, "graph replay")


# ---- the prefill GEMM (gemm.cu) ----

def _gemm(x, w, splits=None, bn=128):
    out = torch.empty(x.shape[0], w.n, dtype=torch.bfloat16, device="cuda")
    _lc().gemm(x, w, out, splits, None, bn)
    return out


def _check_gemm(x, w, splits=None, bn=128):
    assert _lc().gemm_applies(x, w, True, torch.bfloat16)  # it can run here (gemm_choice may still prefer Triton)
    y = _gemm(x, w, splits, bn)
    # e4m3 products are exact; the tensor cores accumulate each 128-K block at reduced precision (DeepGEMM's
    # pattern, promoted to fp32 per block): the FP8-MMA tolerance
    assert_close_rel(y, linear_ref(x, w, True, torch.bfloat16), "op_fp8_mma_bf16_out")
    return y


@pytest.mark.parametrize("n,k", [(n, k) for fmt, n, k in FLASH if fmt == "fp8"])
@pytest.mark.parametrize("m", [9, 128])
def test_gemm_flash_shapes(n, k, m):
    w = _weight("fp8", n, k, seed=n + k + m)
    x = _x(m, k, torch.bfloat16, seed=m)
    plan = _lc().GEMM_TUNED.get((n, k))
    _check_gemm(x, w)
    if plan is not None and m == 128:  # the tuned plan, as the fast linear runs it
        _check_gemm(x, w, plan.splits, plan.bn)


@pytest.mark.parametrize("bn", [128, 64])
@pytest.mark.parametrize("m,n,k", [(9, 8, 128), (17, 200, 384), (64, 136, 1280), (130, 264, 1024),
                                   (300, 128, 256), (128, 4096, 1024), (33, 72, 512)])
def test_gemm_odd_shapes_every_split(m, n, k, bn):
    # tiles of 128 rows x bn columns: a narrow last column tile (N % bn), rows past M, every split, one 64-wide
    # tile sharing its 128-row weight-scale block with its neighbour
    w = _weight("fp8", n, k, seed=7 * m + n + k)
    x = _x(m, k, torch.bfloat16, seed=m + k)
    for splits in sorted({1, 2, 4, 8, _lc().gemm_splits(m, n, k, 132)}):
        if splits > k // 128:
            continue
        y = _check_gemm(x, w, splits, bn)
        assert_bitwise_equal(_gemm(x, w, splits, bn), y, f"rerun splits={splits}")
        if bn == 64:  # same products and sums, tiled twice as finely: the same bits
            assert_bitwise_equal(y, _gemm(x, w, splits, 128), f"bn 64 vs 128, splits={splits}")


@pytest.mark.parametrize("bn", [128, 64])
def test_gemm_split_k_cluster_and_workspace_paths_agree_bitwise(bn):
    # split-K runs through a thread-block cluster when every tile's cluster of S CTAs fits the GPU at once, else
    # through the global workspace; both sum the same partials in split order. Tiles are independent, so the first
    # `fit` column tiles of a GEMM one tile too wide for clusters must equal the GEMM of exactly `fit` tiles bit for bit
    mod = cuda_kernels.load()
    for s in (2, 4, 8):
        fit = mod.gemm_cluster_fit(s, bn)
        if fit == 0:
            pytest.skip(f"no cluster of {s} GEMM CTAs fits this GPU")
        w = _weight("fp8", (fit + 1) * bn, 1024, seed=50 + s)
        x = _x(100, 1024, torch.bfloat16, seed=60 + s)
        wide = _check_gemm(x, w, s, bn)  # fit + 1 tiles: the workspace
        rows = fit * bn
        narrow = PreparedLinear("fp8", rows, 1024, w.weight[:rows].contiguous(), w.scale[: -(-rows // 128)].contiguous())
        assert_bitwise_equal(_gemm(x, narrow, s, bn), wide[:, :rows], f"cluster vs workspace, splits={s}")


def test_gemm_split_k_workspace_only_where_the_clusters_do_not_fit():
    # the cluster path takes no workspace (the binding runs it without one); the workspace path refuses to run
    # without it, with a one-line reason; gemm_cluster_fit takes the splits gemm_fp8 takes
    mod = cuda_kernels.load()
    with pytest.raises(RuntimeError, match="splits must be 1, 2, 4 or 8"):
        mod.gemm_cluster_fit(3, 128)
    with pytest.raises(RuntimeError, match="bn .output tile columns. must be 128 or 64"):
        mod.gemm_cluster_fit(2, 96)
    assert mod.gemm_cluster_fit(1, 128) == 0
    s, fit = 2, mod.gemm_cluster_fit(2, 128)
    if fit == 0:
        pytest.skip("no cluster of 2 GEMM CTAs fits this GPU")
    x = _x(64, 1024, torch.bfloat16, seed=81)
    xq = torch.empty(64, 1024, dtype=torch.float8_e4m3fn, device="cuda")
    xs = torch.empty(64, 8, dtype=torch.float32, device="cuda")
    mod.act_quant(x, xq, xs, False)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    wide = _weight("fp8", (fit + 1) * 128, 1024, seed=83)  # one tile too many for clusters: the workspace
    ref = _gemm(x, wide, s)
    narrow = PreparedLinear("fp8", fit * 128, 1024, wide.weight[: fit * 128].contiguous(), wide.scale[:fit].contiguous())
    out = torch.empty(64, fit * 128, dtype=torch.bfloat16, device="cuda")
    mod.gemm_fp8(xq, xs, narrow.weight, narrow.scale, out, s, 128, sms, None, None, False)
    assert_bitwise_equal(out, ref[:, : fit * 128], "cluster path without a workspace vs the workspace path")
    with pytest.raises(RuntimeError, match="needs a contiguous fp32 workspace"):
        mod.gemm_fp8(xq, xs, wide.weight, wide.scale, ref, s, 128, sms, None, None, False)
    with pytest.raises(RuntimeError, match="bn .output tile columns. must be 128 or 64"):
        mod.gemm_fp8(xq, xs, narrow.weight, narrow.scale, out, s, 32, sms, None, None, False)


def test_gemm_on_the_side_stream_never_takes_the_workspace_path():
    # beside a workspace launch on the main stream, the spin-waiting workspace units could deadlock: on the side
    # stream gemm() runs clusters or one split. wo_b at 128 rows (32 tiles of 4: no cluster fit on an H200) gives the
    # bits of the largest split whose clusters fit
    from dsv4 import ops

    mod = cuda_kernels.load()
    dev = torch.cuda.current_device()
    w = _weight("fp8", 4096, 8192, seed=90)
    x = _x(128, 8192, torch.bfloat16, seed=91)
    s = 4
    while s > 1 and 32 > mod.gemm_cluster_fit(s, 128):
        s //= 2
    want = _gemm(x, w, s)
    torch.cuda.synchronize()  # x and w made on the main stream
    with torch.cuda.stream(ops.side_stream(torch.device("cuda", dev))):
        got = _gemm(x, w, 4)
    torch.cuda.synchronize()
    assert_bitwise_equal(got, want, f"side stream: splits 4 -> {s}")


def test_gemm_choice_fewer_splits_when_more_rows_overflow_the_gpu():
    # GEMM_TUNED's plans were measured at 128 rows; with more rows wq_a || wkv has more tiles: 128-wide ones once the
    # 64-wide ones alone outnumber the SMs, and fewer splits while neither the tiles' clusters (30 of 4 on an H200)
    # nor their units (one CTA per SM) fit at once
    lc = _lc()
    w = _weight("fp8", 1536, 4096, seed=70)
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tuned = lc.GEMM_TUNED[(1536, 4096)]
    for m in (128, 256, 1024):
        plan = lc.gemm_choice(_x(m, 4096, torch.bfloat16, seed=m), w, True, torch.bfloat16)
        s = plan.splits
        assert plan.bn == (tuned.bn if lc.gemm_tiles(m, 1536, tuned.bn) <= sms else 128), (m, plan)
        tiles = lc.gemm_tiles(m, 1536, plan.bn)
        assert s in (1, 2, 4, 8) and s <= tuned.splits

        def fits(n):  # the tiles' clusters of n fit at once, or their units fit one CTA per SM
            return tiles <= lc.cluster_fit(dev, n, plan.bn) or tiles * n <= sms
        assert s == 1 or fits(s), (m, s)
        assert s == tuned.splits or not fits(2 * s), (m, s)  # the most splits that fit: halved no further than needed
        if m == 128:
            assert plan == tuned
    assert s < tuned.splits and plan.bn == 128  # 1024 rows (96 tiles of 128) keep neither the bn nor the splits


@pytest.mark.parametrize("m,n,k", [(128, 32768, 1024), (128, 40960, 1024), (128, 4096, 8192), (37, 264, 1536)])
def test_gemm_from_a_quantized_activation(m, n, k):
    # the GEMM reading rmsnorm_quant's codes and scales (no act_quant launch) equals the GEMM that quantizes x itself,
    # bit for bit, through the fast linear op; the GEMV path (decode) ignores the codes and reads x
    from dsv4 import ops
    from dsv4.ops.act_quant import quant_act_ref

    fast = ops.OPS["linear"].fast
    w = _weight("fp8", n, k, seed=m + n)
    x = _x(m, k, torch.bfloat16, seed=k)
    qa = quant_act_ref(x)
    assert _lc().gemm_choice(x, w, True, torch.bfloat16) or m < 128
    assert_bitwise_equal(fast(qa, w, True, torch.bfloat16), fast(x, w, True, torch.bfloat16), "QuantAct vs x")
    other = quant_act_ref(_x(m, k, torch.bfloat16, seed=k + 1))
    for s in (1, 2):  # the codes given are read (another x's here), not x
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        _lc().gemm(x, w, out, s, (other.q, other.s))
        assert_bitwise_equal(out, _gemm(other.x, w, s), f"pre-quantized, splits={s}")
    one = quant_act_ref(x[:1])
    assert_bitwise_equal(fast(one, w, True, torch.bfloat16), fast(x[:1], w, True, torch.bfloat16), "GEMV")


@pytest.mark.parametrize("n", [32768, 40960, 264])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gemv_with_the_norm_in_its_prologue(n, m):
    # norm_linear at decode: the query's RMSNorm inside the GEMV's x prologue (one launch) against
    # linear_ref(rmsnorm_ref(x)); and against the GEMV on the separately normed x, which differs only where the
    # statistic's fp32 summation order moves a normed value across a bf16 rounding (rare)
    from dsv4 import ops
    from dsv4.ops.linear import norm_linear_ref

    k = 1024
    w = _weight("fp8", n, k, seed=n + m)
    x = _x(m, k, torch.bfloat16, seed=m + 5) * 3
    nw = (1 + 0.1 * torch.randn(k, generator=torch.Generator(device="cuda").manual_seed(m), device="cuda")).bfloat16()
    lc = _lc()
    routed = lc.applies(x, w, True, torch.bfloat16)  # else the Triton kernels run the op: check the CUDA one here
    cfgs = [None] if routed else []
    cfgs += [c for c in lc.candidates("fp8", False, m, n, k) if c[0] > 1][:1]  # a split-K config: the norm's own pass
    cfgs += [c for c in lc.candidates("fp8", False, m, n, k) if c[0] == 1][:1]
    _check_gemv_norm(lc, ops.OPS["norm_linear"].fast, cfgs, x, w, nw, m, n, k)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="norm_w must be"):
        lc.gemv(x, w, out, None if routed else cfgs[0], norm=(nw[:-8], 1e-6))
    xs = _x(m, k + 4, torch.bfloat16, seed=m + 6)[:, 4:]  # rows not 16-byte aligned: the scalar loads
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    lc.gemv(xs, w, out, cfgs[-1], norm=(nw, 1e-6))
    assert_close_rel(out, norm_linear_ref(xs, nw, 1e-6, w, True, torch.bfloat16), "op_bf16_out")


def _check_gemv_norm(lc, fast, cfgs, x, w, nw, m, n, k):
    from dsv4.ops.linear import norm_linear_ref
    from dsv4.ops.norm import rmsnorm_ref

    for cfg in cfgs:
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        lc.gemv(x, w, out, cfg, norm=(nw, 1e-6))
        assert_close_rel(out, norm_linear_ref(x, nw, 1e-6, w, True, torch.bfloat16), "op_bf16_out")
        plain = torch.empty_like(out)
        lc.gemv(rmsnorm_ref(x, nw, 1e-6), w, plain, cfg)
        assert (out == plain).float().mean().item() >= 0.999, cfg
        if cfg is None:
            assert_bitwise_equal(fast(x.view(1, m, k), nw, 1e-6, w, True, torch.bfloat16).view(m, n), out, "route")


def test_gemm_fp32_and_strided_x():
    w = _weight("fp8", 1024, 4096, seed=21)
    big = _x(40, 4096 + 128, torch.float32, seed=22)
    _check_gemm(big[:, 128:], w)  # fp32 rows with stride 4224, quantized by act_quant_kernel
    xb = _x(40, 4096 + 4, torch.bfloat16, seed=23)[:, 4:]  # rows not 16-byte aligned: scalar loads
    _check_gemm(xb, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_kernel_bitwise(dtype):
    mod = cuda_kernels.load()
    x = _x(37, 1024, dtype, seed=31)
    x[3, :128] = 0.0  # amax floor
    x[5, 130] = 1e6  # saturating scale
    for xx in (x, x[:, 128:]):
        q = torch.empty(xx.shape, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(xx.shape[0], xx.shape[1] // 128, dtype=torch.float32, device="cuda")
        mod.act_quant(xx, q, s, True)
        rq, rs = act_quant_ref(xx)
        assert_bitwise_equal(q.view(torch.uint8), rq.view(torch.uint8), "act_quant q")
        assert_bitwise_equal(s, rs, "act_quant s")


def test_gemm_graph_replay_and_pdl_chain():
    # the second GEMM reads the first one's output through its act_quant: griddepcontrol.wait must order them
    w1, w2 = _weight("fp8", 4096, 1024, 41), _weight("fp8", 1024, 4096, 42)
    x = _x(128, 1024, torch.bfloat16, 43)

    def chain():
        return _gemm(_gemm(x, w1), w2)

    h = _gemm(x, w1)  # the second GEMM is checked on the first one's own output (the tolerance is one GEMM's)
    assert_close_rel(h, linear_ref(x, w1, True, torch.bfloat16), "op_fp8_mma_bf16_out")
    assert_close_rel(chain(), linear_ref(h, w2, True, torch.bfloat16), "op_fp8_mma_bf16_out")
    want, got = graph_replay(chain)
    assert_bitwise_equal(got, want, "graph replay")


def test_binding_messages_with_values_raise():
    # a refusal whose message carries values raises a one-line RuntimeError (it once crashed the process: the
    # extension's stream formatting of multi-part messages, see DSV4_CHECK in binding.cpp)
    mod = cuda_kernels.load()
    x = torch.randn(1, 100, device="cuda").to(torch.bfloat16)
    w = torch.randn(64, 100, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="gemv: K must be a multiple of 8"):
        mod.gemv(x, w, None, out, 1, 1, 2, 1, True, 1, False, None, 0.0)
    with pytest.raises(RuntimeError, match="gemv: x columns must split into 3 groups"):
        mod.gemv(x, w, None, out, 1, 1, 2, 1, True, 3, False, None, 0.0)
