"""FP4 e2m1 rounding and the reference "FP4-simulate" of activations (SPEC 2.0, 3.3).

Owns the e2m1 grid (E2M1_LUT, the signed 16-entry decode table: bit 3 = sign, bits 2..0 =
magnitude code), round-to-nearest-even onto it, and `fp4_act_quant_sim_ref`: 1 x 32 blocks,
amax floored at 6*2^-126, scale 2^ceil(log2(amax * fp32(1/6))), x <- e2m1(clamp(x/s, +-6))*s;
`fp4_act_quant_ref` gives the same rounding as (codes, scales), the form packed indexer keys store.
Only the Lightning Indexer's q/k use the simulation; formats.py reuses the encoder for packing.
"""

import torch

from dsv4.ops.act_quant import ue8m0_ceil_ref

FP4_MAX = 6.0
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32).item()  # kernel's fp4_max_inv

# Decode table indexed by a 4-bit code; code & 7 indexes the magnitude, code & 8 is the sign.
E2M1_LUT = torch.tensor(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32
)
_LUT_ON: dict[torch.device, torch.Tensor] = {}


def e2m1_lut(device) -> torch.Tensor:
    """E2M1_LUT on `device`, copied there once: per-call host-to-device copies would break CUDA-graph
    capture (first use must happen outside capture, e.g. in a warm-up step)."""
    device = torch.device(device)
    if device not in _LUT_ON:
        _LUT_ON[device] = E2M1_LUT.to(device)
    return _LUT_ON[device]


# Midpoint between magnitude codes i and i+1, and whether a tie there rounds up: ties go to the
# even code, i.e. up exactly when i is odd (.75->1, 1.75->2, 3.5->4; .25->0, 1.25->1, 2.5->2, 5->4).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_encode_ref(t: torch.Tensor) -> torch.Tensor:
    """t: any shape, values meant to lie in [-6, 6] (larger magnitudes saturate to 6) ->
    uint8 codes 0..15, RNE onto the e2m1 grid; the sign bit follows t's sign bit (-0.1 -> -0)."""
    a = t.float().abs()
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i, m in enumerate(_MIDPOINTS):
        mag += (a >= m) if i % 2 else (a > m)
    return mag | (torch.signbit(t).to(torch.uint8) << 3)


def e2m1_round_ref(t: torch.Tensor) -> torch.Tensor:
    """t -> fp32 values of t rounded (RNE) onto the signed e2m1 grid; same shape."""
    return e2m1_lut(t.device)[e2m1_encode_ref(t).long()]


def fp4_act_quant_ref(x: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., K] (K % block_size == 0) -> (codes [..., K] uint8 e2m1 codes 0..15, scales [..., K / block_size] fp32
    powers of two): the simulation's own rounding, so E2M1_LUT[codes] * scales is fp4_act_quant_sim_ref(x)."""
    if x.dim() == 0 or block_size <= 0 or x.shape[-1] % block_size != 0:
        raise ValueError(
            f"last dim of {tuple(x.shape)} must be a multiple of block_size={block_size}"
        )
    xb = x.float().unflatten(-1, (x.shape[-1] // block_size, block_size))  # [..., K/b, b]
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)  # [..., K/b, 1]
    s = ue8m0_ceil_ref(amax * FP4_MAX_INV)
    codes = e2m1_encode_ref((xb / s).clamp(-FP4_MAX, FP4_MAX))  # exact: s is a power of two
    return codes.flatten(-2), s.squeeze(-1)


def fp4_act_quant_sim_ref(x: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """x: [..., K] (K % block_size == 0) -> FP4-simulated x, same shape and dtype; fp32 math."""
    codes, s = fp4_act_quant_ref(x, block_size)
    y = e2m1_lut(x.device)[codes.long()].unflatten(-1, (-1, block_size)) * s[..., None]  # exact
    return y.flatten(-2).to(x.dtype)
