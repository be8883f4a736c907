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
// as Triton's fp32 division), the rest IEEE. The finish's pieces live in mhc_dev.h (moe.cu's down kernel ends with the
// same finish when it runs the next sublayer's pre).
#include "mhc.h"
#include "mhc_dev.h"

namespace dsv4 {
namespace {

using dev::unpack8;
using dev::warp_sum;
using mhc::HC;
using mhc::MIX;

constexpr int COLS = kMhcCols;
constexpr int kThreads = HC * COLS;         // 256: one element of the CTA's slice per thread
constexpr int kWarps = kThreads / 32;
constexpr int RPW = MIX / kWarps;           // mixer rows per warp (3)
constexpr int kRowThreads = kThreads - 32;  // warps 1..7: the finish's row
static_assert(MIX % kWarps == 0, "mixer rows split evenly over the warps");

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }

// MINB = 2: two CTAs per SM (registers capped at 128; at RV = 3 ptxas spills 20 bytes), for grids past one CTA per
// SM (Flash, 4 tokens: 256 CTAs in one wave instead of two)
template <int RV, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) mhc_boundary_kernel(const MhcArgs a) {
  __shared__ float vals[kThreads];  // the slice's stream values (as stored: bf16)
  __shared__ float mix[MIX];
  __shared__ float red[kWarps];
  __shared__ int last;
  __shared__ float bs[MIX + 3];  // the pre's base, then scale: staged before the wait, read by the finish
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int c = blockIdx.x, t = blockIdx.y, nch = gridDim.x;
  const int D = a.D, nv = D / 8;
  const long long K = static_cast<long long>(HC) * D;
  const int d0 = c * COLS;
  if (tid < MIX + 3) dev::cp_async4(bs + tid, tid < MIX ? a.base + tid : a.scale + (tid - MIX));
  dev::cp_async_commit();

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
      for (int r = 0; r < RPW; ++r) a.part[(static_cast<long long>(t) * MIX + RPW * warp + r) * nch + c] = dots[r];
      if (warp == 0) a.sq[t * nch + c] = sq;
    }
  }

  // arrival: the token's last CTA finishes it (the CTA's writes are ordered before thread 0's acquire-release atomic by
  // the barrier; its acquire orders the finisher's reads, after the next barrier, behind every other CTA's writes)
  __syncthreads();
  if (tid == 0) last = dev::arrive_acq_rel(a.counter + t) == nch - 1;
  dev::cp_async_wait<0>();  // base and scale (landed long ago; no CTA exits with a copy in flight)
  __syncthreads();
  // the dependent kernel launches once every CTA has triggered or exited: the others exit here, the finisher triggers
  // as it starts the finish, so the dependent's CTAs (and their pre-wait weight streams) land beside the finish only,
  // not beside the Sinkhorn of CTAs still mixing (triggering at entry instead: +1.5 us a layer, 40th pass)
  if (!last) return;
  dev::griddep_launch_dependents();

  // the streams of the whole row, every load at once, through L2 (ld.global.cg): this launch's own (other CTAs wrote
  // them) or the input streams (read through the non-coherent cache before: ~0.3 us a layer slower, forty-ninth pass)
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
        q[i][j] = v >= nv ? make_uint4(0, 0, 0, 0) : __ldcg(p);
      }
    }
  }

  // the mixes: the partials summed per lane in chunk order, then a fixed shuffle tree
  mhc::reduce_mixes<RPW, 2>(a.part, a.sq, t, nch, K, a.norm_eps, mix, warp, lane);
  __syncthreads();

  if (warp == 0) {  // post' and the Sinkhorn comb
    mhc::sinkhorn_warp(mix, bs + MIX, bs, a.iters, a.hc_eps, a.post_out + t * HC, a.comb_out + t * HC * HC, lane);
  } else {  // y = sum_j pre_j X_j (bf16), then its RMSNorm
    float pre[HC];
    mhc::pre_weights(mix, bs + MIX, bs, a.hc_eps, pre);
    uint4 yq[RV];  // y as stored: bf16, 8 per vector
    __nv_bfloat16* keep = a.keep == nullptr ? nullptr : a.keep + t * a.keep_stride + *a.keep_slot * D;
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < RV; ++i) mhc::y_vector(q[i], pre, yq[i], ss);  // vectors past the row hold zeros
    const float rinv = mhc::row_rinv(ss, red, warp, lane, D, a.eps);
#pragma unroll
    for (int i = 0; i < RV; ++i) {  // (no early exit: the quantization's shuffles need every lane; rows past the
      const int v = r0 + i * kRowThreads;  // row hold zeros and store nothing)
      const uint4 o = mhc::norm_vector(wq[i], yq[i], rinv);
      if (v < nv) reinterpret_cast<uint4*>(a.y + static_cast<long long>(t) * D)[v] = o;
      if (v < nv && keep != nullptr) reinterpret_cast<uint4*>(keep)[v] = o;
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
