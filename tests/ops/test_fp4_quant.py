"""e2m1 rounding (RNE ties, saturation, sign) and fp4_act_quant_sim_ref (block scales, floor)."""

import pytest
import torch

from dsv4.ops.fp4_quant import E2M1_LUT, e2m1_encode_ref, e2m1_round_ref, fp4_act_quant_sim_ref

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_lut():
    assert E2M1_LUT.dtype == torch.float32
    assert E2M1_LUT.tolist() == GRID + [-v for v in GRID]
    assert torch.signbit(E2M1_LUT[8])  # code 8 is -0


def test_e2m1_round_hand_values():
    x = torch.tensor([0.25, 0.26, 0.74, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 7.0, 100.0])
    want = [0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]
    assert e2m1_round_ref(x).tolist() == want
    assert e2m1_round_ref(-x).tolist() == [-v for v in want]
    assert e2m1_round_ref(torch.tensor(GRID)).tolist() == GRID
    z = e2m1_round_ref(torch.tensor([0.0, -0.0, -0.1]))
    assert z.tolist() == [0.0, 0.0, 0.0] and torch.signbit(z).tolist() == [False, True, True]
    codes = e2m1_encode_ref(torch.tensor([0.0, 0.5, 6.0, -0.5, -6.0]))
    assert codes.dtype == torch.uint8 and codes.tolist() == [0, 1, 7, 9, 15]


def test_e2m1_round_is_nearest_even_bruteforce():
    g = torch.Generator().manual_seed(0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.empty(3000).uniform_(-7, 7, generator=g), mids, -mids])
    grid = torch.tensor(GRID)
    got = e2m1_round_ref(x)
    for v, r in zip(x.tolist(), got.tolist(), strict=True):
        d = (grid - min(abs(v), 6.0)).abs()
        best = [i for i in range(8) if d[i] == d.min()]
        i = best[0] if len(best) == 1 else next(i for i in best if i % 2 == 0)  # tie -> even
        assert r == (GRID[i] if v >= 0 else -GRID[i]), v


def _block(entries, fill=0.0):
    b = torch.full((32,), fill)
    for i, v in entries.items():
        b[i] = v
    return b


def test_sim_hand_values():
    x = torch.stack(
        [
            _block({0: 6.0, 1: 5.0, 2: 2.5, 3: -3.5, 4: 0.25, 5: 0.3, 6: -0.0}),  # amax 6 -> s = 1
            _block({0: 12.0, 1: 5.0, 2: -1.1}),  # amax 12 -> s = 2: 5 -> 2.5 -> 2 -> 4
            _block({0: 7.0, 1: 1.0}),  # 7/6 -> s = 2: 7 -> 3.5 -> 4 -> 8 (rounds above amax)
            _block({0: 3.0, 1: 0.7}),  # 3/6 = 0.5 exactly -> s = 0.5: 0.7 -> 1.4 -> 1.5 -> 0.75
            _block({}),  # all zero -> floor 6*2^-126 -> s = 2^-126 -> zeros
            _block({0: 1e-39}),  # subnormal amax -> floor -> 1e-39/2^-126 = 0.085 -> 0
            _block({0: -0.75, 1: 0.1}),  # amax 0.75 = 6*2^-3 -> s = 2^-3: 0.1 -> 0.8 -> 1 -> 0.125
        ]
    )[None].flatten(1)  # [1, 7*32]
    y = fp4_act_quant_sim_ref(x).view(7, 32)
    assert y[0, :7].tolist() == [6.0, 4.0, 2.0, -4.0, 0.0, 0.5, 0.0] and torch.signbit(y[0, 6])
    assert y[1, :3].tolist() == [12.0, 4.0, -1.0]
    assert y[2, :2].tolist() == [8.0, 1.0]
    assert y[3, :2].tolist() == [3.0, 0.75]
    assert not y[4].any() and not y[5].any()
    assert y[6, :2].tolist() == [-0.75, 0.125]
    assert y[:, 7:].eq(0).all()
    assert torch.equal(fp4_act_quant_sim_ref(-x), -fp4_act_quant_sim_ref(x))


def test_sim_random_properties():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 128, generator=g).to(torch.bfloat16)
    y = fp4_act_quant_sim_ref(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y, fp4_act_quant_sim_ref(x.float()).to(torch.bfloat16))
    xb, yb = x.float().view(4, 5, 4, 32), y.float().view(4, 5, 4, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(amax / 6)))  # safe here: no exact powers of two hit
    assert torch.equal(e2m1_round_ref(yb / s) * s, yb)  # every output is on the scaled grid
    assert ((yb - xb).abs() <= torch.maximum(0.25 * s, 0.2 * xb.abs()) + 1e-12).all()
    assert torch.equal(fp4_act_quant_sim_ref(y), y)  # idempotent


def test_bad_block_raises():
    with pytest.raises(ValueError, match=r"\(2, 48\).*block_size=32"):
        fp4_act_quant_sim_ref(torch.zeros(2, 48))
