// Top-k of the Lightning Indexer's scores (topk_select_ref's contract, SPEC §2.5): per query row the k best of its
// first nvis entries, in descending score order with ties to the lower entry, as int32 entry indices; -1 past the
// number of entries above -inf. Bit for bit the reference's list.
//
// Two kernels. Prefill chunks (9 or more rows) of 16-bit scores of up to 32K entries: one CTA of 1024 threads per row,
// a single histogram of all 65536 keys (topk16_cta_kernel, below). Everything else (decode rows, fp32, longer rows):
// one thread-block cluster of C = 1, 2, 4, 8 or 16 CTAs (512 threads each) per row (16, a non-portable size, past
// 16K entries where the device holds every row's cluster at once); CTA r holds the r-th slice of the
// row (SL entries, a multiple of 8) as order-preserving 32-bit keys in shared memory (bf16 / f16 scores in the high
// 16 bits; -0.0 as +0.0, as torch compares them; -inf and invisible entries are never candidates). Then:
// 1. radix select over the cluster, digits of 12 + 4 bits (16-bit scores) or 12 + 12 + 8 (fp32): every CTA builds a
//    histogram of the digit over its keys still on the prefix (plain shared atomics: 12-bit digits spread even
//    scores of one exponent over many bins); a 12-bit digit's bins are also summed 16 at a time. After a cluster
//    barrier every CTA reads all C coarse histograms through distributed shared memory and finds the same coarse
//    bin (where the count from the top reaches the number still to take), then, in one warp, the fine bin inside it
//    from the C CTAs' 16 fine bins; and every CTA's count of keys above the digit. The result: the k-th largest key
//    T, how many keys equal to T are taken (krem: the lowest entries), and per CTA how many keys lie above T and
//    equal T;
// 1'. instead, 16-bit scores in slices of at most 8192 keys (rows of up to 8192 x C entries): every CTA counts its keys
//    in one histogram of all 65536 keys (16-bit counts, 128 KB, zeroed before the wait while the scores' kernel
//    finishes; in the layers that zeroing is hidden, zeroing only the used parts after the wait is slower) and sums it
//    in 256 coarse bins (16-bit sums, two a word). After one cluster barrier every CTA copies the C CTAs' coarse sums
//    (16-byte reads), finds the coarse bin, copies that bin's 256 counts from each CTA and finds T and the per-CTA
//    counts as above; when the kept keys lie in at most kSpan coarse bins (usually 1-2), the same copy brings the
//    others, and step 2' (rank_from_counts) places every kept key from the counts instead of steps 2 and 3 (no list,
//    no last barrier);
// 2. each CTA stores its kept keys as (key, ~entry) pairs into every CTA's list, at offsets those counts give (keys
//    equal to T after all keys above it, in CTA order; within a CTA by entry when only some of them are kept);
// 3. after the last cluster barrier, CTA r ranks its share of the list against the whole list (8 threads per pair, 16
//    in clusters of 16, where a CTA's share is half as long):
//    a pair's rank is the number of larger pairs, and the pairs are distinct, so o[rank] = entry is the reference's
//    order (descending score, ties to the lower entry).
// Two cluster barriers for 16-bit scores in short slices (one and an arrive / wait pair through step 2'; three in
// longer slices, four for fp32), no global scratch, no host sync (counts are read on the device: graph-safe).
// Programmatic dependent launch: it waits for the scores' kernel before reading anything.
// Every phase is a short dependent chain, so the kernel's cost is mostly fixed (~8.0 us for 32K entries, ~17.5 us for
// 256K on an H200; its per-CTA sums over a warp are single redux.sync instructions, and a coarse bin's 16 fine bins
// are summed by one thread: 1.2-1.4 us less than shuffle trees, docs/performance.md fifty-third pass): it serves long
// decode rows and prefill chunks of more than 32K entries; the Triton kernels are faster on short rows, and the
// one-CTA kernel on prefill chunks of 4K-32K 16-bit entries (dsv4/ops/indexer_cuda.py: topk_prefers).
// NaN scores (never produced by the model) are ordered by their bits in both kernels: a positive NaN above +inf, a
// negative one below -inf (dropped), where the reference's sort puts every NaN first.
#include <cooperative_groups.h>

#include "common.h"
#include "topk.h"

namespace cg = cooperative_groups;

namespace dsv4 {
namespace {

using dev::griddep_launch_dependents;
using dev::griddep_wait;

constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kSliceMax = kTopkMaxN / 8;  // keys of one CTA (128 KB)
constexpr int kMaxC = 16;                 // CTAs of the widest cluster
constexpr int kMaxDevices = 64;           // devices whose shared-memory opt-in is remembered

constexpr int kSub = 16;                 // fine bins per coarse bin of a 12-bit digit

struct alignas(16) Small {
  int hist[2][4096];   // this CTA's histogram of a digit (up to 12 bits), double-buffered across passes (the others
  int coarse[2][256];  // read it after a barrier); its sums over 16 bins when the digit has 12 bits
  int wsum[kWarps];    // scan / reduction partials
  int part[9][kMaxC];  // [warp][CTA]: keys above the digit (warps 0..7: coarse bins, 8: fine bins)
  int gt[kMaxC];       // per CTA of the cluster: keys above T
  int eqc[kMaxC];      // per CTA: keys equal to T
  int digit, krem, fdigit, fkrem, cgt, ceq;
  int cmax;  // step 1': the highest coarse bin with keys, over the cluster
};

__host__ __device__ constexpr int slice_len(int N, int C) { return ((N + C - 1) / C + 7) / 8 * 8; }

__host__ __device__ constexpr int rounds(int SL) { return (SL + kThreads - 1) / kThreads; }

// dynamic shared memory: Small, the list (K pairs), the slice's keys, the per-(round, warp) tie counts
// 16-bit scores in a cluster, slices of at most kWideSL keys: one histogram of all 65536 keys a CTA (16-bit counts, two
// a word, 128 KB after the rest), so that T is found after one cluster barrier (the kernel's step 1')
constexpr int kWideSL = 8192;
constexpr int kWideBytes = 65536 * 2;
__host__ __device__ constexpr bool wide_path(int C, int kind, int SL) { return C > 1 && kind != 2 && SL <= kWideSL; }
// step 2' (below) when the kept keys lie in at most kSpan coarse bins; its arrays after the 16-bit histogram: per bin of
// the span its place (P), per (round, warp) the keys above T and equal to T
constexpr int kSpan = 3;
constexpr int kWideExtra = 4 * (kSpan * 256 + 2 * ((kWideSL + 511) / 512) * 16);

__host__ __device__ constexpr int smem_bytes(int SL, int K) {
  return static_cast<int>(sizeof(Small)) + 8 * ((K + 1) / 2 * 2) + 4 * SL + 4 * rounds(SL) * kWarps;
}

// order-preserving keys (a larger score has a larger key); -0.0 as +0.0. 16-bit scores land in the high half.
__device__ __forceinline__ uint32_t key16(uint32_t b) {
  b &= 0xFFFFu;
  if ((b & 0x7FFFu) == 0) b = 0;
  return ((b & 0x8000u) ? (~b & 0xFFFFu) : (b | 0x8000u)) << 16;
}
__device__ __forceinline__ uint32_t key32(uint32_t b) {
  if ((b & 0x7FFFFFFFu) == 0) b = 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// the key of -inf per score kind: only keys above it are candidates (an invisible entry's key is 0)
__device__ __forceinline__ uint32_t neg_inf_key(int kind) {
  return kind == 0 ? 0x007F0000u : kind == 1 ? 0x03FF0000u : 0x007FFFFFu;
}

// exclusive prefix sums of g[0, L) in place (each thread scans a segment of consecutive items); every thread
// synchronizes inside, and the caller again before g is read back
__device__ __forceinline__ void block_exscan(int* g, int L, int* red) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (L + kThreads - 1) / kThreads, lo = tid * per;
  int sum = 0;
  for (int q = 0; q < per; ++q) sum += lo + q < L ? g[lo + q] : 0;
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) red[warp] = incl;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += red[w];
  int run = before + incl - sum;
  for (int q = 0; q < per; ++q) {
    if (lo + q < L) {
      const int t = g[lo + q];
      g[lo + q] = run;
      run += t;
    }
  }
}

// suffix sums over threads 0..255 of v (bins from the top: thread t gets v[t] + ... + v[255]) and their total; every
// thread calls it (a block barrier inside; threads past 255 get v plus nothing); wsum: 8 ints of scratch
__device__ __forceinline__ int suffix_sum_256(int v, int* wsum, int& total) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int suf = v;
  if (warp < 8) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_down_sync(kFull, suf, o);
      if (lane + o < 32) suf += y;
    }
    if (lane == 0) wsum[warp] = suf;
  }
  __syncthreads();
  total = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    total += wsum[w];
    if (w > warp) suf += wsum[w];
  }
  return suf;
}

// the slice's scores -> keys[0, SL): entries at or past nv (this slice's visible count) and keys at or below -inf's
// become 0. 16-byte loads where the slice starts 16-byte aligned, else one element per load.
__device__ __forceinline__ void load_keys(const TopkArgs& a, const unsigned char* xs, int nv, uint32_t* keys,
                                          int SL) {
  const int tid = threadIdx.x;
  const uint32_t neg = neg_inf_key(a.kind);
  const int esz = a.kind == 2 ? 4 : 2;
  const int vec = 16 / esz;
  // 16-byte chunks of visible entries only (none when the slice is not 16-byte aligned)
  const int full = (reinterpret_cast<uintptr_t>(xs) & 15) == 0 ? nv / vec : 0;
#pragma unroll 4
  for (int c = tid; c < full; c += kThreads) {
    const uint4 w = __ldcg(reinterpret_cast<const uint4*>(xs) + c);
    const uint32_t* p = &w.x;
    uint4 k0, k1;
    uint32_t* kk0 = &k0.x;
    uint32_t* kk1 = &k1.x;
    if (esz == 2) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint32_t lo = key16(p[q]), hi = key16(p[q] >> 16);
        uint32_t* dst = q < 2 ? kk0 + 2 * q : kk1 + 2 * (q - 2);
        dst[0] = lo > neg ? lo : 0u;
        dst[1] = hi > neg ? hi : 0u;
      }
      reinterpret_cast<uint4*>(keys)[2 * c] = k0;
      reinterpret_cast<uint4*>(keys)[2 * c + 1] = k1;
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t k = key32(p[q]);
        kk0[q] = k > neg ? k : 0u;
      }
      reinterpret_cast<uint4*>(keys)[c] = k0;
    }
  }
  // the rest (the chunk with the last visible entry, those past it, an unaligned slice): one element at a time
  for (int i = full * vec + tid; i < SL; i += kThreads) {
    uint32_t k = 0;
    if (i < nv) {
      k = esz == 4 ? key32(reinterpret_cast<const uint32_t*>(xs)[i]) : key16(reinterpret_cast<const uint16_t*>(xs)[i]);
      k = k > neg ? k : 0u;
    }
    keys[i] = k;
  }
}

// pair = (key, ~entry): larger = better score, ties to the lower entry; distinct for distinct entries
__device__ __forceinline__ unsigned long long make_pair(uint32_t key, int entry) {
  return (static_cast<unsigned long long>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(entry));
}

// the offset of the wide histogram in dynamic shared memory, and the kernel's whole dynamic shared memory
__host__ __device__ constexpr int wide_offset(int SL, int K) { return (smem_bytes(SL, K) + 15) / 16 * 16; }
__host__ __device__ constexpr int smem_total(int C, int kind, int SL, int K) {
  return wide_path(C, kind, SL) ? wide_offset(SL, K) + kWideBytes + kWideExtra : smem_bytes(SL, K);
}
// the 16-bit histogram's limits: a bin's count and a coarse bin's sum (at most a slice) fit 16 bits; the copy of one
// coarse bin from every CTA ([CTA][256]) fits hist[0]; the widest slice fits Hopper's 227 KB of shared memory a CTA
static_assert(kWideSL < 65536 && kMaxC * 256 <= 4096, "topk: the 16-bit histogram's counts or copy do not fit");
// step 2': the span's other coarse bins from every CTA, packed ([CTA][kSpan - 1][128 words]), fit hist[1]; its arrays
static_assert(kMaxC * (kSpan - 1) * 128 <= 4096 && kThreads == 512 && kWarps == 16 && 2 * kThreads >= kSpan * 256,
              "topk: step 2' layout");
static_assert(smem_total(kMaxC, 0, kWideSL, kTopkMaxK) <= 227 * 1024, "topk: the widest 16-bit slice's shared memory");
// the clusters' shared-memory opt-in: the widest slice of either path
constexpr int kClusterSmemMax = smem_bytes(kSliceMax, kTopkMaxK) > smem_total(kMaxC, 0, kWideSL, kTopkMaxK)
                                    ? smem_bytes(kSliceMax, kTopkMaxK)
                                    : smem_total(kMaxC, 0, kWideSL, kTopkMaxK);

// Step 2' (16-bit path, the kept keys in coarse bins dc .. cmax, at most kSpan): every kept key's place from counts,
// no list. A key k above T: the cluster's keys in bins above k's (an exclusive scan over the span's bins from the top)
// plus the keys in k's bin in the CTAs before this one plus this CTA's keys equal to k at lower entries; a key equal to
// T: the keys above T, the ties in the CTAs before, its rank among this CTA's ties by entry (kept below eq_take). Each
// CTA writes its own entries. Four block phases: (A) per bin of the span its cluster count and the CTAs-before count,
// scanned within each warp, and per (round, warp) the keys above T and equal to T; (B) the bins' places, the two
// per-(round, warp) scans; (C) this CTA's keys above T compacted in entry order, the ties written; (D) each compacted
// key written at its bin's place plus its rank among equal keys (a warp match, and earlier chunks only where this CTA
// holds the key more than once).
template <int C>
__device__ __forceinline__ void rank_from_counts(const TopkArgs& a, Small& sm, const uint32_t* keys, uint2* ck,
                                                 const uint32_t* h16, int* P, uint32_t T, int krem, int dc, int cmax,
                                                 int r, int p0, int SL, int* out) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int R = rounds(SL), RW = R * kWarps;
  int* cgt = P + kSpan * 256;  // [R * kWarps]: keys above T per (round, warp), then their exclusive scan
  int* ceq = cgt + RW;         // the same for the keys equal to T
  int gt_total = 0, eq_before = 0;
#pragma unroll
  for (int rr = 0; rr < C; ++rr) {
    gt_total += sm.gt[rr];
    if (rr < r) eq_before += sm.eqc[rr];
  }
  const int m = gt_total + krem, gt_here = sm.gt[r];
  const int eq_take = min(max(krem - eq_before, 0), sm.eqc[r]);
  const int* copy = sm.hist[0];                                            // [CTA][256]: coarse bin dc
  const uint32_t* xtab = reinterpret_cast<const uint32_t*>(sm.hist[1]);  // [CTA][kSpan - 1][128 words]: dc + 1 ..
  const int nb = (cmax - dc + 1) * 256;
  const unsigned lt = (1u << lane) - 1u;

  // (A) bins j = 2 tid, 2 tid + 1 of the span from the top: j = (cmax - c) * 256 + 255 - f for bin f of coarse bin c
  int g[2] = {0, 0}, bb[2] = {0, 0};
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int j = 2 * tid + q;
    if (j < nb) {
      const int x = cmax - dc - (j >> 8), f = 255 - (j & 255);  // x: the coarse bin's place above dc (0: dc itself)
#pragma unroll
      for (int rr = 0; rr < C; ++rr) {
        const int c = x == 0 ? copy[rr * 256 + f]
                             : static_cast<int>((xtab[(rr * (kSpan - 1) + x - 1) * 128 + (f >> 1)] >> (16 * (f & 1))) &
                                                0xFFFFu);
        g[q] += c;
        bb[q] += rr < r ? c : 0;
      }
    }
  }
  const int s2 = g[0] + g[1];
  int incl = s2;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) sm.wsum[warp] = incl;
#pragma unroll 1
  for (int rd = 0; rd < R; ++rd) {
    const int p = rd * kThreads + tid;
    const uint32_t k = p < SL ? keys[p] : 0u;
    const unsigned ba = __ballot_sync(kFull, k > T), bt = __ballot_sync(kFull, k == T);
    if (lane == 0) cgt[rd * kWarps + warp] = __popc(ba), ceq[rd * kWarps + warp] = __popc(bt);
  }
  __syncthreads();

  // (B) the places; warps 0 and 1 scan the per-(round, warp) counts (segments of consecutive items a lane)
  {
    const int off = __reduce_add_sync(kFull, lane < warp ? sm.wsum[lane] : 0);
    const int e0 = off + incl - s2;
    if (2 * tid < nb) P[2 * tid] = e0 + bb[0];
    if (2 * tid + 1 < nb) P[2 * tid + 1] = e0 + g[0] + bb[1];
  }
  if (warp < 2) {
    int* c = warp == 0 ? cgt : ceq;
    const int per = (RW + 31) / 32, lo = lane * per;
    int sum = 0;
    for (int q = 0; q < per; ++q) sum += lo + q < RW ? c[lo + q] : 0;
    int run = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, run, o);
      if (lane >= o) run += y;
    }
    run -= sum;
    for (int q = 0; q < per; ++q) {
      if (lo + q < RW) {
        const int t = c[lo + q];
        c[lo + q] = run;
        run += t;
      }
    }
  }
  __syncthreads();

  // (C) the keys above T compacted in entry order as (bin, slice position); the kept ties written
#pragma unroll 1
  for (int rd = 0; rd < R; ++rd) {
    const int p = rd * kThreads + tid;
    const uint32_t k = p < SL ? keys[p] : 0u;
    const unsigned ba = __ballot_sync(kFull, k > T), bt = __ballot_sync(kFull, k == T);
    if (k > T) ck[cgt[rd * kWarps + warp] + __popc(ba & lt)] = make_uint2(k >> 16, static_cast<uint32_t>(p));
    if (k == T) {
      const int rank = ceq[rd * kWarps + warp] + __popc(bt & lt);
      if (rank < eq_take) out[gt_total + eq_before + rank] = p0 + p;
    }
  }
  __syncthreads();

  // (D) chunks of 32 compacted keys a warp: a key's place is its bin's plus the equal keys before it in this CTA
#pragma unroll 1
  for (int c0 = warp * 32; c0 < gt_here; c0 += kThreads) {
    const int i = c0 + lane;
    const bool ok = i < gt_here;
    const uint2 e = ok ? ck[i] : make_uint2(0xFFFFFFFFu, 0u);
    const unsigned same = __match_any_sync(kFull, e.x);
    if (ok) {
      const uint32_t x = e.x;
      int d = 0;
      if (((h16[x >> 1] >> (16 * (x & 1u))) & 0xFFFFu) > 1u) {  // this CTA holds the key more than once
        d = __popc(same & lt);
        for (int jj = 0; jj < c0; ++jj) d += ck[jj].x == x ? 1 : 0;
      }
      const int j = (cmax - static_cast<int>(x >> 8)) * 256 + 255 - static_cast<int>(x & 255u);
      out[P[j] + d] = p0 + static_cast<int>(e.y);
    }
  }
  for (int i = m + r * kThreads + tid; i < a.K; i += C * kThreads) out[i] = -1;
}

// WIDE: the instance of step 1' (launched where wide_path holds), else of the digits; each its own instance, so that
// neither path's code costs the other registers
template <int C, bool WIDE>
__global__ void __launch_bounds__(kThreads) topk_select_kernel(const TopkArgs a, const int SL) {
  extern __shared__ __align__(16) unsigned char smem[];
  Small& sm = *reinterpret_cast<Small*>(smem);
  unsigned long long* list = reinterpret_cast<unsigned long long*>(smem + sizeof(Small));
  uint32_t* keys = reinterpret_cast<uint32_t*>(list + (a.K + 1) / 2 * 2);
  int* ecnt = reinterpret_cast<int*>(keys + SL);

  cg::cluster_group cluster = cg::this_cluster();
  const int r = C > 1 ? static_cast<int>(cluster.block_rank()) : 0;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int row = blockIdx.y;
  const long long b = row / a.S, s = row % a.S;
  const int R = rounds(SL);
  const uint32_t neg = neg_inf_key(a.kind);
  auto sync_all = [&]() {
    if constexpr (C > 1) cluster.sync();
    else __syncthreads();
  };

  if (tid < kMaxC) sm.gt[tid] = 0, sm.eqc[tid] = 0;
  if (tid == 0) sm.cgt = 0, sm.ceq = 0;
  constexpr bool wide = WIDE;
  static_assert(!WIDE || C > 1, "topk: step 1' needs a cluster");
  uint32_t* h16 = reinterpret_cast<uint32_t*>(smem + wide_offset(SL, a.K));
  if constexpr (wide) {  // zeroed while the scores kernel finishes
    for (int i = tid; i < kWideBytes / 16; i += kThreads) reinterpret_cast<uint4*>(h16)[i] = make_uint4(0, 0, 0, 0);
  }
  griddep_wait();  // the scores (and the counts) come from earlier kernels
  griddep_launch_dependents();

  const long long nv_raw = a.nvis_i64 ? static_cast<const long long*>(a.nvis)[s] : static_cast<const int*>(a.nvis)[s];
  const int nvis = static_cast<int>(nv_raw < 0 ? 0 : nv_raw > a.N ? a.N : nv_raw);
  const int p0 = r * SL;  // the slice's first entry
  const int nv = min(max(nvis - p0, 0), SL);
  const int esz = a.kind == 2 ? 4 : 2;
  const unsigned char* xs = static_cast<const unsigned char*>(a.x) + ((b * a.sx_b + s * a.sx_s) + p0) * esz;
  load_keys(a, xs, nv, keys, SL);
  __syncthreads();

  // 1. radix select over the cluster: digits of 12 + 4 bits (16-bit scores) or 12 + 12 + 8 (fp32)
  const int passes = a.kind == 2 ? 3 : 2;
  uint32_t prefix = 0;
  int krem = 0;
  bool none = false;
  bool ranks = false;  // step 2' (16-bit path): the kept keys lie in coarse bins dc2 .. cmax, at most kSpan of them
  int dc2 = 0, cmax = 0;
  if constexpr (wide) {
    // 1'. (16-bit scores, short slices) one histogram of the 65536 keys per CTA, 256 coarse sums of 256 bins; after
    // one cluster barrier: the coarse bin of the k-th key from all CTAs' coarse sums, then its 256 bins from all
    // CTAs' histograms (copied into sm.hist[0] as [CTA][bin]), which give T and every CTA's counts above and at T
#pragma unroll 4
    for (int rd = 0; rd < R; ++rd) {
      const int p = rd * kThreads + tid;
      const uint32_t k = p < SL ? keys[p] : 0u;
      if (k > neg) {
        const uint32_t bin = k >> 16;
        atomicAdd(&h16[bin >> 1], 1u << (16 * (bin & 1u)));
      }
    }
    __syncthreads();
    if (tid < 256) {  // coarse bin tid: words 128 tid ..; 16-byte reads rotated by tid (distinct banks in a phase)
      const uint4* f = reinterpret_cast<const uint4*>(h16 + tid * 128);
      uint32_t c = 0;  // both halves' sums stay below 2^16 (at most SL keys)
#pragma unroll 8
      for (int q = 0; q < 32; ++q) {
        const uint4 w = f[(q + tid) & 31];
        c += w.x + w.y + w.z + w.w;
      }
      c = (c & 0xFFFFu) + (c >> 16);
      const uint32_t up = __shfl_down_sync(kFull, c, 1);
      if ((tid & 1) == 0) sm.coarse[0][tid >> 1] = static_cast<int>(c | (up << 16));  // two 16-bit sums a word
    }
    sync_all();  // every CTA's histogram and coarse sums are complete
    int* call = sm.hist[1];  // [CTA][128 words of two coarse sums], copied in 16-byte reads (512 bytes a CTA)
#pragma unroll
    for (int i = tid; i < C * 32; i += kThreads) {
      const int4* src = reinterpret_cast<const int4*>(cluster.map_shared_rank(sm.coarse[0], i >> 5));
      reinterpret_cast<int4*>(call)[i] = src[i & 31];
    }
    __syncthreads();
    int h[C];
    int v = 0;
    if (tid < 256) {
#pragma unroll
      for (int rr = 0; rr < C; ++rr) {
        h[rr] = (static_cast<uint32_t>(call[rr * 128 + (tid >> 1)]) >> (16 * (tid & 1))) & 0xFFFFu;
        v += h[rr];
      }
    }
    int total;
    const int suf = suffix_sum_256(v, sm.wsum, total);  // coarse bins tid .. 255
    krem = min(a.K, total);
    none = krem == 0;
    if (!none) {
      if (tid < 256 && suf >= krem && suf - v < krem) sm.digit = tid, sm.krem = krem - (suf - v);
      if (tid < 256 && v > 0 && suf == v) sm.cmax = tid;  // the highest coarse bin with keys
      __syncthreads();
      const int dc = sm.digit;
      dc2 = dc, cmax = sm.cmax;
      ranks = cmax - dc < kSpan;  // the same in every CTA (the same sums)
      if (warp < 8) {  // per CTA: keys above the coarse bin
#pragma unroll
        for (int rr = 0; rr < C; ++rr) {
          const int g = __reduce_add_sync(kFull, tid > dc ? h[rr] : 0);
          if (lane == 0) sm.part[warp][rr] = g;
        }
      }
      int* copy = sm.hist[0];  // [CTA][256 bins of coarse bin dc]: 32 16-byte reads a CTA, 8 bins each
      // step 2': coarse bins dc + 1 .. cmax too, packed into hist[1] as [CTA][kSpan - 1][128 words], their reads in
      // flight with bin dc's (the coarse sums' copy there has been read)
      const int per = 32 * (cmax - dc), nx = ranks ? C * per : 0;
      uint4 xw[kSpan - 1];
#pragma unroll
      for (int q = 0; q < kSpan - 1; ++q) {
        const int i = tid + q * kThreads;
        if (i < nx) {
          const int rr = i / per, rem = i - rr * per;
          xw[q] = reinterpret_cast<const uint4*>(cluster.map_shared_rank(h16, rr))[(dc + 1) * 32 + rem];
        }
      }
      if (tid < C * 32) {
        const uint4 w = reinterpret_cast<const uint4*>(cluster.map_shared_rank(h16, tid >> 5) + dc * 128)[tid & 31];
        int4* d = reinterpret_cast<int4*>(copy + 8 * tid);  // (tid >> 5) * 256 + 8 * (tid & 31)
        d[0] = make_int4(w.x & 0xFFFFu, w.x >> 16, w.y & 0xFFFFu, w.y >> 16);
        d[1] = make_int4(w.z & 0xFFFFu, w.z >> 16, w.w & 0xFFFFu, w.w >> 16);
      }
#pragma unroll
      for (int q = 0; q < kSpan - 1; ++q) {
        const int i = tid + q * kThreads;
        if (i < nx) {
          const int rr = i / per, rem = i - rr * per;
          reinterpret_cast<uint4*>(sm.hist[1])[rr * (kSpan - 1) * 32 + rem] = xw[q];
        }
      }
      // step 2' reads no other CTA's memory after this: it arrives here and waits at its exit, so that its shared
      // memory outlives the others' reads without a barrier between
      if (ranks) asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
      __syncthreads();
      int vf = 0;
      if (tid < 256) {
#pragma unroll
        for (int rr = 0; rr < C; ++rr) vf += copy[rr * 256 + tid];
      }
      int ftotal;
      const int sf = suffix_sum_256(vf, sm.wsum + 8, ftotal);  // bins tid .. 255 of the coarse bin
      const int kc = sm.krem;
      if (tid < 256 && sf >= kc && sf - vf < kc) sm.fdigit = tid, sm.fkrem = kc - (sf - vf);
      __syncthreads();
      const int df = sm.fdigit;
      if (warp < C) {  // CTA `warp`: its keys above T inside the coarse bin, and equal to T
        int g = 0;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const int f = q * 32 + lane;
          g += f > df ? copy[warp * 256 + f] : 0;
        }
        g = __reduce_add_sync(kFull, g);
        if (lane == 0) sm.part[8][warp] = g, sm.eqc[warp] = copy[warp * 256 + df];
      }
      __syncthreads();
      if (tid < C) {
        int acc = 0;
        for (int w = 0; w < 9; ++w) acc += sm.part[w][tid];
        sm.gt[tid] += acc;
      }
      prefix = static_cast<uint32_t>(dc * 256 + df) << 16;
      krem = sm.fkrem;
    }
  }
#pragma unroll 1
  for (int pass = 0; pass < (wide ? 0 : passes); ++pass) {
    const int W = pass == 0 ? 12 : a.kind == 2 ? (pass == 1 ? 12 : 8) : 4;  // this digit's bits
    const int shift = pass == 0 ? 20 : pass == 1 ? (a.kind == 2 ? 8 : 16) : 0;  // below it
    const int NB = 1 << W, SUB = NB > 256 ? kSub : 1, NC = NB / SUB;  // bins; fine bins per coarse bin
    int* hist = sm.hist[pass & 1];
    int* coarse = sm.coarse[pass & 1];
    for (int i = tid; i < NB; i += kThreads) hist[i] = 0;
    __syncthreads();
#pragma unroll 4
    for (int rd = 0; rd < R; ++rd) {
      const int p = rd * kThreads + tid;
      const uint32_t k = p < SL ? keys[p] : 0u;
      if (k > neg && (pass == 0 || ((k ^ prefix) >> (shift + W)) == 0)) atomicAdd(&hist[(k >> shift) & (NB - 1)], 1);
    }
    if (SUB > 1) {  // the coarse bins: sums of 16 consecutive fine bins, one a thread (its four 16-byte reads rotated
      __syncthreads();  // by (tid / 2) % 4, so that the 8 threads of a phase hit distinct banks)
      if (tid < 4096 / kSub) {
        const int4* f = reinterpret_cast<const int4*>(hist + tid * kSub);
        int c = 0;
#pragma unroll
        for (int q = 0; q < kSub / 4; ++q) {
          const int4 v = f[(q + (tid >> 1)) & 3];
          c += v.x + v.y + v.z + v.w;
        }
        coarse[tid] = c;
      }
    }
    const int* cbins = SUB > 1 ? coarse : hist;
    sync_all();  // every CTA's histograms are complete
    // the coarse digit: where the count from the top reaches krem (warps 0..7: one coarse bin per thread)
    int h[C];
    int v = 0;
    if (tid < NC) {
#pragma unroll
      for (int rr = 0; rr < C; ++rr) {
        h[rr] = C > 1 ? cluster.map_shared_rank(cbins, rr)[tid] : cbins[tid];
        v += h[rr];
      }
    }
    int total;
    const int suf = suffix_sum_256(v, sm.wsum, total);  // bins tid .. 255
    if (pass == 0) {
      krem = min(a.K, total);  // every candidate when fewer than k
      if (krem == 0) {
        none = true;
        break;
      }
    }
    if (tid < NC && suf >= krem && suf - v < krem) {  // exactly one bin
      sm.digit = tid;
      sm.krem = krem - (suf - v);
    }
    __syncthreads();
    const int dc = sm.digit;
    const bool last = pass == passes - 1;
    if (warp < 8) {  // per CTA: keys above the coarse bin
#pragma unroll
      for (int rr = 0; rr < C; ++rr) {
        const int g = __reduce_add_sync(kFull, tid > dc && tid < NC ? h[rr] : 0);
        if (lane == 0) sm.part[warp][rr] = g;
      }
      if (SUB == 1 && last && tid == dc) {
#pragma unroll
        for (int rr = 0; rr < C; ++rr) sm.eqc[rr] = h[rr];
      }
    } else if (warp == 8 && SUB > 1) {  // the fine digit inside the coarse bin: lanes 0..15, one fine bin each
      int hf[C];
      int vf = 0;
#pragma unroll
      for (int rr = 0; rr < C; ++rr) {
        hf[rr] = lane < kSub ? (C > 1 ? cluster.map_shared_rank(hist, rr)[dc * kSub + lane] : hist[dc * kSub + lane]) : 0;
        vf += hf[rr];
      }
      int sf = vf;
#pragma unroll
      for (int o = 1; o < kSub; o <<= 1) {
        const int y = __shfl_down_sync(kFull, sf, o);
        if (lane + o < kSub) sf += y;
      }
      const int kc = sm.krem;
      const unsigned hit = __ballot_sync(kFull, lane < kSub && sf >= kc && sf - vf < kc);
      const int df = __ffs(hit) - 1;
      const int kf = kc - (__shfl_sync(kFull, sf - vf, df));
#pragma unroll
      for (int rr = 0; rr < C; ++rr) {
        const int g = __reduce_add_sync(kFull, lane > df && lane < kSub ? hf[rr] : 0);
        if (lane == 0) sm.part[8][rr] = g;
        if (last && lane == df) sm.eqc[rr] = hf[rr];
      }
      if (lane == 0) sm.fdigit = df, sm.fkrem = kf;
    }
    __syncthreads();
    if (tid < C) {
      int acc = 0;
      for (int w = 0; w < (SUB > 1 ? 9 : 8); ++w) acc += sm.part[w][tid];
      sm.gt[tid] += acc;
    }
    const int d = SUB > 1 ? dc * kSub + sm.fdigit : dc;
    prefix |= static_cast<uint32_t>(d) << shift;
    krem = SUB > 1 ? sm.fkrem : sm.krem;
  }
  int* out = a.o + b * a.so_b + s * a.so_s;
  if (none) {  // nothing above -inf: all -1 (after the others are done reading this CTA's histogram)
    sync_all();
    for (int i = r * kThreads + tid; i < a.K; i += C * kThreads) out[i] = -1;
    return;
  }
  __syncthreads();

  if constexpr (wide) {
    if (ranks) {
      rank_from_counts<C>(a, sm, keys, reinterpret_cast<uint2*>(list), h16,
                          reinterpret_cast<int*>(smem + wide_offset(SL, a.K) + kWideBytes), prefix, krem, dc2, cmax,
                          r, p0, SL, out);
      asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // the others are done reading this CTA
      return;
    }
  }

  // 2. the kept pairs into every CTA's list
  const uint32_t T = prefix;
  int gt_before = 0, gt_total = 0, eq_before = 0;
#pragma unroll
  for (int rr = 0; rr < C; ++rr) {
    gt_total += sm.gt[rr];
    if (rr < r) gt_before += sm.gt[rr], eq_before += sm.eqc[rr];
  }
  const int m = gt_total + krem;
  const int eq_here = sm.eqc[r];
  const int eq_take = min(max(krem - eq_before, 0), eq_here);
  const bool by_entry = eq_take > 0 && eq_take < eq_here;  // only some of this CTA's ties: the lowest entries
  auto put = [&](int slot, uint32_t k, int p) {
    const unsigned long long v = make_pair(k, p0 + p);
    if constexpr (C > 1) {
#pragma unroll
      for (int rr = 0; rr < C; ++rr) cluster.map_shared_rank(list, rr)[slot] = v;
    } else {
      list[slot] = v;
    }
  };
  const unsigned lt = (1u << lane) - 1u;
  if (by_entry) {  // a tie's rank among this CTA's ties in entry order: ballots per (round, warp), one scan
#pragma unroll 1
    for (int rd = 0; rd < R; ++rd) {
      const int p = rd * kThreads + tid;
      const unsigned bal = __ballot_sync(kFull, (p < SL ? keys[p] : 0u) == T);
      if (lane == 0) ecnt[rd * kWarps + warp] = __popc(bal);
    }
    __syncthreads();
    block_exscan(ecnt, R * kWarps, sm.wsum);
    __syncthreads();
  }
#pragma unroll 1
  for (int rd = 0; rd < R; ++rd) {
    const int p = rd * kThreads + tid;
    const uint32_t k = p < SL ? keys[p] : 0u;
    const bool above = k > T, tie = k == T;
    const unsigned ba = __ballot_sync(kFull, above);
    if (ba) {  // warp-aggregated slots for the keys above T (any order: the ranks sort them)
      int base = 0;
      if (lane == 0) base = atomicAdd(&sm.cgt, __popc(ba));
      base = __shfl_sync(kFull, base, 0);
      if (above) put(gt_before + base + __popc(ba & lt), k, p);
    }
    const unsigned bt = __ballot_sync(kFull, tie);
    if (bt && eq_take > 0) {
      if (by_entry) {
        const int rank = ecnt[rd * kWarps + warp] + __popc(bt & lt);
        if (tie && rank < eq_take) put(gt_total + eq_before + rank, k, p);
      } else {
        int base = 0;
        if (lane == 0) base = atomicAdd(&sm.ceq, __popc(bt));
        base = __shfl_sync(kFull, base, 0);
        if (tie) put(gt_total + eq_before + base + __popc(bt & lt), k, p);
      }
    }
  }
  sync_all();  // every CTA's pairs are in every list

  // 3. rank this CTA's share of the list; -1 past m
  constexpr int kRank = C >= 16 ? 16 : 8;  // threads ranking one pair
  const int E = (m + C - 1) / C, e0 = r * E, e1 = min(m, e0 + E);
  const int g8 = tid % kRank;
#pragma unroll 1
  for (int base = e0; base < e1; base += kThreads / kRank) {
    const int e = base + tid / kRank;
    const unsigned long long v = e < e1 ? list[e] : ~0ull;
    int c0 = 0, c1 = 0, c2 = 0, c3 = 0, j = g8;
    for (; j + 3 * kRank < m; j += 4 * kRank) {
      c0 += list[j] > v;
      c1 += list[j + kRank] > v;
      c2 += list[j + 2 * kRank] > v;
      c3 += list[j + 3 * kRank] > v;
    }
    for (; j < m; j += kRank) c0 += list[j] > v;
    // the pair's kRank threads (an aligned group of lanes) sum their counts
    const unsigned group = (kRank == 32 ? kFull : (1u << kRank) - 1u) << (lane & ~(kRank - 1));
    const int cnt = __reduce_add_sync(group, c0 + c1 + c2 + c3);
    if (e < e1 && g8 == 0) out[cnt] = static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(v));
  }
  for (int i = m + r * kThreads + tid; i < a.K; i += C * kThreads) out[i] = -1;
}

// ---- one CTA per row: 16-bit scores, rows of at most 32K entries ----
//
// A 16-bit score has only 65536 keys, so the whole radix select is one histogram: 65536 16-bit counts, two to a word
// (128 KB of shared memory; a bin's count, and every sum below, is at most N <= 32768). 1024 threads; the row's keys
// in shared memory (64 KB), thread t's chunk r of 8 entries at entry 8 (r * 1024 + t), so (round, warp, lane, j) is
// entry order:
// 1. keys and the histogram (exact zeros, which ReLU'd scores are full of, counted per warp);
// 2. per thread, the counts of its 64 consecutive bins; a suffix scan over the threads; the thread whose bins hold
//    the k-th largest key finds it (T), the keys above it (gt) and its count; every thread whose bins may hold kept
//    keys rewrites them as exclusive suffix sums (S(v) = keys above v: where bin v's keys start in the list);
// 3. each kept key takes slot S(v) + (its place among bin v's keys) by an atomic on its bin's word, so the list is
//    ordered by key and only the order within a bin is arbitrary; when only some keys equal to T are kept, those
//    go to gt + (their rank in entry order), from per-(round, warp) counts and one scan;
// 4. each slot's pair walks its bin's run of the list (the same key: usually one or two) and is stored at the run's
//    start plus the number of pairs in it with a lower entry: descending score, ties to the lower entry. A run costs
//    its length squared (k equal kept keys: ~k iterations a thread), which only rows with fewer than k distinct
//    scores above the k-th reach (e.g. mostly exact zeros with few visible entries).
// Pairs are 32-bit (key << 16 | 0xFFFF - entry). Four or six block barriers after the loads, no cluster.
// The kernel runs once per row from cold instruction caches, so its code is kept short: every phase is a rolled loop
// over the rounds reading the keys from shared memory (a first version kept the row in registers, each phase unrolled
// over the rounds: ~6,000 SASS instructions, 9.2 us at 4K entries and 16.8 at 32K).
constexpr int kCtaThreads = 1024, kCtaWarps = kCtaThreads / 32;
constexpr int kCtaRounds = kTopkCtaMaxN / (8 * kCtaThreads);  // 4: 8 entries a thread and round
static_assert(kTopkCtaMaxN < 65536 && kTopkCtaMaxN % (8 * kCtaThreads) == 0,
              "16-bit counts and sums (at most N each), whole rounds of 8 entries a thread");
constexpr uint32_t kZeroKey = 0x8000u;                       // the key of 0.0

struct alignas(16) CtaSmem {
  uint32_t hist[32768];                // bin 2i's count in word i's low half, bin 2i + 1's in its high half
  uint4 keys[kCtaRounds * kCtaThreads];  // 8 keys (16-bit, 0: not a candidate) per (round, thread)
  uint32_t list[kTopkMaxK];            // kept pairs
  int wsum[kCtaWarps];                 // per warp: its threads' keys
  int tie[kCtaRounds * kCtaWarps];     // per (round, warp): keys equal to T -> their exclusive prefix
  int T, gt, cntT;
};

// a 16-bit score's order-preserving key (-0.0 as +0.0)
__device__ __forceinline__ uint32_t k16(uint32_t b) { return key16(b) >> 16; }

// the 16-bit value j of 8 packed in a uint4
__device__ __forceinline__ uint32_t half_of(const uint4& w, int j) {
  const uint32_t q = j < 2 ? w.x : j < 4 ? w.y : j < 6 ? w.z : w.w;
  return (q >> (16 * (j & 1))) & 0xFFFFu;
}

// inclusive prefix sum of v over lanes 0 .. lane of a full warp
__device__ __forceinline__ int warp_incl_scan(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// keys equal to T among 8
__device__ __forceinline__ int ties8(const uint4& keys, uint32_t T) {
  int n = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) n += half_of(keys, j) == T ? 1 : 0;
  return n;
}

__global__ void __launch_bounds__(kCtaThreads, 1) topk16_cta_kernel(const TopkArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  CtaSmem& sm = *reinterpret_cast<CtaSmem*>(smem);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int row = blockIdx.x;
  const long long b = row / a.S, s = row % a.S;
  const int R = (a.N + 8 * kCtaThreads - 1) / (8 * kCtaThreads);
  const uint32_t neg = neg_inf_key(a.kind) >> 16;

  griddep_wait();  // the scores (and the counts) come from earlier kernels
  griddep_launch_dependents();
  const long long nv_raw = a.nvis_i64 ? static_cast<const long long*>(a.nvis)[s] : static_cast<const int*>(a.nvis)[s];
  const int nv = static_cast<int>(nv_raw < 0 ? 0 : nv_raw > a.N ? a.N : nv_raw);
  const uint16_t* xs = static_cast<const uint16_t*>(a.x) + b * a.sx_b + s * a.sx_s;
  const bool aligned = (reinterpret_cast<uintptr_t>(xs) & 15) == 0;
  uint4 raw[kCtaRounds];
#pragma unroll
  for (int rd = 0; rd < kCtaRounds; ++rd) {  // every full 16-byte load in flight before the first is used
    const int e0 = 8 * (rd * kCtaThreads + tid);
    raw[rd] = make_uint4(0u, 0u, 0u, 0u);
    if (rd < R && aligned && e0 + 8 <= nv) raw[rd] = __ldcg(reinterpret_cast<const uint4*>(xs + e0));
  }
  {  // zero the histogram while the loads are in flight
    uint4* h4 = reinterpret_cast<uint4*>(sm.hist);
#pragma unroll 2
    for (int i = 0; i < 8; ++i) h4[i * kCtaThreads + tid] = make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int rd = 0; rd < kCtaRounds; ++rd) {
    if (rd < R) sm.keys[rd * kCtaThreads + tid] = raw[rd];
  }
  // the rest of a partial chunk (or every chunk of an unaligned row), one element at a time
#pragma unroll 1
  for (int rd = 0; rd < R; ++rd) {
    const int e0 = 8 * (rd * kCtaThreads + tid);
    if (e0 < nv && (!aligned || e0 + 8 > nv)) {
      uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const unsigned short* p = reinterpret_cast<const unsigned short*>(xs) + e0 + j;
        if (e0 + j < nv) w[j / 2] |= static_cast<uint32_t>(__ldcg(p)) << (16 * (j & 1));
      }
      sm.keys[rd * kCtaThreads + tid] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  __syncthreads();

  // 1. keys (0: not a candidate) and the histogram
  int zeros = 0;
#pragma unroll 1
  for (int rd = 0; rd < R; ++rd) {
    const int e0 = 8 * (rd * kCtaThreads + tid);
    const uint4 w = sm.keys[rd * kCtaThreads + tid];
    uint32_t o[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t p = q == 0 ? w.x : q == 1 ? w.y : q == 2 ? w.z : w.w;
      uint32_t lo = k16(p & 0xFFFFu), hi = k16(p >> 16);
      lo = e0 + 2 * q < nv && lo > neg ? lo : 0u;
      hi = e0 + 2 * q + 1 < nv && hi > neg ? hi : 0u;
      o[q] = lo | (hi << 16);
      zeros += (lo == kZeroKey ? 1 : 0) + (hi == kZeroKey ? 1 : 0);
      if (lo != 0u && lo != kZeroKey) atomicAdd(&sm.hist[lo >> 1], (lo & 1u) ? 0x10000u : 1u);
      if (hi != 0u && hi != kZeroKey) atomicAdd(&sm.hist[hi >> 1], (hi & 1u) ? 0x10000u : 1u);
    }
    sm.keys[rd * kCtaThreads + tid] = make_uint4(o[0], o[1], o[2], o[3]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) zeros += __shfl_xor_sync(kFull, zeros, o);
  if (lane == 0 && zeros > 0) atomicAdd(&sm.hist[kZeroKey >> 1], static_cast<uint32_t>(zeros));
  __syncthreads();

  // 2. this thread's 64 bins (words 32 tid ..): their total (the low halves' sum stays below 2^16: no carry), in a
  // rotated order so that a quarter warp's 16-byte reads hit distinct banks
  const uint4* h4 = reinterpret_cast<const uint4*>(sm.hist) + 8 * tid;
  uint32_t sum = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint4 w = h4[(i + tid) & 7];
    sum += w.x + w.y + w.z + w.w;
  }
  const int c = static_cast<int>((sum & 0xFFFFu) + (sum >> 16));
  int incl = c;  // keys in the bins of lanes lane .. 31 of this warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_down_sync(kFull, incl, o);
    if (lane + o < 32) incl += y;
  }
  if (lane == 0) sm.wsum[warp] = incl;
  if (tid == 0) sm.T = 0, sm.gt = 0, sm.cntT = 0;
  __syncthreads();
  int total = 0, above = incl - c;  // above: keys in the bins above this thread's
  {
    const int v = sm.wsum[lane];  // the warps' totals, reduced in registers
    int t = v, u = lane > warp ? v : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      t += __shfl_xor_sync(kFull, t, o);
      u += __shfl_xor_sync(kFull, u, o);
    }
    total = t;
    above += u;
  }
  int* out = a.o + b * a.so_b + s * a.so_s;
  if (total == 0) {  // nothing above -inf
    for (int i = tid; i < a.K; i += kCtaThreads) out[i] = -1;
    return;
  }
  const bool all = total <= a.K;  // every candidate is kept
  if (c > 0 && above < a.K) {     // bins that may hold kept keys: exclusive suffix sums, and the k-th key's bin
    uint32_t* hw = sm.hist + 32 * tid;
    int run = above;
#pragma unroll 1
    for (int i = 31; i >= 0; --i) {
      const uint32_t w = hw[i];
      const int hi = static_cast<int>(w >> 16), lo = static_cast<int>(w & 0xFFFFu);
      const int s_hi = run, s_lo = run + hi;
      run = s_lo + lo;
      if (!all && s_lo < a.K && run >= a.K) sm.T = 64 * tid + 2 * i, sm.gt = s_lo, sm.cntT = lo;
      if (!all && s_hi < a.K && s_lo >= a.K) sm.T = 64 * tid + 2 * i + 1, sm.gt = s_hi, sm.cntT = hi;
      hw[i] = static_cast<uint32_t>(s_lo) | (static_cast<uint32_t>(s_hi) << 16);
    }
  }
  __syncthreads();
  const uint32_t T = all ? 0u : static_cast<uint32_t>(sm.T);
  const int gt = sm.gt, krem = a.K - gt;
  const bool cut = !all && krem < sm.cntT;  // only the lowest entries of the keys equal to T
  const uint32_t lowT = all ? 1u : cut ? T + 1u : T;  // keys from lowT up take their bin's slots
  const int m = all ? total : a.K;

  // 3. the kept pairs into the list
  if (cut) {  // keys equal to T per (round, warp), in entry order -> exclusive prefix over the block
#pragma unroll 1
    for (int rd = 0; rd < R; ++rd) {
      const int n = ties8(sm.keys[rd * kCtaThreads + tid], T);
      const int x = warp_incl_scan(n, lane);  // over lanes 0 .. lane
      if (lane == 31) sm.tie[rd * kCtaWarps + warp] = x;
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of R x 32 per-(round, warp) counts, 4 consecutive per lane
      const int L = R * kCtaWarps;
      int v[kCtaRounds], acc = 0;
#pragma unroll
      for (int q = 0; q < kCtaRounds; ++q) {
        v[q] = kCtaRounds * lane + q < L ? sm.tie[kCtaRounds * lane + q] : 0;
        acc += v[q];
      }
      int run = warp_incl_scan(acc, lane) - acc;
#pragma unroll
      for (int q = 0; q < kCtaRounds; ++q) {
        if (kCtaRounds * lane + q < L) sm.tie[kCtaRounds * lane + q] = run;
        run += v[q];
      }
    }
    __syncthreads();
#pragma unroll 1
    for (int rd = 0; rd < R; ++rd) {
      const uint4 w = sm.keys[rd * kCtaThreads + tid];
      const int n = ties8(w, T);
      int rank = sm.tie[rd * kCtaWarps + warp] + warp_incl_scan(n, lane) - n;
      const int e0 = 8 * (rd * kCtaThreads + tid);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (half_of(w, j) == T) {
          if (rank < krem) sm.list[gt + rank] = (T << 16) | (0xFFFFu - static_cast<uint32_t>(e0 + j));
          ++rank;
        }
      }
    }
  }
#pragma unroll 1
  for (int rd = 0; rd < R; ++rd) {
    const uint4 w = sm.keys[rd * kCtaThreads + tid];
    const int e0 = 8 * (rd * kCtaThreads + tid);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t k = half_of(w, j);
      if (k >= lowT) {
        const uint32_t sh = 16u * (k & 1u);
        const uint32_t slot = (atomicAdd(&sm.hist[k >> 1], 1u << sh) >> sh) & 0xFFFFu;
        sm.list[slot] = (k << 16) | (0xFFFFu - static_cast<uint32_t>(e0 + j));
      }
    }
  }
  __syncthreads();

  // 4. each pair's place in its bin's run (entry order), then -1 past m
  if (tid < m) {
    const uint32_t v = sm.list[tid];
    int pos = tid;
    const int run_end = cut ? gt : m;  // the slots of bins; past them (cut) the ties are in order already
    if (tid < run_end) {
      const uint32_t key = v >> 16;
      int start = tid, better = 0;
      while (start > 0 && (sm.list[start - 1] >> 16) == key) {
        --start;
        better += sm.list[start] > v ? 1 : 0;
      }
      for (int q = tid + 1; q < run_end && (sm.list[q] >> 16) == key; ++q) better += sm.list[q] > v ? 1 : 0;
      pos = start + better;
    }
    out[pos] = static_cast<int>(0xFFFFu - (v & 0xFFFFu));
  }
  for (int i = m + tid; i < a.K; i += kCtaThreads) out[i] = -1;
}

cudaError_t launch_cta(const TopkArgs& a, int rows, bool pdl, cudaStream_t stream) {
  static bool optin[kMaxDevices] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= kMaxDevices || !optin[dev]) {
    e = cudaFuncSetAttribute(topk16_cta_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(sizeof(CtaSmem)));
    if (e != cudaSuccess) return e;
    if (dev < kMaxDevices) optin[dev] = true;
  }
  return launch_pdl(topk16_cta_kernel, dim3(rows), dim3(kCtaThreads), static_cast<int>(sizeof(CtaSmem)), pdl, stream,
                    a);
}

// the largest slice's shared memory (and clusters of 16), set once per instance and device (the attribute is per device)
template <int C, bool WIDE>
cudaError_t opt_in() {
  static bool optin[kMaxDevices] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess || (dev < kMaxDevices && optin[dev])) return e;
  auto kernel = topk_select_kernel<C, WIDE>;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kClusterSmemMax);
  if (e == cudaSuccess && C > 8) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e == cudaSuccess && dev < kMaxDevices) optin[dev] = true;
  return e;
}

template <int C>
cudaError_t launch(const TopkArgs& a, int rows, bool pdl, cudaStream_t stream) {
  const int SL = slice_len(a.N, C);
  const int smem = smem_total(C, a.kind, SL, a.K);
  if constexpr (C > 1) {
    if (wide_path(C, a.kind, SL)) {
      const cudaError_t e = opt_in<C, true>();
      if (e != cudaSuccess) return e;
      return launch_ex(topk_select_kernel<C, true>, dim3(C, rows), dim3(kThreads), smem, pdl, C, stream, a, SL);
    }
  }
  const cudaError_t e = opt_in<C, false>();
  if (e != cudaSuccess) return e;
  return launch_ex(topk_select_kernel<C, false>, dim3(C, rows), dim3(kThreads), smem, pdl, C, stream, a, SL);
}

// clusters of 16 the current device holds at once, for rows of N entries (the shared memory of the band's widest
// slice: the 16-bit histogram's band, slices of up to kWideSL keys, counts as if every row took it; 0: none, or no
// such size)
int wide_clusters(int N) {
  static int held[2][kMaxDevices];
  static bool asked[2][kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
  const int band = slice_len(N, 16) <= kWideSL ? 1 : 0;
  if (!asked[band][dev]) {
    const int smem = band ? smem_total(16, 0, kWideSL, kTopkMaxK) : smem_bytes(slice_len(kTopkMaxN, 16), kTopkMaxK);
    held[band][dev] = band ? max_active_clusters(topk_select_kernel<16, true>, 16, kThreads, smem, kClusterSmemMax)
                           : max_active_clusters(topk_select_kernel<16, false>, 16, kThreads, smem, kClusterSmemMax);
    asked[band][dev] = true;
  }
  return held[band][dev];
}

}  // namespace

int topk_select_cluster(int N, int rows) {
  if (N > 16384 && rows >= 1 && wide_clusters(N) >= rows) return 16;
  return N <= 2048 ? 1 : N <= 4096 ? 2 : N <= 8192 ? 4 : 8;
}

int topk_select_path(int N, int kind, int rows, int mode) {
  const bool cta = kind != 2 && N <= kTopkCtaMaxN;
  if (mode == 2) return cta ? 0 : -1;
  return mode == 0 && cta && rows >= kTopkCtaMinRows && N >= kTopkCtaMinN ? 0 : 1;
}

cudaError_t topk_select_launch(const TopkArgs& a, int rows, int mode, bool pdl, cudaStream_t stream) {
  if (a.N < 1 || a.N > kTopkMaxN || a.K < 1 || a.K > a.N || a.K > kTopkMaxK || rows < 1 || rows > kTopkMaxRows)
    return cudaErrorInvalidValue;
  const int path = topk_select_path(a.N, a.kind, rows, mode);
  if (path < 0) return cudaErrorInvalidValue;
  if (path == 0) return launch_cta(a, rows, pdl, stream);
  switch (topk_select_cluster(a.N, rows)) {
    case 1: return launch<1>(a, rows, pdl, stream);
    case 2: return launch<2>(a, rows, pdl, stream);
    case 4: return launch<4>(a, rows, pdl, stream);
    case 8: return launch<8>(a, rows, pdl, stream);
    default: return launch<16>(a, rows, pdl, stream);
  }
}

}  // namespace dsv4
