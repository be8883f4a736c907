"""Building blocks shared by the model modules: numerics context, RMSNorm, format-aware Linear, RoPE.

`Numerics` says how a model computes: `exact` (no quantization simulation; what transformers
computes) or `reference` (DeepSeek's numerics, SPEC §2.0), and the activation dtype kept between ops.
`Linear` holds a weight in its stored format (official tensor names as buffer names: `weight`,
`scale`, ...) and multiplies through `dsv4.formats`; it never keeps a dequantized copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dsv4 import formats
from dsv4.config import YarnConfig
from dsv4.ops.act_quant import act_quant_sim_ref

NUMERICS = ("exact", "reference")


@dataclass(frozen=True)
class Numerics:
    mode: str = "exact"  # "exact" | "reference"
    dtype: torch.dtype = torch.float32  # activation / residual dtype between ops

    def __post_init__(self):
        if self.mode not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.mode!r}")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"activation dtype must be float32 or bfloat16, got {self.dtype}")

    @property
    def reference(self) -> bool:
        return self.mode == "reference"


class RMSNorm(nn.Module):
    """Weighted RMSNorm: statistic and scaling in fp32, result cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, dtype=torch.bfloat16):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class Linear(nn.Module):
    """y = x @ W^T with W stored in one of `dsv4.formats` (dense, fp8, mxfp4, nvfp4).

    Reference numerics quantize the activation to FP8 1x128 (power-of-two scales) before a
    quantized weight (W8A8 / W4A8), unless `act_quant=False` (wo_a, SPEC §2.0); exact numerics
    never do. The GEMM runs in fp32 and the result is returned in `out_dtype` (default: x's dtype).
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, numerics: Numerics, *,
                 act_quant: bool = True, **fmt_opts):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt = fmt
        self.numerics = numerics
        self.act_quant = act_quant
        self.cls = formats.FORMATS[fmt]
        for name, (shape, dtype) in self.cls.layout(out_features, in_features, **fmt_opts).items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    @property
    def quantized(self) -> bool:
        return self.fmt != "dense"

    def stored(self):
        """The weight as its explicit format container (data + scale tensors, no copy)."""
        return self.cls(**dict(self._buffers))

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.stored().dequantize(dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, stored=None) -> torch.Tensor:
        # stored: optional other weight of this layer's shape and format (e.g. an expert gathered by a
        # device-side index in the CUDA-graph decode step); default: this layer's own weight
        w = (stored or self.stored()).dequantize(torch.float32)
        xf = x.float()
        if self.numerics.reference and self.quantized and self.act_quant:
            xf = act_quant_sim_ref(xf, 128)
        return (xf @ w.T).to(out_dtype or x.dtype)


# --------------------------------------------------------------------------------------------------
# RoPE: interleaved pairs (x[2i], x[2i+1]) on the LAST `rope_dim` dims of a head (SPEC §2.3.3)


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnConfig | None) -> torch.Tensor:
    """[rope_dim/2] fp32 angular frequencies; YaRN blends in omega/factor above the ramp (no mscale)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return freqs

    def corr_dim(n_rot: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (freqs / yarn.factor) * ramp + freqs * (1 - ramp)


class Rope:
    """cos/sin tables [max_pos, rope_dim/2] (fp32) for one RoPE kind, computed once per model."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnConfig | None, max_pos: int, device=None):
        self.rope_dim = rope_dim
        inv = rope_inv_freq(rope_dim, theta, yarn).to(device)
        ang = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos(), ang.sin()

    def apply(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: [..., S, (H,) D] rotated on its last rope_dim dims at positions pos [S] (or [..., S])."""
        rd = self.rope_dim
        cos, sin = self.cos[pos], self.sin[pos]  # [S, rd/2]
        if inverse:
            sin = -sin
        while cos.dim() < x.dim() - 1:  # broadcast over head dims between S and D
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        r = x[..., -rd:].float().unflatten(-1, (rd // 2, 2))
        a, b = r[..., 0], r[..., 1]
        rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., :-rd], rot.to(x.dtype)), dim=-1)
