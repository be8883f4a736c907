"""Triton `sample_race` (dsv4/ops/sample.py): a token from softmax(logits / T) in one launch; with top_p < 1, five
`_nucleus_kernel` launches first find the nucleus' smallest logit (a radix select over the logits' order keys with
the probabilities as weights: no sort) and the race skips the ids below it.

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
import functools
import math
import struct
from fractions import Fraction

import torch
import triton
import triton.language as tl

from dsv4.ops.sample import ATANH_COEFFS, PHILOX_M, PHILOX_W, check_race_args, race_temperature
from dsv4.ops.triton_util import arrival_counters

BLOCK = 1024  # 127 programs at Flash's vocabulary
NUCLEUS_G, NUCLEUS_WARPS = 16, 8  # the nucleus passes' bins a step ([BLOCK, G] compares) and warps
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


@triton.jit
def _order_key(x):
    """fp32 -> uint32 with the same order (sample.order_key_ref); -0.0 as +0.0."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "call_lo", "call_hi"])
def _race_kernel(l_ptr, sl, o_ptr, pk_ptr, pi_ptr, c_ptr, st_ptr, V, NB, temperature, seed_lo, seed_hi, call_lo,
                 call_hi, BLOCK: tl.constexpr, NBP: tl.constexpr, NUCLEUS: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(l_ptr + b.to(tl.int64) * sl + offs, mask=ok, other=float("-inf"))
    if NUCLEUS:  # ids below the nucleus' smallest logit (its order key, from _nucleus_kernel) are out
        low = tl.load(st_ptr + b * 4 + 3).to(tl.uint32, bitcast=True)
        ok = ok & ((_order_key(x) >= low) | (x != x))
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


MASS_BITS = 45  # the nucleus' masses as integers of 2^-45: exact (order-free) sums of the blocks' fp32 partials
_MASS_SCALE = tl.constexpr(float(2**MASS_BITS))


@triton.jit(do_not_specialize=["top_q"])
def _nucleus_kernel(l_ptr, sl, st_ptr, pk_ptr, h_ptr, c_ptr, V, NB, temperature, top_q,
                    PASS: tl.constexpr, BLOCK: tl.constexpr, NBP: tl.constexpr, G: tl.constexpr):
    """The nucleus' smallest logit (sample.nucleus_key_ref) in five launches over the row, PASS 0..4, each finished
    by its last program to arrive. PASS 0: the row's maximum M and normaliser Z (the blocks' partials in pk, combined
    in block order). PASS 1-4: a radix select of the order keys, 8 bits a pass from the top: each program sums its
    block's probabilities (and counts) per 256 bins of the keys that share the prefix so far (the block loaded once,
    G bins a step), and adds the non-empty bins to the row's histogram as integers of 2^-MASS_BITS (integer atomics:
    the same sums in any arrival order); the last program takes the lowest non-empty bin whose mass above is still
    below top_p (top_q: top_p in those units, rounded up: `over < top_p` exactly), the bin holding the smallest kept
    logit, adds the mass above it, appends it to the prefix and zeroes the histogram for the next pass.
    st [B, 4] fp32 (bits): M, Z, -, the prefix (after PASS 4 the smallest kept logit's key; 0, keep everything, where
    M is not finite). h [B, 520] int64: the bins' masses, their counts, the mass above the prefix."""
    tl.static_assert(256 // G <= 64, "the steps' occupancy is one int64 word")
    b = tl.program_id(0)
    j = tl.program_id(1)
    top_q = top_q & 70368744177663  # (bit 46 set by the caller: typed int64 whatever its value)
    row = l_ptr + b.to(tl.int64) * sl
    st = st_ptr + b * 4
    hq = h_ptr + b * 520
    bins = tl.arange(0, 256)
    if PASS == 0:
        offs = j * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < V, other=float("-inf"))
        m = tl.max(tl.where(x == x, x, float("inf")), axis=0)  # a NaN counts as +inf: its row keeps everything
        m0 = tl.where((m > float("-inf")) & (m < float("inf")), m, 0.0)  # (no inf - inf: such rows keep all)
        z = tl.sum(tl.where(x > float("-inf"), tl.exp((x - m0) / temperature), 0.0), axis=0)
        tl.store(pk_ptr + (b * NB + j) * 2, m)
        tl.store(pk_ptr + (b * NB + j) * 2 + 1, z)
    else:
        big = tl.load(st)
        big = tl.where((big > float("-inf")) & (big < float("inf")), big, 0.0)  # (rows that keep all)
        norm = tl.load(st + 1)
        norm = tl.where(norm > 0.0, norm, 1.0)
        prefix = tl.load(st + 3).to(tl.uint32, bitcast=True)
        SHIFT: tl.constexpr = 32 - 8 * PASS
        offs = j * BLOCK + tl.arange(0, BLOCK)  # the block in registers, one load (a load a loop step waits on its
        x = tl.load(row + offs, mask=offs < V, other=float("-inf"))  # latency: 15 us for 64 steps, 66th pass)
        key = _order_key(x)
        sel = x > float("-inf")  # (past V: -inf)
        if PASS > 1:
            sel = sel & ((key >> (SHIFT + 8)) == prefix)
        digit = tl.where(sel, ((key >> SHIFT) & 255).to(tl.int32), -1)
        # the steps whose G bins hold an id of the block, as bits of one word (one reduction): the others are skipped
        # (pass 1's digit is the sign and 7 exponent bits, which a row's logits fill only a few steps of; past it a
        # block holds few or no ids with the prefix)
        step = (tl.where(sel, digit, 0) // G).to(tl.int64)  # (no shift by a negative amount where unselected)
        occ = tl.reduce_or(tl.where(sel, tl.full([BLOCK], 1, tl.int64) << step, 0), axis=0)
        if occ != 0:
            p = tl.where(sel, tl.exp((x - big) / temperature) / norm, 0.0)
            for g in range(0, 256, G):  # G bins a step: [BLOCK, G] compares, summed over the block
                if ((occ >> (g // G)) & 1) != 0:
                    gb = g + tl.arange(0, G)
                    hit = digit[:, None] == gb[None, :]
                    hm = tl.sum(tl.where(hit, p[:, None], 0.0), axis=0)
                    hc = tl.sum(hit.to(tl.int32), axis=0)
                    tl.atomic_add(hq + gb, (hm * _MASS_SCALE).to(tl.int64), mask=hc > 0, sem="relaxed")
                    tl.atomic_add(hq + 256 + gb, hc.to(tl.int64), mask=hc > 0, sem="relaxed")
    tl.debug_barrier()  # the partials are stored before the (release) arrival
    arrived = tl.atomic_add(c_ptr + b, 1, sem="acq_rel")
    if arrived == NB - 1:
        if PASS == 0:
            nb = tl.arange(0, NBP)
            ms = tl.load(pk_ptr + (b * NB + nb) * 2, mask=nb < NB, other=float("-inf"), cache_modifier=".cg")
            zs = tl.load(pk_ptr + (b * NB + nb) * 2 + 1, mask=nb < NB, other=0.0, cache_modifier=".cg")
            big = tl.max(ms, axis=0)
            b0 = tl.where((big > float("-inf")) & (big < float("inf")), big, 0.0)
            norm = tl.sum(tl.where(ms > float("-inf"), zs * tl.exp((ms - b0) / temperature), 0.0), axis=0)
            tl.store(st, big)
            tl.store(st + 1, norm)
            tl.store(st + 3, 0.0)  # (the bits of key 0)
            tl.store(hq + 512, tl.zeros([], tl.int64))
        else:
            qm = tl.load(hq + bins, cache_modifier=".cg")
            qc = tl.load(hq + 256 + bins, cache_modifier=".cg")
            above = tl.load(hq + 512)
            prefix = tl.load(st + 3).to(tl.uint32, bitcast=True)
            # mass strictly above each bin: the mass above the prefix plus that of the higher bins (a suffix sum less
            # the bin: the highest non-empty bin gets `above` exactly)
            over = above + (tl.cumsum(qm, axis=0, reverse=True) - qm)
            take = tl.min(tl.where((qc > 0) & (over < top_q), bins, 256), axis=0)
            # none below top_p (a top_p under 2^-45, or rounding at the boundary): the highest non-empty bin, which
            # holds the row's largest logit, whose mass above is `above` exactly
            top = tl.max(tl.where(qc > 0, bins, -1), axis=0)
            new_above = tl.where(take < 256, tl.sum(tl.where(bins == take, over, 0), axis=0), above)
            take = tl.where(take < 256, take, top)
            finite = (tl.load(st) < float("inf")) & (tl.load(st) > float("-inf")) & (take >= 0)
            new_prefix = (prefix << 8) | take.to(tl.uint32)
            tl.store(hq + 512, tl.where(finite, new_above, 0))
            tl.store(st + 3, tl.where(finite, new_prefix, 0).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True))
            zero = tl.zeros([256], tl.int64)
            tl.store(hq + bins, zero)  # the histogram zero again for the next pass (and the next draw)
            tl.store(hq + 256 + bins, zero)
        tl.atomic_xchg(c_ptr + b, 0)


@functools.lru_cache(maxsize=64)
def _top_q(top_p: float) -> int:
    """top_p rounded to fp32, in units of 2^-MASS_BITS rounded up (`mass < top_p` as an integer compare), with bit 46
    set so that Triton types it int64 (made once per value: not per draw)."""
    return (1 << 46) | math.ceil(Fraction(struct.unpack("f", struct.pack("f", top_p))[0]) * 2**MASS_BITS)


_WORK: dict = {}  # (device, B, NB, nucleus, stream role) -> the partials (and the nucleus' state and bins): made once


def _work(device: torch.device, B: int, NB: int, nucleus: bool = False) -> tuple[torch.Tensor, ...]:
    """The launch's partials, one set per stream role (as arrival_counters: a launch on the side stream may overlap
    one on the main stream); made outside graph capture, or for that launch alone inside one. With `nucleus`, the
    nucleus' row state [B, 4] and its histogram [B, 520] (zeros: each pass leaves it so) too."""
    from dsv4.ops import stream_role

    key = (device, B, NB, nucleus, stream_role(device))
    work = _WORK.get(key)
    if work is None:
        work = (torch.empty(B, NB, 2, dtype=torch.float32, device=device),
                torch.empty(B, NB, dtype=torch.int32, device=device))
        if nucleus:
            work += (torch.empty(B, 4, dtype=torch.float32, device=device),
                     torch.zeros(B, 520, dtype=torch.int64, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _WORK[key] = work
    return work


def sample_race(logits: torch.Tensor, temperature: float, seed: int, call: int, top_p: float = 1.0) -> torch.Tensor:
    """sample_race_ref's token (same signature): one launch, six with top_p < 1 (five find the nucleus)."""
    check_race_args(logits, temperature, seed, call, top_p)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    if V >= 1 << 31:
        raise ValueError(f"sample_race: a vocabulary of {V} ids does not fit int32 indices")
    NB = triton.cdiv(V, BLOCK)
    dev = logits.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    bit = 1 << 32
    nucleus = top_p < 1
    bp = triton.next_power_of_2(B)
    # Triton launches on the current device's stream whatever device the tensors are on: the logits' (the head's GPU)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        pk, pi, *nw = _work(dev, B, NB, nucleus)  # (its capture check reads the current device's stream)
        st = nw[0] if nucleus else pk
        if nucleus:
            t_low = max(race_temperature(temperature), 2.0**-126)  # the softmax's: a normal fp32 number
            counters = arrival_counters(dev, f"sample nucleus x{bp}", bp)
            top_q = _top_q(float(top_p))
            for k in range(5):
                _nucleus_kernel[(B, NB)](logits, logits.stride(0), st, pk, nw[1], counters, V, NB, t_low, top_q,
                                         PASS=k, BLOCK=BLOCK, NBP=triton.next_power_of_2(NB), G=NUCLEUS_G,
                                         num_warps=NUCLEUS_WARPS)
        _race_kernel[(B, NB)](logits, logits.stride(0), out, pk, pi,
                              arrival_counters(dev, f"sample race x{bp}", bp), st,
                              V, NB, race_temperature(temperature), bit | (seed & 0xFFFFFFFF),
                              bit | (seed >> 32), bit | (call & 0xFFFFFFFF), bit | (call >> 32),
                              BLOCK=BLOCK, NBP=triton.next_power_of_2(NB), NUCLEUS=nucleus, num_warps=4)
    return out
