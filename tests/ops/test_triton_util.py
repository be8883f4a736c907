"""dsv4/ops/triton_util.py's rounding helpers, bit for bit against torch's casts (round to nearest, ties to even):
every Triton kernel that rounds fp32 to bf16 in integer ops (the interpreter's cast truncates) goes through
`rne_bf16`, and every one that simulates the FP8 activation cast through `e4m3_round`. Interpreted on the CPU;
compiled on a GPU (`-m gpu`)."""

import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from dsv4.ops.triton_util import e4m3_round, rne_bf16, round_to  # noqa: E402

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


@triton.jit
def _e4m3_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(o_ptr + i, e4m3_round(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


@both_tiers
def test_e4m3_round_is_torchs_cast():
    # every finite e4m3 value, the midpoints between neighbours (ties: the even code wins) and one fp32 ulp either
    # side of them, over the whole range: subnormals (spacing 2^-9 below 2^-6), the first normal binades (where the
    # spacing doubles) and the top (448); then random values log-uniform over [2^-12, 448] and values under half the
    # smallest subnormal (they round to zero)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted, +-0 once
    mid = (grid[1:] + grid[:-1]) / 2
    up, down = (mid.view(torch.int32) + 1).view(torch.float32), (mid.view(torch.int32) - 1).view(torch.float32)
    g = torch.Generator().manual_seed(1)
    mag = torch.exp2(torch.rand(4096, generator=g) * (math.log2(448) + 12) - 12)
    sign = torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    tiny = torch.tensor([2.0**-11, -(2.0**-11), 2.0**-10 * 0.999, 2.0**-30, 1e-38])
    x = torch.cat([grid, mid, up, down, (mag * sign).clamp(-448, 448), tiny]).to(DEV)
    o = torch.empty_like(x)
    _e4m3_kernel[(triton.cdiv(x.numel(), 1024),)](x, o, x.numel(), BLOCK=1024)
    want = x.cpu().to(torch.float8_e4m3fn).float()
    bad = o.cpu() != want  # values compared (a negative value that rounds to zero may come back +0: callers sign it)
    assert not bad.any(), list(zip(x.cpu()[bad][:6].tolist(), o.cpu()[bad][:6].tolist(), want[bad][:6].tolist()))
    # the midpoints are ties, and each went to its even neighbour
    assert torch.equal(mid - grid[:-1], grid[1:] - mid)
    codes = want[len(grid):len(grid) + len(mid)].to(torch.float8_e4m3fn).view(torch.uint8)
    assert bool((codes & 1).eq(0).all())
