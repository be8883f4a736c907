"""The op seam: backends bound once, per-op overrides, honest reporting of what runs where."""

import pytest

from dsv4 import ops


@pytest.fixture(autouse=True)
def _restore():
    yield
    ops.configure("ref", "cpu")


def test_every_op_has_a_reference_and_the_default_is_ref_on_cpu():
    assert {"linear", "sparse_attn", "moe_experts", "router", "compressor", "mhc_pre", "head"} <= set(ops.OPS)
    report = ops.configure(None, "cpu")
    assert set(report) == set(ops.OPS)
    assert all(r == "ref" for r in report.values())
    assert all(op.impl is op.ref for op in ops.OPS.values())


def test_fast_falls_back_to_ref_with_a_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    report = ops.configure("fast", "cpu")
    for name, op in ops.OPS.items():
        assert report[name].startswith("ref ("), (name, report[name])
        assert op.impl is op.ref
    if ops.OPS["linear"].fast is not None:
        assert report["linear"] == "ref (Triton on CPU needs TRITON_INTERPRET=1)"
    assert report["compressor"] == "ref (no fast implementation yet)" or ops.OPS["compressor"].fast is not None
    assert "kernels: " in ops.banner(report)


def test_overrides_and_parse_kernels():
    assert ops.parse_kernels(None) == (None, {})
    assert ops.parse_kernels("fast,sparse_attn=ref, linear=fast") == ("fast", {"sparse_attn": "ref", "linear": "fast"})
    with pytest.raises(ValueError, match="expected ref, fast or op=ref"):
        ops.parse_kernels("fastest")
    with pytest.raises(ValueError, match="unknown op"):
        ops.configure("ref", "cpu", {"no_such_op": "fast"})
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.configure("ref", "cpu", {"linear": "quick"})
    with pytest.raises(ValueError, match="kernels must be one of"):
        ops.configure("turbo", "cpu")


def test_the_hook_sees_every_call():
    import torch

    seen = []
    ops.set_hook(lambda op, a, k: (seen.append(op.name), op.ref(*a, **k))[1])
    try:
        y = ops.rmsnorm(torch.ones(2, 4), torch.ones(4), 1e-6)
    finally:
        ops.set_hook(None)
    assert seen == ["rmsnorm"] and torch.allclose(y, torch.ones(2, 4))
