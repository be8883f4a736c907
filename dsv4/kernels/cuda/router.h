// Decode MoE router in one launch (1-8 tokens): see router.cu.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace dsv4 {

struct RouterArgs {
  const __nv_bfloat16* x;   // [T, D] the FFN's normed input
  const __nv_bfloat16* w;   // [E, D] the gate
  const float* bias;        // [E] score layers; null: hash routing
  const int64_t* tid2eid;   // [vocab, k] (row stride s_tid), hash routing
  const int64_t* ids;       // [T] token ids, hash routing
  float* logits;            // [T, E] scratch
  int* counter;             // [1] arrival counter, zero before and after every launch
  float* w_out;             // [T, k] routing weights
  int64_t* i_out;           // [T, k] expert ids
  long long s_tid;
  int T, E, D, k;
  int func;                 // 0 softmax, 1 sigmoid, 2 sqrtsoftplus
  int norm;                 // normalise the chosen weights (norm_topk, not softmax)
  float route_scale;
};

constexpr int kRouterMaxT = 8;
constexpr int kRouterMaxE = 512;
constexpr int kRouterMaxK = 16;
constexpr int kRouterMaxD = 8192;

// 1 <= T <= 8, E % 32 == 0 with 32 <= E <= 512, 1 <= k <= min(E, 16), D % 8 == 0 with 8 <= D <= 8192, x and w
// 16-byte aligned (checked by the binding)
cudaError_t router_launch(const RouterArgs& a, bool pdl, cudaStream_t stream);

}  // namespace dsv4
