// Sparse MQA attention with a per-head sink for decode (1-8 queries), SPEC §2.3.5, in one launch.
//
// One K = V row of 512 bf16 per slot; each query's index list (window part, then compressed part; -1 = none) is cut
// into blocks of 64 slots, and DeepSeek's online softmax walks them in order: m_new = max(m, max s), p = exp(s - m_new),
// Z = Z e^(m - m_new) + sum p, acc = acc e^(m - m_new) + bf16(p).V (fp32 sums), then Z += e^(sink - m), o = acc / Z.
//
// Work split: a thread-block cluster of C = 1, 2, 4 or 8 CTAs (8 warps each) per (query, 16 heads); CTA r takes the
// list's blocks r, r + C, r + 2C, ... (at most 3), gathers their rows into shared memory (cp.async, 16-byte chunks
// swizzled by row) and:
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
using dev::mma_bf16;

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
    if (c < kCodeChunks) {
      const float sc = __uint_as_float(v[k].z << 23);  // 2^(byte - 127)
      uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const uint32_t word = w ? v[k].y : v[k].x;
        const uint32_t lw = dev::e4m3_lo_f16x2(word), hw = dev::e4m3_hi_f16x2(word);
        const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&lw));
        const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&hw));
        o[2 * w] = bf16x2(lo.x * sc, lo.y * sc);
        o[2 * w + 1] = bf16x2(hi.x * sc, hi.y * sc);
      }
    }
    *reinterpret_cast<uint4*>(tile + swz(i0 + k * (kThreads / kChunks), c, kRowBytes)) = out;
  }
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
  const int L = a.Lw + a.Lc;

  cluster_arrive_relaxed();  // this CTA runs: the others may store into its shared memory (after their wait below)
  griddep_wait();  // q, the lists and the rows all come from earlier kernels
  griddep_launch_dependents();

  // this CTA's heads' q rows -> shared memory
  const __nv_bfloat16* qb = a.q + b * a.sq_b + s * a.sq_s + static_cast<long long>(h0) * a.sq_h;
#pragma unroll
  for (int k = 0; k < kAttnHeads * kChunks / kThreads; ++k) {
    const int i = k * (kThreads / kChunks) + (tid >> 6), c = tid & (kChunks - 1);
    cp_async16(q_s + swz(i, c, kRowBytes), qb + i * a.sq_h + c * 8, true);
  }
  cp_async_commit();

  // the rows its blocks' slots name (null: -1, or past the list); bit j of `mine`: a slot of block j is valid
  int mine = 0;
  if (tid < NBL * kAttnBlock) {
    const int j = tid / kAttnBlock, i = tid % kAttnBlock;
    const int l = (r + j * C) * kAttnBlock + i;
    const unsigned char* row = nullptr;
    if (l < a.Lw) {
      const int v = a.iw[b * a.siw_b + s * a.siw_s + l * a.siw_l];
      if (v >= 0) row = a.kw + b * a.skw_b + v * a.skw_n;
    } else if (l < L) {
      const int v = a.ic[b * a.sic_b + s * a.sic_s + (l - a.Lw) * a.sic_l];
      if (v >= 0) row = a.kc + b * a.skc_b + v * a.skc_n;
    }
    sm.rows[j][i] = row;
    mine = (row != nullptr) << j;
  }
  bool valid[NBL];
#pragma unroll
  for (int j = 0; j < NBL; ++j) valid[j] = __syncthreads_or(mine & (1 << j)) != 0;

  // gather every valid block's rows at once (one cp.async group per block; empty slots are zero-filled): thread t
  // copies chunk t % 64 of rows t / 64, t / 64 + 4, ...; packed rows go to the front of the tile, unswizzled
  {
    const int c = tid & (kChunks - 1), i0 = tid >> 6;
#pragma unroll
    for (int j = 0; j < NBL; ++j) {
      if (valid[j]) {
        unsigned char* dst = kv_s + j * kKvBytes;
        if constexpr (PACKED) {
          constexpr int kPc = kAttnPackedBytes / 16;  // 37 chunks a row
#pragma unroll 2
          for (int u = tid; u < kAttnBlock * kPc; u += kThreads) {
            const int i = u / kPc, cc = u - i * kPc;
            const unsigned char* row = sm.rows[j][i];
            cp_async16(dst + u * 16, row != nullptr ? row + cc * 16 : reinterpret_cast<const unsigned char*>(a.q),
                       row != nullptr);
          }
        } else {
#pragma unroll 4
          for (int i = i0; i < kAttnBlock; i += kThreads / kChunks) {
            const unsigned char* row = sm.rows[j][i];
            cp_async16(dst + swz(i, c, kRowBytes), row != nullptr ? row + c * 16 : reinterpret_cast<const unsigned char*>(a.q),
                       row != nullptr);
          }
        }
      }
      cp_async_commit();
    }
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
    float m0 = kNegInf, m1 = kNegInf;  // heads g, g + 8
    if (valid[j]) {
      logits(q_s, kv_s + j * kKvBytes, warp, lane, sc[j]);
      const bool ok0 = sm.rows[j][warp * 8 + 2 * t4] != nullptr, ok1 = sm.rows[j][warp * 8 + 2 * t4 + 1] != nullptr;
      sc[j][0] = ok0 ? sc[j][0] * a.scale : kNegInf;
      sc[j][1] = ok1 ? sc[j][1] * a.scale : kNegInf;
      sc[j][2] = ok0 ? sc[j][2] * a.scale : kNegInf;
      sc[j][3] = ok1 ? sc[j][3] * a.scale : kNegInf;
      m0 = fmaxf(sc[j][0], sc[j][1]);
      m1 = fmaxf(sc[j][2], sc[j][3]);
#pragma unroll
      for (int o = 1; o <= 2; o <<= 1) {
        m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, o));
        m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
      }
    }
    if (t4 == 0) {
      sm.red[warp][g] = m0;
      sm.red[warp][g + 8] = m1;
    }
    __syncthreads();
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
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
  }
  float mr0 = kNegInf, mr1 = kNegInf, z0 = 0.0f, z1 = 0.0f;
#pragma unroll
  for (int j = 0; j < NBL; ++j) {
    if (!valid[j]) continue;  // the same for the whole CTA
    const float s0 = sm.seed[j][g], s1 = sm.seed[j][g + 8];  // finite: the block has a valid slot
    const float al0 = expf(mr0 - s0), al1 = expf(mr1 - s1);  // 0 at this CTA's first block
    const float p0 = expf(sc[j][0] - s0), p1 = expf(sc[j][1] - s0);
    const float p2 = expf(sc[j][2] - s1), p3 = expf(sc[j][3] - s1);
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
      sm.red[warp][g] = ps0;
      sm.red[warp][g + 8] = ps1;
    }
    __syncthreads();
    float zb0 = sm.red[0][g], zb1 = sm.red[0][g + 8];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      zb0 += sm.red[w][g];
      zb1 += sm.red[w][g + 8];
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
    pv(p_s, kv_s + j * kKvBytes, warp, lane, acc);
    mr0 = s0;
    mr1 = s1;
    __syncthreads();  // P and the sums are rewritten by the next block
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
  constexpr int kUnits = kAttnHeads * (kAttnD / 4) / (C * kThreads);  // float4 outputs per thread
  float4 v[kUnits];
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {  // every remote load of this thread issued before the first use
    const int u = (k * C + r) * kThreads + tid;
    const int h = u / (kAttnD / 4), d = (u % (kAttnD / 4)) * 4;
    v[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
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
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int u = (k * C + r) * kThreads + tid;
    const int h = u / (kAttnD / 4), d = (u % (kAttnD / 4)) * 4;
    const float z = sm.zt[h];
    float r[4] = {bf16_round(__fdiv_rn(v[k].x, z)), bf16_round(__fdiv_rn(v[k].y, z)),
                  bf16_round(__fdiv_rn(v[k].z, z)), bf16_round(__fdiv_rn(v[k].w, z))};
    if (d >= kAttnD - 2 * a.rd2) {  // two RoPE pairs (rd2 even: a float4 never straddles the boundary)
      const int i = (d - (kAttnD - 2 * a.rd2)) >> 1;
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const float c = a.cos[s * a.rd2 + i + p], sn = -a.sin[s * a.rd2 + i + p];  // the conjugate
        const float x0 = r[2 * p], x1 = r[2 * p + 1];
        r[2 * p] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
        r[2 * p + 1] = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
      }
    }
    uint2 out;
    out.x = bf16x2(r[0], r[1]);
    out.y = bf16x2(r[2], r[3]);
    *reinterpret_cast<uint2*>(ob + h * a.so_h + d) = out;
  }
  cluster_arrive_relaxed();  // the other CTAs are done reading this one's partials
  cluster_wait();
}

template <int C, int NBL, bool PACKED>
cudaError_t launch(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream) {
  auto kernel = sparse_attn_decode_kernel<C, NBL, PACKED>;
  constexpr int smem = smem_bytes<C, NBL>();
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  return launch_ex(kernel, dim3(C, head_groups, queries), dim3(kThreads), smem, pdl, C, stream, a);
}

template <int C_, int NBL_>
struct Config {
  static constexpr int C = C_, NBL = NBL_;
};

// f(Config<C, NBL>{}) for a list of 1..kAttnMaxSlots slots: C the list's blocks rounded up to a power of two, at
// most 8 (a CTA past the list only joins the combine); then up to 3 blocks per CTA
template <typename F>
auto with_config(int slots, F&& f) -> decltype(f(Config<1, 1>{})) {
  const int nblk = (slots + kAttnBlock - 1) / kAttnBlock;
  if (nblk <= 1) return f(Config<1, 1>{});
  if (nblk <= 2) return f(Config<2, 1>{});
  if (nblk <= 4) return f(Config<4, 1>{});
  if (nblk <= 8) return f(Config<8, 1>{});
  if (nblk <= 16) return f(Config<8, 2>{});
  return f(Config<8, 3>{});
}

}  // namespace

cudaError_t sparse_attn_decode_launch(const AttnArgs& a, int queries, int head_groups, bool pdl, cudaStream_t stream) {
  const int L = a.Lw + a.Lc;
  if (L < 1 || L > kAttnMaxSlots || queries < 1 || head_groups < 1) return cudaErrorInvalidValue;
  return with_config(L, [&](auto cfg) {
    using K = decltype(cfg);
    return a.packed ? launch<K::C, K::NBL, true>(a, queries, head_groups, pdl, stream)
                    : launch<K::C, K::NBL, false>(a, queries, head_groups, pdl, stream);
  });
}

int sparse_attn_decode_smem(int slots) {
  if (slots < 1 || slots > kAttnMaxSlots) return -1;
  return with_config(slots, [](auto cfg) {
    using K = decltype(cfg);
    return smem_bytes<K::C, K::NBL>();
  });
}

}  // namespace dsv4
