"""Lightning Indexer (SPEC §2.5): picks, per query, the top-k compressed entries a CSA layer attends to.

Keys come from the indexer's own overlapping compressor (d = index_head_dim). Queries are
`wq_b(qr)` RoPE'd with the compress table. Reference numerics rotate q and k by a Hadamard
transform and FP4-simulate them, and score in the activation dtype (bf16) as DeepSeek does;
exact numerics score in fp32. Score I[t,s] = sum_h w[t,h] * relu(q[t,h] . k[s]); the selection is
the top-k entry list in descending score order (ties: lower entry), -1 past the visible count.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4 import ops
from dsv4.config import ModelConfig
from dsv4.model.compressor import Compressor
from dsv4.model.layers import Linear, Numerics, Rope, StepPlan
from dsv4.state import CompressorState


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, numerics: Numerics, fmt: str, **fmt_opts):
        super().__init__()
        self.n_heads, self.dim, self.topk, self.ratio = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, ratio
        self.numerics = numerics
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.dim, fmt, numerics, **fmt_opts)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, "dense", numerics)
        self.compressor = Compressor(cfg.hidden_size, self.dim, ratio, True, cfg.rms_norm_eps, numerics, rotate=True)
        self.scale = self.dim ** -0.5 * self.n_heads ** -0.5

    def forward(self, q: torch.Tensor, w: torch.Tensor, plan: StepPlan, st: CompressorState, rope: Rope,
                n: int, n_vis: torch.Tensor) -> torch.Tensor:
        # q = wq_b(qr): [B,S,H*d]; w = weights_proj(x): [B,S,H] fp32 -> [B,S,min(topk, n)] int32 entry indices
        # (-1 = none). Its compressor (the keys) has run on this step's tokens already: the attention runs it,
        # with the other projections of x, beside the query path
        cos, sin = plan.rope(rope)
        q = q.unflatten(-1, (self.n_heads, self.dim))  # [B,S,H,d]
        ref = self.numerics.reference
        # RoPE, then (reference numerics) the Hadamard rotation + FP4 simulation in the same op
        q = ops.rotate_fp4(q, cos, sin) if ref else ops.rope(q, cos, sin, False)
        # head weights w * scale: under reference numerics the bf16 linear's output, scaled in bf16 (in the op)
        scores = ops.indexer_scores(q, w, st.entries[:, :n], ref, self.scale)
        return ops.topk_select(scores, n_vis, min(self.topk, n))
