"""Packed FP8 K = V rows (dsv4/ops/kv_pack.py): the format, every reader (sparse_attn: reference, Triton, CUDA) and
every writer (qkv_norm_rope's ring / chunk rows, the compressor's entries: reference and Triton, also its packed FP4
indexer keys, whose format and readers tests/ops/test_key_pack.py covers) against the bf16 rows they stand for, bit
for bit; and a whole model whose state is packed against the same model on a bf16 state.
Interpreted on the CPU at small widths; Flash widths (and the CUDA decode kernel) on a GPU."""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model.layers import Numerics, Rope
from dsv4.model.transformer import Transformer
from dsv4.ops.act_quant import act_quant_sim_ref
from dsv4.ops.compressor import compressor_ref
from dsv4.ops.kv_pack import key_row_bytes, key_unpack_ref, kv_pack_ref, kv_row_bytes, kv_unpack_ref, packed_row_dim
from dsv4.ops.rope import qkv_norm_rope_ref
from dsv4.ops.sparse_attn import sparse_attn_ref
from dsv4.state import CompressorState, ModelState
from dsv4.testing import assert_close_rel, randomize_, tiny_config

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
both_tiers = pytest.mark.gpu if CUDA else (lambda f: f)
WIDTHS = [128] + ([512] if CUDA else [])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _sim_rows(shape, D, g, scale=1.0):
    """bf16 K = V rows as the FP8 simulation leaves them: the first D - 64 dims on the e4m3 grid (blocks of 64)."""
    x = torch.randn(*shape, D, generator=g) * scale
    return torch.cat((act_quant_sim_ref(x[..., :D - 64].bfloat16(), 64), x[..., D - 64:].bfloat16()), -1)


def test_row_bytes_and_refusals():
    assert kv_row_bytes(512) == 592  # 448 codes + 128 bytes of RoPE dims + 7 scales, to 16
    assert kv_row_bytes(128) == 208
    assert [packed_row_dim(kv_row_bytes(d)) for d in (128, 192, 512, 1024)] == [128, 192, 512, 1024]
    with pytest.raises(ValueError, match="no packed row is 600 bytes"):
        packed_row_dim(600)
    for dim in (64, 100, 96):
        with pytest.raises(ValueError, match="positive multiple of 64"):
            kv_row_bytes(dim)
    with pytest.raises(ValueError, match="must be bf16"):
        kv_pack_ref(torch.zeros(2, 128))
    with pytest.raises(ValueError, match=r"want packed rows \[..., 208\]"):
        kv_unpack_ref(torch.zeros(2, 592, dtype=torch.uint8), 128)


def test_pack_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    v = _sim_rows((6, 5), 512, g, 3.0)
    v[0, 0, :64] = 0  # an all-zero block
    v[0, 1, :64] = act_quant_sim_ref(v[0, 1, :64].float() * 1e-6, 64).bfloat16()  # amax below the 1e-4 floor
    v[1, 0, 5] = -0.0
    v[1, 1, :64] = 0
    v[1, 1, 0] = 224.0  # the block's largest code is 224: its scale halves on re-quantization, the values stay
    p = kv_pack_ref(v)
    assert p.dtype == torch.uint8 and p.shape == (6, 5, 592)
    assert _same(kv_unpack_ref(p, 512), v)
    assert not p[..., 583:].any()  # the padding is zero
    assert _same(kv_unpack_ref(torch.zeros(3, 592, dtype=torch.uint8), 512), torch.zeros(3, 512, dtype=torch.bfloat16))


def _attn_case(D, B, S, H, Nw, Nc, Lw, Lc, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).bfloat16()
    kw, kc = _sim_rows((B, Nw), D, g), _sim_rows((B, Nc), D, g)
    iw = torch.randint(-1, Nw, (B, S, Lw), generator=g, dtype=torch.int32)
    ic = torch.randint(-1, Nc, (B, S, Lc), generator=g, dtype=torch.int32)
    ic[0, 0, : min(Lc, 70)] = -1  # a run of empty slots (a whole block where Lc is long)
    sink = torch.randn(H, generator=g)
    cos, sin = torch.rand(S, 32, generator=g), torch.rand(S, 32, generator=g)
    return [t.to(DEV) for t in (q, kw, iw, kc, ic, sink, cos, sin)]


ATTN_CASES = [(128, 2, 1, 16, 16, 9, 16, 8), (128, 2, 3, 16, 16, 20, 16, 24), (128, 1, 2, 16, 8, 70, 8, 72),
              (256, 1, 2, 16, 8, 40, 8, 40),  # (column chunks of 32, and of 64 at D = 256)
              (192, 1, 2, 16, 8, 40, 8, 40)]  # (a 256-wide tile overhanging the row: its last chunk reads nothing)
ATTN_GPU = [(512, 1, 1, 64, 128, 300, 128, 512), (512, 1, 1, 64, 128, 1100, 128, 1024), (512, 2, 4, 64, 136, 40, 136, 0),
            (512, 1, 128, 64, 256, 600, 256, 512)]


def _nan_padded(p: torch.Tensor) -> torch.Tensor:
    """Packed rows p [B, N, RB] as a view into rows of RB + 64 bytes whose tails are 0xFF (NaN as bf16): a reader
    that reads past a row's bytes gets NaN into its result."""
    big = torch.full((*p.shape[:-1], p.shape[-1] + 64), 0xFF, dtype=torch.uint8, device=p.device)
    big[..., :p.shape[-1]] = p
    return big[..., :p.shape[-1]]


@pytest.mark.parametrize("case", ATTN_CASES + (ATTN_GPU if CUDA else []))
@both_tiers
def test_sparse_attn_reads_packed_rows_as_their_values(case):
    from dsv4.ops import sparse_attn_triton

    D, B, S, H, Nw, Nc, Lw, Lc = case
    q, kw, iw, kc, ic, sink, cos, sin = _attn_case(D, B, S, H, Nw, Nc, Lw, Lc, seed=sum(case))
    if Lc == 0:
        kc = ic = None
    pw, pc = _nan_padded(kv_pack_ref(kw)), (_nan_padded(kv_pack_ref(kc)) if kc is not None else None)
    args = (sink, 0.0625, cos, sin)
    ref = sparse_attn_ref(q, pw, iw, pc, ic, *args)
    assert _same(ref, sparse_attn_ref(q, kw, iw, kc, ic, *args))
    fast = sparse_attn_triton.sparse_attn(q, pw, iw, pc, ic, *args)
    if q.is_cuda:  # compiled, the dots of the two forms may be scheduled apart: fp32 summation order (the op's bound)
        assert_close_rel(fast, ref, "op_attention")
    else:  # interpreted: the same values in the same order
        assert _same(fast, sparse_attn_triton.sparse_attn(q, kw, iw, kc, ic, *args))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA")
@pytest.mark.parametrize("case", [(512, 1, 1, 64, 128, 300, 128, 512), (512, 1, 1, 64, 128, 1100, 128, 1024),
                                  (512, 2, 2, 64, 136, 40, 136, 300), (512, 1, 1, 16, 128, 0, 37, 0),
                                  (512, 1, 4, 128, 128, 2000, 128, 1400), (512, 1, 2, 64, 128, 5000, 128, 4100)])
def test_cuda_decode_attention_reads_packed_rows_as_their_values(case):
    from dsv4.ops import sparse_attn_cuda

    D, B, S, H, Nw, Nc, Lw, Lc = case
    q, kw, iw, kc, ic, sink, cos, sin = _attn_case(D, B, S, H, Nw, max(Nc, 1), Lw, Lc, seed=sum(case))
    if Lc == 0:
        kc = ic = None
    pw, pc = kv_pack_ref(kw), (kv_pack_ref(kc) if kc is not None else None)
    assert sparse_attn_cuda.applies(q, pw, iw, pc, ic, sink, cos, sin)
    assert not sparse_attn_cuda.applies(q, pw, iw, kc, ic, sink, cos, sin) or kc is None  # mixed kinds: refused
    args = (sink, 0.0625, cos, sin)
    fast = sparse_attn_cuda.sparse_attn(q, pw, iw, pc, ic, *args)
    assert _same(fast, sparse_attn_cuda.sparse_attn(q, kw, iw, kc, ic, *args))
    ref = sparse_attn_ref(q, pw, iw, pc, ic, *args)
    assert (fast.float() - ref.float()).abs().max().item() <= 2e-2 * ref.float().abs().max().item()


@pytest.mark.parametrize("D", WIDTHS)
@both_tiers
def test_kv_writers_store_the_simulations_codes(D):
    from dsv4.ops.norm_rope_triton import qkv_norm_rope

    g = torch.Generator().manual_seed(D)
    B, S, H = 2, 5, 4
    q = torch.randn(B, S, H, D, generator=g).bfloat16().to(DEV)
    kv = (torch.randn(B, S, D, generator=g) * 2).bfloat16().to(DEV)
    w = (torch.rand(D, generator=g) + 0.5).bfloat16().to(DEV)
    cos, sin = torch.rand(S, 32, generator=g).to(DEV), torch.rand(S, 32, generator=g).to(DEV)
    args = (q, kv, w, 1e-6, cos, sin, True, D - 64)
    _, plain = qkv_norm_rope_ref(*args)
    _, packed = qkv_norm_rope_ref(*args, pack=True)
    _, fast = qkv_norm_rope(*args, pack=True)
    assert _same(kv_unpack_ref(packed, D), plain)  # the same values as the simulation's bf16 rows
    assert torch.equal(fast, packed)  # Triton writes the reference's bytes
    slots = torch.tensor([7, 1, 2, 0, 5], device=DEV)
    rings = [torch.zeros(B, 8, kv_row_bytes(D), dtype=torch.uint8, device=DEV) for _ in range(2)]
    qkv_norm_rope_ref(*args, rings[0], slots)
    qkv_norm_rope(*args, rings[1], slots)
    assert torch.equal(rings[0], rings[1]) and torch.equal(rings[0][:, slots], packed)
    assert not rings[0][:, [3, 4, 6]].any()  # other slots untouched
    with pytest.raises(ValueError, match="packed rows need bf16 kv"):
        qkv_norm_rope(q, kv, w, 1e-6, cos, sin, True, D - 128, pack=True)


@pytest.mark.parametrize("ratio,overlap,D,chunks,quant", [(4, True, 128, [1, 1, 1, 6, 1, 9, 3], "fp8"),
                                                          (8, False, 128, [5, 1, 13, 1, 1, 20], "fp8"),
                                                          (4, True, 64, [1, 1, 1, 6, 1, 9, 3], "fp4")]
                         + ([(4, True, 512, [128, 1, 1, 37], "fp8"), (128, False, 512, [100, 1, 60, 1], "fp8"),
                             (4, True, 128, [128, 1, 1, 37, 1, 1, 1], "fp4")] if CUDA else []))
@both_tiers
def test_compressor_entries_packed(ratio, overlap, D, chunks, quant):
    # decode steps (S = 1) and prefill chunks, reference and Triton: the packed entries (FP8 K = V rows, or the
    # indexer's FP4 keys) hold exactly the values of the same backend's bf16 entries (the state beside them bit for bit)
    from dsv4.ops.compressor_triton import compressor as fast

    kind, width, unpack = (("kv", kv_row_bytes, kv_unpack_ref) if quant == "fp8" else
                           ("key", key_row_bytes, key_unpack_ref))
    g = torch.Generator().manual_seed(ratio + D)
    C = (2 if overlap else 1) * D
    rope = Rope(64 if D >= 128 else 32, 160000.0, None, 4096, DEV)
    ape = (torch.randn(ratio, C, generator=g) * 0.5).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).to(DEV)
    n = sum(chunks) + ratio
    for op in (compressor_ref, fast):
        plain = CompressorState(1, ratio, D, overlap, n, torch.bfloat16, DEV)
        packed = CompressorState(1, ratio, D, overlap, n, torch.bfloat16, DEV, packed=kind)
        assert packed.entries.dtype == torch.uint8 and packed.entries.shape[-1] == width(D)
        p = 0
        for S in chunks:
            c, gg = torch.randn(1, S, C, generator=g).to(DEV), torch.randn(1, S, C, generator=g).to(DEV)
            start = torch.tensor([p], device=DEV)
            for st in (plain, packed):
                op(c, gg, ape, norm_w, 1e-6, rope.cos, rope.sin, st.kv, st.score, st.entries, start, ratio, overlap,
                   quant)
            p += S
            assert torch.equal(plain.kv, packed.kv) and torch.equal(plain.score, packed.score)
            assert _same(unpack(packed.entries, D), plain.entries), (op, p)
        assert packed.entries[0, : p // ratio].any(-1).all()


def _tiny_model(seed):
    raw = tiny_config([4, 0, 8], index_topk=3, window=8, max_pos=64, hidden=256, head_dim=128, rope_dim=64,
                      index_dim=64, n_mtp=0,
                      quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                               scale_fmt="ue8m0", weight_block_size=[128, 128]))
    model = Transformer(ModelConfig.from_dict(raw), Numerics("reference", torch.bfloat16))
    return raw, randomize_(model, seed).eval()


def test_model_on_a_packed_state_equals_a_bf16_state():
    # prefill chunks and decode steps past every compressor boundary and the window: the same logits bit for bit,
    # and the packed state holds the bf16 state's values
    raw, model = _tiny_model(5)
    cfg = model.cfg
    assert not model.new_state(8).kv_packed  # off by default
    packed = model.new_state(40, kv_fp8=True)
    assert packed.kv_packed and packed.blocks[0].window.dtype == torch.uint8
    plain = ModelState(cfg, 1, 40, torch.bfloat16, "cpu")
    ids = torch.randint(0, raw["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for a, b in ((0, 11), (11, 12), (12, 13), (13, 22), (22, 23), (23, 24), (24, 30)):
            lp, lb = model(ids[:, a:b], packed), model(ids[:, a:b], plain)
            assert _same(lp, lb), (a, b)
    for bp, bb in zip(packed.blocks, plain.blocks):
        assert _same(kv_unpack_ref(bp.window, cfg.head_dim), bb.window)
        if bb.compressor is not None:
            assert _same(kv_unpack_ref(bp.compressor.entries, cfg.head_dim), bb.compressor.entries)
        if bb.indexer is not None:
            assert _same(bp.indexer.entries, bb.indexer.entries)  # the indexer's keys are not packed


def test_exact_numerics_and_fp32_keep_a_plain_state():
    raw = tiny_config([4], index_topk=3, window=8, max_pos=64, hidden=256, head_dim=128, rope_dim=64, index_dim=64)
    for numerics in (Numerics("exact", torch.float32), Numerics("reference", torch.float32)):
        model = Transformer(ModelConfig.from_dict(raw), numerics)
        st = model.new_state(8)
        assert not st.kv_packed and st.blocks[0].window.dtype == torch.float32
        with pytest.raises(ValueError, match="an FP8 KV state needs reference numerics with bf16 activations"):
            model.new_state(8, kv_fp8=True)
