"""Walsh-Hadamard transform over the last dim (the reference's `rotate_activation`, SPEC 2.0), and the op
`rotate_fp4` built on it.

Owns `hadamard_ref`: Sylvester-ordered H_n (H_2n = [[H_n, H_n], [H_n, -H_n]]) applied with
log2(n) fp32 butterflies, then scaled by n^-0.5, so the transform is orthonormal and its own
inverse. Used on the Lightning Indexer's q/k (n = 128) before FP4 simulation:
`rotate_fp4_ref(x)` = fp4_act_quant_sim_ref(hadamard_ref(x), 32) (reference numerics' indexer queries; the
compressor applies the same to the keys it emits); given (cos, sin), x's RoPE comes first in the same op
(rope_ref, rounded to x's dtype: the indexer's queries). Fast path: dsv4/ops/hadamard_triton.py (one launch).
"""

import torch

from dsv4.ops.fp4_quant import fp4_act_quant_sim_ref
from dsv4.ops.rope import rope_ref


def hadamard_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., n] with n a power of two -> (x @ H_n) * n^-0.5, same shape and dtype; fp32 math."""
    n = x.shape[-1] if x.dim() else 0
    if n < 1 or n & (n - 1):
        raise ValueError(
            f"hadamard_ref: last dim must be a power of two, got shape {tuple(x.shape)}"
        )
    y = x.float()
    h = 1
    while h < n:
        # Pair element j with j + h inside each 2h-chunk: (a, b) -> (a + b, a - b).
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y.select(-2, 0), y.select(-2, 1)
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)


def rotate_fp4_ref(x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., n] -> the FP4 simulation (1 x 32 blocks) of its Hadamard rotation, same shape and dtype; with cos,
    sin [S, rd/2] (x [B, S, (H,) n]) x's last rd dims are RoPE-rotated first (rope_ref)."""
    if cos is not None:
        x = rope_ref(x, cos, sin)
    return fp4_act_quant_sim_ref(hadamard_ref(x), 32)


def register_ops(register) -> None:
    try:
        from dsv4.ops import hadamard_triton as fast
    except ImportError:  # no Triton here: the reference runs
        fast = None
    register("rotate_fp4", rotate_fp4_ref, getattr(fast, "rotate_fp4", None), interpretable=True,
             doc="Hadamard rotation + FP4 simulation (the indexer's queries under reference numerics)")
