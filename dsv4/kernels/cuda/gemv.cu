// Skinny GEMV for decode (1-8 tokens): out[M, N] = x[M, K] @ W[N, K]^T on the tensor cores, fed from registers.
//
// Weights: FP8 e4m3 with fp32 128x128 block scales, x quantized in-kernel to e4m3 1x128 with power-of-two scales
// (DeepSeek's act_quant; FMT 1), or x bf16 unquantized (FMT 2: the e4m3 weight times bf16 x, as a bf16 GEMM on the
// dequantized weight computes it); or dense bf16 weights (x bf16, or fp32 split exactly into three bf16 parts; FMT 0).
// FMT 2 stages x as f16 scaled by a power of two per 128-column block (its max in [2^14, 2^15)): exact for every
// element down to 2^-28 of its block's max, so the products are the bf16 GEMM's; the e4m3 weights convert exactly to
// f16. Grouped x (xg_rows > 0): rows [g * xg_rows, (g + 1) * xg_rows) read x's columns [g * K, (g + 1) * K) (wo_a).
// norm_w (FMT 1, bf16 x): each x row is RMS-normed first, as rmsnorm_ref: every CTA sums the squares of the whole row
// (fp32), y = bf16(w * (x * (1 / sqrt(mean + eps)))), then quantizes y (the query's norm before wq_b, one launch).
//
// Work split: a CTA of 8 warps covers 16*WR weight rows x ks columns; warp (wr, wk) owns 16 rows x nchunk chunks of
// NSTEP steps of 16 bytes per lane per row, streamed through a 3-chunk cp.async ring. The S CTAs of a thread-block cluster split K; their partials are summed through
// distributed shared memory in rank order, and the WK warps of a CTA in warp order: every output is written once,
// with the same bits on every run (no atomics).
//
// mma.sync takes its A fragment (16 rows x k) straight from the 16-byte loads: the dot product does not care
// which k slot holds which column as long as A and B agree, so lane (g = lane/4, t = lane%4) feeds the 16 bytes it
// copied from rows g and g+8 and reads the matching x bytes for token g (no ldmatrix, no layout change).
//
// Programmatic dependent launch: the weight loads (never written by an earlier kernel) are issued before
// griddepcontrol.wait, as cp.async into shared memory; x is read after it. The kernel triggers its dependents right
// after its wait (they launch once every CTA of this grid has passed it, and wait for its completion before reading).
#include <cooperative_groups.h>

#include "common.h"
#include "gemv.h"

namespace cg = cooperative_groups;

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
using dev::cp_async16;
using dev::griddep_launch_dependents;
using dev::griddep_wait;
using dev::mma_bf16;
using dev::mma_e4m3;
using dev::ue8m0_scale;

__device__ __forceinline__ float load_x(const GemvArgs& a, int m, long long c) {
  const long long off = static_cast<long long>(m) * a.sx + c;
  return a.x_f32 ? static_cast<const float*>(a.x)[off]
                 : __bfloat162float(static_cast<const __nv_bfloat16*>(a.x)[off]);
}


// FMT 1: fp8 weights (+ x quantization); FMT 2: fp8 weights, bf16 x as scaled f16; FMT 0: bf16 weights.
// XSPLIT: fp32 x as three bf16 parts (FMT 0 only). NORM: the x rows RMS-normed first (FMT 1 only, a.norm_w).
// NORM instances are capped at 64 registers (4 CTAs of 256 threads per SM); the others leave the bound unset (0: ptxas
// allocates as for __launch_bounds__(kThreads); an explicit 1 took them from 56 to 68-98 registers)
template <int FMT, int NSTEP, bool XSPLIT, bool NORM>
__global__ void __launch_bounds__(kThreads, NORM ? 4 : 0) gemv_kernel(const GemvArgs a) {
  constexpr bool W8 = FMT >= 1;
  constexpr int EB = W8 ? 1 : 2;              // weight bytes per element
  constexpr int CPL = 16 / EB;                // columns per 16-byte lane chunk
  constexpr int STEPC = 4 * CPL;              // columns per step (4 lanes of a row group side by side)
  constexpr int NPART = XSPLIT ? 3 : 1;
  extern __shared__ __align__(16) unsigned char smem[];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wr = warp % a.WR, wk = warp / a.WR;
  const int cta_rows = 16 * a.WR;
  const int row0 = blockIdx.y * cta_rows + wr * 16;
  const int cta_col0 = blockIdx.x * a.ks;
  const int nchunk = a.nchunk;
  const int wcol = wk * nchunk * NSTEP * STEPC;  // warp's first column inside the CTA's range
  const int M = a.M;
  constexpr int NBUF = 3;  // chunks of NSTEP steps in the cp.async ring: two in flight while one is multiplied
  const int nslot = nchunk < NBUF ? nchunk : NBUF;

  // ---- weights: a ring of chunks wsm[slot][step][row g | g+8][thread], 16 bytes each; every thread copies and
  // later reads back only its own slots (no barrier). One commit group per chunk, empty past the last, so that
  // wait_group(NBUF - 1) always means "chunk c has landed". The first NBUF - 1 chunks and the FP8 block scales
  // (weights too: never written by an earlier kernel) are issued before waiting on the previous kernel.
  uint4* wsm = reinterpret_cast<uint4*>(smem);
  const unsigned char* wbytes = static_cast<const unsigned char*>(a.w);
  const int ra = row0 + g, rb = row0 + g + 8;
  auto issue = [&](int c) {
    if (c < nchunk) {
      const int slot = c % NBUF;
#pragma unroll
      for (int s = 0; s < NSTEP; ++s) {
        const int col = cta_col0 + wcol + (c * NSTEP + s) * STEPC + t * CPL;
        const bool okc = col < a.K;
        uint4* dst = wsm + ((slot * NSTEP + s) * 2) * kThreads + threadIdx.x;
        cp_async16(dst, wbytes + (static_cast<long long>(ra) * a.K + col) * EB, okc && ra < a.N);
        cp_async16(dst + kThreads, wbytes + (static_cast<long long>(rb) * a.K + col) * EB, okc && rb < a.N);
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  float* ssm = reinterpret_cast<float*>(smem + nslot * NSTEP * 2 * kThreads * 16);  // [ks / 128] fp8 block scales
  const int nsc = W8 ? a.ks / 128 : 0;
  if constexpr (W8) {
    const int cta_row0 = blockIdx.y * cta_rows;  // the CTA's rows sit in one 128-row scale block
    for (int i = threadIdx.x; i < nsc; i += kThreads) {
      const int col = cta_col0 + i * 128;
      ssm[i] = (col < a.K && cta_row0 < a.N) ? a.ws[static_cast<long long>(cta_row0 / 128) * a.ws_ld + col / 128] : 0.0f;
    }
  }
#pragma unroll
  for (int c = 0; c < NBUF - 1; ++c) issue(c);

  griddep_wait();
  // the trigger after the wait, not at entry: the dependent's CTAs (the next GEMV, streaming its own first chunks)
  // then launch once the previous kernel has finished, not beside its last phase (the mHC boundary's finish before
  // wq_a || wkv; at entry: +2.3..2.6 us in SWA layers, +0.5 in HCA at 1K, 40th pass; after the chunk loop: 4 us a
  // 4-layer step slower than here, the CSA and HCA layers slower than at entry)
  griddep_launch_dependents();

  // ---- x for the CTA's columns -> shared memory
  const int pitch = a.ks + 16;  // bytes (fp8) or elements (bf16, f16) per token row; +16 spreads the banks
  // grouped x: the CTA's rows sit in one group (xg_rows is a multiple of the CTA's rows)
  const long long xoff = a.xg_rows ? static_cast<long long>(blockIdx.y * cta_rows / a.xg_rows) * a.K : 0;
  unsigned char* xsm = reinterpret_cast<unsigned char*>(ssm) + ((nsc * 4 + 15) / 16) * 16;
  unsigned char* xq = xsm;
  float* sa = nullptr;
  __nv_bfloat16* xh = reinterpret_cast<__nv_bfloat16*>(xsm);
  __half* xf = reinterpret_cast<__half*>(xsm);
  float* red;
  if constexpr (W8) {
    const int nblk = nsc;
    sa = reinterpret_cast<float*>(xsm + ((M * pitch * (FMT == 2 ? 2 : 1) + 15) / 16) * 16);
    red = sa + M * nblk;
    // a warp's blocks XB at a time: all their loads in flight together (one L2 round trip, not one per block),
    // kept as loaded (4 fp32 or 4 bf16 per lane) until they have landed
    constexpr int XB = 4;
    constexpr int NW = kThreads / 32;
    auto load_pairs = [&](int p0, uint4 (&raw)[XB]) {
#pragma unroll
      for (int j = 0; j < XB; ++j) {
        const int p = p0 + NW * j;
        const int m = p / nblk, blk = p % nblk;
        const int c = cta_col0 + blk * 128 + lane * 4;
        raw[j] = make_uint4(0, 0, 0, 0);
        if (p < M * nblk && c < a.K) {
          const long long off = static_cast<long long>(m) * a.sx + xoff + c;
          if (a.x_vec && a.x_f32) {  // 4 elements in one 16- or 8-byte load
            raw[j] = *reinterpret_cast<const uint4*>(static_cast<const float*>(a.x) + off);
          } else if (a.x_vec) {
            const uint2 b = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(a.x) + off);
            raw[j].x = b.x, raw[j].y = b.y;
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) (&raw[j].x)[i] = __float_as_uint(load_x(a, m, xoff + c + i));
          }
        }
      }
    };
    auto unpack = [&](const uint4& r, float (&v)[4]) {
      if (a.x_vec && !a.x_f32) {
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.y));
        v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
      } else {
        v[0] = __uint_as_float(r.x), v[1] = __uint_as_float(r.y), v[2] = __uint_as_float(r.z), v[3] = __uint_as_float(r.w);
      }
    };
    constexpr bool norm = NORM;
    __shared__ float rs[8];  // norm: 1 / sqrt(mean(x^2) + eps) per token
    auto stage_pairs = [&](int p0, const uint4 (&raw)[XB]) {
#pragma unroll
      for (int j = 0; j < XB; ++j) {
        const int p = p0 + NW * j;
        if (p >= M * nblk) continue;  // warp-uniform
        const int m = p / nblk, blk = p % nblk;
        float v[4];
        unpack(raw[j], v);
        if constexpr (norm) {  // y = bf16(w * (x * rs)), as rmsnorm_ref (zeros past K stay zero)
          const int c = cta_col0 + blk * 128 + lane * 4;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float w = c + i < a.K ? __bfloat162float(a.norm_w[c + i]) : 0.0f;
            v[i] = __bfloat162float(__float2bfloat16_rn(w * (v[i] * rs[m])));
          }
        }
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float s, inv;
        if constexpr (FMT == 1) {
          ue8m0_scale(amax, s, inv);
          uint32_t packed = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i) packed |= dev::e4m3_code(v[i], inv) << (8 * i);
          *reinterpret_cast<uint32_t*>(xq + m * pitch + blk * 128 + lane * 4) = packed;
        } else {
          // inv = 2^(14 - e) with e = floor(log2(amax)) (clamped: an all-tiny or all-zero block keeps e = -100):
          // the block's max lands in [2^14, 2^15), and every bf16 element down to 2^-28 of it is an f16 normal
          const int e = max(static_cast<int>((__float_as_uint(amax) >> 23) & 0xFF) - 127, -100);
          inv = __uint_as_float(static_cast<uint32_t>(127 + 14 - e) << 23);
          s = __uint_as_float(static_cast<uint32_t>(127 - 14 + e) << 23);
          const __half2 lo = __floats2half2_rn(v[0] * inv, v[1] * inv), hi = __floats2half2_rn(v[2] * inv, v[3] * inv);
          uint2 packed;
          packed.x = *reinterpret_cast<const uint32_t*>(&lo);
          packed.y = *reinterpret_cast<const uint32_t*>(&hi);
          *reinterpret_cast<uint2*>(xf + m * pitch + blk * 128 + lane * 4) = packed;
        }
        if (lane == 0) sa[m * nblk + blk] = s;
      }
    };
    if constexpr (norm) {
      // the statistic over each token's whole row (fp32). Where this CTA stages every column of x in one pass of its
      // warps (one split, all (token, block) pairs at once), from the staged values themselves; else a pass of its own
      const bool one_pass = gridDim.x == 1 && a.ks >= a.K && M * nblk <= NW * XB;
      uint4 raw[XB];
      if (one_pass) {
        __shared__ float pss[NW * XB];  // per (token, block) pair
        load_pairs(warp, raw);
#pragma unroll
        for (int j = 0; j < XB; ++j) {
          const int p = warp + NW * j;
          if (p >= M * nblk) continue;  // warp-uniform
          float v[4];
          unpack(raw[j], v);
          float q = fmaf(v[0], v[0], fmaf(v[1], v[1], fmaf(v[2], v[2], v[3] * v[3])));
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
          if (lane == 0) pss[p] = q;
        }
        __syncthreads();
        if (threadIdx.x < M) {
          float t = 0.0f;
          for (int b = 0; b < nblk; ++b) t += pss[threadIdx.x * nblk + b];
          rs[threadIdx.x] = 1.0f / sqrtf(t / static_cast<float>(a.K) + a.norm_eps);
        }
      } else {
        __shared__ float wss[NW][8];
        float ss[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) ss[m] = 0.0f;
        for (int c = threadIdx.x * 4; c < a.K; c += kThreads * 4) {
#pragma unroll
          for (int m = 0; m < 8; ++m) {
            if (m < M) {
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const float v = c + i < a.K ? load_x(a, m, c + i) : 0.0f;
                ss[m] = fmaf(v, v, ss[m]);
              }
            }
          }
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
          if (lane == 0) wss[warp][m] = ss[m];
        }
        __syncthreads();
        if (threadIdx.x < M) {
          float t = 0.0f;
          for (int w = 0; w < NW; ++w) t += wss[w][threadIdx.x];
          rs[threadIdx.x] = 1.0f / sqrtf(t / static_cast<float>(a.K) + a.norm_eps);
        }
      }
      __syncthreads();
      if (one_pass) {
        stage_pairs(warp, raw);
      } else {
        for (int p0 = warp; p0 < M * nblk; p0 += NW * XB) {
          load_pairs(p0, raw);
          stage_pairs(p0, raw);
        }
      }
    } else {
      for (int p0 = warp; p0 < M * nblk; p0 += NW * XB) {
        uint4 raw[XB];
        load_pairs(p0, raw);
        stage_pairs(p0, raw);
      }
    }
  } else {
    red = reinterpret_cast<float*>(xsm + ((NPART * M * pitch * 2 + 15) / 16) * 16);
    constexpr int XB = 8;  // a thread's elements XB at a time: their loads in flight together
    for (int p0 = threadIdx.x; p0 < M * a.ks; p0 += kThreads * XB) {
      float vs[XB];
#pragma unroll
      for (int j = 0; j < XB; ++j) {
        const int p = p0 + kThreads * j;
        const int c = cta_col0 + p % a.ks;
        vs[j] = p < M * a.ks && c < a.K ? load_x(a, p / a.ks, xoff + c) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < XB; ++j) {
        const int p = p0 + kThreads * j;
        if (p >= M * a.ks) continue;
        const int m = p / a.ks, cc = p % a.ks;
        const float v = vs[j];
        const __nv_bfloat16 hi = __float2bfloat16_rn(v);
        xh[m * pitch + cc] = hi;
        if constexpr (XSPLIT) {  // v = hi + mid + lo exactly
          const float r1 = v - __bfloat162float(hi);
          const __nv_bfloat16 mid = __float2bfloat16_rn(r1);
          xh[(M + m) * pitch + cc] = mid;
          xh[(2 * M + m) * pitch + cc] = __float2bfloat16_rn(r1 - __bfloat162float(mid));
      }
      }
    }
  }
  __syncthreads();  // x (and the scales) staged

  // ---- the products: acc[0..3] = (row g, token 2t), (row g, 2t+1), (row g+8, 2t), (row g+8, 2t+1)
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const float* sa0p = nullptr;
  const float* sa1p = nullptr;
  if constexpr (W8) {
    sa0p = 2 * t < M ? sa + (2 * t) * nsc : nullptr;
    sa1p = 2 * t + 1 < M ? sa + (2 * t + 1) * nsc : nullptr;
  }
  for (int c = 0; c < nchunk; ++c) {
    issue(c + NBUF - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(NBUF - 1) : "memory");
    const uint4* wc = wsm + ((c % NBUF) * NSTEP * 2) * kThreads + threadIdx.x;
    const int ccol = wcol + c * NSTEP * STEPC;  // the chunk's first column inside the CTA's range
    if constexpr (W8) {
#pragma unroll
      for (int s = 0; s < NSTEP; s += 2) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int cl = ccol + (s + u) * STEPC + t * CPL;
          const uint4 wa = wc[(2 * (s + u)) * kThreads], wb = wc[(2 * (s + u) + 1) * kThreads];
          if constexpr (FMT == 1) {
            const uint4 xb = g < M ? *reinterpret_cast<const uint4*>(xq + g * pitch + cl) : make_uint4(0, 0, 0, 0);
            mma_e4m3(d, wa.x, wb.x, wa.y, wb.y, xb.x, xb.y);
            mma_e4m3(d, wa.z, wb.z, wa.w, wb.w, xb.z, xb.w);
          } else {  // the 16 columns' x as 16 f16 (two 16-byte loads), in the k order of the weight words' halves
            const uint4 zero = make_uint4(0, 0, 0, 0);
            const uint4 x0 = g < M ? *reinterpret_cast<const uint4*>(xf + g * pitch + cl) : zero;
            const uint4 x1 = g < M ? *reinterpret_cast<const uint4*>(xf + g * pitch + cl + 8) : zero;
            dev::mma_e4m3_f16x(d, wa.x, wb.x, wa.y, wb.y, x0, false);
            dev::mma_e4m3_f16x(d, wa.z, wb.z, wa.w, wb.w, x1, false);
          }
        }
        // one 128-column block: promote to fp32 with the activation and weight block scales (powers of two)
        const int kb = (ccol + s * STEPC) / 128;
        const float sw = ssm[kb];
        const float f0 = sa0p ? sa0p[kb] * sw : 0.0f;
        const float f1 = sa1p ? sa1p[kb] * sw : 0.0f;
        acc[0] += d[0] * f0;
        acc[1] += d[1] * f1;
        acc[2] += d[2] * f0;
        acc[3] += d[3] * f1;
      }
    } else {
#pragma unroll
      for (int s = 0; s < NSTEP; ++s) {
        const int cl = ccol + s * STEPC + t * CPL;
        const uint4 wa = wc[(2 * s) * kThreads], wb = wc[(2 * s + 1) * kThreads];
#pragma unroll
        for (int part = 0; part < NPART; ++part) {
          const uint4 xb = g < M ? *reinterpret_cast<const uint4*>(xh + (part * M + g) * pitch + cl)
                                 : make_uint4(0, 0, 0, 0);
          mma_bf16(acc, wa.x, wb.x, wa.y, wb.y, xb.x, xb.y);
          mma_bf16(acc, wa.z, wb.z, wa.w, wb.w, xb.z, xb.w);
        }
      }
    }
  }

  // ---- reduce: the WK warps of each CTA in warp order (all threads, local), then the S CTAs of the cluster in
  // rank order (each CTA finishes 1/S of the outputs, its S remote loads issued together)
  const int nout = M * cta_rows;  // red[wk][m][row]
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = 2 * t + (i & 1), r = wr * 16 + g + (i >> 1) * 8;
    if (m < M) red[(wk * M + m) * cta_rows + r] = acc[i];
  }
  __syncthreads();
  const int WK = kThreads / 32 / a.WR;
  for (int o = threadIdx.x; o < nout; o += kThreads) {
    float v = red[o];
    for (int k = 1; k < WK; ++k) v += red[k * nout + o];
    red[o] = v;
  }
  const int S = gridDim.x;
  int rank = 0;
  if (S > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    rank = static_cast<int>(cluster.block_rank());
    cluster.sync();
    for (int o = rank + S * threadIdx.x; o < nout; o += S * kThreads) {
      float part[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) part[q] = q < S ? cluster.map_shared_rank(red, q)[o] : 0.0f;
      float v = part[0];
#pragma unroll
      for (int q = 1; q < 8; ++q) {
        if (q < S) v += part[q];
      }
      red[nout + o] = v;  // past the WK = 1 partials: wk >= 1 slots, no longer read (WK > 1), or scratch
    }
    // this CTA is done reading the others' partials (their values are used above): it says so now, stores, and waits
    // for the others' word only before leaving (its shared memory must outlive their reads of it), so the barrier's
    // round trip overlaps the stores. The arrive is relaxed: the PTX model orders no earlier load before it, so this
    // relies on every remote load's value being consumed (v above) before the arrive issues, which a warp's in-order
    // issue then guarantees (checked in the SASS of every instance, nvcc 13.0). The release form (.release: a
    // MEMBAR.ALL.GPU before the arrive) would not rely on it; here and in attn.cu it cost ~1 us a layer (40th pass)
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    // (the NORM instances, capped at 64 registers, wait here: with the wait after the stores they spill 8 bytes)
    if constexpr (NORM) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  } else {
    __syncthreads();
  }
  for (int o = rank + S * threadIdx.x; o < nout; o += S * kThreads) {
    const int m = o / cta_rows, row = blockIdx.y * cta_rows + o % cta_rows;
    if (row >= a.N) continue;
    const float v = S > 1 ? red[nout + o] : red[o];
    const long long off = static_cast<long long>(m) * a.so + row;
    if (a.out_f32) {
      static_cast<float*>(a.out)[off] = v;
    } else {
      static_cast<__nv_bfloat16*>(a.out)[off] = __float2bfloat16_rn(v);
    }
  }
  if (!NORM && S > 1) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

template <int FMT, int NSTEP, bool XSPLIT, bool NORM>
cudaError_t launch(const GemvArgs& a, int smem, bool pdl, cudaStream_t stream) {
  auto kernel = gemv_kernel<FMT, NSTEP, XSPLIT, NORM>;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  return launch_ex(kernel, dim3(a.S, (a.N + 16 * a.WR - 1) / (16 * a.WR), 1), dim3(kThreads, 1, 1), smem, pdl, a.S,
                   stream, a);
}

template <int FMT, bool XSPLIT, bool NORM = false>
cudaError_t launch_nstep(const GemvArgs& a, int nstep, int smem, bool pdl, cudaStream_t stream) {
  if constexpr (FMT == 0) {
    if (nstep == 1) return launch<FMT, 1, XSPLIT, NORM>(a, smem, pdl, stream);
  }
  switch (nstep) {
    case 2: return launch<FMT, 2, XSPLIT, NORM>(a, smem, pdl, stream);
    case 4: return launch<FMT, 4, XSPLIT, NORM>(a, smem, pdl, stream);
    case 8: return launch<FMT, 8, XSPLIT, NORM>(a, smem, pdl, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int gemv_smem_bytes(int fmt, int x_split, int M, int ks, int WR, int nstep, int nchunk) {
  const int pitch = ks + 16;
  const int cta_rows = 16 * WR;
  const int WK = kThreads / 32 / WR;
  int bytes = fmt ? ((M * pitch * (fmt == 2 ? 2 : 1) + 15) / 16) * 16 + M * (ks / 128) * 4
                  : (((x_split ? 3 : 1) * M * pitch * 2 + 15) / 16) * 16;
  const int ring = (nchunk < 3 ? nchunk : 3) * nstep * 2 * kThreads * 16;
  const int scales = fmt ? ((ks / 128 * 4 + 15) / 16) * 16 : 0;
  return ring + scales + bytes + (WK + 1) * M * cta_rows * 4;
}

cudaError_t gemv_launch(const GemvArgs& a, int fmt, int nstep, bool pdl, cudaStream_t stream) {
  const int smem = gemv_smem_bytes(fmt, a.x_f32 && !fmt, a.M, a.ks, a.WR, nstep, a.nchunk);
  if (fmt == 1) {
    if (a.norm_w != nullptr) return launch_nstep<1, false, true>(a, nstep, smem, pdl, stream);
    return launch_nstep<1, false>(a, nstep, smem, pdl, stream);
  }
  if (fmt == 2) return launch_nstep<2, false>(a, nstep, smem, pdl, stream);
  if (a.x_f32) return launch_nstep<0, true>(a, nstep, smem, pdl, stream);
  return launch_nstep<0, false>(a, nstep, smem, pdl, stream);
}

}  // namespace dsv4
