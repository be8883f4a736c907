"""step_plan (the decode step's plan): the reference against StepPlan.build / rope / n_visible / prefix_idx, the
fast one-launch kernel (dsv4/ops/plan_triton.py) bit for bit the reference. Interpreted on the CPU; compiled on a
GPU (`-m gpu`)."""

import pytest
import torch

from dsv4.model.layers import Rope, StepPlan
from dsv4.ops.plan import step_plan_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
both_tiers = pytest.mark.gpu if CUDA else (lambda f: f)

# window, positions (the ring's first fill, its wrap, far past it), compress ratios, HCA lists (ratio, entries)
CASES = [
    (8, [0, 1, 6, 7, 8, 9, 100], [4, 128], [(128, 16)]),
    (128, [0, 127, 128, 129, 1000, 4095], [4, 128], [(128, 32)]),
    (5, [0, 3, 4, 5, 1234], [3], [(3, 2000), (7, 5)]),  # an odd window; a list longer than one 1024 block
    (16, [7, 300], [], []),
]


def _tables(half: int, n: int):
    return [Rope(2 * half, 10000.0 * (k + 1), None, 4096, DEV) for k in range(n)]


def _flat(out):
    win, ring, ropes, vis, lists = out
    return [win, ring] + [t for pair in ropes for t in pair] + list(vis) + list(lists)


def _assert_same(got, want, what):
    g, w = _flat(got), _flat(want)
    assert len(g) == len(w), what
    for a, b in zip(g, w):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what


@pytest.mark.parametrize("window,positions,ratios,prefix", CASES)
def test_ref_is_step_plan_build(window, positions, ratios, prefix):
    tabs = _tables(8, 2)
    for p in positions:
        start = torch.tensor([p], device=DEV)
        plan = StepPlan.build(start, 1, window, None)
        win, ring, ropes, vis, lists = step_plan_ref(start, window, [(t.cos, t.sin) for t in tabs], ratios, prefix)
        assert torch.equal(win, plan.win_idx) and torch.equal(ring, plan.ring_slots)
        for t, (c, s) in zip(tabs, ropes):
            want_c, want_s = plan.rope(t)
            assert torch.equal(c, want_c) and torch.equal(s, want_s)
        for r, v in zip(ratios, vis):
            assert torch.equal(v, plan.n_visible(r))
        for (r, n), lst in zip(prefix, lists):
            assert torch.equal(lst, plan.prefix_idx(r, n))
        # spot values: the window ends at p, its ring slot p % window; -1 past the positions seen so far
        assert int(win[0, min(p, window - 1)]) == p % window and int(ring[0]) == p % window
        assert int((win >= 0).sum()) == min(p + 1, window)


@both_tiers
@pytest.mark.parametrize("window,positions,ratios,prefix", CASES)
@pytest.mark.parametrize("ntab", [0, 1, 2])
def test_fast_bitwise(window, positions, ratios, prefix, ntab):
    try:
        from dsv4.ops.plan_triton import step_plan
    except ImportError:
        pytest.skip("Triton is not installed")
    tabs = [(t.cos, t.sin) for t in _tables(16, ntab)]
    for p in positions:
        start = torch.tensor([p], device=DEV)
        _assert_same(step_plan(start, window, tabs, ratios, prefix), step_plan_ref(start, window, tabs, ratios, prefix),
                     f"position {p}")


@both_tiers
def test_fast_falls_back_beyond_its_slots():
    from dsv4.ops import plan_triton

    start = torch.tensor([77], device=DEV)
    many = [(t.cos, t.sin) for t in _tables(4, plan_triton.MAX_TABLES + 1)]
    mixed = [(t.cos, t.sin) for t in _tables(4, 1) + _tables(8, 1)]  # two row widths: not one launch's
    for tabs, ratios in ((many, [4]), (mixed, [4]), ([], list(range(2, 3 + plan_triton.MAX_LISTS)))):
        _assert_same(plan_triton.step_plan(start, 8, tabs, ratios, []), step_plan_ref(start, 8, tabs, ratios, []),
                     "fallback")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fast_in_a_graph_follows_the_position():
    from dsv4.ops.plan_triton import step_plan

    tabs = [(t.cos, t.sin) for t in _tables(32, 2)]
    start = torch.tensor([5], device="cuda")
    args = (128, tabs, [4, 128], [(128, 64)])
    step_plan(start, *args)  # compiled before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step_plan(start, *args)
    for p in (5, 130, 4000):
        start.fill_(p)
        g.replay()
        torch.cuda.synchronize()
        _assert_same(out, step_plan_ref(start, *args), f"replay at {p}")
