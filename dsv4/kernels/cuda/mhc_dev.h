// Device pieces of an mHC pre's finish (SPEC §2.2) shared by the kernels that end with one: the boundary kernel
// (mhc.cu) and the decode experts' down kernel when it also runs the next sublayer's pre (moe.cu). The CTAs of such a
// launch each leave partial mixes (24 dot products with the mixer rows; stored part[row][CTA]) and a partial sum of
// squares over their columns; the last CTA to arrive reduces them (reduce_mixes), derives post' and the Sinkhorn comb in one warp
// (sinkhorn_warp) and forms y = sum_j pre_j X_j and its RMSNorm in the others (pre_weights, y_norm_stats).
#pragma once
#include "common.h"

namespace dsv4 {
namespace mhc {

constexpr int HC = 4;
constexpr int MIX = (2 + HC) * HC;  // 24

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

// the mixes from each lane's partial sums (s: its rows' chunks, qs: their sums of squares): a fixed shuffle tree, the
// rows scaled by the rsqrt statistic of the whole row (K values), stored into mix[] (shared memory)
template <int RPW>
__device__ __forceinline__ void store_mixes(const float (&s)[RPW], float qs, long long K, float norm_eps, float* mix,
                                            int warp, int lane) {
  qs = dev::warp_sum(qs);
  const float rs = 1.0f / sqrtf(qs / static_cast<float>(K) + norm_eps);
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float m = dev::warp_sum(s[r]) * rs;
    if (lane == 0) mix[RPW * warp + r] = m;
  }
}

// Token t's mixes from the partials of nch CTAs (part [T][24][nch]: each mixer row's chunks side by side, sq [T][nch];
// read through L2): warp w reduces rows RPW w .. RPW w + RPW - 1, each lane summing chunks lane, lane + 32, .. in
// order, then store_mixes. The chunks are loaded B per lane at a time: a batch's loads are in flight at once, and a
// warp's load of one row reads 32 adjacent chunks (chunks past nch add zeros, which leaves the sums as they are).
template <int RPW, int B>
__device__ __forceinline__ void reduce_mixes(const float* part, const float* sq, int t, int nch, long long K,
                                             float norm_eps, float* mix, int warp, int lane) {
  const float* pt = part + (static_cast<long long>(t) * MIX + RPW * warp) * nch;
  const float* st = sq + static_cast<long long>(t) * nch;
  float s[RPW] = {}, qs = 0.0f;
  for (int c0 = 0; c0 < nch; c0 += 32 * B) {
    float v[B][RPW], q[B];
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int ch = c0 + 32 * i + lane;
      const bool ok = ch < nch;
#pragma unroll
      for (int r = 0; r < RPW; ++r) v[i][r] = ok ? __ldcg(pt + static_cast<long long>(r) * nch + ch) : 0.0f;
      q[i] = ok ? __ldcg(st + ch) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < B; ++i) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) s[r] += v[i][r];
      qs += q[i];
    }
  }
  store_mixes<RPW>(s, qs, K, norm_eps, mix, warp, lane);
}

// one warp: post' (lanes 0-3 store post_out[0..3]) and the Sinkhorn comb (lane (i, j) = (e / 4, e % 4), e = lane % 16;
// lanes 0-15 store comb_out[e]) from the mixes
__device__ __forceinline__ void sinkhorn_warp(const float* mix, const float* scale, const float* base, int iters,
                                              float hc_eps, float* post_out, float* comb_out, int lane) {
  if (lane < HC) post_out[lane] = 2.0f * sigmoid(mix[HC + lane] * scale[1] + base[HC + lane]);
  const int e = lane & 15;
  const float cc = mix[2 * HC + e] * scale[2] + base[2 * HC + e];
  float mx = fmaxf(cc, __shfl_xor_sync(0xffffffffu, cc, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float ex = expf(cc - mx);
  float m = div_full(ex, group_sum<1>(ex)) + hc_eps;
  m = div_full(m, group_sum<4>(m) + hc_eps);  // column normalisation first
#pragma unroll 1  // the chain is serial: unrolling buys nothing and grows the code that a finishing CTA runs cold
  for (int it = 1; it < iters; ++it) {
    m = div_full(m, group_sum<1>(m) + hc_eps);
    m = div_full(m, group_sum<4>(m) + hc_eps);
  }
  if (lane < HC * HC) comb_out[lane] = m;
}

// pre_j = sigmoid(mix_j scale_0 + base_j) + hc_eps
__device__ __forceinline__ void pre_weights(const float* mix, const float* scale, const float* base, float hc_eps,
                                            float (&pre)[HC]) {
#pragma unroll
  for (int j = 0; j < HC; ++j) pre[j] = sigmoid(mix[j] * scale[0] + base[j]) + hc_eps;
}

// y = sum_j pre_j X_j over one 8-column vector of the 4 streams (fp32 FMAs in stream order, rounded to bf16, as
// mhc_pre returns it) -> yq (bf16 x 8); ss += y^2 per element in order
__device__ __forceinline__ void y_vector(const uint4 (&q)[HC], const float (&pre)[HC], uint4& yq, float& ss) {
  float xs[HC][8], yv[8];
#pragma unroll
  for (int j = 0; j < HC; ++j) dev::unpack8(q[j], xs[j]);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < HC; ++j) acc = fmaf(pre[j], xs[j][e], acc);
    yv[e] = dev::bf16_round(acc);
    ss = fmaf(yv[e], yv[e], ss);
  }
  __nv_bfloat162* yh = reinterpret_cast<__nv_bfloat162*>(&yq);
#pragma unroll
  for (int e = 0; e < 4; ++e) yh[e] = __floats2bfloat162_rn(yv[2 * e], yv[2 * e + 1]);  // exact: already bf16
}

// the RMSNorm statistic of a row of D values whose squares warps 1-7 of a 256-thread finishing CTA hold (ss, per
// thread): warp sums, then the 7 warps' in order (named barrier 1 among those 224 threads; red: 8 floats of shared
// memory) -> 1 / sqrt(mean + eps)
__device__ __forceinline__ float row_rinv(float ss, float* red, int warp, int lane, int D, float eps) {
  ss = dev::warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  asm volatile("bar.sync 1, 224;" ::: "memory");
  float tot = 0.0f;
#pragma unroll
  for (int w = 1; w < 8; ++w) tot += red[w];
  return 1.0f / sqrtf(tot / static_cast<float>(D) + eps);
}

// RMSNorm of one vector: bf16(w * (y * rinv)) per element
__device__ __forceinline__ uint4 norm_vector(const uint4& wq, const uint4& yq, float rinv) {
  float wv[8], yv[8];
  dev::unpack8(wq, wv);
  dev::unpack8(yq, yv);
  uint4 o;
  __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    oh[e] = __floats2bfloat162_rn(wv[2 * e] * (yv[2 * e] * rinv), wv[2 * e + 1] * (yv[2 * e + 1] * rinv));
  }
  return o;
}

}  // namespace mhc
}  // namespace dsv4
