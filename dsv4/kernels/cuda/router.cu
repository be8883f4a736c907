// Decode MoE router (SPEC §2.7) for 1-8 tokens in one launch: router_ref's arithmetic up to fp32 summation order and
// expf / log1pf / sqrtf (a few ulp).
//
// Grid ceil(E / 2) CTAs of 256 threads. CTA c copies gate rows 2c and 2c + 1 (bf16, all of D) and the bias into
// shared memory with cp.async before griddepcontrol.wait: they are never written by an earlier kernel, so under
// programmatic dependent launch their bytes (2 MB for Flash) arrive while the previous kernel, the mHC boundary that
// writes x, still runs; the Triton router reads them only after it. After the wait each thread forms fp32 dot products
// over its 8-column vectors in order, then a fixed shuffle tree and the warps in order give the logits (same input,
// same bits).
//
// The last CTA to arrive (an atomic counter that it resets) selects for every token at once (select_all): scores
// (softmax / sigmoid / sqrt(softplus), softplus(v) = v past 20 as torch's), the experts (tid2eid[ids[t]] for hash
// layers, else the k best of score + bias by parallel rank counts, ties to the lowest expert id), and the unbiased
// scores of the chosen ones, normalised (summed in choice order) and times the route scale. A first version selected
// with one warp per token in k serial argmax rounds: ~3000 dependent instructions, 8 us of a 12 us launch.
#include "common.h"
#include "router.h"

namespace dsv4 {
namespace {

using dev::unpack8;
using dev::warp_sum;
using dev::warp_max;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 2;                        // gate rows per CTA
// dynamic shared memory, at most: the gate rows or the selection's arrays, whichever is larger (plus ~3 KB static)
static_assert(kRows * kRouterMaxD * 2 <= 64 * 1024 &&
                  2 * kRouterMaxT * kRouterMaxE * 4 + kRouterMaxT * (kRouterMaxE / 32) * kRouterMaxK * 8 <= 64 * 1024,
              "router smem");

// router_ref's score of one logit; softmax needs the token's max m and sum s of expf(l - m)
__device__ __forceinline__ float score(float l, int func, float m, float s) {
  if (func == 0) return expf(l - m) / s;
  if (func == 1) return 1.0f / (1.0f + expf(-l));
  return sqrtf(l > 20.0f ? l : log1pf(expf(l)));
}

// The selection, by the whole last CTA over every (token, expert) pair at once, in shared memory `sel` (the gate's
// space, sized by router_launch): scores sc [T][E], biased scores vb [T][E], candidates. Expert e of token t is
// choice rank(e) = #{e' : vb[e'] > vb[e] or (vb[e'] == vb[e] and e' < e)} when that is below k (ranks are unique:
// higher biased score first, then the lower id), counted in two parallel steps (within each warp's 32 experts, then
// among the warps' k best): no serial rounds.
__device__ __forceinline__ void select_all(const RouterArgs& a, float* sel, const float* sbias, int tid, int warp,
                                           int lane) {
  __shared__ float stat[2][kRouterMaxT];   // softmax: the token's max and sum of expf(l - max)
  __shared__ int slot[kRouterMaxT][kRouterMaxK];
  const int TE = a.T * a.E;
  float* sc = sel;
  float* vb = sel + TE;
  if (a.func == 0 && warp < a.T) {  // softmax statistics: warp t over token t's logits
    const float* lt = a.logits + warp * a.E;
    float m = -INFINITY;
    for (int e = lane; e < a.E; e += 32) m = fmaxf(m, __ldcg(lt + e));
    m = warp_max(m);
    float s = 0.0f;
    for (int e = lane; e < a.E; e += 32) s += expf(__ldcg(lt + e) - m);
    s = warp_sum(s);
    if (lane == 0) stat[0][warp] = m, stat[1][warp] = s;
  }
  if (a.func == 0) __syncthreads();
  for (int p = tid; p < TE; p += kThreads) {
    const int t = p / a.E, e = p - t * a.E;
    const float v = score(__ldcg(a.logits + p), a.func, a.func == 0 ? stat[0][t] : 0.0f, a.func == 0 ? stat[1][t] : 1.0f);
    sc[p] = v;
    const float b = a.bias != nullptr ? v + sbias[e] : v;
    vb[p] = isnan(b) ? -INFINITY : b;  // ranked last: the ranks stay a permutation (a NaN compares false both ways)
  }
  __syncthreads();
  if (a.tid2eid == nullptr) {
    // 1. rank within the warp (its 32 experts of one token: E % 32 == 0), by shuffles; the warp's k best become
    // candidates cv / ce [T][(E / 32) k] (every warp has k of them: k <= 32)
    const int nc = (a.E / 32) * a.k;
    float* cv = vb + TE;
    int* ce = reinterpret_cast<int*>(cv + a.T * nc);
    for (int p0 = 0; p0 < TE; p0 += kThreads) {
      const int p = p0 + tid;
      if (p0 + warp * 32 >= TE) break;  // warp-uniform
      const int t = p / a.E, e = p - t * a.E;
      const float v = vb[p];
      int rank = 0;
#pragma unroll
      for (int o = 1; o < 32; ++o) {
        const int src = (lane + o) & 31;
        const float ov = __shfl_sync(0xffffffffu, v, src);
        rank += (ov > v) | ((ov == v) & (src < lane));
      }
      if (rank < a.k) {
        const int c = t * nc + (e / 32) * a.k + rank;
        cv[c] = v, ce[c] = e;
      }
    }
    __syncthreads();
    // 2. rank among the token's candidates
    for (int q = tid; q < a.T * nc; q += kThreads) {
      const int t = q / nc;
      const float v = cv[q];
      const int e = ce[q];
      int rank = 0;
      for (int c = t * nc; c < (t + 1) * nc; ++c) rank += (cv[c] > v) | ((cv[c] == v) & (ce[c] < e));
      if (rank < a.k) slot[t][rank] = e;
    }
    __syncthreads();
  }
  if (warp < a.T) {  // token t = warp: lane j < k holds choice j
    const int t = warp;
    float my_w = 0.0f;
    long long my_e = 0;
    if (lane < a.k) {
      if (a.tid2eid != nullptr) {
        my_e = a.tid2eid[a.ids[t] * a.s_tid + lane];
        // an id outside the experts weighs 0 (as in the Triton router), and reads nothing
        my_w = my_e >= 0 && my_e < a.E ? sc[t * a.E + my_e] : 0.0f;
      } else {
        my_e = slot[t][lane];
        my_w = sc[t * a.E + my_e];
      }
    }
    if (a.norm) {  // summed in choice order
      float sum = 0.0f;
      for (int j = 0; j < a.k; ++j) sum += __shfl_sync(0xffffffffu, my_w, j);
      my_w = my_w / sum;
    }
    if (lane < a.k) {
      a.w_out[t * a.k + lane] = my_w * a.route_scale;
      a.i_out[t * a.k + lane] = my_e;
    }
  }
}

__global__ void __launch_bounds__(kThreads) router_kernel(const RouterArgs a) {
  extern __shared__ uint4 gate[];  // [kRows][D / 8]
  __shared__ float red[kWarps][kRows * kRouterMaxT];
  __shared__ int last;
  __shared__ __align__(16) float sbias[kRouterMaxE];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nv = a.D / 8, e0 = blockIdx.x * kRows;

  // the gate rows, before the wait (a row past E is zero-filled)
  for (int i = tid; i < kRows * nv; i += kThreads) {
    const int r = i / nv, e = e0 + r;
    dev::cp_async16(gate + i, a.w + static_cast<long long>(min(e, a.E - 1)) * a.D + (i - r * nv) * 8, e < a.E);
  }
  if (a.bias != nullptr && tid < a.E / 4) dev::cp_async16(sbias + 4 * tid, a.bias + 4 * tid, true);  // for the selection
  dev::cp_async_commit();
  dev::griddep_wait();  // x is the previous kernel's output
  dev::cp_async_wait<0>();
  __syncthreads();

  float acc[kRouterMaxT][kRows];
#pragma unroll
  for (int t = 0; t < kRouterMaxT; ++t)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[t][r] = 0.0f;
  for (int v = tid; v < nv; v += kThreads) {
    float g[kRows][8];
#pragma unroll
    for (int r = 0; r < kRows; ++r) unpack8(gate[r * nv + v], g[r]);
#pragma unroll
    for (int t = 0; t < kRouterMaxT; ++t) {
      if (t < a.T) {
        float xv[8];
        unpack8(*reinterpret_cast<const uint4*>(a.x + static_cast<long long>(t) * a.D + v * 8), xv);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[t][r] = fmaf(xv[i], g[r][i], acc[t][r]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kRouterMaxT; ++t) {
    if (t < a.T) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float s = warp_sum(acc[t][r]);
        if (lane == 0) red[warp][t * kRows + r] = s;
      }
    }
  }
  __syncthreads();
  if (tid < a.T * kRows) {
    const int t = tid / kRows, e = e0 + tid % kRows;
    float s = red[0][tid];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) s += red[w][tid];
    if (e < a.E) a.logits[t * a.E + e] = s;
  }
  __syncthreads();  // the logits written before thread 0's release; every CTA's read below (through L2, __ldcg) after
  if (tid == 0) last = dev::arrive_acq_rel(a.counter) == static_cast<int>(gridDim.x) - 1;  // its acquire
  __syncthreads();
  // the trigger after the logits, not at entry: the dependent's CTAs (moe_up, streaming its pre-wait weights) land
  // beside the selection only, not beside the gate GEMV (at entry: +0.7 us a layer, 40th pass)
  dev::griddep_launch_dependents();
  if (!last) return;
  select_all(a, reinterpret_cast<float*>(gate), sbias, tid, warp, lane);
  if (tid == 0) *a.counter = 0;  // for the next launch (which reads it only after its griddepcontrol.wait)
}

}  // namespace

cudaError_t router_launch(const RouterArgs& a, bool pdl, cudaStream_t stream) {
  const int grid = (a.E + kRows - 1) / kRows;
  // the gate rows, then the selection's scores, biased scores and candidates
  const int smem = max(kRows * a.D * 2, 2 * a.T * a.E * 4 + a.T * (a.E / 32) * a.k * 8);
  // with the static arrays, past the 48 KB a launch gets without opting in at the largest shapes (8 tokens, 512
  // experts, k >= 13)
  const cudaError_t e = cudaFuncSetAttribute(router_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  return launch_pdl(router_kernel, dim3(grid), dim3(kThreads), smem, pdl, stream, a);
}

}  // namespace dsv4
