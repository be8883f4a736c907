// One mHC boundary in one launch (SPEC §2.2), for decode (1-8 tokens): the post of a sublayer (optional), the pre of
// the next one and that sublayer's RMSNorm, i.e. mhc_post_pre_norm (or mhc_pre_norm without the post), with
// mhc_post_pre_norm_ref's arithmetic up to fp32 summation order, expf and the Sinkhorn's 2-ulp divisions.
//
// Grid (D / 64, T), 256 threads. CTA (c, t) owns columns [64c, 64c + 64) of the 4 streams of token t, one element
// per thread: it writes the post's new stream values there (fp32, rounded to bf16: the same per-element FMAs as
// mhc_post's Triton kernel, so the same bits), then its partial dot products with the 24 mixer rows and its partial
// sum of squares. The mixer slice (fn, 24 x 256 fp32) is loaded before griddepcontrol.wait in the source (plain
// loads: ptxas may sink them below it), so that with programmatic dependent launch it can arrive during the previous
// kernel's tail.
//
// The last CTA of a token to arrive (an atomic counter, which it resets) finishes the token: the partials reduced in
// a fixed order (chunk order per lane, then a fixed shuffle tree: same input, same bits), the rsqrt statistic, the
// sigmoids; then warp 0 runs the Sinkhorn chain (lanes hold the 16 entries of comb: rows and columns are xor-shuffle
// groups) while warps 1-7 form y = sum_j pre_j X_j over the whole row (rounded to bf16, as mhc_pre returns it) and
// its RMSNorm, and optionally the RMSNorm's FP8 1x128 quantization (act_quant's codes and scales: the decode MoE's
// up kernel reads them instead of quantizing x in each of its CTAs). The Sinkhorn divisions are div.full.f32 (2 ulp,
// as Triton's fp32 division), the rest IEEE.
#include "common.h"
#include "mhc.h"

namespace dsv4 {
namespace {

using dev::unpack8;
using dev::warp_sum;

constexpr int HC = 4;
constexpr int MIX = (2 + HC) * HC;          // 24
constexpr int COLS = kMhcCols;
constexpr int kThreads = HC * COLS;         // 256: one element of the CTA's slice per thread
constexpr int kWarps = kThreads / 32;
constexpr int RPW = MIX / kWarps;           // mixer rows per warp (3)
constexpr int kRowThreads = kThreads - 32;  // warps 1..7: the finish's row
static_assert(MIX % kWarps == 0, "mixer rows split evenly over the warps");

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// the Sinkhorn chain's division: div.full.f32 (max 2 ulp, the Triton kernels' fp32 division), half the latency of an
// IEEE division on this serial critical path
__device__ __forceinline__ float div_full(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// sum over the 4 lanes of a Sinkhorn row (S = 1: xor 1, 2, 3) or column (S = 4: xor 4, 8, 12), as
// (v + v^S) + (v^2S + v^3S): the value a two-round shuffle tree (xor S, then 2S) gives every lane, bit for bit (fp32
// addition commutes), with the three shuffles in flight at once: one shuffle latency per normalisation, not two
template <int S>
__device__ __forceinline__ float group_sum(float v) {
  const float a = __shfl_xor_sync(0xffffffffu, v, S);
  const float b = __shfl_xor_sync(0xffffffffu, v, 2 * S);
  const float c = __shfl_xor_sync(0xffffffffu, v, 3 * S);
  return (v + a) + (b + c);
}

// MINB = 2: two CTAs per SM (registers capped at 128; at RV = 3 ptxas spills 20 bytes), for grids past one CTA per
// SM (Flash, 4 tokens: 256 CTAs in one wave instead of two)
template <int RV, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) mhc_boundary_kernel(const MhcArgs a) {
  __shared__ float vals[kThreads];  // the slice's stream values (as stored: bf16)
  __shared__ float mix[MIX];
  __shared__ float red[kWarps];
  __shared__ int last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int c = blockIdx.x, t = blockIdx.y, nch = gridDim.x;
  const int D = a.D, nv = D / 8;
  const long long K = static_cast<long long>(HC) * D;
  const int d0 = c * COLS;
  dev::griddep_launch_dependents();

  // weights (never written by an earlier kernel), before griddepcontrol.wait. The mixer slice: warp w's rows
  // RPW w .. RPW w + RPW - 1, the lane's 8 elements (stream lane / 8, columns d0 + 8 (lane % 8) ..). The norm
  // weight: warps 1-7 hold the 8-column vectors r0, r0 + 224, .. that they finish if this CTA is the last.
  const int ek = lane >> 3, ed = (lane & 7) * 8;
  float4 fw[RPW][2];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float4* p = reinterpret_cast<const float4*>(a.fn + (RPW * warp + r) * K + static_cast<long long>(ek) * D + d0 + ed);
    fw[r][0] = __ldg(p);
    fw[r][1] = __ldg(p + 1);
  }
  const int r0 = tid - 32;
  uint4 wq[RV];
#pragma unroll
  for (int i = 0; i < RV; ++i) {
    const int v = r0 + i * kRowThreads;
    wq[i] = (warp > 0 && v < nv) ? __ldg(reinterpret_cast<const uint4*>(a.w) + v) : make_uint4(0, 0, 0, 0);
  }
  dev::griddep_wait();

  const __nv_bfloat16* xt = a.x + static_cast<long long>(t) * HC * D;
  {
    const int k = tid / COLS, d = d0 + tid % COLS;
    float v;
    if (a.f != nullptr) {  // out_k = sum_j comb[j, k] X_j + post_k f, in mhc_post's order
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < HC; ++j) acc = fmaf(a.comb[(t * HC + j) * HC + k], bf(xt[j * D + d]), acc);
      acc = fmaf(a.post[t * HC + k], bf(a.f[static_cast<long long>(t) * D + d]), acc);
      const __nv_bfloat16 o = __float2bfloat16_rn(acc);
      a.out[(static_cast<long long>(t) * HC + k) * D + d] = o;
      v = bf(o);
    } else {
      v = bf(xt[k * D + d]);
    }
    vals[tid] = v;
  }
  __syncthreads();

  // partial mixes (this warp's rows) and sum of squares over the slice
  {
    float xv[8], dots[RPW], sq = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xv[i] = vals[ek * COLS + ed + i];
      sq = fmaf(xv[i], xv[i], sq);
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const float* w = reinterpret_cast<const float*>(fw[r]);
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) s = fmaf(w[i], xv[i], s);
      dots[r] = warp_sum(s);
    }
    sq = warp_sum(sq);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) a.part[(static_cast<long long>(t) * nch + c) * MIX + RPW * warp + r] = dots[r];
      if (warp == 0) a.sq[t * nch + c] = sq;
    }
  }

  // arrival: the token's last CTA finishes it (cooperative groups' grid-barrier pattern: the CTA's writes are ordered
  // before thread 0's fence by the barrier; the fence after the atomic orders the finisher's reads after it)
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(a.counter + t, 1) == nch - 1;
    __threadfence();
  }
  __syncthreads();
  if (!last) return;

  // the streams of the whole row (this launch's own: other CTAs wrote them, read through L2), every load at once
  const bool mine = a.f != nullptr;
  const __nv_bfloat16* src = mine ? a.out + static_cast<long long>(t) * HC * D : xt;
  uint4 q[RV][HC];
  if (warp > 0) {
#pragma unroll
    for (int i = 0; i < RV; ++i) {
      const int v = r0 + i * kRowThreads;
#pragma unroll
      for (int j = 0; j < HC; ++j) {
        const uint4* p = reinterpret_cast<const uint4*>(src + static_cast<long long>(j) * D) + v;
        q[i][j] = v >= nv ? make_uint4(0, 0, 0, 0) : mine ? __ldcg(p) : __ldg(p);
      }
    }
  }

  {  // the mixes: the partials summed per lane in chunk order, then a fixed shuffle tree
    float s[RPW] = {}, qs = 0.0f;
    for (int ch = lane; ch < nch; ch += 32) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) s[r] += __ldcg(a.part + (static_cast<long long>(t) * nch + ch) * MIX + RPW * warp + r);
      qs += __ldcg(a.sq + t * nch + ch);
    }
    qs = warp_sum(qs);
    const float rs = 1.0f / sqrtf(qs / static_cast<float>(K) + a.norm_eps);
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const float m = warp_sum(s[r]) * rs;
      if (lane == 0) mix[RPW * warp + r] = m;
    }
  }
  __syncthreads();

  if (warp == 0) {  // post' and the Sinkhorn comb: lane (i, j) = (e / 4, e % 4), e = lane % 16
    if (lane < HC) a.post_out[t * HC + lane] = 2.0f * sigmoid(mix[HC + lane] * a.scale[1] + a.base[HC + lane]);
    const int e = lane & 15;
    const float cc = mix[2 * HC + e] * a.scale[2] + a.base[2 * HC + e];
    float mx = fmaxf(cc, __shfl_xor_sync(0xffffffffu, cc, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float ex = expf(cc - mx);
    float m = div_full(ex, group_sum<1>(ex)) + a.hc_eps;
    m = div_full(m, group_sum<4>(m) + a.hc_eps);  // column normalisation first
    for (int it = 1; it < a.iters; ++it) {
      m = div_full(m, group_sum<1>(m) + a.hc_eps);
      m = div_full(m, group_sum<4>(m) + a.hc_eps);
    }
    if (lane < HC * HC) a.comb_out[t * HC * HC + lane] = m;
  } else {  // y = sum_j pre_j X_j (bf16), then its RMSNorm
    float pre[HC];
#pragma unroll
    for (int j = 0; j < HC; ++j) pre[j] = sigmoid(mix[j] * a.scale[0] + a.base[j]) + a.hc_eps;
    uint4 yq[RV];  // y as stored: bf16, 8 per vector
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < RV; ++i) {
      float xs[HC][8], yv[8];
#pragma unroll
      for (int j = 0; j < HC; ++j) unpack8(q[i][j], xs[j]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < HC; ++j) acc = fmaf(pre[j], xs[j][e], acc);
        yv[e] = dev::bf16_round(acc);
        ss = fmaf(yv[e], yv[e], ss);  // vectors past the row hold zeros
      }
      __nv_bfloat162* yh = reinterpret_cast<__nv_bfloat162*>(&yq[i]);
#pragma unroll
      for (int e = 0; e < 4; ++e) yh[e] = __floats2bfloat162_rn(yv[2 * e], yv[2 * e + 1]);  // exact: already bf16
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    asm volatile("bar.sync 1, %0;" ::"n"(kRowThreads) : "memory");
    float tot = 0.0f;
#pragma unroll
    for (int w = 1; w < kWarps; ++w) tot += red[w];
    const float rinv = 1.0f / sqrtf(tot / static_cast<float>(D) + a.eps);
#pragma unroll
    for (int i = 0; i < RV; ++i) {  // (no early exit: the quantization's shuffles need every lane; rows past the
      const int v = r0 + i * kRowThreads;  // row hold zeros and store nothing)
      float wv[8], yv[8];
      unpack8(wq[i], wv);
      unpack8(yq[i], yv);
      uint4 o;
      __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        oh[e] = __floats2bfloat162_rn(wv[2 * e] * (yv[2 * e] * rinv), wv[2 * e + 1] * (yv[2 * e + 1] * rinv));
      }
      if (v < nv) reinterpret_cast<uint4*>(a.y + static_cast<long long>(t) * D)[v] = o;
      if (a.yq != nullptr) {  // act_quant of the row: a 128-block is 16 vectors, the 16 lanes of a half-warp
        float ov[8], amax = 0.0f;
        unpack8(o, ov);
#pragma unroll
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(ov[e]));
#pragma unroll
        for (int m = 8; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
        float sc, inv;
        dev::ue8m0_scale(amax, sc, inv);
        const uint2 c = make_uint2(dev::e4m3x2_code(ov[0], ov[1], inv) | dev::e4m3x2_code(ov[2], ov[3], inv) << 16,
                                   dev::e4m3x2_code(ov[4], ov[5], inv) | dev::e4m3x2_code(ov[6], ov[7], inv) << 16);
        if (v < nv) {
          reinterpret_cast<uint2*>(a.yq + static_cast<long long>(t) * D)[v] = c;
          if ((lane & 15) == 0) a.yqs[static_cast<long long>(t) * (D / 128) + v / 16] = sc;
        }
      }
    }
  }
  if (tid == 0) a.counter[t] = 0;  // every CTA of the token has arrived: ready for the next launch
}

template <int RV, int MINB>
cudaError_t launch_rv(const MhcArgs& a, bool pdl, cudaStream_t stream) {
  return launch_pdl(mhc_boundary_kernel<RV, MINB>, dim3(a.D / COLS, a.T), dim3(kThreads), 0, pdl, stream, a);
}

}  // namespace

cudaError_t mhc_boundary_launch(const MhcArgs& a, bool pdl, cudaStream_t stream) {
  const int rv = (a.D / 8 + kRowThreads - 1) / kRowThreads;  // row vectors per finishing thread
  int dev = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  const bool two = (a.D / COLS) * a.T > sms;  // more CTAs than SMs: two per SM
  switch (rv) {
    case 1: return two ? launch_rv<1, 2>(a, pdl, stream) : launch_rv<1, 1>(a, pdl, stream);
    case 2: return two ? launch_rv<2, 2>(a, pdl, stream) : launch_rv<2, 1>(a, pdl, stream);
    case 3: return two ? launch_rv<3, 2>(a, pdl, stream) : launch_rv<3, 1>(a, pdl, stream);
    case 4: return launch_rv<4, 1>(a, pdl, stream);  // Pro's width: 182 registers, one CTA per SM
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace dsv4
