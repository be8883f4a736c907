"""FusedLinear: same-input projections as one GEMM, no weight stored twice, re-fused after a reload."""

import torch

from dsv4 import formats
from dsv4.model.layers import FusedLinear, Linear, Numerics
from dsv4.testing import assert_close_rel


def _linear(n, k, fmt, numerics, seed):
    lin = Linear(k, n, fmt, numerics, **({"scale_dtype": "e8m0"} if fmt == "fp8" else {}))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    stored = formats.FORMATS[fmt].quantize(w) if fmt != "dense" else formats.DenseWeight.quantize(w)
    for sfx, t in stored.tensors().items():
        lin._buffers[sfx] = t
    return lin


def test_fused_fp8_equals_the_members_and_shares_their_storage():
    num = Numerics("reference", torch.bfloat16)
    a, b = _linear(256, 384, "fp8", num, 0), _linear(128, 384, "fp8", num, 1)
    x = torch.randn(3, 384).to(torch.bfloat16)
    want = (a(x), b(x))
    fused = FusedLinear([a, b])
    ya, yb = fused(x)
    assert_close_rel(ya, want[0], "op_bf16_out")
    assert_close_rel(yb, want[1], "op_bf16_out")
    p = fused.prepared()
    assert p is not None and p.n == 384
    # the members' buffers are views into the fused tensors: nothing stored twice
    assert a.weight.untyped_storage().data_ptr() == p.weight.untyped_storage().data_ptr()
    assert b.scale.untyped_storage().data_ptr() == a.scale.untyped_storage().data_ptr()
    # a reload of one member is seen at the next call
    new = formats.Fp8BlockWeight.quantize(torch.randn(128, 384) * 0.1)
    b._buffers["weight"], b._buffers["scale"] = new.weight, new.scale
    assert_close_rel(fused(x)[1], b(x), "op_bf16_out")
    assert fused.prepared() is not p


def test_unfusable_members_run_one_by_one():
    num = Numerics("exact", torch.float32)
    a, b = _linear(100, 128, "fp8", num, 2), _linear(128, 128, "fp8", num, 3)  # 100 rows: not a scale block
    x = torch.randn(2, 128)
    assert FusedLinear([a, b]).prepared() is None
    ya, yb = FusedLinear([a, b])(x)
    assert torch.equal(ya, a(x)) and torch.equal(yb, b(x))
    d1, d2 = _linear(64, 128, "dense", num, 4), _linear(32, 128, "dense", num, 5)
    y1, y2 = FusedLinear([d1, d2])(x, torch.float32)
    assert_close_rel(y1, d1(x, torch.float32), "op_fp32_out")
    assert_close_rel(y2, d2(x, torch.float32), "op_fp32_out")
