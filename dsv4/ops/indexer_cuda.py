"""CUDA fast path of `topk_select` (dsv4/kernels/cuda/topk.cu): one launch, one CTA or one thread-block cluster per
query row.

Prefill chunks (9 or more rows) of 16-bit scores (bf16, f16) of 4K-32K entries take one CTA of 1024 threads a row:
the row's keys and one histogram of all 65536 keys in shared memory, a suffix scan that finds the k-th largest key,
each kept entry's slot from its key's bin, then its place among the equal keys by entry. Other rows (decode, fp32,
longer) are split over 1-8 CTAs of a cluster by their length (16 past 16K entries where the GPU holds every row's
cluster of 16 at once); each holds its slice as order-preserving keys in shared memory. A radix select over the whole
cluster (histograms exchanged through distributed shared memory) finds the k-th largest key; each CTA stores its kept
entries into every CTA's list, and each CTA ranks its share of the list. Either way: descending score, ties to the
lower entry, -1 past the entries above -inf; topk_select_ref's list bit for bit. `topk_applies`
says whether the kernel can take a call (k <= 1024, rows of up to 256K entries, the CUDA build) and `topk_prefers`
whether it is the faster there; the fast op runs it where both hold, the Triton kernels elsewhere. No host sync; the
counts are read on the device (graph-safe).
"""

from __future__ import annotations

import torch

from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.linear_cuda import PDL, _capability, _index

MAX_K = 1024  # entries of one list
MAX_N = 256 * 1024  # entries of one row (1M tokens of context at ratio 4): 8 CTAs x 32K keys in shared memory
DECODE_MIN_N = 2048  # decode rows of more entries than this (not equal) take the clusters of 2+ CTAs: topk_prefers
MAX_ROWS = 65535  # rows (B * S): the grid's second dimension
CTA_MAX_N = 32768  # rows the one-CTA kernel takes (16-bit scores): their keys and histogram in shared memory
_MODES = {"auto": 0, "cluster": 1, "cta": 2}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def topk_applies(scores: torch.Tensor, n_visible: torch.Tensor, k: int) -> bool:
    """True when the CUDA kernel runs this call: CUDA sm_90+, bf16 / f16 / fp32 scores [B, S, N] with a unit stride on
    N, 1 <= N <= 256K, 1 <= B * S <= 65535, int64 / int32 n_visible [S] contiguous on the same device,
    1 <= k <= min(N, 1024), the module built."""
    if not (scores.is_cuda and scores.dim() == 3 and scores.dtype in _DTYPES and scores.stride(2) == 1):
        return False
    B, S, N = scores.shape
    if not (1 <= B * S <= MAX_ROWS and 1 <= k <= min(N, MAX_K) and N <= MAX_N):
        return False
    if not (n_visible.device == scores.device and n_visible.dtype in (torch.int64, torch.int32)
            and n_visible.shape == (S,) and n_visible.is_contiguous()):
        return False
    return _capability(_index(scores))[0] >= 9 and cuda_kernels.load() is not None


def topk_prefers(scores: torch.Tensor) -> bool:
    """Where a CUDA kernel beats the Triton one (H200, docs/performance.md nineteenth, fifty-first and sixty-first
    passes): decode rows (up to 8) of more than 2K entries (a state of more than 8K tokens: the row is the state's
    capacity, max_len / 4, not the position) on the clusters, timed in the CSA layer's decode graph
    (`tools/ab_trees.py`): a step between windows 118.5 against 125.4 us at 4K entries, 118.8 against 143 at 8K, while
    at 512-2K entries (one CTA, no cluster) the Triton kernel's layer is ~9 us faster; alone (`bench_ops`) 8.2 against
    9.9 us at 4K entries, 8.0 against 22.6 at 32K. Prefill chunks of 16-bit scores of 4K-32K entries (16K-128K context)
    on one CTA a row (128 rows: 10.2 against 15.4 us at 4K entries, 21.2 against 55.8 at 32K); and every call on rows
    of more than 64K entries (256 against 420 us for 128 rows of 256K). Everything else stays on Triton, whose fixed
    cost is lower (2.4 us for a 1K-context row, against 7.9 for the one-CTA cluster)."""
    B, S, N = scores.shape
    if N > 65536:
        return True
    if B * S > 8:  # the binding's default rule takes the one-CTA kernel for these (topk.h: kTopkCtaMinRows / MinN)
        return topk_cta_applies(scores) and N >= 4096
    return N > DECODE_MIN_N


def topk_select(scores: torch.Tensor, n_visible: torch.Tensor, k: int, kernel: str = "auto") -> torch.Tensor:
    """topk_select_ref's contract for the calls `topk_applies` takes: idx [B, S, k] int32. kernel: "auto" (one CTA a
    row for 9 or more rows of 4K or more entries where it applies: 16-bit scores, N <= CTA_MAX_N; else the clusters),
    "cluster" or "cta" (tests, benchmarks)."""
    B, S, _ = scores.shape
    o = torch.empty(B, S, k, dtype=torch.int32, device=scores.device)
    cuda_kernels.load().topk_select(scores, n_visible, o, PDL, _MODES[kernel])
    return o


def topk_cta_applies(scores: torch.Tensor) -> bool:
    """Whether the one-CTA kernel takes rows like these (16-bit scores, at most CTA_MAX_N entries)."""
    return scores.dtype in (torch.bfloat16, torch.float16) and scores.shape[-1] <= CTA_MAX_N
