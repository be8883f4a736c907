"""Next-token sampling: `SamplingParams` (validated user knobs), `sample(logits, params, generator)` and
`TokenSampler` (one request's draws).

Owns the token-choice policy only: greedy at temperature 0, otherwise temperature, top-k, top-p
(nucleus), then one draw from a seeded `torch.Generator`. Everything stays on the logits' device;
the only host sync of a decode step is the caller reading the chosen id, so the step can later be
captured in a CUDA graph. Nothing here knows about the model, the tokenizer or stop conditions.
A temperature, with or without top-p (no top-k), may be drawn instead by the op `sample_race`
(dsv4/ops/sample.py: a race on counter-based noise in one launch, six with top-p) when its fast backend is bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and how many. `temperature == 0` means greedy (argmax).

    top_p = 1.0 and top_k = 0 disable those filters; `seed` None draws a fresh random seed per
    request. Defaults are DeepSeek-V4's generation_config.json (temperature 1.0, top_p 1.0).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 256

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top-k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max-new-tokens must be an integer >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                          and -(1 << 63) <= self.seed < 1 << 64):
            raise ValueError(f"seed must be an integer in [-2^63, 2^64) (a torch generator's seed), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded from params.seed (or from fresh entropy when seed is None)."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B,V] -> the distribution a non-greedy `sample` draws from, [B,V] fp32.

    Temperature first, so top-p measures mass on the distribution that is actually sampled (as in
    transformers and vLLM; top-k does not depend on it). Top-k keeps exactly k ids even when there
    are ties at the k-th value; top-p keeps the smallest prefix of the sorted ids whose mass reaches
    top_p, which always includes the most likely id.
    """
    if params.greedy:
        raise ValueError("greedy sampling has no distribution; use sample()")
    x = logits.float()
    # the largest logit first subtracted and the temperature at least fp32's smallest normal number (which a smaller
    # one would round to 0 in the division): the same distribution, and no inf - inf (NaN) at a tiny temperature
    x = (x - x.amax(-1, keepdim=True)) / max(params.temperature, torch.finfo(torch.float32).tiny)
    V = x.shape[-1]
    if 0 < params.top_k < V:
        # scatter (not a `< kth value` mask) so ties at the boundary cannot keep more than k ids
        vals, idx = torch.topk(x, params.top_k, dim=-1)
        x = torch.full_like(x, float("-inf")).scatter_(-1, idx, vals)
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        # keep an id while the mass of the ids before it in the sorted order (equal ones in the sort's order) is still
        # short of top_p, and always the first (a top_p below fp32's smallest number compares as 0)
        keep = mass_before < params.top_p
        keep[..., 0] = True
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B,V] fp32 -> chosen token ids [B] int64, on the logits' device, with no host sync."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, params)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is an exact draw from p, needs no
    # cumulative sum or data-dependent shapes, and ids with p_i = 0 can never win. An exact 0 draw
    # (about 2^-24 per element) would make 0/0 = NaN, which argmax prefers: clamp it away.
    race = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(dim=-1)


def race_applies(params: SamplingParams, vocab: int) -> bool:
    """Whether ops.sample_race draws for `params`: a temperature, with or without top-p, and no top-k filter."""
    return not params.greedy and not 0 < params.top_k < vocab


class TokenSampler:
    """One request's draws: `sampler(logits [B, V]) -> ids [B]` on the logits' device, no host sync.

    `fast_race` (the engine: ops.sample_race runs its fast backend): where race_applies, each draw is ops.sample_race
    (one launch, six with top-p) keyed by the generator's seed and the draw's index: the same seed, the same tokens,
    but another random stream than `sample`'s, and a top-p nucleus that keeps every id tied with its smallest one
    (`sample` keeps a prefix of its sort's order among such ties). Otherwise `sample` with the request's generator.
    """

    def __init__(self, params: SamplingParams, device: torch.device | str, fast_race: bool = False):
        self.params = params
        self.generator = make_generator(params, device)
        self.seed = self.generator.initial_seed() & ((1 << 64) - 1)
        self.fast_race = fast_race
        self.calls = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.fast_race and logits.dim() == 2 and race_applies(self.params, logits.shape[-1]):
            from dsv4 import ops

            out = ops.sample_race(logits.float(), self.params.temperature, self.seed, self.calls, self.params.top_p)
        else:
            out = sample(logits, self.params, self.generator)
        self.calls += 1
        return out
