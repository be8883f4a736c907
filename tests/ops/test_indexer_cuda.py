"""dsv4.ops.indexer_cuda (topk_select in one launch, dsv4/kernels/cuda/topk.cu) against topk_select_ref, bit for bit.

GPU only. The list must be the reference's exactly: the same entries in the same order (descending score, ties to the
lower entry), -1 past the entries above -inf. Inputs full of ties (exact zeros, -0.0, repeated values) at the Flash
shapes (k = 512 of 256, 4K, 32K and 256K entries: 1K, 16K, 128K and 1M context; 1, 4 and 128 query rows; V4-Pro's k =
1024), each through every kernel that takes it (the clusters; one CTA a row for 16-bit rows of up to 32K entries);
every cluster size and the lengths at its edges; the 16-bit histogram's widest slices (8192 keys a CTA); the one-CTA
kernel's runs of equal keys above, at and below the k-th key and its full 16-bit bins; the clusters' ranks from the
counts (kept keys in 1-3 coarse bins; 4 through the list), with runs of one key above the k-th key in a CTA; keys that differ only in the
bits of the last radix pass (16- and 32-bit); ties at the k-th key spread over several CTAs of a cluster (some CTAs
keep all of theirs, one only its lowest entries, the others none); all-equal rows; rows with fewer visible entries
than k, none, or visible -inf scores; odd lengths and rows that are not 16-byte aligned (the one-element load path);
f16 and int32 counts. Also: CUDA-graph replay == eager and follows new counts, the registered fast op routing here,
the limits that route to Triton, and the binding's refusals.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.indexer import topk_select_ref
from dsv4.testing import assert_bitwise_equal, capture_graph, graph_replay
from test_indexer import tied_scores

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("built_sm90")]


def _mod():
    from dsv4.ops import indexer_cuda
    return indexer_cuda


def scores(S, N, seed, dtype=torch.bfloat16):
    """tied_scores for any N (it needs rows of 13 entries or more)."""
    return tied_scores(1, S, (N + 25) // 13 * 13, seed=seed, dtype=dtype, device="cuda")[..., :N]


def check(x, n_vis, k):
    """Every CUDA kernel that takes the call (the clusters; one CTA a row for 16-bit rows of up to 32K entries) against
    the reference; returns the default kernel's list."""
    ic = _mod()
    assert ic.topk_applies(x, n_vis, k)
    want = topk_select_ref(x, n_vis, k)
    kernels = ("cluster", "cta") if ic.topk_cta_applies(x) else ("cluster",)
    for kern in kernels:
        assert_bitwise_equal(ic.topk_select(x, n_vis, k, kernel=kern), want,
                             f"topk ({kern}) k={k} N={x.shape[-1]} {x.dtype}")
    got = ic.topk_select(x, n_vis, k)
    assert_bitwise_equal(got, want, f"topk k={k} N={x.shape[-1]} {x.dtype}")
    return got


def counts(S, N, *short, dtype=torch.int64):
    n = torch.full((S,), N, dtype=dtype)
    for i, v in enumerate(short):
        n[-1 - i] = v
    return n.cuda()


@pytest.mark.parametrize("S", [1, 4, 128])
@pytest.mark.parametrize("N", [256, 4096, 32768, 262144])
def test_flash_shapes(N, S):
    if S == 128 and N == 262144:
        pytest.skip("the reference's sort of 128 x 256K rows: covered by S = 4")
    x = tied_scores(1, S, N, seed=N + S, dtype=torch.bfloat16, device="cuda")
    n_vis = counts(S, N, 300) if S > 1 else counts(S, N - 5)  # a query with fewer visible entries than k
    k = min(512, N)
    check(x, n_vis, k)
    check(x.float(), n_vis, k)


@pytest.mark.parametrize("N", [1, 2, 9, 2047, 2048, 2049, 4096, 4097, 8192, 8193, 16384, 16385, 32768, 32769, 65535,
                               65536 * 4])
def test_every_cluster_size_and_its_edges(N):
    mod = cuda_kernels.load()
    portable = 1 if N <= 2048 else 2 if N <= 4096 else 4 if N <= 8192 else 8
    wide = mod.topk_select_cluster(N, 2)
    assert wide in ((portable,) if N <= 16384 else (8, 16))
    if N > 16384 and torch.cuda.get_device_properties(0).multi_processor_count >= 132:  # an H100 / H200 SXM
        # clusters of 16 for a decode step's rows; past 128K entries (no 16-bit histogram, half the shared memory) for 8
        assert wide == 16 and mod.topk_select_cluster(N, 4 if N <= 131072 else 8) == 16
    assert mod.topk_select_cluster(N, 65535) == portable  # more rows than the device holds clusters of 16 at once
    # the default: one CTA a row for 9 or more 16-bit rows of 4K-32K entries (prefill), the clusters otherwise
    assert mod.topk_select_path(N, 0, 9, 0) == (0 if 4096 <= N <= 32768 else 1)
    assert mod.topk_select_path(N, 0, 8, 0) == 1
    assert mod.topk_select_path(N, 2, 128, 0) == 1 and mod.topk_select_path(N, 1, 1, 2) == (0 if N <= 32768 else -1)
    check(scores(2, N, N), counts(2, N, max(N - 3, 0)), min(N, 512))


def test_16_bit_histogram_at_its_widest_slices():
    # 17 rows of 64K entries: more rows than any device holds clusters of 16 at once in the 16-bit histogram's band, so
    # clusters of 8 with slices of 8192 keys (its widest: ~204 KB of shared memory a CTA); then one value a row (8192
    # equal keys a CTA, in the low half of a histogram word for 1.5, the high half for 1.0078125) with k = 1024
    mod = cuda_kernels.load()
    assert mod.topk_select_cluster(65536, 17) == 8
    check(scores(17, 65536, 17), counts(17, 65536, 65533, 40000, 8191, 1), 512)
    y = torch.full((1, 17, 65536), 1.5, dtype=torch.bfloat16, device="cuda")
    y[:, 1::2] = 1.0078125
    got = check(y, counts(17, 65536), 1024)
    assert got[0, :].eq(torch.arange(1024, dtype=torch.int32, device="cuda")).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pro_k_1024_and_k_equal_n(dtype):
    x = tied_scores(2, 3, 20001, seed=3, dtype=dtype, device="cuda")
    check(x, counts(3, 20001, 1500, 1024, 17), 1024)
    y = tied_scores(1, 2, 700, seed=4, dtype=dtype, device="cuda")
    check(y, counts(2, 700, 699), 700)  # k = N: the whole row in order
    check(y, counts(2, 700), 1)


def test_last_pass_decides():
    # 16-bit keys that share their high byte (the second pass decides), fp32 keys that differ only in the lowest
    # byte (the fourth), each with ties at the k-th key that go to the lowest entries
    g = torch.Generator().manual_seed(7)
    base = torch.tensor(1.0, dtype=torch.bfloat16).view(torch.int16).item()
    bits = base + torch.randint(0, 128, (1, 1, 5000), generator=g, dtype=torch.int16)
    check(bits.view(torch.bfloat16).cuda(), counts(1, 5000), 512)
    fbits = torch.tensor(3.0).view(torch.int32).item() + torch.randint(0, 256, (1, 2, 9000), generator=g,
                                                                       dtype=torch.int32)
    check(fbits.view(torch.float32).cuda(), counts(2, 9000, 8191), 512)


def test_ties_at_the_kth_key_across_the_cluster():
    # 32768 entries (8 CTAs of 4096): 400 positive scores, the rest exact zeros: the k-th key is 0, tied in every
    # CTA; the first CTAs keep all of their zeros, one only its lowest, the last ones none
    g = torch.Generator().manual_seed(14)
    x = torch.zeros(1, 3, 32768)
    for r in range(3):
        x[0, r, torch.randperm(32768, generator=g)[:400]] = torch.rand(400, generator=g) + 0.5
    x[0, 1, :20000] = 0.0  # the positive ones only in the later CTAs: the early CTAs' zeros are the kept ties
    for dtype in (torch.bfloat16, torch.float32):
        got = check(x.to(dtype).cuda(), counts(3, 32768, 20000), 512)
    assert (got[0, 0, 400:] >= 0).all()
    # one tie value spread over a CTA boundary: entries 4000..4199 (CTAs 0 and 1) share the k-th key
    y = torch.full((1, 1, 32768), -1.0)
    y[0, 0, :400] = 2.0
    y[0, 0, 4000:4200] = 1.0
    got = check(y.to(torch.bfloat16).cuda(), counts(1, 32768), 512)
    assert got[0, 0, 400:].tolist() == list(range(4000, 4112))


def test_one_cta_runs_of_equal_keys_and_full_bins():
    # the one-CTA kernel orders a bin's keys by walking its run of the list: long runs above the k-th key, a run
    # that is the k-th key kept whole (keep all) or cut (lowest entries), at both ends of the list
    g = torch.Generator().manual_seed(21)
    x = torch.full((1, 4, 20000), 1.0)
    perm = [torch.randperm(20000, generator=g) for _ in range(4)]
    x[0, 0, perm[0][:300]] = 3.0
    x[0, 0, perm[0][300:600]] = 2.0  # 300 + 212 of 300: the 2.0 run cut to its lowest entries
    x[0, 1, perm[1][:300]] = 3.0
    x[0, 1, perm[1][300:512]] = 2.0  # 300 + 212 of 212: kept whole, then 1.0 below
    x[0, 2, perm[2][:511]] = 5.0  # one run of 511 above a cut run of 1.0
    x[0, 3, perm[3][:40]] = torch.arange(40, dtype=torch.float32)  # 38 distinct keys above 19961 tied at 1.0, 0.0 below
    for dtype in (torch.bfloat16, torch.float16):
        got = check(x.to(dtype).cuda(), counts(4, 20000), 512)
    assert got[0, 0, :300].tolist() == sorted(perm[0][:300].tolist())
    assert got[0, 1, 300:].tolist() == sorted(perm[1][300:512].tolist())
    # full rows: 32768 equal keys (one bin's count 32768, in the low half of its word for 1.5, the high half for
    # 1.0078125), all zeros, all -0.0 and +0.0 mixed
    ic = _mod()
    for v in (1.5, 1.0078125, 0.0):
        y = torch.full((1, 1, 32768), v, dtype=torch.bfloat16, device="cuda")
        y[..., 1::2] = -v if v == 0.0 else v
        got = check(y, counts(1, 32768), 1024)
        assert got[0, 0].tolist() == list(range(1024))
    assert ic.topk_cta_applies(y) and not ic.topk_cta_applies(torch.empty(1, 1, 32769, dtype=torch.bfloat16))
    assert not ic.topk_cta_applies(y.float())


def _spread_row(N, k, span, seed, run_cta=None):
    """One row of N scores whose k kept keys lie in exactly `span` coarse bins (the high bytes of the 16-bit keys: a
    coarse bin is two exponents, [2, 8) is one): k - 40 distinct-ish scores log-uniform in [2, 2 * 4**span) with the
    lowest and highest bins hit, then 120 scores tied at 2.0 (the k-th key, 40 of them kept: the cut spread over the
    CTAs), the rest negative. run_cta: 100 copies of 5.0 in that CTA's slice (slices of 8192 entries), among its other
    kept keys: a run of equal keys above the k-th key longer than a warp's chunk of 32."""
    g = torch.Generator().manual_seed(seed)
    x = -torch.rand(N, generator=g) - 0.001
    perm = torch.randperm(N, generator=g)
    top = (2.0 * torch.pow(4.0, span * torch.rand(k - 40, generator=g))).clamp(max=2.0 * 4.0 ** span * 0.99)
    top[0], top[1] = 2.5, 2.0 * 4.0 ** span * 0.99  # bf16 keeps both inside the span
    x[perm[:k - 40]] = top
    x[perm[k - 40:k + 80]] = 2.0
    if run_cta is not None:
        x[run_cta * 8192 + torch.randperm(8192, generator=g)[:100]] = 5.0
    return x


def _span(x, k):
    """The coarse bins (high bytes of the bf16 bits) from the k-th largest score's to the largest's."""
    hi = torch.sort(x.to(torch.bfloat16).float(), descending=True).values[[k - 1, 0]].to(torch.bfloat16)
    b = (hi.view(torch.int16).int() >> 8).tolist()
    return b[1] - b[0] + 1


@pytest.mark.parametrize("k", [512, 1024])
def test_ranks_from_the_counts(k):
    # the 16-bit histogram's path places the kept keys from the counts (no list) when they lie in at most 3 coarse
    # bins (topk.cu, step 2'), else through the list: rows whose kept keys span 1, 2, 3 and 4 coarse bins, in clusters
    # of 16 (128K entries: slices of 8192; 64K: 4096; an odd length), with ties at the k-th key cut across the CTAs,
    # runs of one key above it inside a CTA (within a warp's chunk of 32 and across chunks) and short rows
    for N in (131072, 65536, 100003):
        rows = [_spread_row(N, k, span, seed=N + 10 * span + k) for span in (1, 2, 3, 4)]
        rows.append(_spread_row(N, k, 2, seed=N + k + 1, run_cta=3))
        rows.append(_spread_row(N, k, 1, seed=N + k + 2, run_cta=0))
        assert [_span(r, k) for r in rows] == [1, 2, 3, 4, 2, 1]
        x = torch.stack(rows)[None].to(torch.bfloat16).cuda()
        for S in (1, 4):
            got = check(x[:, :S].contiguous(), counts(S, N, N - 7), k)
            assert (got >= 0).all()
        check(x, counts(6, N, N - 7, 90000, 40000), k)
    # the run of 5.0 in row 4 (CTA 3 of a 128K row) is kept whole and in entry order
    x = _spread_row(131072, k, 2, seed=131072 + k + 1, run_cta=3)
    got = check(x[None, None].to(torch.bfloat16).cuda(), counts(1, 131072), k)[0, 0].tolist()
    fives = [e for e in got if x[e] == 5.0]
    assert len(fives) >= 100 and fives == sorted(fives)


def test_all_equal_zero_and_infinite_rows():
    z = torch.zeros(1, 3, 3000, device="cuda")
    z[0, 1, ::2] = -0.0  # -0.0 == +0.0: still the first k entries in order
    got = check(z, counts(3, 3000, 200), 512)
    assert got[0, 0].tolist() == list(range(512)) and got[0, 2, 200:].eq(-1).all()
    x = tied_scores(1, 4, 9000, seed=5, dtype=torch.bfloat16, device="cuda")
    x[0, 0] = float("-inf")  # nothing above -inf: all -1
    x[0, 1, 100:] = float("-inf")  # 100 candidates
    x[0, 2, ::3] = float("inf")
    got = check(x, counts(4, 9000, 0), 512)  # and a query that sees nothing
    assert got[0, 0].eq(-1).all() and got[0, 3].eq(-1).all() and got[0, 1, 100:].eq(-1).all()


def test_odd_lengths_unaligned_rows_f16_int32_counts():
    for N in (1, 7, 1001, 4097, 33333):
        x = scores(2, N + 1, N)[..., 1:]  # rows 2 bytes off
        check(x, counts(2, N, max(N // 2, 1)), min(N, 512))
    h = tied_scores(2, 2, 3333, seed=9, dtype=torch.float16, device="cuda")
    check(h, counts(2, 3333, 40, dtype=torch.int32), 512)
    f = tied_scores(1, 1, 40099, seed=10, dtype=torch.float32, device="cuda")[..., 3:]  # 12 bytes off
    check(f, counts(1, 40000, dtype=torch.int32), 512)
    big = torch.full((1, 1, 5000), 7.0, device="cuda")
    big[..., ::7] = 1.0  # two values, each repeated thousands of times
    check(big, counts(1, 5000, dtype=torch.int32), 512)
    s = tied_scores(2, 3, 6000, seed=11, dtype=torch.bfloat16, device="cuda").transpose(0, 1)  # strided rows
    check(s, counts(2, 6000, 77), 512)


@pytest.mark.parametrize("S", [1, 16])
def test_graph_replay_follows_new_counts(S):
    # one row: the clusters; 16 rows (a prefill chunk): one CTA a row
    ic = _mod()
    x = tied_scores(1, S, 32768, seed=11, dtype=torch.bfloat16, device="cuda")
    n_vis = counts(S, 30000)
    want, out = graph_replay(lambda: ic.topk_select(x, n_vis, 512))
    assert_bitwise_equal(out, want, "graph replay")
    graph, out = capture_graph(lambda: ic.topk_select(x, n_vis, 512))
    n_vis.fill_(1234)  # the next step's count, same buffer
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, topk_select_ref(x, n_vis, 512), "replay after a new count")


def test_fast_op_routes_here_and_limits_go_to_triton(monkeypatch):
    from dsv4 import ops
    from dsv4.ops import indexer_triton

    ic = _mod()
    mod = cuda_kernels.load()
    calls = []  # (rows, N) of every call that reaches the CUDA binding
    real = ic.topk_select
    monkeypatch.setattr(ic, "topk_select", lambda s, *a, **kw: calls.append(s.shape[1:]) or real(s, *a, **kw))
    x = tied_scores(1, 1, 32768, seed=12, dtype=torch.bfloat16, device="cuda")
    n_vis = counts(1, 32000)
    assert ic.topk_prefers(x)  # decode at 128K context: the clusters
    assert_bitwise_equal(ops.OPS["topk_select"].fast(x, n_vis, 512), real(x, n_vis, 512, kernel="cluster"), "routed")
    assert calls == [(1, 32768)] and mod.topk_select_path(32768, 0, 1, 0) == 1
    assert ic.topk_prefers(x[..., :2049]) and ic.topk_prefers(x[..., :8192])  # decode past 8K context: the clusters
    assert not ic.topk_prefers(x[..., :2048])  # decode at <= 8K context (one CTA): Triton
    ops.OPS["topk_select"].fast(x[..., :2048].contiguous(), counts(1, 2000), 512)
    assert len(calls) == 1
    ops.OPS["topk_select"].fast(x[..., :4096].contiguous(), counts(1, 4000), 512)
    assert calls[-1] == (1, 4096)
    # prefill chunks of 16-bit scores from 16K to 128K context (4K-32K entries): one CTA a row
    chunk = tied_scores(1, 9, 32768, seed=16, dtype=torch.bfloat16, device="cuda")
    nv9 = counts(9, 32768, 30000, 700)
    assert ic.topk_prefers(chunk) and ic.topk_prefers(chunk[..., :4096])
    assert_bitwise_equal(ops.OPS["topk_select"].fast(chunk, nv9, 512), real(chunk, nv9, 512, kernel="cta"),
                         "routed prefill")
    assert calls[-1] == (9, 32768) and mod.topk_select_path(32768, 0, 9, 0) == 0
    ops.OPS["topk_select"].fast(chunk[..., :4095].contiguous(), counts(9, 4095), 512)
    assert len(calls) == 3  # 4095 entries: Triton
    assert not ic.topk_prefers(chunk[..., :4095])  # shorter rows: Triton
    assert not ic.topk_prefers(chunk.float())  # fp32 chunks: Triton
    assert not ic.topk_prefers(torch.empty(1, 9, 40000, dtype=torch.bfloat16, device="cuda"))  # past the CTA's rows
    assert ic.topk_prefers(torch.empty(1, 128, 65537, device="cuda"))  # past 256K context: always CUDA
    big = tied_scores(1, 1, 262145, seed=13, dtype=torch.bfloat16, device="cuda")
    nv = counts(1, 262145)
    assert not ic.topk_applies(big, nv, 512)  # more entries than 8 CTAs' shared memory holds
    assert not ic.topk_applies(x, n_vis, 1025)  # k past the list's limit
    assert not ic.topk_applies(x, n_vis.cpu(), 512)
    assert not ic.topk_applies(x.cpu(), n_vis.cpu(), 512)
    assert not ic.topk_applies(x.double(), n_vis, 512)
    assert_bitwise_equal(ops.OPS["topk_select"].fast(big, nv, 512), indexer_triton.topk_select(big, nv, 512),
                         "Triton beyond the limit")


def test_binding_refuses_bad_calls():
    mod = cuda_kernels.load()
    x = torch.zeros(1, 2, 100, dtype=torch.bfloat16, device="cuda")
    n_vis = counts(2, 100)
    o = torch.empty(1, 2, 10, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"k must be 1\.\.min\(N, 1024\) \(got 101, N = 100\)"):
        mod.topk_select(x, n_vis, torch.empty(1, 2, 101, dtype=torch.int32, device="cuda"), False, 0)
    with pytest.raises(RuntimeError, match=r"rows of 1 to 262144 entries \(got 262145\)"):
        mod.topk_select(torch.zeros(1, 2, 262145, dtype=torch.bfloat16, device="cuda"), n_vis, o, False, 0)
    with pytest.raises(RuntimeError, match="scores must be bf16, f16 or fp32"):
        mod.topk_select(x.double(), n_vis, o, False, 0)
    with pytest.raises(RuntimeError, match=r"n_visible must be int64 or int32 \[S\]"):
        mod.topk_select(x, n_vis.float(), o, False, 0)
    with pytest.raises(RuntimeError, match=r"o must be int32 \[B, S, K\]"):
        mod.topk_select(x, n_vis, o.long(), False, 0)
    with pytest.raises(RuntimeError, match="unit stride on N"):
        mod.topk_select(x[..., ::2], n_vis, o, False, 0)
    with pytest.raises(RuntimeError, match=r"mode must be 0, 1 or 2 \(got 3\)"):
        mod.topk_select(x, n_vis, o, False, 3)
    with pytest.raises(RuntimeError, match="the one-CTA kernel takes 16-bit scores of at most 32768 entries"):
        mod.topk_select(x.float(), n_vis, o, False, 2)
    with pytest.raises(RuntimeError, match="the one-CTA kernel takes 16-bit scores of at most 32768 entries"):
        mod.topk_select(torch.zeros(1, 2, 32769, dtype=torch.bfloat16, device="cuda"), n_vis, o, False, 2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_second_device():
    # the shared-memory opt-in is per device: a long row on the second GPU after one on the first
    x = tied_scores(1, 1, 32768, seed=15, dtype=torch.bfloat16, device="cuda")
    check(x, counts(1, 32768), 512)
    with torch.cuda.device(1):
        y = x.to("cuda:1")
        check(y, torch.full((1,), 32768, dtype=torch.int64, device="cuda:1"), 512)
