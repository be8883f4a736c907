"""dsv4.ops.sparse_attn_cuda (decode attention in one launch and prefill chunks, dsv4/kernels/cuda/attn.cu) against
sparse_attn_ref.

GPU only. Fresh random inputs: Flash decode shapes (64 heads, 512 dims, a 128-slot window) at 1K, 16K and 128K
context for SWA, HCA (every visible entry, ascending, -1 past the visible count) and CSA (the indexer's top-512 in any
order, a -1 tail while fewer are visible), 1, 2 and 4 queries; odd lists (lengths off the 64-slot grid, holes, a
block straddling the window and compressed parts, a query whose list is all -1, 128 heads, two sequences); the
layouts the model passes (lists expanded over the batch, the entries a prefix of their buffer, a strided q); a
running maximum that jumps in a late block after empty ones; each cluster shape (1-8 CTAs, 1-3 blocks per CTA) up to
the cluster's 1536 slots, and 9-24 blocks in clusters of 16 CTAs (1-2 blocks each) against clusters of 8, bf16 and
packed rows. Past them, the three-launch path over splits: HCA lists at 256K and 1M tokens of context,
odd long lists (holes, -1 tails, empty splits, several queries and sequences), a late jump of the running maximum
across splits, a query without a valid slot. The kernels walk the reference's 64-slot blocks with the walk's own
running maximum, so they must agree within `op_attention` and differ from the reference in few output elements (fp32
summation order only). Also: bitwise determinism, CUDA-graph replay == eager (and follows new lists), the registered
fast op routing decode calls here, and the binding's refusals. The prefill kernel (more than 8 queries, H a multiple of
64; one CTA per (query, 64 heads) walking the list in order): Flash prefill chunks of 128 queries at 1K, 16K and 128K
for SWA, HCA and CSA, causal windows, odd chunk sizes and lists (9 and 37 queries, 128 heads, two sequences, holes,
empty blocks before the first valid one, a query without a valid slot, a late jump of the running maximum), HCA lists
of 1M tokens, packed rows (bit for bit the bf16 rows of the same values, also with holes, a partial last block and
an empty query), RoPE-inverted outputs bit for bit, determinism and graph replay.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.sparse_attn import sparse_attn_ref
from dsv4.testing import assert_bitwise_equal, assert_close_rel, graph_replay, tol
from dsv4.ops.rope import rope_ref
from test_sparse_attn import flash_case, make_case, rope_tables, whole_list

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("built_sm90")]

def _mod():
    from dsv4.ops import sparse_attn_cuda
    return sparse_attn_cuda


def check(args):
    from dsv4.ops import sparse_attn_triton

    sc = _mod()
    assert sc.applies(*args[:6])
    o = sc.sparse_attn(*args)  # the kernel runs before the reference is allocated
    ref = sparse_attn_ref(*args)
    assert_close_rel(o, ref, "op_attention")
    whole = sparse_attn_triton.sparse_attn(*args, cfg=whole_list(sparse_attn_triton, args))
    mine, theirs = (o != ref).float().mean().item(), (whole != ref).float().mean().item()
    # the same walk as the reference in another fp32 summation order: few outputs round differently (testing.py)
    assert mine <= max(tol("op_attention_flip_ratio") * theirs, tol("op_attention_flip_floor")), \
        f"{mine:.2e} of the outputs round differently from the reference (the Triton walk: {theirs:.2e})"
    return o, ref


@pytest.mark.parametrize("S", [1, 2, 4])
@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
@pytest.mark.parametrize("context", [1024, 16384, 131072])
def test_decode_flash(context, kind, S):
    check(flash_case(context, kind, S, seed=context + S + len(kind)))


def test_peaked_softmax_and_sink():
    # keys aligned with the queries: one block holds most of the mass, the running maximum jumps between blocks
    check(make_case(1, 1, 64, 512, 128, 1024, 1024, seed=5, peak=8.0, n_vis=900, csa=False, device="cuda"))


@pytest.mark.parametrize("Lw,Lc,holes", [(100, 333, 0.3), (128, 1, 0.0), (37, 0, 0.5), (1, 0, 0.0),
                                         (128, 1408, 0.1), (64, 640, 0.0)])
def test_odd_lists_every_cluster_shape(Lw, Lc, holes):
    # list lengths off the 64-slot grid, a block straddling the window and compressed parts; with the window these
    # give 1-8 CTAs and 1-3 blocks per CTA, up to the 1536-slot limit
    args = make_case(2, 3, 128, 512, Lw, max(Lc, 1), Lc, seed=Lw + Lc, win_holes=holes, csa=True, device="cuda",
                     n_vis=None if Lc == 0 else max(Lc // 2, 1))
    check(args)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("Lw,Lc,S", [(128, 512, 1), (100, 900, 2), (128, 1024, 1), (64, 1472, 1), (37, 555, 1)])
def test_clusters_of_16_and_of_8(Lw, Lc, S, packed, monkeypatch):
    # 9-24 blocks: clusters of 16 CTAs (1-2 blocks each) where the device holds them, else of 8 (2-3 blocks each);
    # both within the reference's bound, and the packed rows read as their bf16 values in either
    from dsv4.ops.kv_pack import kv_pack_ref

    sc = _mod()
    args = make_case(1, S, 64, 512, Lw, Lc + 17, Lc, seed=Lw + Lc + S, win_holes=0.2, csa=True, device="cuda",
                     n_vis=Lc - 3)
    if packed:
        args = _fp8_rows(args)
    mod = cuda_kernels.load()
    assert mod.sparse_attn_decode_cluster(Lw + Lc, S, 4, packed, 8) == 8
    if torch.cuda.get_device_properties(0).multi_processor_count >= 132:  # an H100 / H200 SXM holds them
        assert mod.sparse_attn_decode_cluster(Lw + Lc, S, 4, packed, 16) == 16
    outs = {}
    for width in (16, 8):
        monkeypatch.setattr(sc, "MAX_CLUSTER", width)
        outs[width] = check(args)[0]
        if packed:
            q, kvw, iw, kvc, ic, sink, scale = args
            pk = (q, kv_pack_ref(kvw), iw, kv_pack_ref(kvc), ic, sink, scale)
            assert_bitwise_equal(sc.sparse_attn(*pk), outs[width], f"packed rows, clusters of {width}")
    # another fp32 summation order (the CTAs' partials), the same walk: within the op's bound of each other
    assert_close_rel(outs[16], outs[8], "op_attention")


def _fp8_rows(args):
    # rows holding FP8-simulated values in their first 448 dims (what a packed state stores)
    from dsv4.ops.act_quant import act_quant_sim_ref

    def sim(t):
        return torch.cat((act_quant_sim_ref(t[..., :448], 64), t[..., 448:]), -1)

    q, kvw, iw, kvc, ic, sink, scale = args
    return q, sim(kvw), iw, sim(kvc), ic, sink, scale


def test_all_empty_list_gives_zeros_and_entries_as_a_prefix():
    q, kvw, iw, kvc, ic, sink, scale = make_case(1, 2, 64, 512, 128, 700, 512, seed=9, device="cuda")
    iw[:, 1] = -1
    ic[:, 1] = -1
    # the entries as the model passes them: a prefix of a larger buffer (row stride 512, batch stride bigger)
    buf = torch.zeros(1, 1000, 512, dtype=kvc.dtype, device="cuda")
    buf[:, :700] = kvc
    args = (q, kvw, iw, buf[:, :700], ic, sink, scale)
    o, _ = check(args)
    assert o[:, 1].abs().sum().item() == 0, "a query without a valid slot must get zeros"
    assert o[:, 0].abs().sum().item() > 0


def test_model_layouts():
    # as attention.py passes them: the window list and HCA's list expanded over the batch (stride 0), the entries a
    # prefix of the state's buffer (a padded batch stride, B = 2), q a view with a 576-element head stride
    g = torch.Generator(device="cuda").manual_seed(31)
    B, H, D, W, n, cap = 2, 64, 512, 128, 700, 1025
    q = torch.randn(B, 1, H, 576, generator=g, device="cuda").bfloat16()[..., :D]
    kvw = torch.randn(B, W, D, generator=g, device="cuda").bfloat16()
    win = torch.roll(torch.arange(W, dtype=torch.int32, device="cuda"), 5)
    win[100:] = -1
    ent = torch.randn(B, cap, D, generator=g, device="cuda").bfloat16()
    ar = torch.arange(n, device="cuda")
    ic = torch.where(ar < 650, ar, -1).to(torch.int32)[None, None].expand(B, 1, n)
    sink = torch.randn(H, generator=g, device="cuda")
    args = (q, kvw, win[None, None].expand(B, 1, W), ent[:, :n], ic, sink, D ** -0.5)
    assert args[0].stride(2) == 576 and args[2].stride(0) == 0 and args[3].stride(0) == cap * D
    check(args)


def test_running_max_jumps_late_after_empty_blocks():
    # an HCA list of 18 blocks over 8 CTAs (2-3 each) whose blocks 2-9 are empty, so ranks 2-7 meet an empty block
    # before a valid one, and keys aligned with the queries in block 16 (rank 0's third): the running maximum jumps
    # there, after every other CTA's blocks
    q, kvw, iw, kvc, ic, sink, scale = make_case(1, 2, 64, 512, 128, 1024, 1024, seed=13, csa=False, device="cuda")
    ic[:, :, :512] = -1
    kvc[:, 900:904] += (3.0 * q[:, :1, :4].float().mean(1)).to(kvc.dtype)
    o, ref = check((q, kvw, iw, kvc, ic, sink, scale))
    assert (ref.float() - sparse_attn_ref(q, kvw, iw, None, None, sink, scale).float()).abs().max() > 0.1


def test_limits_route_elsewhere():
    sc = _mod()
    ok = make_case(1, 1, 64, 512, 128, 1408, 1408, seed=1, device="cuda")
    assert sc.applies(*ok[:6])  # 1536 slots: one cluster
    q, kvw, iw, kvc, ic, sink, _ = ok
    longest = torch.zeros(1, 1, sc.MAX_SLOTS - 128, dtype=torch.int32, device="cuda")
    assert sc.applies(q, kvw, iw, kvc, longest, sink)  # 2^18 slots: the split path
    assert not sc.applies(q, kvw, iw, kvc, torch.cat([longest, longest[..., :1]], -1), sink)  # one more: Triton
    chunk = make_case(1, 9, 64, 512, 128, 256, 256, seed=1, device="cuda")
    assert sc.applies(*chunk[:6])  # 9 queries: a prefill chunk, the prefill kernel
    narrow = make_case(1, 9, 16, 512, 128, 256, 256, seed=1, device="cuda")
    assert not sc.applies(*narrow[:6])  # a prefill chunk of 16 heads (H not a multiple of 64): Triton
    small = make_case(1, 1, 64, 256, 128, 256, 256, seed=1, device="cuda")
    assert not sc.applies(*small[:6])  # D = 256 (the demo model)
    mod = cuda_kernels.load()
    # 16 KB of q rows + 3 blocks of 64 KB + 2 KB of bf16(p) + 5,376 bytes of small arrays (C = 8)
    assert mod.sparse_attn_decode_smem(1536) == 220416
    # past it a ring of 3 tiles: the same, with 10,784 bytes of small arrays (the rows of a split's 16 blocks, seeds)
    assert mod.sparse_attn_decode_smem(1537) == mod.sparse_attn_decode_smem(1 << 18) == 225824
    assert mod.sparse_attn_decode_smem((1 << 18) + 1) == -1 and mod.sparse_attn_decode_smem(0) == -1
    assert not sc.applies(q, kvw, iw.long(), kvc, ic, sink)  # int64 lists
    assert not sc.applies(q.float(), kvw.float(), iw, kvc.float(), ic, sink)


def test_deterministic_and_graph_replay_follows_new_lists():
    sc = _mod()
    args = flash_case(131072, "csa", 2, seed=4)
    first = sc.sparse_attn(*args)
    for _ in range(3):
        assert_bitwise_equal(sc.sparse_attn(*args), first, "rerun")
    want, out = graph_replay(lambda: sc.sparse_attn(*args))
    assert_bitwise_equal(out, want, "graph replay")
    q, kvw, iw, kvc, ic, sink, scale = args
    ic.copy_(ic.flip(-1))  # new lists in the same buffers
    from dsv4.testing import capture_graph

    graph, out = capture_graph(lambda: sc.sparse_attn(*args))
    ic.copy_(ic.flip(-1))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, first, "graph replay after new lists")


def test_fast_op_routes_decode_and_prefill_here():
    from dsv4 import ops
    from dsv4.ops import sparse_attn_triton

    sc = _mod()
    dec = flash_case(16384, "hca", 1, seed=21)
    assert_bitwise_equal(ops.OPS["sparse_attn"].fast(*dec), sc.sparse_attn(*dec), "decode")
    pre = flash_case(16384, "hca", 16, seed=22)
    assert_bitwise_equal(ops.OPS["sparse_attn"].fast(*pre), sc.sparse_attn(*pre), "prefill chunk")
    narrow = make_case(1, 16, 32, 512, 128, 256, 256, seed=23, device="cuda")  # 32 heads: the Triton kernels
    assert_bitwise_equal(ops.OPS["sparse_attn"].fast(*narrow), sparse_attn_triton.sparse_attn(*narrow), "32 heads")


@pytest.mark.parametrize("kind,S", [("csa", 1), ("hca", 4), ("swa", 2), ("csa", 8)])
def test_output_rope_inverted_bitwise(kind, S):
    # the epilogue's rotation is rope_ref's inverse on the rounded output, product by product (no fused
    # multiply-add): bit for bit; the other dims are untouched. The registered fast op passes the tables here
    from dsv4 import ops

    sc = _mod()
    args = flash_case(16384, kind, S, seed=60 + S)
    cos, sin = rope_tables(S, 64, seed=S, device="cuda")
    assert sc.applies(*args[:6], cos, sin)
    plain = sc.sparse_attn(*args)
    o = sc.sparse_attn(*args, cos, sin)
    assert_bitwise_equal(o, rope_ref(plain, cos, sin, True), f"RoPE-inverted output {kind} S={S}")
    assert_bitwise_equal(ops.OPS["sparse_attn"].fast(*args, cos, sin), o, "the fast op")
    assert_close_rel(o, sparse_attn_ref(*args, cos, sin), "op_attention")
    want, out = graph_replay(lambda: sc.sparse_attn(*args, cos, sin))
    assert_bitwise_equal(out, want, "graph replay")
    # other table shapes: the Triton kernels (rd / 2 odd), a refusal in the binding
    assert not sc.applies(*args[:6], cos[:, :31], sin[:, :31])
    assert not sc.applies(*args[:6], cos, None)
    mod = cuda_kernels.load()
    q, kvw, iw, kvc, ic, sink, scale = args
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous fp32"):
        mod.sparse_attn_decode(q, kvw, iw, kvc, ic, sink, torch.empty_like(q), scale, False, cos[:, :31].contiguous(),
                               sin[:, :31].contiguous(), 16)
    with pytest.raises(RuntimeError, match="cos and sin come together"):
        mod.sparse_attn_decode(q, kvw, iw, kvc, ic, sink, torch.empty_like(q), scale, False, cos, None, 16)


def test_binding_refuses_bad_calls():
    mod = cuda_kernels.load()
    q, kvw, iw, kvc, ic, sink, scale = make_case(1, 1, 64, 512, 128, 256, 256, seed=2, device="cuda")
    o = torch.empty_like(q)
    with pytest.raises(RuntimeError, match=r"H a multiple of 16 .*\(got H = 8, D = 512\)"):
        mod.sparse_attn_decode(q[:, :, :8], kvw, iw, kvc, ic, sink[:8], o[:, :, :8], scale, False, None, None, 16)
    with pytest.raises(RuntimeError, match="idx_win must be int32"):
        mod.sparse_attn_decode(q, kvw, iw.long(), kvc, ic, sink, o, scale, False, None, None, 16)
    with pytest.raises(RuntimeError, match="come together"):
        mod.sparse_attn_decode(q, kvw, iw, kvc, None, sink, o, scale, False, None, None, 16)
    big = torch.zeros(1, 1, (1 << 18) - 127, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"lists of 1 to 262144 slots \(got 262145\)"):
        mod.sparse_attn_decode(q, kvw, iw, kvc, big, sink, o, scale, False, None, None, 16)
    with pytest.raises(RuntimeError, match="kv_win must be bf16"):
        mod.sparse_attn_decode(q, kvw[:, :, 1:], iw, kvc, ic, sink, o, scale, False, None, None, 16)
    with pytest.raises(RuntimeError, match=r"sink must be fp32 \[H\]"):
        mod.sparse_attn_decode(q, kvw, iw, kvc, ic, sink.double(), o, scale, False, None, None, 16)
    with pytest.raises(RuntimeError, match="idx_comp must be int32"):
        mod.sparse_attn_decode(q, kvw, iw, kvc, ic[:, :0], sink, o, scale, False, None, None, 16)
    with pytest.raises(RuntimeError, match=r"max_cluster must be 8 or 16 \(got 4\)"):
        mod.sparse_attn_decode(q, kvw, iw, kvc, ic, sink, o, scale, False, None, None, 4)


# ---- lists past one cluster (1536 slots): three launches over splits ----

@pytest.mark.parametrize("S", [1, 4])
@pytest.mark.parametrize("context", [262144, 1048576])
def test_long_hca_lists(context, S):
    # an HCA list of every entry at 256K (2048 + the window: 34 blocks) and 1M (8192 + 128: 130 blocks) tokens
    args = flash_case(context, "hca", S, seed=context // 1024 + S)
    assert args[2].shape[-1] + args[4].shape[-1] > _mod().CLUSTER_SLOTS
    check(args)


@pytest.mark.parametrize("Lw,Lc,nvis,holes", [(100, 1500, None, 0.3), (128, 4000, 1300, 0.0), (37, 2100, 900, 0.5),
                                              (128, 1409, None, 0.0)])
def test_long_odd_lists(Lw, Lc, nvis, holes):
    # lengths off the 64-slot grid, holes, -1 tails that leave whole splits without a valid slot, two sequences of
    # three queries, 128 heads (8 head groups)
    args = make_case(2, 3, 128, 512, Lw, Lc, Lc, seed=Lw + Lc, win_holes=holes, csa=True, device="cuda", n_vis=nvis)
    check(args)


@pytest.mark.parametrize("H,S,Lc", [(16, 1, 8000), (64, 8, 8192)])
def test_long_lists_many_splits_and_eight_queries(H, S, Lc):
    # 16 heads, one query: on 132 SMs a split per block, 127 splits (past the 64 that a combine thread keeps in
    # registers); eight queries over a 1M-token HCA list: splits of 16 blocks, the most a split holds (9 splits)
    args = make_case(1, S, H, 512, 128, Lc, Lc, seed=H + S, win_holes=0.05, csa=False, device="cuda", n_vis=Lc - 300)
    check(args)


def test_long_running_max_jumps_late_and_empty_query():
    # an HCA list of 4096 entries + the window (66 blocks, several splits) whose entries 256-3071 are empty and whose
    # keys at 4000-4003 align with the queries: the running maximum jumps in the last split, after splits that met only
    # empty blocks; query 1 has no valid slot at all
    q, kvw, iw, kvc, ic, sink, scale = make_case(1, 2, 64, 512, 128, 4096, 4096, seed=17, csa=False, device="cuda")
    ic[:, :, 256:3072] = -1
    kvc[:, 4000:4004] += (3.0 * q[:, :1, :4].float().mean(1)).to(kvc.dtype)
    iw[:, 1] = -1
    ic[:, 1] = -1
    o, ref = check((q, kvw, iw, kvc, ic, sink, scale))
    assert o[:, 1].abs().sum().item() == 0, "a query without a valid slot must get zeros"
    ic2 = ic.clone()
    ic2[:, :, 3072:] = -1
    assert (ref[:, 0].float() - sparse_attn_ref(q, kvw, iw, kvc, ic2, sink, scale)[:, 0].float()).abs().max() > 0.1


def test_long_deterministic_graph_replay_rope_and_fast_op():
    from dsv4 import ops

    sc = _mod()
    args = flash_case(524288, "hca", 2, seed=41)
    first = sc.sparse_attn(*args)
    for _ in range(3):
        assert_bitwise_equal(sc.sparse_attn(*args), first, "rerun")
    want, out = graph_replay(lambda: sc.sparse_attn(*args))
    assert_bitwise_equal(out, want, "graph replay")
    assert_bitwise_equal(ops.OPS["sparse_attn"].fast(*args), first, "the fast op")
    cos, sin = rope_tables(2, 64, seed=3, device="cuda")
    assert_bitwise_equal(sc.sparse_attn(*args, cos, sin), rope_ref(first, cos, sin, True), "RoPE-inverted output")
    q, kvw, iw, kvc, ic, sink, scale = args
    from dsv4.testing import capture_graph

    graph, out = capture_graph(lambda: sc.sparse_attn(*args))
    ic[:, :, 1000:] = -1  # new lists in the same buffers: the replay reads them
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, sc.sparse_attn(*args), "graph replay after new lists")
    assert_close_rel(out, sparse_attn_ref(*args), "op_attention")


# ---- prefill chunks: one CTA per (query, 64 heads), the list walked in order (wgmma) ----

def causal_window(args, start: int, W: int = 128):
    """The model's prefill window lists for a chunk of S queries at positions start .. start + S - 1 (StepPlan.build):
    the ring's W rows then the chunk's own rows (kv_win [B, W + S, D]), query i seeing the W positions up to its own."""
    q, kvw, iw, kvc, ic, sink, scale = args
    B, S = q.shape[:2]
    pos = start + torch.arange(S, device=q.device)
    p = (pos - W + 1).clamp_min(0)[:, None] + torch.arange(W, device=q.device)[None, :]
    row = torch.where(p >= start, W + p - start, p % W)
    iw = torch.where(p <= pos[:, None], row, -1).to(torch.int32)[None].expand(B, S, W).contiguous()
    g = torch.Generator(device="cuda").manual_seed(start)
    kvw = torch.randn(B, W + S, q.shape[-1], generator=g, device="cuda").to(q.dtype)
    return q, kvw, iw, kvc, ic, sink, scale


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
@pytest.mark.parametrize("context", [1024, 16384, 131072])
def test_prefill_flash(context, kind):
    # a 128-query chunk ending at the context, its window causal
    check(causal_window(flash_case(context, kind, 128, seed=context + len(kind)), context - 128))


@pytest.mark.parametrize("B,S,H,Lw,Lc,holes", [(1, 9, 64, 128, 512, 0.1), (2, 37, 128, 100, 333, 0.3),
                                               (1, 16, 64, 37, 0, 0.5), (1, 12, 64, 1, 0, 0.0),
                                               (2, 10, 64, 128, 1409, 0.2)])
def test_prefill_odd_chunks_and_lists(B, S, H, Lw, Lc, holes):
    # chunk sizes and list lengths off the grids, holes, a block straddling the window and compressed parts, 128 heads
    # (two CTAs a query), two sequences
    args = make_case(B, S, H, 512, Lw, max(Lc, 1), Lc, seed=B + S + H + Lw + Lc, win_holes=holes, csa=True,
                     device="cuda", n_vis=None if Lc == 0 else max(Lc // 2, 1))
    check(args)


def test_prefill_empty_blocks_late_jump_and_empty_query():
    # an HCA list of 1024 entries + the window: query 0 sees no window slot and entries 0-511 empty (the walk starts at
    # its 11th block), keys at entries 900-903 aligned with the queries (the running maximum jumps late); query 3 has no
    # valid slot at all
    q, kvw, iw, kvc, ic, sink, scale = make_case(1, 12, 64, 512, 128, 1024, 1024, seed=19, csa=False, device="cuda")
    iw[:, 0] = -1
    ic[:, 0, :512] = -1
    kvc[:, 900:904] += (3.0 * q[:, :1, :4].float().mean(1)).to(kvc.dtype)
    iw[:, 3] = -1
    ic[:, 3] = -1
    o, ref = check((q, kvw, iw, kvc, ic, sink, scale))
    assert o[:, 3].abs().sum().item() == 0, "a query without a valid slot must get zeros"
    ic2 = ic.clone()
    ic2[:, :, 896:] = -1
    assert (ref[:, 0].float() - sparse_attn_ref(q, kvw, iw, kvc, ic2, sink, scale)[:, 0].float()).abs().max() > 0.1


def test_prefill_long_hca_list():
    # 16 queries over an HCA list at 1M tokens (8192 entries + the window: 130 blocks, walked in one CTA each)
    check(causal_window(flash_case(1048576, "hca", 16, seed=77), 1048576 - 16))


def _odd_packed_case():
    # holes, a partial last block (100 + 333 slots), a query without a valid slot, another whose first blocks are empty
    args = make_case(1, 11, 64, 512, 100, 700, 333, seed=8, win_holes=0.3, csa=True, device="cuda", n_vis=300)
    q, kvw, iw, kvc, ic, sink, scale = args
    iw[:, 4] = -1
    ic[:, 4] = -1
    iw[:, 7] = -1
    ic[:, 7, :200] = -1
    return args


@pytest.mark.parametrize("kind", ["csa", "hca", "odd"])
def test_prefill_packed_rows_bitwise(kind):
    # packed FP8 rows are converted to their exact bf16 values in shared memory: the same bits as the bf16 rows
    from dsv4.ops.kv_pack import kv_pack_ref

    sc = _mod()
    if kind == "odd":
        args = _fp8_rows(_odd_packed_case())
    else:
        args = _fp8_rows(causal_window(flash_case(16384, kind, 64, seed=5 + len(kind)), 16384 - 64))
    q, kvw, iw, kvc, ic, sink, scale = args
    pk = (q, kv_pack_ref(kvw), iw, kv_pack_ref(kvc), ic, sink, scale)
    assert sc.applies(*pk[:6])
    plain = check(args)[0]
    assert_bitwise_equal(sc.sparse_attn(*pk), plain, "packed rows")
    assert_close_rel(sc.sparse_attn(*pk), sparse_attn_ref(*pk), "op_attention")


@pytest.mark.parametrize("kind", ["csa", "swa"])
def test_prefill_rope_deterministic_graph_replay(kind):
    from dsv4 import ops
    from dsv4.testing import capture_graph

    sc = _mod()
    S = 128
    args = causal_window(flash_case(131072, kind, S, seed=90 + len(kind)), 131072 - S)
    cos, sin = rope_tables(S, 64, seed=4, device="cuda")
    assert sc.applies(*args[:6], cos, sin)
    plain = sc.sparse_attn(*args)
    o = sc.sparse_attn(*args, cos, sin)
    assert_bitwise_equal(o, rope_ref(plain, cos, sin, True), f"RoPE-inverted output {kind}")
    assert_bitwise_equal(ops.OPS["sparse_attn"].fast(*args, cos, sin), o, "the fast op")
    assert_close_rel(o, sparse_attn_ref(*args, cos, sin), "op_attention")
    for _ in range(3):
        assert_bitwise_equal(sc.sparse_attn(*args, cos, sin), o, "rerun")
    want, out = graph_replay(lambda: sc.sparse_attn(*args, cos, sin))
    assert_bitwise_equal(out, want, "graph replay")
    q, kvw, iw, kvc, ic, sink, scale = args
    graph, out = capture_graph(lambda: sc.sparse_attn(*args))
    iw[:, :, 64:] = -1  # new lists in the same buffers: the replay reads them
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, sc.sparse_attn(*args), "graph replay after new lists")


def test_prefill_binding_refuses_bad_calls():
    mod = cuda_kernels.load()
    q, kvw, iw, kvc, ic, sink, scale = make_case(1, 9, 64, 512, 128, 256, 256, seed=3, device="cuda")
    o = torch.empty_like(q)
    bad_heads = r"sparse_attn_prefill: q must be .*H a multiple of 64 .*\(got H = 32, D = 512\)"
    with pytest.raises(RuntimeError, match=bad_heads):
        mod.sparse_attn_prefill(q[:, :, :32], kvw, iw, kvc, ic, sink[:32], o[:, :, :32], scale, False, None, None)
    with pytest.raises(RuntimeError, match="sparse_attn_prefill: idx_win must be int32"):
        mod.sparse_attn_prefill(q, kvw, iw.long(), kvc, ic, sink, o, scale, False, None, None)
    with pytest.raises(RuntimeError, match="sparse_attn_prefill: cos and sin come together"):
        mod.sparse_attn_prefill(q, kvw, iw, kvc, ic, sink, o, scale, False, torch.zeros(9, 32, device="cuda"), None)
    # 64 KB of q, two 64 KB tiles, 8 KB of bf16(p), 2,064 bytes of small arrays (row pointers, valid bits, maxima and
    # sums), 1024 of alignment slack: within an H100 / H200 CTA's 227 KB
    assert mod.sparse_attn_prefill_smem() == 65536 + 2 * 65536 + 8192 + 2064 + 1024 <= 227 * 1024
