"""Walsh-Hadamard transform over the last dim (the reference's `rotate_activation`, SPEC 2.0).

Owns `hadamard_ref`: Sylvester-ordered H_n (H_2n = [[H_n, H_n], [H_n, -H_n]]) applied with
log2(n) fp32 butterflies, then scaled by n^-0.5, so the transform is orthonormal and its own
inverse. Used on the Lightning Indexer's q/k (n = 128) before FP4 simulation.
"""

import torch


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
