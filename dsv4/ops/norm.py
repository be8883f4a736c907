"""RMSNorm (SPEC §2.0): statistic and scaling in fp32, the result cast back to the input dtype.

`rmsnorm_ref(x, w, eps)`: y = (w * (x * rsqrt(mean(x^2) + eps))) in x.dtype, w upcast to fp32.
"""

from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], w [D] -> [..., D] in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (w.float() * xf).to(x.dtype)


def register_ops(register) -> None:
    try:
        from dsv4.ops import norm_rope_triton as fast
    except ImportError:  # no Triton here: the reference runs
        fast = None
    register("rmsnorm", rmsnorm_ref, getattr(fast, "rmsnorm", None), interpretable=True,
             doc="weighted RMSNorm, fp32 statistic")
