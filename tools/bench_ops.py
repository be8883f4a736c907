#!/usr/bin/env python3
"""Per-op latency at DeepSeek-V4-Flash shapes, reference vs fast backend, against the copy bandwidth.

For each case (an op at Flash shapes with random weights in the official formats) and each M (tokens:
1 and 4 for decode, 128 for a prefill chunk) it times both backends, counts the bytes the op must move
(weights it reads + activations in and out) and reports GB/s and % of the device-copy bandwidth
measured in the same run, and against one plain read of the same bytes ("read us": the stream_read probe,
dsv4/kernels/cuda/probe.cu, best of a few grids, same timing method): what one launch streaming those bytes takes
here, its ramp and tail included. It is a yardstick, not a bound: an op whose weight loads start during the
previous launch (programmatic dependent launch) can beat it. Timings replay a CUDA graph of --calls back-to-back calls (launch overhead
excluded, as in the decode graphs); an op that cannot be captured is timed eagerly and marked so. The calls
cycle through enough distinct copies of the weights (and inputs) to exceed 3x the L2 cache, so every call
streams its weights from device memory as in a decode step. --sweep-gemv times every configuration of the
CUDA decode GEMV (dsv4/ops/linear_cuda.py) per linear case instead; --sweep-mm every tile config (split-K
included) of the Triton tensor-core kernel at M > 16.
Needs CUDA. Prints a table and writes JSON (--json). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.cli import Parser  # noqa: E402  (argparse errors in one line)


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(
        description="Per-op latency at Flash shapes (ref vs fast), bytes moved, GB/s and % of the device-copy "
                    "bandwidth measured in the same run. Needs CUDA.")
    p.add_argument("--device", default="cuda", help="CUDA device (default cuda)")
    p.add_argument("--m", default="1,4,128", help="comma list of token counts M (default 1,4,128)")
    p.add_argument("--cases", default="all", help="all, or a comma list of case names (see --list) (default all)")
    p.add_argument("--calls", type=int, default=20, help="calls per timed graph replay (default 20)")
    p.add_argument("--reps", type=int, default=10, help="timed replays, the median is reported (default 10)")
    p.add_argument("--no-ref", action="store_true", help="skip timing the reference backend")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--sweep-gemv", action="store_true",
                   help="time every (splits, WR, nstep) of the CUDA decode GEMV per FP8/bf16 linear case at each M")
    p.add_argument("--sweep-mm", action="store_true",
                   help="time every tile config (BM, BN, stages, split-K) of the Triton tensor-core kernel per "
                        "linear case at each M > 16")
    p.add_argument("--json", metavar="F", help="write the results as JSON to F")
    return p.parse_args(argv)


# name, format, N, K, out dtype ("bf16" | "fp32"), input dtype
LINEARS = [
    ("wq_a", "fp8", 1024, 4096, "bf16", "bf16"),
    ("wkv", "fp8", 512, 4096, "bf16", "bf16"),
    ("wq_a+wkv", "fp8", 1536, 4096, "bf16", "bf16"),  # as the model runs them (FusedLinear)
    ("wq_b", "fp8", 32768, 1024, "bf16", "bf16"),  # SWA and HCA layers
    ("wq_b+indexer.wq_b", "fp8", 40960, 1024, "bf16", "bf16"),  # a CSA layer's projections of qr (FusedLinear)
    ("wo_b", "fp8", 4096, 8192, "bf16", "bf16"),
    ("shared.w1", "fp8", 2048, 4096, "bf16", "bf16"),
    ("shared.w2", "fp8", 4096, 2048, "bf16", "bf16"),
    ("expert.w1 mxfp4", "mxfp4", 2048, 4096, "bf16", "bf16"),
    ("expert.w2 mxfp4", "mxfp4", 4096, 2048, "bf16", "bf16"),
    ("expert.w1 nvfp4", "nvfp4", 2048, 4096, "bf16", "bf16"),
    # the fp32 projections of the bf16 attn_norm output, as the model runs them (FusedLinear): an HCA layer's
    # compressor wkv || wgate; a CSA layer's main + indexer compressor wkv || wgate || the indexer's weights_proj
    ("compressor.wkv", "dense", 1024, 4096, "fp32", "bf16"),
    ("compressor.csa", "dense", 2624, 4096, "fp32", "bf16"),
]


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def build_cases(dev):
    """name -> (op name, make(M) -> (args tuple, bytes moved)[, fast fn (None: the op's)[, ref fn]]): a twin or chain
    overrides the dispatching op."""
    import torch

    from dsv4 import formats
    from dsv4.ops.act_quant import quant_act_ref
    from dsv4.ops.linear import PreparedLinear, prepare_linear

    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, std=1.0, dtype=torch.float32):
        return (torch.randn(shape, generator=g, device=dev) * std).to(dtype)

    try:
        from dsv4.ops.linear_triton import linear as triton_linear
    except ImportError:
        triton_linear = None
    cases = {}
    for name, fmt, N, K, out, inp in LINEARS:
        odt = torch.float32 if out == "fp32" else torch.bfloat16
        idt = torch.float32 if inp == "fp32" else torch.bfloat16

        def make(M, fmt=fmt, K=K, N=N, odt=odt, idt=idt):  # a fresh weight per call: the copies rotate
            w = randn(N, K, std=K ** -0.5)
            pw = prepare_linear(formats.DenseWeight.quantize(w, torch.bfloat16) if fmt == "dense"
                                else formats.FORMATS[fmt].quantize(w))
            x = randn(M, K, dtype=idt)
            return (x, pw, pw.quantized, odt), pw.nbytes() + _nbytes(x) + M * N * odt.itemsize
        cases[name] = ("linear", make)
        if name.startswith("wq_b"):
            def make_xq(M, make=make):  # qr with its codes (rmsnorm_quant's)
                (x, pw, aq, odt), moved = make(M)
                qa = quant_act_ref(x)
                return (qa, pw, aq, odt), moved - _nbytes(x) + _nbytes(qa.q, qa.s)
            cases[name + ".xq"] = ("linear", make_xq)

            def make_normed(M, make=make):  # as the model runs them: the query's norm + the linear, one op
                (x, pw, aq, odt), moved = make(M)
                nw = (1 + randn(x.shape[-1], std=0.1)).to(torch.bfloat16)
                return (x, nw, 1e-6, pw, aq, odt), moved + _nbytes(nw)
            cases["q_norm+" + name] = ("norm_linear", make_normed)
        if fmt in ("fp8", "dense") and triton_linear is not None:  # the Triton kernels beside the CUDA ones, same run
            cases[name + ".triton"] = ("linear", make, triton_linear)

    def make_q_norm(M):  # the query's low-rank norm (q_lora_rank 1024), with the codes for wq_b or without
        x, w = randn(M, 1024, dtype=torch.bfloat16), (1 + randn(1024, std=0.1)).to(torch.bfloat16)
        return (x, w, 1e-6), 2 * _nbytes(x) + _nbytes(w)
    cases["q_norm"] = ("rmsnorm", make_q_norm)
    cases["q_norm+quant"] = ("rmsnorm_quant", lambda M: ((a := make_q_norm(M))[0], a[1] + M * (1024 + 32)))

    def make_wo_a(M, fp8=True):
        # the FP8 weight (power-of-two scales) and its bf16 twin; the bytes of the weight the fast path reads: the FP8
        # one in the decode GEMV (M <= 8), else the bf16 one (cuBLAS)
        w8 = prepare_linear(formats.Fp8BlockWeight.quantize(randn(8 * 1024, 4096, std=4096 ** -0.5)))
        wo = w8.dequantize().to(torch.bfloat16).unflatten(0, (8, 1024))
        o = randn(M, 8, 4096, dtype=torch.bfloat16)
        read = w8.nbytes() if fp8 and M <= 8 else _nbytes(wo)
        return (o, wo, w8 if fp8 else None), read + _nbytes(o) + M * 8 * 1024 * 2
    cases["wo_a"] = ("wo_a", make_wo_a)
    cases["wo_a.bf16"] = ("wo_a", lambda M: make_wo_a(M, fp8=False))

    def make_mhc(M, boundary):
        # one mHC boundary at Flash shapes (hc 4, D 4096, the 1.5 MB fp32 mixer): mhc_pre_norm, or the attention's
        # post fused with the FFN's pre (mhc_post_pre_norm)
        hc, D = 4, 4096
        x = randn(1, M, hc, D, dtype=torch.bfloat16)
        fn = randn((2 + hc) * hc, hc * D, std=(hc * D) ** -0.5)
        base, scale = randn((2 + hc) * hc, std=0.5), 1 + randn(3, std=0.3)
        w = (1 + randn(D, std=0.3)).to(torch.bfloat16)
        tail = (fn, base, scale, hc, 20, 1e-6, 1e-6, w, 1e-6)
        moved = _nbytes(x, fn) + M * D * 2 + M * (hc + hc * hc) * 4
        if not boundary:
            return (x,) + tail, moved
        f = randn(1, M, D, dtype=torch.bfloat16)
        post, comb = torch.rand(1, M, hc, device=dev), torch.rand(1, M, hc, hc, device=dev)
        return (f, x, post, comb) + tail, moved + _nbytes(f, post, comb, x)
    cases["mhc_pre_norm"] = ("mhc_pre_norm", lambda M: make_mhc(M, False))
    cases["mhc_post_pre_norm"] = ("mhc_post_pre_norm", lambda M: make_mhc(M, True))
    try:  # the Triton kernels beside the CUDA one (decode), same run
        from dsv4.ops import mhc_triton
    except ImportError:
        mhc_triton = None
    if mhc_triton is not None:
        cases["mhc_pre_norm.triton"] = ("mhc_pre_norm", lambda M: make_mhc(M, False), mhc_triton.mhc_pre_norm)
        cases["mhc_post_pre_norm.triton"] = ("mhc_post_pre_norm", lambda M: make_mhc(M, True),
                                             mhc_triton.mhc_post_pre_norm)

    head = randn(129280, 4096, std=4096 ** -0.5, dtype=torch.bfloat16)
    ph = PreparedLinear("dense", 129280, 4096, head)

    def make_head(M):
        z = randn(M, 4096, dtype=torch.bfloat16)
        return (z, ph), _nbytes(head, z) + M * 129280 * 4
    cases["head"] = ("head", make_head)
    cases.update(moe_cases(dev, randn))

    def make_logits(M):  # what the engine samples from: fp32 logits, a draw at a bare temperature
        return (randn(M, 129280, std=3.0), 1.0, 12345, 0), M * (129280 * 4 + 8)

    from dsv4.sampling import SamplingParams, sample

    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    # the reference column: torch's sampler (softmax, exponential draw, argmax), the path the race replaces (the
    # op's own reference, torch Philox, is its spec, not a contender)
    cases["sample.race"] = ("sample_race", make_logits, None,
                            lambda lg, t, seed, call: sample(lg, SamplingParams(temperature=t), gen))

    def make_logits_p(M):  # the same at top-p 0.95: the nucleus' five passes, then the race within it
        return make_logits(M)[0] + (0.95,), M * (129280 * 4 + 8)

    cases["sample.race.top_p"] = ("sample_race", make_logits_p, None,
                                  lambda lg, t, seed, call, p: sample(lg, SamplingParams(temperature=t, top_p=p), gen))

    def make_ffn_entry(M):
        # the FFN's entry as a decode step runs it: the boundary (mhc_post_pre_norm) writes x, the router reads it (the
        # CUDA router's gate copy starts during the boundary, under programmatic dependent launch)
        b, moved = make_mhc(M, True)
        gate, bias = randn(256, 4096, std=4096 ** -0.5, dtype=torch.bfloat16), randn(256, std=0.1)
        return b + (gate, bias, torch.zeros(M, dtype=torch.int64, device=dev)), moved + _nbytes(gate, bias)

    def ffn_entry(boundary, router):
        def run(*a):
            y = boundary(*a[:13])[1]
            return router(y.flatten(0, 1), a[13], a[14], None, a[15], "sqrtsoftplus", 6, True, 1.5)
        return run

    from dsv4 import ops

    b_op, r_op = ops.OPS["mhc_post_pre_norm"], ops.OPS["router"]
    if b_op.fast is not None and r_op.fast is not None:
        cases["mhc_post_pre_norm+router"] = ("router", make_ffn_entry, ffn_entry(b_op.fast, r_op.fast),
                                             ffn_entry(b_op.ref, r_op.ref))
        try:
            from dsv4.ops import moe_triton
            cases["mhc_post_pre_norm+router.triton"] = ("router", make_ffn_entry,
                                                        ffn_entry(b_op.fast, moe_triton.router),
                                                        ffn_entry(b_op.ref, r_op.ref))
        except ImportError:
            pass
    cases.update(attn_cases(dev, randn))
    cases.update(indexer_cases(dev, randn))
    return cases


ATTN = [("attn.swa", "swa", 1024), ("attn.hca.1k", "hca", 1024), ("attn.csa.1k", "csa", 1024),
        ("attn.hca.128k", "hca", 131072), ("attn.csa.128k", "csa", 131072), ("attn.hca.1m", "hca", 1048576)]


def attn_cases(dev, randn):
    """The attention of one layer at Flash shapes (64 heads, 512 dims, a full 128-slot window): SWA; HCA (every visible
    entry, ascending); CSA (512 distinct entries in random order, the indexer's top-k; -1 past the visible count). M is
    the number of queries (1-8: the CUDA decode kernel; more: a prefill chunk, the CUDA prefill kernel). Bytes: q, the
    distinct rows the lists name, o. The CSA entries buffer holds at most 8192 entries (its rows are read only where
    the list names them): the copies that defeat the L2 cache stay small."""
    import torch

    H, D, W = 64, 512, 128
    g = torch.Generator(device="cpu").manual_seed(2)

    def make(M, kind, context):
        q = randn(1, M, H, D, dtype=torch.bfloat16)
        kvw = randn(1, W, D, dtype=torch.bfloat16)
        iw = torch.roll(torch.arange(W, dtype=torch.int32), -(context % W)).to(dev).expand(1, M, W)
        kvc = ic = None
        rows = W
        if kind == "hca":
            n = context // 128
            kvc = randn(1, n, D, dtype=torch.bfloat16)
            ic = torch.arange(n, dtype=torch.int32, device=dev).expand(1, M, n)
            rows += n
        elif kind == "csa":
            n, k = context // 4, 512
            nc = min(n, 8192)
            kvc = randn(1, nc, D, dtype=torch.bfloat16)
            pick = torch.stack([torch.randperm(nc, generator=g)[:min(k, n)] for _ in range(M)]).to(torch.int32)
            ic = torch.full((1, M, k), -1, dtype=torch.int32)
            ic[0, :, :pick.shape[1]] = pick
            ic = ic.to(dev)
            rows += len(set(pick.flatten().tolist()))
        sink = randn(H)
        return (q, kvw, iw, kvc, ic, sink, D ** -0.5), 2 * _nbytes(q) + rows * D * 2
    cases = {}
    try:  # the Triton kernels beside the dispatching fast op (CUDA for decode), same run
        from dsv4.ops import sparse_attn_triton
    except ImportError:
        sparse_attn_triton = None
    for name, kind, context in ATTN:
        cases[name] = ("sparse_attn", lambda M, kind=kind, context=context: make(M, kind, context))
        if sparse_attn_triton is not None:
            cases[name + ".triton"] = ("sparse_attn", lambda M, kind=kind, context=context: make(M, kind, context),
                                       sparse_attn_triton.sparse_attn)
    return cases


INDEXER = [("indexer.1k", 1024), ("indexer.16k", 16384), ("indexer.128k", 131072), ("indexer.1m", 1048576)]


def indexer_cases(dev, randn):
    """A CSA layer's Lightning Indexer at Flash shapes (64 heads x 128, k = 512 of context / 4 entries): `.scores` (bf16
    scores of M queries, reference numerics; bytes: q, w, the keys, the scores), `.scores.fp4` (the same on packed FP4
    keys) and `.topk` (the top-512 list per query; bytes: the scores, the list), the latter with a `.triton` twin (the
    dispatching fast op runs the CUDA kernel where indexer_cuda.topk_prefers says it is the faster) and the CUDA
    kernels forced (`.cta`: one CTA a row, rows of up to 32K entries; `.cluster`). M is the number of queries."""
    import torch

    H, d, k = 64, 128, 512

    def make_scores(M, n):
        q = randn(1, M, H, d, dtype=torch.bfloat16)
        w = randn(1, M, H, std=0.01, dtype=torch.bfloat16)
        keys = randn(1, n, d, dtype=torch.bfloat16)
        return (q, w, keys, True, (d * H) ** -0.5), _nbytes(q, w, keys) + M * n * 2

    def make_scores_fp4(M, n):  # the keys as packed FP4 rows (80 bytes a key instead of 256)
        from dsv4.ops.fp4_quant import fp4_act_quant_ref
        from dsv4.ops.kv_pack import key_pack_parts

        q = randn(1, M, H, d, dtype=torch.bfloat16)
        w = randn(1, M, H, std=0.01, dtype=torch.bfloat16)
        keys = key_pack_parts(*fp4_act_quant_ref(randn(1, n, d), 32))
        return (q, w, keys, True, (d * H) ** -0.5), _nbytes(q, w, keys) + M * n * 2

    def make_topk(M, n):
        x = torch.relu(randn(1, M, n)).to(torch.bfloat16)  # ReLU-like: many exact zeros
        n_vis = torch.full((M,), n, dtype=torch.int64, device=dev)
        return (x, n_vis, min(k, n)), _nbytes(x) + M * k * 4
    cases = {}
    try:
        from dsv4.ops import indexer_triton
    except ImportError:
        indexer_triton = None
    try:
        from dsv4.ops import indexer_cuda
    except ImportError:
        indexer_cuda = None
    for name, context in INDEXER:
        n = context // 4
        cases[name + ".scores"] = ("indexer_scores", lambda M, n=n: make_scores(M, n))
        cases[name + ".scores.fp4"] = ("indexer_scores", lambda M, n=n: make_scores_fp4(M, n))
        cases[name + ".topk"] = ("topk_select", lambda M, n=n: make_topk(M, n))
        if indexer_triton is not None:
            cases[name + ".topk.triton"] = ("topk_select", lambda M, n=n: make_topk(M, n), indexer_triton.topk_select)
        if indexer_cuda is not None:  # the CUDA kernels forced: one CTA a row (rows of up to 32K) or clusters
            for kern in ("cta", "cluster") if n <= indexer_cuda.CTA_MAX_N else ("cluster",):
                cases[f"{name}.topk.{kern}"] = ("topk_select", lambda M, n=n: make_topk(M, n),
                                                functools.partial(indexer_cuda.topk_select, kernel=kern))
    return cases


def moe_cases(dev, randn):
    """The MoE of one layer: 6 of 256 MXFP4 experts + the FP8 shared expert (bytes: the chosen experts)."""
    import torch

    from dsv4 import formats
    from dsv4.ops.linear import prepare_linear, stack_prepared

    E, D, I, k = 256, 4096, 2048, 6
    g = torch.Generator(device="cpu").manual_seed(1)

    def stacked(n, kk):
        one = prepare_linear(formats.Mxfp4Weight.quantize(randn(n, kk, std=kk ** -0.5)))
        w = stack_prepared([one])
        # E experts that differ in their bytes, without quantizing 256 of them: random packed nibbles
        w.weight = torch.randint(0, 256, (E, *one.weight.shape), dtype=torch.uint8, device=dev)
        w.scale = (one.scale.unsqueeze(0) + torch.randint(-1, 2, (E, *one.scale.shape), device=dev)).to(torch.uint8)
        return w

    w1, w2, w3 = stacked(I, D), stacked(D, I), stacked(I, D)
    per_expert = (w1.nbytes() + w2.nbytes() + w3.nbytes()) // E
    bias = randn(E, std=0.1)

    def make_experts(M):  # the copies rotate over other experts and another shared expert
        shared = tuple(prepare_linear(formats.Fp8BlockWeight.quantize(randn(n, kk, std=kk ** -0.5)))
                       for n, kk in ((I, D), (D, I), (I, D)))
        x = randn(M, D, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(dev)
        weights = torch.rand(M, k, device=dev)
        hit = len(set(idx.flatten().tolist()))
        moved = hit * per_expert + sum(s.nbytes() for s in shared) + 2 * _nbytes(x)
        return (x, weights, idx, w1, w2, w3, shared, 10.0, True), moved

    def make_router(M):
        gate = randn(E, D, std=D ** -0.5, dtype=torch.bfloat16)
        x = randn(M, D, dtype=torch.bfloat16)
        ids = torch.zeros(M, dtype=torch.int64, device=dev)
        return (x, gate, bias, None, ids, "sqrtsoftplus", k, True, 1.5), _nbytes(gate, bias, x)
    def make_experts_xq(M):  # x with its FP8 codes, as the FFN's mHC boundary hands them to the experts
        from dsv4.ops.act_quant import quant_act_ref

        (x, *rest), moved = make_experts(M)
        qa = quant_act_ref(x)
        return (qa, *rest), moved - _nbytes(x) + _nbytes(qa.q, qa.s)

    cases = {"moe_experts": ("moe_experts", make_experts), "moe_experts.xq": ("moe_experts", make_experts_xq),
             "router": ("router", make_router)}
    try:  # the Triton experts beside the dispatching fast op (CUDA for one MXFP4 token): A/B in the same run
        from dsv4.ops import moe_triton
        cases["moe_experts.triton"] = ("moe_experts", make_experts, moe_triton.moe_experts)
        cases["router.triton"] = ("router", make_router, moe_triton.router)
    except ImportError:
        pass
    return cases


def copy_bandwidth(dev) -> float:
    """Device-to-device copy GB/s (bytes read + written) of a 2 GiB buffer, CUDA events over 10 copies."""
    import torch

    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(dev)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize(dev)
    return 2 * a.numel() * 10 / (s.elapsed_time(e) * 1e-3) / 1e9


_READ_FLOOR: dict[int, float | None] = {}


def read_floor_us(nbytes: int, dev, calls: int, reps: int) -> float | None:
    """Microseconds of one plain read of nbytes (rounded up to 16) by the stream_read probe: the best of a few grids,
    over copies past the L2 cache, timed like the ops (launches back to back, without PDL). None without the CUDA
    kernels."""
    import torch

    from dsv4.kernels import cuda as cuda_kernels

    n = -(-nbytes // 16) * 16
    if n in _READ_FLOOR:
        return _READ_FLOOR[n]
    mod = cuda_kernels.load()
    best = None
    if mod is not None:
        bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(copies_needed(n, dev))]
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        for blocks, threads in ((4 * sms, 256), (8 * sms, 256), (4 * sms, 512)):
            out = torch.empty(blocks, 4, dtype=torch.int32, device=dev)
            us, _ = time_us([lambda b=b, o=out, k=blocks, t=threads: mod.stream_read(b, o, k, t) for b in bufs],
                            calls, reps)
            best = us if best is None else min(best, us)
        del bufs
    _READ_FLOOR[n] = best
    return best


def copies_needed(moved: int, dev) -> int:
    """Distinct weight copies whose bytes exceed 3x the L2 cache (1 for ops that are larger on their own)."""
    import torch

    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    return max(1, -(-3 * l2 // max(moved, 1)))


def time_us(fns, calls: int, reps: int) -> tuple[float, bool]:
    """Median microseconds per call: replays of a CUDA graph of `calls` calls cycling through `fns` (one per
    weight copy); eager when capture fails."""
    import statistics

    import torch

    if callable(fns):
        fns = [fns]
    calls = max(calls, len(fns))

    def fn(i=[0]):  # noqa: B006 (the cycling counter)
        fns[i[0] % len(fns)]()
        i[0] += 1

    for f in fns:
        f()
    torch.cuda.synchronize()
    from dsv4.testing import capture_graph

    try:
        graph, _ = capture_graph(fn, calls)
    except Exception:  # an op that cannot be captured (e.g. a host sync): time it eagerly
        graph = None
        torch.cuda.synchronize()
    run = graph.replay if graph is not None else (lambda: [fn() for _ in range(calls)])
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times), graph is not None


def _best_and_chosen(configs: list[dict], chosen) -> tuple[dict, dict | None]:
    """Sorts a sweep's {"cfg", "us", ...} rows by time: (the fastest, the row of the chosen config or None)."""
    configs.sort(key=lambda r: r["us"])
    return configs[0], next((r for r in configs if chosen is not None and tuple(r["cfg"]) == tuple(chosen)), None)


def sweep_gemv(args, cases, ms, bw, dev) -> int:
    """Every configuration of the CUDA decode GEMV per FP8 / bf16 linear case and M <= 8: us and % copy."""
    import torch

    from dsv4.ops import linear_cuda, linear_triton

    if not linear_cuda.cuda_kernels.load():
        print(f"error: {linear_cuda.cuda_kernels.status()[1]}", file=sys.stderr)
        return 2
    fmts = {c[0]: c[1] for c in LINEARS}
    results = []
    for name, (op_name, make, *_) in cases.items():
        grouped = name == "wo_a"  # the grouped GEMV on wo_a's FP8 weight, bf16 x (format "fp8_bf16")
        if not grouped and (op_name != "linear" or fmts.get(name) not in ("fp8", "dense")):
            continue
        for M in (m for m in ms if m <= linear_cuda.MAX_M):
            first, moved = make(M)
            sets = [first] + [make(M)[0] for _ in range(copies_needed(moved, dev) - 1)]
            if grouped:
                o0, _, w0 = first
                fmt, xf32, odt, groups = "fp8_bf16", False, torch.bfloat16, o0.shape[1]
                sets = [(a[0].reshape(M, -1), a[2]) for a in sets]
                tri = None  # (the wo_a case of the plain table times the bf16 alternatives)
            else:
                x0, w0, aq, odt = first
                fmt, xf32 = w0.fmt, x0.dtype == torch.float32
                tri, _ = time_us([lambda a=a: linear_triton.linear(*a) for a in sets], args.calls, args.reps)
            outs = [torch.empty(M, w0.n, dtype=odt, device=dev) for _ in sets]
            chosen = linear_cuda.config(fmt, xf32, M, w0.n, w0.k)
            line = {"case": name, "M": M, "bytes": moved, "triton_us": tri, "chosen": chosen and list(chosen),
                    "configs": []}
            for cfg in linear_cuda.candidates(fmt, xf32, M, w0.n, w0.k):
                if grouped:
                    calls = [lambda a=a, o=o, c=cfg: linear_cuda.wo_a(a[0], a[1], groups, o, c) for a, o in zip(sets, outs)]
                else:
                    calls = [lambda a=a, o=o, c=cfg: linear_cuda.gemv(a[0], a[1], o, c) for a, o in zip(sets, outs)]
                us, _ = time_us(calls, args.calls, args.reps)
                line["configs"].append({"cfg": list(cfg), "us": us, "pct_copy_bw": 100 * moved / (us * 1e-6) / 1e9 / bw})
            best, mine = _best_and_chosen(line["configs"], chosen)
            line["read_floor_us"] = floor = read_floor_us(moved, dev, args.calls, args.reps)
            mine_s = f"{mine['us']:6.1f} us ({mine['pct_copy_bw']:.0f}%)" if mine else "(Triton)"
            tri_s = f"{tri:6.1f} us" if tri is not None else "     -   "
            print(f"{name:16s} M={M} {moved / 1e6:7.2f} MB  triton {tri_s}  chosen {chosen} {mine_s}  "
                  f"best {tuple(best['cfg'])} {best['us']:6.1f} us ({best['pct_copy_bw']:.0f}%)"
                  + (f"  read floor {floor:.1f} us" if floor else ""))
            print("    " + "  ".join(f"{tuple(r['cfg'])}:{r['us']:.1f}" for r in line["configs"]))
            results.append(line)
            del sets, outs
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "copy_bw_gbps": bw,
                                               "sweep_gemv": results}, indent=1))
    return 0


def sweep_mm(args, cases, ms, bw, dev) -> int:
    """Every tile config of the Triton tensor-core kernel per linear case and M > 16: us and % copy."""
    import torch

    from dsv4.ops import linear_triton as lt

    results = []
    for name, (op_name, make, *over) in cases.items():
        if op_name != "linear" or over or name.endswith(".xq"):  # the Triton kernel quantizes x itself
            continue
        for M in (m for m in ms if m > 16):
            first, moved = make(M)
            sets = [first] + [make(M)[0] for _ in range(copies_needed(moved, dev) - 1)]
            x0, w0, aq, odt = first
            dot = lt._dot_mode(x0, w0, bool(aq and w0.quantized), odt)
            chosen = lt._mm_config(w0.fmt, M, w0.n, w0.k, 1, lt._num_sms(dev), dot)
            line = {"case": name, "M": M, "bytes": moved, "chosen": list(chosen), "configs": []}
            for cfg in lt.mm_candidates(M, w0.n, w0.k, dot):
                try:
                    us, _ = time_us([lambda a=a, c=cfg: lt._linear_variant(*a, "mm", mm_cfg=c) for a in sets],
                                    args.calls, args.reps)
                except Exception as e:  # e.g. a tile that does not fit shared memory
                    print(f"    {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                    continue
                line["configs"].append({"cfg": list(cfg), "us": us, "pct_copy_bw": 100 * moved / (us * 1e-6) / 1e9 / bw})
            best, mine = _best_and_chosen(line["configs"], chosen)
            line["read_floor_us"] = floor = read_floor_us(moved, dev, args.calls, args.reps)
            mine_s = f"{mine['us']:6.1f} us ({mine['pct_copy_bw']:.0f}%)" if mine else "(not swept)"
            print(f"{name:16s} M={M} {moved / 1e6:7.2f} MB  chosen {chosen[1:]} {mine_s}  "
                  f"best {tuple(best['cfg'][1:])} {best['us']:6.1f} us ({best['pct_copy_bw']:.0f}%)"
                  + (f"  read floor {floor:.1f} us" if floor else ""))
            print("    " + "  ".join(f"{tuple(r['cfg'][1:])}:{r['us']:.1f}" for r in line["configs"][:12]))
            results.append(line)
            del sets
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "copy_bw_gbps": bw,
                                               "sweep_mm": results}, indent=1))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.list:
        names = ([c[0] for c in LINEARS] + [c[0] + ".triton" for c in LINEARS if c[1] in ("fp8", "dense")]
                 + [c[0] + ".xq" for c in LINEARS if c[0].startswith("wq_b")]
                 + ["q_norm+" + c[0] for c in LINEARS if c[0].startswith("wq_b")] + ["q_norm", "q_norm+quant"]
                 + ["wo_a", "wo_a.bf16", "mhc_pre_norm", "mhc_post_pre_norm", "mhc_pre_norm.triton",
                    "mhc_post_pre_norm.triton", "head", "moe_experts", "moe_experts.xq",
                    "moe_experts.triton", "router", "router.triton", "mhc_post_pre_norm+router",
                    "mhc_post_pre_norm+router.triton", "sample.race", "sample.race.top_p"]
                 + [n + t for n, _, _ in ATTN for t in ("", ".triton")]
                 + [n + t for n, _ in INDEXER for t in (".scores", ".scores.fp4", ".topk", ".topk.triton")]
                 + [f"{n}.topk.{kern}" for n, c in INDEXER
                    for kern in (("cta", "cluster") if c // 4 <= 32768 else ("cluster",))])
        print("\n".join(names))
        return 0
    if not torch.cuda.is_available():
        print("error: bench_ops needs a CUDA device (none is visible)", file=sys.stderr)
        return 2
    from dsv4 import ops

    dev = torch.device(args.device)
    if dev.type != "cuda":
        print(f"error: --device must be a CUDA device, got {args.device!r}", file=sys.stderr)
        return 2
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    ms = [int(m) for m in args.m.split(",")]
    cases = build_cases(dev)
    if args.cases != "all":
        want = [c.strip() for c in args.cases.split(",")]
        bad = [c for c in want if c not in cases]
        if bad:
            print(f"error: unknown case(s) {', '.join(bad)}; see --list", file=sys.stderr)
            return 2
        cases = {k: v for k, v in cases.items() if k in want}
    bw = copy_bandwidth(dev)
    print(f"device: {torch.cuda.get_device_name(dev)}; copy bandwidth {bw:.0f} GB/s (read + write, same run)")
    if args.sweep_gemv:
        return sweep_gemv(args, cases, ms, bw, dev)
    if args.sweep_mm:
        return sweep_mm(args, cases, ms, bw, dev)
    rows = []
    for name, (op_name, make, *override) in cases.items():  # override: (fast fn[, ref fn]) of a twin or a chain
        op = ops.OPS[op_name]
        fast_ok, why = op.fast_available("cuda")
        fast_fn = override[0] if override and override[0] is not None else op.fast
        ref_fn = override[1] if len(override) > 1 else op.ref
        for M in ms:
            op_args, moved = make(M)
            sets = [op_args] + [make(M)[0] for _ in range(copies_needed(moved, dev) - 1)]
            row = {"case": name, "op": op_name, "M": M, "bytes": moved, "copies": len(sets)}
            for backend, fn in (("ref", ref_fn), ("fast", fast_fn if fast_ok else None)):
                if fn is None or (backend == "ref" and args.no_ref):
                    row[f"{backend}_us"] = None
                    continue
                # the reference dequantizes to fp32: timed on one copy (it is far from memory-bound anyway)
                fns = [lambda fn=fn, a=a: fn(*a) for a in (sets if backend == "fast" else sets[:1])]
                # up to 8 tokens: the kernels as the decode graphs run them (ops.fixed_shapes: specialized on the
                # shapes); more: as an eager prefill chunk runs them
                with ops.fixed_shapes() if M <= 8 else contextlib.nullcontext():
                    us, graphed = time_us(fns, args.calls, args.reps)
                row[f"{backend}_us"], row[f"{backend}_graph"] = us, graphed
            best = row.get("fast_us") or row.get("ref_us")
            row["read_floor_us"] = read_floor_us(moved, dev, args.calls, args.reps)
            fast_us = row.get("fast_us")
            row["pct_read_floor"] = 100 * row["read_floor_us"] / fast_us if fast_us and row["read_floor_us"] else None
            row["gbps"] = moved / (best * 1e-6) / 1e9 if best else None
            row["pct_copy_bw"] = 100 * row["gbps"] / bw if best else None
            row["fast"] = "yes" if fast_ok else f"no ({why})"
            rows.append(row)
            del op_args, sets
        torch.cuda.empty_cache()

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    print(f"{'case':18s} {'M':>4s} {'MB':>8s} {'ref us':>9s} {'fast us':>9s} {'speedup':>7s} {'GB/s':>7s} {'% copy':>7s} "
          f"{'read us':>8s} {'% read':>7s}")
    for r in rows:
        sp = r["ref_us"] / r["fast_us"] if r.get("ref_us") and r.get("fast_us") else None
        print(f"{r['case']:18s} {r['M']:4d} {r['bytes'] / 1e6:8.2f} {f(r.get('ref_us'), '9.1f')} "
              f"{f(r.get('fast_us'), '9.1f')} {f(sp, '7.1f')} {f(r['gbps'], '7.0f')} {f(r['pct_copy_bw'], '7.1f')} "
              f"{f(r['read_floor_us'], '8.1f')} {f(r['pct_read_floor'], '7.1f')}"
              + ("" if r["fast"] == "yes" else f"  fast: {r['fast']}"))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": torch.cuda.get_device_name(dev), "host": platform.node(), "copy_bw_gbps": bw,
            "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
