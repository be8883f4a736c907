// Sparse MQA attention with a per-head sink (SPEC §2.3.5): decode (1-8 queries) in one launch, and prefill chunks.
//
// One K = V row of 512 bf16 per slot; each query's index list (window part, then compressed part; -1 = none) is cut
// into blocks of 64 slots, and DeepSeek's online softmax walks them in order: m_new = max(m, max s), p = exp(s - m_new),
// Z = Z e^(m - m_new) + sum p, acc = acc e^(m - m_new) + bf16(p).V (fp32 sums), then Z += e^(sink - m), o = acc / Z.
//
// Decode, work split: a thread-block cluster of C = 1, 2, 4 or 8 CTAs (8 warps each) per (query, 16 heads), or of 16
// for 9-24 blocks where the device holds every query's cluster at once (a non-portable size: fewer blocks one after
// another in each CTA); CTA r takes the list's blocks r, r + C, r + 2C, ... (at most 3), gathers their rows into shared memory
// (cp.async, 16-byte chunks swizzled by row) and:
// 1. computes each block's logits s = (q.k) * scale (mma.sync bf16, fp32 accumulation; -inf for empty slots) and keeps
//    them in registers; each block's maximum per head is stored into every CTA of the cluster;
// 2. after a cluster barrier, takes the walk's running maximum at each of its blocks: the maximum over every block of
//    the list up to that one. So p = exp(s - m_new) and bf16(p) are the sequential walk's own values, though the CTAs
//    walk their blocks side by side;
// 3. walks its blocks: Z and acc rescaled from its previous block's maximum, P through shared memory to the P.V mma;
// 4. stores its (m, Z) into every CTA; after a second barrier, the CTAs combine their partials (acc read through
//    distributed shared memory) in rank order, each for a slice of the output: m* = max m_r, Z = sum Z_r e^(m_r - m*) + e^(sink - m*), o = sum acc_r e^(m_r - m*) / Z
//    (IEEE division), rounded to bf16 once; with RoPE tables, the last 2 rd2 dims are then rotated back to the
//    query's position as rope_ref(o, cos, sin, inverse) does (fp32 products and sums, unfused), rounded again.
// Packed FP8 rows (dsv4/ops/kv_pack.py, 592 bytes: 448 e4m3 codes, 64 bf16 RoPE dims, 7 E8M0 scales) are gathered
// into the front of their block's tile, then converted in place to the tile's bf16 values (every thread's share read
// into registers first, then written; code x scale is exact in bf16), so the rest of the kernel reads the same tile.
// Against the sequential walk only fp32 summation order differs: the dot products, the sums of p, and the rescaling
// (one exp per CTA instead of a product of exps). Blocks without a valid slot are neither read nor computed. Same
// input, same bits (no atomics); indices are read on the device (graph-safe).
#include <cooperative_groups.h>

#include <cmath>

#include "attn.h"
#include "common.h"

namespace cg = cooperative_groups;

namespace dsv4 {
namespace {

constexpr int kWarps = 8;                        // 8 slots each for the logits, 64 columns each for P.V
constexpr int kThreads = kWarps * 32;
constexpr int kRowBytes = kAttnD * 2;            // one K = V (or q) row
constexpr int kChunks = kRowBytes / 16;          // its 16-byte chunks
constexpr int kQBytes = kAttnHeads * kRowBytes;  // 16 KB
constexpr int kKvBytes = kAttnBlock * kRowBytes;  // 64 KB per block
constexpr int kPRow = kAttnBlock * 2;            // bytes of one head's bf16(p) row
constexpr int kPBytes = kAttnHeads * kPRow;
constexpr int kPartStride = kAttnD + 8;          // fp32 partial rows, padded against bank conflicts
constexpr int kCols = kAttnD / kWarps;           // P.V columns per warp
constexpr float kNegInf = -INFINITY;

using dev::cp_async16;
using dev::cp_async_commit;
using dev::cp_async_wait;
using dev::griddep_launch_dependents;
using dev::griddep_wait;
using dev::fence_acc;
using dev::fence_proxy_async;
using dev::mma_bf16;
using dev::wgmma_commit;
using dev::wgmma_fence;
using dev::wgmma_wait0;

template <int C, int NBL>
struct Small {
  const unsigned char* rows[NBL][kAttnBlock];  // each slot's K = V row, null when empty
  float allmax[C][NBL][kAttnHeads];            // every CTA's blocks' maximum logit per head (-inf: no valid slot)
  float seed[NBL][kAttnHeads];                 // the walk's running maximum at each block
  float red[kWarps][kAttnHeads];               // per-warp maxima, then per-warp sums of p
  float allm[C][kAttnHeads];                   // every CTA's partial: its last maximum and Z
  float allz[C][kAttnHeads];
  float w[C][kAttnHeads];                      // combine weights e^(m_r - m*)
  float zt[kAttnHeads];                        // the combined Z with the sink
};

template <int C, int NBL>
constexpr int smem_bytes() {
  return kQBytes + NBL * kKvBytes + kPBytes + static_cast<int>(sizeof(Small<C, NBL>));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// byte offset of 16-byte chunk c of row i in a swizzled tile (chunk c ^ (i & 7)): ldmatrix's 8 rows hit 8 bank groups
__device__ __forceinline__ int swz(int i, int c, int row_bytes) { return i * row_bytes + ((c ^ (i & 7)) << 4); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// the cluster barrier without memory ordering, in its two halves: arrive (this CTA has started / is done with the
// others' shared memory) and wait (every CTA has arrived); all threads of the CTA call both
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// at most n cp.async groups still pending (n folds to a constant in unrolled loops)
__device__ __forceinline__ void cp_async_wait_n(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// s (heads g, g + 8 x slots 8 warp + 2 (lane % 4) + {0, 1}) = q . k over the 512 columns, fp32: even and odd k-steps
// in two accumulators (two dependent mma chains of 16 instead of one of 32), summed at the end
__device__ __forceinline__ void logits(const unsigned char* q_s, const unsigned char* k_s, int warp, int lane,
                                       float (&s)[4]) {
  float s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int e = 0; e < 4; ++e) s[e] = 0.0f;
  const int qi = lane & 15, qh = lane >> 4;         // A (q): rows 0-15, k halves by lane / 16
  const int ki = warp * 8 + (lane & 7), kq = lane >> 3;  // B (k rows = slots): 4 chunks of 8 columns by lane / 8
  const uint32_t qa = smem_u32(q_s), ka = smem_u32(k_s);
#pragma unroll 4
  for (int kk = 0; kk < kAttnD / 32; ++kk) {
    uint32_t a0, a1, a2, a3, c0, c1, c2, c3, b0, b1, b2, b3;
    ldsm_x4(qa + swz(qi, 4 * kk + qh, kRowBytes), a0, a1, a2, a3);
    ldsm_x4(qa + swz(qi, 4 * kk + 2 + qh, kRowBytes), c0, c1, c2, c3);
    ldsm_x4(ka + swz(ki, 4 * kk + kq, kRowBytes), b0, b1, b2, b3);
    mma_bf16(s, a0, a1, a2, a3, b0, b1);
    mma_bf16(s1, c0, c1, c2, c3, b2, b3);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) s[e] += s1[e];
}

// acc (heads g, g + 8 x columns 64 warp + 8 n + 2 (lane % 4) + {0, 1}) += P (16 x 64, bf16) . V (64 x 512)
__device__ __forceinline__ void pv(const unsigned char* p_s, const unsigned char* v_s, int warp, int lane,
                                   float (&acc)[kCols / 8][4]) {
  const int pi = lane & 15, ph = lane >> 4;
  const int vi = (lane & 7) + (((lane >> 3) & 1) << 3), vh = lane >> 4;
  const uint32_t pa = smem_u32(p_s), va = smem_u32(v_s);
#pragma unroll
  for (int ks = 0; ks < kAttnBlock / 16; ++ks) {
    uint32_t a0, a1, a2, a3;
    ldsm_x4(pa + swz(pi, 2 * ks + ph, kPRow), a0, a1, a2, a3);
    const int row = ks * 16 + vi;
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(va + swz(row, warp * (kCols / 8) + np * 2 + vh, kRowBytes), b0, b1, b2, b3);
      mma_bf16(acc[2 * np], a0, a1, a2, a3, b0, b1);
      mma_bf16(acc[2 * np + 1], a0, a1, a2, a3, b2, b3);
    }
  }
}

// eight e4m3 codes (words lo, hi) times their block's E8M0 scale byte -> eight bf16, a 16-byte chunk (code x 2^k is
// exact in bf16)
__device__ __forceinline__ uint4 codes_bf16(uint32_t lo_word, uint32_t hi_word, uint32_t scale_byte) {
  const float sc = __uint_as_float(scale_byte << 23);  // 2^(byte - 127)
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint32_t word = w ? hi_word : lo_word;
    const uint32_t lw = dev::e4m3_lo_f16x2(word), hw = dev::e4m3_hi_f16x2(word);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&lw));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&hw));
    o[2 * w] = bf16x2(lo.x * sc, lo.y * sc);
    o[2 * w + 1] = bf16x2(hi.x * sc, hi.y * sc);
  }
  return out;
}

// packed rows of block j, gathered to the front of its tile (kAttnPackedBytes apart) -> the tile's swizzled bf16 rows.
// Thread t converts 16-byte output chunk t % 64 of rows t / 64, t / 64 + 4, ...: 8 codes and their scale, or 8 RoPE
// values; every read is done before any write (the two overlap)
__device__ __forceinline__ void unpack_block(unsigned char* tile, int tid) {
  constexpr int kItems = kAttnBlock * kChunks / kThreads;  // 16
  constexpr int kCodeChunks = kAttnNope / 8;               // output chunks of codes (56), then RoPE ones
  const int c = tid & (kChunks - 1), i0 = tid / kChunks;
  uint4 v[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const unsigned char* row = tile + (i0 + k * (kThreads / kChunks)) * kAttnPackedBytes;
    if (c < kCodeChunks) {
      const uint2 codes = *reinterpret_cast<const uint2*>(row + c * 8);
      v[k] = make_uint4(codes.x, codes.y, row[kAttnNope + 128 + c / 8], 0u);
    } else {
      v[k] = *reinterpret_cast<const uint4*>(row + kAttnNope + (c - kCodeChunks) * 16);
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    uint4 out = v[k];
    if (c < kCodeChunks) out = codes_bf16(v[k].x, v[k].y, v[k].z);
    *reinterpret_cast<uint4*>(tile + swz(i0 + k * (kThreads / kChunks), c, kRowBytes)) = out;
  }
}

// the K = V row that slot l of query (b, s)'s list names (window part, then compressed part); null for -1 or past the list
__device__ __forceinline__ const unsigned char* slot_row(const AttnArgs& a, long long b, long long s, int l) {
  if (l < a.Lw) {
    const int v = a.iw[b * a.siw_b + s * a.siw_s + l * a.siw_l];
    return v >= 0 ? a.kw + b * a.skw_b + v * a.skw_n : nullptr;
  }
  if (l < a.Lw + a.Lc) {
    const int v = a.ic[b * a.sic_b + s * a.sic_s + (l - a.Lw) * a.sic_l];
    return v >= 0 ? a.kc + b * a.skc_b + v * a.skc_n : nullptr;
  }
  return nullptr;
}

// one block's rows -> its tile, one cp.async per 16 bytes (empty slots zero-filled; `fill` itself is never read):
// bf16 rows swizzled (thread t copies chunk t % 64 of rows t / 64, t / 64 + 4, ...), packed rows to the front, unswizzled
template <bool PACKED>
__device__ __forceinline__ void gather_rows(unsigned char* dst, const unsigned char* const* rows, int tid,
                                            const void* fill) {
  if constexpr (PACKED) {
    constexpr int kPc = kAttnPackedBytes / 16;  // 37 chunks a row
#pragma unroll 2
    for (int u = tid; u < kAttnBlock * kPc; u += kThreads) {
      const int i = u / kPc, cc = u - i * kPc;
      const unsigned char* row = rows[i];
      cp_async16(dst + u * 16, row != nullptr ? row + cc * 16 : fill, row != nullptr);
    }
  } else {
    const int c = tid & (kChunks - 1), i0 = tid >> 6;
#pragma unroll 4
    for (int i = i0; i < kAttnBlock; i += kThreads / kChunks) {
      const unsigned char* row = rows[i];
      cp_async16(dst + swz(i, c, kRowBytes), row != nullptr ? row + c * 16 : fill, row != nullptr);
    }
  }
}

// the 16 heads' q rows -> shared memory (one cp.async group)
__device__ __forceinline__ void load_q(const AttnArgs& a, long long b, long long s, int h0, unsigned char* q_s,
                                       int tid) {
  const __nv_bfloat16* qb = a.q + b * a.sq_b + s * a.sq_s + static_cast<long long>(h0) * a.sq_h;
#pragma unroll
  for (int k = 0; k < kAttnHeads * kChunks / kThreads; ++k) {
    const int i = k * (kThreads / kChunks) + (tid >> 6), c = tid & (kChunks - 1);
    cp_async16(q_s + swz(i, c, kRowBytes), qb + i * a.sq_h + c * 8, true);
  }
  cp_async_commit();
}

// a gathered block's logits times the scale, -inf for its empty slots
__device__ __forceinline__ void masked_logits(const unsigned char* q_s, const unsigned char* tile,
                                              const unsigned char* const* rows, float scale, int warp, int lane,
                                              float (&sc)[4]) {
  const int t4 = lane & 3;
  logits(q_s, tile, warp, lane, sc);
  const bool ok0 = rows[warp * 8 + 2 * t4] != nullptr, ok1 = rows[warp * 8 + 2 * t4 + 1] != nullptr;
  sc[0] = ok0 ? sc[0] * scale : kNegInf;
  sc[1] = ok1 ? sc[1] * scale : kNegInf;
  sc[2] = ok0 ? sc[2] * scale : kNegInf;
  sc[3] = ok1 ? sc[3] * scale : kNegInf;
}

// each warp's maximum of sc per head -> red[warp][head]; then (after the barrier) every thread may read red
__device__ __forceinline__ void block_max_to_red(const float (&sc)[4], float (&red)[kWarps][kAttnHeads], int warp,
                                                 int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  float m0 = fmaxf(sc[0], sc[1]), m1 = fmaxf(sc[2], sc[3]);  // heads g, g + 8
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, o));
    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
  }
  if (t4 == 0) {
    red[warp][g] = m0;
    red[warp][g + 8] = m1;
  }
  __syncthreads();
}

__device__ __forceinline__ void zero_acc(float (&acc)[kCols / 8][4]) {
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
  }
}

// one step of the walk over a block with a valid slot, whose running maximum per head is s0 (head g), s1 (g + 8):
// p = exp(s - m), bf16(p) through shared memory to the P.V mma, Z and acc rescaled from the previous block's maximum
// (mr: -inf before the first, so the rescale is 0). Ends with a barrier: P, red and the tile may be rewritten after it
__device__ __forceinline__ void walk_block(float s0, float s1, const float (&sc)[4], unsigned char* p_s,
                                           const unsigned char* tile, float (&red)[kWarps][kAttnHeads], int warp,
                                           int lane, float& mr0, float& mr1, float& z0, float& z1,
                                           float (&acc)[kCols / 8][4]) {
  const int g = lane >> 2, t4 = lane & 3;
  const float al0 = expf(mr0 - s0), al1 = expf(mr1 - s1);  // 0 at the first block
  const float p0 = expf(sc[0] - s0), p1 = expf(sc[1] - s0);
  const float p2 = expf(sc[2] - s1), p3 = expf(sc[3] - s1);
  // the 16-byte chunk `warp` of P's rows g, g + 8 holds slots 8 warp ...
  *reinterpret_cast<uint32_t*>(p_s + swz(g, warp, kPRow) + 4 * t4) = bf16x2(p0, p1);
  *reinterpret_cast<uint32_t*>(p_s + swz(g + 8, warp, kPRow) + 4 * t4) = bf16x2(p2, p3);
  float ps0 = p0 + p1, ps1 = p2 + p3;
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    ps0 += __shfl_xor_sync(0xffffffffu, ps0, o);
    ps1 += __shfl_xor_sync(0xffffffffu, ps1, o);
  }
  if (t4 == 0) {
    red[warp][g] = ps0;
    red[warp][g + 8] = ps1;
  }
  __syncthreads();
  float zb0 = red[0][g], zb1 = red[0][g + 8];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    zb0 += red[w][g];
    zb1 += red[w][g + 8];
  }
  z0 = z0 * al0 + zb0;
  z1 = z1 * al1 + zb1;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    acc[n][0] *= al0;
    acc[n][1] *= al0;
    acc[n][2] *= al1;
    acc[n][3] *= al1;
  }
  pv(p_s, tile, warp, lane, acc);
  mr0 = s0;
  mr1 = s1;
  __syncthreads();
}

// RoPE pair i of query s rotated back to its position (rope_ref's inverse: the conjugate angle, fp32 products and
// sums, unfused), in place
__device__ __forceinline__ void rope_back(const AttnArgs& a, long long s, int i, float& x0, float& x1) {
  const float c = a.cos[s * a.rd2 + i], sn = -a.sin[s * a.rd2 + i];
  const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
  x1 = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
  x0 = y0;
}

// o of one head at columns d .. d + 3 from its combined partial v and Z: v / Z (IEEE division) rounded to bf16 once;
// in the last 2 rd2 dims the RoPE pairs rotated back to query s's position (rope_ref's inverse: fp32 products and
// sums, unfused), rounded again
__device__ __forceinline__ void store_out4(const AttnArgs& a, __nv_bfloat16* orow, long long s, int d, float4 v,
                                           float z) {
  float r[4] = {bf16_round(__fdiv_rn(v.x, z)), bf16_round(__fdiv_rn(v.y, z)), bf16_round(__fdiv_rn(v.z, z)),
                bf16_round(__fdiv_rn(v.w, z))};
  if (d >= kAttnD - 2 * a.rd2) {  // two RoPE pairs (rd2 even: a float4 never straddles the boundary)
    const int i = (d - (kAttnD - 2 * a.rd2)) >> 1;
    rope_back(a, s, i, r[0], r[1]);
    rope_back(a, s, i + 1, r[2], r[3]);
  }
  uint2 out;
  out.x = bf16x2(r[0], r[1]);
  out.y = bf16x2(r[2], r[3]);
  *reinterpret_cast<uint2*>(orow + d) = out;
}

template <int C, int NBL, bool PACKED>
__global__ void __launch_bounds__(kThreads, 1) sparse_attn_decode_kernel(const AttnArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* kv_s = smem + kQBytes;
  unsigned char* p_s = kv_s + NBL * kKvBytes;
  Small<C, NBL>& sm = *reinterpret_cast<Small<C, NBL>*>(p_s + kPBytes);
  float* part = reinterpret_cast<float*>(kv_s);  // the CTA's partial acc after its walk (block 0's rows are done)

  cg::cluster_group cluster = cg::this_cluster();
  const int r = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int h0 = blockIdx.y * kAttnHeads;
  const long long b = blockIdx.z / a.S, s = blockIdx.z % a.S;

  cluster_arrive_relaxed();  // this CTA runs: the others may store into its shared memory (after their wait below)
  griddep_wait();  // q, the lists and the rows all come from earlier kernels
  griddep_launch_dependents();

  load_q(a, b, s, h0, q_s, tid);  // this CTA's heads' q rows -> shared memory

  // the rows its blocks' slots name (null: -1, or past the list); bit j of `mine`: a slot of block j is valid
  int mine = 0;
  if (tid < NBL * kAttnBlock) {
    const int j = tid / kAttnBlock, i = tid % kAttnBlock;
    const unsigned char* row = slot_row(a, b, s, (r + j * C) * kAttnBlock + i);
    sm.rows[j][i] = row;
    mine = (row != nullptr) << j;
  }
  bool valid[NBL];
#pragma unroll
  for (int j = 0; j < NBL; ++j) valid[j] = __syncthreads_or(mine & (1 << j)) != 0;

  // gather every valid block's rows at once (one cp.async group per block)
#pragma unroll
  for (int j = 0; j < NBL; ++j) {
    if (valid[j]) gather_rows<PACKED>(kv_s + j * kKvBytes, sm.rows[j], tid, a.q);
    cp_async_commit();
  }

  cluster_wait();  // every CTA of the cluster runs

  // 1. logits and each block's maximum per head
  float sc[NBL][4];
#pragma unroll
  for (int j = 0; j < NBL; ++j) {
    cp_async_wait_n(NBL - 1 - j);  // q and block j have landed (this thread's copies) ...
    __syncthreads();               // ... and everyone's
    if constexpr (PACKED) {
      if (valid[j]) {
        unpack_block(kv_s + j * kKvBytes, tid);
        __syncthreads();
      }
    }
    if (valid[j]) {
      masked_logits(q_s, kv_s + j * kKvBytes, sm.rows[j], a.scale, warp, lane, sc[j]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[j][e] = kNegInf;
    }
    block_max_to_red(sc[j], sm.red, warp, lane);
    if (tid < kAttnHeads) {  // the block's maximum, pushed into every CTA of the cluster (stores: no round trip)
      float m = sm.red[0][tid];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m = fmaxf(m, sm.red[w][tid]);
#pragma unroll
      for (int rr = 0; rr < C; ++rr) cluster.map_shared_rank(&sm.allmax[0][0][0], rr)[(r * NBL + j) * kAttnHeads + tid] = m;
    }
  }

  // 2. the walk's running maximum at each of this CTA's blocks: the maximum over every block of the list up to it
  cluster.sync();  // every CTA's maxima are here
  if (tid < NBL * kAttnHeads) {
    const int j = tid / kAttnHeads, h = tid % kAttnHeads;
    const int gj = r + j * C;
    float m = kNegInf;
#pragma unroll
    for (int rr = 0; rr < C; ++rr) {
#pragma unroll
      for (int jj = 0; jj < NBL; ++jj) {
        if (rr + jj * C <= gj) m = fmaxf(m, sm.allmax[rr][jj][h]);
      }
    }
    sm.seed[j][h] = m;
  }
  __syncthreads();

  // 3. the walk over this CTA's blocks
  float acc[kCols / 8][4];
  zero_acc(acc);
  float mr0 = kNegInf, mr1 = kNegInf, z0 = 0.0f, z1 = 0.0f;
#pragma unroll
  for (int j = 0; j < NBL; ++j) {
    if (!valid[j]) continue;  // the same for the whole CTA
    // the seeds are finite: the block has a valid slot
    walk_block(sm.seed[j][g], sm.seed[j][g + 8], sc[j], p_s, kv_s + j * kKvBytes, sm.red, warp, lane, mr0, mr1, z0,
               z1, acc);
  }

  // 4. the partials (m, Z, acc) in shared memory, then combined across the cluster in rank order
  __syncthreads();
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    const int col = warp * kCols + n * 8 + 2 * t4;
    *reinterpret_cast<float2*>(part + g * kPartStride + col) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(part + (g + 8) * kPartStride + col) = make_float2(acc[n][2], acc[n][3]);
  }
  if (warp == 0 && t4 == 0) {  // (m, Z) pushed into every CTA of the cluster
#pragma unroll
    for (int rr = 0; rr < C; ++rr) {
      float* m = cluster.map_shared_rank(&sm.allm[r][0], rr);
      float* z = cluster.map_shared_rank(&sm.allz[r][0], rr);
      m[g] = mr0;
      m[g + 8] = mr1;
      z[g] = z0;
      z[g + 8] = z1;
    }
  }
  cluster.sync();  // every CTA's partial is complete, its (m, Z) here
  if (tid < kAttnHeads) {
    float mm = kNegInf;
#pragma unroll
    for (int rr = 0; rr < C; ++rr) mm = fmaxf(mm, sm.allm[rr][tid]);
    const float base = mm == kNegInf ? 0.0f : mm;  // no valid slot anywhere: o = 0
    float z = 0.0f;
#pragma unroll
    for (int rr = 0; rr < C; ++rr) {
      const float w = expf(sm.allm[rr][tid] - base);  // 0 for a CTA without a valid slot
      sm.w[rr][tid] = w;
      z += sm.allz[rr][tid] * w;
    }
    sm.zt[tid] = z + expf(a.sink[h0 + tid] - base);
  }
  __syncthreads();
  const float* parts[C];
#pragma unroll
  for (int rr = 0; rr < C; ++rr) parts[rr] = cluster.map_shared_rank(part, rr);
  __nv_bfloat16* ob = a.o + b * a.so_b + s * a.so_s + static_cast<long long>(h0) * a.so_h;
  constexpr int kOut = kAttnHeads * (kAttnD / 4);                 // float4 outputs of the CTA's heads
  constexpr int kUnits = (kOut + C * kThreads - 1) / (C * kThreads);  // per thread (C = 16: half the threads, one)
  float4 v[kUnits];
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {  // every remote load of this thread issued before the first use
    const int u = (k * C + r) * kThreads + tid;
    const int h = u / (kAttnD / 4), d = (u % (kAttnD / 4)) * 4;
    v[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (kOut % (C * kThreads) != 0 && u >= kOut) continue;
#pragma unroll
    for (int rr = 0; rr < C; ++rr) {
      const float4 pr = *reinterpret_cast<const float4*>(parts[rr] + h * kPartStride + d);
      const float w = sm.w[rr][h];
      v[k].x += pr.x * w;
      v[k].y += pr.y * w;
      v[k].z += pr.z * w;
      v[k].w += pr.w * w;
    }
  }
  // this CTA is done reading the others' partials (their values are in v): it says so before its stores and waits for
  // the others' word only before leaving (its shared memory must outlive their reads), the barrier under the stores.
  // (Relaxed: this relies on the remote loads' values being consumed, in v, before the arrive issues; see gemv.cu)
  cluster_arrive_relaxed();
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int u = (k * C + r) * kThreads + tid;
    const int h = u / (kAttnD / 4), d = (u % (kAttnD / 4)) * 4;
    if (kOut % (C * kThreads) != 0 && u >= kOut) continue;
    store_out4(a, ob + h * a.so_h, s, d, v[k], sm.zt[h]);
  }
  cluster_wait();
}

// ---- lists longer than kAttnMaxSlots: three launches over a grid of splits ----
// A (query, 16 heads) has nsplit CTAs, split i owning the list's blocks [i bps, (i + 1) bps): too many blocks for one
// cluster's shared memory, so the running maximum goes through global memory. attn_long_max_kernel: every block's
// maximum logit per head (bmax). attn_long_walk_kernel: the walk's running maximum at each of the split's blocks (the
// maximum of bmax over the list up to that block: every p and bf16(p) is the sequential walk's), the walk over them
// with the logits recomputed (the same code on the same rows: the same values), the split's partial (m, Z, acc) out.
// attn_long_combine_kernel: per (query, head) the splits' partials combined in split order, with the sink, as the
// cluster kernel's step 4. The rows stream through a ring of kLongBuf tiles per CTA (read twice: the second pass
// mostly from L2).
constexpr int kLongBuf = 3;
constexpr int kCombineThreads = kAttnD;  // four per float4 of the head's output (128 float4)

struct LongSmall {
  const unsigned char* rows[kAttnLongMaxBps][kAttnBlock];  // every slot's row of the split (null: none)
  float red[kWarps][kAttnHeads];
  float seed[kAttnLongMaxBps][kAttnHeads];  // the walk's running maximum at each of the split's blocks
  float part[16][kAttnHeads];               // maxima over the blocks before the split, 16 strided parts per head
  unsigned wvalid[kWarps];                  // per warp: bit k, a slot of block k it named is valid
};

constexpr int long_smem_bytes() { return kQBytes + kLongBuf * kKvBytes + kPBytes + static_cast<int>(sizeof(LongSmall)); }

// this CTA's split: its first block and block count
struct Split {
  int blk0, nb;
};

__device__ __forceinline__ Split my_split(const AttnArgs& a) {
  const int blk0 = blockIdx.x * a.bps;
  return {blk0, min(a.bps, a.nblk - blk0)};
}

// every slot of the split named at once (the list's indices in one round trip, not one per block) -> sm.rows; returns
// the blocks with a valid slot as bits (the same in every thread)
__device__ __forceinline__ unsigned split_rows(const AttnArgs& a, long long b, long long s, Split sp, LongSmall& sm,
                                               int tid) {
  unsigned mine = 0;
  const int n = sp.nb * kAttnBlock;
#pragma unroll 4
  for (int u = tid; u < n; u += kThreads) {
    const unsigned char* row = slot_row(a, b, s, sp.blk0 * kAttnBlock + u);
    sm.rows[u / kAttnBlock][u % kAttnBlock] = row;
    if (row != nullptr) mine |= 1u << (u / kAttnBlock);
  }
  mine = __reduce_or_sync(0xffffffffu, mine);
  if ((tid & 31) == 0) sm.wvalid[tid >> 5] = mine;
  __syncthreads();
  unsigned all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) all |= sm.wvalid[w];
  return all;
}

// block k of the split into ring slot k % kLongBuf, if it has a valid slot; one cp.async group (empty past the split)
template <bool PACKED>
__device__ __forceinline__ void issue_block(const AttnArgs& a, Split sp, unsigned valid, int k, unsigned char* kv_s,
                                            const LongSmall& sm, int tid) {
  if (k < sp.nb && ((valid >> k) & 1u)) gather_rows<PACKED>(kv_s + (k % kLongBuf) * kKvBytes, sm.rows[k], tid, a.q);
  cp_async_commit();
}

// the ring's k-th block has landed (every thread's copies) and, packed, is converted to bf16 rows
template <bool PACKED>
__device__ __forceinline__ void block_landed(unsigned char* tile, bool valid, int tid) {
  cp_async_wait<kLongBuf - 1>();
  __syncthreads();
  if constexpr (PACKED) {
    if (valid) {
      unpack_block(tile, tid);
      __syncthreads();
    }
  }
}

template <bool PACKED>
__global__ void __launch_bounds__(kThreads, 1) attn_long_max_kernel(const AttnArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* kv_s = smem + kQBytes;
  LongSmall& sm = *reinterpret_cast<LongSmall*>(kv_s + kLongBuf * kKvBytes + kPBytes);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long b = blockIdx.z / a.S, s = blockIdx.z % a.S;
  const Split sp = my_split(a);
  griddep_wait();  // q, the lists and the rows come from earlier kernels
  griddep_launch_dependents();
  load_q(a, b, s, blockIdx.y * kAttnHeads, q_s, tid);
  const unsigned valid = split_rows(a, b, s, sp, sm, tid);  // bit k: block k of the split has a valid slot
#pragma unroll
  for (int k = 0; k < kLongBuf; ++k) issue_block<PACKED>(a, sp, valid, k, kv_s, sm, tid);
  float* bm = a.bmax + ((static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y) * a.nblk + sp.blk0) * kAttnHeads;
  for (int k = 0; k < sp.nb; ++k) {
    const int slot = k % kLongBuf;
    unsigned char* tile = kv_s + slot * kKvBytes;
    const bool ok = (valid >> k) & 1u;
    block_landed<PACKED>(tile, ok, tid);
    float sc[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
    if (ok) masked_logits(q_s, tile, sm.rows[k], a.scale, warp, lane, sc);
    block_max_to_red(sc, sm.red, warp, lane);
    if (tid < kAttnHeads) {
      float m = sm.red[0][tid];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m = fmaxf(m, sm.red[w][tid]);
      bm[k * kAttnHeads + tid] = m;
    }
    __syncthreads();  // the tile and red are free
    issue_block<PACKED>(a, sp, valid, k + kLongBuf, kv_s, sm, tid);
  }
  cp_async_wait<0>();
}

template <bool PACKED>
__global__ void __launch_bounds__(kThreads, 1) attn_long_walk_kernel(const AttnArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* kv_s = smem + kQBytes;
  unsigned char* p_s = kv_s + kLongBuf * kKvBytes;
  LongSmall& sm = *reinterpret_cast<LongSmall*>(p_s + kPBytes);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const long long b = blockIdx.z / a.S, s = blockIdx.z % a.S;
  const long long qh = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;  // (query, head group)
  const Split sp = my_split(a);
  griddep_wait();  // the blocks' maxima
  griddep_launch_dependents();
  load_q(a, b, s, blockIdx.y * kAttnHeads, q_s, tid);
  const unsigned valid = split_rows(a, b, s, sp, sm, tid);
#pragma unroll
  for (int k = 0; k < kLongBuf; ++k) issue_block<PACKED>(a, sp, valid, k, kv_s, sm, tid);

  // the running maximum at each of the split's blocks: the maximum over every block of the list up to it
  // (every load issued before any is used: the blocks before the split in 16 strided parts per head, the split's own
  // blocks' maxima into seed; then the prefix over them)
  const float* bm = a.bmax + qh * a.nblk * kAttnHeads;
  {
    const int h = tid & (kAttnHeads - 1), part = tid / kAttnHeads;
    float m = kNegInf;
#pragma unroll 8
    for (int k = part; k < sp.blk0; k += kThreads / kAttnHeads) m = fmaxf(m, bm[k * kAttnHeads + h]);
    sm.part[part][h] = m;
    for (int i = tid; i < sp.nb * kAttnHeads; i += kThreads) sm.seed[i / kAttnHeads][i % kAttnHeads] = bm[sp.blk0 * kAttnHeads + i];
  }
  __syncthreads();
  if (tid < kAttnHeads) {
    float m = kNegInf;
#pragma unroll
    for (int p = 0; p < kThreads / kAttnHeads; ++p) m = fmaxf(m, sm.part[p][tid]);
    for (int k = 0; k < sp.nb; ++k) {
      m = fmaxf(m, sm.seed[k][tid]);
      sm.seed[k][tid] = m;
    }
  }
  // (published by the first block's barrier)

  float acc[kCols / 8][4];
  zero_acc(acc);
  float mr0 = kNegInf, mr1 = kNegInf, z0 = 0.0f, z1 = 0.0f;
  for (int k = 0; k < sp.nb; ++k) {
    const int slot = k % kLongBuf;
    unsigned char* tile = kv_s + slot * kKvBytes;
    const bool ok = (valid >> k) & 1u;
    block_landed<PACKED>(tile, ok, tid);
    if (ok) {  // the same for the whole CTA; the seeds are finite
      float sc[4];
      masked_logits(q_s, tile, sm.rows[k], a.scale, warp, lane, sc);
      walk_block(sm.seed[k][g], sm.seed[k][g + 8], sc, p_s, tile, sm.red, warp, lane, mr0, mr1, z0, z1, acc);
    } else {
      __syncthreads();  // every thread is past block_landed: the slot's tile may be refilled
    }
    issue_block<PACKED>(a, sp, valid, k + kLongBuf, kv_s, sm, tid);
  }
  cp_async_wait<0>();

  // the split's partial: acc [16, 512], (m, Z) [16]
  const long long pi = qh * a.nsplit + blockIdx.x;
  float* pa = a.pacc + pi * kAttnHeads * kAttnD;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    const int col = warp * kCols + n * 8 + 2 * t4;
    *reinterpret_cast<float2*>(pa + g * kAttnD + col) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(pa + (g + 8) * kAttnD + col) = make_float2(acc[n][2], acc[n][3]);
  }
  if (warp == 0 && t4 == 0) {
    a.pm[pi * kAttnHeads + g] = mr0;
    a.pm[pi * kAttnHeads + g + 8] = mr1;
    a.pz[pi * kAttnHeads + g] = z0;
    a.pz[pi * kAttnHeads + g + 8] = z1;
  }
}

// grid (H, queries): head h of a query, the splits' partials combined (the cluster kernel's step 4). Thread t sums
// float4 t % 128 of the head's row over a quarter of the splits (t / 128) in split order, then the quarters are added
// in order: a fixed order. A thread's first kCombineRegs partials are loaded before the weights are known
constexpr int kCombineRegs = 16;

__global__ void __launch_bounds__(kCombineThreads) attn_long_combine_kernel(const AttnArgs a) {
  __shared__ float w[kAttnLongMaxSplits];
  __shared__ float zs[kAttnLongMaxSplits];
  __shared__ float zt;
  __shared__ float4 quarter[3][kAttnD / 4];
  const int tid = threadIdx.x, h = blockIdx.x, hg = h / kAttnHeads, hh = h % kAttnHeads;
  const long long b = blockIdx.y / a.S, s = blockIdx.y % a.S;
  const long long p0 = (static_cast<long long>(blockIdx.y) * (gridDim.x / kAttnHeads) + hg) * a.nsplit;
  const int c = tid % (kAttnD / 4), qr = tid / (kAttnD / 4), d = c * 4;
  const int per = (a.nsplit + 3) / 4, i0 = min(a.nsplit, qr * per), i1 = min(a.nsplit, i0 + per);
  const float* pa = a.pacc + (p0 * kAttnHeads + hh) * kAttnD + d;
  constexpr long long kStride = static_cast<long long>(kAttnHeads) * kAttnD;  // one split's partial
  griddep_wait();  // the partials
  griddep_launch_dependents();
  float4 pr[kCombineRegs];
#pragma unroll
  for (int j = 0; j < kCombineRegs; ++j) {
    pr[j] = i0 + j < i1 ? *reinterpret_cast<const float4*>(pa + (i0 + j) * kStride) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (tid < 32) {
    float mm = kNegInf;
    for (int i = tid; i < a.nsplit; i += 32) mm = fmaxf(mm, a.pm[(p0 + i) * kAttnHeads + hh]);
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o));
    const float base = mm == kNegInf ? 0.0f : mm;  // no valid slot anywhere: o = 0
    for (int i = tid; i < a.nsplit; i += 32) {
      w[i] = expf(a.pm[(p0 + i) * kAttnHeads + hh] - base);  // 0 for a split without a valid slot
      zs[i] = a.pz[(p0 + i) * kAttnHeads + hh];
    }
    __syncwarp();
    if (tid == 0) {
      float z = 0.0f;
      for (int i = 0; i < a.nsplit; ++i) z += zs[i] * w[i];
      zt = z + expf(a.sink[h] - base);
    }
  }
  __syncthreads();
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int j = 0; j < kCombineRegs; ++j) {
    if (i0 + j < i1) {
      const float wi = w[i0 + j];
      v.x += pr[j].x * wi;
      v.y += pr[j].y * wi;
      v.z += pr[j].z * wi;
      v.w += pr[j].w * wi;
    }
  }
  for (int i = i0 + kCombineRegs; i < i1; ++i) {  // more than 4 x 16 splits
    const float4 p = *reinterpret_cast<const float4*>(pa + i * kStride);
    const float wi = w[i];
    v.x += p.x * wi;
    v.y += p.y * wi;
    v.z += p.z * wi;
    v.w += p.w * wi;
  }
  if (qr > 0) quarter[qr - 1][c] = v;
  __syncthreads();
  if (qr == 0) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const float4 u = quarter[k][c];
      v = make_float4(v.x + u.x, v.y + u.y, v.z + u.z, v.w + u.w);
    }
    store_out4(a, a.o + b * a.so_b + s * a.so_s + static_cast<long long>(h) * a.so_h, s, d, v, zt);
  }
}

template <bool PACKED>
cudaError_t launch_long(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream) {
  constexpr int smem = long_smem_bytes();
  auto k1 = attn_long_max_kernel<PACKED>;
  auto k2 = attn_long_walk_kernel<PACKED>;
  cudaError_t e = cudaFuncSetAttribute(k1, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const dim3 grid(a.nsplit, head_groups, queries);
  if (e == cudaSuccess) e = launch_pdl(k1, grid, dim3(kThreads), smem, pdl, stream, a);
  if (e == cudaSuccess) e = launch_pdl(k2, grid, dim3(kThreads), smem, pdl, stream, a);
  if (e == cudaSuccess) {
    e = launch_pdl(attn_long_combine_kernel, dim3(head_groups * kAttnHeads, queries), dim3(kCombineThreads), 0, pdl,
                   stream, a);
  }
  return e;
}

template <int C, int NBL, bool PACKED>
cudaError_t launch(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream) {
  auto kernel = sparse_attn_decode_kernel<C, NBL, PACKED>;
  constexpr int smem = smem_bytes<C, NBL>();
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  return launch_ex(kernel, dim3(C, head_groups, queries), dim3(kThreads), smem, pdl, C, stream, a);
}

// how many clusters of C = 16 CTAs (NBL blocks each) the device holds at once: 0 when it cannot run them (a
// non-portable cluster size; asked once per configuration and device)
template <int NBL, bool PACKED>
int wide_clusters() {
  static int cached[64];
  static bool asked[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (!asked[dev]) {
    constexpr int smem = smem_bytes<16, NBL>();
    cached[dev] = max_active_clusters(sparse_attn_decode_kernel<16, NBL, PACKED>, 16, kThreads, smem, smem);
    asked[dev] = true;
  }
  return cached[dev];
}

template <int C_, int NBL_>
struct Config {
  static constexpr int C = C_, NBL = NBL_;
};

// f(Config<C, NBL>{}) for a list of 1..kAttnMaxSlots slots: C the list's blocks rounded up to a power of two, at
// most 8 (a CTA past the list only joins the combine); then up to 3 blocks per CTA. With `wide` (the device holds
// every (query, head group)'s cluster of 16 at once), 9-24 blocks take clusters of 16 CTAs, 1-2 blocks each: fewer
// blocks one after another in each CTA
template <typename F>
auto with_config(int slots, bool wide, F&& f) -> decltype(f(Config<1, 1>{})) {
  const int nblk = (slots + kAttnBlock - 1) / kAttnBlock;
  if (nblk <= 1) return f(Config<1, 1>{});
  if (nblk <= 2) return f(Config<2, 1>{});
  if (nblk <= 4) return f(Config<4, 1>{});
  if (nblk <= 8) return f(Config<8, 1>{});
  if (wide && nblk <= 16) return f(Config<16, 1>{});
  if (wide) return f(Config<16, 2>{});
  if (nblk <= 16) return f(Config<8, 2>{});
  return f(Config<8, 3>{});
}

// clusters of 16 for a list of `slots` (9-24 blocks) when allowed and the device holds all queries x head_groups of them
bool use_wide(int slots, int queries, int head_groups, bool packed, bool allowed) {
  const int nblk = (slots + kAttnBlock - 1) / kAttnBlock;
  if (!allowed || nblk <= 8 || slots > kAttnMaxSlots) return false;
  const int held = nblk <= 16 ? (packed ? wide_clusters<1, true>() : wide_clusters<1, false>())
                              : (packed ? wide_clusters<2, true>() : wide_clusters<2, false>());
  return held >= queries * head_groups;
}


// ---- prefill chunks: one CTA per (query, 64 heads), wgmma ----
// A prefill chunk has many queries (up to 128), each with its own list: a CTA takes one query and 64 heads, the M of
// a wgmma, and walks the query's blocks one after another in the list's order, the reference's sequential walk (only
// the fp32 sums of q.k, of p and of P.V run in another order). Two warpgroups: for a block, warpgroup w computes the
// logits of slots 32 w .. 32 w + 31 for all 64 heads (S = q K^T, 32 m64n32k16 over the 512 dims), the block's maximum
// and sum of p per head go through shared memory, bf16(p) [64 heads x 64 slots] into shared memory, and warpgroup w
// then adds P.V for output columns 256 w .. 256 w + 255 (4 m64n256k16 over the 64 slots) into its 128 fp32
// accumulators per thread (rescaled only where the running maximum moved: a factor of 1 changes nothing). Operands in
// shared memory as wgmma's 128-byte-swizzled atoms: q and a block's rows as [8 segments of 64 dims][64 rows][128 bytes]
// (K-major for q K^T; the same tile is P.V's MN-major B: K = V), bf16(p) as [64 heads][64 slots]. The rows of block
// j + 1 are gathered with cp.async while block j is computed, into the other of two tiles (blocks 0 and 1 both before
// the first), and the list's indices of block j + 2 are loaded meanwhile; a block without a valid slot is neither
// gathered nor computed (the walk leaves m, Z and acc unchanged over it). Packed FP8 rows are gathered to the front of
// their tile and converted in place. The epilogue is the decode kernel's: Z += e^(sink - m), o = acc / Z (IEEE
// division) rounded once, the RoPE dims rotated back.
constexpr int kPfThreads = 256;                          // two warpgroups
constexpr int kAtomRow = 128;                            // bytes of a swizzle atom's row: 64 bf16
constexpr int kSegBytes = kAttnBlock * kAtomRow;         // 8 KB: one 64-dim segment of 64 rows
constexpr int kPfQBytes = kAttnPrefillHeads * kRowBytes;  // 64 KB of q
constexpr int kPfTileBytes = kAttnBlock * kRowBytes;     // 64 KB: a block's rows
constexpr int kPfPBytes = kAttnPrefillHeads * kAtomRow;  // 8 KB of bf16(p)
static_assert(kPfThreads == kThreads, "the packed gather (gather_rows<true>) is shared with the decode kernel");
static_assert(kAttnPrefillHeads == 64 && kAttnBlock == 64, "one wgmma M of heads, one atom row of slots");

struct PfSmall {
  const unsigned char* rows[2][kAttnBlock];  // each slot's row for the two tiles' blocks (null: none)
  unsigned valid[2][2];                      // and their valid slots as bits (slots 0-31, 32-63)
  float red[2][2][kAttnPrefillHeads];        // [maximum | sum of p][warpgroup][head]
};

constexpr int kPfSmem = 1024 + kPfQBytes + 2 * kPfTileBytes + kPfPBytes + static_cast<int>(sizeof(PfSmall));

// byte offset of 16-byte chunk c (0..63) of row i (0..63) in a [8][64][128] tile: the atoms' own 128-byte swizzle
__device__ __forceinline__ int atom_off(int i, int c) {
  return (c >> 3) * kSegBytes + i * kAtomRow + (((c & 7) ^ (i & 7)) << 4);
}

// d[16] (+)= A[64 x k16] B[32 x k16]^T, bf16, both K-major in shared memory, fp32 accumulators (d = A B when
// !accumulate). Thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 + {0, 8}: d[4j + {0, 1}] at columns
// 8j + 2 (t % 4) + {0, 1} of the first row, d[4j + {2, 3}] of the second
__device__ __forceinline__ void wgmma_m64n32k16_bf16(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : DSV4_ACC8(0), DSV4_ACC8(8)
      : "l"(da), "l"(db), "r"(accumulate));
}

// d[128] += A[64 x k16] (K-major) B[k16 x 256] (MN-major: transposed), bf16 in shared memory; d's layout as above,
// j < 32
__device__ __forceinline__ void wgmma_m64n256k16_bf16_tb(float (&d)[128], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 1;\n}\n"
      : DSV4_ACC8(0), DSV4_ACC8(8), DSV4_ACC8(16), DSV4_ACC8(24), DSV4_ACC8(32), DSV4_ACC8(40),
        DSV4_ACC8(48), DSV4_ACC8(56), DSV4_ACC8(64), DSV4_ACC8(72), DSV4_ACC8(80), DSV4_ACC8(88),
        DSV4_ACC8(96), DSV4_ACC8(104), DSV4_ACC8(112), DSV4_ACC8(120)
      : "l"(da), "l"(db), "r"(1));
}

// a block's bf16 rows -> its tile's atoms, one cp.async per 16 bytes (empty slots zero-filled; `fill` itself is never
// read): thread t copies chunk t % 64 of rows t / 64, t / 64 + 4, ...
__device__ __forceinline__ void pf_gather(unsigned char* tile, const unsigned char* const* rows, int tid,
                                          const void* fill) {
  const int c = tid & (kChunks - 1), i0 = tid / kChunks;
#pragma unroll 4
  for (int i = i0; i < kAttnBlock; i += kPfThreads / kChunks) {
    const unsigned char* row = rows[i];
    cp_async16(tile + atom_off(i, c), row != nullptr ? row + c * 16 : fill, row != nullptr);
  }
}

// packed rows gathered to the front of the tile (kAttnPackedBytes apart, 37,888 bytes: segments 0-4) -> the tile's
// bf16 atoms, in place: the chunks of segments 5-7 (dims 320-511) land past the packed rows and are written as they are
// read; those of segments 0-4 are all read before the barrier and written after it
__device__ __forceinline__ void pf_unpack(unsigned char* tile, int tid) {
  constexpr int kCodeChunks = kAttnNope / 8;  // 56: the rest are RoPE chunks
  constexpr int kLow = 40;                    // chunks in segments 0-4
  static_assert(kAttnBlock * kAttnPackedBytes <= (kLow / 8) * kSegBytes, "the packed rows end in segment 4");
  constexpr int kHighItems = kAttnBlock * (kChunks - kLow) / kPfThreads;  // 6
  constexpr int kLowItems = kAttnBlock * kLow / kPfThreads;               // 10
#pragma unroll
  for (int k = 0; k < kHighItems; ++k) {
    const int u = k * kPfThreads + tid, i = u / (kChunks - kLow), c = kLow + u % (kChunks - kLow);
    const unsigned char* row = tile + i * kAttnPackedBytes;
    uint4 out;
    if (c < kCodeChunks) {
      const uint2 codes = *reinterpret_cast<const uint2*>(row + c * 8);
      out = codes_bf16(codes.x, codes.y, row[kAttnNope + 128 + c / 8]);
    } else {
      out = *reinterpret_cast<const uint4*>(row + kAttnNope + (c - kCodeChunks) * 16);
    }
    *reinterpret_cast<uint4*>(tile + atom_off(i, c)) = out;
  }
  uint2 codes[kLowItems];
  uint32_t scales[kLowItems];
#pragma unroll
  for (int k = 0; k < kLowItems; ++k) {
    const int u = k * kPfThreads + tid, i = u / kLow, c = u % kLow;
    const unsigned char* row = tile + i * kAttnPackedBytes;
    codes[k] = *reinterpret_cast<const uint2*>(row + c * 8);
    scales[k] = row[kAttnNope + 128 + c / 8];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kLowItems; ++k) {
    const int u = k * kPfThreads + tid, i = u / kLow, c = u % kLow;
    *reinterpret_cast<uint4*>(tile + atom_off(i, c)) = codes_bf16(codes[k].x, codes[k].y, scales[k]);
  }
}

// block j's rows (threads 0-63 hold one slot's row each: row) -> rows, their valid slots as bits -> valid; true when
// one is valid (the same in every thread: a barrier)
__device__ __forceinline__ bool pf_publish(const unsigned char* row, const unsigned char** rows, unsigned* valid,
                                           int tid) {
  if (tid < kAttnBlock) {
    rows[tid] = row;
    const unsigned bits = __ballot_sync(0xffffffffu, row != nullptr);
    if ((tid & 31) == 0) valid[tid >> 5] = bits;
  }
  return __syncthreads_or(row != nullptr) != 0;
}

template <bool PACKED>
__device__ __forceinline__ void pf_issue(unsigned char* tile, const unsigned char* const* rows, int tid,
                                         const void* fill) {
  if constexpr (PACKED) {
    gather_rows<true>(tile, rows, tid, fill);
  } else {
    pf_gather(tile, rows, tid, fill);
  }
}

template <bool PACKED>
__global__ void __launch_bounds__(kPfThreads, 1) sparse_attn_prefill_kernel(const AttnArgs a) {
  extern __shared__ unsigned char smem_raw[];
  // the swizzle atoms must be 1024-byte aligned
  unsigned char* q_s = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* tiles = q_s + kPfQBytes;
  unsigned char* p_s = tiles + 2 * kPfTileBytes;
  PfSmall& sm = *reinterpret_cast<PfSmall*>(p_s + kPfPBytes);

  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
  const int r0 = 16 * ((tid >> 5) & 3) + (lane >> 2), r1 = r0 + 8;  // this thread's rows (heads) of S and of o
  const int cq = 2 * (lane & 3);                                      // its first column in each 8-column group
  const int h0 = blockIdx.x * kAttnPrefillHeads;
  const long long b = blockIdx.y / a.S, s = blockIdx.y % a.S;
  const int nblk = (a.Lw + a.Lc + kAttnBlock - 1) / kAttnBlock;
  // wgmma descriptors: q, bf16(p) (K-major); a k-step of 16 adds 32 bytes (2 in the address field) inside an atom
  const uint64_t dq = dev::desc_sw128(smem_u32(q_s)), dp = dev::desc_sw128(smem_u32(p_s));

  griddep_wait();  // q, the lists and the rows all come from earlier kernels
  griddep_launch_dependents();

  {  // the 64 heads' q rows -> q_s
    const __nv_bfloat16* qb = a.q + b * a.sq_b + s * a.sq_s + static_cast<long long>(h0) * a.sq_h;
    const int c = tid & (kChunks - 1);
#pragma unroll 4
    for (int i = tid / kChunks; i < kAttnPrefillHeads; i += kPfThreads / kChunks) {
      cp_async16(q_s + atom_off(i, c), qb + i * a.sq_h + c * 8, true);
    }
  }
  // blocks 0 and 1 gathered (two cp.async groups, q in the first); block 2's indices in flight (nxt: threads 0-63)
  const unsigned char* nxt = tid < kAttnBlock ? slot_row(a, b, s, tid) : nullptr;
  bool vj = pf_publish(nxt, sm.rows[0], sm.valid[0], tid);  // block j has a valid slot
  if (vj) pf_issue<PACKED>(tiles, sm.rows[0], tid, a.q);
  cp_async_commit();
  nxt = tid < kAttnBlock ? slot_row(a, b, s, kAttnBlock + tid) : nullptr;
  bool vn = pf_publish(nxt, sm.rows[1], sm.valid[1], tid);  // and block j + 1
  if (vn) pf_issue<PACKED>(tiles + kPfTileBytes, sm.rows[1], tid, a.q);
  cp_async_commit();
  nxt = tid < kAttnBlock ? slot_row(a, b, s, 2 * kAttnBlock + tid) : nullptr;

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  float m0 = kNegInf, m1 = kNegInf, z0 = 0.0f, z1 = 0.0f;  // the walk's running maximum and Z of rows r0, r1

  for (int j = 0; j < nblk; ++j) {
    const int buf = j & 1;
    unsigned char* tile = tiles + buf * kPfTileBytes;
    if (j == 0) {  // block 1 is in flight already
      cp_async_wait<1>();   // block 0's rows and q have landed (this thread's copies) ...
      fence_proxy_async();  // ... visible to wgmma; after the barrier, everyone's
      __syncthreads();
    } else {
      cp_async_wait<0>();   // block j's rows have landed (this thread's copies) ...
      fence_proxy_async();  // ... visible to wgmma; after the barrier, everyone's. Past it every thread is done with
                            // block j - 1: its tile, rows and bits may be rewritten with block j + 1's
      vn = pf_publish(nxt, sm.rows[buf ^ 1], sm.valid[buf ^ 1], tid);
      if (vn) pf_issue<PACKED>(tiles + (buf ^ 1) * kPfTileBytes, sm.rows[buf ^ 1], tid, a.q);
      cp_async_commit();
      nxt = tid < kAttnBlock ? slot_row(a, b, s, (j + 2) * kAttnBlock + tid) : nullptr;  // block j + 2's, in flight
    }
    if (vj) {  // the same for the whole CTA
      if constexpr (PACKED) {
        pf_unpack(tile, tid);
        fence_proxy_async();
        __syncthreads();
      }
      const uint32_t ta = smem_u32(tile);
      // S = q K^T for this warpgroup's 32 slots: 32 k-steps of 16 dims (32 bytes inside a segment's atoms)
      const uint64_t dk = dev::desc_sw128(ta + wg * 32 * kAtomRow);
      float sc[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) sc[i] = 0.0f;
      fence_acc(sc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kAttnD / 16; ++k) {
        const uint64_t off = ((k >> 2) * kSegBytes + (k & 3) * 32) >> 4;
        wgmma_m64n32k16_bf16(sc, dq + off, dk + off, k);
      }
      wgmma_commit();
      wgmma_wait0();
      fence_acc(sc);

      // scale and mask; the block's maximum per head over both warpgroups
      const unsigned bits = sm.valid[buf][wg];  // this warpgroup's 32 slots
      float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = 8 * i + cq;  // within the warpgroup's slots
        const bool ok0 = (bits >> col) & 1u, ok1 = (bits >> (col + 1)) & 1u;
        sc[4 * i] = ok0 ? sc[4 * i] * a.scale : kNegInf;
        sc[4 * i + 1] = ok1 ? sc[4 * i + 1] * a.scale : kNegInf;
        sc[4 * i + 2] = ok0 ? sc[4 * i + 2] * a.scale : kNegInf;
        sc[4 * i + 3] = ok1 ? sc[4 * i + 3] * a.scale : kNegInf;
        mx0 = fmaxf(mx0, fmaxf(sc[4 * i], sc[4 * i + 1]));
        mx1 = fmaxf(mx1, fmaxf(sc[4 * i + 2], sc[4 * i + 3]));
      }
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
      }
      if ((lane & 3) == 0) {
        sm.red[0][wg][r0] = mx0;
        sm.red[0][wg][r1] = mx1;
      }
      __syncthreads();
      // the running maximum (finite: the block has a valid slot), p = exp(s - m) (fp32), bf16(p) into P
      const float n0 = fmaxf(m0, fmaxf(sm.red[0][0][r0], sm.red[0][1][r0]));
      const float n1 = fmaxf(m1, fmaxf(sm.red[0][0][r1], sm.red[0][1][r1]));
      const float al0 = expf(m0 - n0), al1 = expf(m1 - n1);  // 0 at the first block
      float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = 32 * wg + 8 * i + cq;
        const float p0 = expf(sc[4 * i] - n0), p1 = expf(sc[4 * i + 1] - n0);
        const float p2 = expf(sc[4 * i + 2] - n1), p3 = expf(sc[4 * i + 3] - n1);
        ps0 += p0 + p1;
        ps1 += p2 + p3;
        const int cb = (col & 7) * 2;
        *reinterpret_cast<uint32_t*>(p_s + r0 * kAtomRow + (((col >> 3) ^ (r0 & 7)) << 4) + cb) = bf16x2(p0, p1);
        *reinterpret_cast<uint32_t*>(p_s + r1 * kAtomRow + (((col >> 3) ^ (r1 & 7)) << 4) + cb) = bf16x2(p2, p3);
      }
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        ps0 += __shfl_xor_sync(0xffffffffu, ps0, o);
        ps1 += __shfl_xor_sync(0xffffffffu, ps1, o);
      }
      if ((lane & 3) == 0) {
        sm.red[1][wg][r0] = ps0;
        sm.red[1][wg][r1] = ps1;
      }
      fence_proxy_async();  // P visible to wgmma, after the barrier everyone's
      __syncthreads();
      z0 = z0 * al0 + (sm.red[1][0][r0] + sm.red[1][1][r0]);
      z1 = z1 * al1 + (sm.red[1][0][r1] + sm.red[1][1][r1]);
      m0 = n0;
      m1 = n1;
      if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {  // (a factor of 1 leaves acc as it is)
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          acc[4 * i] *= al0;
          acc[4 * i + 1] *= al0;
          acc[4 * i + 2] *= al1;
          acc[4 * i + 3] *= al1;
        }
      }
      fence_acc(acc);  // the rescaled values in their registers before the fence
      // acc += P V for this warpgroup's 256 columns: 4 k-steps of 16 slots (two 8-slot atom rows each, 1024 bytes
      // apart), the 4 column segments 8 KB apart
      const uint64_t dv = dev::desc_sw128_ex(ta + 4 * wg * kSegBytes, kSegBytes, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kAttnBlock / 16; ++k) wgmma_m64n256k16_bf16_tb(acc, dp + 2 * k, dv + 128 * k);
      wgmma_commit();
      wgmma_wait0();
      fence_acc(acc);
    }
    vj = vn;
  }
  cp_async_wait<0>();

  // o = acc / (Z + e^(sink - m)), rounded once, RoPE dims rotated back
  const float base0 = m0 == kNegInf ? 0.0f : m0, base1 = m1 == kNegInf ? 0.0f : m1;  // no valid slot: o = 0
  const float zt0 = z0 + expf(a.sink[h0 + r0] - base0), zt1 = z1 + expf(a.sink[h0 + r1] - base1);
  __nv_bfloat16* o0 = a.o + b * a.so_b + s * a.so_s + static_cast<long long>(h0 + r0) * a.so_h;
  __nv_bfloat16* o1 = a.o + b * a.so_b + s * a.so_s + static_cast<long long>(h0 + r1) * a.so_h;
  const int rope0 = kAttnD - 2 * a.rd2;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = 256 * wg + 8 * j + cq;
    float v[4] = {bf16_round(__fdiv_rn(acc[4 * j], zt0)), bf16_round(__fdiv_rn(acc[4 * j + 1], zt0)),
                  bf16_round(__fdiv_rn(acc[4 * j + 2], zt1)), bf16_round(__fdiv_rn(acc[4 * j + 3], zt1))};
    if (col >= rope0) {  // one RoPE pair in each of the two rows
      const int i = (col - rope0) >> 1;
      rope_back(a, s, i, v[0], v[1]);
      rope_back(a, s, i, v[2], v[3]);
    }
    *reinterpret_cast<uint32_t*>(o0 + col) = bf16x2(v[0], v[1]);
    *reinterpret_cast<uint32_t*>(o1 + col) = bf16x2(v[2], v[3]);
  }
}

}  // namespace

int sparse_attn_decode_cluster(int slots, int queries, int head_groups, bool packed, int max_cluster) {
  if (slots < 1 || slots > kAttnLongMaxSlots || queries < 1 || head_groups < 1) return -1;
  if (slots > kAttnMaxSlots) return 0;
  const bool wide = use_wide(slots, queries, head_groups, packed, max_cluster == 16);
  return with_config(slots, wide, [](auto cfg) { return decltype(cfg)::C; });
}

AttnLongPlan sparse_attn_long_plan(int slots, int queries, int head_groups, int sms) {
  AttnLongPlan p{};
  p.nblk = (slots + kAttnBlock - 1) / kAttnBlock;
  // about one CTA per SM over every (query, head group), within the splits' and the seeds' bounds. The fp32 sums follow
  // the splits, so a query's low bits may differ between calls of another query count or on a GPU of another SM count
  // (the same call gives the same bits)
  const long long work = static_cast<long long>(p.nblk) * queries * head_groups;
  int bps = static_cast<int>((work + sms - 1) / (sms > 0 ? sms : 1));
  bps = max(bps, (p.nblk + kAttnLongMaxSplits - 1) / kAttnLongMaxSplits);
  p.bps = min(max(bps, 1), kAttnLongMaxBps);
  p.nsplit = (p.nblk + p.bps - 1) / p.bps;
  return p;
}

cudaError_t sparse_attn_decode_launch(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream) {
  const int L = a.Lw + a.Lc;
  if (L < 1 || L > kAttnLongMaxSlots || queries < 1 || head_groups < 1) return cudaErrorInvalidValue;
  if (L > kAttnMaxSlots) {
    if (a.bmax == nullptr || a.pm == nullptr || a.pz == nullptr || a.pacc == nullptr || a.bps < 1 ||
        a.bps > kAttnLongMaxBps || a.nsplit < 1 || a.nsplit > kAttnLongMaxSplits ||
        a.nblk != (L + kAttnBlock - 1) / kAttnBlock || static_cast<long long>(a.nsplit) * a.bps < a.nblk ||
        static_cast<long long>(a.nsplit - 1) * a.bps >= a.nblk) {  // every split has a block
      return cudaErrorInvalidValue;
    }
    return a.packed ? launch_long<true>(a, queries, head_groups, pdl, stream)
                    : launch_long<false>(a, queries, head_groups, pdl, stream);
  }
  const bool wide = use_wide(L, queries, head_groups, a.packed != 0, a.wide != 0);
  return with_config(L, wide, [&](auto cfg) {
    using K = decltype(cfg);
    return a.packed ? launch<K::C, K::NBL, true>(a, queries, head_groups, pdl, stream)
                    : launch<K::C, K::NBL, false>(a, queries, head_groups, pdl, stream);
  });
}

int sparse_attn_decode_smem(int slots) {
  if (slots < 1 || slots > kAttnLongMaxSlots) return -1;
  if (slots > kAttnMaxSlots) return long_smem_bytes();
  return with_config(slots, false, [](auto cfg) {  // the 8-wide configurations take the most
    using K = decltype(cfg);
    return smem_bytes<K::C, K::NBL>();
  });
}

int sparse_attn_prefill_smem() { return kPfSmem; }

cudaError_t sparse_attn_prefill_launch(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream) {
  const int L = a.Lw + a.Lc;
  if (L < 1 || L > kAttnLongMaxSlots || queries < 1 || queries > 65535 || head_groups < 1) return cudaErrorInvalidValue;
  auto kernel = a.packed ? sparse_attn_prefill_kernel<true> : sparse_attn_prefill_kernel<false>;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPfSmem);
  if (e != cudaSuccess) return e;
  return launch_pdl(kernel, dim3(head_groups, queries), dim3(kPfThreads), kPfSmem, pdl, stream, a);
}

}  // namespace dsv4
