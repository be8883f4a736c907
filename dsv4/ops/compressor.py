"""KV compressor update (SPEC §2.4): gated pooling of every `ratio` tokens into one compressed entry.

`compressor_ref` takes a chunk's projections (c = wkv(x), g = wgate(x), fp32, any S >= 1) at device
positions start.., and updates the compressor state in place, branch-free and with static shapes (so
the S = 1 decode step is captured once and right at every position):
- the chunk touches at most T = (S + r - 2) // r + 1 windows; their rows are assembled from the open
  window kept in the state (positions < start) and the chunk (gate scores + ape);
- every touched window is pooled (softmax over its slots per channel; CSA: the previous window's A
  halves then this window's B halves); the windows whose last token is in the chunk are emitted:
  cast to the entries dtype, RMSNorm, RoPE at position w*r, then the quantization simulation
  ("fp8": FP8 block 64 on the no-RoPE dims; "fp4": Hadamard + FP4 block 32 (indexer keys); None); uint8 entries
  hold the rows packed (dsv4/ops/kv_pack.py: "fp8" K = V rows, "fp4" keys);
- the state keeps the open window's rows and (CSA) the last closed window.
Windows that do not close leave their entry row as it is (the spare last row of `entries` takes a window
that never closes within the state's length; no query reads it).
"""

from __future__ import annotations

import torch

from dsv4.ops.act_quant import act_quant_ref, act_quant_sim_ref
from dsv4.ops.fp4_quant import fp4_act_quant_ref, fp4_act_quant_sim_ref
from dsv4.ops.hadamard import hadamard_ref
from dsv4.ops.kv_pack import KEY_BLOCK, ROPE, key_pack_parts, kv_pack_parts
from dsv4.ops.norm import rmsnorm_ref
from dsv4.ops.rope import rope_ref


def finish_entries(e: torch.Tensor, norm_w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   quant: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Pooled e [B, n, d] fp32 -> stored entries [B, n, d] in dtype (cos/sin [n, rd/2] at w*r); dtype uint8: packed
    rows (dsv4/ops/kv_pack.py) of the bf16 entries, the simulation's codes and scales: FP8 K = V rows (quant "fp8")
    or FP4 indexer keys (quant "fp4")."""
    pack = dtype == torch.uint8
    if pack and not (quant == "fp4" or (quant == "fp8" and 2 * cos.shape[-1] == ROPE)):
        raise ValueError(f"compressor: packed entries need quant 'fp4', or 'fp8' with {ROPE} RoPE dims, got {quant!r}")
    e = rope_ref(rmsnorm_ref(e.to(torch.bfloat16 if pack else dtype), norm_w, eps), cos, sin)
    if quant == "fp4":
        if pack:
            return key_pack_parts(*fp4_act_quant_ref(hadamard_ref(e), KEY_BLOCK))
        return fp4_act_quant_sim_ref(hadamard_ref(e), KEY_BLOCK)
    if quant == "fp8":
        nope = e.shape[-1] - 2 * cos.shape[-1]
        if pack:
            return kv_pack_parts(*act_quant_ref(e[..., :nope], 64), e[..., nope:])
        return torch.cat((act_quant_sim_ref(e[..., :nope], 64), e[..., nope:]), -1)
    return e


def compressor_ref(c: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, norm_w: torch.Tensor, eps: float,
                   cos_tab: torch.Tensor, sin_tab: torch.Tensor, kv_state: torch.Tensor, score_state: torch.Tensor,
                   entries: torch.Tensor, start: torch.Tensor, ratio: int, overlap: bool,
                   quant: str | None, window: bool = False) -> None:
    """c, g [B,S,coff*d] fp32 at positions start + [0, S) (start: [1] int64 on the device); window: the caller's
    promise that the chunk is one whole window from its start (S = ratio, start a multiple of it; the same result,
    which the fast path computes in the decode step's one launch);
    ape [r, coff*d]; cos_tab/sin_tab [max_pos, rd/2] RoPE tables; kv_state/score_state
    [B, coff*r, coff*d] fp32 and entries [B, n_max + 1, d] (or packed: [B, n_max + 1, kv_row_bytes(d)] uint8 for
    "fp8", [B, n_max + 1, key_row_bytes(d)] for "fp4")
    updated in place."""
    B, S, C = c.shape
    r = ratio
    if window and S != r:
        raise ValueError(f"compressor: window=True needs one window's {r} rows, got {S}")
    d = C // 2 if overlap else C
    dev = c.device
    pos = start + torch.arange(S, device=dev)
    g = g + ape[pos % r]
    T = (S + r - 2) // r + 1  # windows the chunk can touch
    w0 = start // r  # [1] first touched window
    q = w0 * r + torch.arange(T * r, device=dev)  # positions of the touched windows' rows
    in_chunk = ((q >= start) & (q < start + S))[None, :, None]
    in_state = (q < start)[None, :, None]
    ci = (q - start).clamp(0, S - 1)
    si = (r if overlap else 0) + q % r  # the open window's slots in the state
    vals = torch.where(in_chunk, c[:, ci], torch.where(in_state, kv_state[:, si], 0.0)).view(B, T, r, C)
    gates = torch.where(in_chunk, g[:, ci], torch.where(in_state, score_state[:, si], float("-inf")))
    gates = gates.view(B, T, r, C)
    if overlap:  # previous window's A halves, then this window's B halves
        pv = torch.cat((kv_state[:, None, :r, :d], vals[:, :-1, :, :d]), 1)
        pg = torch.cat((score_state[:, None, :r, :d], gates[:, :-1, :, :d]), 1)
        pv, pg = torch.cat((pv, vals[..., d:]), 2), torch.cat((pg, gates[..., d:]), 2)
    else:
        pv, pg = vals, gates
    e = (pv * pg.softmax(dim=2)).sum(2)  # [B,T,d] fp32

    w = w0 + torch.arange(T, device=dev)  # window indices
    emit = (w + 1) * r - 1 <= start + S - 1  # the window's last token is in this chunk
    rope_pos = (w * r).clamp_max(cos_tab.shape[0] - 1)
    e = finish_entries(e, norm_w, eps, cos_tab[rope_pos], sin_tab[rope_pos], quant, entries.dtype)
    # windows that stay open keep their row as it is (written back unchanged): every index names one window
    # and the result is deterministic (a scatter of duplicate indices would not be)
    slot = w.clamp_max(entries.shape[1] - 1)
    entries.index_copy_(1, slot, torch.where(emit[None, :, None], e, entries.index_select(1, slot)))

    # the open window after the chunk (its first (start+S) % r rows matter) and CSA's last closed one
    end = start + S
    jn = (end // r - w0).clamp(0, T - 1)
    new_open_v = vals.index_select(1, jn)[:, 0]  # [B,r,C]
    new_open_g = gates.index_select(1, jn)[:, 0]
    if overlap:
        jc = end // r - 1 - w0  # the last closed window, if it closed in this chunk
        closed = (jc >= 0).view(1, 1, 1)
        jc = jc.clamp(0, T - 1)
        kv_state[:, :r] = torch.where(closed, vals.index_select(1, jc)[:, 0], kv_state[:, :r])
        score_state[:, :r] = torch.where(closed, gates.index_select(1, jc)[:, 0], score_state[:, :r])
        kv_state[:, r:] = new_open_v
        score_state[:, r:] = new_open_g
    else:
        kv_state.copy_(new_open_v)
        score_state.copy_(new_open_g)


def register_ops(register) -> None:
    try:
        from dsv4.ops import compressor_triton as fast
    except ImportError:  # no Triton here: the reference runs
        fast = None
    register("compressor", compressor_ref, getattr(fast, "compressor", None), interpretable=True,
             doc="compressor state update: gated pooling, norm, RoPE, quant simulation, entry insert "
                 "(fast: the decode step in one launch, a prefill chunk in two)")
