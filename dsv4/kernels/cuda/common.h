// Device helpers shared by dsv4's CUDA kernels (gemv.cu, moe.cu, mhc.cu, router.cu, ...): programmatic dependent launch, cp.async,
// the mma.sync wrappers and DeepSeek's act_quant scale; launch_pdl on the host side.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace dsv4 {
namespace dev {

constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// A launch's last CTA to arrive finishes its work: after a __syncthreads that orders the CTA's writes before it,
// thread 0 adds 1 to *counter with acquire-release semantics at GPU scope (its release covers the CTA's writes, its
// acquire orders the CTA's later reads, after the next __syncthreads, behind every earlier CTA's release: MEMBAR.ALL,
// the atomic, an L1 invalidate; two __threadfence()s would be two sequentially consistent MEMBAR.SC). Thread 0 only:
// the counter's previous value
__device__ __forceinline__ int arrive_acq_rel(int* counter) {
  int prev;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counter) : "memory");
  return prev;
}

// 16 bytes global -> shared, asynchronously (zero-filled when !ok). Weights travel this way so that their loads are
// issued before griddepcontrol.wait: ptxas sinks plain register loads below the wait, cp.async it keeps in place.
// No L2 eviction hint (.L2::cache_hint with an evict_first policy): it bought nothing in the decode graphs (fiftieth
// pass), and ptxas 13.0 miscompiled it inlined into gemv_kernel (undefined descriptor registers: illegal instruction).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

// 4 bytes global -> shared, asynchronously (cached in L1 too: cp.async.cg takes only 16)
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// d += A * B, m16n8k<K>, fp32 accumulation: one wrapper per operand type
#define DSV4_MMA_M16N8(NAME, SHAPE_TYPES)                                                                        \
  __device__ __forceinline__ void NAME(float(&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,       \
                                       uint32_t b0, uint32_t b1) {                                             \
    asm volatile("mma.sync.aligned." SHAPE_TYPES                                                               \
                 " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                            \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                              \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                                      \
  }
DSV4_MMA_M16N8(mma_e4m3, "m16n8k32.row.col.f32.e4m3.e4m3.f32")
DSV4_MMA_M16N8(mma_bf16, "m16n8k16.row.col.f32.bf16.bf16.f32")
DSV4_MMA_M16N8(mma_f16, "m16n8k16.row.col.f32.f16.f16.f32")
#undef DSV4_MMA_M16N8

// d = A * B (f16, m16n8k16), from a zero accumulator
__device__ __forceinline__ void mma_f16_zero(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

// the e4m3 codes in bits 0..15 (lo) or 16..31 (hi) of a word -> two f16 of the same values (exact)
// (the halves are taken with mov.b32 {lo, hi}, which costs nothing: the conversion reads a register half directly)
__device__ __forceinline__ uint32_t e4m3_lo_f16x2(uint32_t w) {
  uint32_t out;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(out) : "r"(w));
  return out;
}
__device__ __forceinline__ uint32_t e4m3_hi_f16x2(uint32_t w) {
  uint32_t out;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(out) : "r"(w));
  return out;
}

// A (16 rows x k32, e4m3: a0/a2 row g, a1/a3 row g + 8, as mma m16n8k32 takes them) times B (x as f16, 4 words: k
// slots of a0, then of a2) as two f16 MMAs: sm_90 runs e4m3 mma.sync this way anyway, but would convert B at every call
__device__ __forceinline__ void mma_e4m3_f16x(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint4 b, bool zero) {
  if (zero) {
    mma_f16_zero(d, e4m3_lo_f16x2(a0), e4m3_lo_f16x2(a1), e4m3_hi_f16x2(a0), e4m3_hi_f16x2(a1), b.x, b.y);
  } else {
    mma_f16(d, e4m3_lo_f16x2(a0), e4m3_lo_f16x2(a1), e4m3_hi_f16x2(a0), e4m3_hi_f16x2(a1), b.x, b.y);
  }
  mma_f16(d, e4m3_lo_f16x2(a2), e4m3_lo_f16x2(a3), e4m3_hi_f16x2(a2), e4m3_hi_f16x2(a3), b.z, b.w);
}

// eight bf16 (one 16-byte vector) -> fp32
__device__ __forceinline__ void unpack8(const uint4& q, float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}

// over the 32 lanes of a warp, a fixed xor-shuffle tree (every lane gets the result)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// v rounded to bf16 (nearest even), as fp32
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// act_quant's power-of-two scale: s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))) from the exponent bits, and 1/s.
__device__ __forceinline__ void ue8m0_scale(float amax, float& s, float& inv) {
  const float y = fmaxf(amax, kAmaxFloor) * (1.0f / kFp8Max);
  const uint32_t bits = __float_as_uint(y);
  const int e = static_cast<int>((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0 ? 1 : 0);
  s = __uint_as_float(static_cast<uint32_t>(e) << 23);
  inv = __uint_as_float(static_cast<uint32_t>(254 - e) << 23);
}

// v / s rounded to e4m3 (RNE), saturating at +-448: act_quant's code for one element. |v / s| <= 448 holds already
// (s >= amax / 448, a power of two); NaN stays NaN, as in the reference.
__device__ __forceinline__ uint32_t e4m3_code(float v, float inv) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(v * inv, __NV_SATFINITE, __NV_E4M3));
}

// two elements in one conversion: a -> bits 0..7, b -> bits 8..15
__device__ __forceinline__ uint32_t e4m3x2_code(float a, float b, float inv) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a * inv, b * inv), __NV_SATFINITE, __NV_E4M3));
}

// ---- wgmma (sm_90a): shared-memory matrix descriptors, fences, groups ----

// a descriptor of a 128-byte-swizzled operand (swizzle atoms: 8 rows of 128 bytes, 16-byte chunk c of row i at chunk
// c ^ (i & 7), 1024-byte aligned) at shared address saddr, with leading / stride byte offsets lbo / sbo
__device__ __forceinline__ uint64_t desc_sw128_ex(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// K-major operand: rows of 128 bytes, 8-row atoms 1024 bytes apart (stride byte offset), the leading byte offset
// unused; a k-step inside the atom advances the start address by its bytes (32 for k16 bf16 or k32 e4m3)
__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr) { return desc_sw128_ex(saddr, 16, 1024); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// this thread's generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy (wgmma
// operands); a barrier after it covers the other threads'
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// keeps the compiler from reading an accumulator before wgmma.wait_group has returned
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define DSV4_ACC8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

}  // namespace dev

// kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx: as a programmatic dependent launch when
// pdl (its CTAs may start while the previous kernel runs, and wait for it at griddepcontrol.wait), and in thread-block
// clusters of cluster_x CTAs along x when cluster_x > 1
template <typename... Params, typename... Args>
inline cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, bool pdl, int cluster_x,
                             cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = static_cast<unsigned>(cluster_x);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// clusters of cluster_x CTAs of `kernel` (`threads` each, dyn_smem bytes of dynamic shared memory) the current device
// holds at once; 0 when it cannot run them. Sets the kernel's dynamic shared memory attribute to attr_smem (>= dyn_smem:
// the most its launches take) and, past 8 CTAs, allows the non-portable cluster size; leaves no error behind
template <typename... Params>
inline int max_active_clusters(void (*kernel)(Params...), int cluster_x, int threads, int dyn_smem, int attr_smem) {
  int n = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, attr_smem) == cudaSuccess &&
      (cluster_x <= 8 || cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess)) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(cluster_x), 1, 1);
    cfg.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
    cfg.dynamicSmemBytes = dyn_smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(cluster_x);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) n = 0;
  }
  (void)cudaGetLastError();
  return n > 0 ? n : 0;
}

// launch_ex without clusters
template <typename... Params, typename... Args>
inline cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, bool pdl,
                              cudaStream_t stream, const Args&... args) {
  return launch_ex(kernel, grid, block, smem, pdl, 1, stream, args...);
}

}  // namespace dsv4
