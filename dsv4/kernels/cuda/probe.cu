// Bandwidth probe for the benchmarks (tools/bench_ops.py): a plain read of a buffer, as one launch.
//
// What one kernel reading B bytes takes on this device, its ramp and tail included, is the yardstick for an op that
// streams B bytes of weights in one launch: at 6-33 MB that time sits well above B / copy bandwidth (H200: 8.4 MB
// in ~4 us, 44-50% of copy; 33.6 MB in 9.3-10.4 us, 76-85%). An op whose weight loads start during the previous
// launch (programmatic dependent launch) can beat it; this probe does not overlap its neighbours. Each thread keeps
// kU 16-byte loads in flight (a grid-stride loop over the buffer) and xors what it read; each CTA writes its xor to
// out[blockIdx.x], so every byte is read exactly once and the result is checkable (tests/kernels/test_probe.py).
#include <cstdint>

#include "common.h"
#include "probe.h"

namespace dsv4 {
namespace {

constexpr int kU = 4;  // loads in flight per thread (4 x 16 B: measured best or within 2% at 8-105 MB, H200)

__global__ void __launch_bounds__(1024) stream_read_kernel(const uint4* __restrict__ p, long long n16, uint4* __restrict__ out) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n16; i += stride * kU) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const long long j = i + u * stride;
      v[u] = j < n16 ? __ldg(p + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) acc.x ^= v[u].x, acc.y ^= v[u].y, acc.z ^= v[u].z, acc.w ^= v[u].w;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    acc.x ^= __shfl_xor_sync(0xffffffffu, acc.x, o);
    acc.y ^= __shfl_xor_sync(0xffffffffu, acc.y, o);
    acc.z ^= __shfl_xor_sync(0xffffffffu, acc.z, o);
    acc.w ^= __shfl_xor_sync(0xffffffffu, acc.w, o);
  }
  __shared__ uint4 warps[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warps[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint4 r = make_uint4(0, 0, 0, 0);
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      r.x ^= warps[w].x, r.y ^= warps[w].y, r.z ^= warps[w].z, r.w ^= warps[w].w;
    }
    out[blockIdx.x] = r;
  }
}

}  // namespace

cudaError_t stream_read_launch(const void* buf, long long bytes, void* out, int blocks, int threads,
                               cudaStream_t stream) {
  stream_read_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint4*>(buf), bytes / 16,
                                                     static_cast<uint4*>(out));
  return cudaGetLastError();
}

}  // namespace dsv4
