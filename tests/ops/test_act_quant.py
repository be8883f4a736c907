"""act_quant_ref / act_quant_sim_ref: hand-computed scales and e4m3 codes, plus an independent
per-block emulation (math.frexp for the scale) on random inputs."""

import math

import pytest
import torch

from dsv4.ops.act_quant import FP8_MAX_INV, act_quant_ref, act_quant_sim_ref, ue8m0_ceil_ref


def _blocks(*rows):
    """Each row: (fill value for the 128-block, {index: value}) -> fp32 [1, 128*len(rows)]."""
    out = []
    for fill, entries in rows:
        b = torch.full((128,), float(fill))
        for i, v in entries.items():
            b[i] = v
        out.append(b)
    return torch.cat(out)[None]


def test_scales_hand_values():
    x = _blocks(
        (0.0, {5: -448.0}),  # amax 448 -> 448 * fp32(1/448) rounds to 1.0 -> s = 1
        (0.0, {0: 449.0}),  # amax 449 -> s = 2
        (1e-6, {}),  # amax 1e-6 -> floor 1e-4 -> 2^ceil(log2(1e-4/448)) = 2^-22
        (0.0, {}),  # all zero -> floor as well
        (0.0, {3: 7.0}),  # 7/448 = 2^-6 exactly: exact powers of two are not rounded up
        (0.0, {3: 224.0}),  # 224/448 = 0.5
        (0.0, {0: torch.tensor(448.0).nextafter(torch.tensor(1e9)).item()}),  # +1 fp32 ulp -> 2
    )
    _, s = act_quant_ref(x)
    assert s.dtype == torch.float32 and s.shape == (1, 7)
    assert s[0].tolist() == [1.0, 2.0, 2.0**-22, 2.0**-22, 2.0**-6, 0.5, 2.0]


def test_codes_hand_values():
    x = _blocks(
        (0.0, {0: 448.0, 1: 1.0625, 2: 1.1875, 3: 432.0, 4: 2.0**-10, 5: 3 * 2.0**-10, 6: -3.3}),
        (0.0, {0: 449.0, 1: -449.0, 2: 3.0, 3: 1.0}),
    )
    q, s = act_quant_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 256)
    q = q.float()[0]
    # s = 1: RNE ties go to the even mantissa: 1.0625 -> 1, 1.1875 -> 1.25, 432 -> 448;
    # subnormals (step 2^-9): 2^-10 -> 0, 3*2^-10 -> 2^-8; -3.3 -> -3.25 (step 0.25).
    assert q[:7].tolist() == [448.0, 1.0, 1.25, 448.0, 0.0, 2.0**-8, -3.25]
    # s = 2: 449/2 = 224.5 -> 224 (step 16 in [128, 256)); 1/2 stays exact.
    assert q[128:132].tolist() == [224.0, -224.0, 1.5, 0.5]
    assert q.abs().max() <= 448


def test_sim_hand_values_and_dtype():
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    x[0, :2] = torch.tensor([1.0625, 3.0])  # amax 3 -> s = 2^-7; 1.0625*128 = 136 -> 128 (tie)
    x[1, 0] = 449.0  # bf16(449) = 448 -> s = 1 -> exact
    y = act_quant_sim_ref(x)
    assert y.dtype == torch.bfloat16
    assert y[0, :2].tolist() == [1.0, 3.0] and y[1, 0].item() == 448.0
    assert act_quant_sim_ref(x, out_dtype=torch.float32).dtype == torch.float32


def test_ue8m0_ceil_matches_frexp():
    g = torch.Generator().manual_seed(0)
    v = torch.exp2(torch.empty(4000).uniform_(-120, 120, generator=g))
    pow2 = torch.exp2(torch.arange(-126, 127, dtype=torch.float32))
    v = torch.cat([v, pow2, pow2 * (1 + 2.0**-23), pow2 * (1 - 2.0**-24)])
    got = ue8m0_ceil_ref(v)
    for a, b in zip(v.tolist(), got.tolist(), strict=True):
        m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1): ceil(log2 a) = e, or e-1 if m == 0.5
        assert b == 2.0 ** (e - 1 if m == 0.5 else e), a
    assert torch.isnan(ue8m0_ceil_ref(torch.tensor([0.0, -1.0, 1e-40]))).all()  # outside the domain
    with pytest.raises(ValueError):
        ue8m0_ceil_ref(torch.tensor([1.0], dtype=torch.float64))


def _emulate(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent loop emulation: float32 x [R, K] -> (q fp32, s fp32)."""
    q, s = torch.empty_like(x), torch.empty(x.shape[0], x.shape[1] // block)
    for r in range(x.shape[0]):
        for j in range(x.shape[1] // block):
            blk = x[r, j * block : (j + 1) * block]
            amax = max(blk.abs().max().item(), torch.tensor(1e-4).item())
            y = (torch.tensor(amax) * torch.tensor(FP8_MAX_INV)).item()  # fp32 product
            m, e = math.frexp(y)
            sc = 2.0 ** (e - 1 if m == 0.5 else e)
            s[r, j] = sc
            q[r, j * block : (j + 1) * block] = (blk / sc).to(torch.float8_e4m3fn).float()
    return q, s


@pytest.mark.parametrize("block", [128, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_matches_emulation(block, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 448 if block == 64 else 512, generator=g)
    x = x * torch.exp2(
        torch.randint(-30, 12, (6, x.shape[1] // block), generator=g)
    ).repeat_interleave(block, 1)
    x = x.to(dtype)
    q, s = act_quant_ref(x, block)
    q_ref, s_ref = _emulate(x.float(), block)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref)
    sim = act_quant_sim_ref(x, block)
    assert torch.equal(sim.float(), q_ref * s_ref.repeat_interleave(block, 1))
    assert torch.equal(act_quant_sim_ref(sim, block), sim)  # idempotent


def test_leading_dims_and_noncontiguous():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 8, 256, generator=g)[:, :, ::2]  # non-contiguous view [2,3,4,256]
    q, s = act_quant_ref(x)
    assert q.shape == (2, 3, 4, 256) and s.shape == (2, 3, 4, 2)
    q2, s2 = act_quant_ref(x.contiguous().reshape(24, 256))
    assert torch.equal(q.float().reshape(24, 256), q2.float()) and torch.equal(s.reshape(24, 2), s2)


def test_bad_block_raises():
    with pytest.raises(ValueError, match=r"\(3, 200\).*block_size=128"):
        act_quant_ref(torch.zeros(3, 200))
    with pytest.raises(ValueError, match="block_size=64"):
        act_quant_sim_ref(torch.zeros(100), 64)


def test_quant_act_rows_and_dequantize():
    # QuantAct: x as it is, codes and scales in [M, K] / [M, K / 128] rows; dequantize = act_quant_sim_ref bit for bit
    from dsv4.ops.act_quant import QuantAct, quant_act_ref

    x = (torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(5)) * 10).bfloat16()
    qa = quant_act_ref(x)
    assert isinstance(qa, QuantAct) and qa.x is x and qa.shape == x.shape and qa.dtype == x.dtype
    q, s = act_quant_ref(x)
    assert torch.equal(qa.q.view(torch.uint8), q.reshape(6, 256).view(torch.uint8)) and torch.equal(qa.s, s.reshape(6, 2))
    assert torch.equal(qa.dequantize(), act_quant_sim_ref(x, 128, out_dtype=torch.float32))
