"""dsv4.ops.linear_triton (`linear`, `wo_a`) against `linear_ref` / `wo_a_ref` on fresh random inputs.

CPU tier: small shapes through the Triton interpreter (TRITON_INTERPRET=1 is set here before the kernels
are decorated), every weight format, odd N tails, M in {1, 3, 16, 17, 128} (both kernels, swap-AB and
tiled), bf16 and fp32 outputs, fp32 activations, leading dims, strided rows, argument errors.
GPU tier (@pytest.mark.gpu): Flash production shapes, CUDA-graph replay == eager bitwise, determinism.
`python tests/ops/test_linear.py` (on a GPU) prints us, GB/s and % of the device-copy bandwidth per op.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
# Triton decides "interpreted or compiled" when it and each @triton.jit function are first imported: without
# CUDA, TRITON_INTERPRET=1 must be set before that. If another test module imported Triton first, the CPU
# tier re-runs this file in a subprocess instead (test_cpu_tier_in_subprocess).
_LATE = not CUDA and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from dsv4 import formats  # noqa: E402
from dsv4.ops import linear_triton as lt  # noqa: E402
from dsv4.ops.act_quant import act_quant_sim_ref  # noqa: E402
from dsv4.ops.linear import linear_ref, prepare_linear, wo_a_ref  # noqa: E402
from dsv4.testing import assert_bitwise_equal, assert_close_rel, fp8_blocks_apart, rel_err, tol  # noqa: E402

_INTERPRETED = type(lt._gemv_kernel).__name__ == "InterpretedFunction"
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA or _INTERPRETED, reason="needs CUDA (and TRITON_INTERPRET unset)")
cpu_tier = pytest.mark.skipif(_LATE, reason="Triton was imported before TRITON_INTERPRET=1: runs in a subprocess")


@pytest.mark.skipif(not _LATE, reason="only when Triton was imported compiled on a machine without CUDA")
def test_cpu_tier_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _weight(fmt: str, n: int, k: int, seed: int, device: str = DEV):
    """A prepared weight of `fmt` ("bf16" / "f32" = dense) built with the dsv4.formats quantizers."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
    if fmt == "bf16":
        return prepare_linear(formats.DenseWeight.quantize(w, torch.bfloat16))
    if fmt == "f32":
        return prepare_linear(formats.DenseWeight.quantize(w.bfloat16().float(), torch.float32))
    if fmt == "fp8":
        return prepare_linear(formats.Fp8BlockWeight.quantize(fp8_blocks_apart(w, g)))
    if fmt == "mxfp4":
        return prepare_linear(formats.Mxfp4Weight.quantize(w))
    if fmt == "nvfp4":
        return prepare_linear(formats.Nvfp4Weight.quantize(w))
    raise ValueError(fmt)


def _x(shape, dtype, seed: int, device: str = DEV) -> torch.Tensor:
    # a few large activations per row, as after the model's norms: the 1x128 scales differ per block
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device)
    e = torch.randint(-3, 4, tuple(shape[:-1]) + (-(-shape[-1] // 64),), generator=g, device=device)
    x = x * torch.exp2(e.float()).repeat_interleave(64, -1)[..., : shape[-1]]
    return x.to(dtype)


def _tolerance(x, w, act_quant, out_dtype, forced_mm: bool = False) -> str:
    if out_dtype == torch.float32:
        return "op_fp32_out"
    m = x.numel() // max(w.k, 1)
    fp8_mma = (x.is_cuda and act_quant and w.fmt == "fp8" and (forced_mm or not lt._use_gemv(w.fmt, m, w.n, 1))
               and lt._dot_mode(x, w, True, out_dtype) == lt._DOT_FP8)
    return "op_fp8_mma_bf16_out" if fp8_mma else "op_bf16_out"


def _check(x, w, act_quant, out_dtype):
    y = lt.linear(x, w, act_quant, out_dtype)  # the fast kernel runs before the reference allocates
    ref = linear_ref(x, w, act_quant, out_dtype)
    assert y.dtype == out_dtype and y.shape == ref.shape
    assert_close_rel(y, ref, _tolerance(x, w, act_quant, out_dtype))


# ---- CPU tier (interpreted on CPU; the same tests run compiled on a GPU) ---------------------------------


@cpu_tier
@pytest.mark.parametrize("m", [1, 3, 16, 17, 128])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4", "bf16"])
def test_linear_formats(fmt, m):
    w = _weight(fmt, 200, 256, seed=m)
    x = _x((m, 256), torch.bfloat16, seed=100 + m)
    for out_dtype in (torch.bfloat16, torch.float32):
        _check(x, w, True, out_dtype)


@cpu_tier
@pytest.mark.parametrize("m", [1, 17])  # the GEMV and the tensor-core kernel
def test_mxfp4_scale_byte_255_is_nan(m):
    # E8M0 byte 255 encodes NaN (formats.e8m0_to_float): the rows whose blocks carry it are NaN in both paths, the rest
    # as the reference
    w = _weight("mxfp4", 200, 256, seed=7)
    w.scale.view(torch.uint8)[[5, 130], [2, 7]] = 255
    x = _x((m, 256), torch.bfloat16, seed=8)
    got, ref = lt.linear(x, w, True, torch.float32), linear_ref(x, w, True, torch.float32)
    nan = torch.zeros(200, dtype=torch.bool, device=x.device)
    nan[[5, 130]] = True
    assert torch.equal(got.isnan(), nan.expand(m, -1)) and torch.equal(ref.isnan(), nan.expand(m, -1))
    assert_close_rel(got[:, ~nan], ref[:, ~nan], _tolerance(x, w, True, torch.float32))


@cpu_tier
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4", "bf16"])
def test_linear_gemv_over_several_k_steps(fmt, m):
    # K = 2432 (19 blocks of 128): the decode GEMV's K loop runs 2-5 steps of BK (2048 for FP4, 512-1024 else) with
    # a partial last step (at K = 256 every format's BK holds the whole row), so each step's weight, scale and
    # activation offsets count
    w = _weight(fmt, 72, 2432, seed=31 + m)
    x = _x((m, 2432), torch.bfloat16, seed=32 + m)
    assert lt._gemv_config(w.fmt, lt._ELEM_BYTES.get(w.fmt, w.weight.element_size()), m, 72, 2432, 1,
                           lt._num_sms(x.device), True)[2] < 2432
    assert lt._use_gemv(w.fmt, m, w.n, 1) == (m == 1 or fmt in ("fp8", "bf16"))  # FP4 at 3 tokens: tensor cores
    for act_quant, out_dtype in ((True, torch.bfloat16), (False, torch.float32)):
        _check(x, w, act_quant, out_dtype)


@cpu_tier
@pytest.mark.parametrize("m", [16, 17])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "bf16"])
def test_linear_h200_configs(fmt, m, monkeypatch):
    # the tensor-core tile configs chosen for a 132-SM GPU (narrow BN, pre-quantized swap-AB tiles), here too
    monkeypatch.setattr(lt, "_num_sms", lambda device: 132)
    w = _weight(fmt, 200, 256, seed=21 + m)
    x = _x((m, 256), torch.bfloat16, seed=22 + m)
    _check(x, w, True, torch.bfloat16)
    _check(x, w, True, torch.float32)


@cpu_tier
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4", "bf16"])
def test_linear_forced_tensor_core_decode(fmt):
    # decode of short weights runs the GEMV (_use_gemv): the swap-AB tensor-core path at small N here
    w = _weight(fmt, 200, 256, seed=11)
    for m, out_dtype in ((1, torch.float32), (3, torch.bfloat16)):
        x = _x((m, 256), torch.bfloat16, seed=12 + m)
        y = lt._linear_variant(x, w, True, out_dtype, "mm")
        assert_close_rel(y, linear_ref(x, w, True, out_dtype), _tolerance(x, w, True, out_dtype, forced_mm=True))


@cpu_tier
@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "bf16"])
def test_linear_split_k(fmt, split):
    # prefill tiles with K split over programs (the last to arrive sums the fp32 partials in split order):
    # a ragged last split (K = 640 = 5 blocks), odd N and M tails, every output written once
    w = _weight(fmt, 200, 640, seed=31 + split)
    x = _x((37, 640), torch.bfloat16, seed=32 + split)
    for out_dtype in (torch.bfloat16, torch.float32):
        cfg = (False, 32, 64, 4, 2, split)
        y = lt._linear_variant(x, w, True, out_dtype, "mm", mm_cfg=cfg)
        assert_close_rel(y, linear_ref(x, w, True, out_dtype), _tolerance(x, w, True, out_dtype, forced_mm=True))
        # the counters are back to zero, so a second launch sums again (as a graph replay does), same bits
        assert_bitwise_equal(lt._linear_variant(x, w, True, out_dtype, "mm", mm_cfg=cfg), y, "split-K relaunch")
    assert not lt._split_counters(x.device).any()


@cpu_tier
def test_mm_config_splits_k_only_when_tiles_leave_sms_idle():
    # 132 SMs: a 128-token chunk over the 1536-row wq_a || wkv (12 tiles of 128 x 128) splits K=4096; the
    # 32768-row wq_b (256 tiles) does not; the ragged wo_a groups never exceed the counters
    assert lt._mm_config("fp8", 128, 1536, 4096, 1, 132, lt._DOT_FP8)[-1] > 1
    assert lt._mm_config("fp8", 128, 32768, 1024, 1, 132, lt._DOT_FP8)[-1] == 1
    for m, n, k, g in ((128, 1024, 4096, 8), (17, 64, 4096, 1), (128, 4096, 256, 1)):
        sw, bm, bn, _, _, split = lt._mm_config("fp8", m, n, k, g, 132, lt._DOT_FP8)
        assert split == 1 or (-(-k // 128) >= 4 * (split // 2) and g * -(-n // bn) * -(-m // bm) <= lt.MAX_SPLIT_TILES)
    for cfg in lt.mm_candidates(128, 1536, 4096, lt._DOT_FP8):
        assert -(-4096 // 128) >= 2 * cfg[-1]
    # bf16 weights on bf16 x (the compressor projections): 4 stages on 64 x 64 tiles, programs up to one per SM
    # (H200 sweep: CSA 2624 rows split 1 at 128 tokens, 2 at 32; HCA 1024 rows split 4 at 128)
    assert lt._mm_config("dense", 128, 2624, 4096, 1, 132, lt._DOT_BF16) == (False, 64, 64, 4, 4, 1)
    assert lt._mm_config("dense", 32, 2624, 4096, 1, 132, lt._DOT_BF16)[-1] == 2
    assert lt._mm_config("dense", 128, 1024, 4096, 1, 132, lt._DOT_BF16)[-1] == 4


def _edge_activations(m: int) -> torch.Tensor:
    """[m, 256] fp32 rows that probe the FP8 1x128 quantizer: ties between e4m3 neighbours, a carry into the
    next binade, the subnormal grid, exact powers of two as amax, the 1e-4 amax floor, signs."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())
    x[0, :16] = torch.tensor([448.0, 124.6, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 440.0, -432.0, 7.0, -0.3,
                              2.0**-9, 5 * 2.0**-11, 100.0, -3.3, 232.0, 0.0])
    x[0, 128:] = 1e-6 * torch.randn(128, generator=g)  # amax below the floor
    if m > 1:
        x[1, :128] = 7.0 * torch.randn(128, generator=g).sign()  # amax 7 = 448 * 2^-6: s exact, not rounded up
    return x


@cpu_tier
@pytest.mark.parametrize("m,variant", [(3, None), (3, "mm"), (17, None)])  # GEMV, swap-AB, pre-quantized
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_activation_quantization_exact(fmt, m, variant):
    # W = I is exact in both formats, so y is the FP8-quantized activation itself: equal to the reference
    # quantizer value for value (fp32 output; a zero may come back as +0 where the reference has -0)
    w = _weight_from(fmt, torch.eye(256, device=DEV))
    x = _edge_activations(m).to(DEV)
    if variant is None:
        y = lt.linear(x, w, True, torch.float32)
    else:
        y = lt._linear_variant(x, w, True, torch.float32, variant)
    ref = act_quant_sim_ref(x, 128, out_dtype=torch.float32)
    bad = (y != ref).nonzero()
    if bad.numel():
        at = tuple(bad[0].tolist())
        raise AssertionError(f"{len(bad)} values differ, first at {at}: {y[at].item()} vs reference {ref[at].item()}")


def _weight_from(fmt, w):
    cls = {"fp8": formats.Fp8BlockWeight, "mxfp4": formats.Mxfp4Weight, "nvfp4": formats.Nvfp4Weight}[fmt]
    return prepare_linear(cls.quantize(w))


@cpu_tier
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_linear_fp32_activations(fmt, m):
    # fp32 x: quantized (W8A8 / W4A8) and unquantized (fp32 x against the exact weight: split bf16 dots)
    w = _weight(fmt, 136, 384, seed=7 + m)
    x = _x((m, 384), torch.float32, seed=8 + m)
    _check(x, w, True, torch.float32)
    _check(x, w, False, torch.float32 if m == 1 else torch.bfloat16)


@cpu_tier
@pytest.mark.parametrize("m", [1, 3, 17])
def test_linear_dense_fp32(m):
    # compressor projections: fp32 x, fp32 out, weight bf16 or fp32 (the reference computes in fp32)
    for fmt in ("bf16", "f32"):
        w = _weight(fmt, 72, 384, seed=m)
        _check(_x((m, 384), torch.float32, seed=m), w, False, torch.float32)
    w = _weight("bf16", 72, 384, seed=5)
    _check(_x((m, 384), torch.bfloat16, seed=6), w, True, torch.float32)  # act_quant ignored for dense


@cpu_tier
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "bf16"])
def test_linear_quantized_activation_input(fmt):
    # a QuantAct (the activation with its own quantization, as rmsnorm_quant hands it on) gives the linear exactly
    # what x gives it, quantized or not, in the reference and in the fast op (which reads x or the codes)
    from dsv4.ops.act_quant import quant_act_ref
    from dsv4.ops.linear import make_fast_linear

    fast = make_fast_linear(lt)
    w = _weight(fmt, 136, 384, seed=41)
    for shape in ((1, 384), (2, 17, 384)):
        x = _x(shape, torch.bfloat16, seed=len(shape))
        qa = quant_act_ref(x)
        for aq in (True, False):
            assert_bitwise_equal(linear_ref(qa, w, aq, torch.bfloat16), linear_ref(x, w, aq, torch.bfloat16),
                                 f"reference, act_quant={aq}")
            assert_bitwise_equal(fast(qa, w, aq, torch.bfloat16), fast(x, w, aq, torch.bfloat16), f"fast, act_quant={aq}")
    with pytest.raises(ValueError, match="do not match"):  # codes of other rows than x's
        fast(quant_act_ref(x)._replace(x=x[:, :1]), w, True, torch.bfloat16)
    if fmt != "bf16":  # prefill tiles read the codes given (another x's here), where they would quantize x first
        x, other = _x((17, 384), torch.bfloat16, seed=3), quant_act_ref(_x((17, 384), torch.bfloat16, seed=4))
        assert_bitwise_equal(lt.linear(x, w, True, torch.bfloat16, (other.q, other.s)),
                             lt.linear(other.x, w, True, torch.bfloat16), "the codes are read")


@cpu_tier
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "bf16"])
def test_norm_linear(fmt, m):
    # the fast norm_linear (here: the norm kernel, with its codes where the linear quantizes, then the fast linear)
    # against linear_ref(rmsnorm_ref(x)), and bit for bit the two fast ops it is made of
    from dsv4 import ops
    from dsv4.ops import norm_rope_triton as nt
    from dsv4.ops.linear import make_fast_linear, norm_linear_ref

    fast_linear = make_fast_linear(lt)
    fast = ops.OPS["norm_linear"].fast
    w = _weight(fmt, 136, 256, seed=43 + m)
    x = _x((1, m, 256), torch.bfloat16, seed=m) * 3
    nw = (1 + 0.1 * torch.randn(256, generator=_gen(m), device=DEV)).to(torch.bfloat16)
    for aq in (True, False):
        y = fast(x, nw, 1e-6, w, aq, torch.bfloat16)
        assert_close_rel(y, norm_linear_ref(x, nw, 1e-6, w, aq, torch.bfloat16), _tolerance(x, w, aq, torch.bfloat16))
        assert_bitwise_equal(y, fast_linear(nt.rmsnorm(x, nw, 1e-6), w, aq, torch.bfloat16), f"composition, aq={aq}")
    with pytest.raises(TypeError, match="PreparedLinear"):
        fast(x, nw, 1e-6, w.weight, True, torch.bfloat16)


@cpu_tier
def test_linear_leading_dims_and_strided_rows():
    w = _weight("fp8", 200, 256, seed=1)
    x = _x((2, 3, 256), torch.bfloat16, seed=2)
    _check(x, w, True, torch.bfloat16)
    wide = _x((5, 384), torch.bfloat16, seed=3)
    _check(wide[:, 64:320], w, True, torch.float32)  # rows with stride 384, unit stride along K
    assert lt.linear(x[:, :0], w, True, torch.bfloat16).shape == (2, 0, 200)


@cpu_tier
@pytest.mark.parametrize("m", [1, 3, 17])
def test_wo_a(m):
    g = torch.Generator(device=DEV).manual_seed(m)
    w = (torch.randn(4, 72, 256, generator=g, device=DEV) / 16).bfloat16()
    for dtype in (torch.bfloat16, torch.float32):
        o = _x((m, 4, 256), dtype, seed=50 + m)
        z = lt.wo_a(o, w)
        ref = wo_a_ref(o, w)
        assert z.dtype == dtype
        assert_close_rel(z, ref, "op_bf16_out" if dtype == torch.bfloat16 else "op_fp32_out")
    o = _x((2, m, 4, 256), torch.bfloat16, seed=60 + m)
    assert_close_rel(lt.wo_a(o, w), wo_a_ref(o, w), "op_bf16_out")


@cpu_tier
def test_argument_errors():
    w = _weight("fp8", 200, 256, seed=1)
    x = _x((1, 256), torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match=r"x \(1, 128\) does not match K=256"):
        lt.linear(x[:, :128], w, True, torch.bfloat16)
    with pytest.raises(ValueError, match="x dtype torch.float16"):
        lt.linear(x.half(), w, True, torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype torch.float16"):
        lt.linear(x, w, True, torch.float16)
    with pytest.raises(ValueError, match="unit stride along K"):
        lt.linear(_x((256, 2), torch.bfloat16, seed=1).T, w, True, torch.bfloat16)
    bad = type(w)("fp8", 200, 256, w.weight.T.contiguous().T, w.scale)  # a transposed view
    with pytest.raises(ValueError, match=r"weight \(200, 256\) must be contiguous"):
        lt.linear(x, bad, True, torch.bfloat16)
    with pytest.raises(ValueError, match=r"fp8 scale torch.float32\(1, 2\), expected torch.float32\(2, 2\)"):
        lt.linear(x, type(w)("fp8", 200, 256, w.weight, w.scale[:1]), True, torch.bfloat16)
    w384 = _weight("mxfp4", 64, 160, seed=1)
    with pytest.raises(ValueError, match="K=160 must be a multiple of 128"):
        lt.linear(_x((1, 160), torch.bfloat16, seed=1), w384, True, torch.bfloat16)
    with pytest.raises(ValueError, match=r"o \(1, 3, 256\) does not match w \(4, 72, 256\)"):
        lt.wo_a(torch.zeros(1, 3, 256, dtype=torch.bfloat16, device=DEV),
                torch.zeros(4, 72, 256, dtype=torch.bfloat16, device=DEV))


# ---- GPU tier: Flash production shapes -----------------------------------------------------------------

# (name, weight format, N, K, act_quant, out dtype, x dtype)
FLASH = [
    ("wq_a", "fp8", 1024, 4096, True, torch.bfloat16, torch.bfloat16),
    ("wkv", "fp8", 512, 4096, True, torch.bfloat16, torch.bfloat16),
    ("wq_b", "fp8", 32768, 1024, True, torch.bfloat16, torch.bfloat16),
    ("wo_b", "fp8", 4096, 8192, True, torch.bfloat16, torch.bfloat16),
    ("shared_w1", "fp8", 2048, 4096, True, torch.bfloat16, torch.bfloat16),
    ("shared_w2", "fp8", 4096, 2048, True, torch.bfloat16, torch.bfloat16),
    ("idx_wq_b", "fp8", 8192, 1024, True, torch.bfloat16, torch.bfloat16),
    ("wq_b_and_idx_wq_b", "fp8", 40960, 1024, True, torch.bfloat16, torch.bfloat16),
    ("expert_w1_mxfp4", "mxfp4", 2048, 4096, True, torch.bfloat16, torch.bfloat16),
    ("expert_w2_mxfp4", "mxfp4", 4096, 2048, True, torch.bfloat16, torch.bfloat16),
    ("expert_w1_nvfp4", "nvfp4", 2048, 4096, True, torch.bfloat16, torch.bfloat16),
    ("compressor_bf16", "bf16", 1024, 4096, False, torch.float32, torch.float32),
    ("compressor_bf16_x", "bf16", 1024, 4096, False, torch.float32, torch.bfloat16),
    ("csa_x_proj", "bf16", 2624, 4096, False, torch.float32, torch.bfloat16),
    ("compressor_f32", "f32", 1024, 4096, False, torch.float32, torch.float32),
    ("head", "bf16", 129280, 4096, False, torch.float32, torch.bfloat16),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 128])
@pytest.mark.parametrize("case", FLASH, ids=[c[0] for c in FLASH])
def test_flash_shapes(case, m):
    name, fmt, n, k, aq, out_dtype, x_dtype = case
    if name == "head" and m == 128:
        pytest.skip("head runs on the last position only")
    w = _weight(fmt, n, k, seed=m)
    x = _x((m, k), x_dtype, seed=m + 1)
    _check(x, w, aq, out_dtype)
    if out_dtype == torch.bfloat16 and n <= 8192:
        _check(x, w, aq, torch.float32)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 128])
def test_flash_wo_a(m):
    g = torch.Generator(device=DEV).manual_seed(m)
    w = (torch.randn(8, 1024, 4096, generator=g, device=DEV) / 64).bfloat16()
    o = _x((m, 8, 4096), torch.bfloat16, seed=m)
    assert_close_rel(lt.wo_a(o, w), wo_a_ref(o, w), "op_bf16_out")


@gpu
@pytest.mark.gpu
def test_graph_replay_equals_eager():
    cases = [(_weight("fp8", 32768, 1024, 1), 1, True, torch.bfloat16),
             (_weight("fp8", 1024, 4096, 2), 4, True, torch.bfloat16),
             (_weight("mxfp4", 2048, 4096, 3), 1, True, torch.bfloat16),
             (_weight("nvfp4", 2048, 4096, 3), 16, True, torch.float32),
             (_weight("fp8", 4096, 8192, 4), 128, True, torch.bfloat16),
             (_weight("bf16", 129280, 4096, 5), 1, False, torch.float32)]
    xs = [_x((m, w.k), torch.bfloat16, seed=i) for i, (w, m, _, _) in enumerate(cases)]
    gw = (torch.randn(8, 1024, 4096, device=DEV) / 64).bfloat16()
    o = _x((2, 8, 4096), torch.bfloat16, seed=9)
    eager = [lt.linear(x, w, aq, od) for x, (w, _, aq, od) in zip(xs, cases)] + [lt.wo_a(o, gw)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [lt.linear(x, w, aq, od) for x, (w, _, aq, od) in zip(xs, cases)] + [lt.wo_a(o, gw)]
    for _ in range(2):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(outs, eager)):
            assert_bitwise_equal(a, b, f"graph replay case {i}")
    # fresh inputs through the same graph: replay follows the captured input buffers
    for x in xs:
        x.copy_(_x(tuple(x.shape), x.dtype, seed=77))
    graph.replay()
    for i, (a, x, (w, _, aq, od)) in enumerate(zip(outs, xs, cases)):
        assert_bitwise_equal(a, lt.linear(x, w, aq, od), f"graph replay, new inputs, case {i}")


# ---- benchmark: python tests/ops/test_linear.py [--precompile-only] ----------------------------------------

BENCH = [(c[0], c[1], c[2], c[3], 1, c[4], c[5], c[6]) for c in FLASH] + [
    ("wo_a", "bf16", 1024, 4096, 8, False, torch.bfloat16, torch.bfloat16)]


def _bench_case(case, m, variant, iters=100):
    """-> (us per call eager, us per call in a graph of `iters` calls, bytes moved)."""
    name, fmt, n, k, groups, aq, out_dtype, x_dtype = case
    if groups > 1:
        base = [(torch.randn(groups, n, k, device="cuda") / 64).bfloat16()]
        nbytes_w = base[0].numel() * 2
    else:
        base = [_weight(fmt, n, k, seed=0, device="cuda")]
        nbytes_w = base[0].nbytes()
    copies = max(1, -(-256 * 2**20 // nbytes_w))  # rotate over >= 256 MB of weights: no L2 reuse
    ws = base + [base[0].clone() if groups > 1 else _clone(base[0]) for _ in range(copies - 1)]
    x = _x((m, groups, k) if groups > 1 else (m, k), x_dtype, seed=1, device="cuda")
    if groups > 1:
        call = (lambda i: _wo_a_variant(x, ws[i % copies], variant))
        out_bytes = m * groups * n * x.element_size()
        ref = wo_a_ref(x, ws[0])
    else:
        call = (lambda i: _call_variant(x, ws[i % copies], aq, out_dtype, variant))
        out_bytes = m * n * (2 if out_dtype == torch.bfloat16 else 4)
        ref = linear_ref(x, ws[0], aq, out_dtype)
    nbytes = nbytes_w + x.numel() * x.element_size() + out_bytes
    tol_name = "op_bf16_out" if ref.dtype == torch.bfloat16 else "op_fp32_out"
    if groups == 1 and variant != "mm16" and variant != "gemv":
        tol_name = _tolerance(x, ws[0], aq, out_dtype, forced_mm=variant == "mm")
    err = rel_err(call(0), ref)
    check = f"{'ok' if err <= tol(tol_name) else 'FAIL'} {err:.1e}"
    del ref
    for i in range(3):
        call(i)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for i in range(iters):
        call(i)
    t1.record()
    torch.cuda.synchronize()
    eager = t0.elapsed_time(t1) * 1e3 / iters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0.record()
        graph.replay()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / iters)
    return eager, sorted(times)[2], nbytes, check


def _wo_a_variant(o, w, variant):
    if variant is None:
        return lt.wo_a(o, w)
    G, R, D = w.shape
    o3 = o.view(-1, G, D)
    out = torch.empty((o3.shape[0], G, R), dtype=o.dtype, device=o.device)
    lt._launch(o3, lt.PreparedLinear("dense", R, D, w), out, o3.shape[0], R, D, G, (o3.stride(1), o3.stride(0)),
               (R * D, D), (0, 0), (R, G * R), False, o.dtype, force=variant)
    return out


def _clone(w):
    return type(w)(w.fmt, w.n, w.k, *(None if t is None else t.clone() for t in (w.weight, w.scale, w.global_scale)))


def _call_variant(x, w, aq, out_dtype, variant):
    if variant is None:
        return lt.linear(x, w, aq, out_dtype)
    return lt._linear_variant(x, w, aq, out_dtype, variant)


def _copy_bandwidth() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        t0.record()
        b.copy_(a)
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) / 1e3)
    return 2 * 2**30 / sorted(times)[10] / 1e9


def _main(argv):
    variants = [None]
    for a in argv:
        if a.startswith("--variants="):
            variants += [v for v in a.split("=", 1)[1].split(",") if v]
    ms = [1, 4, 16, 128]
    shard = next((a.split("=")[1] for a in argv if a.startswith("--shard=")), None)

    def wanted(c, m, v):
        if c[0] == "head" and m == 128:
            return False
        gemv = lt._use_gemv(_pfmt(c[1]), m, c[2], c[4])
        if v == "mm":  # the tensor-core kernel where the GEMV is the default
            return gemv
        if v == "gemv":  # and the other way round
            return m <= 4 and not gemv
        if v == "mm16":  # 16-bit operands instead of the FP8 dot
            return c[1] == "fp8" and c[6] == torch.bfloat16 and not gemv
        return v is None

    jobs = [(c, m, v) for c in BENCH for m in ms for v in variants if wanted(c, m, v)]
    if shard is not None:  # --shard=i/n: run (compile) only every n-th job, for a parallel warm-up
        i, n = map(int, shard.split("/"))
        for c, m, v in jobs[i::n]:
            try:
                _bench_case(c, m, v, iters=2)
            except Exception as e:  # noqa: BLE001 - report and go on warming the others
                print(f"warm-up {c[0]} M={m} {v}: {type(e).__name__}: {e}", flush=True)
        return
    bw = _copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s (1 GiB D2D, read + write)")
    print(f"{'op':18s} {'fmt':6s} {'N':>6s} {'K':>5s} {'M':>4s} {'variant':10s} {'eager us':>9s} {'graph us':>9s} "
          f"{'GB/s':>7s} {'% copy':>6s}  {'vs ref':12s} config")
    for c, m, v in jobs:
        try:
            eager, graph, nbytes, check = _bench_case(c, m, v)
        except Exception as e:  # noqa: BLE001
            print(f"{c[0]:18s} M={m} {v}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        gbs = nbytes / graph / 1e3
        print(f"{c[0]:18s} {c[1]:6s} {c[2]:6d} {c[3]:5d} {m:4d} {str(v or 'default'):10s} {eager:9.2f} {graph:9.2f} "
              f"{gbs:7.0f} {100 * gbs / bw:6.1f}  {check:12s} {_describe(c, m, v)}", flush=True)


def _pfmt(fmt):
    return "dense" if fmt in ("bf16", "f32") else fmt


def _describe(c, m, v):
    name, fmt, n, k, groups, aq, out_dtype, x_dtype = c
    pf = _pfmt(fmt)
    wb = {"bf16": 2, "f32": 4, "fp8": 1}.get(fmt, 0.5)
    aq = aq and pf != "dense"
    if (v is None and lt._use_gemv(pf, m, n, groups)) or v == "gemv":
        return f"gemv {lt._gemv_config(pf, wb, m, n, k, groups, lt._num_sms(torch.device('cuda')), aq)}"
    dot = 3 if fmt == "f32" else 1 if (pf == "fp8" and aq and out_dtype == torch.bfloat16 and lt.FP8_DOT
                                       and v != "mm16") else 2 if (x_dtype == torch.float32 and not aq) else 0
    return f"mm dot{dot} {lt._mm_config(pf, m, n, k, groups, lt._num_sms(torch.device('cuda')), dot)}"


if __name__ == "__main__":
    _main(sys.argv[1:])
