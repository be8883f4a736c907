"""Lightning Indexer scores and top-k selection (SPEC §2.5).

`indexer_scores_ref(q, w, k, low_precision, w_scale)`: I[b,s,n] = sum_h w'[b,s,h] * relu(q[b,s,h] . k[b,n])
with w' = w * w_scale (the head weights: weights_proj output times n_heads^-0.5 d^-0.5); in
the activation dtype (bf16) under reference numerics, as DeepSeek computes it, else in fp32. The keys may be
packed FP4 rows (dsv4/ops/kv_pack.py), the simulation's codes and scales: the same values.
`topk_select_ref(scores, n_visible, k)`: per query the k best of its first n_visible[s] entries,
in descending score order with ties resolved to the lower entry index (so chunked and one-shot runs
select the same list), as int32 entry indices; slots past the visible count are -1.
"""

from __future__ import annotations

import torch

from dsv4.ops.kv_pack import is_packed, key_unpack_ref


def indexer_scores_ref(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, low_precision: bool,
                       w_scale: float = 1.0) -> torch.Tensor:
    """q [B,S,H,d], w [B,S,H] (the weights_proj output), k [B,N,d] -> [B,S,N]; the head weights are
    w * w_scale in the score dtype (low precision: w rounded to q's dtype, then scaled and rounded again).
    k may be packed FP4 keys [B,N,key_row_bytes(d)] uint8 (dsv4/ops/kv_pack.py), read as their bf16 values."""
    if is_packed(k):
        k = key_unpack_ref(k, q.shape[-1])
    if low_precision:
        score = torch.relu(torch.einsum("bshd,btd->bsht", q, k.to(q.dtype)))
        return (score * (w.to(q.dtype) * w_scale).unsqueeze(-1)).sum(2)
    score = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()))
    return (score * (w.float() * w_scale).unsqueeze(-1)).sum(2)


def topk_select_ref(scores: torch.Tensor, n_visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B,S,N], n_visible [S] int64 (entries 0..n-1 visible to query s) -> idx [B,S,k] int32."""
    N = scores.shape[-1]
    visible = torch.arange(N, device=scores.device)[None, :] < n_visible[:, None]  # [S,N]
    s = scores.float().masked_fill(~visible, float("-inf"))
    # stable sort: equal scores (exact zeros are common after the ReLU) resolve to the lower index
    top = s.sort(dim=-1, descending=True, stable=True)
    idx, val = top.indices[..., :k], top.values[..., :k]
    return torch.where(torch.isinf(val) & (val < 0), -1, idx).to(torch.int32)


def make_fast_topk(triton_fast):
    """The fast `topk_select`: the CUDA kernels (dsv4/ops/indexer_cuda.py, one launch, a CTA or a cluster per row) for
    the calls it takes (k <= 1024, rows of up to 256K entries) where it is the faster (`topk_prefers`: long rows at
    decode, prefill chunks from 16K to 128K context, very long rows always), the Triton kernels for everything else."""
    if triton_fast is None:
        return None
    from dsv4.ops import indexer_cuda

    def topk_select_fast(scores, n_visible, k):
        if indexer_cuda.topk_applies(scores, n_visible, k) and indexer_cuda.topk_prefers(scores):
            return indexer_cuda.topk_select(scores, n_visible, k)
        return triton_fast(scores, n_visible, k)

    topk_select_fast.__doc__ = triton_fast.__doc__
    return topk_select_fast


def register_ops(register) -> None:
    try:  # the Triton fast paths; without Triton the references run and ops.configure lists them so
        from dsv4.ops.indexer_triton import indexer_scores as fast_scores, topk_select as fast_topk
    except ImportError:
        fast_scores = fast_topk = None
    register("indexer_scores", indexer_scores_ref, fast_scores, interpretable=True,
             doc="Lightning Indexer scores over compressed keys")
    register("topk_select", topk_select_ref, make_fast_topk(fast_topk), interpretable=True,
             doc="top-k entry indices per query, ties to the lower index",
             cuda="decode rows of more than 2K entries, up to 256K (a cluster per row), prefill rows of 4K-32K bf16 / "
                  "f16 entries (a CTA per row) and of 64K-256K (clusters), k <= 1024: one launch")
