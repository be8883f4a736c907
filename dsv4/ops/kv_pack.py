"""Packed FP8 K = V rows: the form the attention state keeps its entries in under reference numerics (#13 item 5).

DeepSeek's reference numerics round the no-RoPE dims of every stored K = V row (the window's kv and the
compressors' entries) to FP8 e4m3 in blocks of 64 with power-of-two scales (act_quant, SPEC §2.3.4); only the
last ROPE = 64 dims stay in the activation dtype. So a row of D dims (bf16 activations) is stored as
RB = kv_row_bytes(D) bytes:

    [0, N)                      the e4m3 codes of the N = D - 64 no-RoPE dims
    [N, N + 128)                the 64 RoPE dims as bf16
    [N + 128, N + 128 + N / 64) one E8M0 byte per block of 64 codes: the block's scale 2^(byte - 127)
    then zeros to a multiple of 16 bytes (16-byte aligned rows, for vector loads)

Flash / Pro (D = 512): 592 bytes against 1,024 in bf16. A code times its power-of-two scale is exactly the bf16 value
the simulation gives, so a reader that dequantizes sees the very numbers a bf16 state holds: the same results bit
for bit at about half the memory. Writers store the codes and scales of the simulation they perform (its scale is
act_quant's, amax floored at 1e-4); `kv_pack_ref` packs rows that are already FP8-simulated (re-quantizing such a
row gives back its values exactly).

The Lightning Indexer's keys are FP4-simulated under reference numerics (Hadamard, then e2m1 in blocks of 32 with
power-of-two scales, SPEC §2.5), so a key of d dims (a multiple of 32) is stored as KB = key_row_bytes(d) bytes:

    [0, d / 2)                  the e2m1 codes, two a byte, the even (first) element in the low nibble
    [d / 2, d / 2 + d / 32)     one E8M0 byte per block of 32: the block's scale 2^(byte - 127)
    then zeros to a multiple of 16 bytes

Flash / Pro (d = 128): 80 bytes against 256 in bf16. E2M1 value x scale is exactly the simulated bf16 value.
"""

from __future__ import annotations

import torch

from dsv4.ops.act_quant import act_quant_ref
from dsv4.ops.fp4_quant import e2m1_lut, fp4_act_quant_ref

ROPE = 64  # trailing dims kept in bf16 (DeepSeek-V4's qk_rope_head_dim)
BLOCK = 64  # codes per scale byte
KEY_BLOCK = 32  # FP4 key codes per scale byte


def kv_row_bytes(dim: int) -> int:
    """Bytes of one packed row of `dim` dims (dim - 64 a positive multiple of 64)."""
    nope = dim - ROPE
    if nope <= 0 or nope % BLOCK:
        raise ValueError(f"kv_pack: a packed row needs dim - {ROPE} a positive multiple of {BLOCK}, got dim {dim}")
    return -(-(nope + 2 * ROPE + nope // BLOCK) // 16) * 16


def packed_row_dim(row_bytes: int) -> int:
    """The dims of a packed row of `row_bytes` bytes (kv_row_bytes' inverse; ValueError for no such row)."""
    for dim in range(ROPE + BLOCK, 64 * row_bytes, BLOCK):
        if kv_row_bytes(dim) >= row_bytes:
            if kv_row_bytes(dim) == row_bytes:
                return dim
            break
    raise ValueError(f"kv_pack: no packed row is {row_bytes} bytes long")


def packable(dim: int, dtype: torch.dtype) -> bool:
    """True when rows of `dim` dims in `dtype` have a packed form (bf16, dim - 64 a positive multiple of 64)."""
    return dtype == torch.bfloat16 and dim > ROPE and (dim - ROPE) % BLOCK == 0


def is_packed(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.uint8


def packed_dim(t: torch.Tensor, dim: int) -> None:
    """Raise unless t is packed rows of `dim` dims ([..., kv_row_bytes(dim)] uint8, unit stride on the bytes)."""
    rb = kv_row_bytes(dim)
    if t.dtype != torch.uint8 or t.shape[-1] != rb or (t.shape[-1] > 0 and t.stride(-1) != 1):
        raise ValueError(f"kv_pack: want packed rows [..., {rb}] uint8 of {dim} dims, got {t.dtype}{tuple(t.shape)}")


def kv_pack_parts(codes: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """codes [..., N] float8_e4m3fn, scales [..., N / 64] fp32 (powers of two), rope [..., 64] bf16 -> packed rows
    [..., kv_row_bytes(N + 64)] uint8."""
    N = codes.shape[-1]
    rb = kv_row_bytes(N + ROPE)
    lead = codes.shape[:-1]
    out = torch.zeros(*lead, rb, dtype=torch.uint8, device=codes.device)
    out[..., :N] = codes.contiguous().view(torch.uint8)
    out[..., N:N + 2 * ROPE] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    out[..., N + 2 * ROPE:N + 2 * ROPE + N // BLOCK] = ((scales.float().contiguous().view(torch.int32) >> 23)
                                                       & 0xFF).to(torch.uint8)
    return out


def kv_pack_ref(v: torch.Tensor) -> torch.Tensor:
    """FP8-simulated rows v [..., D] bf16 -> packed rows [..., kv_row_bytes(D)] uint8 holding the same values."""
    if v.dtype != torch.bfloat16:
        raise ValueError(f"kv_pack: rows must be bf16, got {v.dtype}")
    N = v.shape[-1] - ROPE
    kv_row_bytes(v.shape[-1])
    q, s = act_quant_ref(v[..., :N], BLOCK)
    return kv_pack_parts(q, s, v[..., N:])


def kv_unpack_ref(p: torch.Tensor, dim: int) -> torch.Tensor:
    """Packed rows p [..., kv_row_bytes(dim)] uint8 -> their values [..., dim] bf16 (exact)."""
    packed_dim(p, dim)
    N = dim - ROPE
    codes = p[..., :N].contiguous().view(torch.float8_e4m3fn).float()
    sb = p[..., N + 2 * ROPE:N + 2 * ROPE + N // BLOCK].to(torch.int32)
    scales = (sb << 23).view(torch.float32)  # 2^(byte - 127); byte 0 (a zero-filled row) gives 0
    nope = (codes.unflatten(-1, (N // BLOCK, BLOCK)) * scales[..., None]).flatten(-2)
    rope = p[..., N:N + 2 * ROPE].contiguous().view(torch.bfloat16)
    return torch.cat((nope.to(torch.bfloat16), rope), -1)


# ---- packed FP4 indexer keys


def key_row_bytes(dim: int) -> int:
    """Bytes of one packed FP4 key of `dim` dims (a positive multiple of 32)."""
    if dim <= 0 or dim % KEY_BLOCK:
        raise ValueError(f"kv_pack: a packed key needs dims a positive multiple of {KEY_BLOCK}, got {dim}")
    return -(-(dim // 2 + dim // KEY_BLOCK) // 16) * 16


def key_packable(dim: int, dtype: torch.dtype) -> bool:
    """True when keys of `dim` dims in `dtype` have a packed FP4 form (bf16, dim a positive multiple of 32)."""
    return dtype == torch.bfloat16 and dim > 0 and dim % KEY_BLOCK == 0


def packed_key_dim(t: torch.Tensor, dim: int) -> None:
    """Raise unless t is packed keys of `dim` dims ([..., key_row_bytes(dim)] uint8, unit stride on the bytes)."""
    kb = key_row_bytes(dim)
    if t.dtype != torch.uint8 or t.shape[-1] != kb or (t.shape[-1] > 0 and t.stride(-1) != 1):
        raise ValueError(f"kv_pack: want packed keys [..., {kb}] uint8 of {dim} dims (unit stride on the bytes), got "
                         f"{t.dtype}{tuple(t.shape)} with strides {t.stride()}")


def key_pack_parts(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., d] uint8 e2m1 codes (0..15), scales [..., d / 32] fp32 (powers of two) -> packed keys
    [..., key_row_bytes(d)] uint8."""
    d = codes.shape[-1]
    kb = key_row_bytes(d)
    out = torch.zeros(*codes.shape[:-1], kb, dtype=torch.uint8, device=codes.device)
    c = codes.to(torch.uint8)
    out[..., :d // 2] = c[..., 0::2] | (c[..., 1::2] << 4)
    out[..., d // 2:d // 2 + d // KEY_BLOCK] = ((scales.float().contiguous().view(torch.int32) >> 23)
                                                & 0xFF).to(torch.uint8)
    return out


def key_pack_ref(v: torch.Tensor) -> torch.Tensor:
    """FP4-simulated keys v [..., d] bf16 (fp4_act_quant_sim_ref's values) -> packed keys holding the same values
    (re-quantizing a simulated row gives back its values exactly)."""
    if v.dtype != torch.bfloat16:
        raise ValueError(f"kv_pack: keys must be bf16, got {v.dtype}")
    key_row_bytes(v.shape[-1])
    return key_pack_parts(*fp4_act_quant_ref(v, KEY_BLOCK))


def key_unpack_ref(p: torch.Tensor, dim: int) -> torch.Tensor:
    """Packed keys p [..., key_row_bytes(dim)] uint8 -> their values [..., dim] bf16 (exact)."""
    packed_key_dim(p, dim)
    b = p[..., :dim // 2].long()
    codes = torch.stack((b & 15, b >> 4), -1).flatten(-2)  # element 2i: the low nibble of byte i
    sb = p[..., dim // 2:dim // 2 + dim // KEY_BLOCK].to(torch.int32)
    scales = (sb << 23).view(torch.float32)  # 2^(byte - 127); byte 0 (a zero-filled row) gives 0
    v = e2m1_lut(p.device)[codes].unflatten(-1, (-1, KEY_BLOCK)) * scales[..., None]
    return v.flatten(-2).to(torch.bfloat16)
