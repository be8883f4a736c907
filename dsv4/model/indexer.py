"""Lightning Indexer (SPEC §2.5): picks, per query, the top-k compressed entries a CSA layer attends to.

Keys come from the indexer's own overlapping compressor (d = index_head_dim). Queries are
`wq_b(qr)` RoPE'd with the compress table. Reference numerics rotate q and k by a Hadamard
transform and FP4-simulate them, and score in the activation dtype (bf16) as DeepSeek does;
exact numerics score in fp32. Score I[t,s] = sum_h w[t,h] * relu(q[t,h] . k[s]).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config import ModelConfig
from dsv4.model.compressor import Compressor
from dsv4.model.layers import Linear, Numerics, Rope
from dsv4.ops.fp4_quant import fp4_act_quant_sim_ref
from dsv4.ops.hadamard import hadamard_ref
from dsv4.state import CompressorState


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, numerics: Numerics, fmt: str, **fmt_opts):
        super().__init__()
        self.n_heads, self.dim, self.topk, self.ratio = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, ratio
        self.numerics = numerics
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.dim, fmt, numerics, **fmt_opts)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, "dense", numerics)
        self.compressor = Compressor(cfg.hidden_size, self.dim, ratio, True, cfg.qk_rope_head_dim,
                                     cfg.rms_norm_eps, numerics, rotate=True)
        self.scale = self.dim ** -0.5 * self.n_heads ** -0.5

    def forward(self, x: torch.Tensor, qr: torch.Tensor, p0: int, st: CompressorState, rope: Rope) -> torch.Tensor:
        # x: [B,S,hidden], qr: [B,S,q_lora] -> selected: [B,S,n] bool over the n = (p0+S)//ratio entries
        B, S, _ = x.shape
        self.compressor(x, p0, st, rope)
        n = (p0 + S) // self.ratio
        pos = torch.arange(p0, p0 + S, device=x.device)
        if n == 0:
            return torch.zeros(B, S, 0, dtype=torch.bool, device=x.device)
        return self._select(self._scores(x, qr, pos, st.entries[:, :n], rope), pos, n)

    def _scores(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, rope: Rope) -> torch.Tensor:
        # queries at positions pos vs keys k [B,n,d] -> I [B,S,n]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.dim))  # [B,S,H,d]
        q = rope.apply(q, pos)
        if self.numerics.reference:
            q = fp4_act_quant_sim_ref(hadamard_ref(q), 32)
            w = self.weights_proj(x) * self.scale  # [B,S,H] bf16 linear, bf16 scaling
            score = torch.relu(torch.einsum("bshd,btd->bsht", q, k.to(q.dtype)))
            score = (score * w.unsqueeze(-1)).sum(2)  # [B,S,n] in the activation dtype
        else:
            w = self.weights_proj(x, torch.float32) * self.scale
            score = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()))
            score = (score * w.unsqueeze(-1)).sum(2)
        return score

    def decode_step(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, st: CompressorState,
                    rope: Rope) -> torch.Tensor:
        # x: [B,1,hidden] at device position pos [1] -> selected [B,1,N] over ALL N cache slots
        # (static shape for CUDA graphs; slots not yet emitted are masked out)
        self.compressor.decode_step(x, pos, st, rope)
        return self._select(self._scores(x, qr, pos, st.entries, rope), pos, st.entries.shape[1])

    def _select(self, score: torch.Tensor, pos: torch.Tensor, n: int) -> torch.Tensor:
        # score: [B,S,n] -> top-k of the entries visible to each query, as a [B,S,n] bool mask
        B, S, _ = score.shape
        visible = torch.arange(n, device=score.device)[None, :] < ((pos + 1) // self.ratio)[:, None]  # [S,n]
        score = score.float().masked_fill(~visible, float("-inf"))
        k_sel = min(self.topk, n)
        # stable sort: equal scores (exact zeros are common after the ReLU) resolve to the lower entry
        # index, so the selection does not depend on how the sequence was chunked
        idx = score.sort(dim=-1, descending=True, stable=True).indices[..., :k_sel]  # [B,S,k]
        selected = torch.zeros(B, S, n, dtype=torch.bool, device=score.device)
        selected.scatter_(-1, idx, True)
        return selected & visible
