"""A token drawn from softmax(logits / temperature) in one pass (the decode loop's default sampling), or from its
top-p nucleus (`nucleus_key_ref`: the ids whose logit has less than top_p of the mass strictly above it).

`sample_race_ref(logits, temperature, seed, call)`: logits [B, V] fp32 -> token ids [B] int64. The exponential race
of dsv4/sampling.py (argmax of p_i / E_i with E_i ~ Exp(1) is an exact draw from p) taken in log space:

    key_i = logits_i - temperature * log(E_i),    token = argmax_i key_i

which is argmax(p_i / E_i) multiplied through by the temperature, so no softmax, maximum or normalisation is needed
and a tiny temperature does not overflow (`race_temperature`: capped at TEMPERATURE_CAP, where the draw is already
uniform to fp32 precision). Among equal keys the smallest log(E_i) wins, then the lowest index: at a temperature too
small to move any key (keys = logits) the noise still splits the ties among the largest logits evenly, the limit a
vanishing temperature has. E_i comes from a counter-based generator, so the draw is a function of (seed, call, row, index)
alone and a fast kernel can make the same noise in any order:

- Philox4x32-10 (Salmon et al. 2011, Random123's constants) with counter (index, row, call mod 2^32, call >> 32) and
  key (seed mod 2^32, seed >> 32); its first output word w.
- v = fp32(w | 1) * 2^-32 (the odd word rounded to nearest even: exact below 2^24, in (0, 1], never 0), a uniform
  whose resolution follows its size down to 2^-32.
- E = -log(1 - v): for v <= 1/2 with s = v / (2 - v) <= 1/3, E = 2 atanh(s) = 2 s (1 + s^2/3 + ... + s^14/15)
  (truncation below 2^-29 of E), so a small E, the one that lets a token win, keeps its relative precision down to
  2.3e-10 whatever log does near 1; for v > 1/2, E = -log(max(1 - v, 2^-32)) (1 - v exact). log E lies in
  [-22.2, 3.1]: a token whose probability is below e^-25.3 (1e-11) of the most likely one's can never win, at most
  1.4e-6 of the mass at Flash's vocabulary.

A NaN logit counts as +inf (it wins, as torch's argmax would pick it). The fast kernel computes the same fp32 formula;
the GPU may fuse its multiply-adds and round its log another way, so the two pick the same token except where the
two best keys lie within a few ulps (the tests allow exactly that).
"""

from __future__ import annotations

import struct

import torch

TEMPERATURE_CAP = 1e30  # temperature * |log E| <= 1e30 * 23: finite; past it |x| / T < 1e-26 for logits below 1e4
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key increments (the golden ratio, sqrt(3) - 1)
_MASK32 = 0xFFFFFFFF
# 2 atanh(s) / (2 s) = sum s^(2j) / (2j + 1), j = 0..7, as a Horner polynomial in s^2 (highest first)
ATANH_COEFFS = tuple(1.0 / (2 * j + 1) for j in range(7, -1, -1))


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * m for uint32 values held in int64 (16-bit halves: no int64 overflow)."""
    a1, a0 = a >> 16, a & 0xFFFF
    m1, m0 = m >> 16, m & 0xFFFF
    mid = a1 * m0 + a0 * m1  # < 2^33
    lo_full = a0 * m0 + ((mid & 0xFFFF) << 16)  # < 2^33
    return a1 * m1 + (mid >> 16) + (lo_full >> 32), lo_full & _MASK32


def philox4x32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox4x32 over int64 tensors holding uint32 words (broadcast together) -> the four output words."""
    dev = next((c.device for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)), None)  # (Python ints join it)
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64, device=dev)
                                               for c in (c0, c1, c2, c3)))
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def race_noise_ref(B: int, V: int, seed: int, call: int, device="cpu") -> torch.Tensor:
    """log(E) [B, V] fp32: the race's noise for draw `call` of stream `seed` (the module docstring's steps)."""
    idx = torch.arange(V, dtype=torch.int64, device=device)[None, :]
    row = torch.arange(B, dtype=torch.int64, device=device)[:, None]
    w, *_ = philox4x32(idx, row, call & _MASK32, (call >> 32) & _MASK32, seed & _MASK32, (seed >> 32) & _MASK32)
    return log_exp1_ref(w)


def log_exp1_ref(w: torch.Tensor) -> torch.Tensor:
    """Philox words (uint32 values in int64) -> log(E) fp32, E ~ Exp(1) (the module docstring's steps)."""
    v = (w | 1).to(torch.float32) * 2.0**-32
    s = v / (2.0 - v)
    s2 = s * s
    poly = torch.full_like(s, ATANH_COEFFS[0])
    for c in ATANH_COEFFS[1:]:
        poly = poly * s2 + c
    e = torch.where(v <= 0.5, 2.0 * s * poly, -torch.log(torch.clamp_min(1.0 - v, 2.0**-32)))
    return torch.log(e)


def check_race_args(logits: torch.Tensor, temperature: float, seed: int, call: int, top_p: float = 1.0) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] == 0:
        raise ValueError(f"sample_race: logits must be float32 [batch, vocab], got {logits.dtype}{tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"sample_race: temperature must be > 0, got {temperature}")
    if not 0 <= seed < 1 << 64 or not 0 <= call < 1 << 63:
        raise ValueError(f"sample_race: seed must be in [0, 2^64) and call in [0, 2^63), got {seed}, {call}")
    if not 0 < top_p <= 1:
        raise ValueError(f"sample_race: top_p must be in (0, 1], got {top_p}")


def race_temperature(temperature: float) -> float:
    """The temperature the race multiplies by: capped at TEMPERATURE_CAP, then rounded to fp32 (one below fp32's
    smallest subnormal becomes 0, and the keys are the logits: the ties among the largest are left to the noise)."""
    return struct.unpack("f", struct.pack("f", min(float(temperature), TEMPERATURE_CAP)))[0]


def order_key_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> its order as a uint32 value (in int64): x < y exactly when key(x) < key(y); -0.0 counts as +0.0."""
    b = torch.where(x == 0, torch.zeros_like(x), x).view(torch.int32).to(torch.int64)
    return torch.where(b < 0, ~b, b | (1 << 31)) & _MASK32


def nucleus_key_ref(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[B, V] -> [B] int64: the order key of the smallest logit the nucleus keeps (0, all, where a row's largest logit
    is not finite, NaN included). The nucleus of top_p < 1: the ids whose logit x has mass strictly above it, sum of
    p_j over x_j > x (p = softmax(logits / T) in float64), below top_p; so every id tied with the smallest kept one
    is kept, and the most likely always is (a top_p too small for fp32, as the kernel takes it, keeps just those).
    (`sample` keeps a prefix of the sorted ids instead: the same set but for ties.)"""
    t = max(race_temperature(temperature), 2.0**-126)
    out = torch.zeros(logits.shape[0], dtype=torch.int64)
    for r, x in enumerate(logits.detach().cpu().double()):
        m = x.max()
        if not torch.isfinite(m):
            continue
        p = torch.exp((x - m) / t)
        p = p / p.sum()
        vals, inv = torch.unique(x, sorted=True, return_inverse=True)  # ascending
        mass = torch.zeros_like(vals).index_add_(0, inv, p)
        above = mass.flip(0).cumsum(0).flip(0) - mass  # strictly above each value
        kept = vals[(above < struct.unpack("f", struct.pack("f", top_p))[0]) | (above == 0)]
        out[r] = int(order_key_ref(kept.min().float().reshape(1))[0])
    return out


def sample_race_ref(logits: torch.Tensor, temperature: float, seed: int, call: int,
                    top_p: float = 1.0) -> torch.Tensor:
    """logits [B, V] fp32 -> [B] int64: draw `call` of stream `seed` from softmax(logits / temperature), restricted
    to the nucleus of top_p (nucleus_key_ref) when top_p < 1."""
    check_race_args(logits, temperature, seed, call, top_p)
    B, V = logits.shape
    noise = race_noise_ref(B, V, seed, call, logits.device)
    key = logits - race_temperature(temperature) * noise
    if top_p < 1:
        keep = order_key_ref(logits) >= nucleus_key_ref(logits, temperature, top_p).to(logits.device)[:, None]
        key = torch.where(keep | torch.isnan(logits), key, -torch.inf)
    key = torch.where(torch.isnan(key), torch.inf, key)
    best = key == key.amax(-1, keepdim=True)
    noise = torch.where(best, noise, torch.inf)
    return (best & (noise == noise.amin(-1, keepdim=True))).int().argmax(dim=-1)


def register_ops(register) -> None:
    try:
        from dsv4.ops import sample_triton as fast
    except ImportError:  # no Triton here: the reference runs
        fast = None
    register("sample_race", sample_race_ref, getattr(fast, "sample_race", None), interpretable=True,
             doc="a token from softmax(logits / T) (or its top-p nucleus) by an exponential race on counter-based "
                 "noise: one launch, six with top-p")
