"""Attention block (SPEC §2.3): MQA over one latent 512-dim KV head with an attention sink.

A query at position t sees the sliding window (the last `sliding_window` tokens including t) plus,
in CSA/HCA layers, compressed entries w with (w+1)*ratio <= t+1 (CSA: only the indexer's top-k).
K = V, so the output's RoPE dims are rotated back by -t before the grouped low-rank projection
(wo_a in the activation dtype without activation quantization, then wo_b). Chunks of any length
are processed against the window ring and compressed entries kept in `BlockState`.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config import LayerSpec, ModelConfig
from dsv4.model.compressor import Compressor
from dsv4.model.indexer import Indexer
from dsv4.model.layers import Linear, Numerics, RMSNorm, Rope
from dsv4.ops.act_quant import act_quant_sim_ref
from dsv4.ops.sparse_attn import sparse_attn_ref
from dsv4.state import BlockState


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, numerics: Numerics, fmt: str, **fmt_opts):
        super().__init__()
        self.spec, self.numerics = spec, numerics
        self.n_heads, self.head_dim, self.rope_dim = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        self.nope_dim = cfg.nope_head_dim
        self.window, self.eps, self.o_groups = cfg.sliding_window, cfg.rms_norm_eps, cfg.o_groups
        D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a = Linear(D, cfg.q_lora_rank, fmt, numerics, **fmt_opts)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * hd, fmt, numerics, **fmt_opts)
        self.wkv = Linear(D, hd, fmt, numerics, **fmt_opts)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        # wo_a: stored FP8 like the others, but DeepSeek runs it dequantized (bf16 einsum, no act quant)
        self.wo_a = Linear(cfg.o_group_in, cfg.o_groups * cfg.o_lora_rank, fmt, numerics, act_quant=False, **fmt_opts)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, D, fmt, numerics, **fmt_opts)
        self.register_buffer("attn_sink", torch.zeros(H, dtype=torch.float32))
        self.compressor = None
        self.indexer = None
        if spec.ratio > 0:
            self.compressor = Compressor(D, hd, spec.ratio, spec.overlap, self.rope_dim, cfg.rms_norm_eps,
                                         numerics, rotate=False)
        if spec.has_indexer:
            self.indexer = Indexer(cfg, spec.ratio, numerics, fmt, **fmt_opts)

    def _fp8_kv(self, kv: torch.Tensor) -> torch.Tensor:
        # FP8-simulate the no-RoPE dims (block 64, power-of-two scales); RoPE dims stay as they are
        if not self.numerics.reference:
            return kv
        return torch.cat((act_quant_sim_ref(kv[..., : self.nope_dim], 64), kv[..., self.nope_dim:]), -1)

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor, rope: Rope):
        # x: [B,S,D] at positions pos [S] -> qr [B,S,q_lora], q [B,S,H,hd], kv [B,S,hd]
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        if self.numerics.reference:  # DeepSeek computes the per-head RMS statistic in bf16
            q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)
        else:
            q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = rope.apply(q, pos)
        kv = self._fp8_kv(rope.apply(self.kv_norm(self.wkv(x)), pos))
        return qr, q, kv

    def _output(self, o: torch.Tensor, pos: torch.Tensor, rope: Rope) -> torch.Tensor:
        # o: [B,S,H,hd] -> [B,S,D]: undo the RoPE of V = K, grouped low-rank projection
        o = rope.apply(o, pos, inverse=True)
        og = o.flatten(2).unflatten(-1, (self.o_groups, -1))  # [B,S,G,H*hd/G]
        dt = self.numerics.dtype
        wo_a = self.wo_a.dequantize(dt).unflatten(0, (self.o_groups, -1))  # [G,o_lora,H*hd/G]
        z = torch.einsum("bsgd,grd->bsgr", og.to(dt), wo_a)  # activation dtype, as DeepSeek's bf16 einsum
        return self.wo_b(z.flatten(2))

    def forward(self, x: torch.Tensor, p0: int, st: BlockState, rope: Rope) -> torch.Tensor:
        # x: [B,S,D] (attn_norm output) at positions p0..p0+S-1 -> [B,S,D]
        B, S, _ = x.shape
        pos = torch.arange(p0, p0 + S, device=x.device)
        qr, q, kv = self._qkv(x, pos, rope)

        # keys: window ring (positions < p0) ++ this chunk's raw kv ++ compressed entries
        W = self.window
        slot = torch.arange(W, device=x.device)
        ring_pos = (p0 - 1) - torch.remainder(p0 - 1 - slot, W)  # latest position stored in each slot
        ring_vis = (ring_pos[None, :] >= 0) & (pos[:, None] - ring_pos[None, :] < W)  # [S,W]
        d = pos[:, None] - pos[None, :]
        chunk_vis = (d >= 0) & (d < W)  # [S,S]
        keys = [st.window, kv]
        vis = [ring_vis.expand(B, S, W), chunk_vis.expand(B, S, S)]
        if self.compressor is not None:
            self.compressor(x, p0, st.compressor, rope)
            n = (p0 + S) // self.spec.ratio
            comp_vis = torch.arange(n, device=x.device)[None, :] < ((pos + 1) // self.spec.ratio)[:, None]
            comp_vis = comp_vis.expand(B, S, n)
            if self.indexer is not None:
                comp_vis = self.indexer(x, qr, p0, st.indexer, rope)
            keys.append(st.compressor.entries[:, :n])
            vis.append(comp_vis)
        o = sparse_attn_ref(q, torch.cat(keys, 1), torch.cat(vis, -1), self.attn_sink, self.head_dim ** -0.5)

        # the ring keeps the last W raw kv vectors, slot = position mod W
        keep = min(S, W)
        st.window[:, pos[-keep:] % W] = kv[:, -keep:]
        return self._output(o, pos, rope)

    def decode_step(self, x: torch.Tensor, pos: torch.Tensor, st: BlockState, rope: Rope) -> torch.Tensor:
        # x: [B,1,D] at the device position pos ([1] int64) -> [B,1,D]. Static shapes and no host
        # decision: the token is written to its ring slot first, then attends over all W slots and
        # all compressed-entry slots, with visibility computed from pos on the device.
        B = x.shape[0]
        qr, q, kv = self._qkv(x, pos, rope)
        W = self.window
        st.window.index_copy_(1, pos % W, kv)
        slot = torch.arange(W, device=x.device)
        ring_pos = pos - torch.remainder(pos - slot, W)  # latest position <= pos stored in each slot
        keys, vis = [st.window], [(ring_pos >= 0).expand(B, 1, W)]
        if self.compressor is not None:
            self.compressor.decode_step(x, pos, st.compressor, rope)
            n = st.compressor.entries.shape[1]
            comp_vis = (torch.arange(n, device=x.device) < (pos + 1) // self.spec.ratio).expand(B, 1, n)
            if self.indexer is not None:
                comp_vis = self.indexer.decode_step(x, qr, pos, st.indexer, rope)
            keys.append(st.compressor.entries)
            vis.append(comp_vis)
        o = sparse_attn_ref(q, torch.cat(keys, 1), torch.cat(vis, -1), self.attn_sink, self.head_dim ** -0.5)
        return self._output(o, pos, rope)
