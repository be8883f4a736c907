// Decode MoE experts for one token, on the tensor cores: the k routed MXFP4 experts and the FP8 shared expert in two
// launches (SPEC §2.7, moe_experts_ref's numerics up to fp32 summation order and the FP8 MMA's accumulation).
//
// moe_up_kernel: one CTA per 16 rows of w1 and w3 of one expert (the shared expert's CTAs first); warp (mat, kq)
//   streams 16 rows of w1 (mat 0) or w3 (mat 1) over a quarter of K, its products on wgmma (below). Epilogue: gate /
//   up summed over the quarters in order, rounded to bf16, clamped, silu(gate) * up in fp32, times the routing weight
//   (routed), rounded -> h.
// moe_down_kernel: one CTA per 16 output rows; warp j < k streams routed pair j's w2 rows over all of K, warps 6 and 7
//   the shared expert's w2 rows over one half of K each. Epilogue: the pair outputs rounded to bf16 and summed in fp32
//   in ascending (expert id, slot) order, then the shared expert's (its halves summed, rounded): fixed order, no
//   atomics, the same bits on every run. Optionally the FFN's mHC post of those columns follows in the same threads
//   (moe_post: the new streams, the same FMAs as mhc_post's kernel), so that no launch of its own is needed; and
//   after it optionally the next sublayer's mHC pre and RMSNorm (moe_post_pre: the next layer's attention input, one
//   launch fewer in the next layer's step): each CTA leaves its partial mixes over its 16 columns of the new streams
//   (its mixer slice, base and scale copied into shared memory before griddepcontrol.wait), and the last CTA to arrive
//   finishes the token as the mHC boundary kernel does (mhc_dev.h: the same reduction, Sinkhorn, y and RMSNorm; the
//   row staged through the rings' shared memory). Against the boundary kernel only the partials' grouping differs (256
//   chunks of 16 columns instead of 64 of 64): fp32 summation order. The finish's loops stay rolled: it runs once per
//   token in one CTA, from cold instruction caches (unrolled, the kernel was 7,000 SASS instructions and the finish
//   ~4.5 us a layer slower). (Measured on an H200 the fused model is still 0-5 us a layer slower than the boundary
//   kernel launched in the next layer, so the model keeps it off by default, Transformer.fuse_pre; %globaltimer stamps
//   in the finishing CTA: its epilogue ~3 us (before its loads came in one round, see down_epilogue), the arrival
//   ~0.8 us, the staging and reduction ~1.2 us, the Sinkhorn ~2.7 us: docs/performance.md, thirty-seventh and
//   thirty-eighth passes.)
//
// Numerics. x (and h) are quantized in the kernel to e4m3 with a power-of-two scale per 128 (DeepSeek's act_quant),
// or x's codes come with it (a.xq, a.xqs: the FFN's mHC boundary writes them beside x; the same codes, so the same bits).
// An e2m1 nibble s.EE.m becomes the e4m3 byte s.00EE.m00, whose value is exactly e2m1 * 2^-6 (E = 0 lands on the e4m3
// subnormal 2^-7), so one k32 product multiplies 32 weights of one MXFP4 group exactly; its sum is promoted to fp32
// with the group's E8M0 scale times the x block scale times 2^6. FP8 weights: products over 128 columns, promoted per
// 128-column block with the 128x128 block scale (as gemv.cu).
// The up kernel multiplies on wgmma (m64n8k32, e4m3 x e4m3 -> fp32): warpgroup mat = warps (mat, 0..3), whose decoded
// weight codes are the register operand A as they are, and B (shared memory) holds x's four K quarters as columns 0-3,
// so warp kq keeps column kq. (The forty-seventh pass: 0.4-1.2 us a layer faster in the decode graphs than the up
// kernel's earlier f16 mma.sync form, the down kernel's below, which needs eight conversions per 32 weights; the pair
// alone with x's codes given, as the layers run it, 0.8 us faster, and ~2 us slower only where the up kernel quantizes
// x itself, which no decode graph does (forty-eighth pass); 64-row warpgroups over one quarter, whose quarters met in a
// cluster of four CTAs or in one CTA of 32 warps, were 2-7 us a layer slower: docs/performance.md.) sm_90 has no e4m3
// mma.sync (ptxas turns it into f16 MMAs, converting both operands at every call), so the down kernel converts the
// weight codes to f16 itself (exact) and keeps h in shared memory as the f16 of its e4m3 codes: two m16n8k16 f16 MMAs
// per 32 values. (The same wgmma trick in the down kernel, the experts' h as B's columns, was timed and refuted in the
// forty-eighth pass: 0.3-1.2 us a layer slower at two CTAs per SM, 6.4 at three.)
//
// Layout trick for MXFP4: lane (g, t) copies 16 bytes (one 32-value group) of rows g and g+8; an MMA needs the same
// group from all four lanes of a quad, so lane t reads word t of the group its quad's lane j copied (a 4x4 word
// transpose through shared memory; slots rotated by g/2 so the reads hit 32 distinct banks). The 8 values of a word
// feed k-slots 4t..4t+3 (even values) and 4t+16..4t+19 (odd), and x sits in shared memory permuted the same way
// (the down kernel's h: per 8 values, evens then odds; the up kernel's B: put_codes). The checkpoint layout is read as
// is.
//
// Programmatic dependent launch: the shared expert's weights are issued before griddepcontrol.wait. The routed
// experts' addresses come from the router's output: moe_up_kernel (the router's dependent) loads them after its wait
// and triggers its own dependent only then, so moe_down_kernel may issue its routed w2 loads before waiting on h.
#include <type_traits>

#include "common.h"
#include "mhc_dev.h"
#include "moe.h"

namespace dsv4 {
namespace {

using dev::cp_async16;
using dev::cp_async_commit;
using dev::cp_async_wait;
using dev::e4m3x2_code;
using dev::mma_e4m3_f16x;
using dev::bf16_round;
using dev::ue8m0_scale;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kHc = 4;  // mHC streams (the fused post)
constexpr int kCols = 16;                        // output rows of a down CTA: its columns of the new streams
constexpr int kPreRows = mhc::MIX / kWarps;      // mixer rows per warp in the next pre's partials (3)
constexpr int NSTEP = 2;                         // 64-byte steps per ring chunk (fp8: one 128-column block)
constexpr int kStepB = 1024;                     // ring bytes of one step: 16 rows x 64 bytes
constexpr int NBUF = 3;                          // chunks in a warp's cp.async ring: two in flight, one multiplied
constexpr int kRingU4 = NBUF * NSTEP * kStepB / 16;  // 16-byte slots of one warp's ring
constexpr int kMaxXV = 2048;                     // x values per warp (its K range), at most
constexpr int kMaxSc = 1024;                     // E8M0 bytes per warp (16 rows x its groups)

// dynamic shared memory of a down CTA whose warps hold xv values of h each (as f16)
constexpr int smem_bytes(int xv) { return kWarps * (kRingU4 * 16 + 2 * xv + 16 * 4 + kMaxSc + 16 * 4); }

// e2m1 nibbles -> e4m3 codes of e2m1 * 2^-6: the even (low) nibbles of the 4 bytes, and the odd (high) ones
__device__ __forceinline__ uint32_t fp4_even(uint32_t w) { return ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu); }
__device__ __forceinline__ uint32_t fp4_odd(uint32_t w) { return (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu); }

// byte Q of four E8M0 scales -> 2^(b - 127) (b = 0: 2^-127, a subnormal; b = 255, NaN in E8M0, reads as inf: outside
// any checkpoint's range), in two integer ops
template <int Q>
__device__ __forceinline__ float e8m0(uint32_t four) {
  const uint32_t bits = (Q < 3 ? four << (23 - 8 * Q) : four >> 1) & 0x7F800000u;
  return __uint_as_float(max(bits, 0x00400000u));
}

// one warp's work: 16 weight rows x a K range
struct Job {
  const uint8_t* w;         // byte (row 0, first column)
  long long ld;             // bytes per weight row
  const uint8_t* sc;        // fp4: E8M0 byte (row 0, first group); fp8: fp32 block scale (row block, first K block)
  long long sc_ld;          // fp4: bytes per scale row
  const __nv_bfloat16* x;   // x at the first column
  int nsteps;               // 64-byte steps (fp4: 128 values, fp8: 64)
};

struct WarpSmem {
  uint4* ring;
  uint16_t* xh;       // the e4m3-quantized x of the K range, as f16 (fp4: permuted per 8 values, evens then odds)
  float* xs;          // x scales per 128 values
  unsigned char* sc;  // fp4: E8M0 bytes [16 rows][groups]
  float* red;         // [kWarps][16] the warps' row sums (token 0)
};

__device__ __forceinline__ WarpSmem carve(unsigned char* smem, int warp, int xv) {
  WarpSmem s;
  unsigned char* p = smem;
  s.ring = reinterpret_cast<uint4*>(p) + warp * kRingU4;
  p += kWarps * kRingU4 * 16;
  s.xh = reinterpret_cast<uint16_t*>(p) + warp * xv;
  p += kWarps * xv * 2;
  s.xs = reinterpret_cast<float*>(p) + warp * 16;
  p += kWarps * 16 * 4;
  s.sc = p + warp * kMaxSc;
  p += kWarps * kMaxSc;
  s.red = reinterpret_cast<float*>(p);
  return s;
}

// A lane's addresses in one job's weight stream, computed once (not per step): lane (g, t) copies the 16 bytes t of
// every 64-byte step of rows g and g + 8 into its ring slot g * 4 + ((t + g / 2) & 3) of the step (the rotation
// spreads the quads' 4-byte reads over all 32 banks, see run), row g + 8 512 bytes further.
struct Lane {
  const uint8_t* src;    // row g, the lane's 16 bytes of step 0
  long long row8;        // 8 weight rows, in bytes
  unsigned char* slot0;  // its ring slot in step 0 of chunk 0 (row g)
  int nsteps, nchunk;
};

__device__ __forceinline__ Lane lane_of(const Job& j, const WarpSmem& s, int lane) {
  const int g = lane >> 2, t = lane & 3;
  Lane l;
  l.src = j.w + t * 16 + g * j.ld;
  l.row8 = 8 * j.ld;
  l.slot0 = reinterpret_cast<unsigned char*>(s.ring) + (g * 4 + ((t + (g >> 1)) & 3)) * 16;
  l.nsteps = j.nsteps;
  l.nchunk = (j.nsteps + NSTEP - 1) / NSTEP;
  return l;
}

// chunk c of the job -> ring slot `slot` (= c % NBUF, kept by the caller; one commit group per chunk, empty past the
// end)
__device__ __forceinline__ void issue(const Lane& l, int c, int slot) {
  if (c < l.nchunk) {
#pragma unroll
    for (int st = 0; st < NSTEP; ++st) {
      const int step = c * NSTEP + st;
      if (step < l.nsteps) {
        const uint8_t* src = l.src + step * 64;
        unsigned char* dst = l.slot0 + (slot * NSTEP + st) * kStepB;
        cp_async16(dst, src, true);
        cp_async16(dst + 512, src + l.row8, true);
      }
    }
  }
  cp_async_commit();
}

// chunk c of the stream in ring slot `slot`: the chunk NBUF - 1 ahead issued into the slot freed last, then c waited
// for and visible to the lane's quad
__device__ __forceinline__ void await_chunk(const Lane& l, int c, int slot) {
  __syncwarp();  // the quad is done reading the slot about to be refilled
  issue(l, c + NBUF - 1, slot == 0 ? NBUF - 1 : slot - 1);
  cp_async_wait<NBUF - 1>();
  __syncwarp();  // every lane's copies of chunk c (and the scales) visible to its quad
}

// FP4 scale bytes (in the first chunk's commit group) and the first NBUF - 1 chunks
template <bool FP4>
__device__ __forceinline__ void prefetch(const Job& j, const Lane& l, const WarpSmem& s, int lane) {
  if constexpr (FP4) {
    const int ng = j.nsteps * 4;  // groups of 32 in the K range (a multiple of 16)
    const int per_row = ng / 16;
    for (int i = lane; i < 16 * per_row; i += 32) {
      const int r = i / per_row, c = i % per_row;
      cp_async16(s.sc + r * ng + c * 16, j.sc + r * j.sc_ld + c * 16, true);
    }
  }
#pragma unroll
  for (int c = 0; c < NBUF - 1; ++c) issue(l, c, c);
}

// h (x) of a down warp's K range (<= 2048 values: 16 blocks of 128), 4 values per lane per block, every load issued at once
// (one L2 round trip, not one per block)
struct XRegs {
  uint2 v[kMaxXV / 128];
};

__device__ __forceinline__ void load_x(const Job& j, int nblk, int lane, XRegs& r) {
#pragma unroll
  for (int b = 0; b < kMaxXV / 128; ++b) {
    if (b < nblk) r.v[b] = *reinterpret_cast<const uint2*>(j.x + b * 128 + lane * 4);
  }
}

// -> e4m3 codes (stored as the f16 of their values) + scales per 128 in the warp's shared memory (act_quant)
// (blocks b0 .. b0 + nblk - 1 of the K range). Four blocks at a time, their amax reductions side by side (one shuffle
// of each per step): block by block, each waiting on its own five shuffles, a routed down warp's 16 blocks took ~2 us
// after h had arrived (%globaltimer stamps, 41st pass); all 16 side by side spill (80 registers).
template <bool FP4, int G = 4>
__device__ __forceinline__ void quantize_x(const XRegs& r, int nblk, const WarpSmem& s, int lane, int b0 = 0) {
#pragma unroll
  for (int g = 0; g < kMaxXV / 128; g += G) {
    if (g >= nblk) break;
    float amax[G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.v[g + i].x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.v[g + i].y));
      amax[i] = g + i < nblk ? fmaxf(fmaxf(fabsf(lo.x), fabsf(lo.y)), fmaxf(fabsf(hi.x), fabsf(hi.y))) : 0.0f;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int i = 0; i < G; ++i) amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], o));
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      const int b = g + i;
      if (b < nblk) {
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.v[b].x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.v[b].y));
        float sc, inv;
        ue8m0_scale(amax[i], sc, inv);
        if constexpr (FP4) {  // values 4L..4L+3 of the block: evens to slots (L&1)*2 + {0,1}, odds 4 + (L&1)*2 + {0,1}
          uint16_t* p = s.xh + (b0 + b) * 128 + (lane >> 1) * 8 + (lane & 1) * 2;
          *reinterpret_cast<uint32_t*>(p) = dev::e4m3_lo_f16x2(e4m3x2_code(lo.x, hi.x, inv));
          *reinterpret_cast<uint32_t*>(p + 4) = dev::e4m3_lo_f16x2(e4m3x2_code(lo.y, hi.y, inv));
        } else {
          *reinterpret_cast<uint2*>(s.xh + (b0 + b) * 128 + lane * 4) = make_uint2(
              dev::e4m3_lo_f16x2(e4m3x2_code(lo.x, lo.y, inv)), dev::e4m3_lo_f16x2(e4m3x2_code(hi.x, hi.y, inv)));
        }
        if (lane == 0) s.xs[b0 + b] = sc;
      }
    }
  }
  __syncwarp();
}

// A lane's MXFP4 reads in a warp's ring: word t of group q of row g in a step sits at slot g * 4 + ((q + g / 2) & 3)
// (the rotation issue() wrote), row g + 8 512 bytes further, so a quad's four lanes read the four words of one group and
// the warp 32 distinct banks; and its rows' E8M0 bytes (s.sc, [16 rows][groups])
struct Fp4Reads {
  const unsigned char* rrow;  // + ring slot * NSTEP * kStepB + step * kStepB + ro[q]: row g's word of group q
  int ro[4];
  const unsigned char* sc0p;  // + step * 4: row g's four scale bytes of the step
  const unsigned char* sc1p;  // row g + 8's
  __device__ __forceinline__ Fp4Reads(const Job& j, const WarpSmem& s, int lane) {
    const int g = lane >> 2, t = lane & 3, ng = j.nsteps * 4;
    rrow = reinterpret_cast<const unsigned char*>(s.ring) + g * 64 + t * 4;
#pragma unroll
    for (int q = 0; q < 4; ++q) ro[q] = ((q + (g >> 1)) & 3) * 16;
    sc0p = s.sc + g * ng;
    sc1p = s.sc + (g + 8) * ng;
  }
};

// (the down kernel) the job's 16 row sums for token 0 -> s.red[warp][0..15]. Every address a lane reads is its base
// plus a constant or a per-chunk offset (nothing recomputed per group). h is read by every lane: the MMA's column g is
// token 0's h in every column, and only column 0 (lanes t == 0) is kept.
template <bool FP4>
__device__ __forceinline__ void run(const Job& j, const Lane& l, const WarpSmem& s, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float acc0 = 0.0f, acc1 = 0.0f;  // rows g, g + 8 (token 0 is the MMA column 0: lanes t == 0 hold it)
  int slot = 0;                    // c % NBUF
  if constexpr (FP4) {
    const Fp4Reads rd(j, s, lane);
    const unsigned char *rrow = rd.rrow, *sc0p = rd.sc0p, *sc1p = rd.sc1p;
    const int* ro = rd.ro;
    const unsigned char* xt = reinterpret_cast<const unsigned char*>(s.xh) + t * 16;  // 8 f16 of group q: q * 64
    for (int c = 0; c < l.nchunk; ++c) {
      await_chunk(l, c, slot);
      const unsigned char* rc = rrow + slot * (NSTEP * kStepB);
#pragma unroll
      for (int st = 0; st < NSTEP; ++st) {
        const int step = c * NSTEP + st;
        if (step >= l.nsteps) break;
        const uint32_t sc0 = *reinterpret_cast<const uint32_t*>(sc0p + step * 4);
        const uint32_t sc1 = *reinterpret_cast<const uint32_t*>(sc1p + step * 4);
        const float fx = s.xs[step] * 64.0f;
        const unsigned char* xs = xt + step * 256;
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // group q of the step (copied by lane (g, q) of the quad)
          const unsigned char* rq = rc + st * kStepB + ro[q];
          const uint32_t w0 = *reinterpret_cast<const uint32_t*>(rq);
          const uint32_t w1 = *reinterpret_cast<const uint32_t*>(rq + 512);
          const uint4 xb = *reinterpret_cast<const uint4*>(xs + q * 64);
          float d[4];
          mma_e4m3_f16x(d, fp4_even(w0), fp4_even(w1), fp4_odd(w0), fp4_odd(w1), xb, true);
          float f0, f1;
          if (q == 0) f0 = e8m0<0>(sc0), f1 = e8m0<0>(sc1);
          if (q == 1) f0 = e8m0<1>(sc0), f1 = e8m0<1>(sc1);
          if (q == 2) f0 = e8m0<2>(sc0), f1 = e8m0<2>(sc1);
          if (q == 3) f0 = e8m0<3>(sc0), f1 = e8m0<3>(sc1);
          acc0 += d[0] * (f0 * fx);
          acc1 += d[2] * (f1 * fx);
        }
      }
      slot = slot == NBUF - 1 ? 0 : slot + 1;
    }
  } else {  // one 128-column block per chunk; the lane reads back the 16 bytes it copied
    const unsigned char* wl = l.slot0;
    const unsigned char* xt = reinterpret_cast<const unsigned char*>(s.xh) + t * 32;  // 16 f16 of a step
    const float* bs = reinterpret_cast<const float*>(j.sc);
    for (int c = 0; c < l.nchunk; ++c) {
      await_chunk(l, c, slot);
      const unsigned char* wc = wl + slot * (NSTEP * kStepB);
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int st = 0; st < NSTEP; ++st) {
        const int step = c * NSTEP + st;
        const uint4 wa = *reinterpret_cast<const uint4*>(wc + st * kStepB);
        const uint4 wb = *reinterpret_cast<const uint4*>(wc + st * kStepB + 512);
        const uint4* xp = reinterpret_cast<const uint4*>(xt + step * 128);
        mma_e4m3_f16x(d, wa.x, wb.x, wa.y, wb.y, xp[0], false);
        mma_e4m3_f16x(d, wa.z, wb.z, wa.w, wb.w, xp[1], false);
      }
      const float f = __ldg(bs + c) * s.xs[c];
      acc0 += d[0] * f;
      acc1 += d[2] * f;
      slot = slot == NBUF - 1 ? 0 : slot + 1;
    }
  }
  if (t == 0) {
    s.red[warp * 16 + g] = acc0;
    s.red[warp * 16 + g + 8] = acc1;
  }
}

// ---- the up kernel: wgmma with x's K quarters as B's columns ----
// One wgmma m64n8k32 (e4m3, fp32 accumulation) per 32 values: warpgroup mat is
// the four warps (mat, kq), the decoded weights of warp kq (16 rows, its K quarter) are the register operand A (the
// e2m1 -> e4m3 codes of fp4_even / fp4_odd as they are, or the FP8 codes), and B holds x's four quarters as columns 0-3
// (shared memory, k slots permuted as A's fragments take them), so warp kq keeps column kq (lanes t == kq / 2). Columns
// 4-7 read the next 16-slot row (the four quarters' next 16 bytes) and are never used. MXFP4: one wgmma per 32-value
// group, promoted with its E8M0 scale; FP8: four into one sum per 128-column block, promoted with the block scale.
constexpr int kXq = 64;  // B's bytes per 16 k slots: four quarters x 16 bytes

// ring | scale bytes | x's codes as B (D bytes + one more 16-slot row) | x's scales (D / 128) | the row sums [8][16]
constexpr int smem_up_bytes(int D) { return kWarps * (kRingU4 * 16 + kMaxSc) + D + kXq + (D / 128) * 4 + kWarps * 16 * 4; }

__device__ __forceinline__ void wgmma_m64n8k32_rs(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(accumulate));
}

// B at shared address saddr, no swizzle: core matrices of 8 rows (columns n) x 16 bytes, rows 16 bytes apart, the
// next 16 k slots kXq bytes further (both offsets kXq: only one core matrix along N)
__device__ __forceinline__ uint64_t desc_xq(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(kXq >> 4) << 16) |
         (static_cast<uint64_t>(kXq >> 4) << 32);
}

// the 4 codes of lane L (values 4L .. 4L + 3 of block b of quarter kq, value 4L in the low byte) -> their k slots in
// column kq. MXFP4, per 32-value group: word w's evens to slots 4w .., its odds to 16 + 4w .. (fp4_even / fp4_odd);
// FP8, per 64 columns: lane t's 16 bytes of a row, columns 16t + 4i .. 16t + 4i + 3, to slot 4t of the i-th 16 slots
template <bool FP4>
__device__ __forceinline__ void put_codes(unsigned char* xb, int kq, int b, uint32_t c, int lane) {
  unsigned char* col = xb + b * 8 * kXq + kq * 16;  // the block's 8 rows of 16 slots, column kq
  if constexpr (FP4) {
    const uint32_t eo = __byte_perm(c, 0u, 0x3120u);
    unsigned char* p = col + (lane >> 3) * 2 * kXq + ((lane & 7) >> 1) * 4 + (lane & 1) * 2;
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(eo & 0xFFFFu);
    *reinterpret_cast<uint16_t*>(p + kXq) = static_cast<uint16_t>(eo >> 16);
  } else {
    *reinterpret_cast<uint32_t*>(col + ((lane >> 4) * 4 + (lane & 3)) * kXq + ((lane & 15) >> 2) * 4) = c;
  }
}

// one warp's 16 row sums over its K quarter kq (token 0; lanes t == kq / 2 keep rows g, g + 8): xaddr = B's shared
// address, xs = the quarter's block scales
template <bool FP4>
__device__ __forceinline__ void run_wgq(const Job& j, const Lane& l, const WarpSmem& s, uint32_t xaddr,
                                        const float* xs, int kq, int lane, float& acc0, float& acc1) {
  const bool odd = kq & 1;  // column kq: d[odd] (row g), d[2 + odd] (row g + 8)
  acc0 = 0.0f, acc1 = 0.0f;
  int slot = 0;
  if constexpr (FP4) {
    const Fp4Reads rd(j, s, lane);
    const unsigned char *rrow = rd.rrow, *sc0p = rd.sc0p, *sc1p = rd.sc1p;
    const int* ro = rd.ro;
    // scale-d 0 (every group its own sum) from a value ptxas cannot prove zero: with a literal 0 an earlier form of this
    // loop had its wgmmas serialized (C7511); this one compiles either way (66 registers, 68 with the literal)
    const int fresh = l.nsteps < 0;
    float d[4][4];
    for (int c = 0; c < l.nchunk; ++c) {
      await_chunk(l, c, slot);
      const unsigned char* rc = rrow + slot * (NSTEP * kStepB);
#pragma unroll
      for (int st = 0; st < NSTEP; ++st) {
        const int step = c * NSTEP + st;
        if (step >= l.nsteps) break;
        uint32_t a[4][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const unsigned char* rq = rc + st * kStepB + ro[q];
          const uint32_t w0 = *reinterpret_cast<const uint32_t*>(rq);
          const uint32_t w1 = *reinterpret_cast<const uint32_t*>(rq + 512);
          a[q][0] = fp4_even(w0), a[q][1] = fp4_even(w1), a[q][2] = fp4_odd(w0), a[q][3] = fp4_odd(w1);
        }
        dev::wgmma_fence();
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          wgmma_m64n8k32_rs(d[q], a[q][0], a[q][1], a[q][2], a[q][3], desc_xq(xaddr + (step * 4 + q) * 2 * kXq), fresh);
        }
        dev::wgmma_commit();
        const uint32_t sc0 = *reinterpret_cast<const uint32_t*>(sc0p + step * 4);
        const uint32_t sc1 = *reinterpret_cast<const uint32_t*>(sc1p + step * 4);
        const float fx = xs[step] * 64.0f;
        dev::wgmma_wait0();
#pragma unroll
        for (int q = 0; q < 4; ++q) dev::fence_acc(d[q]);
        acc0 += (odd ? d[0][1] : d[0][0]) * (e8m0<0>(sc0) * fx);
        acc1 += (odd ? d[0][3] : d[0][2]) * (e8m0<0>(sc1) * fx);
        acc0 += (odd ? d[1][1] : d[1][0]) * (e8m0<1>(sc0) * fx);
        acc1 += (odd ? d[1][3] : d[1][2]) * (e8m0<1>(sc1) * fx);
        acc0 += (odd ? d[2][1] : d[2][0]) * (e8m0<2>(sc0) * fx);
        acc1 += (odd ? d[2][3] : d[2][2]) * (e8m0<2>(sc1) * fx);
        acc0 += (odd ? d[3][1] : d[3][0]) * (e8m0<3>(sc0) * fx);
        acc1 += (odd ? d[3][3] : d[3][2]) * (e8m0<3>(sc1) * fx);
      }
      slot = slot == NBUF - 1 ? 0 : slot + 1;
    }
  } else {  // one 128-column block per chunk: four wgmmas into one sum, promoted with the block scale
    const float* bs = reinterpret_cast<const float*>(j.sc);
    float d[4];
    for (int c = 0; c < l.nchunk; ++c) {
      await_chunk(l, c, slot);
      const unsigned char* wc = l.slot0 + slot * (NSTEP * kStepB);
      uint4 wa[NSTEP], wb[NSTEP];
#pragma unroll
      for (int st = 0; st < NSTEP; ++st) {
        wa[st] = *reinterpret_cast<const uint4*>(wc + st * kStepB);
        wb[st] = *reinterpret_cast<const uint4*>(wc + st * kStepB + 512);
      }
      dev::wgmma_fence();
#pragma unroll
      for (int st = 0; st < NSTEP; ++st) {
        const uint32_t xa = xaddr + ((c * NSTEP + st) * 4) * kXq;
        wgmma_m64n8k32_rs(d, wa[st].x, wb[st].x, wa[st].y, wb[st].y, desc_xq(xa), st);
        wgmma_m64n8k32_rs(d, wa[st].z, wb[st].z, wa[st].w, wb[st].w, desc_xq(xa + 2 * kXq), 1);
      }
      dev::wgmma_commit();
      const float f = __ldg(bs + c) * xs[c];
      dev::wgmma_wait0();
      dev::fence_acc(d);
      acc0 += (odd ? d[1] : d[0]) * f;
      acc1 += (odd ? d[3] : d[2]) * f;
      slot = slot == NBUF - 1 ? 0 : slot + 1;
    }
  }
}

template <bool XQ>
__global__ void __launch_bounds__(kThreads, 3) moe_up_kernel(const MoeArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kw = a.D / 4, nq = kw / 128;  // a quarter's columns and blocks
  unsigned char* xb = smem + kWarps * (kRingU4 * 16 + kMaxSc);
  float* xs = reinterpret_cast<float*>(xb + a.D + kXq);
  float* red = xs + a.D / 128;
  WarpSmem s;
  s.ring = reinterpret_cast<uint4*>(smem) + warp * kRingU4;
  s.sc = smem + kWarps * kRingU4 * 16 + warp * kMaxSc;
  s.red = red;
  const int groups = a.I / 16;
  const int nshared = a.has_shared ? groups : 0;
  const int bid = static_cast<int>(blockIdx.x);
  const bool shared = bid < nshared;
  const int q = shared ? bid : bid - nshared;
  const int slot = shared ? a.k : q / groups;
  const int row0 = (q % groups) * 16;
  const int mat = warp >> 2, kq = warp & 3;  // w1 / w3, quarter of K
  // warps kq (w1) and kq + 4 (w3) stage half of quarter kq's blocks each: b0 .. b0 + half - 1
  const int half = nq / 2, b0 = mat * half;
  uint32_t codes[kMaxXV / 256];
  float bsc = 0.0f;  // lane i < half: block b0 + i's scale
  // x's loads go through L2 only (ld.global.cg): the plain cached loads made the layers ~0.9 us slower (forty-ninth
  // pass, bits unchanged; the same change in the down kernel's h loads, the GEMV's x loads or the router's was slower
  // or no faster)
  auto load_x = [&]() {  // every load issued before the first is used (one L2 round trip)
    const long long off = static_cast<long long>(kq) * kw + b0 * 128;
    if constexpr (XQ) {
#pragma unroll
      for (int i = 0; i < kMaxXV / 256; ++i) {
        if (i < half) codes[i] = __ldcg(reinterpret_cast<const unsigned int*>(a.xq + off + i * 128 + lane * 4));
      }
      if (lane < half) bsc = __ldcg(a.xqs + off / 128 + lane);
    } else {  // act_quant, block by block
      uint2 v[kMaxXV / 256];
#pragma unroll
      for (int i = 0; i < kMaxXV / 256; ++i) {
        if (i < half) v[i] = __ldcg(reinterpret_cast<const uint2*>(a.x + off + i * 128 + lane * 4));
      }
#pragma unroll
      for (int i = 0; i < kMaxXV / 256; ++i) {
        if (i < half) {
          const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[i].x));
          const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[i].y));
          const float amax = dev::warp_max(fmaxf(fmaxf(fabsf(lo.x), fabsf(lo.y)), fmaxf(fabsf(hi.x), fabsf(hi.y))));
          float sc, inv;
          ue8m0_scale(amax, sc, inv);
          codes[i] = e4m3x2_code(lo.x, lo.y, inv) | (e4m3x2_code(hi.x, hi.y, inv) << 16);
          if (lane == i) bsc = sc;
        }
      }
    }
  };
  auto store_x = [&](auto fp4) {
    constexpr bool FP4 = decltype(fp4)::value;
#pragma unroll
    for (int i = 0; i < kMaxXV / 256; ++i) {
      if (i < half) put_codes<FP4>(xb, kq, b0 + i, codes[i], lane);
    }
    if (lane < half) xs[kq * nq + b0 + lane] = bsc;
    if (threadIdx.x < kXq / 4) reinterpret_cast<uint32_t*>(xb + a.D)[threadIdx.x] = 0u;  // read as columns 4-7
    dev::fence_proxy_async();
    __syncthreads();  // every quarter of B in place for both warpgroups
  };
  const uint32_t xaddr = static_cast<uint32_t>(__cvta_generic_to_shared(xb));
  // B's block b of quarter kq sits at b * 8 * kXq: a quarter's blocks are interleaved with the others' by column, so
  // quarter kq's block b is B's block b, column kq (put_codes), and a warp walks B from its start
  Job j;
  float acc0, acc1;
  if (shared) {
    j.w = (mat ? a.v3 : a.v1) + static_cast<long long>(row0) * a.D + kq * kw;
    j.ld = a.D;
    j.sc = reinterpret_cast<const uint8_t*>((mat ? a.v3s : a.v1s) + (row0 / 128) * (a.D / 128) + kq * kw / 128);
    j.sc_ld = 0;
    j.nsteps = kw / 64;
    const Lane l = lane_of(j, s, lane);
    prefetch<false>(j, l, s, lane);
    dev::griddep_wait();
    dev::griddep_launch_dependents();  // after the wait: see moe_down_kernel
    load_x();
    store_x(std::false_type());
    run_wgq<false>(j, l, s, xaddr, xs + kq * nq, kq, lane, acc0, acc1);
  } else {
    dev::griddep_wait();
    dev::griddep_launch_dependents();
    load_x();
    const long long e = a.idx[slot];
    const long long r = e * a.I + row0;
    j.w = (mat ? a.w3 : a.w1) + r * (a.D / 2) + kq * kw / 2;
    j.ld = a.D / 2;
    j.sc = (mat ? a.s3 : a.s1) + r * (a.D / 32) + kq * kw / 32;
    j.sc_ld = a.D / 32;
    j.nsteps = kw / 128;
    const Lane l = lane_of(j, s, lane);
    prefetch<true>(j, l, s, lane);
    store_x(std::true_type());
    run_wgq<true>(j, l, s, xaddr, xs + kq * nq, kq, lane, acc0, acc1);
  }
  if ((lane & 3) == (kq >> 1)) {
    red[warp * 16 + (lane >> 2)] = acc0;
    red[warp * 16 + (lane >> 2) + 8] = acc1;
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    const int r = threadIdx.x;
    float gate = 0.0f, up = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      gate += red[w * 16 + r];
      up += red[(4 + w) * 16 + r];
    }
    gate = bf16_round(gate);
    up = bf16_round(up);
    if (a.limit > 0.0f) {
      up = fminf(fmaxf(up, -a.limit), a.limit);
      gate = fminf(gate, a.limit);
    }
    float hv = gate / (1.0f + expf(-gate)) * up;
    if (!shared) hv *= a.wts[slot];
    a.h[static_cast<long long>(slot) * a.I + row0 + r] = __float2bfloat16_rn(hv);
  }
}

// the weighted sum over the experts of the CTA's 16 output rows (threads 0-15, one row each), then the FFN's mHC post of
// those columns (with a.out); vals (or null) receives the new streams' values [4][16] as stored (bf16). Its operands
// were staged before the wait (EpiOperands): the expert ids by the routed warps, the post's comb, post and the CTA's
// columns of the residual streams by threads 0-15 (written by the mHC boundary kernel, two kernels back: see
// moe_down_kernel); loaded after the block barrier they were one more L2 round trip in every CTA's tail.
// The experts are summed in ascending (expert id, slot) order, picked by rank in registers (no indexed local array).
struct EpiOperands {
  long long ids[6];
  float cb[kHc * kHc];
  float pp[kHc];
  float xs[kHc * kCols];
};

__device__ __forceinline__ void down_epilogue(const MoeArgs& a, const WarpSmem& s, const EpiOperands& e, int row0,
                                              float* vals) {
  constexpr int K = 6;  // routed experts, at most (the binding checks 1 <= k <= 6)
  if (threadIdx.x < 16) {
    const int r = threadIdx.x, d = row0 + r;
    long long ids[K];
#pragma unroll
    for (int i = 0; i < K; ++i) ids[i] = i < a.k ? e.ids[i] : 0;
    float cb[kHc * kHc], pp[kHc], xs[kHc];
    if (a.out != nullptr) {
#pragma unroll
      for (int i = 0; i < kHc * kHc; ++i) cb[i] = e.cb[i];
#pragma unroll
      for (int j = 0; j < kHc; ++j) {
        pp[j] = e.pp[j];
        xs[j] = e.xs[j * kCols + r];
      }
    }
    float rv[K];
    int rank[K];
#pragma unroll
    for (int i = 0; i < K; ++i) {
      rv[i] = i < a.k ? bf16_round(s.red[i * 16 + r]) : 0.0f;
      int n = 0;
#pragma unroll
      for (int j = 0; j < K; ++j) n += (j < a.k && (ids[j] < ids[i] || (ids[j] == ids[i] && j < i))) ? 1 : 0;
      rank[i] = n;
    }
    float y = 0.0f;
#pragma unroll
    for (int n = 0; n < K; ++n) {
      if (n < a.k) {
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < K; ++i) v = (i < a.k && rank[i] == n) ? rv[i] : v;
        y += v;
      }
    }
    if (a.has_shared) y += bf16_round(s.red[(kWarps - 2) * 16 + r] + s.red[(kWarps - 1) * 16 + r]);
    const __nv_bfloat16 yb = __float2bfloat16_rn(y);
    a.y[d] = yb;
    if (a.out != nullptr) {  // the mHC post of this column, mhc_post's per-element FMAs (its Triton kernel's bits)
#pragma unroll
      for (int j = 0; j < kHc; ++j) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < kHc; ++i) acc = fmaf(cb[i * kHc + j], xs[i], acc);
        const __nv_bfloat16 o = __float2bfloat16_rn(fmaf(pp[j], __bfloat162float(yb), acc));
        a.out[j * a.D + d] = o;
        if (vals != nullptr) vals[j * kCols + r] = __bfloat162float(o);
      }
    }
  }
}

// The next sublayer's mHC pre + RMSNorm (a.nfn): this CTA's partial mixes and sum of squares over its 16 columns of
// the 4 new streams (vals), then the last CTA to arrive finishes the token as mhc.cu's finishing CTA does (mhc_dev.h)
// and resets the counter. fn: the CTA's mixer slice [24][4][16] and bs: base [24], scale [3] (shared memory).
__device__ __forceinline__ void next_pre(const MoeArgs& a, unsigned char* smem, const float* vals, const float* fn,
                                         const float* bs, int warp, int lane) {
  using mhc::HC;
  using mhc::MIX;
  __shared__ float mix[MIX];
  __shared__ float red[kWarps];
  __shared__ int last;
  const int blk = static_cast<int>(blockIdx.x), nblk = static_cast<int>(gridDim.x);
  __syncthreads();  // vals
  {
    const int ek = lane >> 3, ec = (lane & 7) * 2;
    const float x0 = vals[ek * kCols + ec], x1 = vals[ek * kCols + ec + 1];
    float dots[kPreRows];
#pragma unroll
    for (int r = 0; r < kPreRows; ++r) {
      const float2 f = *reinterpret_cast<const float2*>(fn + ((kPreRows * warp + r) * HC + ek) * kCols + ec);
      dots[r] = dev::warp_sum(fmaf(f.y, x1, f.x * x0));
    }
    const float sq = dev::warp_sum(fmaf(x1, x1, x0 * x0));
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kPreRows; ++r) a.part[(kPreRows * warp + r) * nblk + blk] = dots[r];
      if (warp == 0) a.sq[blk] = sq;
    }
  }
  // arrival: one acquire-release atomic (thread 0, after the CTA barrier: its release covers the CTA's writes, its
  // acquire orders the finisher's reads of the others' writes after it; those reads go through L2)
  __syncthreads();
  if (threadIdx.x == 0) last = dev::arrive_acq_rel(a.counter) == nblk - 1;
  __syncthreads();
  if (!last) return;

  // the whole row of the new streams (this launch's own, read through L2) and the norm weight, staged in the rings'
  // shared memory (every warp is past its stream), in flight while the partials are reduced
  const int D = a.D, nv = D / 8;
  uint4* rows = reinterpret_cast<uint4*>(smem);  // [4][nv]
  uint4* wn = rows + HC * nv;                    // [nv]
#pragma unroll 1
  for (int i = threadIdx.x; i < HC * nv; i += kThreads) cp_async16(rows + i, reinterpret_cast<const uint4*>(a.out) + i, true);
#pragma unroll 1
  for (int i = threadIdx.x; i < nv; i += kThreads) cp_async16(wn + i, reinterpret_cast<const uint4*>(a.nw) + i, true);
  cp_async_commit();
  mhc::reduce_mixes<kPreRows, 8>(a.part, a.sq, 0, nblk, static_cast<long long>(HC) * D, a.norm_eps, mix, warp, lane);
  cp_async_wait<0>();
  __syncthreads();
  if (warp == 0) {  // post' and the Sinkhorn comb
    mhc::sinkhorn_warp(mix, bs + MIX, bs, a.iters, a.hc_eps, a.npost, a.ncomb, lane);
  } else {  // y = sum_j pre_j X_j (bf16), then its RMSNorm; vectors r0, r0 + 224, .. as mhc.cu's finish takes them
    constexpr int kRowThreads = kThreads - 32;
    const int r0 = static_cast<int>(threadIdx.x) - 32;
    float pre[HC];
    mhc::pre_weights(mix, bs + MIX, bs, a.hc_eps, pre);
    float ss = 0.0f;
#pragma unroll 1
    for (int v = r0; v < nv; v += kRowThreads) {  // y kept over stream 0's vector (only this thread reads it again)
      uint4 q[HC], y;
#pragma unroll
      for (int j = 0; j < HC; ++j) q[j] = rows[j * nv + v];
      mhc::y_vector(q, pre, y, ss);
      rows[v] = y;
    }
    const float rinv = mhc::row_rinv(ss, red, warp, lane, D, a.eps);
#pragma unroll 1
    for (int v = r0; v < nv; v += kRowThreads) reinterpret_cast<uint4*>(a.ny)[v] = mhc::norm_vector(wn[v], rows[v], rinv);
  }
  if (threadIdx.x == 0) *a.counter = 0;  // every CTA has arrived: ready for the next launch
}

template <bool PRE>
__global__ void __launch_bounds__(kThreads, 3) moe_down_kernel(const MoeArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const WarpSmem s = carve(smem, warp, a.I);
  const int row0 = static_cast<int>(blockIdx.x) * kCols;
  const bool routed = warp < a.k;
  const bool shared = a.has_shared && warp >= kWarps - 2;
  dev::griddep_launch_dependents();
  // the next pre's mixer slice for this CTA's columns (24 rows x 4 streams x 16, fp32), base and scale (weights: never
  // written by an earlier kernel) copied into shared memory before the wait (the oldest commit group: the rings' waits
  // cover it); and its norm weight on its way into L2 (one 128-byte line per CTA), which the finishing CTA reads
  float* pfn = nullptr;
  float* pbs = nullptr;
  if constexpr (PRE) {
    __shared__ __align__(16) float sfn[mhc::MIX * kHc * kCols];
    __shared__ float sbs[mhc::MIX + 3];
    pfn = sfn;
    pbs = sbs;
    const long long K = static_cast<long long>(kHc) * a.D;
    for (int i = threadIdx.x; i < mhc::MIX * kHc * kCols / 4; i += kThreads) {  // 16-byte pieces
      const int r = i / (kHc * kCols / 4), k = (i / (kCols / 4)) % kHc, q = i % (kCols / 4);
      cp_async16(sfn + 4 * i, a.nfn + r * K + static_cast<long long>(k) * a.D + row0 + 4 * q, true);
    }
    if (threadIdx.x < mhc::MIX + 3) {
      dev::cp_async4(sbs + threadIdx.x, threadIdx.x < mhc::MIX ? a.nbase + threadIdx.x : a.nscale + (threadIdx.x - mhc::MIX));
    }
    cp_async_commit();
    if (threadIdx.x == 0 && blockIdx.x * 64 < a.D) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(a.nw + blockIdx.x * 64));
    }
  }
  // The routed w2 weights are issued before the wait too: the expert ids come from the router, the kernel before
  // moe_up_kernel, whose CTAs trigger this launch only after their own wait, i.e. once the router has completed and
  // its writes are performed. The ids are read through L2 (ld.global.cg), never a stale L1 line.
  // the epilogue's operands (EpiOperands), loaded before the wait and stored after it: the routed warps' expert ids
  // (read for their w2 addresses anyway); comb, post and the residual streams, written by the mHC boundary kernel
  // before the router: this launch needs every moe_up CTA past its wait (router complete), and the router's CTAs
  // waited on the boundary kernel, so its writes are complete and performed; read through L2 (ld.global.cg)
  __shared__ EpiOperands epi;
  float eo[kHc + 2];
  const bool epi_loader = a.out != nullptr && threadIdx.x < 16;
  if (epi_loader) {
    const int r = threadIdx.x;
#pragma unroll
    for (int jj = 0; jj < kHc; ++jj) eo[jj] = __bfloat162float(__ldcg(a.streams + jj * a.D + row0 + r));
    eo[kHc] = __ldcg(a.comb + r);
    eo[kHc + 1] = r < kHc ? __ldcg(a.post + r) : 0.0f;
  }
  Job j;
  if (shared) {  // half (warp - 6) of the shared expert's K
    const int half = warp - (kWarps - 2), kh = a.I / 2;
    j.w = a.v2 + static_cast<long long>(row0) * a.I + half * kh;
    j.ld = a.I;
    j.sc = reinterpret_cast<const uint8_t*>(a.v2s + (row0 / 128) * (a.I / 128) + half * kh / 128);
    j.sc_ld = 0;
    j.nsteps = kh / 64;
    j.x = a.h + static_cast<long long>(a.k) * a.I + half * kh;
    const Lane l = lane_of(j, s, lane);
    prefetch<false>(j, l, s, lane);
    dev::griddep_wait();
    XRegs xr;
    load_x(j, kh / 128, lane, xr);
    quantize_x<false>(xr, kh / 128, s, lane);
    run<false>(j, l, s, warp, lane);
  } else if (routed) {
    const long long id = __ldcg(a.idx + warp);
    if (lane == 0) epi.ids[warp] = id;
    const long long r = id * a.D + row0;
    j.w = a.w2 + r * (a.I / 2);
    j.ld = a.I / 2;
    j.sc = a.s2 + r * (a.I / 32);
    j.sc_ld = a.I / 32;
    j.nsteps = a.I / 128;
    const Lane l = lane_of(j, s, lane);
    prefetch<true>(j, l, s, lane);
    dev::griddep_wait();
    if (epi_loader) {
      const int r = threadIdx.x;
#pragma unroll
      for (int jj = 0; jj < kHc; ++jj) epi.xs[jj * kCols + r] = eo[jj];
      epi.cb[r] = eo[kHc];
      if (r < kHc) epi.pp[r] = eo[kHc + 1];
    }
    j.x = a.h + static_cast<long long>(warp) * a.I;
    XRegs xr;
    load_x(j, a.I / 128, lane, xr);
    quantize_x<true>(xr, a.I / 128, s, lane);
    run<true>(j, l, s, warp, lane);
  }
  if constexpr (PRE) cp_async_wait<0>();  // the mixer slice (warps without a stream waited for nothing yet)
  __syncthreads();
  if constexpr (PRE) {
    __shared__ float vals[kHc * kCols];
    down_epilogue(a, s, epi, row0, vals);
    next_pre(a, smem, vals, pfn, pbs, warp, lane);
  } else {
    down_epilogue(a, s, epi, row0, nullptr);
  }
}

cudaError_t launch(void (*kernel)(MoeArgs), const MoeArgs& a, int grid, int smem, bool pdl, cudaStream_t stream) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  return launch_pdl(kernel, dim3(grid), dim3(kThreads), smem, pdl, stream, a);
}

}  // namespace

cudaError_t moe_decode_launch(const MoeArgs& a, bool pdl, cudaStream_t stream) {
  // the next pre's finish stages the new streams' row and the norm weight (10 D bytes) in the down kernel's shared memory
  if (a.nfn != nullptr && 10 * a.D > smem_bytes(a.I)) return cudaErrorInvalidValue;
  const int up = (a.has_shared ? a.I / 16 : 0) + a.k * (a.I / 16);
  cudaError_t e = launch(a.xq != nullptr ? moe_up_kernel<true> : moe_up_kernel<false>, a, up, smem_up_bytes(a.D), pdl,
                         stream);
  if (e != cudaSuccess) return e;
  return launch(a.nfn != nullptr ? moe_down_kernel<true> : moe_down_kernel<false>, a, a.D / kCols, smem_bytes(a.I), pdl,
                stream);
}

}  // namespace dsv4
