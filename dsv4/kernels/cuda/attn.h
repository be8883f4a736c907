// Sparse MQA attention with a sink for decode (1-8 queries), one launch: see attn.cu.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>

namespace dsv4 {

struct AttnArgs {
  const __nv_bfloat16* q;   // [B, S, H, 512]
  // K = V rows as bytes: bf16 [.., 512], or (packed) the FP8 rows of dsv4/ops/kv_pack.py, kAttnPackedBytes each
  const unsigned char* kw;  // [B, Nw, row] window K = V rows
  const unsigned char* kc;  // [B, Nc, row] compressed K = V rows (kw when the list has no compressed part)
  const int* iw;            // [B, S, Lw] window slots (-1: none)
  const int* ic;            // [B, S, Lc] compressed slots (-1: none)
  const float* sink;        // [H]
  __nv_bfloat16* o;         // [B, S, H, 512]
  long long sq_b, sq_s, sq_h;  // element strides
  long long skw_b, skw_n, skc_b, skc_n;  // byte strides of the rows
  long long siw_b, siw_s, siw_l, sic_b, sic_s, sic_l, so_b, so_s, so_h;
  int S, Lw, Lc;
  int packed;  // the rows are packed FP8 (codes, bf16 RoPE dims, E8M0 scales per 64 codes)
  float scale;
  // rd2 > 0: the output's last 2 * rd2 dims RoPE-inverted (rope_ref's inverse on the rounded output) with the
  // angles of token s: cos / sin [S, rd2] fp32, contiguous; rd2 even, 2 * rd2 <= 512
  const float* cos;
  const float* sin;
  int rd2;
};

constexpr int kAttnD = 512;         // K = V width
constexpr int kAttnHeads = 16;      // query heads per CTA
constexpr int kAttnBlock = 64;      // slots per online-softmax step
constexpr int kAttnMaxCluster = 8;  // CTAs per (query, head group): the list's blocks are spread over them
constexpr int kAttnMaxBlocksPerCta = 3;  // a CTA keeps the K = V rows of its blocks in shared memory
constexpr int kAttnMaxSlots = kAttnBlock * kAttnMaxCluster * kAttnMaxBlocksPerCta;  // 1536
constexpr int kAttnNope = 448;                  // packed rows: e4m3 codes of the first 448 dims,
constexpr int kAttnPackedBytes = 592;           // then 64 bf16 RoPE dims, 7 scale bytes, padding

// B * S queries (grid z), H / 16 head groups; 1 <= Lw + Lc <= kAttnMaxSlots (checked by the binding)
cudaError_t sparse_attn_decode_launch(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream);

// dynamic shared memory of one CTA for a list of `slots` (the launch's config), -1 outside 1..kAttnMaxSlots
int sparse_attn_decode_smem(int slots);

}  // namespace dsv4
