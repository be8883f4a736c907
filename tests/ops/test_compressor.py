"""Fast compressor decode step (dsv4/ops/compressor_triton.py) against compressor_ref: step by step over
several windows (every emission boundary), HCA and CSA, main (FP8 simulation) and indexer (Hadamard + FP4)
keys and exact numerics; state and entries compared after every step. Interpreted on the CPU, Flash
widths on a GPU."""

import pytest
import torch

from dsv4.model.layers import Rope
from dsv4.ops.compressor import compressor_ref
from dsv4.state import CompressorState
from dsv4.testing import assert_close_rel, tol

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


# interpreted on CPU (CI); on a GPU machine compiled, and selected by `-m gpu`
both_tiers = pytest.mark.gpu if torch.cuda.is_available() else (lambda f: f)


def _fast():
    try:
        from dsv4.ops import compressor_triton
    except ImportError:
        pytest.skip("Triton is not installed")
    return compressor_triton.compressor


def _assert_entries(a, b, quant):
    """Entries: close in bf16; with a quantization simulation an element may sit on the other side of a
    rounding boundary (fp32 pooling in another order), so a few elements may differ by one grid step."""
    if quant is None:
        assert_close_rel(a, b, "op_bf16_out" if a.dtype == torch.bfloat16 else "op_fp32_out")
        return
    diff = (a.float() - b.float()).abs()
    frac = (diff > tol("op_bf16_out") * b.float().abs().max()).float().mean().item()
    assert frac <= 0.01, f"{frac:.4f} of the entry elements differ by more than a bf16 rounding"


# (ratio, overlap, d, quant, dtype): CSA- and HCA-like windows, FP8- and FP4-simulated entries, fp32 activations; on
# a GPU also Flash's widths
DECODE_CASES = [
    (4, True, 128, "fp8", torch.bfloat16),
    (8, False, 128, "fp8", torch.bfloat16),
    (4, True, 64, "fp4", torch.bfloat16),
    (4, True, 64, None, torch.float32),
] + ([(128, False, 512, "fp8", torch.bfloat16), (4, True, 512, "fp8", torch.bfloat16)] if CUDA else [])


@both_tiers
@pytest.mark.parametrize("ratio,overlap,d,quant,dtype", DECODE_CASES)
def test_decode_steps_match_reference(ratio, overlap, d, quant, dtype):
    fast = _fast()
    g = torch.Generator().manual_seed(ratio * d)
    C = (2 if overlap else 1) * d
    rope = Rope(64 if d >= 128 else 32, 160000.0, None, 4096, DEV)
    ape = (torch.randn(ratio, C, generator=g) * 0.5).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).to(DEV)
    ref_st = CompressorState(1, ratio, d, overlap, 64, dtype, DEV)
    fast_st = CompressorState(1, ratio, d, overlap, 64, dtype, DEV)
    steps = 3 * ratio + 2 if ratio <= 8 else ratio + 3
    # exact numerics with an eps that matters (the pooled rows' mean square is ~0.4: its sign moves an entry ~10%,
    # far past the fp32 tolerance), so where the finish adds it shows
    eps = 0.05 if quant is None else 1e-6
    for p in range(steps):
        c = torch.randn(1, 1, C, generator=g).to(DEV)
        gg = torch.randn(1, 1, C, generator=g).to(DEV)
        start = torch.tensor([p], device=DEV)
        args = (ape, norm_w, eps, rope.cos, rope.sin)
        compressor_ref(c, gg, *args, ref_st.kv, ref_st.score, ref_st.entries, start, ratio, overlap, quant)
        fast(c, gg, *args, fast_st.kv, fast_st.score, fast_st.entries, start, ratio, overlap, quant)
        assert torch.equal(fast_st.score, ref_st.score), p
        assert torch.equal(fast_st.kv, ref_st.kv), p
        _assert_entries(fast_st.entries, ref_st.entries, quant)


@both_tiers
@pytest.mark.parametrize("d,quant", [(128, "fp8"), (128, "fp4"), (128, None)] + ([(512, "fp8")] if CUDA else []))
def test_batch_rows_finish_once_and_leave_the_counters_zero(d, quant):
    # two batch rows of several programs each: the last of a row's programs to arrive finishes that row's entry
    # (its own arrival counter), and every counter is zero again after each call
    from dsv4.ops.compressor_triton import MAX_ROWS, _block
    from dsv4.ops.triton_util import arrival_counters

    fast = _fast()
    ratio, overlap, B = 4, True, 2
    assert d // _block(ratio, overlap) >= 2  # several programs per row
    g = torch.Generator().manual_seed(d)
    C = 2 * d
    rope = Rope(64, 160000.0, None, 4096, DEV)
    ape = (torch.randn(ratio, C, generator=g) * 0.5).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).to(DEV)
    ref_st = CompressorState(B, ratio, d, overlap, 16, torch.bfloat16, DEV)
    fast_st = CompressorState(B, ratio, d, overlap, 16, torch.bfloat16, DEV)
    counters = arrival_counters(fast_st.entries.device, "compressor", MAX_ROWS)  # the kernel's (cuda:0, not cuda)
    for p in range(2 * ratio + 1):
        c, gg = torch.randn(B, 1, C, generator=g).to(DEV), torch.randn(B, 1, C, generator=g).to(DEV)
        start = torch.tensor([p], device=DEV)
        args = (ape, norm_w, 1e-6, rope.cos, rope.sin)
        compressor_ref(c, gg, *args, ref_st.kv, ref_st.score, ref_st.entries, start, ratio, overlap, quant)
        fast(c, gg, *args, fast_st.kv, fast_st.score, fast_st.entries, start, ratio, overlap, quant)
        assert torch.equal(fast_st.kv, ref_st.kv) and torch.equal(fast_st.score, ref_st.score), p
        _assert_entries(fast_st.entries, ref_st.entries, quant)
        assert not counters.any(), p
    assert fast_st.entries[:, :2].abs().amax(-1).gt(0).all()  # both windows of both rows were written


@both_tiers
@pytest.mark.parametrize("ratio,overlap,d,quant,dtype,chunks", [
    (4, True, 128, "fp8", torch.bfloat16, [3, 1, 6, 2, 9, 1, 17, 4]),
    (8, False, 128, "fp8", torch.bfloat16, [5, 13, 1, 20, 3, 8]),
    (4, True, 64, "fp4", torch.bfloat16, [2, 7, 1, 12, 5]),
    (4, True, 64, None, torch.float32, [6, 1, 9, 3]),
] + ([(128, False, 512, "fp8", torch.bfloat16, [100, 128, 60, 1, 128, 40]),
      (4, True, 512, "fp8", torch.bfloat16, [128, 128, 1, 37, 128]),
      (4, True, 128, "fp4", torch.bfloat16, [128, 1, 77, 128])] if CUDA else []))
def test_chunks_match_reference(ratio, overlap, d, quant, dtype, chunks):
    # prefill chunks of any length at any start (S > 1: the two chunk launches; S = 1 between them: the decode
    # step), two batch rows, c and g as column views of one wider projection (the attention's fused GEMM output):
    # state bit for bit, entries within the bf16 rounding after every call
    fast = _fast()
    g = torch.Generator().manual_seed(ratio * d + len(chunks))
    C = (2 if overlap else 1) * d
    B = 2
    rope = Rope(64 if d >= 128 else 32, 160000.0, None, 4096, DEV)
    ape = (torch.randn(ratio, C, generator=g) * 0.5).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).to(DEV)
    max_len = sum(chunks) + ratio  # positions: every window of the chunks has its own entry row
    ref_st = CompressorState(B, ratio, d, overlap, max_len, dtype, DEV)
    fast_st = CompressorState(B, ratio, d, overlap, max_len, dtype, DEV)
    p = 0
    for S in chunks:
        proj = torch.randn(B, S, 2 * C + 16, generator=g).to(DEV)
        c, gg = proj[..., :C], proj[..., C + 16:]
        start = torch.tensor([p], device=DEV)
        args = (ape, norm_w, 1e-6, rope.cos, rope.sin)
        compressor_ref(c, gg, *args, ref_st.kv, ref_st.score, ref_st.entries, start, ratio, overlap, quant)
        fast(c, gg, *args, fast_st.kv, fast_st.score, fast_st.entries, start, ratio, overlap, quant)
        assert torch.equal(fast_st.score, ref_st.score), (p, S)
        assert torch.equal(fast_st.kv, ref_st.kv), (p, S)
        _assert_entries(fast_st.entries, ref_st.entries, quant)
        p += S
    assert fast_st.entries[:, : p // ratio].abs().amax(-1).gt(0).all()  # every closed window was written


@both_tiers
@pytest.mark.parametrize("ratio,overlap,d,quant,dtype",
                         DECODE_CASES + ([(4, True, 128, "fp4", torch.bfloat16)] if CUDA else []))
def test_a_whole_window_in_the_decode_launch(ratio, overlap, d, quant, dtype):
    # window=True (a decode step that closes a window after steps that only kept x: Attention.begin): one window's
    # rows from its start, as column views of a wider projection, in the decode step's one launch. The same pooling
    # as the step-by-step decode fed the same rows (state and entries bit for bit) and the reference's chunk (entries
    # within the bf16 rounding, the state's last closed window bit for bit), window after window
    fast = _fast()
    g = torch.Generator().manual_seed(ratio * d + 7)
    C = (2 if overlap else 1) * d
    B = 2
    rope = Rope(64 if d >= 128 else 32, 160000.0, None, 4096, DEV)
    ape = (torch.randn(ratio, C, generator=g) * 0.5).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).to(DEV)
    sts = [CompressorState(B, ratio, d, overlap, 4 * ratio, dtype, DEV) for _ in range(3)]  # window, steps, ref
    args = (ape, norm_w, 1e-6, rope.cos, rope.sin)
    for w in range(3):
        proj = torch.randn(B, ratio, 2 * C + 16, generator=g).to(DEV)
        c, gg = proj[..., :C], proj[..., C + 16:]
        start = torch.tensor([w * ratio], device=DEV)
        fast(c, gg, *args, sts[0].kv, sts[0].score, sts[0].entries, start, ratio, overlap, quant, window=True)
        for i in range(ratio):
            fast(c[:, i:i + 1], gg[:, i:i + 1], *args, sts[1].kv, sts[1].score, sts[1].entries, start + i, ratio,
                 overlap, quant)
        compressor_ref(c, gg, *args, sts[2].kv, sts[2].score, sts[2].entries, start, ratio, overlap, quant,
                       window=True)
        assert torch.equal(sts[0].kv, sts[1].kv) and torch.equal(sts[0].score, sts[1].score), w
        assert torch.equal(sts[0].entries, sts[1].entries), w
        _assert_entries(sts[0].entries, sts[2].entries, quant)
        if overlap:  # the window that closed, kept for the next one's overlap
            assert torch.equal(sts[0].kv[:, :ratio], sts[2].kv[:, :ratio]), w
            assert torch.equal(sts[0].score[:, :ratio], sts[2].score[:, :ratio]), w
    assert sts[0].entries[:, :3].abs().amax(-1).gt(0).all()
    for f in (fast, compressor_ref):
        with pytest.raises(ValueError, match="window=True needs one window"):
            f(c[:, 1:], gg[:, 1:], *args, sts[0].kv, sts[0].score, sts[0].entries, start, ratio, overlap, quant,
              window=True)
