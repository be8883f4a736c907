// Skinny GEMV (decode, 1-8 tokens) on FP8 block-scaled or bf16 weights: see gemv.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dsv4 {

struct GemvArgs {
  const void* x;      // [M, K] (or [M, groups * K]) bf16 or fp32 (x_f32), row stride sx elements, unit column stride
  long long sx;
  const void* w;      // [N, K] e4m3 or bf16, contiguous
  const float* ws;    // fp8: [ceil(N/128), ws_ld] fp32 block scales; else unused
  int ws_ld;
  void* out;          // [M, N] bf16 or fp32 (out_f32), row stride so elements
  long long so;
  int M, N, K;
  int S;              // CTAs per cluster along K (gridDim.x), 1..8
  int WR;             // 16-row groups per CTA (1, 2, 4, 8); the 8 / WR warps per group split the CTA's columns
  int nchunk;         // chunks of nstep steps per warp, streamed through the ring
  int ks;             // columns per CTA = (8 / WR) * nchunk * nstep * (64 fp8 | 32 bf16)
  int x_f32, out_f32;
  int x_vec;          // x rows 16-byte aligned (base and stride): vector loads
  int xg_rows;        // 0, or rows per x group: rows [g * xg_rows, (g + 1) * xg_rows) read x[:, g * K : (g + 1) * K]
  const __nv_bfloat16* norm_w;  // fmt 1 with bf16 x: [K] RMSNorm weight applied to each x row first (else null)
  float norm_eps;
};

// fmt: 0 bf16 weights, 1 fp8 weights with x quantized to e4m3 (act_quant), 2 fp8 weights with x unquantized (bf16)
int gemv_smem_bytes(int fmt, int x_split, int M, int ks, int WR, int nstep, int nchunk);
cudaError_t gemv_launch(const GemvArgs& a, int fmt, int nstep, bool pdl, cudaStream_t stream);

}  // namespace dsv4
