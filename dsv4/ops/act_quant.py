"""FP8 e4m3 block activation quantization with power-of-two (ue8m0) scales (SPEC 2.0).

Owns the reference of the official `act_quant`: 1 x block_size blocks along the last dim,
amax floored at 1e-4, scale = 2^ceil(log2(amax * fp32(1/448))) taken from the fp32 exponent
bits, q = e4m3_RNE(clamp(x/s, +-448)). Used before FP8/FP4 weight linears (block 128) and for
the FP8 KV simulation (block 64 over the 448 no-RoPE dims). No fast path lives here yet.

`QuantAct` carries an activation together with its 1x128 quantization, made by the op that wrote the activation
(`rmsnorm_quant`), so that the linear after it starts from the codes instead of launching a quantization of its own.
"""

from typing import NamedTuple

import torch

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
# fp32(1/448), as the kernel's `fp8_max_inv`; the product amax * it is rounded to fp32.
FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()


def ue8m0_ceil_ref(y: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(y)) for positive normal fp32 y, exact, read off the exponent bits.

    Same as the kernel's fast_round_scale: biased exponent + (mantissa != 0). Exact powers of
    two map to themselves; inf/NaN pass through. Zero, subnormal or negative inputs (which the
    callers' amax floors exclude) give NaN: branch-free, so the op stays CUDA-graph safe.
    """
    if y.dtype != torch.float32:
        raise ValueError(f"ue8m0_ceil_ref expects float32, got {y.dtype}")
    bits = y.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    out = (exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)) << 23  # y < 2^128 -> at most inf
    out = torch.where(exp == 0xFF, bits, out).view(torch.float32)  # inf/NaN pass through
    return torch.where((bits < 0) | (exp == 0), torch.full_like(out, float("nan")), out)


def act_quant_ref(x: torch.Tensor, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., K] any float dtype -> q [..., K] float8_e4m3fn, s [..., K/block] fp32 (2^e)."""
    if x.dim() == 0 or block_size <= 0 or x.shape[-1] % block_size != 0:
        raise ValueError(
            f"last dim of {tuple(x.shape)} must be a multiple of block_size={block_size}"
        )
    xb = x.float().unflatten(-1, (x.shape[-1] // block_size, block_size))  # [..., K/b, b]
    amax = xb.abs().amax(-1).clamp_min(FP8_AMAX_FLOOR)  # [..., K/b]
    s = ue8m0_ceil_ref(amax * FP8_MAX_INV)
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # exact / by 2^e
    return q.flatten(-2), s


def act_quant_sim_ref(
    x: torch.Tensor, block_size: int = 128, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Quantize then dequantize: x [..., K] -> q*s [..., K] in out_dtype (default x.dtype).

    q*s is exact in fp32 and bf16 (same exponent range); pass out_dtype=torch.float32 to feed
    an fp32 GEMM without a lossy round trip through fp16.
    """
    q, s = act_quant_ref(x, block_size)
    y = q.float().unflatten(-1, s.shape[-1:] + (block_size,)) * s.unsqueeze(-1)
    return y.flatten(-2).to(out_dtype or x.dtype)


class QuantAct(NamedTuple):
    """An activation x [..., K] with its FP8 quantization q [M, K] e4m3, s [M, K / 128] fp32 (M = x.numel() // K):
    exactly act_quant_ref(x, 128) in rows. A linear that quantizes its input (reference numerics, a quantized
    weight) may read q and s; every other reader takes x. Shape, dtype and device are x's."""

    x: torch.Tensor
    q: torch.Tensor
    s: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def dequantize(self) -> torch.Tensor:
        """q * s in fp32 with x's shape: act_quant_sim_ref(x, 128, out_dtype=torch.float32), bit for bit."""
        y = self.q.float().unflatten(-1, (self.s.shape[-1], -1)) * self.s.unsqueeze(-1)
        return y.flatten(-2).reshape(self.x.shape)


def quant_act_ref(x: torch.Tensor) -> QuantAct:
    """x [..., K] -> QuantAct(x, act_quant_ref(x, 128) in [M, K] / [M, K / 128] rows)."""
    q, s = act_quant_ref(x, 128)
    K = x.shape[-1]
    return QuantAct(x, q.reshape(-1, K), s.reshape(-1, K // 128))


def register_ops(register) -> None:
    register("act_quant", act_quant_ref, doc="FP8 e4m3 1 x block activation quantization, power-of-two scales")
