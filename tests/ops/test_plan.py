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
    # every slot of the kernel used, each with its own ratio and length (a swapped slot shows), an empty list
    (32, [0, 31, 4000], [2, 3, 5, 7], [(2, 0), (3, 1025), (5, 17), (7, 2048)]),
]


def _tables(half: int, n: int):
    return [Rope(2 * half, 10000.0 * (k + 1), None, 4096, DEV) for k in range(n)]


def _flat(out):
    win, ring, ropes, vis, lists = out
    return [win, ring] + [t for pair in ropes for t in pair] + list(vis) + list(lists)


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)  # torch.equal alone ignores dtype


def _assert_same(got, want, what):
    g, w = _flat(got), _flat(want)
    assert len(g) == len(w), what
    for a, b in zip(g, w):
        assert _same(a, b), what


@pytest.mark.parametrize("window,positions,ratios,prefix", CASES)
def test_ref_is_step_plan_build(window, positions, ratios, prefix):
    tabs = _tables(8, 2)
    for p in positions:
        start = torch.tensor([p], device=DEV)
        plan = StepPlan.build(start, 1, window, None)
        win, ring, ropes, vis, lists = step_plan_ref(start, window, [(t.cos, t.sin) for t in tabs], ratios, prefix)
        assert _same(win, plan.win_idx) and _same(ring, plan.ring_slots)
        for t, (c, s) in zip(tabs, ropes):
            want_c, want_s = plan.rope(t)
            assert _same(c, want_c) and _same(s, want_s)
        for r, v in zip(ratios, vis):
            assert _same(v[0:1], plan.n_visible(r))
            assert _same(v[1:2], plan.window_slots(r)) and _same(v[2:3], plan.window_start(r))
            assert v.tolist() == [(p + 1) // r, p % r, p - p % r]
        for (r, n), lst in zip(prefix, lists):
            assert _same(lst, plan.prefix_idx(r, n))
        # spot values: the window ends at p, its ring slot p % window; -1 past the positions seen so far
        assert int(win[0, min(p, window - 1)]) == p % window and int(ring[0]) == p % window
        assert int((win >= 0).sum()) == min(p + 1, window)


@both_tiers
@pytest.mark.parametrize("window,positions,ratios,prefix", CASES)
@pytest.mark.parametrize("ntab", [0, 1, 2, 4])
def test_fast_bitwise(window, positions, ratios, prefix, ntab, monkeypatch):
    try:
        from dsv4.ops import plan_triton
    except ImportError:
        pytest.skip("Triton is not installed")
    _no_fallback(monkeypatch, plan_triton)
    tabs = [(t.cos, t.sin) for t in _tables(16, ntab)]
    for p in positions:
        start = torch.tensor([p], device=DEV)
        _assert_same(plan_triton.step_plan(start, window, tabs, ratios, prefix),
                     step_plan_ref(start, window, tabs, ratios, prefix), f"position {p}")


def _no_fallback(monkeypatch, plan_triton):
    """The kernel must run: its fallback to the reference raises."""
    def refuse(*a, **k):
        raise AssertionError("step_plan fell back to the reference")
    monkeypatch.setattr(plan_triton, "step_plan_ref", refuse)


@both_tiers
def test_fast_falls_back_beyond_its_slots(monkeypatch):
    from dsv4.ops import plan_triton

    calls = []
    monkeypatch.setattr(plan_triton, "step_plan_ref", lambda *a: calls.append(1) or step_plan_ref(*a))
    start = torch.tensor([77], device=DEV)
    one = [(t.cos, t.sin) for t in _tables(4, 1)]
    many = [(t.cos, t.sin) for t in _tables(4, plan_triton.MAX_TABLES + 1)]
    mixed = one + [(t.cos, t.sin) for t in _tables(8, 1)]  # two row widths: not one launch's
    f64 = [(c.double(), s.double()) for c, s in one]
    strided = [(c[:, ::2], s[:, ::2]) for c, s in [(t.cos, t.sin) for t in _tables(8, 1)]]
    lots = list(range(2, 3 + plan_triton.MAX_LISTS))
    cases = [(start, many, [4], []), (start, mixed, [4], []), (start, f64, [4], []), (start, strided, [4], []),
             (start, one, lots, []), (start, one, [4], [(r, 8) for r in lots]), (start.int(), one, [4], [])]
    for st, tabs, ratios, prefix in cases:
        _assert_same(plan_triton.step_plan(st, 8, tabs, ratios, prefix), step_plan_ref(st, 8, tabs, ratios, prefix),
                     "fallback")
    assert len(calls) == len(cases)  # each took the reference


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fast_in_a_graph_follows_the_position(monkeypatch):
    from dsv4.ops import plan_triton
    from dsv4.ops.plan_triton import step_plan

    _no_fallback(monkeypatch, plan_triton)
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


def test_later_layers_find_the_whole_plan(monkeypatch):
    # StepPlan.decode files every tensor under the key the layers ask for: after the first layer no layer makes a
    # plan tensor of its own (it would be a torch kernel in that layer's graph)
    from dsv4.config import ModelConfig
    from dsv4.graphs import DecodeRunner
    from dsv4.model import layers
    from dsv4.model.transformer import Transformer
    from dsv4.testing import randomize_, tiny_config

    raw = tiny_config([4, 128, 0], index_topk=3, window=16, max_pos=512)
    model = randomize_(Transformer(ModelConfig.from_dict(raw), layers.Numerics("exact", torch.float32)), 3)
    made = []
    for name in ("rope", "n_visible", "prefix_idx"):
        real = getattr(layers.StepPlan, name)

        def spy(self, *a, _real=real, _name=name):
            key = id(a[0]) if _name == "rope" else (a if _name == "prefix_idx" else a[0])
            cache = self.ropes if _name == "rope" else self.visible
            if key not in cache:
                made.append(_name)
            return _real(self, *a)
        monkeypatch.setattr(layers.StepPlan, name, spy)
    runner = DecodeRunner(model, model.new_state(64), use_graphs=False)
    for t in torch.randint(0, raw["vocab_size"], (6,), generator=torch.Generator().manual_seed(2)).tolist():
        runner.step(t)
    assert made == []
