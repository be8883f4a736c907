"""Test support shared by tests/ and tools/: the one tolerance table, comparison helpers, tiny configs.

Every threshold used by a test lives in TOLERANCES with its justification; no test loosens one
locally. `tiny_config` builds official-style config.json dicts for random tiny models.
"""

from __future__ import annotations

from typing import Any

import torch

# name -> (threshold, why). Relative errors are max|a-b| / max|b| over the whole tensor.
TOLERANCES: dict[str, tuple[float, str]] = {
    "logits_exact_fp32": (
        1e-4,
        "fp32 model vs transformers fp32: same math, different summation order; observed ~1e-6",
    ),
    "logits_incremental_fp32": (
        1e-4,
        "chunked/decode vs one-shot forward in fp32: only summation order differs",
    ),
    "logits_reference_incremental_fp32": (
        2e-3,
        "as above plus DeepSeek's FP8/FP4 simulations, which are discontinuous: a 1-ulp fp32 difference "
        "can flip one element's e4m3/e2m1 rounding (<= 2^-3 of that element); observed 7e-7..1.3e-4",
    ),
    # ---- fast op vs its reference (tests/ops, tools/ab_compare.py); max|fast-ref| / max|ref| ----
    "op_bf16_out": (
        8e-3,
        "fp32 accumulation in another order, then one bf16 rounding: an output can land one bf16 ulp "
        "(2^-8 relative) away, i.e. <= 2^-8 of the largest output, plus fp32 noise; 2 ulps of margin",
    ),
    "op_bf16_stat": (
        1.6e-2,
        "a statistic rounded in bf16 (mean, + eps, rsqrt: DeepSeek's q head norm) summed in another fp32 order "
        "can land one bf16 ulp away, scaling the row by 1 +- 2^-8 before RoPE mixes two elements: "
        "<= 2 * 2^-8 of the largest output, plus the output rounding",
    ),
    "op_fp8_mma_bf16_out": (
        1e-2,
        "FP8 x FP8 tensor-core dot (Hopper, DeepGEMM's pattern): exact products, but the MMA accumulates each "
        "128-K block at ~2^-13 relative precision (~1e-3 of the output over K/128 <= 64 blocks), then one bf16 "
        "flip (<= 2^-7 of the largest output): 7.8e-3 + 2e-3; observed <= 6.1e-3 on an H200",
    ),
    "op_fp32_out": (
        2e-5,
        "fp32 accumulation in another order over K <= 16384 terms: ~sqrt(K) * 2^-24 relative, observed < 5e-6",
    ),
    "op_attention": (
        8e-3,
        "64-slot online softmax in the same order with fp32 sums; only the dot-product summation order "
        "differs, which can flip one bf16 rounding of P or of the output (2^-8 relative)",
    ),
    "op_attention_flip_ratio": (
        2.0,
        "outputs a fast attention kernel rounds differently from the reference, as a multiple of those the Triton "
        "walk over the whole list (one program) rounds differently: both take the reference's blocks, maxima and "
        "bf16(p), and differ only in fp32 summation order (~1e-6 relative), which moves an output across a bf16 "
        "boundary rarely (Flash cases: 2e-4 .. 1e-2 of the outputs for either kernel); other maxima or bf16 P.V "
        "products flip most outputs",
    ),
    "op_attention_flip_floor": (
        2e-3,
        "the fraction of such outputs always allowed, for cases where the Triton walk happens to flip almost none",
    ),
    # ---- the sampler's race (dsv4/ops/sample.py) ----
    "race_noise_log": (
        1e-6,
        "log(E) of the race's noise, fast vs reference: the same Philox words and fp32 steps, but the GPU may fuse "
        "the series' multiply-adds and its log may round another way: a few ulps of values within [-22.2, 3.1]",
    ),
    "race_key_margin": (
        1e-5,
        "draws compared token for token only where the reference's two best keys lie further apart than this "
        "(relative to max(1, |best key|)): a fused multiply-add or another log rounding moves a key by a few fp32 "
        "ulps (~1e-7), which can swap two keys closer than that",
    ),
    "race_nucleus_margin": (
        1e-5,
        "the nucleus' masses: fp32 sums over each block of 1024 ids (~1e-7 relative), added across blocks as integers "
        "of 2^-45, against the float64 reference; a logit whose mass above lies within this of top_p may fall on "
        "either side of the boundary",
    ),
    "race_frequency": (
        0.015,
        "draw frequencies vs softmax over 20000 independent draws of 4 ids: 4 standard deviations "
        "(sqrt(0.25 / 20000) = 0.0035 at most); the seed is fixed, so the check is deterministic",
    ),
}


def tol(name: str) -> float:
    return TOLERANCES[name][0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a-b| / max|b| (b is the reference)."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
    if not torch.isfinite(a).all():
        raise AssertionError(f"{name}: non-finite values")
    err = rel_err(a, b)
    if err > tol(name):
        flat = (a.float() - b.float()).abs().flatten().argmax().item()
        coord = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol(name):.1e} (worst at {coord})")


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    """Gathers, index lists, top-k and stores: equal bit for bit (NaNs at the same places)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{name}: {a.dtype}{tuple(a.shape)} vs reference {b.dtype}{tuple(b.shape)}")
    ai = a.contiguous().view(torch.uint8) if a.element_size() == 1 else a.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()])
    bi = b.contiguous().view(ai.dtype)
    diff = (ai != bi).reshape(a.shape) if a.element_size() > 1 else (ai != bi)
    if bool(diff.any()):
        coord = tuple(int(i) for i in diff.nonzero()[0])
        raise AssertionError(f"{name}: {int(diff.sum())} elements differ, first at {coord}: "
                             f"{a[coord].item()} vs reference {b[coord].item()}")


def capture_graph(fn, calls: int = 1):
    """Warm `fn` up once on a side stream, then capture `calls` calls of it in a CUDA graph: (graph, the
    output of the last captured call). Shared by the graph tests and tools/bench_ops.py."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def graph_replay(fn):
    """Warm `fn` up on a side stream, capture one call in a CUDA graph, replay it; returns (eager result of a
    call made before the capture, the graph's output after replay) for a bitwise comparison."""
    want = fn()
    graph, out = capture_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    return want, out


def fp8_blocks_apart(w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """w [..., n, k] times a power of two (2^-2 .. 2^2, drawn from g on w's device) per 128x128 block, ahead of an FP8
    block quantization: Gaussian blocks all quantize to one E8M0 scale, so a kernel reading another block's scale
    would pass; with these it fails."""
    n, k = w.shape[-2:]
    f = 2.0 ** torch.randint(-2, 3, (*w.shape[:-2], -(-n // 128), -(-k // 128)), generator=g, device=w.device)
    return w * f.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]


def tiny_config(ratios: list[int], *, n_mtp: int = 1, num_hash_layers: int = 1, hidden: int = 64,
                heads: int = 4, head_dim: int = 64, rope_dim: int = 16, window: int = 16, index_topk: int = 5,
                index_heads: int = 16, index_dim: int = 32, experts: int = 8, topk: int = 2, vocab: int = 300,
                yarn: tuple[float, int] | None = (4.0, 64), max_pos: int = 1024, scoring: str = "sqrtsoftplus",
                **over: Any) -> dict[str, Any]:
    """An official-style config.json dict for a random tiny model.

    `ratios` lists the main layers' compress ratios; MTP blocks get ratio 0 (as in Flash).
    index_heads defaults to 16: with few heads the ReLU'd indexer scores are often exactly 0 and
    ties make top-k selection implementation-defined.
    """
    cfg: dict[str, Any] = dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=len(ratios), num_attention_heads=heads,
        num_key_value_heads=1, head_dim=head_dim, qk_rope_head_dim=rope_dim, q_lora_rank=hidden // 2,
        o_groups=2, o_lora_rank=hidden // 4, sliding_window=window, compress_ratios=list(ratios) + [0] * n_mtp,
        compress_rope_theta=160000.0, rope_theta=10000.0, max_position_embeddings=max_pos,
        index_n_heads=index_heads, index_head_dim=index_dim, index_topk=index_topk, n_routed_experts=experts,
        n_shared_experts=1, num_experts_per_tok=topk, moe_intermediate_size=hidden // 2,
        num_hash_layers=num_hash_layers, scoring_func=scoring, norm_topk_prob=True, routed_scaling_factor=1.5,
        swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        num_nextn_predict_layers=n_mtp, bos_token_id=0, eos_token_id=1, hidden_act="silu",
        topk_method="noaux_tc", tie_word_embeddings=False,
    )
    if yarn is not None:
        cfg["rope_scaling"] = dict(type="yarn", factor=yarn[0], original_max_position_embeddings=yarn[1],
                                   beta_fast=32, beta_slow=1)
    cfg.update(over)
    return cfg


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every tensor of a dsv4 model in place with seeded random values in its stored format.

    Linear weights are drawn in float (std 1/sqrt(K)) on their device and quantized into the layer's
    format; norms ~1, hc mixers small, sinks ~N(0,1), tid2eid distinct random experts. Activations
    stay O(1) through the layers, so the model can be run (tests, benchmarks) without a checkpoint.
    """
    from dsv4.model.layers import Linear
    from dsv4.model.moe import StackedLinear

    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(shape, device, std=1.0):
        gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
        return torch.randn(shape, generator=gen, device=device) * std

    done = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, Linear):
            dev = next(iter(mod._buffers.values())).device
            w = randn((mod.out_features, mod.in_features), dev, mod.in_features ** -0.5)
            opts = {"dtype": mod.weight.dtype} if mod.fmt == "dense" else {}
            if mod.fmt == "fp8":
                opts = {"scale_dtype": "e8m0" if mod.scale.dtype == torch.float8_e8m0fnu else "f32"}
            stored = mod.cls.quantize(w, **opts).tensors()
            for sfx, t in stored.items():
                mod._buffers[sfx].copy_(t)
                done.add(f"{mname}.{sfx}")
        if isinstance(mod, StackedLinear):  # routed experts, one quantized weight per expert
            dev = mod.weight.device
            for e in range(mod.n_experts):
                w = randn((mod.out_features, mod.in_features), dev, mod.in_features ** -0.5)
                opts = {"dtype": mod.weight.dtype} if mod.fmt == "dense" else {}
                if mod.fmt == "fp8":
                    opts = {"scale_dtype": "e8m0" if mod.scale.dtype == torch.float8_e8m0fnu else "f32"}
                for sfx, t in mod.cls.quantize(w, **opts).tensors().items():
                    mod._buffers[sfx][e].copy_(t)
            done.update(f"{mname}.{sfx}" for sfx in mod._buffers)
    for name, buf in model.named_buffers():
        if name in done:
            continue
        leaf = name.rsplit(".", 1)[-1]
        dev = buf.device
        if leaf == "tid2eid":
            E = model.cfg.n_routed_experts
            val = torch.rand(buf.shape[0], E, generator=g).argsort(-1)[:, : buf.shape[1]]
        elif leaf.endswith("_fn"):
            val = randn(buf.shape, dev, 0.5 * buf.shape[-1] ** -0.5)
        elif leaf.endswith("_base"):
            val = randn(buf.shape, dev, 0.5)
        elif leaf.endswith("_scale"):
            val = 1 + randn(buf.shape, dev, 0.3)
        elif leaf == "attn_sink":
            val = randn(buf.shape, dev)
        elif leaf in ("ape", "bias"):
            val = randn(buf.shape, dev, 0.5)
        elif "norm" in name:
            val = 1 + randn(buf.shape, dev, 0.1)
        elif name in ("embed.weight", "head.weight") or leaf == "weight":
            std = 1.0 if name == "embed.weight" else buf.shape[-1] ** -0.5
            val = randn(buf.shape, dev, std)
        else:
            raise ValueError(f"randomize_: no rule for {name}")
        buf.copy_(val.to(buf.dtype))
    return model


def triton_kernels_compiled() -> dict[str, int]:
    """Kernels Triton has compiled in this process for the JIT functions of dsv4's modules (both of a JitTwins),
    per module.name[.variant]: their in-memory caches' sizes. A count that grows between two calls means a kernel
    was compiled in between."""
    import sys

    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}

    def size(f) -> int:
        caches = getattr(f, "device_caches", {}).values()
        return sum(len(c[0]) for c in caches if isinstance(c, tuple) and isinstance(c[0], dict))

    out: dict[str, int] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("dsv4."):
            continue
        for name, v in list(vars(mod).items()):
            if isinstance(v, JITFunction):
                out[f"{mod_name}.{name}"] = size(v)
            elif isinstance(getattr(v, "fixed", None), JITFunction):  # triton_util.JitTwins
                out[f"{mod_name}.{name}.fixed"], out[f"{mod_name}.{name}.any"] = size(v.fixed), size(v.any)
    return out
