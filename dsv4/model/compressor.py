"""KV compressor (SPEC §2.4): pools every `ratio` tokens into one compressed KV entry.

HCA (ratio != 4): softmax over the window's tokens, per channel, of gate+ape scores. CSA (ratio 4):
overlapping windows of width 8, stride 4: the previous window's first halves (A) join the current
window's second halves (B). Projections and pooling run in fp32 with fp32 weights; the entry is cast
to the activation dtype, RMS-normed, RoPE'd at position w*ratio and quantization-simulated.
Works on chunks of any length with boundaries anywhere: incomplete windows live in the state.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.layers import Linear, Numerics, RMSNorm, Rope
from dsv4.ops.act_quant import act_quant_sim_ref
from dsv4.ops.fp4_quant import fp4_act_quant_sim_ref
from dsv4.ops.hadamard import hadamard_ref
from dsv4.state import CompressorState


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, rope_dim: int, eps: float,
                 numerics: Numerics, rotate: bool):
        super().__init__()
        self.dim, self.ratio, self.overlap, self.rope_dim = dim, ratio, overlap, rope_dim
        self.rotate = rotate  # indexer keys: Hadamard + FP4 simulation instead of FP8 KV simulation
        self.numerics = numerics
        coff = 2 if overlap else 1
        self.wkv = Linear(hidden, coff * dim, "dense", numerics)
        self.wgate = Linear(hidden, coff * dim, "dense", numerics)
        self.register_buffer("ape", torch.zeros(ratio, coff * dim, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, p0: int, st: CompressorState, rope: Rope) -> None:
        # x: [B,S,hidden] (attn_norm output), tokens at positions p0..p0+S-1. Writes the entries of
        # every window that closes in this chunk into st.entries and keeps the rest in st.kv/score.
        B, S, _ = x.shape
        r, d = self.ratio, self.dim
        pos = torch.arange(p0, p0 + S, device=x.device)
        c = self.wkv(x, torch.float32)  # [B,S,coff*d] fp32 (fp32 weights and input, SPEC §5.16)
        g = self.wgate(x, torch.float32) + self.ape[pos % r]
        k0, w0 = p0 % r, p0 // r  # tokens of the open window already buffered; its window index
        cur = r if self.overlap else 0  # slot offset of the open window in the state
        vc = torch.cat((st.kv[:, cur:cur + k0], c), 1)  # [B, k0+S, coff*d]
        vg = torch.cat((st.score[:, cur:cur + k0], g), 1)
        n = (k0 + S) // r  # windows that close in this chunk
        if n > 0:
            wc = vc[:, : n * r].unflatten(1, (n, r))  # [B,n,r,coff*d]
            wg = vg[:, : n * r].unflatten(1, (n, r))
            if self.overlap:
                prev_c = torch.cat((st.kv[:, None, :r, :d], wc[:, :-1, :, :d]), 1)  # A halves of w-1
                prev_g = torch.cat((st.score[:, None, :r, :d], wg[:, :-1, :, :d]), 1)
                vals = torch.cat((prev_c, wc[..., d:]), 2)  # [B,n,2r,d]
                gates = torch.cat((prev_g, wg[..., d:]), 2)
                st.kv[:, :r] = wc[:, -1]  # the last closed window becomes the previous window
                st.score[:, :r] = wg[:, -1]
            else:
                vals, gates = wc, wg
            e = (vals * gates.softmax(dim=2)).sum(2)  # [B,n,d] fp32
            st.entries[:, w0:w0 + n] = self._finish(e, torch.arange(w0, w0 + n, device=x.device) * r, rope)
        rem = k0 + S - n * r
        st.kv[:, cur:cur + rem] = vc[:, n * r:]
        st.score[:, cur:cur + rem] = vg[:, n * r:]

    def decode_step(self, x: torch.Tensor, pos: torch.Tensor, st: CompressorState, rope: Rope) -> None:
        # x: [B,1,hidden] at the device position pos ([1] int64). Branch-free (CUDA-graph safe): the
        # token is written to its slot, the open window is always pooled, and the entry (and the CSA
        # window rotation) is kept only when this token closes the window.
        r, d = self.ratio, self.dim
        c = self.wkv(x, torch.float32)  # [B,1,coff*d]
        g = self.wgate(x, torch.float32) + self.ape[pos % r]
        slot = (r if self.overlap else 0) + pos % r
        st.kv.index_copy_(1, slot, c)
        st.score.index_copy_(1, slot, g)
        if self.overlap:
            vals = torch.cat((st.kv[:, :r, :d], st.kv[:, r:, d:]), 1)  # [B,2r,d]
            gates = torch.cat((st.score[:, :r, :d], st.score[:, r:, d:]), 1)
        else:
            vals, gates = st.kv, st.score
        e = (vals * gates.softmax(dim=1)).sum(1, keepdim=True)  # [B,1,d] fp32
        w = pos // r
        e = self._finish(e, w * r, rope)
        emit = (pos + 1) % r == 0  # [1] bool, on the device
        st.entries.index_copy_(1, w, torch.where(emit, e, st.entries.index_select(1, w)))
        if self.overlap:  # the closed window becomes the previous one
            st.kv[:, :r] = torch.where(emit, st.kv[:, r:], st.kv[:, :r])
            st.score[:, :r] = torch.where(emit, st.score[:, r:], st.score[:, :r])

    def _finish(self, e: torch.Tensor, pos: torch.Tensor, rope: Rope) -> torch.Tensor:
        # e: [B,n,d] fp32 pooled entries at RoPE positions pos [n] -> [B,n,d] activation dtype
        e = self.norm(e.to(self.numerics.dtype))
        e = rope.apply(e, pos)
        if self.numerics.reference:
            if self.rotate:
                e = fp4_act_quant_sim_ref(hadamard_ref(e), 32)
            else:
                nope = self.dim - self.rope_dim
                e = torch.cat((act_quant_sim_ref(e[..., :nope], 64), e[..., nope:]), -1)
        return e
