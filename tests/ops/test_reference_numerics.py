"""The reference ops compute what DeepSeek's inference code computes (SPEC §2.3.5, §2.7, §2.2, §2.3.3).

Each behaviour is pinned by a case whose expected value is computed independently here (by hand or by
a literal loop over the SPEC formulas) and which the simpler, wrong arithmetic would fail:
- sparse attention walks the index list in 64-slot blocks with an online softmax, rounds P to bf16
  against the running max and accumulates P.V in fp32 (130 visible slots);
- the list order is part of the numerics (the same slots in another order give other bits);
- w1 / w3 / w2 outputs are rounded to bf16 inside an expert, and expert outputs are summed in fp32;
- the window index lists have the official layout at decode and in a first prompt chunk;
- the mHC mixes are the projection first, then the scaling; the YaRN blend is DeepSeek's expression.
"""

import math

import torch

from dsv4.config import YarnConfig
from dsv4.model.layers import StepPlan, rope_inv_freq
from dsv4.ops.indexer import topk_select_ref
from dsv4.ops.linear import PreparedLinear
from dsv4.ops.mhc import hc_mixes
from dsv4.ops.moe import expert_ref, moe_experts_ref
from dsv4.ops.sparse_attn import sparse_attn_ref


def _loop_attention(q, keys, sink, scale):
    """SPEC §2.3.5 literally, one query and head: q [D] bf16, keys [L, D] bf16 (all valid)."""
    m, z, acc = -math.inf, torch.tensor(0.0), torch.zeros(q.shape[0])
    for b0 in range(0, keys.shape[0], 64):
        blk = keys[b0:b0 + 64].float()
        s = (blk @ q.float()) * scale
        m_new = max(m, s.max().item())
        alpha = torch.exp(torch.tensor(m - m_new)) if m > -math.inf else torch.tensor(0.0)
        p = torch.exp(s - m_new)
        z = z * alpha + p.sum()
        acc = acc * alpha + p.to(torch.bfloat16).float() @ blk
        m = m_new
    z = z + torch.exp(torch.tensor(sink - m))
    return (acc / z).to(torch.bfloat16)


def _global_max_bf16_einsum(q, keys, sink, scale):
    """The arithmetic this replaced: one global max, P.V as a bf16 product, then the division."""
    s = (keys.float() @ q.float()) * scale
    m = s.max()
    p = torch.exp(s - m)
    z = p.sum() + torch.exp(torch.tensor(sink) - m)
    return ((p.to(torch.bfloat16) @ keys).float() / z).to(torch.bfloat16)


def test_attention_walks_130_slots_in_64_slot_blocks():
    g = torch.Generator().manual_seed(0)
    D, L = 64, 130
    q = torch.randn(D, generator=g).to(torch.bfloat16)
    keys = torch.randn(L, D, generator=g).to(torch.bfloat16)
    keys[129] = (q.float() * 0.6).to(torch.bfloat16)  # the max arrives in the last block: rescaling
    sink, scale = 0.3, D ** -0.5
    out = sparse_attn_ref(q.view(1, 1, 1, D), keys.view(1, L, D), torch.arange(L, dtype=torch.int32).view(1, 1, L),
                          None, None, torch.tensor([sink]), scale)[0, 0, 0]
    want = _loop_attention(q, keys, sink, scale)
    assert torch.equal(out, want)
    old = _global_max_bf16_einsum(q, keys, sink, scale)
    assert not torch.equal(want, old), "the case must tell the two arithmetics apart"


def test_attention_list_order_is_part_of_the_numerics():
    g = torch.Generator().manual_seed(1)
    D, L = 64, 200
    q = torch.randn(1, 1, 2, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(1, L, D, generator=g).to(torch.bfloat16)
    sink = torch.tensor([0.1, -0.2])
    idx = torch.arange(L, dtype=torch.int32).view(1, 1, L)
    a = sparse_attn_ref(q, kv, idx, None, None, sink, D ** -0.5)
    b = sparse_attn_ref(q, kv, idx.flip(-1), None, None, sink, D ** -0.5)
    assert not torch.equal(a, b)
    # the window / compressed split is only a layout: the same list in one part gives the same bits
    c = sparse_attn_ref(q, kv, idx[..., :100], kv, idx[..., 100:], sink, D ** -0.5)
    assert torch.equal(a, c)
    # -1 slots count for the block boundaries but contribute nothing
    pad = torch.cat((idx[..., :30], torch.full((1, 1, 34), -1, dtype=torch.int32), idx[..., 30:]), -1)
    d = sparse_attn_ref(q, kv, pad, None, None, sink, D ** -0.5)
    assert not torch.equal(a, d)
    assert torch.allclose(a.float(), d.float(), rtol=0.02, atol=0.02)


def test_attention_with_no_valid_slot_is_zero():
    q = torch.randn(1, 2, 3, 64).to(torch.bfloat16)
    kv = torch.randn(1, 5, 64).to(torch.bfloat16)
    out = sparse_attn_ref(q, kv, torch.full((1, 2, 70), -1, dtype=torch.int32), None, None,
                          torch.zeros(3), 0.125)
    assert torch.equal(out, torch.zeros_like(out))


def _dense(rows):
    w = torch.tensor(rows, dtype=torch.bfloat16)
    return PreparedLinear("dense", w.shape[0], w.shape[1], w)


def test_expert_rounds_gate_up_and_output_to_bf16():
    # x = [1, 2^-10]; w1 row [1, 1] -> gate 1 + 2^-10, which bf16 rounds to 1.0; w3 row [1, 0] -> up = 1
    # h = silu(1) * 1 = 0.7310586 -> bf16 0.73046875 (= 187/256) before w2
    # w2 = [[1], [3]] -> [187/256, 561/256]; 561/256 is not a bf16 value: rounds to 2.1875 (= 560/256)
    x = torch.tensor([[1.0, 2.0 ** -10]], dtype=torch.bfloat16)
    w1, w3, w2 = _dense([[1.0, 1.0]]), _dense([[1.0, 0.0]]), _dense([[1.0], [3.0]])
    out = expert_ref(x, w1, w2, w3, limit=10.0, act_quant=False)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.73046875, 2.1875]]
    unrounded = torch.nn.functional.silu(torch.tensor(1 + 2.0 ** -10)) * torch.tensor([1.0, 3.0])
    assert not torch.equal(out[0], unrounded)


def test_expert_outputs_are_summed_in_fp32_after_bf16_rounding():
    # two experts that each output 2.1875 (rounded from 561/256) for the second channel; the fp32 sum
    # keeps 4.375 exactly, then one cast to bf16
    x = torch.tensor([[1.0, 2.0 ** -10]], dtype=torch.bfloat16)

    def stack(rows):
        w = torch.stack([torch.tensor(rows, dtype=torch.bfloat16)] * 2)
        return PreparedLinear("dense", w.shape[1], w.shape[2], w)

    w1, w3, w2 = stack([[1.0, 1.0]]), stack([[1.0, 0.0]]), stack([[1.0], [3.0]])
    idx = torch.tensor([[1, 0]])
    weights = torch.ones(1, 2)
    y = moe_experts_ref(x, weights, idx, w1, w2, w3, None, 10.0, False)
    assert y.dtype == torch.bfloat16
    assert y.float().tolist() == [[1.4609375, 4.375]]  # 2 * 187/256 and 2 * 2.1875


def test_topk_order_is_descending_score_ties_to_lower_index():
    scores = torch.tensor([[[0.5, 2.0, 0.5, 3.0, 0.0, 9.0]]])
    idx = topk_select_ref(scores, torch.tensor([5]), 5)  # entry 5 is not visible yet
    assert idx.tolist() == [[[3, 1, 0, 2, 4]]]
    idx = topk_select_ref(scores, torch.tensor([2]), 4)
    assert idx.tolist() == [[[1, 0, -1, -1]]]


def _positions(plan: StepPlan, ring_pos):
    """Turn window rows back into positions: ring rows hold ring_pos[slot], chunk rows start + j."""
    W = plan.window
    rows = plan.win_idx.long()
    chunk = plan.start + rows - W
    ring = ring_pos[rows.clamp(0, W - 1)]
    return torch.where(rows < 0, -1, torch.where(rows >= W, chunk, ring))


def test_window_lists_have_the_official_layout():
    W = 128
    # decode at t < 127: [0..t, -1 ...] (128 slots); at t >= 127: oldest to newest; ring rows only (the
    # token's kv is in its slot before the attention)
    for t in (0, 5, 100, 126, 127, 128, 300):
        plan = StepPlan.build(torch.tensor([t]), 1, W, None)
        assert plan.ring_first and int(plan.win_idx.max()) < W
        ring_pos = torch.tensor([t - ((t - s) % W) for s in range(W)])  # slot -> its latest pos <= t
        got = _positions(plan, ring_pos)[0].tolist()
        want = list(range(t + 1)) + [-1] * (W - t - 1) if t < W - 1 else list(range(t - W + 1, t + 1))
        assert got == want, t
    # a first prompt chunk of S > 1 tokens: min(S, W) slots, row t = clamp(t-127, 0) + j, -1 past t
    # (a one-token prompt runs the decode step's 128 slots: [0, -1, ...], the same numerics as [0])
    for S in (2, 7, 128, 300):
        plan = StepPlan.build(torch.tensor([0]), S, W, 0)
        got = _positions(plan, torch.full((W,), -1))
        base = torch.arange(S)[:, None]
        want = (base - W + 1).clamp(min=0) + torch.arange(min(S, W))
        want = torch.where(want > base, -1, want)
        assert torch.equal(got, want), S


def test_mhc_mixes_project_first_then_scale():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, 4, 256, generator=g).to(torch.bfloat16)
    fn = torch.randn(24, 1024, generator=g) * 0.05
    xf = x.flatten(2).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(hc_mixes(x, fn, 1e-6), (xf @ fn.T) * r)


def test_yarn_blend_is_deepseeks_expression():
    yarn = YarnConfig(factor=16.0, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
    freqs = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    ramp = ((torch.arange(32, dtype=torch.float32) - 15) / (25 - 15)).clamp(0, 1)  # SPEC: low 15, high 25
    smooth = 1 - ramp
    want = freqs / 16.0 * (1 - smooth) + freqs * smooth
    assert torch.equal(rope_inv_freq(64, 160000.0, yarn), want)
