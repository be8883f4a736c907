"""dsv4/ops/triton_util.py's rounding helpers, bit for bit against torch's casts (round to nearest, ties to even):
every Triton kernel that rounds fp32 to bf16 in integer ops (the interpreter's cast truncates) goes through
`rne_bf16`. Interpreted on the CPU; compiled on a GPU (`-m gpu`)."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from dsv4.ops.triton_util import rne_bf16, round_to  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
both_tiers = pytest.mark.gpu if CUDA else (lambda f: f)


@triton.jit
def _round_kernel(x_ptr, o_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr, USE_RNE: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    y = rne_bf16(x) if USE_RNE else round_to(x, DT)
    tl.store(o_ptr + i, y, mask=m)


def _bits(*words: int) -> torch.Tensor:
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)


def _cases() -> torch.Tensor:
    """fp32 values whose low 16 bits sit exactly halfway between two bf16 values (even and odd bf16 below), just
    either side of halfway, the largest finite values (they round to inf), subnormals, +-0, +-inf and NaNs (some
    that the integer rounding alone would turn into inf or -0), then random words."""
    ties = [hi << 16 | 0x8000 for hi in (0x3F80, 0x3F81, 0x4049, 0x404A, 0xBF80, 0xBF81, 0x0000, 0x0001, 0x7F7E)]
    near = [hi << 16 | lo for hi in (0x3F80, 0x3F81, 0xC2F7) for lo in (0x7FFF, 0x8001, 0x0001, 0xFFFF)]
    ends = [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x807FFFFF, 0x00000000, 0x80000000,
            0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF, 0xFF800001]
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(-(1 << 31), (1 << 31) - 1, (4093,), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.cat([_bits(*ties, *near, *ends), rnd.view(torch.float32)])


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    nan = torch.isnan(want)
    return bool(torch.equal(torch.isnan(got), nan)) and torch.equal(got[~nan].view(torch.int32),
                                                                     want[~nan].view(torch.int32))


@both_tiers
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # numpy, casting the largest values to fp16
@pytest.mark.parametrize("dt", ["rne", "bf16", "fp16"])
def test_rounding_is_torchs_cast_bit_for_bit(dt):
    x = _cases().to(DEV)
    o = torch.empty_like(x)
    tdt = {"rne": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, o, x.numel(), DT=tl.float16 if dt == "fp16" else tl.bfloat16,
                                                   BLOCK=1024, USE_RNE=dt == "rne")
    want = x.to(tdt).float()
    assert _same(o, want), (x[~torch.eq(o.view(torch.int32), want.view(torch.int32))][:8].view(torch.int32).tolist())
    # the ties really are ties: both neighbours differ from x by the same amount, and the even one was taken
    if dt != "fp16":
        t = x[:9].cpu()
        up, down = (t.view(torch.int32) + 0x8000).view(torch.float32), (t.view(torch.int32) - 0x8000).view(torch.float32)
        assert torch.equal(up - t, t - down)
        assert bool(((o[:9].cpu().view(torch.int32) >> 16) & 1).eq(0).all())
