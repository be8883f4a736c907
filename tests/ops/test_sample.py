"""The sampler's race (dsv4/ops/sample.py, dsv4/ops/sample_triton.py): Philox against its published answers, the
Triton noise and draws against the reference (interpreted on the CPU at small vocabularies, Flash's on a GPU), the
draws' distribution, ties, NaN and -inf logits, the arguments' checks."""

import math

import pytest
import torch

from dsv4.ops.sample import (
    log_exp1_ref, nucleus_key_ref, order_key_ref, philox4x32, race_noise_ref, race_temperature, sample_race_ref,
)
from dsv4.testing import assert_bitwise_equal, assert_close_rel, tol

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# the interpreter evaluates masked-out lanes too (-inf padding, the -inf / +inf / NaN rows a test draws from, a softmax
# at a temperature of 2^-126): numpy warns about values the kernels then discard
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]
pytestmark += [pytest.mark.gpu] if CUDA else []


def _fast():
    try:
        from dsv4.ops import sample_triton
    except ImportError:
        pytest.skip("Triton is not installed")
    return sample_triton


def test_philox_matches_random123_answers():
    # Random123's known-answer vectors for Philox4x32-10 (counter, key -> output)
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        assert tuple(int(w) for w in philox4x32(*ctr, *key)) == want


def test_reference_noise_is_exponential():
    e = race_noise_ref(8, 1 << 15, seed=42, call=7).double().exp().flatten()
    n = e.numel()
    s = e.sort().values
    ks = ((1 - torch.exp(-s)) - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max().item()
    assert ks < 1.63 / math.sqrt(n)  # Kolmogorov-Smirnov at the 1% level
    assert abs(e.mean().item() - 1) < 4 / math.sqrt(n) and e.min() > 0 and torch.isfinite(e).all()
    # log(E) within 2^-22 of its size against float64 log(-log(1 - v)), the small E (v near 0: the series) included
    w, *_ = philox4x32(torch.arange(1 << 15), 0, 7, 0, 42, 0)
    v = (w | 1).to(torch.float32).double() * 2.0**-32
    exact = torch.log(-torch.log1p(-v))
    got = race_noise_ref(1, 1 << 15, seed=42, call=7)[0].double()
    assert ((got - exact).abs() / exact.abs().clamp_min(1)).max() < 2.0**-22
    assert exact.min() < -10  # E < 5e-5 among them
    # the ends: the smallest word gives E = 2^-32; the largest rounds v to 1, whose 1 - v is held at 2^-32
    ends = log_exp1_ref(torch.tensor([0, 1, 2**31, 2**32 - 1]))
    assert torch.equal(ends[[0, 1, 3]], torch.tensor([math.log(2.0**-32), math.log(2.0**-32), math.log(32 * math.log(2))],
                                                     dtype=torch.float32))
    assert abs(ends[2].item() - math.log(math.log(2))) < 1e-6


try:  # a kernel that stores the race's noise words and log(E) (sample_triton's helpers) for the test below
    import triton
    import triton.language as tl

    from dsv4.ops.sample_triton import _log_exp1, _philox_w0

    @triton.jit
    def _noise_kernel(w_ptr, le_ptr, V, row, seed_lo, seed_hi, call_lo, call_hi, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        zero = offs.to(tl.uint32) * 0
        w = _philox_w0(offs.to(tl.uint32), zero + row, zero + call_lo.to(tl.uint32), zero + call_hi.to(tl.uint32),
                       seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))
        tl.store(w_ptr + offs, w.to(tl.int32, bitcast=True), mask=offs < V)
        tl.store(le_ptr + offs, _log_exp1(w), mask=offs < V)

    @triton.jit
    def _log_exp1_kernel(w_ptr, le_ptr, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        w = tl.load(w_ptr + offs, mask=offs < N, other=0).to(tl.uint32, bitcast=True)
        tl.store(le_ptr + offs, _log_exp1(w), mask=offs < N)
except ImportError:
    _noise_kernel = _log_exp1_kernel = None


@pytest.mark.parametrize("seed, call, row", [(0, 0, 0), (2**64 - 1, 2**40 + 3, 2), (123456789123, 5, 1)])
def test_fast_noise_matches_reference(seed, call, row):
    if _noise_kernel is None:
        pytest.skip("Triton is not installed")
    V = 3000 if not CUDA else 129280
    w = torch.empty(V, dtype=torch.int32, device=DEV)
    le = torch.empty(V, dtype=torch.float32, device=DEV)
    bit = 1 << 32
    _noise_kernel[(-(-V // 1024),)](w, le, V, row, bit | (seed & 0xFFFFFFFF), bit | (seed >> 32),
                                   bit | (call & 0xFFFFFFFF), bit | (call >> 32), BLOCK=1024)
    ref_w, *_ = philox4x32(torch.arange(V), row, call & 0xFFFFFFFF, call >> 32, seed & 0xFFFFFFFF, seed >> 32)
    assert_bitwise_equal(w.cpu(), ref_w.to(torch.int32), "Philox words")
    assert_close_rel(le.cpu(), race_noise_ref(row + 1, V, seed, call)[row], "race_noise_log")
    # the words at the ends of both halves of the formula
    ends = torch.tensor([0, 1, 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 256, 2**32 - 1], dtype=torch.int64)
    le8 = torch.empty(8, dtype=torch.float32, device=DEV)
    as_int32 = (ends - (ends >> 31) * 2**32).to(torch.int32)  # the words' bits
    _log_exp1_kernel[(1,)](as_int32.to(DEV), le8, 8, BLOCK=8)
    assert_close_rel(le8.cpu(), log_exp1_ref(ends), "race_noise_log")
    # value by value over both halves, densest where the series' high terms weigh most (v just under 1/2, s = 1/3: a
    # coefficient of s^10 with the wrong sign moves log(E) by 3e-6 there, which the whole-vector norm above averages away)
    words = torch.cat([torch.arange(0, 2**32, 2**20), 2**31 - 1 - torch.arange(0, 2**24, 2**14)])
    n = words.numel()
    got = torch.empty(n, dtype=torch.float32, device=DEV)
    _log_exp1_kernel[(1,)]((words - (words >> 31) * 2**32).to(torch.int32).to(DEV), got, n, BLOCK=8192)
    want = log_exp1_ref(words)
    err = ((got.cpu() - want).abs() / want.abs().clamp_min(1)).max().item()
    assert err <= tol("race_noise_log"), err


def _check_draws(fast, logits, temperature, seed, call, ref=sample_race_ref):
    """fast vs reference draws, row by row, except rows whose two best reference keys lie within race_key_margin."""
    got = fast(logits, temperature, seed, call)
    want = ref(logits, temperature, seed, call)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    key = logits.cpu() - race_temperature(temperature) * race_noise_ref(*logits.shape, seed, call)
    top2 = key.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tol("race_key_margin") * top2[:, 0].abs().clamp_min(1)
    assert clear.any()
    assert torch.equal(got.cpu()[clear], want.cpu()[clear]), (got, want, clear)
    return got


@pytest.mark.parametrize("B, V", [(1, 5000), (3, 2049), (2, 100)] if not CUDA else
                         [(1, 129280), (4, 129280), (3, 2049), (1, 100)])
def test_fast_draws_match_reference(B, V):
    fast = _fast().sample_race
    g = torch.Generator().manual_seed(B * V)
    logits = (torch.randn(B, V, generator=g) * 3).to(DEV)
    for temperature in (1.0, 0.6, 7.0, 1e35):
        for seed, call in ((1, 0), (2**63 + 11, 1), (987654321987, 2**33 + 5)):
            _check_draws(fast, logits, temperature, seed, call)
    # the same arguments, the same token (the arrival counters were left at zero), and the draws move with the call
    a = fast(logits, 1.0, 5, 3)
    assert torch.equal(a, fast(logits, 1.0, 5, 3))
    many = torch.stack([fast(logits, 1.0, 5, c) for c in range(8)])
    assert len(set(many[:, 0].tolist())) > 1


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = (probs.log() * 0.7).repeat(20000, 1)  # at temperature 0.7: softmax(logits / 0.7) = probs
    draws = sample_race_ref(logits, 0.7, seed=3, call=0)
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert (freq - probs).abs().max() < tol("race_frequency")


def test_ties_nan_and_masked_logits():
    fast = _fast().sample_race
    # a temperature below fp32's range leaves the keys equal to the logits: the noise splits the largest ones' ties
    tied = torch.tensor([[3.0, 7.0, 7.0, -2.0, 7.0]], device=DEV)
    picks = [int(sample_race_ref(tied, 1e-300, 9, c)) for c in range(60)]
    assert set(picks) == {1, 2, 4}
    assert [int(fast(tied, 1e-300, 9, c)) for c in range(12)] == picks[:12]
    # -inf (a filtered id) never wins; NaN always does (torch's argmax picks it)
    masked = torch.full((1, 300), float("-inf"), device=DEV)
    masked[0, 17] = masked[0, 250] = 0.0
    for c in range(10):
        for f in (fast, sample_race_ref):
            assert int(f(masked, 1.0, 4, c)) in (17, 250)
    nan = torch.zeros(2, 300, device=DEV)
    nan[0, 123] = float("nan")
    assert int(fast(nan, 1.0, 4, 0)[0]) == int(sample_race_ref(nan, 1.0, 4, 0)[0]) == 123


def test_ties_across_blocks_and_an_all_masked_row():
    fast = _fast().sample_race
    # ties spread over several of the kernel's blocks (1024 ids): the noise splits them, as the reference
    flat = torch.zeros(2, 3000, device=DEV)
    flat[1, ::7] = 1.0  # the largest ones every 7th id
    for c in range(4):
        want = sample_race_ref(flat, 1e-300, 3, c)
        assert torch.equal(fast(flat, 1e-300, 3, c), want) and int(want[1]) % 7 == 0
    # a row that is -inf everywhere still draws an id inside the vocabulary (the reference's: the smallest log E)
    dead = torch.full((1, 1500), float("-inf"), device=DEV)
    for c in range(4):
        assert int(fast(dead, 1.0, 4, c)) == int(sample_race_ref(dead, 1.0, 4, c)) < 1500
    # equal keys and equal log E (two words that round to the same fp32 v), in one block and in two: the lower
    # index wins
    found = {}
    for call in range(256):
        le = race_noise_ref(1, 4096, 1, call)[0]
        vals, counts = torch.unique(le, return_counts=True)
        for v in vals[counts == 2]:
            i, j = (le == v).nonzero().flatten().tolist()
            found.setdefault(i // 1024 == j // 1024, (call, i, j))
        if len(found) == 2:
            break
    assert len(found) == 2, f"equal noise values in one block and in two not both found: {found}"
    for call, i, j in found.values():
        two = torch.full((1, 4096), float("-inf"), device=DEV)
        two[0, i] = two[0, j] = 2.5
        assert int(fast(two, 0.7, 1, call)) == int(sample_race_ref(two, 0.7, 1, call)) == i


def _nucleus_keys(logits, temperature, top_p):
    """The fast kernels' nucleus key per row (the state the race read), after a draw."""
    st = _fast()
    st.sample_race(logits, temperature, 1, 0, top_p)
    B, V = logits.shape
    key = (logits.device, B, -(-V // st.BLOCK), True, "main")
    return st._WORK[key][2][:, 3].contiguous().view(torch.int32).to(torch.int64).cpu() & 0xFFFFFFFF


def _check_nucleus(logits, temperature, top_p):
    """The fast nucleus keeps the reference's ids, but for ids whose mass above lies within race_nucleus_margin of
    top_p (float64 reference masses)."""
    got, want = _nucleus_keys(logits, temperature, top_p), nucleus_key_ref(logits, temperature, top_p)
    for r in range(logits.shape[0]):
        if got[r] == want[r]:
            continue
        x = logits[r].cpu().double()
        t = max(race_temperature(temperature), 2.0**-126)
        p = torch.exp((x - x.max()) / t)
        p = p / p.sum()
        k = order_key_ref(logits[r].cpu())
        lo, hi = sorted((int(got[r]), int(want[r])))
        between = (k >= lo) & (k < hi)  # the ids one side keeps and the other does not
        assert between.any(), (r, got[r], want[r])  # (keys apart with no id between them would be the same set)
        above = torch.stack([p[x > v].sum() for v in x[between]])
        assert ((above - top_p).abs() < tol("race_nucleus_margin")).all(), (r, got[r], want[r])
    return got


@pytest.mark.parametrize("B, V", [(1, 2100), (2, 700)] if not CUDA else [(1, 129280), (4, 129280), (2, 700)])
def test_fast_nucleus_matches_reference(B, V):
    g = torch.Generator().manual_seed(B + V)
    logits = (torch.randn(B, V, generator=g) * 3).to(DEV)
    logits[0, :5] += 8.0  # a few dominant ids: the nucleus is small
    # (interpreted on the CPU: fewer cases, each draw is six launches)
    for temperature in (1.0, 0.6, 4.0, 1e-300) if CUDA else (1.0, 1e-300):
        for top_p in (0.05, 0.5, 0.9, 0.95, 0.999) if CUDA else (0.05, 0.9, 0.999):
            _check_nucleus(logits, temperature, top_p)
            for call in (0, 7) if CUDA else (7,):
                got = _check_draws(lambda *a: _fast().sample_race(*a, top_p), logits, temperature, 3, call,
                                   lambda *a: sample_race_ref(*a, top_p))
                kept = order_key_ref(logits.cpu()) >= nucleus_key_ref(logits, temperature, top_p)[:, None]
                assert kept[torch.arange(B), got.cpu()].all()  # every draw inside the nucleus


def _floats_of_keys(k: torch.Tensor) -> torch.Tensor:
    """uint32 order keys (int64) -> the fp32 values they order (order_key_ref's inverse)."""
    b = torch.where(k >= 1 << 31, k - (1 << 31), ~k & 0xFFFFFFFF)
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def test_nucleus_passes_run_each_step_of_bins_that_holds_ids():
    # a pass runs only its steps of G = 16 bins that hold an id: rows whose nucleus edge lies in each step of each pass
    # (a step skipped wrongly drops mass above the edge, or the edge itself)
    g = torch.Generator().manual_seed(3)
    V = 3000
    # pass 1: one row per step, every id of the row in it (the step's middle bin, random lower 24 bits)
    digit = torch.arange(16) * 16 + 8
    keys = (digit[:, None] << 24) | torch.randint(0, 1 << 24, (16, V), generator=g)
    _check_nucleus(_floats_of_keys(keys).to(DEV), 1.0, 0.5)
    # passes 2-4: a row inside one bin of the pass before, over all of this pass' bins, the mass spread evenly (the
    # temperature at its cap) and the edge in the lowest step, so every step holds mass above it
    u = torch.rand(3, V, generator=g, dtype=torch.float64)
    rows = torch.stack([2 + 6 * u[0], 2 + 2**-6 * 0.999 * u[1], 2 + torch.floor(256 * u[2]) * 2**-22]).float()
    _check_nucleus(rows.to(DEV), 1e30, 0.99)


def test_nucleus_keeps_ties_and_follows_the_distribution():
    # mass above each 0.2 is 0.4 < 0.5: all three tied ids are kept (sample() keeps a prefix of its sort's order)
    tied = torch.tensor([[0.4, 0.2, 0.2, 0.2]]).log()
    assert (order_key_ref(tied) >= nucleus_key_ref(tied, 1.0, 0.5)[:, None]).tolist() == [[True] * 4]
    assert torch.equal(_nucleus_keys(tied.to(DEV), 1.0, 0.5), nucleus_key_ref(tied, 1.0, 0.5))
    # top_p 0.8 keeps the ids with mass above 0, 0.5, 0.75 (not 0.9): frequencies of the renormalized three
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    draws = sample_race_ref(probs.log().repeat(20000, 1), 1.0, seed=5, call=0, top_p=0.8)
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert (freq - torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9).abs().max() < tol("race_frequency")
    # exact boundaries: mass above 0.25 is 0.5, not below top_p 0.5 (only the first kept); -0.0 counts as +0.0
    for row, top_p in (([0.5, 0.25, 0.25], 0.5), ([0.5, 0.25, 0.125, 0.125], 0.75)):
        x = torch.tensor([row]).log()
        assert torch.equal(_nucleus_keys(x.to(DEV), 1.0, top_p), nucleus_key_ref(x, 1.0, top_p))
    zeros = torch.tensor([[1.0, 0.0, -0.0, -0.0, -5.0]])
    assert torch.equal(_nucleus_keys(zeros.to(DEV), 1.0, 0.9), nucleus_key_ref(zeros, 1.0, 0.9))
    assert nucleus_key_ref(zeros, 1.0, 0.9) == order_key_ref(torch.tensor([0.0]))
    # a top_p too small to reach any id (one below fp32's smallest number is 0): the largest logit alone is kept
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(4, 2100, generator=g) * 10
    for top_p in (1e-9, 1e-50):
        want = order_key_ref(wide.max(-1).values)
        assert torch.equal(nucleus_key_ref(wide, 30.0, top_p), want)
        assert torch.equal(_nucleus_keys(wide.to(DEV), 30.0, top_p), want)
    # rows whose largest logit is not finite keep everything: -inf everywhere, +inf, NaN
    odd = torch.zeros(3, 1500)
    odd[0] = float("-inf")
    odd[1, 77] = float("inf")
    odd[2, 600] = float("nan")
    assert nucleus_key_ref(odd, 1.0, 0.5).tolist() == [0, 0, 0]
    assert _nucleus_keys(odd.to(DEV), 1.0, 0.5).tolist() == [0, 0, 0]
    fast = _fast().sample_race
    for c in range(3):
        got, want = fast(odd.to(DEV), 1.0, 2, c, 0.5), sample_race_ref(odd.to(DEV), 1.0, 2, c, 0.5)
        assert torch.equal(got, want) and got[1] == 77 and got[2] == 600 and got[0] < 1500


@pytest.mark.parametrize("args, message", [
    ((torch.zeros(2, 3, 4), 1.0, 0, 0), r"logits must be float32 \[batch, vocab\]"),
    ((torch.zeros(2, 4, dtype=torch.bfloat16), 1.0, 0, 0), r"logits must be float32 \[batch, vocab\]"),
    ((torch.zeros(2, 4), 0.0, 0, 0), "temperature must be > 0"),
    ((torch.zeros(2, 4), 1.0, 1 << 64, 0), r"seed must be in \[0, 2\^64\)"),
    ((torch.zeros(2, 4), 1.0, 0, -1), r"call in \[0, 2\^63\)"),
    ((torch.zeros(2, 4), 1.0, 0, 0, 0.0), r"top_p must be in \(0, 1\]"),
])
def test_bad_arguments_are_refused(args, message):
    for f in (sample_race_ref, _fast().sample_race):
        with pytest.raises(ValueError, match=message):
            f(*args)
