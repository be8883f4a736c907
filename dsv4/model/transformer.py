"""The DeepSeek-V4 model: embedding, hc-expanded blocks, hc head, final norm, LM head, MTP blocks.

Module and buffer names are the official checkpoint names (SPEC §3.2), except the routed experts,
which each layer owns stacked (`ffn.experts.w1.weight` [E, ...]); dsv4/checkpoint.py routes the
per-expert names there. `Transformer.forward` runs a chunk of tokens at the state's position (prefill
chunk or single decode token) and returns next-token logits (fp32) for every position of the chunk;
a fresh state and the whole sequence is the stateless forward. `step()` runs the same layers on a
device-side position: the piece the CUDA-graph runner captures. `prepare()` makes every weight's
kernel layout once after loading.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.config import LayerSpec, ModelConfig
from dsv4.model.attention import Attention
from dsv4 import ops
from dsv4.model.layers import Linear, Numerics, RMSNorm, Rope, SideBranch, StepPlan, on_device
from dsv4.model.moe import ExpertLinear, MoE, StackedExperts
from dsv4.ops.kv_pack import ROPE, key_packable, packable
from dsv4.ops.linear import PreparedLinear
from dsv4.state import BlockState, ModelState


def linear_formats(cfg: ModelConfig) -> tuple[str, dict, str, dict]:
    """(format, options) of the FP8-family projections and of the routed experts, from the config."""
    if cfg.quant is None:
        return "dense", {}, "dense", {}
    fp8_opts = {"scale_dtype": cfg.quant.fp8_scale_dtype}
    expert = cfg.quant.expert_format
    return "fp8", fp8_opts, expert, (fp8_opts if expert == "fp8" else {})


def _register_hc(owner: nn.Module, prefix: str, mix: int, width: int, n_scale: int) -> None:
    owner.register_buffer(f"{prefix}_fn", torch.zeros(mix, width, dtype=torch.float32))
    owner.register_buffer(f"{prefix}_base", torch.zeros(mix, dtype=torch.float32))
    owner.register_buffer(f"{prefix}_scale", torch.zeros(n_scale, dtype=torch.float32))


def check_reference_shapes(cfg: ModelConfig) -> None:
    """Reference numerics simulate quantization in fixed blocks; the dims must tile them."""
    need = [("head_dim - qk_rope_head_dim", cfg.nope_head_dim, 64, "FP8 KV simulation")]
    if any(s.has_indexer for s in cfg.layers + cfg.mtp_layers):
        need.append(("index_head_dim", cfg.index_head_dim, 32, "indexer FP4 simulation"))
    if cfg.quant is not None:  # FP8 1x128 activation quantization before every quantized linear
        need += [("hidden_size", cfg.hidden_size, 128, "FP8 activation blocks"),
                 ("q_lora_rank", cfg.q_lora_rank, 128, "FP8 activation blocks"),
                 ("o_groups * o_lora_rank", cfg.o_groups * cfg.o_lora_rank, 128, "FP8 activation blocks"),
                 ("moe_intermediate_size", cfg.moe_intermediate_size, 128, "FP8 activation blocks")]
    for name, value, block, why in need:
        if value % block:
            raise ValueError(f"reference numerics need {name} ({value}) to be a multiple of {block} ({why})")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, numerics: Numerics):
        super().__init__()
        self.cfg, self.spec, self.numerics = cfg, spec, numerics
        fmt, fmt_opts, efmt, eopts = linear_formats(cfg)
        D = cfg.hidden_size
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, spec, numerics, fmt, **fmt_opts)
        self.ffn = MoE(cfg, spec, numerics, fmt, efmt, fmt_opts, eopts)
        for site in ("attn", "ffn"):
            _register_hc(self, f"hc_{site}", cfg.hc_mix, cfg.hc_mult * D, 3)

    def _hc_args(self, site: str, norm: RMSNorm) -> tuple:
        # the pre's parameters at `site` and the sublayer's RMSNorm (mhc_pre_norm / mhc_post_pre_norm)
        c = self.cfg
        return (getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale"),
                c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, norm.weight, norm.eps)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, plan: StepPlan, st: BlockState, rope: Rope,
                pre: tuple | None = None, nxt: "Block | None" = None, defer: bool = False, lag: bool = False):
        # x: [B,S,hc,D] residual streams at plan.pos -> [B,S,hc,D]; the same code for a prefill chunk
        # and the captured S = 1 decode step. Each sublayer's input is mhc_pre then its RMSNorm; the attention's
        # mhc_post and the FFN's pre run as one boundary op, the FFN's post inside its experts' op. Given nxt (the next
        # block), the FFN's op also makes nxt's attention input (ops.moe_post_pre) -> (streams, nxt's pre), which
        # nxt then takes as `pre` instead of running its own mhc_pre_norm (the decode step: one launch fewer).
        # defer: a decode step that closes no compressor window defers the compressors' work; lag: the step that
        # closes it after such steps (Attention.begin)
        carry, a = self.begin(x, plan, st, rope, pre=pre, defer=defer, lag=lag)
        out = self.finish(self.attn.attend(a, plan, st), carry, ids, nxt)
        a.join_deferred()
        return out

    # forward in the attention's three phases (begin, attn.attend, finish: see Attention.begin)
    def begin(self, x: torch.Tensor, plan: StepPlan, st: BlockState, rope: Rope, join: bool = False,
              pre: tuple | None = None, defer: bool = False, lag: bool = False) -> tuple:
        """The attention's mhc_pre + RMSNorm (or `pre`, its (y, post, comb) made by the block before) and its
        projections -> (carry for finish, AttnStart)."""
        # a decode step's kept compressor input row (BlockState.x_ring) written by the same op (Attention.keep_target)
        keep = self.attn.keep_target(x, plan, st) if pre is None else None
        y, post, comb = ops.mhc_pre_norm(x, *self.pre_args(), keep=keep) if pre is None else pre
        return (x, post, comb), self.attn.begin(y, plan, st, rope, join, defer, lag, kept=keep is not None)

    def pre_args(self) -> tuple:
        """The attention's mhc_pre_norm parameters after its input streams."""
        return self._hc_args("attn", self.attn_norm)

    def finish(self, o: torch.Tensor, carry: tuple, ids: torch.Tensor, nxt: "Block | None" = None):
        """The attention's output projections, the mHC boundary and the FFN -> the new streams (with nxt: and nxt's
        attention input, see forward)."""
        x, post, comb = carry
        f = self.attn.finish(o)
        # y comes with its FP8 quantization when the experts quantize their input (a QuantAct: written by the same op)
        x, y, post, comb = ops.mhc_post_pre_norm(f, x, post, comb, *self._hc_args("ffn", self.ffn_norm),
                                                 quant=self.ffn.quantizes_input)
        # the FFN's mhc_post inside ops.moe_post (and nxt's mhc_pre_norm with it: ops.moe_post_pre)
        return self.ffn(y, ids, x, post, comb, None if nxt is None else nxt.pre_args())


class MTPBlock(Block):
    """Multi-token prediction block (SPEC §2.9): a Block fed hnorm(main streams) and enorm(embedding)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, numerics: Numerics):
        super().__init__(cfg, spec, numerics)
        fmt, fmt_opts, _, _ = linear_formats(cfg)
        D = cfg.hidden_size
        self.e_proj = Linear(D, D, fmt, numerics, **fmt_opts)
        self.h_proj = Linear(D, D, fmt, numerics, **fmt_opts)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        _register_hc(self, "hc_head", cfg.hc_mult, cfg.hc_mult * D, 1)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(vocab, dim, dtype=torch.bfloat16))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, numerics: Numerics | None = None, max_pos: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.numerics = numerics or Numerics()
        if self.numerics.reference:
            check_reference_shapes(cfg)
        D = cfg.hidden_size
        self.embed = Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(Block(cfg, s, self.numerics) for s in cfg.layers)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = Embedding(cfg.vocab_size, D)  # [vocab, D] weight, applied in fp32
        _register_hc(self, "hc_head", cfg.hc_mult, cfg.hc_mult * D, 1)
        self.mtp = nn.ModuleList(MTPBlock(cfg, s, self.numerics) for s in cfg.mtp_layers)
        self.max_pos = max_pos or cfg.max_position_embeddings
        self._ropes: dict = {}
        self._head: tuple | None = None  # (key, PreparedLinear) of the LM head
        self._step_plans: dict = {}  # device -> (pos buffer address, the decode step's StepPlan)
        # True: each layer's attention input is made by the FFN op of the layer before on its device (ops.moe_post_pre:
        # in a decode step one launch fewer, the down kernel's last CTA finishes it). Off by default: on an H200 the
        # fused model is still 3-7 us a layer slower in three of the four layer kinds (docs/performance.md,
        # thirty-seventh and thirty-eighth passes)
        self.fuse_pre = False

    # ---- official names: a routed expert's linear is a view into its layer's stack ----
    def get_submodule(self, target: str):
        parts = target.split(".")
        if len(parts) >= 3 and parts[-3] == "experts" and parts[-2].isdigit():
            experts = super().get_submodule(".".join(parts[:-2]))
            if isinstance(experts, StackedExperts):
                return getattr(experts[int(parts[-2])], parts[-1])
        return super().get_submodule(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        prefix, _, leaf = target.rpartition(".")
        mod = self.get_submodule(prefix)
        if isinstance(mod, ExpertLinear):
            return getattr(mod, leaf)
        return super().get_buffer(target)

    # ---- helpers ----
    def rope(self, kind: str, device) -> Rope:
        """RoPE table of `kind` ("main" | "compress") on `device`, built on first use up to max_pos."""
        key = (kind, str(device))
        if key not in self._ropes:
            c = self.cfg
            self._ropes[key] = Rope(c.qk_rope_head_dim, c.theta_for(kind), c.rope_scaling_for(kind), self.max_pos, device)
        return self._ropes[key]

    def new_state(self, max_len: int, batch: int = 1, with_mtp: bool = False, kv_fp8: bool = False,
                  keys_fp4: bool = False) -> ModelState:
        """The preallocated state. kv_fp8: its window ring and compressed entries hold packed FP8 rows
        (dsv4/ops/kv_pack.py: 592 bytes a Flash row instead of 1,024, the same values, so the same results); keys_fp4:
        the indexer's keys are packed FP4 rows (80 bytes a Flash key instead of 256, the same values). Both need
        reference numerics with bf16 activations (where those rows are FP8- / FP4-simulated). kv_fp8 is off by
        default: its readers are slower than the bf16 ones for now (docs/performance.md, twenty-eighth pass)."""
        dev = self.embed.weight.device
        c = self.cfg
        ref_bf16 = self.numerics.reference and self.numerics.dtype == torch.bfloat16
        if kv_fp8 and not (ref_bf16 and packable(c.head_dim, self.numerics.dtype) and c.qk_rope_head_dim == ROPE):
            raise ValueError("an FP8 KV state needs reference numerics with bf16 activations and "
                             f"head_dim - {ROPE} RoPE dims a multiple of 64 (got {self.numerics.dtype}, head_dim "
                             f"{c.head_dim}, RoPE dims {c.qk_rope_head_dim})")
        if keys_fp4 and not (ref_bf16 and key_packable(c.index_head_dim, self.numerics.dtype)):
            raise ValueError("FP4 indexer keys need reference numerics with bf16 activations and index_head_dim a "
                             f"multiple of 32 (got {self.numerics.dtype}, index_head_dim {c.index_head_dim})")
        return ModelState(c, batch, max_len, self.numerics.dtype, dev, with_mtp=with_mtp,
                          block_devices=[layer.attn_norm.weight.device for layer in self.layers],
                          mtp_devices=[blk.attn_norm.weight.device for blk in self.mtp], kv_packed=kv_fp8,
                          keys_packed=keys_fp4)

    def place(self, devices: list) -> "Transformer":
        """Spread the model over `devices`: embedding on the first, head/norm/hc_head on the last, the
        layers in contiguous runs of about equal count. A model built on the meta device is
        materialized (uninitialized) in place. (The loader places by bytes while streaming instead.)"""
        devices = [torch.device(d) for d in devices]

        def move(mod: nn.Module, dev) -> None:
            for m in mod.modules():
                for name, b in m._buffers.items():
                    if b is not None:
                        m._buffers[name] = torch.empty_like(b, device=dev) if b.is_meta else b.to(dev)

        move(self.embed, devices[0])
        for layer, dev in zip(self.layers, self.split_layers(devices)):
            move(layer, dev)
        for mod in (self.norm, self.head, *self.mtp):
            move(mod, devices[-1])
        for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            b = self._buffers[name]
            self._buffers[name] = torch.empty_like(b, device=devices[-1]) if b.is_meta else b.to(devices[-1])
        self._ropes.clear()
        self._head = None
        self._step_plans.clear()
        return self

    def split_layers(self, devices: list) -> list[torch.device]:
        """The device `place(devices)` puts each layer on: contiguous runs of about equal count, in order."""
        devices = [torch.device(d) for d in devices]
        n, k = len(self.layers), len(devices)
        return [devices[min(i * k // n, k - 1)] for i in range(n)]

    def logits(self, x: torch.Tensor, fn, base, scale, norm: RMSNorm) -> torch.Tensor:
        # x: [B,S,hc,D] -> [B,S,vocab] fp32
        with on_device(x.device):
            z = norm(ops.mhc_head(x, fn, base, scale, self.cfg.hc_eps, self.cfg.rms_norm_eps))
            return ops.head(z, self.head_weight())

    def head_weight(self) -> PreparedLinear:
        """The LM head as the head op reads it: the stored bf16 weight for a fast kernel; an fp32 copy,
        made once, when the reference runs it (converting 129280 x D every step would dominate a small
        model's CPU decode step)."""
        w = self.head.weight
        want_f32 = ops.OPS["head"].active == "ref" and w.dtype != torch.float32
        key = (w.data_ptr(), w._version, w.device, want_f32)
        if self._head is None or self._head[0] != key:
            self._head = (key, PreparedLinear("dense", w.shape[0], w.shape[1], w.float() if want_f32 else w))
        return self._head[1]

    def prepare(self) -> "Transformer":
        """Make every weight's kernel layout now (after loading or placing): each Linear's and the
        stacked experts' prepared tensors, wo_a in the activation dtype, the head. Later calls re-make
        only what changed."""
        for mod in self.modules():
            for step in ("prepare_fused", "prepared", "wo_a_grouped"):
                if hasattr(mod, step):
                    getattr(mod, step)()
        if self.head.weight.device.type != "meta":
            self.head_weight()
        return self

    # ---- decode-step pieces (static shapes, device positions: captured as CUDA graphs) ----
    def embed_step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [B,1] -> residual streams [B,1,hc,D]."""
        h = self.embed.weight[ids].to(self.numerics.dtype)
        return h.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()

    def next_block(self, i: int) -> Block | None:
        """The block whose attention input layer i's decode step makes with its FFN (ops.moe_post_pre): layer i + 1
        where it runs on layer i's device and `fuse_pre` is on, else None."""
        if not self.fuse_pre or i + 1 >= len(self.layers):
            return None
        nxt = self.layers[i + 1]
        return nxt if nxt.attn_norm.weight.device == self.layers[i].attn_norm.weight.device else None

    def layer_step(self, i: int, x: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, st: BlockState,
                   pre: tuple | None = None, defer: bool = False, lag: bool = False):
        """Layer i on one token at the device position pos ([1] int64): x [B,1,hc,D] -> [B,1,hc,D], or, where
        next_block(i) is a block, (x, that block's attention input (y, post, comb)), which its step takes as `pre`.

        The step's plan (positions, window index list, ring slot, the RoPE rows of every table kind, the
        visible compressed-entry counts of every ratio and the HCA index lists) is the same for every layer:
        the first layer on a device builds it (in its captured graph), the later layers on that device read
        it. So the layers of a device run in order within a step (as the graph runner and the eager loop do);
        a layer run on its own with no plan for its pos buffer builds its own. defer: the step closes none of the
        layer's compressor windows, and its compressors' work may wait for the step that closes it; lag: this step
        closes one after such steps (Attention.begin; the caller knows the position: the graph runner replays the
        schedule it calls for, and keeps st.lagging)."""
        layer = self.layers[i]
        if st.lagging and not (defer or lag):
            # a one-schedule step would run the compressors at pos over a state missing the open window's rows
            raise ValueError(f"layer {i}: deferring decode steps left its compressor state behind; call "
                             "Transformer.catch_up(state) before a step that runs the compressors at every position")
        dev = x.device
        first = i == 0 or self.layers[i - 1].attn_norm.weight.device != dev
        with on_device(dev):
            cached = self._step_plans.get(dev)
            if first or cached is None or cached[0] != pos.data_ptr():
                # everything now (a later layer's graph must not compute any of it), from pos alone (ops.step_plan: one
                # launch on the fast path): on the side stream, beside the layer's mHC and query projections; the
                # attention waits for it (plan.ready()) before its first kernel that reads the plan
                tables = [self.rope(kind, dev) for kind in dict.fromkeys(lay.spec.rope for lay in self.layers)]
                kinds = dict.fromkeys((lay.spec.ratio, lay.spec.has_indexer) for lay in self.layers)
                ratios = list(dict.fromkeys(r for r, _ in kinds if r > 0))
                # HCA: decode lists cover the whole entries buffer
                prefix = [(r, st.max_len // r) for r, has_indexer in kinds if r > 0 and not has_indexer]
                branch = SideBranch(dev)
                with branch:
                    plan = StepPlan.decode(pos, self.cfg.sliding_window, tables, ratios, prefix)
                plan.pending = branch
                self._step_plans[dev] = (pos.data_ptr(), plan)
            plan = self._step_plans[dev][1]
            return layer(x, ids, plan, st, self.rope(layer.spec.rope, dev), pre, self.next_block(i), defer, lag)

    def catch_up(self, state: ModelState, layers=None) -> None:
        """Brings the compressor states that deferring decode steps left behind (BlockState.lagging) up to date at
        state.pos (Attention.catch_up), for the listed layers (default all): before a chunk or a one-schedule step
        reads them. Eager, on each layer's device."""
        for i in range(len(self.layers)) if layers is None else layers:
            st = state.blocks[i]
            if st.lagging:
                layer = self.layers[i]
                dev = layer.attn_norm.weight.device
                with on_device(dev):
                    layer.attn.catch_up(st, state.pos, self.rope(layer.spec.rope, dev))

    def head_step(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B,1,hc,D] -> logits [B,1,vocab] fp32."""
        return self.logits(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm)

    # ---- forward ----
    def forward_streams(self, ids: torch.Tensor, state: ModelState, layer_call=None) -> torch.Tensor:
        """ids: [B,S] at positions state.pos.. -> final residual streams [B,S,hc,D]; advances state.pos.
        layer_call(i, layer, args) -> layer(*args), if given, runs each layer (tools time or record them). Each layer
        makes the next one's attention input where next_block(i) says so, as the decode step does (for a chunk the
        fast op runs the kernels of the two ops called apart)."""
        B, S = ids.shape
        p0 = state.pos
        if p0 + S > state.max_len:
            raise ValueError(f"positions {p0}..{p0 + S - 1} exceed the state's max_len {state.max_len}")
        if p0 + S > self.max_pos:
            raise ValueError(f"positions {p0}..{p0 + S - 1} exceed the model's RoPE table ({self.max_pos})")
        self.catch_up(state)
        x = self.embed_streams(ids)
        plans: dict = {}
        pre = None  # this layer's attention input, where the layer before made it (next_block)
        for i, (layer, st) in enumerate(zip(self.layers, state.blocks)):
            x = x.to(layer.attn_norm.weight.device)
            args = (x, ids.to(x.device), self._plan(plans, x.device, p0, S), st, self.rope(layer.spec.rope, x.device),
                    pre, self.next_block(i))
            with on_device(x.device):
                out = layer(*args) if layer_call is None else layer_call(i, layer, args)
            x, pre = out if isinstance(out, tuple) else (out, None)
        state.pos = p0 + S
        return x

    def embed_streams(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [B,S] -> the four identical residual streams [B,S,hc,D] of their embeddings."""
        h = self.embed.weight[ids].to(self.numerics.dtype)  # [B,S,D]
        return h.unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)

    def _plan(self, plans: dict, device, p0: int, S: int) -> StepPlan:
        # one plan per device per step; S = 1 builds a plan of the decode step's static sizes and values (the
        # graph runner's layer_step makes the same tensors in one op, ops.step_plan)
        if device not in plans:
            start = torch.full((1,), p0, dtype=torch.int64, device=device)
            plans[device] = StepPlan.build(start, S, self.cfg.sliding_window, p0)
        return plans[device]

    def forward(self, ids: torch.Tensor, state: ModelState, last_only: bool = False) -> torch.Tensor:
        """ids: [B,S] -> next-token logits [B,S,vocab] fp32 (or [B,1,vocab] with last_only)."""
        return self.head_logits(self.forward_streams(ids, state), last_only)

    def head_logits(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Final residual streams [B,S,hc,D] -> next-token logits [B,S,vocab] fp32 (or [B,1,vocab] with last_only)."""
        if last_only:
            x = x[:, -1:]
        x = x.to(self.head.weight.device)
        return self.logits(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm)

    def forward_mtp(self, next_ids: torch.Tensor, streams: torch.Tensor, state: ModelState, p0: int, k: int = 0) -> torch.Tensor:
        """MTP block k: main streams [B,S,hc,D] at positions p0.. with the NEXT tokens' ids [B,S]
        -> logits [B,S,vocab] predicting the token after next (standard DeepSeek MTP alignment)."""
        blk = self.mtp[k]
        dev = blk.attn_norm.weight.device
        e = self.embed.weight[next_ids.to(self.embed.weight.device)].to(device=dev, dtype=self.numerics.dtype)
        with on_device(dev):
            x = blk.h_proj(blk.hnorm(streams.to(dev))) + blk.e_proj(blk.enorm(e)).unsqueeze(2)
            next_ids = next_ids.to(dev)
            x = blk(x, next_ids, self._plan({}, dev, p0, next_ids.shape[1]), state.mtp[k], self.rope(blk.spec.rope, dev))
            return self.logits(x, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, blk.norm)
