"""RMSNorm (SPEC §2.0): statistic and scaling in fp32, the result cast back to the input dtype.

`rmsnorm_ref(x, w, eps)`: y = (w * (x * rsqrt(mean(x^2) + eps))) in x.dtype, w upcast to fp32.
`rmsnorm_quant_ref(x, w, eps)`: the same y with its FP8 1x128 activation quantization (a `QuantAct`), for a norm
whose output feeds a linear that quantizes its input (the query's low-rank norm before wq_b).
"""

from __future__ import annotations

import torch

from dsv4.ops.act_quant import QuantAct, quant_act_ref


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], w [D] -> [..., D] in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (w.float() * xf).to(x.dtype)


def rmsnorm_quant_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> QuantAct:
    """x [..., D] (D % 128 == 0), w [D] -> QuantAct(y = rmsnorm_ref(x, w, eps), act_quant_ref(y, 128))."""
    if x.shape[-1] % 128:
        raise ValueError(f"rmsnorm_quant: D={x.shape[-1]} must be a multiple of 128")
    return quant_act_ref(rmsnorm_ref(x, w, eps))


def register_ops(register) -> None:
    try:
        from dsv4.ops import norm_rope_triton as fast
    except ImportError:  # no Triton here: the reference runs
        fast = None
    register("rmsnorm", rmsnorm_ref, getattr(fast, "rmsnorm", None), interpretable=True,
             doc="weighted RMSNorm, fp32 statistic")
    register("rmsnorm_quant", rmsnorm_quant_ref, getattr(fast, "rmsnorm_quant", None), interpretable=True,
             doc="weighted RMSNorm + the FP8 1x128 quantization of its output for the next linear")
