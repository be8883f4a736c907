"""Sampler contract: greedy, temperature, top-k (exactly k), top-p (smallest set reaching the mass),
seeded determinism, and parameter validation; which draws TokenSampler hands to the race op. CPU, hand-made
distributions (the race op's Triton kernel interpreted)."""

import math
from dataclasses import replace

import pytest
import torch

from dsv4.sampling import SamplingParams, TokenSampler, make_generator, race_applies, sample, sampling_probs


def _logits(probs):
    return torch.tensor([probs], dtype=torch.float32).log()


def _draws(logits, params, n=2000, seed=0):
    gen = make_generator(replace(params, seed=seed), "cpu")
    batch = logits.expand(n, -1).contiguous()  # n independent draws in one call
    return sample(batch, params, gen)


def test_greedy_is_argmax_and_ignores_filters():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0, top_p=0.1, top_k=3)
    assert torch.equal(sample(logits, params), logits.argmax(-1))


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])  # tie at the 2nd..4th place
    probs = sampling_probs(logits, SamplingParams(top_k=2))
    assert int((probs > 0).sum()) == 2
    assert probs[0, 0] > 0
    probs = sampling_probs(torch.randn(3, 500), SamplingParams(top_k=17))
    assert ((probs > 0).sum(-1) == 17).all()
    # k >= vocab disables the filter
    assert int((sampling_probs(logits, SamplingParams(top_k=100)) > 0).sum()) == 6


@pytest.mark.parametrize("top_p, kept", [(0.3, 1), (0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3), (0.9, 4), (1.0, 4)])
def test_top_p_keeps_smallest_set_reaching_the_mass(top_p, kept):
    logits = _logits([0.5, 0.25, 0.125, 0.125])
    probs = sampling_probs(logits, SamplingParams(top_p=top_p))
    assert int((probs > 0).sum()) == kept
    assert (probs[0, :kept] > 0).all()  # the kept ones are the most likely ones
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    # renormalised over the kept set
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])[:kept]
    assert torch.allclose(probs[0, :kept], p / p.sum(), atol=1e-6)


def test_top_p_always_keeps_the_top_token():
    probs = sampling_probs(_logits([0.9, 0.05, 0.05]), SamplingParams(top_p=1e-6))
    assert probs[0].tolist() == [1.0, 0.0, 0.0]


def test_top_k_then_top_p():
    # top-k=3 renormalises [0.4, 0.3, 0.2] to [4/9, 3/9, 2/9]; top-p 0.7 then needs the first two
    probs = sampling_probs(_logits([0.4, 0.3, 0.2, 0.1]), SamplingParams(top_k=3, top_p=0.7))
    assert (probs[0] > 0).tolist() == [True, True, False, False]


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    for t in (0.5, 1.0, 2.0):
        assert torch.allclose(sampling_probs(logits, SamplingParams(temperature=t)), torch.softmax(logits / t, -1))


def test_draws_follow_the_distribution():
    logits = _logits([0.5, 0.25, 0.125, 0.125])
    counts = torch.bincount(_draws(logits, SamplingParams(), n=20000), minlength=4).float() / 20000
    assert torch.allclose(counts, torch.tensor([0.5, 0.25, 0.125, 0.125]), atol=0.02)
    # filtered-out ids are never drawn
    draws = _draws(logits, SamplingParams(top_p=0.6))
    assert set(draws.tolist()) == {0, 1}
    draws = _draws(torch.randn(1, 300), SamplingParams(top_k=5, temperature=3.0))
    assert len(set(draws.tolist())) == 5


def test_low_temperature_approaches_greedy():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    draws = _draws(logits, SamplingParams(temperature=1e-4), n=200)
    assert (draws == logits.argmax()).all()


def test_tiny_temperature_and_top_p_keep_a_distribution():
    # 1e-300 overflowed logits / T to inf (softmax NaN: every draw token 0); a top_p below fp32's smallest number
    # compared as 0 and kept no id. Both now sample the most likely ids
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(4)) * 5
    for p in (SamplingParams(temperature=1e-300), SamplingParams(top_p=1e-300), SamplingParams(top_p=1e-30)):
        probs = sampling_probs(logits, p)
        assert torch.isfinite(probs).all()
        assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and (probs.max(-1).values == 1).all()
        assert torch.equal(_draws(logits[:1], p, n=20), logits[:1].argmax().repeat(20))
    tied = torch.tensor([[3.0, 7.0, 7.0, -2.0]])  # the limit of a vanishing temperature splits the ties
    assert torch.equal(sampling_probs(tied, SamplingParams(temperature=1e-300)), torch.tensor([[0.0, 0.5, 0.5, 0.0]]))


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.zeros(64, 5000)  # uniform: every draw is pure generator randomness
    p = SamplingParams(temperature=1.0)
    a = sample(logits, p, make_generator(replace(p, seed=7), "cpu"))
    b = sample(logits, p, make_generator(replace(p, seed=7), "cpu"))
    c = sample(logits, p, make_generator(replace(p, seed=8), "cpu"))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.dtype == torch.int64 and a.shape == (64,)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top-p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top-p must be in \(0, 1\]"),
    (dict(top_k=-1), "top-k must be an integer >= 0"),
    (dict(max_new_tokens=0), "max-new-tokens must be an integer >= 1"),
    (dict(seed=1 << 64), r"seed must be an integer in \[-2\^63, 2\^64\)"),
    (dict(seed=-(1 << 63) - 1), r"seed must be an integer in \[-2\^63, 2\^64\)"),
    (dict(seed=True), r"seed must be an integer in \[-2\^63, 2\^64\)"),
])
def test_invalid_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sample_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\]"):
        sample(torch.zeros(1, 1, 10), SamplingParams(temperature=0))


def test_token_sampler_draws_as_sample_does_without_the_race():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(5))
    for p in (SamplingParams(seed=11), SamplingParams(temperature=0.8, top_p=0.9, seed=11), SamplingParams(0.0)):
        ts, gen = TokenSampler(p, "cpu"), make_generator(p, "cpu")
        for _ in range(4):
            assert torch.equal(ts(logits), sample(logits, p, gen))


def test_token_sampler_hands_temperature_and_top_p_to_the_race_op():
    from dsv4 import ops

    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(6))
    calls = []
    ops.set_hook(lambda op, a, k: (calls.append((op.name, *a[1:])), op.ref(*a, **k))[1])
    try:
        for p in (SamplingParams(temperature=0.7, seed=-3), SamplingParams(seed=9, top_k=300)):
            ts = TokenSampler(p, "cpu", fast_race=True)
            got = [ts(logits) for _ in range(3)]
            assert ts.seed == (p.seed % 2**64)  # the generator's seed, as an unsigned 64-bit word
            assert calls == [("sample_race", p.temperature, ts.seed, c, p.top_p) for c in range(3)]
            calls.clear()
            again = TokenSampler(p, "cpu", fast_race=True)
            assert [again(logits) for _ in range(3)] == got  # the same seed, the same draws
            calls.clear()
        # top-p draws through the race too (its nucleus)
        ts = TokenSampler(SamplingParams(top_p=0.9, seed=1), "cpu", fast_race=True)
        ts(logits)
        assert calls == [("sample_race", 1.0, 1, 0, 0.9)]
        calls.clear()
        # top-k or greedy keeps the torch sampler (and its generator's stream)
        for p in (SamplingParams(top_k=5, seed=1), SamplingParams(top_k=5, top_p=0.9, seed=1), SamplingParams(0.0)):
            ts, gen = TokenSampler(p, "cpu", fast_race=True), make_generator(p, "cpu")
            assert not race_applies(p, 300)
            assert torch.equal(ts(logits), sample(logits, p, gen)) and calls == []
    finally:
        ops.set_hook(None)
