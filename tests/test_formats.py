"""dsv4.formats: E8M0 helpers, hand-built dequantization (nibble order, scale bytes), quantize
error bounds, bit-exact safetensors round trips, matmul_ref numerics and validation errors."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4.formats import (
    FORMATS,
    DenseWeight,
    Fp8BlockWeight,
    Mxfp4Weight,
    Nvfp4Weight,
    check_shared_global_scale,
    e8m0_to_float,
    float_to_e8m0,
    nvfp4_quantize_pair,
    weight_from_tensors,
)
from dsv4.ops.act_quant import act_quant_ref
from dsv4.ops.fp4_quant import E2M1_LUT

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e8m0(byte_list) -> torch.Tensor:
    return torch.tensor(byte_list, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- E8M0 helpers ---------------------------------------------------------------------------


def test_e8m0_to_float_bytes():
    f = e8m0_to_float(_e8m0([0, 1, 126, 127, 128, 254, 255]))
    assert f.dtype == torch.float32
    assert f[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127] and f[6].isnan()
    assert torch.equal(e8m0_to_float(torch.tensor([127], dtype=torch.uint8)), torch.tensor([1.0]))


def test_float_to_e8m0_round_trip_and_errors():
    b = _e8m0(list(range(255)))
    assert torch.equal(_bytes(float_to_e8m0(e8m0_to_float(b))), _bytes(b))
    assert float_to_e8m0(torch.tensor([1.0, 2.0])).dtype == torch.float8_e8m0fnu
    for bad in (3.0, 0.0, -2.0, float("inf"), 2.0**-128):
        with pytest.raises(ValueError, match="powers of two"):
            float_to_e8m0(torch.tensor([bad]))


# ---- safetensors ----------------------------------------------------------------------------


def _header(path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def test_safetensors_supports_fp8_dtypes(tmp_path):
    t = {"s": _e8m0([0, 127, 128, 254]), "w": torch.tensor([1.0, -448.0]).to(torch.float8_e4m3fn)}
    save_file(t, tmp_path / "x.safetensors")
    h = _header(tmp_path / "x.safetensors")
    assert h["s"]["dtype"] == "F8_E8M0" and h["w"]["dtype"] == "F8_E4M3"
    back = load_file(tmp_path / "x.safetensors")
    for k in t:
        assert back[k].dtype == t[k].dtype and torch.equal(_bytes(back[k]), _bytes(t[k]))


CASES = [
    (DenseWeight, {"dtype": torch.bfloat16}, (130, 256)),
    (DenseWeight, {"dtype": torch.float32}, (3, 4)),
    (Fp8BlockWeight, {"scale_dtype": "e8m0"}, (200, 320)),  # partial edge blocks
    (Fp8BlockWeight, {"scale_dtype": "f32"}, (128, 256)),
    (Mxfp4Weight, {}, (48, 256)),
    (Nvfp4Weight, {"input_amax": 3.5}, (40, 96)),
]


@pytest.mark.parametrize("cls,opts,shape", CASES)
def test_quantize_save_load_bit_exact(cls, opts, shape, tmp_path):
    w = _randn(*shape, seed=sum(shape)) * 0.02
    q = cls.quantize(w, **opts)
    assert q.shape == shape and cls.FORMAT in FORMATS and FORMATS[cls.FORMAT] is cls
    layout_opts = {k: v for k, v in opts.items() if k in ("dtype", "scale_dtype")}
    layout = cls.layout(*shape, **layout_opts)
    assert {k: (tuple(t.shape), t.dtype) for k, t in q.tensors().items()} == layout
    prefix = "layers.0.ffn.experts.7.w1."
    save_file({prefix + k: t for k, t in q.tensors().items()}, tmp_path / "w.safetensors")
    via_load = {k[len(prefix) :]: t for k, t in load_file(tmp_path / "w.safetensors").items()}
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        via_open = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys()}
    for d in (via_load, via_open):
        r = weight_from_tensors(cls.FORMAT, d)
        assert type(r) is cls and r.shape == shape
        for k, t in q.tensors().items():
            got = r.tensors()[k]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(_bytes(got), _bytes(t)), k
        assert torch.equal(r.dequantize(), q.dequantize())


# ---- hand-built dequantization --------------------------------------------------------------


def test_fp8_dequant_by_hand():
    w = torch.tensor([[1.0, -0.5, 448.0], [0.0625, 2.0**-9, -3.0]]).to(torch.float8_e4m3fn)
    q = Fp8BlockWeight(w, _e8m0([[128]]))  # 2^(128-127) = 2
    assert q.dequantize().tolist() == [[2.0, -1.0, 896.0], [0.125, 2.0**-8, -6.0]]
    q = Fp8BlockWeight(w, torch.tensor([[0.3]]))  # fp32 ("Base"-style) scale, any value
    torch.testing.assert_close(q.dequantize(), w.float() * 0.3, rtol=0, atol=0)
    # 130 x 129 -> 2 x 2 blocks, the last ones partial: bytes 127,128 / 126,129 -> 1,2 / .5,4
    ones = torch.ones(130, 129).to(torch.float8_e4m3fn)
    d = Fp8BlockWeight(ones, _e8m0([[127, 128], [126, 129]])).dequantize(torch.bfloat16)
    assert d.dtype == torch.bfloat16
    assert (d[:128, :128] == 1).all() and (d[:128, 128:] == 2).all()
    assert (d[128:, :128] == 0.5).all() and (d[128:, 128:] == 4).all()


def test_mxfp4_dequant_by_hand_low_nibble_is_even():
    # N=2, K=64 -> weight [2, 32] bytes, scale [2, 2]
    wb = torch.zeros(2, 32, dtype=torch.uint8)
    wb[0, 0] = 0x2F  # low nibble F -> -6 (element 0), high nibble 2 -> 1.0 (element 1)
    wb[0, 16] = 0x97  # element 32 = LUT[7] = 6, element 33 = LUT[9] = -0.5 (second block)
    wb[1, 0] = 0x07  # element 0 = 6, element 1 = 0
    wb[1, 31] = 0xB3  # element 62 = 1.5, element 63 = LUT[11] = -1.5
    q = Mxfp4Weight(wb.view(torch.int8), _e8m0([[127, 128], [126, 0]]))
    want = torch.zeros(2, 64)
    want[0, :2] = torch.tensor([-6.0, 1.0])
    want[0, 32:34] = torch.tensor([12.0, -1.0])  # x 2^(128-127)
    want[1, 0] = 3.0  # 6 x 2^-1
    want[1, 62:] = torch.tensor([1.5, -1.5]) * 2.0**-127  # byte 0 -> 2^-127
    assert torch.equal(q.dequantize(), want)


def test_nvfp4_dequant_by_hand():
    wb = torch.zeros(1, 16, dtype=torch.uint8)
    wb[0, 0] = 0x5A  # element 0 = LUT[10] = -1, element 1 = LUT[5] = 3
    wb[0, 8] = 0x71  # element 16 = 0.5, element 17 = 6
    ws = torch.tensor([[2.0, 0.75]]).to(torch.float8_e4m3fn)
    q = Nvfp4Weight(wb, ws, torch.tensor(0.5), torch.tensor(1.0 / 2688))
    want = torch.zeros(1, 32)
    want[0, :2] = torch.tensor([-1.0, 3.0]) * 2.0 * 0.5
    want[0, 16:18] = torch.tensor([0.5, 6.0]) * 0.75 * 0.5
    assert torch.equal(q.dequantize(), want)


def test_dequantize_reads_storage_not_a_cache():
    q = Mxfp4Weight.quantize(_randn(4, 64))
    before = q.dequantize()
    q.weight.view(torch.uint8)[0, 0] ^= 0x08  # flip the sign bit of element 0
    after = q.dequantize()
    assert after[0, 0] == -before[0, 0] and torch.equal(after[1:], before[1:])


# ---- quantize accuracy ----------------------------------------------------------------------


def test_fp8_quantize_error_bound():
    # Per-128-block magnitudes spread over 2^-20..2^10 to exercise many scales.
    w = _randn(256, 384, seed=1) * torch.exp2(torch.randint(-20, 10, (2, 3))).repeat_interleave(
        128, 0
    ).repeat_interleave(128, 1)
    q = Fp8BlockWeight.quantize(w)
    s = e8m0_to_float(q.scale).repeat_interleave(128, 0).repeat_interleave(128, 1)
    amax = w.abs().view(2, 128, 3, 128).amax((1, 3)).clamp_min(1e-4)  # the quantizer's floor
    amax = amax.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert (s >= amax / 448).all() and (s < amax / 224).all()  # tightest power of two
    err = (q.dequantize() - w).abs()
    normal = w.abs() >= s * 2.0**-6  # e4m3 normal range: 3 mantissa bits -> rel err <= 2^-4
    assert (err[normal] <= 2.0**-4 * w.abs()[normal]).all()
    assert (err[~normal] <= 2.0**-10 * s[~normal]).all()  # half a subnormal step


def test_mxfp4_on_grid_values_are_exact():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (8, 256), generator=g)
    exps = torch.randint(-100, 100, (8, 8), generator=g).float().repeat_interleave(32, 1)
    w = E2M1_LUT[codes] * torch.exp2(exps)
    q = Mxfp4Weight.quantize(w)
    assert torch.equal(q.dequantize(), w)
    assert torch.equal(torch.signbit(q.dequantize()), torch.signbit(w))  # -0 survives too


def test_mxfp4_quantize_error_bound():
    w = _randn(16, 512, seed=3)
    q = Mxfp4Weight.quantize(w)
    s = e8m0_to_float(q.scale).repeat_interleave(32, 1)
    err = (q.dequantize() - w).abs()
    assert (err <= torch.maximum(0.25 * s, 0.2 * w.abs())).all()


def test_nvfp4_quantize_by_hand_and_bound():
    # amax 6 everywhere -> weight_scale_2 = 6/2688, block scale 448, effective scale ~1.
    w = torch.tensor(GRID * 2 + [-v for v in GRID] * 2).view(2, 16)
    w[:, 0] = 6.0
    q = Nvfp4Weight.quantize(w, input_amax=2688.0)
    assert q.weight_scale_2.item() == pytest.approx(6 / 2688, rel=1e-7)
    assert q.weight_scale.float().eq(448).all() and q.input_scale.item() == 1.0
    torch.testing.assert_close(q.dequantize(), w, rtol=1e-6, atol=0)
    w = _randn(32, 256, seed=4)
    q = Nvfp4Weight.quantize(w)
    s = (q.weight_scale.float() * q.weight_scale_2).repeat_interleave(16, 1)
    err = (q.dequantize() - w).abs()
    bound = torch.maximum(0.25 * s, 0.2 * w.abs()) + (w.abs() - 6 * s).clamp_min(0)
    assert (err <= bound * (1 + 1e-6)).all()
    assert q.input_scale.item() == pytest.approx(1 / 2688, rel=1e-7)


def test_nvfp4_pair_shares_global_scales():
    w1, w3 = _randn(8, 64, seed=5), 3 * _randn(8, 64, seed=6)
    a, b = nvfp4_quantize_pair(w1, w3, input_amax=10.0)
    check_shared_global_scale(a, b)
    assert a.weight_scale_2.item() == pytest.approx(w3.abs().max().item() / 2688, rel=1e-6)
    with pytest.raises(ValueError, match="weight_scale_2 differ"):
        check_shared_global_scale(Nvfp4Weight.quantize(w1), Nvfp4Weight.quantize(w3))
    with pytest.raises(ValueError, match="weight_amax"):
        Nvfp4Weight.quantize(w3, weight_amax=0.1)


# ---- matmul_ref -----------------------------------------------------------------------------


def test_matmul_ref_by_hand():
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, :2] = torch.tensor([1.0625, 3.0])  # FP8 sim: s = 2^-7, 136 -> 128 (tie) => 1.0
    q = Fp8BlockWeight(torch.ones(1, 128).to(torch.float8_e4m3fn), _e8m0([[128]]))  # W = 2
    assert q.matmul_ref(x, act_quant=True).item() == 8.0
    assert q.matmul_ref(x, act_quant=False).item() == 8.125


@pytest.mark.parametrize("cls", [Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, DenseWeight])
def test_matmul_ref_matches_emulation(cls):
    x = (_randn(3, 5, 256, seed=7) * 4).to(torch.bfloat16)
    q = cls.quantize(_randn(64, 256, seed=8) * 0.05)
    qa, sa = act_quant_ref(x, 128)
    x_sim = (qa.float().view(3, 5, 2, 128) * sa[..., None]).view(3, 5, 256)
    want = (x_sim @ q.dequantize().T).to(torch.bfloat16)
    y = q.matmul_ref(x, act_quant=True)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 64)
    assert torch.equal(y, want)
    want = (x.float() @ q.dequantize().T).to(torch.bfloat16)
    assert torch.equal(q.matmul_ref(x, act_quant=False), want)
    with pytest.raises(ValueError, match="K=256"):
        q.matmul_ref(x[..., :128], act_quant=False)


# ---- layouts and validation -----------------------------------------------------------------


def test_official_layouts():
    e8, e4 = torch.float8_e8m0fnu, torch.float8_e4m3fn
    assert Fp8BlockWeight.layout(32768, 1024) == {
        "weight": ((32768, 1024), e4),
        "scale": ((256, 8), e8),
    }
    assert Fp8BlockWeight.layout(1024, 4096, scale_dtype="f32")["scale"] == ((8, 32), torch.float32)
    assert Mxfp4Weight.layout(2048, 4096) == {
        "weight": ((2048, 2048), torch.int8),
        "scale": ((2048, 128), e8),
    }
    assert Nvfp4Weight.layout(4096, 2048) == {
        "weight": ((4096, 1024), torch.uint8),
        "weight_scale": ((4096, 128), e4),
        "weight_scale_2": ((), torch.float32),
        "input_scale": ((), torch.float32),
    }
    assert DenseWeight.layout(4, 8) == {"weight": ((4, 8), torch.bfloat16)}


def test_validation_errors():
    fp8 = Fp8BlockWeight.quantize(_randn(256, 128)).tensors()
    with pytest.raises(ValueError, match=r"Fp8BlockWeight\.weight: dtype torch\.bfloat16"):
        Fp8BlockWeight.from_tensors({**fp8, "weight": fp8["weight"].to(torch.bfloat16)})
    with pytest.raises(
        ValueError, match=r"Fp8BlockWeight\.scale: shape \(1, 1\), expected \(2, 1\)"
    ):
        Fp8BlockWeight.from_tensors({**fp8, "scale": fp8["scale"][:1]})
    with pytest.raises(ValueError, match=r"Fp8BlockWeight\.scale: dtype torch\.bfloat16"):
        Fp8BlockWeight.from_tensors({**fp8, "scale": fp8["scale"].float().bfloat16()})
    with pytest.raises(ValueError, match=r"missing \['scale'\], unexpected \['weight_scale'\]"):
        Fp8BlockWeight.from_tensors({"weight": fp8["weight"], "weight_scale": fp8["scale"]})
    mx = Mxfp4Weight.quantize(_randn(4, 64)).tensors()
    with pytest.raises(
        ValueError, match=r"Mxfp4Weight\.weight: dtype torch\.uint8, expected torch\.int8"
    ):
        Mxfp4Weight.from_tensors({**mx, "weight": mx["weight"].view(torch.uint8)})
    with pytest.raises(ValueError, match="K=48 must be a multiple of 32"):
        Mxfp4Weight.from_tensors({**mx, "weight": mx["weight"][:, :24]})
    with pytest.raises(ValueError, match=r"Mxfp4Weight\.weight: expected a 2-D tensor"):
        Mxfp4Weight.from_tensors({**mx, "weight": mx["weight"][0]})
    nv = Nvfp4Weight.quantize(_randn(4, 32)).tensors()
    with pytest.raises(
        ValueError, match=r"Nvfp4Weight\.weight_scale_2: shape \(1,\), expected \(\)"
    ):
        Nvfp4Weight.from_tensors({**nv, "weight_scale_2": nv["weight_scale_2"].reshape(1)})
    with pytest.raises(ValueError, match=r"Nvfp4Weight\.input_scale: expected a tensor"):
        Nvfp4Weight.from_tensors({**nv, "input_scale": 1.0})
    with pytest.raises(ValueError, match=r"DenseWeight\.weight: dtype torch\.int8"):
        DenseWeight(torch.zeros(2, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="scale_dtype 'bf16'"):
        Fp8BlockWeight.layout(128, 128, scale_dtype="bf16")
    with pytest.raises(ValueError, match="unknown weight format 'int4'"):
        weight_from_tensors("int4", {})
