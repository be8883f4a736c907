"""Fast norm / RoPE ops (dsv4/ops/norm_rope_triton.py) against their references: interpreted on the CPU at
small shapes, Flash shapes on a GPU; both statistic precisions of the query's norm, the FP8 KV simulation on
and off, odd row counts, the inverse rotation, the attention prologue's ring insert."""

import pytest
import torch

from dsv4.model.layers import Rope
from dsv4.ops.act_quant import QuantAct, act_quant_sim_ref, quant_act_ref
from dsv4.ops.norm import rmsnorm_quant_ref, rmsnorm_ref
from dsv4.ops.rope import kv_norm_rope_ref, q_norm_rope_ref, qkv_norm_rope_ref, rope_ref
from dsv4.testing import assert_bitwise_equal, assert_close_rel

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# interpreted on the CPU (CI); on a GPU machine they run on CUDA and belong to the `-m gpu` suite
pytestmark = [pytest.mark.gpu] if CUDA else []


def _fast():
    try:
        from dsv4.ops import norm_rope_triton
    except ImportError:
        pytest.skip("Triton is not installed")
    return norm_rope_triton


def _case(B, S, H, D, rd, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    tab = Rope(rd, 160000.0, None, 4096, DEV)
    pos = torch.randint(0, 4096, (S,), generator=g).to(DEV)
    cos, sin = tab.at(pos)
    x = (torch.randn(B, S, H, D, generator=g) * 3).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).to(DEV)
    return x, w, cos, sin


# (1, 2, 2, 256, 64): kv's FP8 simulation over 3 blocks of 64 (a padded block count), as Flash's 7
SHAPES = [(1, 1, 4, 128, 64), (1, 5, 3, 96, 32), (2, 3, 2, 128, 16), (1, 2, 2, 256, 64)] if not CUDA else \
    [(1, 1, 64, 512, 64), (1, 4, 64, 512, 64), (1, 128, 64, 512, 64), (1, 37, 8, 128, 64)]


@pytest.mark.parametrize("B,S,H,D,rd", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_matches_reference(B, S, H, D, rd, dtype):
    fast = _fast()
    x, w, cos, sin = _case(B, S, H, D, rd, dtype, seed=S * D + H)
    name = "op_bf16_out" if dtype == torch.bfloat16 else "op_fp32_out"
    assert_close_rel(fast.rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), name)
    for inv in (False, True):
        assert_close_rel(fast.rope(x, cos, sin, inv), rope_ref(x, cos, sin, inv), name)
    kv = x[:, :, 0] * 2 + 1  # the attention's kv row: another row than any head of q
    nope = D - rd if (D - rd) % 64 == 0 else 0
    for low in (False, True):
        stat = "op_bf16_stat" if low and dtype == torch.bfloat16 else name
        for fp8 in sorted({0, nope}):
            q_out, kv_out = fast.qkv_norm_rope(x, kv, w, 1e-6, cos, sin, low, fp8)
            assert_close_rel(q_out, q_norm_rope_ref(x, cos, sin, 1e-6, low), stat)
            assert_close_rel(kv_out, kv_norm_rope_ref(kv, w, 1e-6, cos, sin, fp8), name)
            ref_q, ref_kv = qkv_norm_rope_ref(x, kv, w, 1e-6, cos, sin, low, fp8)
            assert_close_rel(q_out, ref_q, stat)
            assert_close_rel(kv_out, ref_kv, name)


def test_eps_counts():
    """eps large enough to move every norm far past its tolerance (x of RMS ~1, eps 0.5): the fast rmsnorm,
    rmsnorm_quant and qkv_norm_rope (the queries' statistic in both precisions, kv's norm plain, FP8-simulated and
    packed) add it where their references do."""
    from dsv4.ops.kv_pack import kv_unpack_ref
    from dsv4.testing import TOLERANCES

    fast = _fast()
    x, w, cos, sin = _case(1, 3, 2, 128, 64, torch.bfloat16, seed=5)
    x = x / 3
    kv = x[:, :, 0] + 0.5
    eps = 0.5

    def check(got, ref, name):  # ref(eps) within tolerance, ref(-eps) far outside it
        want, other = ref(eps).float(), ref(-eps).float()
        tol = TOLERANCES[name][0] * float(want.abs().max())
        assert float((want - other).abs().max()) > 20 * tol
        assert_close_rel(got, want.to(got.dtype), name)

    check(fast.rmsnorm(x, w, eps), lambda e: rmsnorm_ref(x, w, e), "op_bf16_out")
    check(fast.rmsnorm_quant(x[0, :, 0], w, eps).x, lambda e: rmsnorm_ref(x[0, :, 0], w, e), "op_bf16_out")
    for low in (False, True):
        for fp8 in (0, 64):
            q_out, kv_out = fast.qkv_norm_rope(x, kv, w, eps, cos, sin, low, fp8)
            check(q_out, lambda e: q_norm_rope_ref(x, cos, sin, e, low), "op_bf16_stat" if low else "op_bf16_out")
            check(kv_out, lambda e: kv_norm_rope_ref(kv, w, e, cos, sin, fp8), "op_bf16_out")
    _, packed = fast.qkv_norm_rope(x, kv, w, eps, cos, sin, True, 64, pack=True)
    check(kv_unpack_ref(packed, 128), lambda e: kv_norm_rope_ref(kv, w, e, cos, sin, 64), "op_bf16_out")


def test_qkv_norm_rope_other_kv_width():
    # the query's and kv's rows of different widths in one launch (the kv row's block is its own power of two)
    fast = _fast()
    x, w, cos, sin = _case(1, 3, 4, 128, 32, torch.bfloat16, seed=11)
    kv = torch.randn(1, 3, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEV)
    w96 = w[:96].contiguous()
    q_out, kv_out = fast.qkv_norm_rope(x, kv, w96, 1e-6, cos, sin, True, 64)
    assert_close_rel(q_out, q_norm_rope_ref(x, cos, sin, 1e-6, True), "op_bf16_stat")
    assert_close_rel(kv_out, kv_norm_rope_ref(kv, w96, 1e-6, cos, sin, 64), "op_bf16_out")
    with pytest.raises(ValueError, match="q must be"):
        fast.qkv_norm_rope(x, kv[:, :2], w96, 1e-6, cos, sin, True, 64)
    with pytest.raises(ValueError, match="fp8_nope"):
        fast.qkv_norm_rope(x, kv, w96, 1e-6, cos, sin, True, 32)


@pytest.mark.parametrize("B,S,W", [(1, 1, 128), (2, 1, 16), (1, 3, 8)])
def test_kv_norm_rope_into_the_ring(B, S, W):
    # the decode step's window insert in the same launch: row s lands in ring[:, slots[s]], bit for bit the rows
    # the op returns without a ring; every other slot untouched; the query's rows as without a ring; the reference
    # does the same through index_copy_
    fast = _fast()
    x, w, cos, sin = _case(B, S, 2, 128, 64, torch.bfloat16, seed=B + S + W)
    kv = x[:, :, 0]
    slots = torch.randperm(W, generator=torch.Generator().manual_seed(W))[:S].to(DEV)
    for fp8 in (0, 64):
        q_rows, rows = fast.qkv_norm_rope(x, kv, w, 1e-6, cos, sin, True, fp8)
        ring = torch.randn(B, W, 128, generator=torch.Generator().manual_seed(fp8)).to(torch.bfloat16).to(DEV)
        want = ring.clone()
        want[:, slots] = rows
        q_out, none = fast.qkv_norm_rope(x, kv, w, 1e-6, cos, sin, True, fp8, ring, slots)
        assert none is None
        assert torch.equal(ring, want), "ring rows"
        assert torch.equal(q_out, q_rows), "query rows"
        ref_ring = ring.clone()
        assert qkv_norm_rope_ref(x, kv, w, 1e-6, cos, sin, True, fp8, ref_ring, slots.long())[1] is None
        assert_close_rel(ring, ref_ring, "op_bf16_out")
    with pytest.raises(ValueError, match="ring and slots come together"):
        fast.qkv_norm_rope(x, kv, w, 1e-6, cos, sin, True, 0, ring, None)
    with pytest.raises(ValueError, match="ring must be"):
        fast.qkv_norm_rope(x, kv, w, 1e-6, cos, sin, True, 0, ring.float(), slots)


@pytest.mark.parametrize("M,D", [(1, 1024), (5, 1024), (3, 1536), (4, 128)] if not CUDA else
                         [(1, 1024), (128, 1024), (37, 1536), (4, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_quant(M, D, dtype):
    # the norm as fast.rmsnorm (bit for bit) and within op_*_out of the reference; its codes and scales exactly
    # act_quant_ref of the rounded norm it wrote, a negative value that quantizes to zero included (-0, as the cast)
    fast = _fast()
    g = torch.Generator().manual_seed(M * D)
    x = (torch.randn(M, D, generator=g) * 3).to(dtype)
    x[0, 5] = -1e-7 * float(x[0].abs().max())  # rounds to -0 in its block
    x, w = x.to(DEV), (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).to(DEV)
    got = fast.rmsnorm_quant(x, w, 1e-6)
    ref = rmsnorm_quant_ref(x, w, 1e-6)
    assert isinstance(got, QuantAct) and got.q.shape == (M, D) and got.s.shape == (M, D // 128)
    assert_bitwise_equal(got.x, fast.rmsnorm(x, w, 1e-6), "norm")
    assert_close_rel(got.x, ref.x, "op_bf16_out" if dtype == torch.bfloat16 else "op_fp32_out")
    own = quant_act_ref(got.x)
    assert_bitwise_equal(got.q.view(torch.uint8), own.q.view(torch.uint8), "codes")
    assert_bitwise_equal(got.s, own.s, "scales")
    assert bool(got.q[0, 5].view(torch.uint8) == 0x80) or got.x[0, 5] == 0  # -0 where the norm kept the sign
    assert_bitwise_equal(got.dequantize(), act_quant_sim_ref(got.x, 128, out_dtype=torch.float32), "dequantize")
    with pytest.raises(ValueError, match="multiple of 128"):
        fast.rmsnorm_quant(x[:, :64], w[:64], 1e-6)
    with pytest.raises(ValueError, match="multiple of 128"):
        rmsnorm_quant_ref(x[:, :64], w[:64], 1e-6)
