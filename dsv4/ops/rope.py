"""RoPE on the last `rope_dim` dims, interleaved pairs (SPEC §2.3.3), and the attention prologues built on it.

`rope_ref(x, cos, sin, inverse)`: x [B, S, (H,) D] rotated on its last 2*cos.shape[-1] dims by the
per-token angles (cos, sin [S, rd/2] fp32, already gathered at the tokens' positions); fp32 math,
written back in x.dtype; inverse rotates by the conjugate.
`q_norm_rope_ref`: the query's per-head unweighted RMS normalisation (statistic in the activation
dtype under reference numerics, as DeepSeek computes it in bf16; fp32 otherwise) then RoPE.
`kv_norm_rope_ref`: kv_norm (weighted RMSNorm), RoPE, then the FP8 simulation of the no-RoPE dims
(block 64, power-of-two scales) under reference numerics; given a ring and slots, the rows go straight
into the ring (the decode step's window insert) and nothing is returned. A packed ring (uint8, dsv4/ops/kv_pack.py)
takes the rows as packed FP8 rows (the simulation's codes and scales), and pack=True returns them so.
`qkv_norm_rope_ref`: both, on one chunk's query and kv (the attention's prologue, one op and one launch).
"""

from __future__ import annotations

import torch

from dsv4.ops.act_quant import act_quant_ref, act_quant_sim_ref
from dsv4.ops.kv_pack import ROPE, is_packed, kv_pack_parts
from dsv4.ops.norm import rmsnorm_ref


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    rd = 2 * cos.shape[-1]
    if inverse:
        sin = -sin
    while cos.dim() < x.dim() - 1:  # broadcast over head dims between S and D
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    r = x[..., -rd:].float().unflatten(-1, (rd // 2, 2))
    a, b = r[..., 0], r[..., 1]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rot.to(x.dtype)), dim=-1)


def q_norm_rope_ref(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                    low_precision_stat: bool) -> torch.Tensor:
    """q [B, S, H, D] -> per-head RMS-normalised (no weight) and RoPE'd q, same dtype."""
    if low_precision_stat:  # DeepSeek computes the statistic in the activation dtype (bf16)
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    else:
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + eps).to(q.dtype)
    return rope_ref(q, cos, sin)


def check_pack(kv: torch.Tensor, fp8_nope: int, cos: torch.Tensor) -> None:
    """Packed rows need bf16 kv whose FP8-simulated dims are all but the last 64, the RoPE dims."""
    if kv.dtype != torch.bfloat16 or fp8_nope != kv.shape[-1] - ROPE or 2 * cos.shape[-1] != ROPE:
        raise ValueError(f"kv_norm_rope: packed rows need bf16 kv with fp8_nope = D - {ROPE} and {ROPE} RoPE dims, got "
                         f"{kv.dtype} D={kv.shape[-1]}, fp8_nope={fp8_nope}, RoPE dims {2 * cos.shape[-1]}")


def kv_norm_rope_ref(kv: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     fp8_nope: int, ring: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None, pack: bool = False) -> torch.Tensor | None:
    """kv [B, S, D] -> kv_norm, RoPE, and (fp8_nope > 0) FP8-simulate the first fp8_nope dims. With ring
    [B, W, D] (kv's dtype) and slots [S] int64: row s goes to ring[:, slots[s]] and None is returned. A packed ring
    ([B, W, kv_row_bytes(D)] uint8), or pack=True, takes / returns the rows packed (fp8_nope = D - 64, bf16)."""
    pack = pack or is_packed(ring)
    if pack:
        check_pack(kv, fp8_nope, cos)
    kv = rope_ref(rmsnorm_ref(kv, w, eps), cos, sin)
    if pack:
        kv = kv_pack_parts(*act_quant_ref(kv[..., :fp8_nope], 64), kv[..., fp8_nope:])
    elif fp8_nope:
        kv = torch.cat((act_quant_sim_ref(kv[..., :fp8_nope], 64), kv[..., fp8_nope:]), -1)
    if ring is None:
        return kv
    ring.index_copy_(1, slots, kv)
    return None


def qkv_norm_rope_ref(q: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, low_precision_stat: bool, fp8_nope: int, ring: torch.Tensor | None = None,
                      slots: torch.Tensor | None = None, pack: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q_norm_rope_ref(q, ...), kv_norm_rope_ref(kv, w, ...)): kv's rows None where they went into the ring;
    packed FP8 rows where the ring is packed or pack=True."""
    return (q_norm_rope_ref(q, cos, sin, eps, low_precision_stat),
            kv_norm_rope_ref(kv, w, eps, cos, sin, fp8_nope, ring, slots, pack))


def register_ops(register) -> None:
    try:
        from dsv4.ops import norm_rope_triton as fast
    except ImportError:  # no Triton here: the references run
        fast = None
    register("rope", rope_ref, getattr(fast, "rope", None), interpretable=True,
             doc="interleaved RoPE on the last dims (and its inverse)")
    register("qkv_norm_rope", qkv_norm_rope_ref, getattr(fast, "qkv_norm_rope", None), interpretable=True,
             doc="per-head RMS of q + RoPE, kv_norm + RoPE + FP8 KV simulation (+ ring insert), one launch")
