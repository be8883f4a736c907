"""indexer_scores and topk_select fast paths (dsv4/ops/indexer_triton.py) against their references.

topk_select must equal the reference bit for bit (set and order: descending score, ties to the lower
entry, -1 past the visible count); the inputs are full of ties (exact zeros after the ReLU, -0.0, repeated
bf16 values). indexer_scores is held to `op_bf16_out` (reference numerics, bf16) and `op_fp32_out`.
CPU tier: the Triton interpreter (a subprocess under TRITON_INTERPRET=1, see test_sparse_attn.py); GPU
tier (`gpu` mark): Flash shapes (64 heads x 128, k = 512) over 4K, 32K and 262K entries (16K, 128K and
1M context), decode and 128-query prefill, and CUDA-graph capture (replay == eager, bitwise).
"""

import sys
from pathlib import Path

import pytest
import torch

from dsv4.ops.indexer import indexer_scores_ref, topk_select_ref
from dsv4.testing import assert_bitwise_equal, assert_close_rel

sys.path.insert(0, str(Path(__file__).parent))
from test_sparse_attn import INTERP, cpu_tier, run_interpreted  # noqa: E402

CUDA = torch.cuda.is_available()


def test_cpu_tier_interpreted():
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def fast():
    pytest.importorskip("triton")
    from dsv4.ops import indexer_triton
    return indexer_triton


def tied_scores(B, S, N, *, seed, dtype, device="cpu"):
    """Indexer-like scores: sums of ReLU'd terms, many exact zeros (and -0.0), repeated values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, N, generator=g)
    x = torch.where(torch.rand(B, S, N, generator=g) < 0.2, 0.0, x)
    x[..., 3::17] = -0.0
    x[..., 5::13] = x[..., 6::13]
    return x.to(dtype).to(device)


def check_topk(fast, x, n_vis, k):
    got = fast.topk_select(x, n_vis, k)
    assert_bitwise_equal(got, topk_select_ref(x, n_vis, k), f"topk k={k} N={x.shape[-1]}")
    return got


# ---------------------------------------------------------------------------------------------------------
# CPU tier


@cpu_tier
def test_topk_ties_tails_and_short_lists(fast):
    # N not a multiple of the chunk (3 chunks, two merge rounds); per query: all visible, fewer visible than
    # k (the list's -1 tail), none visible (all -1), exactly k visible; bf16 and fp32 scores
    N, k = 2500, 512
    check_topk(fast, tied_scores(1, 4, N, seed=1, dtype=torch.bfloat16), torch.tensor([N, 100, 0, k]), k)
    check_topk(fast, tied_scores(1, 1, N, seed=2, dtype=torch.float32), torch.tensor([N - 7]), k)


@cpu_tier
def test_topk_small_k_equal_n_and_all_ties(fast):
    x = tied_scores(1, 3, 100, seed=2, dtype=torch.float32)
    check_topk(fast, x, torch.tensor([100, 37, 100]), 100)  # k = N: every entry kept, only the order is selected
    # (bf16 scores, as the model's decode at 1K context: 256 entries, k = 256; one query sees none)
    check_topk(fast, tied_scores(1, 3, 256, seed=7, dtype=torch.bfloat16), torch.tensor([256, 100, 0]), 256)
    check_topk(fast, x, torch.tensor([100, 37, 100]), 5)
    z = torch.zeros(1, 2, 300)
    z[0, 1, ::2] = -0.0
    got = check_topk(fast, z, torch.tensor([300, 250]), 64)  # all equal: the first 64 entries in order
    assert got[0, 0].tolist() == list(range(64))


@cpu_tier
def test_topk_chunked_equals_one_shot(fast):
    # a query sees the same entries whether its row is scored over the visible part or the whole buffer
    x = tied_scores(1, 2, 1500, seed=3, dtype=torch.bfloat16)
    nv = torch.tensor([700, 1100])
    full = fast.topk_select(x, nv, 256)
    part = fast.topk_select(x[..., :1100].contiguous(), nv, 256)
    assert_bitwise_equal(part, full, "topk over a shorter buffer")


@cpu_tier
def test_topk_bad_inputs_raise(fast):
    x = torch.zeros(1, 2, 10)
    with pytest.raises(ValueError, match="k=11"):
        fast.topk_select(x, torch.tensor([10, 10]), 11)
    with pytest.raises(ValueError, match="n_visible"):
        fast.topk_select(x, torch.tensor([10]), 3)
    assert fast.topk_select(x[..., :0], torch.tensor([0, 0]), 0).shape == (1, 2, 0)


@cpu_tier
@pytest.mark.parametrize("low", [True, False])
def test_scores_production_heads(fast, low):
    # 64 heads x 128 dims, odd entry counts, S = 1 (decode) and 5; reference numerics score in bf16
    g = torch.Generator().manual_seed(4)
    for S, N in ((1, 300), (5, 77)):
        dt = torch.bfloat16
        q = torch.randn(1, S, 64, 128, generator=g).to(dt)
        w = torch.randn(1, S, 64, generator=g)  # the fp32 weights_proj output, scaled in the op
        k = torch.randn(1, N + 3, 128, generator=g).to(dt)[:, :N]  # entries[:, :n]: a strided slice
        scale = 128 ** -0.5 * 64 ** -0.5
        got = fast.indexer_scores(q, w, k, low, scale)
        ref = indexer_scores_ref(q, w, k, low, scale)
        assert got.dtype == ref.dtype
        assert_close_rel(got, ref, "op_bf16_out" if low else "op_fp32_out")


def _check_weight_scaling(fast, low, dev):
    # one head, q = k = e0: each score is the scaled head weight itself, so its rounding shows bit for bit
    # (reference numerics: bf16(bf16(w) * scale), torch's bf16 op computed in fp32; else fp32 w * scale); 200
    # queries: 50 blocks of 4 on a GPU
    g = torch.Generator().manual_seed(6)
    dt = torch.bfloat16 if low else torch.float32
    q = torch.zeros(1, 200, 1, 16, dtype=dt)
    q[..., 0] = 1
    k = torch.zeros(1, 1, 16, dtype=dt)
    k[..., 0] = 1
    w = torch.randn(1, 200, 1, generator=g).abs() * torch.exp2(torch.randint(-20, 20, (1, 200, 1), generator=g).float())
    q, k, w = q.to(dev), k.to(dev), w.to(dev)
    for scale in (128 ** -0.5 * 64 ** -0.5, 1.0, 3.0):
        got = fast.indexer_scores(q, w, k, low, scale)
        want = (w.to(dt) * scale) if low else w * scale
        assert torch.equal(got[..., 0], want[..., 0]), scale
        assert torch.equal(indexer_scores_ref(q, w, k, low, scale)[..., 0], want[..., 0])


@cpu_tier
@pytest.mark.parametrize("low", [True, False])
def test_scores_scale_the_head_weights_as_torch(fast, low):
    _check_weight_scaling(fast, low, "cpu")


@cpu_tier
def test_scores_fp32_small_heads(fast):
    g = torch.Generator().manual_seed(5)
    q, w = torch.randn(2, 3, 4, 32, generator=g), torch.randn(2, 3, 4, generator=g)
    k = torch.randn(2, 50, 32, generator=g)
    assert_close_rel(fast.indexer_scores(q, w, k, False), indexer_scores_ref(q, w, k, False), "op_fp32_out")


# ---------------------------------------------------------------------------------------------------------
# GPU tier


def _gpu_fast():
    from dsv4.ops import indexer_triton
    return indexer_triton


def _flash_scores(S, N, seed, low=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16
    q = torch.randn(1, S, 64, 128, device="cuda", generator=g).to(dt)
    w = (torch.randn(1, S, 64, device="cuda", generator=g) * 0.01).to(dt if low else torch.float32)
    k = torch.randn(1, N, 128, device="cuda", generator=g).to(dt)
    return q, w, k


@pytest.mark.parametrize("S", [1, 4, 128])
@pytest.mark.parametrize("N", [4096, 32768, 262144])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_topk_flash(N, S):
    if N == 4096:  # also the rows of 1K context (256 entries, k = 256: every entry kept)
        x = tied_scores(1, S, 256, seed=S, dtype=torch.bfloat16, device="cuda")
        n_vis = torch.full((S,), 256, dtype=torch.int64)
        n_vis[-1] = 100
        check_topk(_gpu_fast(), x, n_vis.cuda(), 256)
    if N == 262144 and S == 128:
        pytest.skip("1M-context prefill rows: covered by S = 4")
    fast = _gpu_fast()
    x = tied_scores(1, S, N, seed=N + S, dtype=torch.bfloat16, device="cuda")
    n_vis = torch.full((S,), N, dtype=torch.int64)
    n_vis[-1] = 300  # a query whose list is shorter than k
    check_topk(fast, x, n_vis.cuda(), 512)
    check_topk(fast, x.float(), n_vis.cuda(), 512)


@pytest.mark.parametrize("S", [1, 128])
@pytest.mark.parametrize("N", [4096, 32768])
@pytest.mark.parametrize("low", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_scores_flash(N, S, low):
    fast = _gpu_fast()
    q, w, k = _flash_scores(S, N, seed=N + S, low=low)
    assert_close_rel(fast.indexer_scores(q, w, k, low), indexer_scores_ref(q, w, k, low),
                     "op_bf16_out" if low else "op_fp32_out")


@pytest.mark.parametrize("low", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_scores_rounding_bitwise(low):
    # the GPU's cvt.rn roundings of the head weights, bit for bit torch's
    _check_weight_scaling(_gpu_fast(), low, "cuda")


@pytest.mark.parametrize("S,N", [(5, 300), (127, 9000)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_scores_query_tail_and_batch(S, N):
    # S not a multiple of the 4-query block (a prefill chunk of any length), two sequences, both entry tiles: each
    # row as the reference's and bit for bit that query scored alone
    fast = _gpu_fast()
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(2, S, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(2, S, 64, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
    k = torch.randn(2, N, 128, device="cuda", generator=g).to(torch.bfloat16)
    got = fast.indexer_scores(q, w, k, True)
    assert_close_rel(got, indexer_scores_ref(q, w, k, True), "op_bf16_out")
    for s in (0, S - 1):
        assert_bitwise_equal(got[:, s:s + 1], fast.indexer_scores(q[:, s:s + 1], w[:, s:s + 1], k, True), f"query {s}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_scores_then_topk_graph_replay_equals_eager():
    fast = _gpu_fast()
    q, w, k = _flash_scores(1, 32768, seed=9)
    n_vis = torch.tensor([30000], device="cuda")

    def step():
        return fast.topk_select(fast.indexer_scores(q, w, k, True), n_vis, 512)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, eager, "graph replay")
    n_vis.fill_(1000)  # the visible count lives on the device: the replay follows it
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, step(), "graph replay after a new visible count")
    assert int((out >= 1000).sum()) == 0


def test_eager_calls_take_the_unspecialized_twins(fast, monkeypatch):
    # triton_util.JitTwins: inside ops.fixed_shapes() (the decode graphs' warm-up and capture) the kernel specialized
    # on its integers, outside the twin that does not specialize on what follows a prefill chunk (so a new chunk
    # length compiles nothing); the batch strides go in as 0 for one sequence; eager scores calls take one block size
    from dsv4 import ops

    seen = []

    class Probe:
        def __init__(self, tag):
            self.tag = tag

        def __getitem__(self, grid):
            return lambda *a, **k: seen.append((self.tag, a, k))

    for twins in (fast._topk, fast._scores):
        monkeypatch.setattr(twins, "fixed", Probe("fixed"))
        monkeypatch.setattr(twins, "any", Probe("any"))
    scores, nvis = torch.randn(1, 3, 40), torch.full((3,), 40)
    q, w, k = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4), torch.randn(1, 40, 16)
    fast.topk_select(scores, nvis, 4)
    fast.indexer_scores(q, w, k, False)
    with ops.fixed_shapes():
        with ops.fixed_shapes():
            fast.topk_select(scores, nvis, 4)
        assert ops.shapes_fixed()
        fast.indexer_scores(q, w, k, False)
    assert not ops.shapes_fixed()
    with pytest.raises(RuntimeError), ops.fixed_shapes():
        raise RuntimeError
    assert not ops.shapes_fixed()
    assert [t for t, _, _ in seen] == ["any", "any", "fixed", "fixed"]
    assert seen[0][1][9] == 0 and seen[0][1][11] == 0  # the top-k's batch strides (sx_b, so_b)
    assert [seen[1][1][i] for i in (8, 11, 13, 15)] == [0] * 4  # the scores' (sq_b, sw_b, sk_b, so_b)
    monkeypatch.undo()
    for twins, varying in ((fast._topk, ["S", "K", "P_IN"]), (fast._scores, ["S", "sq_b", "sw_b"])):
        if hasattr(twins.any, "params"):  # JITFunctions (not the interpreter's wrapper): the names are parameters
            assert [p.name for p in twins.any.params if p.do_not_specialize] == varying
            assert not any(p.do_not_specialize for p in twins.fixed.params)
