"""CUDA fast path of `linear` for decode shapes (dsv4/kernels/cuda/gemv.cu): 1-8 tokens on FP8 block-scaled or bf16
weights, on the tensor cores, same numerics as `linear_ref` up to fp32 summation order (products exact: e4m3 x e4m3
and bf16 x bf16 in fp32; fp32 x split exactly into three bf16 parts; power-of-two scales per 128-K block).

`applies(x2, w, act_quant, out_dtype)` says whether a call takes this path (else the Triton kernels run);
`gemv(x2, w, out, cfg)` launches it; `wo_a_applies` / `wo_a` run the grouped wo_a on its FP8 weight with bf16 x (no
activation quantization: the products of the bf16 GEMM on the dequantized weight, given power-of-two scales); `config(fmt, x_f32, M, N, K)` is the (splits, WR, nstep, nchunk) choice, a fixed function of
the shape (deterministic; measured on an H200 with tools/bench_ops.py, docs/performance.md). Split-K runs across a
thread-block cluster and is reduced in rank order: same input, same bits.

The prefill path (dsv4/kernels/cuda/gemm.cu) on FP8 block-scaled weights with bf16 out: one launch quantizes x
(act_quant), a second runs TMA + FP8 wgmma over 128 x 128 or 128 x 64 output tiles on a persistent grid, with K split S
ways and the fp32 partials summed in split order where the tiles alone leave SMs idle. `gemm_applies` says whether it
can run a call, `gemm_choice` whether the fast `linear` runs it there (and with which plan: GEMM_TUNED, measured against
Triton), `gemm(x2, w, out, splits, pre, bn)` launches it. The MMA accumulates each 128-K block on the tensor cores
(op_fp8_mma_bf16_out in dsv4/testing.py), as Triton's FP8 dot does.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops import stream_role
from dsv4.ops.linear import PreparedLinear

MAX_M = 8
# programmatic dependent launch: weight loads overlap the previous kernel's tail (DSV4_PDL=0 turns it off, to
# measure what it buys)
PDL = os.environ.get("DSV4_PDL", "1") != "0"

# weight formats of the GEMV: "fp8" (x quantized to e4m3 1x128, linear), "fp8_bf16" (FP8 weights times bf16 x as
# the bf16 GEMM of the dequantized weight computes it, wo_a), "dense" (bf16 weights)
_STEP_COLS = {"fp8": 64, "fp8_bf16": 64, "dense": 32}


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def applies(x2: torch.Tensor, w: PreparedLinear, act_quant: bool, out_dtype: torch.dtype) -> bool:
    """True when the CUDA GEMV runs this call: CUDA sm_90+, 1..8 rows, FP8 weights with activation quantization
    (K % 128 == 0) or bf16 weights (K % 8 == 0, 16-byte rows), bf16/fp32 x and out, and the module built."""
    if not x2.is_cuda or not 1 <= x2.shape[0] <= MAX_M:
        return False
    if w.fmt == "fp8":
        ok = act_quant and w.k % 128 == 0
    elif w.fmt == "dense":
        ok = w.weight.dtype == torch.bfloat16 and w.k % 8 == 0
    else:
        ok = False
    if not ok or x2.stride(-1) != 1:
        return False
    if _capability(_index(x2))[0] < 9:
        return False
    if config(w.fmt, x2.dtype == torch.float32, x2.shape[0], w.n, w.k) is None:
        return False
    return cuda_kernels.load() is not None


_THREADS = 256
SMEM_CAP = 100 * 1024  # bytes per CTA: keeps two CTAs (and a dependent kernel's) resident per SM

# (fmt, x fp32, N, K) -> {1: config for one token, 4: for 2-8 tokens}; None: the Triton kernel was faster there.
# The fastest of every candidate on an H200 (tools/bench_ops.py --sweep-gemv --m 1,4, 2026-11-23,
# docs/performance.md) for the Flash shapes the model runs (its FusedLinears: wq_a || wkv, wq_b || the indexer's
# wq_b in CSA layers, the compressors' wkv || wgate (|| the indexer's weights_proj) on the bf16 attn_norm output)
# and the per-projection shapes of bench_ops.
TUNED: dict[tuple[str, bool, int, int], dict[int, tuple[int, int, int, int] | None]] = {
    ("fp8", False, 1024, 4096): {1: (4, 2, 4, 1), 4: (8, 8, 8, 1)},  # wq_a
    ("fp8", False, 512, 4096): {1: (8, 4, 4, 1), 4: (8, 4, 4, 1)},  # wkv
    ("fp8", False, 1536, 4096): {1: (4, 4, 8, 1), 4: (8, 2, 2, 1)},  # wq_a || wkv
    ("fp8", False, 32768, 1024): {1: (1, 8, 4, 4), 4: None},  # wq_b (Triton's swap-AB MMA: 11.4 vs 14.6 us)
    ("fp8", False, 40960, 1024): {1: (1, 4, 2, 4), 4: (1, 8, 2, 8)},  # wq_b || indexer wq_b (13.7 / 13.6 us)
    ("fp8", False, 4096, 8192): {1: (2, 1, 2, 4), 4: (8, 8, 2, 8)},  # wo_b
    ("fp8", False, 8192, 1024): {1: (1, 2, 4, 1), 4: (4, 8, 4, 1)},  # indexer wq_b
    ("fp8", False, 2048, 4096): {1: (8, 8, 8, 1), 4: (8, 2, 2, 1)},  # shared expert w1 / w3
    ("fp8", False, 4096, 2048): {1: (4, 8, 4, 2), 4: (8, 4, 2, 1)},  # shared expert w2
    ("dense", False, 1024, 4096): {1: None, 4: None},  # HCA compressor wkv || wgate (Triton 5.3 / 7.0 vs 5.9 / 9.3 us)
    ("dense", False, 2624, 4096): {1: (8, 8, 4, 4), 4: (8, 4, 8, 1)},  # CSA compressors || weights_proj (8.7 / 12.1 us)
    # wo_a on its FP8 weight, bf16 x, 8 groups (11.0 / 13.3 us, against 18.7 / 19.0 for cuBLAS on the bf16 weight)
    ("fp8_bf16", False, 8192, 4096): {1: (2, 2, 2, 4), 4: (4, 8, 2, 8)},
}



def smem_bytes(fmt: str, x_f32: bool, M: int, ks: int, wr: int, nstep: int, nchunk: int = 1) -> int:
    """Dynamic shared memory of one CTA (mirrors gemv_smem_bytes in gemv.cu)."""
    pitch = ks + 16
    rows = 16 * wr
    wk = 8 // wr
    if fmt != "dense":
        x = (M * pitch * (2 if fmt == "fp8_bf16" else 1) + 15) // 16 * 16 + M * (ks // 128) * 4
    else:
        x = ((3 if x_f32 else 1) * M * pitch * 2 + 15) // 16 * 16
    ring = min(nchunk, 3) * nstep * 2 * _THREADS * 16
    scales = (ks // 128 * 4 + 15) // 16 * 16 if fmt != "dense" else 0
    return ring + scales + x + (wk + 1) * M * rows * 4


def candidates(fmt: str, x_f32: bool, M: int, N: int, K: int) -> list[tuple[int, int, int, int]]:
    """Every (splits, WR, nstep, nchunk) whose columns cover K with less than 2x overshoot (the column count is a
    power of two, so one exists) and whose CTA fits SMEM_CAP; streamed chunks (nchunk > 1) of 2 or 4 steps."""
    step = _STEP_COLS[fmt]
    steps = -(-K // step)
    out = []
    for splits in (1, 2, 4, 8):
        for wr in (1, 2, 4, 8):
            for nstep in ((1, 2, 4, 8) if fmt == "dense" else (2, 4, 8)):
                for nchunk in (1, 2, 4, 8, 16, 32):
                    if nchunk > 1 and nstep > 4:
                        continue
                    cols = splits * (8 // wr) * nstep * nchunk
                    if not steps <= cols < 2 * steps:
                        continue
                    if smem_bytes(fmt, x_f32, M, (8 // wr) * nchunk * nstep * step, wr, nstep, nchunk) > SMEM_CAP:
                        continue
                    out.append((splits, wr, nstep, nchunk))
    return out


@functools.lru_cache(maxsize=None)
def config(fmt: str, x_f32: bool, M: int, N: int, K: int) -> tuple[int, int, int, int] | None:
    """(splits, WR, nstep, nchunk), or None where the Triton kernel is faster: `splits` CTAs of a cluster share K,
    WR 16-row groups per CTA, each warp streams nchunk chunks of nstep 16-byte steps per lane (8 // WR warps per
    row group split the CTA's columns). TUNED
    where measured; otherwise, from the same sweep's pattern: >= 96 CTAs, then up to 64 KB of weights per CTA
    (all its loads in flight at once), then more rows per CTA, then fewer splits."""
    tuned = TUNED.get((fmt, x_f32, N, K))
    if tuned is not None:
        cfg = tuned[1 if M == 1 else 4]
        if cfg is None or smem_bytes(fmt, x_f32, M, (8 // cfg[1]) * cfg[3] * cfg[2] * _STEP_COLS[fmt],
                                     cfg[1], cfg[2], cfg[3]) <= SMEM_CAP:
            return cfg
    step = _STEP_COLS[fmt]
    best = None
    for splits, wr, nstep, nchunk in candidates(fmt, x_f32, M, N, K):
        if nchunk > 1:
            continue  # the one-chunk kernels measured faster at the shapes swept so far
        ctas = splits * -(-N // (16 * wr))
        cta_bytes = 16 * wr * (8 // wr) * nstep * step * (2 if fmt == "dense" else 1)
        score = (ctas >= 96, min(cta_bytes, 65536), wr, -splits)
        if best is None or score > best[0]:
            best = (score, (splits, wr, nstep, nchunk))
    if best is None:
        raise ValueError(f"linear_cuda: no gemv config for {fmt} N={N} K={K}")
    return best[1]


def gemv(x2: torch.Tensor, w: PreparedLinear, out: torch.Tensor, cfg: tuple[int, int, int, int] | None = None,
         norm: tuple[torch.Tensor, float] | None = None) -> None:
    """out[M, N] = x2[M, K] @ W^T (see applies()); cfg overrides config() (benchmarks and tests). norm = (w [K] bf16,
    eps): x2's rows RMS-normed first (rmsnorm_ref), in the same launch (FP8 weights, bf16 x)."""
    mod = cuda_kernels.load()
    cfg = cfg or config(w.fmt, x2.dtype == torch.float32, x2.shape[0], w.n, w.k)
    if cfg is None:
        raise ValueError(f"linear_cuda.gemv: the Triton kernel runs {w.fmt} [{w.n}, {w.k}] at M = {x2.shape[0]}")
    splits, wr, nstep, nchunk = cfg
    nw, eps = norm if norm is not None else (None, 0.0)
    mod.gemv(x2, w.weight, w.scale if w.fmt == "fp8" else None, out, splits, wr, nstep, nchunk, True, 1, PDL, nw, eps)


def wo_a_applies(o2: torch.Tensor, w8: PreparedLinear, groups: int) -> bool:
    """True when the grouped GEMV runs wo_a: CUDA sm_90+, 1..8 bf16 rows of groups x K columns (unit stride), an FP8
    weight [groups * R, K] with K % 128 == 0 and R a multiple of 128 rows, and the module built."""
    if not o2.is_cuda or o2.dtype != torch.bfloat16 or not 1 <= o2.shape[0] <= MAX_M or o2.stride(-1) != 1:
        return False
    if w8.fmt != "fp8" or w8.k % 128 or w8.n % groups or (w8.n // groups) % 128 or o2.shape[1] != groups * w8.k:
        return False
    if _capability(_index(o2))[0] < 9:
        return False
    try:
        config("fp8_bf16", False, o2.shape[0], w8.n, w8.k)
    except ValueError:  # no configuration fits the shared-memory cap (K far beyond wo_a's)
        return False
    return cuda_kernels.load() is not None


def wo_a(o2: torch.Tensor, w8: PreparedLinear, groups: int, out: torch.Tensor,
         cfg: tuple[int, int, int, int] | None = None) -> None:
    """out[M, N] (bf16) = the grouped wo_a on the FP8 weight (see wo_a_applies): rows [g R, (g + 1) R) of w8 times
    o2[:, g K:(g + 1) K], R = N / groups; the products are those of the bf16 weight (pow2_scales)."""
    mod = cuda_kernels.load()
    splits, wr, nstep, nchunk = cfg or config("fp8_bf16", False, o2.shape[0], w8.n, w8.k)
    mod.gemv(o2, w8.weight, w8.scale, out, splits, wr, nstep, nchunk, False, groups, PDL, None, 0.0)


# below: the GEMV (1-8 tokens) or the Triton kernels; the default of GemmPlan.min_m, and the bound outside GEMM_TUNED
GEMM_MIN_M = 96


class GemmPlan(NamedTuple):
    """How the CUDA GEMM runs a call: `splits` of K per output tile, tiles of 128 rows x `bn` (128 or 64) columns."""

    splits: int
    bn: int = 128
    min_m: int = GEMM_MIN_M  # fewer rows run the Triton kernel (or the GEMV, up to 8)


# (N, K) -> plan, for the shapes where the CUDA GEMM beat the Triton kernel at M = 128 (H200, act_quant + GEMM, every
# (splits, bn) timed, docs/performance.md twenty-fifth pass; Triton in the same session). Where a tile's S CTAs fit the
# GPU as clusters (gemm_cluster_fit: 66 of 2, 30 of 4, 15 of 8 on an H200) the partials meet in distributed shared
# memory, else in the workspace. 64-wide tiles double the tiles (wo_b's 32 x 4 units did not fit as clusters, its 64 x 2
# do) and overlap each block's MMAs with the previous block's promotion; where the 128-wide tiles alone fill the GPU
# (wq_b) they stay faster. Any other shape runs Triton unless its tiles alone fill half the SMs (the regime of wq_b)
GEMM_TUNED: dict[tuple[int, int], GemmPlan] = {
    # wq_b: 16.3-16.9 us (bn 64: 19.4; Triton 22.0); from 32 rows (M = 16 / 32 / 64: 16.7-16.9 / 16.1-16.4 / 15.8-15.9
    # us, Triton 12.4-12.7 / 17.1-17.5 / 17.7-18.1; sixty-second pass)
    (32768, 1024): GemmPlan(1, min_m=32),
    # wq_b || indexer wq_b (CSA layers): 22.1 us (bn 64: 23.1; Triton 29.7); Triton up to 95 rows (M = 16-64: 19.6-20.9
    # us against 20.7-22.2)
    (40960, 1024): GemmPlan(1),
    (4096, 8192): GemmPlan(2, 64),  # wo_b: 17.7-18.3 us, clusters of 2 (128 wide, S = 4: 20.0-20.4); Triton to 95 rows
    # wq_a || wkv: 9.5 us, clusters of 4 (128 wide, S = 8: 11.0); from 9 rows (M = 16-64: 9.1-9.5 us, Triton 12.6-14.0)
    (1536, 4096): GemmPlan(4, 64, min_m=9),
    # the shared expert's w1 / w3 shape: 11.2 us, clusters of 4 (bn 64, S = 2: 11.1); from 9 rows (M = 16-64:
    # 10.6-11.4 us, Triton 12.7-14.1)
    (2048, 4096): GemmPlan(4, min_m=9),
    # the shared expert's w2 shape: 8.8 us (128 wide: 11.3; Triton 10.8); from 9 rows (M = 16-64: 8.3-9.1, Triton
    # 10.4-10.9)
    (4096, 2048): GemmPlan(1, 64, min_m=9),
    (8192, 1024): GemmPlan(1, 64),  # indexer wq_b alone: 8.0 us (128 wide: 8.6; Triton 9.7)
}


def gemm_tiles(M: int, N: int, bn: int = 128) -> int:
    """Output tiles of the CUDA GEMM: 128 rows x `bn` columns."""
    return -(-M // 128) * -(-N // bn)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemm_applies(x2: torch.Tensor, w: PreparedLinear, act_quant: bool, out_dtype: torch.dtype) -> bool:
    """True when the CUDA prefill GEMM can run this call: CUDA sm_90, FP8 weights with activation quantization,
    K % 128 == 0, N % 8 == 0, bf16 out, a 16-byte aligned weight, and the module built (any M >= 1)."""
    if not x2.is_cuda or x2.shape[0] < 1 or x2.stride(-1) != 1:
        return False
    if not (w.fmt == "fp8" and act_quant and out_dtype == torch.bfloat16 and w.k % 128 == 0 and w.n % 8 == 0
            and w.weight.is_contiguous() and w.weight.data_ptr() % 16 == 0):
        return False
    if _capability(_index(x2))[0] != 9:  # wgmma is sm_90a only
        return False
    return cuda_kernels.load() is not None


def gemm_choice(x2: torch.Tensor, w: PreparedLinear, act_quant: bool, out_dtype: torch.dtype) -> GemmPlan | None:
    """The plan the fast `linear` runs this call with on the CUDA GEMM, or None where another kernel is faster
    (fewer rows than its GEMM_TUNED plan's min_m, or GEMM_MIN_M outside the table; a shape outside GEMM_TUNED whose
    tiles do not fill half the SMs) or it cannot run."""
    M = x2.shape[0]
    plan = GEMM_TUNED.get((w.n, w.k))
    if M < (plan.min_m if plan is not None else GEMM_MIN_M) or not gemm_applies(x2, w, act_quant, out_dtype):
        return None
    if plan is not None:
        # measured at M = 128; more rows give more tiles: 128-wide ones once the 64-wide ones alone fill the SMs, and
        # fewer splits while neither their clusters nor their units fit the GPU at once
        if plan.bn == 64 and gemm_tiles(M, w.n, 64) > _sms(_index(x2)):
            plan = plan._replace(bn=128)
        s, tiles = plan.splits, gemm_tiles(M, w.n, plan.bn)
        while s > 1 and tiles > cluster_fit(_index(x2), s, plan.bn) and tiles * s > _sms(_index(x2)):
            s //= 2
        return plan._replace(splits=s)
    return GemmPlan(1) if 2 * gemm_tiles(M, w.n) >= _sms(_index(x2)) else None


_CLUSTER_FIT: dict[tuple[int, int, int], int] = {}


def cluster_fit(index: int, splits: int, bn: int = 128) -> int:
    """Clusters of `splits` GEMM CTAs (tiles `bn` wide) device `index` holds at once: split-K goes through a cluster
    where every output tile's fits, else through the workspace (gemm.cu). Cached per device; a failed occupancy query
    counts as 0 (the workspace) this time and is asked again next time."""
    key = (index, splits, bn)
    n = _CLUSTER_FIT.get(key)
    if n is None:
        try:
            with torch.cuda.device(index):
                n = int(cuda_kernels.load().gemm_cluster_fit(splits, bn))
        except RuntimeError:
            return 0
        _CLUSTER_FIT[key] = n
    return n


def gemm_splits(M: int, N: int, K: int, sms: int) -> int:
    """Default splits of K per output tile (shapes outside GEMM_TUNED, tests): doubled (up to 8) while the work units
    still fit the SMs in one wave and every split keeps >= 2 blocks of K; 1 when the tiles alone fill half the SMs."""
    tiles = gemm_tiles(M, N)
    kb = K // 128
    s = 1
    while s < 8 and tiles * 2 * s <= sms and kb >= 4 * s:
        s *= 2
    return s


MAX_SPLIT_TILES = 4096  # output tiles of a split-K launch (the per-device arrival counters)


def _counters(device: torch.device) -> torch.Tensor:
    """The workspace split-K's 2 x MAX_SPLIT_TILES arrival counters on `device` for the current stream's role
    (`triton_util.arrival_counters`: zeros that every launch leaves zero)."""
    from dsv4.ops.triton_util import arrival_counters  # imported here: this module loads without Triton

    return arrival_counters(device, "gemm split-K", 2 * MAX_SPLIT_TILES)


def gemm(x2: torch.Tensor, w: PreparedLinear, out: torch.Tensor, splits: int | None = None,
         pre: tuple[torch.Tensor, torch.Tensor] | None = None, bn: int = 128) -> None:
    """out[M, N] (bf16) = act_quant(x2) @ W^T on FP8 weights (see gemm_applies), in tiles of 128 rows x `bn` (128 or
    64) columns; `splits` overrides gemm_splits. `pre`: act_quant(x2) already made (e4m3 codes [M, K], fp32 scales
    [M, K / 128], contiguous), no launch for it."""
    mod = cuda_kernels.load()
    M, K = x2.shape
    sms = _sms(_index(x2))
    s = splits or gemm_splits(M, w.n, w.k, sms)
    tiles = gemm_tiles(M, w.n, bn)
    if stream_role(x2.device) == "side":
        # the workspace path's units wait for each other and assume the whole grid resident: beside a workspace
        # launch on the main stream, each could hold SMs the other waits for. On the side stream: clusters or S = 1
        while s > 1 and tiles > cluster_fit(_index(x2), s, bn):
            s //= 2
    part = cnt = None
    if s > 1 and tiles > cluster_fit(_index(x2), s, bn):  # else the partials meet in the clusters' shared memory
        if tiles > MAX_SPLIT_TILES:
            raise ValueError(f"linear_cuda.gemm: split-K over {tiles} tiles (at most {MAX_SPLIT_TILES})")
        part = torch.empty(tiles * s * 128 * bn, dtype=torch.float32, device=x2.device)
        cnt = _counters(x2.device)
    if pre is not None:
        xq, xs = pre
    else:
        xq = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
        xs = torch.empty((M, K // 128), dtype=torch.float32, device=x2.device)
        mod.act_quant(x2, xq, xs, PDL)
    mod.gemm_fp8(xq, xs, w.weight, w.scale, out, s, bn, sms, part, cnt, PDL)
