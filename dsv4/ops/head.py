"""LM head (SPEC §2.8): logits = z @ head^T in fp32.

`head_ref(z, w)`: z [..., D] (the normed hc-head output, activation dtype), w a dense PreparedLinear
[V, D] (bf16 as stored; the reference backend may hold an fp32 copy) -> fp32 logits [..., V]. bf16 x bf16
products are exact in fp32, so a kernel that reads the bf16 weight once differs only in summation order.
"""

from __future__ import annotations

import torch

from dsv4.ops.linear import PreparedLinear, linear_ref, load_triton_module


def head_ref(z: torch.Tensor, w: PreparedLinear) -> torch.Tensor:
    return linear_ref(z, w, False, torch.float32)


def _head_fast(z: torch.Tensor, w: PreparedLinear) -> torch.Tensor:
    from dsv4.ops import linear_triton

    return linear_triton.linear(z, w, False, torch.float32)


def register_ops(register) -> None:
    fast = _head_fast if hasattr(load_triton_module(), "linear") else None
    register("head", head_ref, fast, interpretable=True, doc="LM head GEMV/GEMM, fp32 logits")
