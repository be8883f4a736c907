"""The decode step's plan (SPEC §2.3.5): every position-derived tensor a one-token step reads, made once per step.

`step_plan_ref(start, window, tables, ratios, prefix)`, for one token at the device position start ([1] int64):
- win_idx [1, window] int32: the window's ring slots p % window for p = max(0, start - window + 1) .. start, then -1;
- ring_slots [1] int64: start % window, the slot the token's kv goes to;
- ropes: per (cos, sin) table [max_pos, rd/2], its rows at start, [1, rd/2] each;
- n_vis: per compress ratio r, [3] int64: the compressed entries visible at start, (start + 1) // r, then the
  token's slot in its compressor window, start % r, and the window's start, start - start % r;
- prefixes: per (r, n), [1, n] int32: the HCA index list 0 .. n_vis - 1 ascending, then -1.
The same tensors `dsv4.model.layers.StepPlan` builds for a one-token step (its `build`, `rope`, `n_visible`,
`prefix_idx`); the fast path (dsv4/ops/plan_triton.py) writes them all in one launch instead of ~24 small ones.
The position must be a row of every table (the reference raises otherwise; the engine bounds positions by the
tables' max_pos).
"""

from __future__ import annotations

import torch


def step_plan_ref(start: torch.Tensor, window: int, tables: list, ratios: list, prefix: list) -> tuple:
    """See the module docstring: (win_idx, ring_slots, [(cos, sin)], [n_vis], [prefix list])."""
    pos = start[:1]
    first = (pos - window + 1).clamp_min(0)
    p = first[:, None] + torch.arange(window, device=pos.device)[None, :]
    win_idx = torch.where(p <= pos[:, None], p % window, -1).to(torch.int32)
    ropes = [(cos[pos], sin[pos]) for cos, sin in tables]
    n_vis = [torch.cat(((pos + 1) // r, pos % r, pos - pos % r)) for r in ratios]
    lists = []
    for r, n in prefix:
        ar = torch.arange(n, device=pos.device)
        lists.append(torch.where(ar[None, :] < ((pos + 1) // r)[:, None], ar, -1).to(torch.int32))
    return win_idx, pos % window, ropes, n_vis, lists


def register_ops(register) -> None:
    try:
        from dsv4.ops import plan_triton as fast
    except ImportError:  # no Triton here: the reference runs
        fast = None
    register("step_plan", step_plan_ref, getattr(fast, "step_plan", None), interpretable=True,
             doc="the decode step's window list, ring slot, RoPE rows, visible counts and HCA lists")
