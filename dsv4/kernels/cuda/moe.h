// Decode MoE experts (one token): MXFP4 routed experts + an FP8 shared expert, two launches. See moe.cu.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace dsv4 {

struct MoeArgs {
  const __nv_bfloat16* x;  // [D]
  // x's FP8 1x128 quantization made by the kernel that wrote x (act_quant_ref's codes [D] e4m3, scales [D/128]
  // fp32), or null: the up kernel quantizes x itself (the same codes)
  const uint8_t* xq;
  const float* xqs;
  const int64_t* idx;      // [k] expert ids
  const float* wts;        // [k] routing weights
  // routed experts, stacked: w1 / w3 [E, I, D/2] e2m1 bytes (low nibble = even k), s1 / s3 [E, I, D/32] E8M0 bytes;
  // w2 [E, D, I/2], s2 [E, D, I/32]
  const uint8_t* w1;
  const uint8_t* s1;
  const uint8_t* w3;
  const uint8_t* s3;
  const uint8_t* w2;
  const uint8_t* s2;
  // shared expert (null when has_shared == 0): v1 / v3 [I, D] e4m3 with fp32 128x128 block scales [I/128, D/128];
  // v2 [D, I], scales [D/128, I/128]
  const uint8_t* v1;
  const float* v1s;
  const uint8_t* v3;
  const float* v3s;
  const uint8_t* v2;
  const float* v2s;
  __nv_bfloat16* h;  // [k + 1, I] scratch: the routed pairs' h rows, then the shared expert's
  __nv_bfloat16* y;  // [D]
  // the FFN's mHC post, fused (null: y only): new streams out[j] = sum_i comb[i, j] streams[i] + post[j] y, [4, D]
  const __nv_bfloat16* streams;
  const float* post;  // [4]
  const float* comb;  // [4, 4]
  __nv_bfloat16* out;
  // the next sublayer's mHC pre and RMSNorm on the new streams (with out; null nfn: none): mhc_pre_norm's outputs
  // ny [D] bf16, npost [4], ncomb [4, 4] fp32, finished by the down kernel's last CTA (see moe.cu)
  const float* nfn;         // [24, 4 D] mixer
  const float* nbase;       // [24]
  const float* nscale;      // [3]
  const __nv_bfloat16* nw;  // [D] the RMSNorm weight
  __nv_bfloat16* ny;
  float* npost;
  float* ncomb;
  float* part;   // [24, D / 16] scratch: the CTAs' partial mixes (per mixer row, CTA order)
  float* sq;     // [D / 16] scratch: their partial sums of squares
  int* counter;  // [1] arrival counter, zero before and after every launch
  int iters;     // Sinkhorn iterations
  float hc_eps, norm_eps, eps;
  int D, I, k, has_shared;
  float limit;       // SwiGLU clamp (<= 0: none)
};

// D % 2048 == 0, I % 512 == 0, 1 <= k <= 6 (checked by the binding).
cudaError_t moe_decode_launch(const MoeArgs& a, bool pdl, cudaStream_t stream);

}  // namespace dsv4
