"""Triton `sample_race` (dsv4/ops/sample.py): a token from softmax(logits / T) in one launch.

Grid (rows, blocks of BLOCK logits). Each program makes its block's Philox noise, keys and best (key, index), stores
them, and arrives on its row's counter (acq_rel); the row's last program to arrive reads the row's partials in block
order, writes the token (among equal keys the smallest log E, then the lowest index, as the reference) and leaves
the counter at 0.
The same input gives the same token however the programs are scheduled. Nothing depends on the host: the seed and
the draw's index are launch arguments, so a decode step can be queued on the token before the host reads it.

Against torch's sampler (softmax, exponential_, division, argmax: ~8 launches over the vocabulary, ~30-60 us a token
on an H200 at Flash's 129,280 ids, sixty-third pass): one launch of 127 programs. The seed and call words are passed
with bit 32 set so that Triton types them as int64 whatever their value (one compiled kernel; the kernel drops it).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dsv4.ops.sample import ATANH_COEFFS, PHILOX_M, PHILOX_W, check_race_args, race_temperature
from dsv4.ops.triton_util import arrival_counters

BLOCK = 1024  # 127 programs at Flash's vocabulary
_M0, _M1 = tl.constexpr(PHILOX_M[0]), tl.constexpr(PHILOX_M[1])
_W0, _W1 = tl.constexpr(PHILOX_W[0]), tl.constexpr(PHILOX_W[1])
_A = [tl.constexpr(c) for c in ATANH_COEFFS]
_A0, _A1, _A2, _A3, _A4, _A5, _A6, _A7 = _A


@triton.jit
def _philox_w0(c0, c1, c2, c3, k0, k1):
    """The first output word of Philox4x32-10 (uint32 tensors / scalars)."""
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + _W0
            k1 = k1 + _W1
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0


@triton.jit
def _log_exp1(w):
    """log(E), E ~ Exp(1), from a uint32 word (sample.py's steps)."""
    v = (w | 1).to(tl.float32) * 2.3283064365386963e-10  # 2^-32
    s = v / (2.0 - v)
    s2 = s * s
    p = _A0 * s2 + _A1
    p = p * s2 + _A2
    p = p * s2 + _A3
    p = p * s2 + _A4
    p = p * s2 + _A5
    p = p * s2 + _A6
    p = p * s2 + _A7
    e = tl.where(v <= 0.5, 2.0 * s * p, -tl.log(tl.maximum(1.0 - v, 2.3283064365386963e-10)))
    return tl.log(e)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "call_lo", "call_hi"])
def _race_kernel(l_ptr, sl, o_ptr, pk_ptr, pi_ptr, c_ptr, V, NB, temperature, seed_lo, seed_hi, call_lo, call_hi,
                 BLOCK: tl.constexpr, NBP: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(l_ptr + b.to(tl.int64) * sl + offs, mask=ok, other=float("-inf"))
    zero = offs.to(tl.uint32) * 0
    w = _philox_w0(offs.to(tl.uint32), zero + b.to(tl.uint32), zero + call_lo.to(tl.uint32),
                   zero + call_hi.to(tl.uint32), seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))
    le = _log_exp1(w)
    key = x - temperature * le
    key = tl.where(key == key, key, float("inf"))  # NaN wins, as in torch's argmax
    key = tl.where(ok, key, float("-inf"))
    best = tl.max(key, axis=0)
    le = tl.where(ok & (key == best), le, float("inf"))  # (an all -inf row: past V is no candidate)
    small = tl.min(le, axis=0)  # among the best keys the smallest log(E), then the lowest index
    at = tl.min(tl.where(le == small, offs, 2147483647), axis=0)
    tl.store(pk_ptr + (b * NB + j) * 2, best)
    tl.store(pk_ptr + (b * NB + j) * 2 + 1, small)
    tl.store(pi_ptr + b * NB + j, at)
    tl.debug_barrier()  # the partials are stored before the (release) arrival
    arrived = tl.atomic_add(c_ptr + b, 1, sem="acq_rel")
    if arrived == NB - 1:
        nb = tl.arange(0, NBP)
        pk = tl.load(pk_ptr + (b * NB + nb) * 2, mask=nb < NB, other=float("-inf"), cache_modifier=".cg")
        pl = tl.load(pk_ptr + (b * NB + nb) * 2 + 1, mask=nb < NB, other=float("inf"), cache_modifier=".cg")
        pi = tl.load(pi_ptr + b * NB + nb, mask=nb < NB, other=2147483647, cache_modifier=".cg")
        pl = tl.where(pk == tl.max(pk, axis=0), pl, float("inf"))
        tok = tl.min(tl.where(pl == tl.min(pl, axis=0), pi, 2147483647), axis=0)  # blocks: ascending indices
        tl.store(o_ptr + b, tok.to(tl.int64))
        tl.atomic_xchg(c_ptr + b, 0)


_WORK: dict = {}  # (device, B, NB, stream role) -> (partial (key, log E) pairs, partial indices): made once


def _work(device: torch.device, B: int, NB: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch's partials, one set per stream role (as arrival_counters: a launch on the side stream may overlap
    one on the main stream); made outside graph capture, or for that launch alone inside one."""
    from dsv4.ops import stream_role

    key = (device, B, NB, stream_role(device))
    work = _WORK.get(key)
    if work is None:
        work = (torch.empty(B, NB, 2, dtype=torch.float32, device=device),
                torch.empty(B, NB, dtype=torch.int32, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _WORK[key] = work
    return work


def sample_race(logits: torch.Tensor, temperature: float, seed: int, call: int) -> torch.Tensor:
    """sample_race_ref's token, one launch (same signature)."""
    check_race_args(logits, temperature, seed, call)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    if V >= 1 << 31:
        raise ValueError(f"sample_race: a vocabulary of {V} ids does not fit int32 indices")
    NB = triton.cdiv(V, BLOCK)
    dev = logits.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    bit = 1 << 32
    # Triton launches on the current device's stream whatever device the tensors are on: the logits' (the head's GPU)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        pk, pi = _work(dev, B, NB)  # (its capture check reads the current device's stream)
        _race_kernel[(B, NB)](logits, logits.stride(0), out, pk, pi,
                              arrival_counters(dev, f"sample race x{triton.next_power_of_2(B)}",
                                               triton.next_power_of_2(B)),
                              V, NB, race_temperature(temperature), bit | (seed & 0xFFFFFFFF),
                              bit | (seed >> 32), bit | (call & 0xFFFFFFFF), bit | (call >> 32),
                              BLOCK=BLOCK, NBP=triton.next_power_of_2(NB), num_warps=4)
    return out
