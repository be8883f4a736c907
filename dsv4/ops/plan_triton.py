"""Triton fast path of `step_plan` (dsv4/ops/plan.py): the decode step's plan in one launch.

One program per output family, all in one grid: program 0 writes the window list and the ring slot, programs
1..T copy the RoPE rows of table t at the position, programs T+1.. write a visible count (with the window slot and
start) or an HCA list. Integer
results and copied rows: bit for bit `step_plan_ref`. Up to MAX_TABLES tables and MAX_LISTS ratios / lists per call
(more: the reference runs). The position is not checked against the tables' rows (the reference's indexing raises
there; the engine never asks past them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.plan import step_plan_ref

MAX_TABLES = 4
MAX_LISTS = 4
_LIST_BLOCK = 1024


# the integer arguments are never specialised: an integer 1 (a padded slot's ratio) would turn into a constexpr and
# the branches that pick an argument by program id would no longer agree on its type
@triton.jit(do_not_specialize=["window", "half", "r0", "r1", "r2", "r3", "q0", "q1", "q2", "q3",
                               "n0", "n1", "n2", "n3"])
def _plan_kernel(start_ptr, win_ptr, ring_ptr, window,
                 c0, s0, oc0, os0, c1, s1, oc1, os1, c2, s2, oc2, os2, c3, s3, oc3, os3, half,
                 r0, r1, r2, r3, v0, v1, v2, v3,
                 q0, q1, q2, q3, l0, l1, l2, l3, n0, n1, n2, n3,
                 T: tl.constexpr, NV: tl.constexpr, WP: tl.constexpr, HP: tl.constexpr, LB: tl.constexpr):
    pid = tl.program_id(0)
    pos = tl.load(start_ptr)  # int64
    if pid == 0:
        j = tl.arange(0, WP)
        first = tl.maximum(pos - window + 1, 0)
        p = first + j
        idx = tl.where(p <= pos, p % window, -1).to(tl.int32)
        tl.store(win_ptr + j, idx, mask=j < window)
        tl.store(ring_ptr, pos % window)
    elif pid <= T:
        t = pid - 1
        if t == 0:
            c, s, oc, os = c0, s0, oc0, os0
        elif t == 1:
            c, s, oc, os = c1, s1, oc1, os1
        elif t == 2:
            c, s, oc, os = c2, s2, oc2, os2
        else:
            c, s, oc, os = c3, s3, oc3, os3
        h = tl.arange(0, HP)
        hm = h < half
        tl.store(oc + h, tl.load(c + pos * half + h, mask=hm), mask=hm)
        tl.store(os + h, tl.load(s + pos * half + h, mask=hm), mask=hm)
    elif pid <= T + NV:
        i = pid - 1 - T
        if i == 0:
            r, v = r0, v0
        elif i == 1:
            r, v = r1, v1
        elif i == 2:
            r, v = r2, v2
        else:
            r, v = r3, v3
        tl.store(v, (pos + 1) // r)
        tl.store(v + 1, pos % r)
        tl.store(v + 2, pos - pos % r)
    else:
        i = pid - 1 - T - NV
        if i == 0:
            q, out, n = q0, l0, n0
        elif i == 1:
            q, out, n = q1, l1, n1
        elif i == 2:
            q, out, n = q2, l2, n2
        else:
            q, out, n = q3, l3, n3
        vis = (pos + 1) // q
        for b in range(0, n, LB):
            ar = b + tl.arange(0, LB)
            tl.store(out + ar, tl.where(ar < vis, ar, -1).to(tl.int32), mask=ar < n)


def _pad(items: list, k: int, fill) -> list:
    return list(items) + [fill] * (k - len(items))


def step_plan(start: torch.Tensor, window: int, tables: list, ratios: list, prefix: list) -> tuple:
    """step_plan_ref's contract, one launch (see the module docstring)."""
    halves = {c.shape[-1] for c, _ in tables}
    usable = (start.numel() >= 1 and start.dtype == torch.int64 and window >= 1 and len(tables) <= MAX_TABLES
              and len(ratios) <= MAX_LISTS and len(prefix) <= MAX_LISTS and len(halves) <= 1
              and all(c.is_contiguous() and s.is_contiguous() and c.dtype == s.dtype == torch.float32
                      and c.shape == s.shape and c.device == start.device == s.device for c, s in tables))
    if not usable:
        return step_plan_ref(start, window, tables, ratios, prefix)
    dev = start.device
    half = halves.pop() if halves else 1
    win_idx = torch.empty((1, window), dtype=torch.int32, device=dev)
    ring = torch.empty(1, dtype=torch.int64, device=dev)
    ropes = [(torch.empty((1, half), dtype=torch.float32, device=dev),
              torch.empty((1, half), dtype=torch.float32, device=dev)) for _ in tables]
    n_vis = [torch.empty(3, dtype=torch.int64, device=dev) for _ in ratios]
    lists = [torch.empty((1, n), dtype=torch.int32, device=dev) for _, n in prefix]
    # unused slots take tensors of the used ones' types (never read or written)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    tab = _pad([(c, s, oc, os) for (c, s), (oc, os) in zip(tables, ropes)], MAX_TABLES, (dummy,) * 4)
    vis = _pad(list(zip(ratios, n_vis)), MAX_LISTS, (1, ring))
    lst = _pad([(r, out, n) for (r, n), out in zip(prefix, lists)], MAX_LISTS, (1, win_idx, 0))
    grid = (1 + len(tables) + len(ratios) + len(prefix),)
    _plan_kernel[grid](
        start, win_idx, ring, window, *[t for row in tab for t in row], half,
        *[r for r, _ in vis], *[v for _, v in vis],
        *[q for q, _, _ in lst], *[o for _, o, _ in lst], *[n for _, _, n in lst],
        T=len(tables), NV=len(ratios), WP=triton.next_power_of_2(window),
        HP=triton.next_power_of_2(half), LB=_LIST_BLOCK, num_warps=4)
    return win_idx, ring, ropes, n_vis, lists
