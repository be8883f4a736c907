"""Attention block (SPEC §2.3): MQA over one latent 512-dim KV head with an attention sink.

A query at position t sees the sliding window (the last `sliding_window` tokens including t) plus,
in CSA/HCA layers, compressed entries w with (w+1)*ratio <= t+1 (CSA: only the indexer's top-k), given
to `ops.sparse_attn` as index lists in DeepSeek's order (StepPlan). K = V, so the output's RoPE dims
are rotated back by -t (inside ops.sparse_attn) before the grouped low-rank projection (wo_a in the activation dtype without
activation quantization, then wo_b). One forward serves prefill chunks and the captured decode step.
The compressors (and their fused projection of x) run in a `SideBranch` beside the query / kv path, and
in CSA layers the indexer after them (once its queries exist); both join before the attention. Every step and chunk
keeps the compressors' input rows of the open window (`BlockState.x_ring`). A decode step of a layer with compressors
that closes no window (CSA: 3 steps in 4, HCA: 127 in 128) may defer their work (`defer`): the attention reads none
of what they write then (SPEC §2.4: only the token that closes a window attends to its entry), so such a step only
keeps its x (and a CSA layer's indexer projects its head weights alone, which it reads every step), and the step that
closes the window (`lag`) projects the window's rows at once and runs the compressors over them as a chunk from the
window's start (the same ops; the projection's fp32 sums in another order). A decode step's x row is written into the
kept rows by the op that makes x from the streams (mhc_pre_norm's keep, `keep_target`: no launch of its own; the layer
that builds the step's plan, a chunk, and a step whose x the layer before made (Transformer.fuse_pre) keep theirs with
an index copy), so an HCA step that keeps x launches nothing for its compressor, and a CSA one only its head weights'
GEMV, forked after wq_a || wkv's. The graph runner captures both schedules for such
layers and replays the one the position calls for (dsv4/graphs.py); `catch_up` brings a state that such steps left
behind up to date before a chunk or a one-schedule step reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv4 import ops
from dsv4.config import LayerSpec, ModelConfig
from dsv4.model.compressor import Compressor
from dsv4.model.indexer import Indexer
from dsv4.model.layers import FusedLinear, Linear, Numerics, RMSNorm, Rope, SideBranch, StepPlan
from dsv4.ops.kv_pack import is_packed
from dsv4.ops.linear import PreparedLinear, pow2_scales
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
            self.compressor = Compressor(D, hd, spec.ratio, spec.overlap, cfg.rms_norm_eps, numerics, rotate=False)
        if spec.has_indexer:
            self.indexer = Indexer(cfg, spec.ratio, numerics, fmt, **fmt_opts)
        self._wo_a: tuple | None = None  # (key, ([G, o_lora, group_in] in the activation dtype, FP8 twin | None))
        # same-input projections, one GEMM each: wq_a || wkv (x); wq_b || the indexer's wq_b (qr); every
        # compressor's wkv || wgate || the indexer's weights_proj (x, fp32 out)
        self.qkv_a = FusedLinear([self.wq_a, self.wkv])
        self.q_b = FusedLinear([self.wq_b, self.indexer.wq_b]) if self.indexer is not None else None
        comps = [c for c in (self.compressor, self.indexer.compressor if self.indexer else None) if c is not None]
        x_proj = [w for c in comps for w in (c.wkv, c.wgate)] + ([self.indexer.weights_proj] if self.indexer else [])
        self.compress_proj = FusedLinear(x_proj) if comps else None

    def prepare_fused(self) -> None:
        for f in (self.qkv_a, self.q_b, self.compress_proj):
            if f is not None:
                f.prepared()
        if self.q_b is not None:  # a decode step runs them one by one (begin): views of the fused bytes, own scales
            for m in self.q_b.members:
                m.prepared()

    def wo_a_grouped(self) -> tuple[torch.Tensor, PreparedLinear | None]:
        """wo_a dequantized once to the activation dtype as [G, o_lora, group_in] (what DeepSeek's convert.py does),
        and the stored FP8 weight where it holds exactly those values (power-of-two block scales, bf16 activations:
        the fast op reads its half-size bytes), else None; re-made only when the stored weight changes."""
        w = self.wo_a
        key = tuple((b.data_ptr(), b._version) for b in w._buffers.values())
        if self._wo_a is None or self._wo_a[0] != key:
            g = w.stored().dequantize(self.numerics.dtype).unflatten(0, (self.o_groups, -1)).contiguous()
            w8 = w.prepared()
            exact = (w8.fmt == "fp8" and self.numerics.dtype == torch.bfloat16 and w8.weight.device.type != "meta"
                     and pow2_scales(w8))
            self._wo_a = (key, (g, w8 if exact else None))
        return self._wo_a[1]

    def forward(self, x: torch.Tensor, plan: StepPlan, st: BlockState, rope: Rope, defer: bool = False) -> torch.Tensor:
        # x: [B,S,D] (attn_norm output) at positions plan.pos -> [B,S,D]
        a = self.begin(x, plan, st, rope, defer=defer)
        out = self.finish(self.attend(a, plan, st))
        a.join_deferred()
        return out

    @property
    def can_defer(self) -> bool:
        """A layer with compressors: its decode steps that close no window may defer their work (see the module's
        docstring; a CSA layer's indexer then projects its head weights in a GEMV of their own)."""
        return self.compressor is not None

    def defers(self, x: torch.Tensor, join: bool = False) -> bool:
        """Whether `defer` and `lag` apply to this call (Attention.begin): `can_defer`, one token (a decode step), no
        join. The caller passes them at the right positions (lag only where the window closes): not checked here."""
        return self.can_defer and x.shape[0] * x.shape[1] == 1 and not join

    # The forward in three phases, for the prefill graph runner (dsv4/graphs.py): `begin` and `finish` have the same
    # shapes at every full prefill chunk and are captured; `attend` reads index lists whose width follows the chunk's
    # end and runs eagerly between them. forward() runs the three in a row: the same kernels in the same order.
    def keep_target(self, streams: torch.Tensor, plan: StepPlan, st: BlockState) -> tuple | None:
        """(st.x_ring, this token's slot) for the op that makes a decode step's input from the streams [B,1,hc,D] to
        write the row it makes into the compressors' kept rows (mhc_pre_norm's keep: no launch of its own), or None:
        no compressor, a chunk, or the plan's slot not made yet (the layer that builds the step's plan keeps its row
        itself, Attention._keep)."""
        if self.compressor is None or streams.shape[1] != 1 or plan.pending is not None:
            return None
        return st.x_ring, plan.window_slots(self.spec.ratio)

    def begin(self, x: torch.Tensor, plan: StepPlan, st: BlockState, rope: Rope, join: bool = False,
              defer: bool = False, lag: bool = False, kept: bool = False) -> "AttnStart":
        """The projections: the compressors (and their fused projection of x) on a side branch, wq_a || wkv, the
        query's norm + wq_b (|| the indexer's wq_b). join: the side branch is joined here (a captured piece must end
        with it), not before the attention. defer: a decode step that closes no compressor window defers the
        compressors' work (it keeps x; see the module's docstring; ignored where `defers` does not hold). lag: a decode
        step that closes a window after such steps (the deferring runner's other schedule): the compressors run over
        the window's kept rows. kept: x's row is in st.x_ring already (keep_target)."""
        cos, sin = plan.rope(rope)
        one = self.defers(x, join)
        defer = defer and one
        mode = "keep" if defer else "close" if lag and one else "step"
        comp_branch = proj = None
        late = defer and self.indexer is None  # an HCA layer keeps x beside the attention (attend)
        # a CSA step that keeps x (kept already) has only its head weights' small GEMV on the side: forked after wq_a ||
        # wkv's GEMV, which it would otherwise slow (and the indexer's queries after it) on the critical path
        after = defer and kept and not late
        if late and kept:  # nothing left to do in this step
            st.lagging, late = True, False
        elif self.compressor is not None and not late and not after:
            # (on the side stream, its work follows a plan still being built)
            # the compressors read x and their own state only: a side branch beside the query / kv path, joined
            # before the indexer's scores and the attention read its entries
            comp_branch = SideBranch(x.device)
            with comp_branch:
                proj = self._compress(x, plan, st, rope, mode, kept)
        q_a, kv = self.qkv_a(x)
        if after:
            comp_branch = SideBranch(x.device)
            with comp_branch:
                proj = self._compress(x, plan, st, rope, mode, kept)
        # the query's low-rank norm and wq_b (|| the indexer's wq_b) as one op: a decode step norms inside the GEMV;
        # a prefill chunk's norm hands the GEMM its FP8 codes
        idx_fork = None
        if self.q_b is not None and x.shape[0] * x.shape[1] == 1 and not join:
            # a decode step of a CSA layer (one token, where each part has its own GEMV config): the indexer's
            # queries in their own GEMV first (8 MB of 42), and the indexer's chain (rotation, scores, top-k: on the
            # critical path) forked right after them, so it runs beside the query's wq_b instead of after it
            q_idx = self.indexer.wq_b.normed(q_a, self.q_norm)
            plan.n_visible(self.spec.ratio)  # (the chain reads it: made before the fork)
            idx_fork = SideBranch(x.device)
            q = self.wq_b.normed(q_a, self.q_norm)
        elif self.q_b is not None:
            q, q_idx = self.q_b.normed(q_a, self.q_norm)
        else:
            q, q_idx = self.wq_b.normed(q_a, self.q_norm), None
        if self.compressor is not None:
            plan.n_visible(self.spec.ratio)  # made here: plan tensors come from this stream (and a captured piece)
            if join:
                comp_branch.join()
                comp_branch = None
        return AttnStart(x.shape[0], x.shape[1], rope, cos, sin, q, q_idx, kv, proj, comp_branch, x, idx_fork, late)

    def _compress(self, x: torch.Tensor, plan: StepPlan, st: BlockState, rope: Rope, mode: str = "step",
                  kept: bool = False) -> tuple:
        """The compressors on x (on the caller's stream) -> the fused projections (kept referenced by the caller until
        its branch is joined; a CSA layer's head weights are the 5th). mode "step": project x and run the compressors
        at plan.pos; "keep" (a decode step that defers them): only keep x (CSA: and project the head weights);
        "close" (the decode step that closes the window after "keep" steps): project the window's kept rows and run
        the compressors over them from the window's start."""
        # fp32 projections of the input (SPEC §5.16: fp32 weights and input), all of the layer's in one GEMM on x (or
        # on the window's kept rows) as it is: its values are exact in its dtype (bf16 activations: bf16 products,
        # exact in the fp32 accumulation), so no fp32 copy is made
        if not kept:
            self._keep(x, plan, st)
        if mode == "keep":  # (the graph runner keeps st.lagging at every replay; this marks an eager call's too)
            st.lagging = True
            return (None,) * 4 + (self.indexer.weights_proj(x, torch.float32),) if self.indexer is not None else None
        if mode == "close":
            # the window's r rows (this step's last), from its start: pos - (r - 1) at a closing step, written so that
            # the capture's warm-up at position 0 stays in range
            r = self.spec.ratio
            proj = self.compress_proj(st.x_ring, torch.float32)
            self._run_compressors(proj, st, rope, plan.window_start(r), window=True)
            st.lagging = False
            return proj if self.indexer is None else proj[:4] + (proj[4][:, r - 1:],)
        proj = self.compress_proj(x, torch.float32)
        self._run_compressors(proj, st, rope, plan.start)
        return proj

    def _run_compressors(self, proj: tuple, st: BlockState, rope: Rope, start: torch.Tensor,
                         window: bool = False) -> None:
        self.compressor(proj[0], proj[1], None, st.compressor, rope, start, window)
        if self.indexer is not None:
            self.indexer.compressor(proj[2], proj[3], None, st.indexer, rope, start, window)

    def _keep(self, x: torch.Tensor, plan: StepPlan, st: BlockState) -> None:
        """x's rows of the open window into st.x_ring at slot p mod ratio: its last min(S, ratio) rows (a chunk's end is
        not known on the host in a captured piece; rows of a window that closed are rewritten before a step reads
        their slots)."""
        r, S = self.spec.ratio, x.shape[1]
        m = min(S, r)
        st.x_ring.index_copy_(1, plan.window_slots(r)[S - m:], x[:, S - m:])

    def catch_up(self, st: BlockState, pos: int, rope: Rope) -> None:
        """Where decode steps deferred the compressors (st.lagging), run them over the open window's kept rows (the
        positions before pos), so that their state holds those rows again; clears st.lagging."""
        if not st.lagging:
            return
        k = pos % self.spec.ratio
        if k:
            x = st.x_ring[:, :k]
            start = torch.full((1,), pos - k, dtype=torch.int64, device=x.device)
            self._run_compressors(self.compress_proj(x, torch.float32), st, rope, start)
        st.lagging = False

    def attend(self, a: "AttnStart", plan: StepPlan, st: BlockState) -> torch.Tensor:
        """The index lists, the indexer (CSA), the queries' and kv's norm + RoPE, the sparse attention and (prefill)
        the ring insert -> o [B,S,H,hd]."""
        B, S = a.B, a.S
        ref = self.numerics.reference
        kv_comp = idx_comp = idx_branch = None
        if self.compressor is not None:
            n = plan.n_entries(self.spec.ratio, st.compressor.entries.shape[1] - 1)
            kv_comp = st.compressor.entries[:, :n]
            if self.indexer is not None:
                # the indexer's chain (its queries' RoPE, scores, top-k) on the side stream too, after the
                # compressors whose key entries it reads (the same stream), beside the queries' norm + RoPE and
                # the kv insert
                n_vis = plan.n_visible(self.spec.ratio)
                idx_branch = a.idx_fork if a.idx_fork is not None else SideBranch(a.q.device)
                with idx_branch:
                    idx_comp = self.indexer(a.q_idx, a.proj[4], plan, st.indexer, a.rope, n, n_vis)
            else:  # HCA: every visible entry, ascending
                idx_comp = plan.prefix_idx(self.spec.ratio, n).expand(B, -1, -1)
        q = a.q.unflatten(-1, (self.n_heads, self.head_dim))
        plan.ready()  # the step plan's kernels (built beside this layer so far, see Transformer.layer_step)
        nope = self.nope_dim if ref else 0
        cos, sin = a.cos, a.sin
        # the query's and kv's norm + RoPE in one op; the ring keeps the last W raw kv vectors, slot = position mod W
        if plan.ring_first:  # one token: normed straight into its slot, the ring is the whole window
            q, _ = ops.qkv_norm_rope(q, a.kv, self.kv_norm.weight, self.eps, cos, sin, ref, nope, st.window,
                                     plan.ring_slots)
            kv_win = st.window
        else:  # (a packed ring: the chunk's rows packed too)
            q, kv = ops.qkv_norm_rope(q, a.kv, self.kv_norm.weight, self.eps, cos, sin, ref, nope,
                                      pack=is_packed(st.window))
            kv_win = torch.cat((st.window, kv), 1)  # ring (positions < start) ++ this chunk
        idx_win = plan.win_idx.expand(B, -1, -1)
        # the last branch's join covers the earlier one (one side stream)
        last = idx_branch if idx_branch is not None else a.comp_branch
        if last is not None:
            last.join()
        if a.defer:
            # an HCA step that defers its compressors keeps x here (after the lists and the query path are queued),
            # beside the attention and the output projections; joined at the end of the layer (join_deferred). In line
            # (CPU, set_overlap(False)) it runs at that join
            a.deferred = SideBranch(a.x.device)
            if a.deferred.side is not None:
                with a.deferred:
                    a.proj = self._compress(a.x, plan, st, a.rope, "keep")
            else:
                a.run_deferred = lambda: self._compress(a.x, plan, st, a.rope, "keep")
        # the output's RoPE dims rotated back to the query's position (V = K carries RoPE) in the same op
        o = ops.sparse_attn(q, kv_win, idx_win, kv_comp, idx_comp, self.attn_sink, self.head_dim ** -0.5, cos, sin)
        if not plan.ring_first:
            st.window.index_copy_(1, plan.ring_slots, kv[:, S - plan.ring_slots.shape[0]:])
        return o

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        """o [B,S,H,hd] -> the grouped wo_a, then wo_b -> [B,S,D]."""
        z = ops.wo_a(o.flatten(2).unflatten(-1, (self.o_groups, -1)), *self.wo_a_grouped())
        return self.wo_b(z.flatten(2))


@dataclass
class AttnStart:
    """What Attention.begin hands to Attention.attend."""

    B: int
    S: int
    rope: Rope
    cos: torch.Tensor
    sin: torch.Tensor
    q: torch.Tensor  # [B,S,H*hd] before its norm
    q_idx: torch.Tensor | None  # the indexer's queries (CSA)
    kv: torch.Tensor  # [B,S,hd] before its norm
    # the compressors' projections (|| the indexer's head weights); a step that only keeps x: (None x 4, the head
    # weights) in a CSA layer, None in an HCA layer; a closing step after such steps: the window's rows, the head
    # weights this token's
    proj: tuple | None
    comp_branch: SideBranch | None  # the compressors' side branch, not joined yet
    # the input, referenced until attend() returns (an HCA step's kept x: until join_deferred): while a side branch is
    # not joined, its GEMM still reads x on the side stream, and a freed x could be handed to the main stream's next
    # allocation
    x: torch.Tensor
    # a decode step of a CSA layer: the indexer chain's branch, forked after the indexer's queries (its work is queued
    # by attend(); between the fork and that work the main stream reads no side-stream tensor)
    idx_fork: SideBranch | None = None
    defer: bool = False  # an HCA step's x kept by attend() (Attention.begin)
    deferred: SideBranch | None = None  # the branch that keeps x, forked by attend(), joined by join_deferred()
    run_deferred: object = None  # in line: that, run by join_deferred()

    def join_deferred(self) -> None:
        """Join the branch that keeps an HCA step's x (the end of the layer's step; in line, run it now); x stays
        referenced until then (see SideBranch)."""
        if self.run_deferred is not None:
            self.proj = self.run_deferred()
            self.run_deferred = None
        if self.deferred is not None:
            self.deferred.join()
            self.deferred = None
