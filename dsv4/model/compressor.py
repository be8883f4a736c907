"""KV compressor (SPEC §2.4): pools every `ratio` tokens into one compressed KV entry.

HCA (ratio != 4): softmax over the window's tokens, per channel, of gate+ape scores. CSA (ratio 4):
overlapping windows of width 8, stride 4: the previous window's first halves (A) join the current
window's second halves (B). Projections are fp32 (the attention runs them, fused, on its input);
pooling, norm, RoPE at position w*ratio, quantization simulation and the insert are `ops.compressor`,
which works on chunks of any length with boundaries anywhere (incomplete windows live in the state).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4 import ops
from dsv4.model.layers import Linear, Numerics, RMSNorm, Rope, StepPlan
from dsv4.state import CompressorState


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, numerics: Numerics,
                 rotate: bool):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.rotate = rotate  # indexer keys: Hadamard + FP4 simulation instead of FP8 KV simulation
        self.numerics = numerics
        coff = 2 if overlap else 1
        self.wkv = Linear(hidden, coff * dim, "dense", numerics)
        self.wgate = Linear(hidden, coff * dim, "dense", numerics)
        self.register_buffer("ape", torch.zeros(ratio, coff * dim, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)

    def forward(self, c: torch.Tensor, g: torch.Tensor, plan: StepPlan | None, st: CompressorState, rope: Rope,
                start: torch.Tensor | None = None, window: bool = False) -> None:
        # c = wkv(x), g = wgate(x): [B,S,coff*d] fp32 projections of the attn_norm output (SPEC §5.16; the
        # attention runs them fused) at plan.pos (or from `start`, a [1] int64 device position): emits the entries of
        # the windows that close into st.entries and keeps the open window (and CSA's previous one) in st.kv / st.score;
        # window: c / g are one whole window's rows from its start (ops.compressor)
        quant = ("fp4" if self.rotate else "fp8") if self.numerics.reference else None
        ops.compressor(c, g, self.ape, self.norm.weight, self.norm.eps, rope.cos, rope.sin, st.kv, st.score,
                       st.entries, plan.start if start is None else start, self.ratio, self.overlap, quant,
                       window=window)
