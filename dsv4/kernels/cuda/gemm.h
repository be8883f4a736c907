// Prefill GEMM (9+ tokens) on FP8 128x128 block-scaled weights, sm_90a: TMA + warp-specialized FP8 wgmma. See gemm.cu.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace dsv4 {

struct ActQuantArgs {
  const void* x;  // [M, K] bf16 or fp32 (x_f32), row stride sx elements, unit column stride
  long long sx;
  uint8_t* q;     // [M, K] e4m3 codes, contiguous
  float* s;       // [M, K / 128] fp32 power-of-two scales, contiguous
  int M, K;
  int x_f32;
  int x_vec;      // x rows 16-byte aligned (base and stride): vector loads
};

// K % 128 == 0 (checked by the binding).
cudaError_t act_quant_launch(const ActQuantArgs& a, bool pdl, cudaStream_t stream);

struct GemmFp8Args {
  const uint8_t* xq;     // [M, K] e4m3, contiguous (act_quant's q)
  const float* xs;       // [M, K / 128] fp32 (act_quant's s)
  const uint8_t* w;      // [N, K] e4m3, contiguous
  const float* ws;       // [ceil(N / 128), K / 128] fp32 block scales
  int bn;                // output tile columns: 128, or 64 (twice the tiles: a split-K's clusters fit more often)
  __nv_bfloat16* out;    // [M, N] bf16, row stride so elements
  long long so;
  int M, N, K;
  int S;                 // splits of K per output tile, 1..8
  int ctas;              // CTAs of the persistent grid (at most one per work unit)
  float* part;           // S > 1 without clusters: [tiles * S, 128, bn] fp32 partials (workspace), else may be null
  int* counters;         // likewise: two int32 per output tile (arrived, done), zero before and after a launch
  int cluster;           // set by the launcher: S > 1 through a thread-block cluster (part and counters unused)
};

// Tensor maps are encoded on the host for every launch (a few microseconds; prefill only). K % 128 == 0,
// N % 8 == 0, 16-byte aligned xq / w / out rows (checked by the binding).
cudaError_t gemm_fp8_launch(GemmFp8Args a, bool pdl, cudaStream_t stream);

// clusters of `splits` GEMM CTAs (tiles `bn` wide) the current device holds at once (0 where none, or splits other than
// 2, 4, 8, or the occupancy query failed; -1 without a current device). Split-K without a workspace needs every tile's
// cluster to fit.
int gemm_cluster_fit(int splits, int bn);

}  // namespace dsv4
