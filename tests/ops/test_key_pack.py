"""Packed FP4 indexer keys (dsv4/ops/kv_pack.py): the format and the readers (indexer_scores: reference and Triton)
against the bf16 keys they stand for, bit for bit (the writer, the compressor: test_kv_pack.py); and a whole model
whose indexer keys are packed against the same model on a bf16 state. Interpreted on the CPU at small widths; the
Flash width (d = 128, 64 heads, 32K entries) on a GPU."""

import pytest
import torch

from dsv4.model.layers import Rope
from dsv4.ops.compressor import compressor_ref
from dsv4.ops.fp4_quant import E2M1_LUT, fp4_act_quant_ref, fp4_act_quant_sim_ref
from dsv4.ops.indexer import indexer_scores_ref
from dsv4.ops.kv_pack import key_pack_parts, key_pack_ref, key_row_bytes, key_unpack_ref
from dsv4.state import CompressorState, ModelState

from test_kv_pack import _same, _tiny_model

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
both_tiers = pytest.mark.gpu if CUDA else (lambda f: f)

try:
    import triton
    import triton.language as tl

    from dsv4.ops.hadamard_triton import store_packed_key

    @triton.jit
    def _write_keys(x_ptr, o_ptr, N: tl.constexpr, RB: tl.constexpr):  # row r of x -> packed key r
        r = tl.program_id(0)
        store_packed_key(o_ptr, r * RB, tl.load(x_ptr + r * N + tl.arange(0, N)), N, RB - N // 2)
except ImportError:
    _write_keys = None


def _sim_keys(shape, d, g, scale=1.0):
    """bf16 keys as the FP4 simulation leaves them (e2m1 values times a power of two per block of 32)."""
    return fp4_act_quant_sim_ref((torch.randn(*shape, d, generator=g) * scale).bfloat16(), 32)


def test_key_row_bytes_and_refusals():
    assert key_row_bytes(128) == 80  # 64 bytes of codes + 4 scales, to 16
    assert [key_row_bytes(d) for d in (32, 64, 96, 1024)] == [32, 48, 64, 544]
    for d in (0, 48, 100):
        with pytest.raises(ValueError, match="positive multiple of 32"):
            key_row_bytes(d)
    with pytest.raises(ValueError, match="keys must be bf16"):
        key_pack_ref(torch.zeros(2, 128))
    with pytest.raises(ValueError, match=r"want packed keys \[..., 80\]"):
        key_unpack_ref(torch.zeros(2, 48, dtype=torch.uint8), 128)


def test_key_pack_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    v = _sim_keys((6, 5), 128, g, 3.0)
    v[0, 0, :32] = 0  # an all-zero block (its scale is the floor's)
    v[0, 1, :32] = fp4_act_quant_sim_ref(v[0, 1, :32].float() * 1e-30, 32).bfloat16()  # tiny scales
    v[1, 0, 5] = -0.0
    v[1, 1, 32:64] = torch.cat((E2M1_LUT, E2M1_LUT)).bfloat16()  # every code, both signs (amax 6: scale 1)
    p = key_pack_ref(v)
    assert p.dtype == torch.uint8 and p.shape == (6, 5, 80)
    assert not p[..., 68:].any()  # zero padding
    assert p[1, 1, 16:32].tolist() == [i | (i + 1) << 4 for i in range(0, 16, 2)] * 2 and p[1, 1, 65].item() == 127
    assert _same(key_unpack_ref(p, 128), v)
    assert torch.equal(key_pack_ref(key_unpack_ref(p, 128)), p)
    # the byte layout: element 2i in the low nibble of byte i, the scale's E8M0 byte after the codes
    one = torch.zeros(1, 32, dtype=torch.bfloat16)
    one[0, 0], one[0, 1], one[0, 2] = 0.5, -6.0, 1.5
    q = key_pack_ref(one)
    assert q[0, 0].item() == 0x1 | (0xF << 4) and q[0, 1].item() == 0x3 and q[0, 16].item() == 127
    # a zero-filled row (a slot no window wrote) reads as zeros
    assert not key_unpack_ref(torch.zeros(3, 80, dtype=torch.uint8), 128).float().any()


def test_compressor_refuses_packed_entries_without_a_simulation():
    # (the compressor's packed keys against its bf16 keys: test_kv_pack.test_compressor_entries_packed)
    st = CompressorState(1, 4, 64, True, 16, torch.bfloat16, "cpu", packed="key")
    rope = Rope(32, 160000.0, None, 64, "cpu")
    c = torch.randn(1, 1, 128)
    with pytest.raises(ValueError, match="packed entries need quant"):
        compressor_ref(c, c, torch.zeros(4, 128), torch.ones(64, dtype=torch.bfloat16), 1e-6, rope.cos, rope.sin,
                       st.kv, st.score, st.entries, torch.tensor([3]), 4, True, None)


def _fast_scores():
    pytest.importorskip("triton")
    from dsv4.ops.indexer_triton import indexer_scores
    return indexer_scores


@pytest.mark.parametrize("B,S,H,d,N", [(1, 1, 4, 64, 37), (2, 3, 5, 32, 70)]
                         + ([(1, 1, 64, 128, 32768 + 17), (1, 128, 64, 128, 4096)] if CUDA else []))
@both_tiers
def test_scores_on_packed_keys_equal_scores_on_their_values(B, S, H, d, N):
    # reference numerics (bf16 q, FP4-simulated keys): each backend scores the packed keys bit for bit as it
    # scores their bf16 values, including zero-filled rows (entries no window wrote)
    g = torch.Generator().manual_seed(N + d)
    q = fp4_act_quant_sim_ref(torch.randn(B, S, H, d, generator=g).bfloat16(), 32).to(DEV)
    w = torch.randn(B, S, H, generator=g).bfloat16().to(DEV)
    k = _sim_keys((B, N), d, g, 2.0)
    k[:, -3:] = 0
    kp = key_pack_ref(k)
    kp[:, -3:] = 0
    k, kp = k.to(DEV), kp.to(DEV)
    for op in (indexer_scores_ref, _fast_scores()):
        assert _same(op(q, w, kp, True, 0.125), op(q, w, k, True, 0.125)), op
    # outside the packed kernel's cases (fp32 scores): the reference reads them
    assert _same(_fast_scores()(q, w, kp, False, 0.125), indexer_scores_ref(q, w, k, False, 0.125))
    with pytest.raises(ValueError, match=r"\(packed keys: \[B,N,key_row_bytes\(d\)\] uint8\)"):
        _fast_scores()(q, w, kp[..., :-16], True)
    wide = torch.zeros(*kp.shape[:-1], 2 * kp.shape[-1], dtype=torch.uint8, device=DEV)[..., ::2]
    with pytest.raises(ValueError, match="unit stride on the bytes"):
        _fast_scores()(q, w, wide, True)


@both_tiers
def test_scores_on_packed_keys_at_extreme_scales():
    # blocks whose scale bytes span 1 (the amax floor's scale, e2m1's 0.5 a subnormal) to 250 (2^123): the packed
    # keys still score bit for bit as their bf16 values (queries scaled down so that no score overflows)
    g = torch.Generator().manual_seed(3)
    N, d = 70, 128
    q = fp4_act_quant_sim_ref((torch.randn(1, 2, 4, d, generator=g) * 2.0 ** -100).bfloat16(), 32).to(DEV)
    w = torch.randn(1, 2, 4, generator=g).bfloat16().to(DEV)
    x = torch.randn(1, N, d // 32, 32, generator=g)
    x = x * (2.0 ** torch.tensor([-125.0, -118.0, 0.0, 40.0, 114.0, 115.0, 118.0, 121.0, 123.0]))[
        torch.randint(0, 9, (1, N, d // 32, 1), generator=g)]
    k = fp4_act_quant_sim_ref(x.flatten(-2).bfloat16(), 32)
    kp = key_pack_ref(k)
    assert kp[..., d // 2:d // 2 + d // 32].min().item() == 1 and kp[..., d // 2:d // 2 + d // 32].max().item() >= 245
    assert torch.isfinite(k.float()).all()
    k, kp = k.to(DEV), kp.to(DEV)
    for op in (indexer_scores_ref, _fast_scores()):
        out = op(q, w, kp, True, 0.125)
        assert torch.isfinite(out.float()).all() and _same(out, op(q, w, k, True, 0.125)), op


@both_tiers
def test_triton_key_writer_rounds_as_the_reference():
    # store_packed_key (the compressor's Triton writer) against fp4_act_quant_ref's codes and scales: every e2m1
    # midpoint (ties to the even code), both signs, -0.0, blocks at the amax floor, and random rows at many scales
    if _write_keys is None:
        pytest.skip("Triton is not installed")
    g = torch.Generator().manual_seed(4)
    N = 128
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    ties = torch.cat((mids, -mids, mids * 0.5, -mids * 0.5)).reshape(1, 32)  # amax 6: scale 1
    x = torch.randn(16, N, generator=g) * (2.0 ** torch.randint(-60, 60, (16, 1), generator=g)).float()
    x[0, :32] = ties
    x[0, 32:64] = -0.0
    x[0, 64:96] = 0.0
    x[0, 96:100] = torch.tensor([1e-45, -1e-40, 0.0, -0.0])
    x = x.bfloat16().float()  # the writer sees the rotation rounded to bf16
    out = torch.zeros(16, key_row_bytes(N), dtype=torch.uint8, device=DEV)
    _write_keys[(16,)](x.to(DEV), out, N, key_row_bytes(N))
    assert torch.equal(out.cpu(), key_pack_parts(*fp4_act_quant_ref(x, 32)))


@pytest.mark.parametrize("backend", ["ref"] + ([pytest.param("fast", marks=pytest.mark.gpu)] if CUDA else []))
def test_model_with_packed_keys_equals_a_bf16_state(backend):
    # prefill chunks and decode steps past every compressor boundary: the same logits bit for bit, and the packed
    # keys hold the bf16 state's values; with both packings at once as well
    from dsv4 import ops

    raw, model = _tiny_model(7)
    cfg = model.cfg
    model = model.to(DEV)
    ids = torch.randint(0, raw["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(2)).to(DEV)
    ops.configure(backend, DEV)
    try:
        assert not model.new_state(8).keys_packed  # off by default
        for kw in (dict(keys_fp4=True), dict(keys_fp4=True, kv_fp8=True)):
            packed = model.new_state(40, **kw)
            assert packed.keys_packed and packed.blocks[0].indexer.entries.dtype == torch.uint8
            plain = ModelState(cfg, 1, 40, torch.bfloat16, DEV)
            with torch.no_grad():
                for a, b in ((0, 11), (11, 12), (12, 13), (13, 22), (22, 23), (23, 24), (24, 30)):
                    assert _same(model(ids[:, a:b], packed), model(ids[:, a:b], plain)), (kw, a, b)
            for bp, bb in zip(packed.blocks, plain.blocks):
                if bb.indexer is not None:
                    assert _same(key_unpack_ref(bp.indexer.entries, cfg.index_head_dim), bb.indexer.entries)
    finally:
        ops.configure("ref", "cpu")
