"""Mixture of experts (SPEC §2.7): router (hash or score + bias), clamped-SwiGLU experts, shared expert.

The router runs in fp32: scores = sqrt(softplus(x W^T)) (or sigmoid / softmax); hash layers take the
experts from `tid2eid[token]`, others the top-k of scores + bias (bias selects only). Weights are the
un-biased scores of the chosen experts, normalised and scaled. A routed expert multiplies its SwiGLU
output by its routing weight BEFORE w2, as DeepSeek does. Routed outputs sum in fp32 with the shared
expert's, then cast to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import LayerSpec, ModelConfig
from dsv4.model.layers import Linear, Numerics


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, numerics: Numerics):
        super().__init__()
        self.topk, self.func = cfg.num_experts_per_tok, cfg.scoring_func
        self.norm_topk, self.route_scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.hash = spec.routing == "hash"
        self.register_buffer("weight", torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.bfloat16))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.int64))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T,D], ids: [T] -> weights [T,k] fp32, experts [T,k] int64
        logits = x.float() @ self.weight.float().T
        if self.func == "softmax":
            scores = logits.softmax(-1)
        elif self.func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hash:
            idx = self.tid2eid[ids].long()
        else:
            idx = (scores + self.bias.float()).topk(self.topk, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk and self.func != "softmax":
            w = w / w.sum(-1, keepdim=True)
        return w * self.route_scale, idx


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, numerics: Numerics, fmt: str, **fmt_opts):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter, fmt, numerics, **fmt_opts)
        self.w2 = Linear(inter, dim, fmt, numerics, **fmt_opts)
        self.w3 = Linear(dim, inter, fmt, numerics, **fmt_opts)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, stored=None) -> torch.Tensor:
        # x: [T,D] -> [T,D] fp32; weight: [T] routing weight applied before w2. stored: optional
        # (w1, w2, w3) weights of another expert of the same shapes, run through this expert's ops
        s1, s2, s3 = stored or (None, None, None)
        gate, up = self.w1(x, torch.float32, s1), self.w3(x, torch.float32, s3)
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)  # asymmetric: the gate has an upper bound only
        h = F.silu(gate) * up
        if weight is not None:
            h = h * weight[:, None]
        return self.w2(h.to(x.dtype), torch.float32, s2)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, numerics: Numerics, fmt: str, expert_fmt: str,
                 fmt_opts: dict, expert_opts: dict):
        super().__init__()
        self.gate = Gate(cfg, spec, numerics)
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, inter, limit, numerics, expert_fmt, **expert_opts) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = Expert(cfg.hidden_size, inter, limit, numerics, fmt, **fmt_opts)
        self.stacked: dict[str, dict[str, torch.Tensor]] = {}  # filled by stack_experts()

    def stack_experts(self) -> None:
        """Move every expert's stored tensors into one [E, ...] tensor per (w1|w2|w3, suffix) and make
        the experts' buffers views of it, so the decode step can gather experts by a device index."""
        if self.stacked:
            return
        for wname in ("w1", "w2", "w3"):
            lins = [getattr(e, wname) for e in self.experts]
            self.stacked[wname] = {}
            for suffix in list(lins[0]._buffers):
                big = torch.stack([lin._buffers[suffix] for lin in lins])
                for i, lin in enumerate(lins):
                    lin._buffers[suffix] = big[i]
                self.stacked[wname][suffix] = big

    def _expert_weights(self, e: torch.Tensor):
        # e: [1] int64 device index -> (w1, w2, w3) containers of expert e, gathered on the device
        cls = self.experts[0].w1.cls
        return tuple(cls(**{sfx: t.index_select(0, e)[0] for sfx, t in self.stacked[w].items()})
                     for w in ("w1", "w2", "w3"))

    def decode_step(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x: [1,1,D], ids: [1,1] -> [1,1,D]. No host decision: the k chosen experts are gathered by
        # device indices (requires stack_experts()).
        x2 = x.flatten(0, 1)
        w, idx = self.gate(x2, ids.flatten())  # [1,k]
        y = torch.zeros(x2.shape, dtype=torch.float32, device=x.device)
        for j in range(idx.shape[1]):
            y = y + self.experts[0](x2, w[:, j], self._expert_weights(idx[0, j:j + 1]))
        y = y + self.shared_experts(x2)
        return y.to(x.dtype).view(x.shape)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x: [B,S,D] (ffn_norm output), ids: [B,S] -> [B,S,D]
        shape = x.shape
        x = x.flatten(0, 1)
        w, idx = self.gate(x, ids.flatten())
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            y.index_add_(0, tok, self.experts[e](x[tok], w[tok, slot]))
        y = y + self.shared_experts(x)
        return y.to(x.dtype).view(shape)
