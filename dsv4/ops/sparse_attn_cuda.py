"""CUDA fast path of `sparse_attn` (dsv4/kernels/cuda/attn.cu): decode in one launch per call, prefill chunks too.

Decode queries (1-8 per call: a step, or MTP verification) with bf16 q / K = V rows of 512 dims (bf16, or packed FP8
rows that the kernel converts to bf16 in shared memory), H a multiple of 16 and int32 index lists:
- up to 1536 slots in all, one launch: a thread-block cluster per (query, 16 heads) spreads the list's 64-slot blocks
  over up to 8 CTAs (up to MAX_CLUSTER = 16 for 9-24 blocks where the device holds every query's cluster at once),
  each keeping its blocks' rows in shared memory; the running maximum of the sequential walk is
  exchanged across the cluster before the walk, so every p and bf16(p) is the reference's, and the CTAs' partials are
  combined in rank order;
- longer lists (HCA states of more than ~176K tokens; up to 2^18 slots), three launches over about one CTA per SM: every
  block's maximum logit per head into global memory, then each split's walk from the running maximum at its blocks
  (the same p and bf16(p)) into fp32 partials, then the partials combined in split order.
Given RoPE tables, the output's RoPE dims are rotated back in the epilogue. Same input, same bits; no host sync,
graph-safe. (On the split path the fp32 sums follow the splits, whose size depends on the number of queries in the
call and the GPU's SM count: a query's low bits may differ between calls of another query count.)
Prefill chunks (more than 8 queries, H a multiple of 64, up to 65535 queries and 2^18 slots) take a second kernel: one
CTA per (query, 64 heads) walks the query's list block by block in order, the reference's sequential walk, with wgmma
(q K^T and P.V on tensor cores, K = V rows in shared memory gathered one block ahead); the same epilogue. `applies(...)`
says whether a call takes either path (else the Triton kernels run: other shapes or dtypes, no CUDA build).
"""

from __future__ import annotations

import torch

from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.kv_pack import is_packed, kv_row_bytes
from dsv4.ops.linear_cuda import PDL, _capability, _index

D = 512  # K = V width (the kernel's tiles)
HEADS = 16  # query heads per CTA of the decode kernel
MAX_QUERIES = 8  # decode; more queries are prefill chunks (sparse_attn_prefill where H is a multiple of 64)
PREFILL_HEADS = 64  # heads per CTA of the prefill kernel: H a multiple of it
MAX_PREFILL_QUERIES = 65535
CLUSTER_SLOTS = 1536  # one launch: 64-slot blocks x 8 CTAs x 3 blocks kept in shared memory per CTA
MAX_SLOTS = 1 << 18  # longer lists: three launches over up to 256 splits of up to 16 blocks
PACKED_BYTES = kv_row_bytes(D)  # 592: a packed FP8 row, converted to bf16 in shared memory
MAX_CLUSTER = 16  # CTAs a cluster may take (16: a non-portable size, used where the device holds them; 8: never)
_OPTIN: dict[int, int] = {}


def _smem_optin(index: int) -> int:
    if index not in _OPTIN:
        _OPTIN[index] = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
    return _OPTIN[index]


def _rows_ok(t: torch.Tensor, q: torch.Tensor, packed: bool) -> bool:
    """bf16 rows of 512, or packed FP8 rows (dsv4/ops/kv_pack.py, 592 bytes), 16-byte aligned."""
    dtype, width, esz = (torch.uint8, PACKED_BYTES, 1) if packed else (torch.bfloat16, D, 2)
    return (t.dtype == dtype and t.device == q.device and t.dim() == 3 and t.shape[0] == q.shape[0]
            and t.shape[2] == width and t.stride(2) == 1 and (t.stride(1) * esz) % 16 == 0
            and (t.stride(0) * esz) % 16 == 0 and t.data_ptr() % 16 == 0)


def _list_ok(t: torch.Tensor, q: torch.Tensor) -> bool:
    return t.dtype == torch.int32 and t.device == q.device and t.dim() == 3 and tuple(t.shape[:2]) == tuple(q.shape[:2])


def _prefill(q: torch.Tensor) -> bool:
    """True when a call of these queries goes to the prefill kernel (more than MAX_QUERIES)."""
    return q.shape[0] * q.shape[1] > MAX_QUERIES


def applies(q: torch.Tensor, kv_win: torch.Tensor, idx_win: torch.Tensor, kv_comp: torch.Tensor | None,
            idx_comp: torch.Tensor | None, sink: torch.Tensor, cos: torch.Tensor | None = None,
            sin: torch.Tensor | None = None) -> bool:
    """True when a CUDA kernel runs this call: CUDA sm_90+ with the shared memory the kernel needs per CTA (up to
    ~220 KB), bf16 q [B, S, H, 512] with 1 <= B * S <= 8 and H a multiple of 16 (decode) or 8 < B * S <= 65535 and H a
    multiple of 64 (prefill), bf16 rows (or packed FP8 rows, both parts) with 16-byte aligned rows, int32 lists of
    1..2^18 slots in all, an fp32 sink, no RoPE tables or fp32 [S, rd/2] ones (rd/2 even), the module built."""
    if not (q.is_cuda and q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[3] == D and q.stride(3) == 1):
        return False
    B, S, H, _ = q.shape
    prefill = _prefill(q)
    heads = PREFILL_HEADS if prefill else HEADS
    if not (1 <= B * S <= (MAX_PREFILL_QUERIES if prefill else MAX_QUERIES) and H % heads == 0 and H >= heads):
        return False
    if not (q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.stride(2) % 8 == 0 and q.data_ptr() % 16 == 0):
        return False
    if (kv_comp is None) != (idx_comp is None):
        return False
    packed = is_packed(kv_win)
    if not (_rows_ok(kv_win, q, packed) and _list_ok(idx_win, q)):
        return False
    L = idx_win.shape[2]
    if kv_comp is not None:
        if not (_rows_ok(kv_comp, q, packed) and _list_ok(idx_comp, q)):
            return False
        L += idx_comp.shape[2]
    if not 1 <= L <= MAX_SLOTS:
        return False
    if not (sink.dtype == torch.float32 and sink.device == q.device and sink.is_contiguous() and sink.numel() == H):
        return False
    if (cos is None) != (sin is None):
        return False
    if cos is not None and not all(t.dtype == torch.float32 and t.device == q.device and t.dim() == 2
                                   and tuple(t.shape) == (S, cos.shape[-1]) for t in (cos, sin)):
        return False
    if cos is not None and not (cos.shape[1] >= 2 and cos.shape[1] % 2 == 0 and 2 * cos.shape[1] <= D):
        return False
    if _capability(_index(q))[0] < 9:
        return False
    mod = cuda_kernels.load()
    if mod is None:
        return False
    # the shared memory its CTAs take for this list (a GPU with less per block than an H100 / H200: Triton)
    smem = mod.sparse_attn_prefill_smem() if prefill else mod.sparse_attn_decode_smem(L)
    return 0 < smem <= _smem_optin(_index(q))


def sparse_attn(q: torch.Tensor, kv_win: torch.Tensor, idx_win: torch.Tensor, kv_comp: torch.Tensor | None,
                idx_comp: torch.Tensor | None, sink: torch.Tensor, scale: float, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None) -> torch.Tensor:
    """sparse_attn_ref's contract for the calls `applies` takes: o [B, S, H, 512] bf16, its last 2 * rd/2 dims
    RoPE-inverted when cos, sin [S, rd/2] are given."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if idx_comp is not None and idx_comp.shape[2] == 0:
        kv_comp = idx_comp = None
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    mod = cuda_kernels.load()
    if _prefill(q):
        mod.sparse_attn_prefill(q, kv_win, idx_win, kv_comp, idx_comp, sink, o, float(scale), PDL, cos, sin)
    else:
        mod.sparse_attn_decode(q, kv_win, idx_win, kv_comp, idx_comp, sink, o, float(scale), PDL, cos, sin, MAX_CLUSTER)
    return o
