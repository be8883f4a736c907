// Sparse MQA attention with a sink: decode (1-8 queries) in one launch, prefill chunks: see attn.cu.
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
  int wide;    // 9-24 blocks may take clusters of 16 CTAs (where the device holds every query's at once)
  float scale;
  // rd2 > 0: the output's last 2 * rd2 dims RoPE-inverted (rope_ref's inverse on the rounded output) with the
  // angles of token s: cos / sin [S, rd2] fp32, contiguous; rd2 even, 2 * rd2 <= 512
  const float* cos;
  const float* sin;
  int rd2;
  // lists longer than kAttnMaxSlots (sparse_attn_long_plan): nblk 64-slot blocks in nsplit splits of bps blocks; fp32
  // scratch: bmax [queries, H / 16, nblk, 16], pm / pz [queries, H / 16, nsplit, 16], pacc [.., nsplit, 16, 512]
  float* bmax;
  float* pm;
  float* pz;
  float* pacc;
  int nblk, bps, nsplit;
};

constexpr int kAttnD = 512;         // K = V width
constexpr int kAttnHeads = 16;      // query heads per CTA of the decode kernel
constexpr int kAttnBlock = 64;      // slots per online-softmax step
constexpr int kAttnMaxCluster = 8;  // CTAs per (query, head group): the list's blocks are spread over them
constexpr int kAttnMaxBlocksPerCta = 3;  // a CTA keeps the K = V rows of its blocks in shared memory
constexpr int kAttnMaxSlots = kAttnBlock * kAttnMaxCluster * kAttnMaxBlocksPerCta;  // 1536: one cluster
constexpr int kAttnLongMaxBps = 16;         // longer lists: three launches over splits of at most 16 blocks
constexpr int kAttnLongMaxSplits = 256;     // and at most 256 splits per (query, head group)
constexpr int kAttnLongMaxSlots = kAttnBlock * kAttnLongMaxBps * kAttnLongMaxSplits;  // 262144 (an HCA list at 32M tokens)
constexpr int kAttnPrefillHeads = 64;  // query heads per CTA of the prefill kernel (wgmma's M)
constexpr int kAttnNope = 448;                  // packed rows: e4m3 codes of the first 448 dims,
constexpr int kAttnPackedBytes = 592;           // then 64 bf16 RoPE dims, 7 scale bytes, padding

struct AttnLongPlan {
  int nblk, bps, nsplit;
};

// the splits of a list of kAttnMaxSlots < slots <= kAttnLongMaxSlots: about one CTA per SM
AttnLongPlan sparse_attn_long_plan(int slots, int queries, int head_groups, int sms);

// B * S queries (grid z), H / 16 head groups; 1 <= Lw + Lc <= kAttnLongMaxSlots (checked by the binding); past
// kAttnMaxSlots the plan's fields and scratch must be set
cudaError_t sparse_attn_decode_launch(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream);

// the CTAs per cluster a one-launch call takes (1-16), 0 for the three-launch path, -1 outside the limits
int sparse_attn_decode_cluster(int slots, int queries, int head_groups, bool packed, int max_cluster);
// dynamic shared memory of one CTA for a list of `slots` (the launch's config), -1 outside 1..kAttnLongMaxSlots
int sparse_attn_decode_smem(int slots);

// prefill chunks (any number of queries, H a multiple of 64): one CTA per (query, 64 heads) walking its list's blocks
// in order with wgmma; grid (H / 64, B * S); 1 <= Lw + Lc <= kAttnLongMaxSlots, up to 65535 queries
cudaError_t sparse_attn_prefill_launch(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream);
// its dynamic shared memory per CTA (any list length)
int sparse_attn_prefill_smem();

}  // namespace dsv4
