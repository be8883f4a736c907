// One mHC boundary per launch (decode, 1-8 tokens): see mhc.cu.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace dsv4 {

struct MhcArgs {
  const __nv_bfloat16* f;     // [T, D] the sublayer's output, or null: no post (mhc_pre_norm)
  const __nv_bfloat16* x;     // [T, 4, D] the streams
  const float* post;          // [T, 4] (with f)
  const float* comb;          // [T, 4, 4] (with f)
  const float* fn;            // [24, 4 * D] the next pre's mixer
  const float* base;          // [24]
  const float* scale;         // [3]
  const __nv_bfloat16* w;     // [D] the sublayer's RMSNorm weight
  __nv_bfloat16* out;         // [T, 4, D] the new streams (with f)
  __nv_bfloat16* y;           // [T, D] RMSNorm(sum_j pre_j X_j)
  uint8_t* yq;                // [T, D] y's act_quant e4m3 codes (1 x 128 blocks), or null: none (D % 128 == 0)
  float* yqs;                 // [T, D / 128] their power-of-two scales
  float* post_out;            // [T, 4]
  float* comb_out;            // [T, 4, 4]
  float* part;                // [T, 24, D / 64] scratch: the CTAs' partial mixes (per mixer row, CTA order)
  float* sq;                  // [T, D / 64] scratch: their partial sums of squares
  int* counter;               // [T] arrival counters, zero before and after every launch
  __nv_bfloat16* keep;        // or null: y's row t also to keep + t * keep_stride + (*keep_slot) * D (a ring)
  const int64_t* keep_slot;   // [1] the ring slot (with keep)
  long long keep_stride;      // elements between the tokens' rings
  int T, D, iters;
  float hc_eps, norm_eps, eps;
};

constexpr int kMhcCols = 64;  // columns of every stream per CTA
constexpr int kMhcMaxT = 8;
constexpr int kMhcMaxD = 7168;  // the finishing CTA holds the row in registers (4 vectors of 8 per thread)

// D % 64 == 0, D <= 7168, 1 <= T <= 8, iters >= 1 (checked by the binding)
cudaError_t mhc_boundary_launch(const MhcArgs& a, bool pdl, cudaStream_t stream);

}  // namespace dsv4
