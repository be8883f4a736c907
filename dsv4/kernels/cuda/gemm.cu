// Prefill GEMM (9+ tokens) on FP8 128x128 block-scaled weights, sm_90a: out[M, N] (bf16) = act_quant(x) @ W^T.
//
// Numerics are DeepSeek's: x is quantized to e4m3 in 1x128 blocks with power-of-two scales (act_quant_kernel, one
// launch before the GEMM), the tensor cores accumulate the exact e4m3 x e4m3 products of one 128-K block, and the
// block's sum is promoted to fp32 with the product of its two scales and added in ascending block order.
//
// gemm_fp8_kernel<BN>, a persistent grid (at most one CTA per SM) over work units = 128 x BN output tiles (BN = 128 or
// 64) x S splits of K. One producer thread streams 128-byte-wide tiles of xq (128 rows) and W (BN rows) through a ring
// of kStages stages with TMA (128-byte swizzle: the layout wgmma reads through its descriptors); two consumer
// warpgroups each run 64 rows x BN columns as four m64nBNk32 wgmma per stage, then promote. Stage hand-off is one
// mbarrier pair per stage (full: the TMA bytes landed; empty: both consumer warpgroups' MMAs on it are complete, one
// arrival each: 256 arrivals cost ~80 ns a stage). The producer runs ahead into the next unit while the consumers
// finish one. setmaxnreg moves registers from the producer warpgroup to the consumers (their accumulator sets spilled
// under the 168-register cap of a 384-thread CTA). At BN = 64 a consumer keeps two accumulator sets: block kb's MMAs
// run while block kb - 1's sum is promoted (one wgmma group in flight; waiting for each block's MMAs before promoting
// it cost wo_b ~2.5 us of 20); at BN = 128 the third 64-float set spills, so each block is waited for.
// - S == 1: the bf16 tile goes out through shared memory as whole 16-byte chunks (4-byte stores straight from the
//   MMA fragments left half-written 32-byte sectors: ~7 us of wq_b's 20 at M = 128).
// - S > 1, where the tiles' clusters of S CTAs fit the GPU at once (cluster): the S units of a tile run on the S CTAs
//   of a thread-block cluster (rank = split), one unit per CTA. Each leaves its fp32 partial in its own shared
//   memory (over the ring, read by then); after a cluster barrier, rank s sums its 128 / S rows of the S partials, read through distributed shared
//   memory, in split order, and writes them; a second cluster barrier keeps every CTA until all reads are done. Through global memory (below) the partials' stores,
//   fence, arrival counter, polling and loads took ~4.5 us of a launch.
// - S > 1 otherwise (clusters of S are placed per GPC: a GPU of 132 SMs may not hold 32 clusters of 4): each unit
//   writes its fp32 partial to a workspace; when all S units of a tile have arrived, unit s sums its 128 / S rows of
//   the S partials in split order. Either way: same input, same bits, no atomics on data, the same sums.
// Programmatic dependent launch: the weight tiles of the first stages are requested before griddepcontrol.wait
// (weights are never written by an earlier kernel); xq and its scales after it.
#include <cuda.h>
#include <cudaTypedefs.h>

#include "common.h"
#include "gemm.h"

namespace dsv4 {
namespace {

using dev::desc_sw128;
using dev::fence_acc;
using dev::griddep_launch_dependents;
using dev::griddep_wait;
using dev::wgmma_commit;
using dev::wgmma_fence;
using dev::wgmma_wait0;
using dev::wgmma_wait1;

constexpr int kTile = 128;                     // BM = BK (and the weights' 128 x 128 scale blocks)
constexpr int kConsumers = 2;                  // warpgroups of 64 rows
constexpr int kThreads = 128 * (kConsumers + 1);
constexpr int kTileBytes = kTile * kTile;      // the activation's e4m3 tile (128 rows x 128 bytes)
// registers per thread after setmaxnreg: 128 x 40 + 256 x 232 <= 64K
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// the pool setmaxnreg redistributes is what the launch allocated: the 384 threads' share, in multiples of 8
static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= (65536 / kThreads) / 8 * 8 * kThreads,
              "setmaxnreg: more registers than the CTA holds");

// an output tile of 128 rows x BN columns (BN = 128 or 64: a 64-wide tile gives twice the tiles, so a split-K whose
// clusters of S = 4 at BN = 128 do not fit the GPU fits as clusters of 2)
template <int BN>
struct TileCfg {
  static_assert(BN == 128 || BN == 64, "BN is 128 or 64");
  static constexpr int kAcc = BN / 2;                   // fp32 accumulators per consumer thread (64 x BN / 128)
  static constexpr int kBBytes = BN * kTile;            // the weight's e4m3 tile
  static constexpr int kStageBytes = kTileBytes + kBBytes;
  // 4 stages at BN = 128 (5 or 6 measured slower, docs/performance.md twenty-first pass); 8 at BN = 64 keep the same
  // weight bytes in flight per SM
  static constexpr int kStages = BN == 128 ? 4 : 8;
  static constexpr int kOutStageBytes = 64 * BN * 2;     // a consumer warpgroup's bf16 out rows (S == 1)
  static constexpr int kPartPitch = BN + 8;              // fp32 partial rows (S > 1): 8 floats of padding spread the banks
  static constexpr int kPartBytes = kTile * kPartPitch * 4;
  // the S == 1 out tile has its own staging (the producer fills the ring with the next unit meanwhile); the cluster
  // path's fp32 partial reuses the ring (one unit per CTA: every copy has landed and been read by then)
  static constexpr int kStagingBytes = kConsumers * kOutStageBytes;
  static_assert(kPartBytes <= kStages * kStageBytes, "the cluster partial must fit the ring");
  static constexpr int kSmemBytes = kStages * kStageBytes + kStagingBytes + 16 * kStages + 16 + 1024;
};

// ---- mbarrier, TMA, wgmma (PTX) ----

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// ---- thread-block cluster: remote mbarrier arrivals and distributed shared memory reads ----

__device__ __forceinline__ uint32_t cluster_addr(uint32_t local, int rank) {  // the same offset in CTA `rank`
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(rank));
  return out;
}

// every thread of every CTA of the cluster: writes before it (shared memory included) are visible to reads after it
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// a 128 x 128-byte box of a 2-D e4m3 tensor map at (column c0, row c1) -> shared memory, completing on bar
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// d[64] (+)= A[64 x k32] * B[128 x k32]^T, e4m3 from shared memory, fp32 accumulators (d = A B when !accumulate).
// Thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 + {0, 8}: d[4j + {0, 1}] at columns
// 8j + 2 (t % 4) + {0, 1} of the first row, d[4j + {2, 3}] of the second.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : DSV4_ACC8(0), DSV4_ACC8(8), DSV4_ACC8(16), DSV4_ACC8(24), DSV4_ACC8(32), DSV4_ACC8(40), DSV4_ACC8(48),
        DSV4_ACC8(56)
      : "l"(da), "l"(db), "r"(accumulate));
}

// the same for B[64 x k32]: d[32], j < 8
__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : DSV4_ACC8(0), DSV4_ACC8(8), DSV4_ACC8(16), DSV4_ACC8(24)
      : "l"(da), "l"(db), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_e4m3(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  wgmma_m64n128k32_e4m3(d, da, db, accumulate);
}
__device__ __forceinline__ void wgmma_e4m3(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  wgmma_m64n64k32_e4m3(d, da, db, accumulate);
}

// ---- activation quantization: one warp per (row, 128-block), 4 values per lane ----

__global__ void __launch_bounds__(256) act_quant_kernel(const ActQuantArgs a) {
  griddep_wait();  // x is the previous kernel's output
  griddep_launch_dependents();
  const int kb_n = a.K / kTile;
  const long long w = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (w >= static_cast<long long>(a.M) * kb_n) return;
  const int lane = threadIdx.x & 31;
  const int m = static_cast<int>(w / kb_n), kb = static_cast<int>(w % kb_n);
  const long long off = static_cast<long long>(m) * a.sx + kb * kTile + lane * 4;
  float v[4];
  if (a.x_f32) {
    const float* x = static_cast<const float*>(a.x) + off;
    if (a.x_vec) {
      const float4 f = *reinterpret_cast<const float4*>(x);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      for (int i = 0; i < 4; ++i) v[i] = x[i];
    }
  } else {
    const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(a.x) + off;
    if (a.x_vec) {
      const uint2 u = *reinterpret_cast<const uint2*>(x);
      const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&u.x);
      const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
      v[0] = __low2float(p0), v[1] = __high2float(p0), v[2] = __low2float(p1), v[3] = __high2float(p1);
    } else {
      for (int i = 0; i < 4; ++i) v[i] = __bfloat162float(x[i]);
    }
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float s, inv;
  dev::ue8m0_scale(amax, s, inv);
  const uint32_t code = dev::e4m3x2_code(v[0], v[1], inv) | (dev::e4m3x2_code(v[2], v[3], inv) << 16);
  *reinterpret_cast<uint32_t*>(a.q + static_cast<long long>(m) * a.K + kb * kTile + lane * 4) = code;
  if (lane == 0) a.s[static_cast<long long>(m) * kb_n + kb] = s;
}

// ---- the GEMM ----

// work unit u: output tile u / S (m fastest; 128 rows x BN columns), 128-K blocks [kb0, kb1) of split u % S
struct Unit {
  int tile, split, m0, n0, kb0, kb1;
  __device__ Unit(const GemmFp8Args& a, int u, int tiles_m, int kb_n, int bn) {
    tile = u / a.S;
    split = u % a.S;
    m0 = (tile % tiles_m) * kTile;
    n0 = (tile / tiles_m) * bn;
    const int per = (kb_n + a.S - 1) / a.S;
    kb0 = min(split * per, kb_n);  // an empty split (K / 128 not a multiple of S): kb0 == kb1 == kb_n
    kb1 = min(kb_n, kb0 + per);
  }
};

__device__ __forceinline__ void consumer_bar() { asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory"); }

// the 128 threads of consumer warpgroup wg (named barrier 2 + wg; a literal id for each)
__device__ __forceinline__ void wg_bar(int wg) {
  if (wg == 0) {
    asm volatile("bar.sync 2, 128;" ::: "memory");
  } else {
    asm volatile("bar.sync 3, 128;" ::: "memory");
  }
}

// split-K: rows [split * 128 / S, (split + 1) * 128 / S) of the tile's S fp32 partials, summed in split order, to out
// as bf16; load(q, r, c) returns split q's float4 at tile row r, column c (a cluster rank's shared memory or the
// workspace). Every consumer thread issues all its loads (BN / 8 float4 over the S partials) before it sums any: one
// round trip, not one per row group (a loop of dependent ones took ~1.8 us of wo_b's launch, through a cluster)
template <int BN, int S, typename Load>
__device__ __forceinline__ void reduce_partials(const GemmFp8Args& a, int split, int m0, int n0, const Load& load) {
  constexpr int kRows = kTile / S, kVec = BN / 4;               // float4 per partial row
  constexpr int kItems = kRows * kVec / (128 * kConsumers);     // per thread: BN / (8 S)
  static_assert(kItems >= 1 && kRows * kVec % (128 * kConsumers) == 0, "whole float4 items per thread");
  float4 p[kItems][S];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int i = threadIdx.x + it * 128 * kConsumers;
#pragma unroll
    for (int q = 0; q < S; ++q) p[it][q] = load(q, split * kRows + i / kVec, 4 * (i % kVec));
  }
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int i = threadIdx.x + it * 128 * kConsumers;
    const int gr = m0 + split * kRows + i / kVec, gc = n0 + 4 * (i % kVec);
    if (gr >= a.M || gc >= a.N) continue;
    float4 sum = p[it][0];
#pragma unroll
    for (int q = 1; q < S; ++q)  // split order
      sum.x += p[it][q].x, sum.y += p[it][q].y, sum.z += p[it][q].z, sum.w += p[it][q].w;
    __nv_bfloat162 lo = __floats2bfloat162_rn(sum.x, sum.y), hi = __floats2bfloat162_rn(sum.z, sum.w);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(a.out + static_cast<long long>(gr) * a.so + gc) = packed;
  }
}

template <int BN, typename Load>
__device__ __forceinline__ void reduce_partials(const GemmFp8Args& a, int split, int m0, int n0, const Load& load) {
  if (a.S == 2) {
    reduce_partials<BN, 2>(a, split, m0, n0, load);
  } else if (a.S == 4) {
    reduce_partials<BN, 4>(a, split, m0, n0, load);
  } else {
    reduce_partials<BN, 8>(a, split, m0, n0, load);
  }
}

template <int BN>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_fp8_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const GemmFp8Args a) {
  using C = TileCfg<BN>;
  constexpr int kStages = C::kStages, kStageBytes = C::kStageBytes, kAcc = C::kAcc, kPartPitch = C::kPartPitch;
  constexpr int kJ = BN / 8;  // 8-column groups of a consumer thread's fragment
  extern __shared__ unsigned char smem_raw[];
  // the swizzle atoms must be 1024-byte aligned
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* staging = smem + kStages * kStageBytes;  // the bf16 out tile (S == 1)
  const uint32_t ring = smem_addr(smem);
  const uint32_t full0 = smem_addr(staging + C::kStagingBytes);  // full[s] = full0 + 8 s, empty[s] = empty0 + 8 s
  const uint32_t empty0 = full0 + 8 * kStages;

  const int wg = threadIdx.x >> 7;
  const int tiles_m = (a.M + kTile - 1) / kTile;
  const int units = tiles_m * ((a.N + BN - 1) / BN) * a.S;
  const int kb_n = a.K / kTile;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == kConsumers) {
    // ---- producer: one thread issues every TMA copy; its warpgroup hands registers to the consumers (without
    // setmaxnreg, the 384-thread launch caps every thread at 168 and the consumers' 2 x 64 accumulators spill) ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs) : "memory");
    if (threadIdx.x == 128 * kConsumers) {
      tma_prefetch_map(&map_a);
      tma_prefetch_map(&map_b);
      int pre = 0;  // the first unit's leading stages: weights before the wait, activations after
      if (static_cast<int>(blockIdx.x) < units) {
        const Unit w(a, blockIdx.x, tiles_m, kb_n, BN);
        pre = min(w.kb1 - w.kb0, kStages);
        for (int i = 0; i < pre; ++i) {
          mbar_expect_tx(full0 + 8 * i, kStageBytes);
          tma_load(ring + i * kStageBytes + kTileBytes, &map_b, full0 + 8 * i, (w.kb0 + i) * kTile, w.n0);
        }
      }
      griddep_wait();
      int it = 0;
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const Unit w(a, u, tiles_m, kb_n, BN);
        for (int kb = w.kb0; kb < w.kb1; ++kb, ++it) {
          const int s = it % kStages;
          const uint32_t full = full0 + 8 * s, dst = ring + s * kStageBytes;
          if (it < pre) {
            tma_load(dst, &map_a, full, kb * kTile, w.m0);
            continue;
          }
          mbar_wait(empty0 + 8 * s, ((it / kStages) & 1) ^ 1);
          mbar_expect_tx(full, kStageBytes);
          tma_load(dst, &map_a, full, kb * kTile, w.m0);
          tma_load(dst + kTileBytes, &map_b, full, kb * kTile, w.n0);
        }
      }
    }
    if (a.cluster) {  // the consumers' two cluster barriers (one unit per CTA)
      __syncwarp();
      cluster_sync();
      cluster_sync();
    }
  } else {
    // ---- consumers: warpgroup wg owns rows [64 wg, 64 wg + 64) of the tile ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs) : "memory");
    griddep_wait();  // xs is the previous kernel's output
    const int tid = threadIdx.x & 127, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int r_wg = warp * 16 + (lane >> 2);  // the thread's first row in the warpgroup's 64 (second: + 8)
    const int r_in = wg * 64 + r_wg;            // ... in the tile
    const int c_in = 2 * (lane & 3);            // its first column in every 8-column group
    unsigned char* stg = staging + wg * C::kOutStageBytes;
    float* cpart = reinterpret_cast<float*>(smem);  // S > 1 through a cluster: this rank's fp32 partial (the ring)
    // at BN = 64 two accumulator sets: block kb's MMAs run on the tensor cores while block kb - 1's sum is promoted. At
    // BN = 128 one set, each block waited for: a second 64-float set spills (~600 bytes, with setmaxnreg at 232 or
    // 240), and the tile's two 64-column halves alternating in flight measured slower (wq_b 16.3-16.9 -> 18.4 us:
    // ptxas serialises those MMAs, C7514, and every A tile is read twice)
    constexpr bool kPipe = BN == 64;
    float acc0[kAcc], acc1[kPipe ? kAcc : 1], tot[kAcc];
    int it = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const Unit w(a, u, tiles_m, kb_n, BN);
      // rows past M (a last tile of M % 128 rows) multiply the zeros TMA fills in and are never stored: every
      // warpgroup runs every MMA, as a conditional wgmma in flight across a branch is serialised by the compiler
      const float* xs0 = a.xs + static_cast<long long>(min(w.m0 + r_in, a.M - 1)) * kb_n;
      const float* xs1 = a.xs + static_cast<long long>(min(w.m0 + r_in + 8, a.M - 1)) * kb_n;
      const float* wsr = a.ws + static_cast<long long>(w.n0 / kTile) * kb_n;  // the weight's 128-row scale block
#pragma unroll
      for (int i = 0; i < kAcc; ++i) tot[i] = 0.0f;
      struct Block {  // a block of K in flight: its ring stage and its two scale products
        int s;
        float f0, f1;
      };
      // the stage of block kb0 + i, once landed, and the block's two scale products
      auto begin = [&](int i) {
        const int kb = w.kb0 + i, s = it++ % kStages;
        const float sb = __ldg(wsr + kb);
        const Block b{s, __ldg(xs0 + kb) * sb, __ldg(xs1 + kb) * sb};
        mbar_wait(full0 + 8 * s, ((it - 1) / kStages) & 1);
        return b;
      };
      // stage s's four MMAs into d (64 x BN), committed as one group
      auto issue = [&](float (&d)[kAcc], int s) {
        const uint32_t st = ring + s * kStageBytes;
        const uint64_t da = desc_sw128(st + wg * 64 * kTile), db = desc_sw128(st + kTileBytes);
        fence_acc(d);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_e4m3(d, da + 2 * k, db + 2 * k, k);
        wgmma_commit();
      };
      // d's block is complete: its stage goes back to the producer, its sum times the two scales into tot
      auto retire = [&](float (&d)[kAcc], const Block& b) {
        fence_acc(d);
        if (tid == 0) mbar_arrive(empty0 + 8 * b.s);
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          tot[4 * j] += d[4 * j] * b.f0;
          tot[4 * j + 1] += d[4 * j + 1] * b.f0;
          tot[4 * j + 2] += d[4 * j + 2] * b.f1;
          tot[4 * j + 3] += d[4 * j + 3] * b.f1;
        }
      };
      const int n = w.kb1 - w.kb0;
      if constexpr (kPipe) {
        if (n > 0) {  // acc0 in flight at the top of every iteration (unrolled by two: the sets alternate branch-free)
          Block b0 = begin(0), b1;
          issue(acc0, b0.s);
          int i = 1;
          for (; i + 1 < n; i += 2) {
            b1 = begin(i);
            issue(acc1, b1.s);
            wgmma_wait1();  // acc0's block is complete
            retire(acc0, b0);
            b0 = begin(i + 1);
            issue(acc0, b0.s);
            wgmma_wait1();
            retire(acc1, b1);
          }
          if (i < n) {
            b1 = begin(i);
            issue(acc1, b1.s);
            wgmma_wait1();
            retire(acc0, b0);
            wgmma_wait0();
            retire(acc1, b1);
          } else {
            wgmma_wait0();
            retire(acc0, b0);
          }
        }
      } else {
        for (int i = 0; i < n; ++i) {
          const Block b = begin(i);
          issue(acc0, b.s);
          wgmma_wait0();
          retire(acc0, b);
        }
      }
      if (a.S > 1 && a.cluster) {
        // ---- split-K across the cluster: this rank's partial -> its shared memory; once every rank's is there,
        // rows [split * 128 / S, (split + 1) * 128 / S) of the S partials summed in split order ----
        consumer_bar();  // both warpgroups' last MMAs have read the ring the partial goes to
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          const int c = 8 * j + c_in;
          *reinterpret_cast<float2*>(cpart + r_in * kPartPitch + c) = make_float2(tot[4 * j], tot[4 * j + 1]);
          *reinterpret_cast<float2*>(cpart + (r_in + 8) * kPartPitch + c) = make_float2(tot[4 * j + 2], tot[4 * j + 3]);
        }
        cluster_sync();  // every rank's partial is in place (the producer warpgroups take part)
        const uint32_t part0 = smem_addr(cpart);
        reduce_partials<BN>(a, w.split, w.m0, w.n0, [&](int q, int r, int c) {
          return ld_cluster_f4(cluster_addr(part0 + (r * kPartPitch + c) * 4, q));
        });
        cluster_sync();  // every rank is done reading the partials: none leaves while another reads its memory
      } else if (a.S > 1) {
        // ---- split-K: every unit leaves its fp32 partial in the workspace; once all S of the tile have (they run in
        // the same wave: the grid is at most one CTA per SM, and a unit only waits for units of the same or the next
        // round), unit s sums rows [s * 128 / S, (s + 1) * 128 / S) of the S partials in split order: the same bits
        // whichever finishes first. The last unit done resets the tile's two counters for the next launch. ----
        float* part = a.part + static_cast<long long>(u) * kTile * BN;
#pragma unroll
        for (int j = 0; j < kJ; ++j) {  // a quad writes 32 contiguous bytes of a row
          const int c = 8 * j + c_in;
          *reinterpret_cast<float2*>(part + r_in * BN + c) = make_float2(tot[4 * j], tot[4 * j + 1]);
          *reinterpret_cast<float2*>(part + (r_in + 8) * BN + c) = make_float2(tot[4 * j + 2], tot[4 * j + 3]);
        }
        __threadfence();
        consumer_bar();
        int* arrived = a.counters + 2 * w.tile;
        if (threadIdx.x == 0) {
          atomicAdd(arrived, 1);
          int seen;
          for (;;) {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(arrived) : "memory");
            if (seen >= a.S) break;
            __nanosleep(64);
          }
        }
        consumer_bar();
        const float* base = a.part + static_cast<long long>(w.tile) * a.S * kTile * BN;
        reduce_partials<BN>(a, w.split, w.m0, w.n0, [&](int q, int r, int c) {
          return __ldcg(reinterpret_cast<const float4*>(base + (static_cast<long long>(q) * kTile + r) * BN + c));
        });
        consumer_bar();  // this unit's reads of the workspace are done
        if (threadIdx.x == 0 && atomicAdd(arrived + 1, 1) == a.S - 1) {
          arrived[0] = 0;
          arrived[1] = 0;
        }
      } else if (w.m0 + wg * 64 < a.M) {  // a warpgroup wholly past M stores nothing
        // ---- the bf16 tile through shared memory (16-byte chunks XOR-swizzled by row), then 16-byte stores:
        // every 32-byte sector of the output is written whole ----
        constexpr int kRowBytes = BN * 2, kChunks = BN / 8;  // a staged row: kChunks 16-byte chunks
        wg_bar(wg);  // the last tile's reads are done
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          const int sw0 = ((j ^ (r_wg & 7)) << 4) + 2 * c_in;
          *reinterpret_cast<__nv_bfloat162*>(stg + r_wg * kRowBytes + sw0) =
              __floats2bfloat162_rn(tot[4 * j], tot[4 * j + 1]);
          *reinterpret_cast<__nv_bfloat162*>(stg + (r_wg + 8) * kRowBytes + sw0) =
              __floats2bfloat162_rn(tot[4 * j + 2], tot[4 * j + 3]);
        }
        wg_bar(wg);
#pragma unroll
        for (int p = 0; p < 64 * kChunks / 128; ++p) {
          const int idx = p * 128 + tid, r = idx / kChunks, ch = idx % kChunks;
          const int gr = w.m0 + wg * 64 + r, gc = w.n0 + ch * 8;
          if (gr < a.M && gc < a.N)
            *reinterpret_cast<uint4*>(a.out + static_cast<long long>(gr) * a.so + gc) =
                *reinterpret_cast<const uint4*>(stg + r * kRowBytes + ((ch ^ (r & 7)) << 4));
        }
      }
    }
  }
  griddep_launch_dependents();
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// rows x cols e4m3 (row stride cols bytes), box_rows x 128-byte boxes, 128-byte swizzle, out-of-range reads as zeros
bool encode_map(CUtensorMap* map, const void* base, int rows, int cols, int box_rows) {
  const auto fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols)};
  const cuuint32_t box[2] = {kTile, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estride[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, estride,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

cudaError_t act_quant_launch(const ActQuantArgs& a, bool pdl, cudaStream_t stream) {
  const long long warps = static_cast<long long>(a.M) * (a.K / kTile);
  if (warps == 0) return cudaSuccess;
  return launch_pdl(act_quant_kernel, dim3(static_cast<unsigned>((warps + 7) / 8)), dim3(256), 0, pdl, stream, a);
}

// clusters of S gemm_fp8_kernel<BN> CTAs that fit the current device at once (S = 2, 4, 8; else 0; 0 when the
// occupancy query fails), cached per device; -1 without a current device
constexpr int kMaxDevices = 64;
template <int BN>
static int cluster_fit(int S) {
  static int fit[kMaxDevices][9] = {};
  if (S < 2 || S > 8 || (S & (S - 1)) != 0) return 0;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  int* slot = dev < kMaxDevices ? &fit[dev][S] : nullptr;
  if (slot != nullptr && *slot != 0) return *slot - 1;  // stored + 1: 0 means "not asked yet"
  const int n =
      max_active_clusters(gemm_fp8_kernel<BN>, S, kThreads, TileCfg<BN>::kSmemBytes, TileCfg<BN>::kSmemBytes);
  if (slot != nullptr) *slot = n + 1;
  return n;
}

int gemm_cluster_fit(int splits, int bn) { return bn == 64 ? cluster_fit<64>(splits) : cluster_fit<128>(splits); }

template <int BN>
static cudaError_t launch(GemmFp8Args a, bool pdl, cudaStream_t stream) {
  CUtensorMap map_a, map_b;
  if (!encode_map(&map_a, a.xq, a.M, a.K, kTile) || !encode_map(&map_b, a.w, a.N, a.K, BN)) return cudaErrorInvalidValue;
  const cudaError_t e =
      cudaFuncSetAttribute(gemm_fp8_kernel<BN>, cudaFuncAttributeMaxDynamicSharedMemorySize, TileCfg<BN>::kSmemBytes);
  if (e != cudaSuccess) return e;
  const int tiles = ((a.M + kTile - 1) / kTile) * ((a.N + BN - 1) / BN);
  const int units = tiles * a.S;
  // split-K through a cluster where every tile's cluster fits at once, else through the workspace (whose units
  // wait for each other: the grid is at most one CTA per SM, all resident)
  a.cluster = a.S > 1 && tiles <= cluster_fit<BN>(a.S);
  if (a.S > 1 && !a.cluster && (a.part == nullptr || a.counters == nullptr)) return cudaErrorInvalidValue;
  return launch_ex(gemm_fp8_kernel<BN>, dim3(static_cast<unsigned>(a.cluster ? units : min(units, a.ctas))),
                   dim3(kThreads), TileCfg<BN>::kSmemBytes, pdl, a.cluster ? a.S : 1, stream, map_a, map_b, a);
}

cudaError_t gemm_fp8_launch(GemmFp8Args a, bool pdl, cudaStream_t stream) {
  if (a.bn == 64) return launch<64>(a, pdl, stream);
  if (a.bn == 128) return launch<128>(a, pdl, stream);
  return cudaErrorInvalidValue;
}

}  // namespace dsv4
