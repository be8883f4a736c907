"""Mixture of experts (SPEC §2.7): router (hash or score + bias), clamped-SwiGLU experts, shared expert.

The routed experts of a layer are owned as stacked [E, ...] tensors (`StackedExperts`, buffers
`experts.w1.weight` [E, N, K/2], ...): the checkpoint's per-expert names
(`ffn.experts.{e}.w1.weight`) are routed into slice e by the name table (dsv4/checkpoint.py), so
the kernels address experts by a device index and a reload writes where the kernels read.
The math is `ops.router` and `ops.moe_post` (`moe_experts`, then the FFN's mHC post), or `ops.moe_post_pre` (and
the next block's mHC pre + RMSNorm after it).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4 import formats, ops
from dsv4.config import LayerSpec, ModelConfig
from dsv4.model.layers import Linear, Numerics
from dsv4.ops.act_quant import QuantAct
from dsv4.ops.linear import PreparedLinear, prepare_linear


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
        return ops.router(x, self.weight, None if self.hash else self.bias, self.tid2eid if self.hash else None,
                          ids, self.func, self.topk, self.norm_topk, self.route_scale)


class StackedLinear(nn.Module):
    """E same-shaped linear weights of one format, stored stacked: buffer `weight` [E, ...], `scale`..."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, fmt: str, **fmt_opts):
        super().__init__()
        self.n_experts, self.in_features, self.out_features, self.fmt = n_experts, in_features, out_features, fmt
        self.cls = formats.FORMATS[fmt]
        for name, (shape, dtype) in self.cls.layout(out_features, in_features, **fmt_opts).items():
            self.register_buffer(name, torch.zeros((n_experts, *shape), dtype=dtype))
        self._prepared: tuple | None = None

    def expert(self, e: int) -> formats.LinearWeight:
        """Expert e as its stored format container (views into the stack)."""
        return self.cls(**{k: v[e] for k, v in self._buffers.items()})

    def view(self, e: int) -> "ExpertLinear":
        return ExpertLinear(self, e)

    def prepared(self) -> PreparedLinear:
        key = tuple((b.data_ptr(), b._version) for b in self._buffers.values())
        if self._prepared is None or self._prepared[0] != key:
            p = prepare_linear(self.expert(0))
            stack = {k: v for k, v in self._buffers.items()}
            w = stack["weight"].view(torch.uint8) if p.fmt in ("mxfp4", "nvfp4") else stack["weight"]
            if p.fmt == "fp8":
                s = stack["scale"]
                s = formats.e8m0_to_float(s) if s.dtype == torch.float8_e8m0fnu else s
            elif p.fmt == "mxfp4":
                s = stack["scale"].view(torch.uint8)
            else:
                s = stack.get("weight_scale")
            self._prepared = (key, PreparedLinear(p.fmt, p.n, p.k, w, s, stack.get("weight_scale_2")))
        return self._prepared[1]


class ExpertLinear:
    """Expert e of a StackedLinear, addressable like a Linear under its official name
    (`weight`, `scale`, ... are views into the stack; `stored()`, `dequantize()`)."""

    def __init__(self, stack: StackedLinear, e: int):
        self.stack, self.e = stack, e
        self.in_features, self.out_features, self.fmt = stack.in_features, stack.out_features, stack.fmt

    def __getattr__(self, name: str) -> torch.Tensor:
        bufs = self.__dict__["stack"]._buffers
        if name in bufs:
            return bufs[name][self.__dict__["e"]]
        raise AttributeError(name)

    def stored(self) -> formats.LinearWeight:
        return self.stack.expert(self.e)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.stored().dequantize(dtype)


class StackedExperts(nn.Module):
    """The routed experts of one layer: w1, w2, w3 each a StackedLinear over all E experts.

    `state_dict()` lists them under the checkpoint's per-expert names (`{e}.w1.weight`, views into
    the stacks), so the model's state_dict keys stay the official tensor names."""

    def __init__(self, n_experts: int, dim: int, inter: int, fmt: str, **fmt_opts):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = StackedLinear(n_experts, dim, inter, fmt, **fmt_opts)
        self.w2 = StackedLinear(n_experts, inter, dim, fmt, **fmt_opts)
        self.w3 = StackedLinear(n_experts, dim, inter, fmt, **fmt_opts)
        self._register_state_dict_hook(_per_expert_names)

    def __getitem__(self, e: int):
        """Expert e: an object with w1 / w2 / w3 ExpertLinear views."""
        if not 0 <= e < self.n_experts:
            raise IndexError(f"expert {e} of {self.n_experts}")
        return _Expert(*(getattr(self, w).view(e) for w in ("w1", "w2", "w3")))

    def __len__(self) -> int:
        return self.n_experts

    def slot(self, e: int, wname: str, suffix: str) -> tuple[StackedLinear, str]:
        """(stack, buffer name) holding expert e's `wname.suffix` (e.g. 3, "w1", "scale")."""
        lin = getattr(self, wname, None)
        if not isinstance(lin, StackedLinear) or suffix not in lin._buffers or not 0 <= e < self.n_experts:
            raise KeyError(f"{e}.{wname}.{suffix}")
        return lin, suffix


class _Expert:
    def __init__(self, w1: ExpertLinear, w2: ExpertLinear, w3: ExpertLinear):
        self.w1, self.w2, self.w3 = w1, w2, w3


def _per_expert_names(module: StackedExperts, state_dict: dict, prefix: str, local_metadata) -> None:
    for wname in ("w1", "w2", "w3"):
        for suffix in list(getattr(module, wname)._buffers):
            stacked = state_dict.pop(f"{prefix}{wname}.{suffix}")
            for e in range(module.n_experts):
                state_dict[f"{prefix}{e}.{wname}.{suffix}"] = stacked[e]


class Expert(nn.Module):
    """The shared expert (its own w1/w2/w3 Linears)."""

    def __init__(self, dim: int, inter: int, numerics: Numerics, fmt: str, **fmt_opts):
        super().__init__()
        self.w1 = Linear(dim, inter, fmt, numerics, **fmt_opts)
        self.w2 = Linear(inter, dim, fmt, numerics, **fmt_opts)
        self.w3 = Linear(dim, inter, fmt, numerics, **fmt_opts)

    def prepared(self) -> tuple[PreparedLinear, PreparedLinear, PreparedLinear]:
        return self.w1.prepared(), self.w2.prepared(), self.w3.prepared()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, numerics: Numerics, fmt: str, expert_fmt: str,
                 fmt_opts: dict, expert_opts: dict):
        super().__init__()
        self.numerics = numerics
        self.gate = Gate(cfg, spec, numerics)
        inter, self.limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.experts = StackedExperts(cfg.n_routed_experts, cfg.hidden_size, inter, expert_fmt, **expert_opts)
        self.shared_experts = Expert(cfg.hidden_size, inter, numerics, fmt, **fmt_opts)
        # the experts quantize their input (reference numerics, quantized weights): x may come with its codes
        self.quantizes_input = numerics.reference and expert_fmt != "dense"

    def forward(self, x: torch.Tensor | QuantAct, ids: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor, nxt: tuple | None = None):
        # x: [B,S,D] (ffn_norm output; a QuantAct when quantizes_input), ids: [B,S], the residual streams [B,S,hc,D]
        # with the FFN's mHC post / comb -> the new streams [B,S,hc,D] (ops.moe_post: the experts' output expanded
        # back, one op; the router reads x, the experts may read its codes). nxt: the next block's mhc_pre_norm
        # parameters (Block.pre_args) -> (new streams, (its y, post, comb)) from one op, ops.moe_post_pre
        xq = x if isinstance(x, QuantAct) else None
        x = (x.x if xq is not None else x).flatten(0, 1)
        w, idx = self.gate(x, ids.flatten())
        ex = self.experts
        args = (x if xq is None else QuantAct(x, xq.q, xq.s), w, idx, ex.w1.prepared(), ex.w2.prepared(),
                ex.w3.prepared(), self.shared_experts.prepared(), self.limit, self.numerics.reference, streams, post, comb)
        if nxt is None:
            return ops.moe_post(*args)
        x_new, y, post, comb = ops.moe_post_pre(*args, *nxt)
        return x_new, (y, post, comb)
