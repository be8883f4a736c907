// Bandwidth probe (benchmarks): see probe.cu.
#pragma once
#include <cuda_runtime.h>

namespace dsv4 {

// xor-reads `bytes` (a multiple of 16) from 16-byte aligned `buf`; out: [blocks] x 16 bytes, each CTA's xor
cudaError_t stream_read_launch(const void* buf, long long bytes, void* out, int blocks, int threads,
                               cudaStream_t stream);

}  // namespace dsv4
