// The one Python binding of dsv4's CUDA kernels (built by dsv4/kernels/cuda/__init__.py). Each function checks
// what the kernel needs (the Python wrappers in dsv4/ops/ validate shapes and pick configs) and launches on the
// current stream; nothing here synchronizes the host.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdio>

#include "attn.h"
#include "gemm.h"
#include "gemv.h"
#include "mhc.h"
#include "moe.h"
#include "probe.h"
#include "router.h"
#include "topk.h"

namespace {

// TORCH_CHECK with a printf-style message. Inside this extension, c10::str's stream formatting of a multi-part
// message crashes (H200 image: libtorch built with gcc-toolset-13, the extension with the system g++ 13.3; measured:
// a failed gemv K check segfaulted instead of raising), so every message that carries values is formatted here and
// handed to libtorch as one C string, the path a literal message takes.
#define DSV4_CHECK(cond, ...)                                            \
  do {                                                                   \
    if (!(cond)) {                                                       \
      char dsv4_msg_[512];                                               \
      std::snprintf(dsv4_msg_, sizeof(dsv4_msg_), __VA_ARGS__);          \
      TORCH_CHECK(false, static_cast<const char*>(dsv4_msg_));           \
    }                                                                    \
  } while (0)

inline long long LL(int64_t v) { return static_cast<long long>(v); }

// out [M, N] = x [M, K] @ w [N, K]^T; fp8 w: x quantized to e4m3 1x128 (quant_x) or taken as bf16; groups > 1:
// x is [M, groups * K] and the N / groups rows of group g read its g-th K columns (wo_a)
void gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, at::Tensor& out,
          int64_t splits, int64_t wr, int64_t nstep, int64_t nchunk, bool quant_x, int64_t groups, bool pdl,
          const c10::optional<at::Tensor>& norm_w, double norm_eps) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && out.is_cuda(), "gemv: tensors must be on CUDA");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "gemv: x [M, K], w [N, K], out [M, N]");
  const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || w.scalar_type() == at::kBFloat16, "gemv: w must be float8_e4m3fn or bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "gemv: x must be bf16 or fp32");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, "gemv: out must be bf16 or fp32");
  TORCH_CHECK(w.is_contiguous() && x.stride(1) == 1 && out.stride(1) == 1, "gemv: unit column strides, w contiguous");
  DSV4_CHECK(groups >= 1 && x.size(1) % groups == 0, "gemv: x columns must split into %lld groups", LL(groups));
  const int64_t M = x.size(0), K = x.size(1) / groups, N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "gemv: shape mismatch");
  TORCH_CHECK(M >= 1 && M <= 8, "gemv: 1 to 8 tokens");
  TORCH_CHECK(wr == 1 || wr == 2 || wr == 4 || wr == 8, "gemv: wr must be 1, 2, 4 or 8");
  TORCH_CHECK(splits >= 1 && splits <= 8, "gemv: splits must be 1..8");
  DSV4_CHECK(K % (fp8 ? 128 : 8) == 0, "gemv: K must be a multiple of %d", fp8 ? 128 : 8);
  TORCH_CHECK(quant_x || (fp8 && x.scalar_type() == at::kBFloat16), "gemv: unquantized x needs fp8 w and bf16 x");
  DSV4_CHECK(groups == 1 || (N % groups == 0 && (N / groups) % (16 * wr) == 0),
             "gemv: each group's rows must be a multiple of the CTA's %lld", LL(16 * wr));
  const int fmt = fp8 ? (quant_x ? 1 : 2) : 0;
  dsv4::GemvArgs a{};
  a.x = x.data_ptr();
  a.sx = x.stride(0);
  a.w = w.data_ptr();
  if (fp8) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->dim() == 2 && scale->size(0) == (N + 127) / 128 && scale->size(1) == K / 128,
                "gemv: fp8 weights need fp32 block scales [ceil(N/128), K/128]");
    a.ws = scale->data_ptr<float>();
    a.ws_ld = static_cast<int>(scale->size(1));
  }
  a.out = out.data_ptr();
  a.so = out.stride(0);
  a.M = static_cast<int>(M);
  a.N = static_cast<int>(N);
  a.K = static_cast<int>(K);
  a.S = static_cast<int>(splits);
  a.WR = static_cast<int>(wr);
  TORCH_CHECK(nchunk >= 1, "gemv: nchunk must be >= 1");
  a.nchunk = static_cast<int>(nchunk);
  a.ks = static_cast<int>((8 / wr) * nchunk * nstep * (fp8 ? 64 : 32));
  TORCH_CHECK(static_cast<int64_t>(a.ks) * splits >= K, "gemv: splits x columns per CTA must cover K");
  a.x_f32 = x.scalar_type() == at::kFloat;
  a.out_f32 = out.scalar_type() == at::kFloat;
  a.x_vec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && (x.stride(0) * x.element_size()) % 16 == 0 &&
            (K * x.element_size()) % 16 == 0;
  a.xg_rows = groups > 1 ? static_cast<int>(N / groups) : 0;
  if (norm_w.has_value()) {
    TORCH_CHECK(fp8 && quant_x && groups == 1 && x.scalar_type() == at::kBFloat16,
                "gemv: a norm needs fp8 w, x quantized, bf16 x, one group");
    TORCH_CHECK(norm_w->is_cuda() && norm_w->scalar_type() == at::kBFloat16 && norm_w->is_contiguous() &&
                    norm_w->dim() == 1 && norm_w->size(0) == K,
                "gemv: norm_w must be a contiguous bf16 [K] on CUDA");
    a.norm_w = reinterpret_cast<const __nv_bfloat16*>(norm_w->data_ptr());
    a.norm_eps = static_cast<float>(norm_eps);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t e = dsv4::gemv_launch(a, fmt, static_cast<int>(nstep), pdl, c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "gemv launch failed: %s", cudaGetErrorString(e));
}

int64_t gemv_smem(int64_t fmt, bool x_split, int64_t M, int64_t ks, int64_t wr, int64_t nstep, int64_t nchunk) {
  return dsv4::gemv_smem_bytes(static_cast<int>(fmt), x_split, static_cast<int>(M), static_cast<int>(ks),
                               static_cast<int>(wr), static_cast<int>(nstep), static_cast<int>(nchunk));
}

// x [1, D] bf16, wts [1, k] fp32, idx [1, k] int64; routed MXFP4 stacks w1 / w3 [E, I, D/2] + [E, I, D/32] bytes, w2
// [E, D, I/2] + [E, D, I/32]; the FP8 shared expert (v1, v1s, v3, v3s, v2, v2s) or none; h [k + 1, I] bf16 scratch;
// y [1, D] bf16; optionally the FFN's mHC post (streams, post, comb -> out) and after it the next sublayer's mHC pre +
// RMSNorm on the new streams (nfn [24, 4 D], nbase [24], nscale [3] fp32, nw [D] bf16 -> ny [1, D] bf16, npost [4],
// ncomb [4, 4] fp32; part [24, D / 16] / sq [D / 16] fp32 scratch, counter int32 [>= 1], zero)
void moe_decode(const at::Tensor& x, const at::Tensor& wts, const at::Tensor& idx, const at::Tensor& w1,
                const at::Tensor& s1, const at::Tensor& w3, const at::Tensor& s3, const at::Tensor& w2,
                const at::Tensor& s2, const c10::optional<at::Tensor>& v1, const c10::optional<at::Tensor>& v1s,
                const c10::optional<at::Tensor>& v3, const c10::optional<at::Tensor>& v3s,
                const c10::optional<at::Tensor>& v2, const c10::optional<at::Tensor>& v2s, at::Tensor& h, at::Tensor& y,
                double limit, bool pdl, const c10::optional<at::Tensor>& streams, const c10::optional<at::Tensor>& post,
                const c10::optional<at::Tensor>& comb, const c10::optional<at::Tensor>& out,
                const c10::optional<at::Tensor>& xq, const c10::optional<at::Tensor>& xqs,
                const c10::optional<at::Tensor>& nfn, const c10::optional<at::Tensor>& nbase,
                const c10::optional<at::Tensor>& nscale, const c10::optional<at::Tensor>& nw,
                const c10::optional<at::Tensor>& ny, const c10::optional<at::Tensor>& npost,
                const c10::optional<at::Tensor>& ncomb, const c10::optional<at::Tensor>& part,
                const c10::optional<at::Tensor>& sq, const c10::optional<at::Tensor>& counter, int64_t iters,
                double hc_eps, double norm_eps, double eps) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(),
              "moe_decode: x must be one contiguous bf16 row [1, D]");
  const int64_t D = x.size(1), k = idx.size(1), E = w1.size(0), I = w1.size(1);
  DSV4_CHECK(D % 2048 == 0 && D <= 8192 && I % 512 == 0 && I <= 2048, "moe_decode: D (%lld) must be a multiple of "
             "2048 up to 8192 and I (%lld) a multiple of 512 up to 2048", LL(D), LL(I));
  TORCH_CHECK(k >= 1 && k <= 6 && idx.dim() == 2 && idx.size(0) == 1 && idx.scalar_type() == at::kLong &&
                  idx.is_contiguous(), "moe_decode: idx must be contiguous int64 [1, k], 1 <= k <= 6");
  TORCH_CHECK(wts.scalar_type() == at::kFloat && wts.is_contiguous() && wts.numel() == k,
              "moe_decode: wts must be contiguous fp32 [1, k]");
  auto fp4 = [&](const at::Tensor& w, const at::Tensor& s, int64_t n, int64_t kk, const char* name) {
    DSV4_CHECK(w.is_cuda() && w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(0) == E &&
                   w.size(1) == n && w.size(2) == kk / 2, "moe_decode: %s must be contiguous uint8 [%lld, %lld, %lld]",
               name, LL(E), LL(n), LL(kk / 2));
    DSV4_CHECK(s.scalar_type() == at::kByte && s.is_contiguous() && s.dim() == 3 && s.size(0) == E &&
                   s.size(1) == n && s.size(2) == kk / 32,
               "moe_decode: %s scales must be contiguous uint8 [%lld, %lld, %lld]", name, LL(E), LL(n), LL(kk / 32));
  };
  fp4(w1, s1, I, D, "w1");
  fp4(w3, s3, I, D, "w3");
  fp4(w2, s2, D, I, "w2");
  const bool has_shared = v1.has_value();
  auto fp8 = [&](const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& s, int64_t n, int64_t kk,
                 const char* name) {
    DSV4_CHECK(w.has_value() && s.has_value(), "moe_decode: shared %s missing", name);
    DSV4_CHECK(w->scalar_type() == at::kFloat8_e4m3fn && w->is_contiguous() && w->dim() == 2 && w->size(0) == n &&
                   w->size(1) == kk, "moe_decode: shared %s must be contiguous e4m3 [%lld, %lld]", name, LL(n), LL(kk));
    DSV4_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 2 && s->size(0) == n / 128 &&
                   s->size(1) == kk / 128, "moe_decode: shared %s scales must be fp32 [%lld, %lld]", name,
               LL(n / 128), LL(kk / 128));
  };
  if (has_shared) {
    fp8(v1, v1s, I, D, "w1");
    fp8(v3, v3s, I, D, "w3");
    fp8(v2, v2s, D, I, "w2");
  }
  TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.is_contiguous() && h.numel() == (k + 1) * I,
              "moe_decode: h must be contiguous bf16 [k + 1, I]");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.is_contiguous() && y.numel() == D, "moe_decode: y must be bf16 [1, D]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(h.data_ptr()) % 16 == 0,
              "moe_decode: x and h must be 16-byte aligned");
  dsv4::MoeArgs a{};
  a.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  a.idx = idx.data_ptr<int64_t>();
  a.wts = wts.data_ptr<float>();
  a.w1 = w1.data_ptr<uint8_t>();
  a.s1 = s1.data_ptr<uint8_t>();
  a.w3 = w3.data_ptr<uint8_t>();
  a.s3 = s3.data_ptr<uint8_t>();
  a.w2 = w2.data_ptr<uint8_t>();
  a.s2 = s2.data_ptr<uint8_t>();
  if (has_shared) {
    a.v1 = static_cast<const uint8_t*>(v1->data_ptr());
    a.v1s = v1s->data_ptr<float>();
    a.v3 = static_cast<const uint8_t*>(v3->data_ptr());
    a.v3s = v3s->data_ptr<float>();
    a.v2 = static_cast<const uint8_t*>(v2->data_ptr());
    a.v2s = v2s->data_ptr<float>();
  }
  a.h = reinterpret_cast<__nv_bfloat16*>(h.data_ptr());
  a.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  a.D = static_cast<int>(D);
  a.I = static_cast<int>(I);
  a.k = static_cast<int>(k);
  a.has_shared = has_shared ? 1 : 0;
  a.limit = static_cast<float>(limit);
  const bool fused = streams.has_value();
  TORCH_CHECK(fused == post.has_value() && fused == comb.has_value() && fused == out.has_value(),
              "moe_decode: streams, post, comb and out come together (the fused mHC post)");
  if (fused) {
    auto bf16c = [&](const at::Tensor& t) {
      return t.is_cuda() && t.device() == x.device() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() &&
             t.numel() == 4 * D;
    };
    auto f32c = [&](const at::Tensor& t, int64_t n) {
      return t.is_cuda() && t.device() == x.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
             t.numel() == n;
    };
    TORCH_CHECK(bf16c(*streams) && bf16c(*out), "moe_decode: streams and out must be contiguous bf16 [4, D] on x's device");
    TORCH_CHECK(f32c(*post, 4) && f32c(*comb, 16), "moe_decode: post [4] and comb [4, 4] must be contiguous fp32 on x's device");
    a.streams = reinterpret_cast<const __nv_bfloat16*>(streams->data_ptr());
    a.post = post->data_ptr<float>();
    a.comb = comb->data_ptr<float>();
    a.out = reinterpret_cast<__nv_bfloat16*>(out->data_ptr());
  }
  TORCH_CHECK(xq.has_value() == xqs.has_value(), "moe_decode: xq and xqs come together (x's codes and scales)");
  if (xq.has_value()) {  // x's act_quant, made by the kernel that wrote x: the up kernel copies it
    TORCH_CHECK(xq->is_cuda() && xq->device() == x.device() && xq->scalar_type() == at::kFloat8_e4m3fn &&
                    xq->is_contiguous() && xq->numel() == D && reinterpret_cast<uintptr_t>(xq->data_ptr()) % 16 == 0,
                "moe_decode: xq must be 16-byte aligned contiguous e4m3 [1, D] on x's device");
    TORCH_CHECK(xqs->is_cuda() && xqs->device() == x.device() && xqs->scalar_type() == at::kFloat &&
                    xqs->is_contiguous() && xqs->numel() == D / 128,
                "moe_decode: xqs must be contiguous fp32 [1, D / 128] on x's device");
    a.xq = static_cast<const uint8_t*>(xq->data_ptr());
    a.xqs = xqs->data_ptr<float>();
  }
  const bool pre = nfn.has_value();
  for (const c10::optional<at::Tensor>* t : std::initializer_list<const c10::optional<at::Tensor>*>{
           &nbase, &nscale, &nw, &ny, &npost, &ncomb, &part, &sq, &counter}) {
    TORCH_CHECK(t->has_value() == pre, "moe_decode: nfn, nbase, nscale, nw, ny, npost, ncomb, part, sq and counter come "
                "together (the next sublayer's fused mHC pre)");
  }
  if (pre) {
    TORCH_CHECK(fused, "moe_decode: the next sublayer's mHC pre needs the FFN's post (streams, post, comb, out)");
    const int64_t nblk = D / 16;
    auto on = [&](const at::Tensor& t, at::ScalarType st, int64_t n) {
      return t.is_cuda() && t.device() == x.device() && t.scalar_type() == st && t.is_contiguous() && t.numel() == n &&
             reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    };
    TORCH_CHECK(on(*nfn, at::kFloat, 24 * 4 * D) && on(*nbase, at::kFloat, 24) && on(*nscale, at::kFloat, 3),
                "moe_decode: nfn [24, 4 D], nbase [24], nscale [3] must be contiguous 16-byte aligned fp32 on x's device");
    TORCH_CHECK(on(*nw, at::kBFloat16, D) && on(*ny, at::kBFloat16, D),
                "moe_decode: nw and ny must be contiguous 16-byte aligned bf16 [D] on x's device");
    TORCH_CHECK(on(*npost, at::kFloat, 4) && on(*ncomb, at::kFloat, 16) && on(*part, at::kFloat, nblk * 24) &&
                    on(*sq, at::kFloat, nblk),
                "moe_decode: npost [4], ncomb [4, 4], part [24, D / 16] and sq [D / 16] must be contiguous 16-byte aligned "
                "fp32 on x's device");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(out->data_ptr()) % 16 == 0, "moe_decode: out must be 16-byte aligned");
    TORCH_CHECK(counter->is_cuda() && counter->device() == x.device() && counter->scalar_type() == at::kInt &&
                    counter->numel() >= 1, "moe_decode: counter must be int32 [>= 1] on x's device");
    TORCH_CHECK(iters >= 1, "moe_decode: iters must be >= 1");
    a.nfn = nfn->data_ptr<float>();
    a.nbase = nbase->data_ptr<float>();
    a.nscale = nscale->data_ptr<float>();
    a.nw = reinterpret_cast<const __nv_bfloat16*>(nw->data_ptr());
    a.ny = reinterpret_cast<__nv_bfloat16*>(ny->data_ptr());
    a.npost = npost->data_ptr<float>();
    a.ncomb = ncomb->data_ptr<float>();
    a.part = part->data_ptr<float>();
    a.sq = sq->data_ptr<float>();
    a.counter = counter->data_ptr<int>();
    a.iters = static_cast<int>(iters);
    a.hc_eps = static_cast<float>(hc_eps);
    a.norm_eps = static_cast<float>(norm_eps);
    a.eps = static_cast<float>(eps);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t e = dsv4::moe_decode_launch(a, pdl, c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "moe_decode launch failed: %s", cudaGetErrorString(e));
}


// x [M, K] bf16 / fp32 (unit column stride) -> q [M, K] e4m3, s [M, K / 128] fp32 (DeepSeek's act_quant)
void act_quant(const at::Tensor& x, at::Tensor& q, at::Tensor& s, bool pdl) {
  TORCH_CHECK(x.is_cuda() && q.is_cuda() && s.is_cuda(), "act_quant: tensors must be on CUDA");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "act_quant: x must be [M, K] with unit column stride");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "act_quant: x must be bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 128 == 0, "act_quant: K must be a multiple of 128");
  TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn && q.is_contiguous() && q.dim() == 2 && q.size(0) == M &&
                  q.size(1) == K, "act_quant: q must be contiguous e4m3 [M, K]");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == M &&
                  s.size(1) == K / 128, "act_quant: s must be contiguous fp32 [M, K / 128]");
  dsv4::ActQuantArgs a{};
  a.x = x.data_ptr();
  a.sx = x.stride(0);
  a.q = static_cast<uint8_t*>(q.data_ptr());
  a.s = s.data_ptr<float>();
  a.M = static_cast<int>(M);
  a.K = static_cast<int>(K);
  a.x_f32 = x.scalar_type() == at::kFloat;
  a.x_vec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && (x.stride(0) * x.element_size()) % 16 == 0;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t e = dsv4::act_quant_launch(a, pdl, c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "act_quant launch failed: %s", cudaGetErrorString(e));
}

// out [M, N] bf16 = (xq [M, K] e4m3 * xs [M, K / 128]) @ (w [N, K] e4m3 * ws [ceil(N / 128), K / 128])^T
// in output tiles of 128 rows x bn (128 or 64) columns; splits > 1 where the tiles' clusters do not fit the GPU at once
// (gemm_cluster_fit): part [>= tiles * splits * 128 * bn] fp32 workspace, counters [>= 2 tiles] int32, zero (left
// zero); elsewhere both may be None
void gemm_fp8(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& w, const at::Tensor& ws, at::Tensor& out,
              int64_t splits, int64_t bn, int64_t ctas, const c10::optional<at::Tensor>& part,
              const c10::optional<at::Tensor>& counters, bool pdl) {
  TORCH_CHECK(xq.is_cuda() && xs.is_cuda() && w.is_cuda() && ws.is_cuda() && out.is_cuda(),
              "gemm_fp8: tensors must be on CUDA");
  TORCH_CHECK(xq.scalar_type() == at::kFloat8_e4m3fn && w.scalar_type() == at::kFloat8_e4m3fn,
              "gemm_fp8: xq and w must be float8_e4m3fn");
  TORCH_CHECK(xq.dim() == 2 && w.dim() == 2 && out.dim() == 2 && xq.is_contiguous() && w.is_contiguous(),
              "gemm_fp8: xq [M, K] and w [N, K] contiguous, out [M, N]");
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "gemm_fp8: shape mismatch");
  TORCH_CHECK(K % 128 == 0 && N % 8 == 0 && M >= 1, "gemm_fp8: K % 128 == 0, N % 8 == 0, M >= 1");
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.is_contiguous() && xs.dim() == 2 && xs.size(0) == M &&
                  xs.size(1) == K / 128, "gemm_fp8: xs must be contiguous fp32 [M, K / 128]");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.dim() == 2 && ws.size(0) == (N + 127) / 128 &&
                  ws.size(1) == K / 128, "gemm_fp8: ws must be contiguous fp32 [ceil(N / 128), K / 128]");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.stride(1) == 1 && out.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "gemm_fp8: out must be bf16 with unit column stride, 16-byte aligned rows");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(xq.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "gemm_fp8: xq and w must be 16-byte aligned");
  TORCH_CHECK((splits == 1 || splits == 2 || splits == 4 || splits == 8) && (K / 128) >= splits,
              "gemm_fp8: splits must be 1, 2, 4 or 8 (each sums 128 / splits rows of a tile), at most K / 128");
  TORCH_CHECK(bn == 128 || bn == 64, "gemm_fp8: bn (output tile columns) must be 128 or 64");
  TORCH_CHECK(ctas >= 1, "gemm_fp8: ctas must be >= 1");
  const int64_t tiles = ((M + 127) / 128) * ((N + bn - 1) / bn);
  const c10::cuda::CUDAGuard guard(xq.device());
  // split-K through clusters where every tile's fits (no workspace), else through the workspace
  const bool workspace =
      splits > 1 && tiles > dsv4::gemm_cluster_fit(static_cast<int>(splits), static_cast<int>(bn));
  if (workspace) {
    DSV4_CHECK(part.has_value() && part->is_cuda() && part->scalar_type() == at::kFloat && part->is_contiguous() &&
                    part->numel() >= tiles * splits * 128 * bn,
                "gemm_fp8: split-K over %lld tiles needs a contiguous fp32 workspace of tiles * splits * 128 * bn "
                "(its clusters do not fit the GPU at once, or their occupancy query failed)", static_cast<long long>(tiles));
    TORCH_CHECK(counters.has_value() && counters->is_cuda() && counters->scalar_type() == at::kInt &&
                    counters->is_contiguous() && counters->numel() >= 2 * tiles,
                "gemm_fp8: split-K needs int32 counters, two per output tile");
  }
  dsv4::GemmFp8Args a{};
  a.xq = static_cast<const uint8_t*>(xq.data_ptr());
  a.xs = xs.data_ptr<float>();
  a.w = static_cast<const uint8_t*>(w.data_ptr());
  a.ws = ws.data_ptr<float>();
  a.bn = static_cast<int>(bn);
  a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  a.so = out.stride(0);
  a.M = static_cast<int>(M);
  a.N = static_cast<int>(N);
  a.K = static_cast<int>(K);
  a.S = static_cast<int>(splits);
  a.ctas = static_cast<int>(ctas);
  if (workspace) {
    a.part = part->data_ptr<float>();
    a.counters = counters->data_ptr<int>();
  }
  const cudaError_t e = dsv4::gemm_fp8_launch(a, pdl, c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "gemm_fp8 launch failed: %s", cudaGetErrorString(e));
}
}  // namespace

// clusters of `splits` GEMM CTAs (tiles `bn` wide) the current device holds at once: split-K runs through a cluster
// where every output tile's fits (0: never, and for splits = 1); an error when the occupancy query fails
int64_t gemm_cluster_fit(int64_t splits, int64_t bn) {
  TORCH_CHECK(splits == 1 || splits == 2 || splits == 4 || splits == 8, "gemm_cluster_fit: splits must be 1, 2, 4 or 8");
  TORCH_CHECK(bn == 128 || bn == 64, "gemm_cluster_fit: bn (output tile columns) must be 128 or 64");
  const int n = dsv4::gemm_cluster_fit(static_cast<int>(splits), static_cast<int>(bn));
  DSV4_CHECK(n >= 0, "gemm_cluster_fit: the cluster occupancy query failed for %d-CTA clusters", static_cast<int>(splits));
  return n;
}

// benchmarks: one plain read of buf (uint8, contiguous, 16-byte aligned, a multiple of 16 bytes); out [blocks, 4]
// int32 receives each CTA's xor of what it read
void stream_read(const at::Tensor& buf, at::Tensor& out, int64_t blocks, int64_t threads) {
  TORCH_CHECK(buf.is_cuda() && out.is_cuda(), "stream_read: tensors must be on CUDA");
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous() && buf.numel() % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(buf.data_ptr()) % 16 == 0,
              "stream_read: buf must be contiguous uint8, 16-byte aligned, a multiple of 16 bytes");
  TORCH_CHECK(threads >= 32 && threads <= 1024 && threads % 32 == 0, "stream_read: threads must be 32..1024, x32");
  TORCH_CHECK(blocks >= 1 && out.scalar_type() == at::kInt && out.is_contiguous() && out.numel() == blocks * 4 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && out.device() == buf.device(),
              "stream_read: out must be int32 [blocks, 4], 16-byte aligned, on buf's device");
  const c10::cuda::CUDAGuard guard(buf.device());
  const cudaError_t e = dsv4::stream_read_launch(buf.data_ptr(), buf.numel(), out.data_ptr(), static_cast<int>(blocks),
                                                 static_cast<int>(threads), c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "stream_read launch failed: %s", cudaGetErrorString(e));
}

// one mHC boundary (decode): the post of a sublayer when f is given, the next pre and its RMSNorm (mhc.cu)
void mhc_boundary(const c10::optional<at::Tensor>& f, const at::Tensor& x, const c10::optional<at::Tensor>& post,
                  const c10::optional<at::Tensor>& comb, const at::Tensor& fn, const at::Tensor& base,
                  const at::Tensor& scale, const at::Tensor& w, const c10::optional<at::Tensor>& out, at::Tensor& y,
                  at::Tensor& post_out, at::Tensor& comb_out, at::Tensor& part, at::Tensor& sq, at::Tensor& counter,
                  int64_t iters, double hc_eps, double norm_eps, double eps, bool pdl,
                  const c10::optional<at::Tensor>& yq, const c10::optional<at::Tensor>& yqs,
                  const c10::optional<at::Tensor>& keep, const c10::optional<at::Tensor>& keep_slot) {
  auto bf16c = [](const at::Tensor& t) { return t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(); };
  auto f32c = [](const at::Tensor& t) { return t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous(); };
  TORCH_CHECK(bf16c(x) && x.dim() == 3 && x.size(1) == 4, "mhc_boundary: x must be contiguous bf16 [T, 4, D]");
  const int64_t T = x.size(0), D = x.size(2);
  const int64_t max_t = dsv4::kMhcMaxT, cols = dsv4::kMhcCols, max_d = dsv4::kMhcMaxD;
  DSV4_CHECK(T >= 1 && T <= max_t && D % cols == 0 && D >= cols && D <= max_d,
             "mhc_boundary: 1 to %lld tokens, D a multiple of %lld up to %lld (got T = %lld, D = %lld)", LL(max_t),
             LL(cols), LL(max_d), LL(T), LL(D));
  const int64_t nch = D / dsv4::kMhcCols;
  TORCH_CHECK(f32c(fn) && fn.dim() == 2 && fn.size(0) == 24 && fn.size(1) == 4 * D, "mhc_boundary: fn must be fp32 [24, 4 D]");
  TORCH_CHECK(f32c(base) && base.numel() == 24 && f32c(scale) && scale.numel() == 3, "mhc_boundary: base [24], scale [3] fp32");
  TORCH_CHECK(bf16c(w) && w.numel() == D, "mhc_boundary: w must be bf16 [D]");
  TORCH_CHECK(bf16c(y) && y.numel() == T * D, "mhc_boundary: y must be bf16 [T, D]");
  TORCH_CHECK(f32c(post_out) && post_out.numel() == T * 4 && f32c(comb_out) && comb_out.numel() == T * 16,
              "mhc_boundary: post_out [T, 4], comb_out [T, 4, 4] fp32");
  TORCH_CHECK(f32c(part) && part.numel() == T * nch * 24 && f32c(sq) && sq.numel() == T * nch,
              "mhc_boundary: part [T, 24, D / 64], sq [T, D / 64] fp32");
  TORCH_CHECK(counter.is_cuda() && counter.scalar_type() == at::kInt && counter.is_contiguous() && counter.numel() >= T,
              "mhc_boundary: counter must be int32 [>= T]");
  const bool has_post = f.has_value();
  TORCH_CHECK(has_post == post.has_value() && has_post == comb.has_value() && has_post == out.has_value(),
              "mhc_boundary: f, post, comb and out come together");
  if (has_post) {
    TORCH_CHECK(bf16c(*f) && f->numel() == T * D && bf16c(*out) && out->numel() == T * 4 * D,
                "mhc_boundary: f [T, D] and out [T, 4, D] bf16");
    TORCH_CHECK(f32c(*post) && post->numel() == T * 4 && f32c(*comb) && comb->numel() == T * 16,
                "mhc_boundary: post [T, 4], comb [T, 4, 4] fp32");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &fn, &w, &y}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "mhc_boundary: x, fn, w and y must be 16-byte aligned");
  }
  if (has_post) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(out->data_ptr()) % 16 == 0, "mhc_boundary: out must be 16-byte aligned");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&fn, &base, &scale, &w, &y, &post_out, &comb_out,
                                                                       &part, &sq, &counter}) {
    TORCH_CHECK(t->device() == x.device(), "mhc_boundary: every tensor must be on x's device");
  }
  if (has_post) {
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&*f, &*post, &*comb, &*out}) {
      TORCH_CHECK(t->device() == x.device(), "mhc_boundary: every tensor must be on x's device");
    }
  }
  TORCH_CHECK(iters >= 1, "mhc_boundary: iters must be >= 1");
  dsv4::MhcArgs a{};
  a.f = has_post ? reinterpret_cast<const __nv_bfloat16*>(f->data_ptr()) : nullptr;
  a.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  a.post = has_post ? post->data_ptr<float>() : nullptr;
  a.comb = has_post ? comb->data_ptr<float>() : nullptr;
  a.fn = fn.data_ptr<float>();
  a.base = base.data_ptr<float>();
  a.scale = scale.data_ptr<float>();
  a.w = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
  a.out = has_post ? reinterpret_cast<__nv_bfloat16*>(out->data_ptr()) : nullptr;
  a.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  a.post_out = post_out.data_ptr<float>();
  a.comb_out = comb_out.data_ptr<float>();
  a.part = part.data_ptr<float>();
  a.sq = sq.data_ptr<float>();
  a.counter = counter.data_ptr<int>();
  a.T = static_cast<int>(T);
  a.D = static_cast<int>(D);
  a.iters = static_cast<int>(iters);
  a.hc_eps = static_cast<float>(hc_eps);
  a.norm_eps = static_cast<float>(norm_eps);
  a.eps = static_cast<float>(eps);
  TORCH_CHECK(yq.has_value() == yqs.has_value(), "mhc_boundary: yq and yqs come together (y's codes and scales)");
  if (yq.has_value()) {  // y's act_quant (1 x 128 blocks)
    TORCH_CHECK(D % 128 == 0, "mhc_boundary: y's quantization needs D a multiple of 128");
    TORCH_CHECK(yq->is_cuda() && yq->device() == x.device() && yq->scalar_type() == at::kFloat8_e4m3fn &&
                    yq->is_contiguous() && yq->numel() == T * D && reinterpret_cast<uintptr_t>(yq->data_ptr()) % 8 == 0,
                "mhc_boundary: yq must be 8-byte aligned contiguous e4m3 [T, D] on x's device");
    TORCH_CHECK(f32c(*yqs) && yqs->device() == x.device() && yqs->numel() == T * (D / 128),
                "mhc_boundary: yqs must be contiguous fp32 [T, D / 128] on x's device");
    a.yq = static_cast<uint8_t*>(yq->data_ptr());
    a.yqs = yqs->data_ptr<float>();
  }
  TORCH_CHECK(keep.has_value() == keep_slot.has_value(), "mhc_boundary: keep and keep_slot come together");
  if (keep.has_value()) {  // y's rows also into a ring [T, r, D] at slot *keep_slot
    TORCH_CHECK(keep->is_cuda() && keep->device() == x.device() && keep->scalar_type() == at::kBFloat16 &&
                    keep->dim() == 3 && keep->size(0) == T && keep->size(2) == D && keep->stride(2) == 1 &&
                    keep->stride(1) == D && keep->stride(0) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(keep->data_ptr()) % 16 == 0,
                "mhc_boundary: keep must be a 16-byte aligned bf16 [T, r, D] ring with contiguous rows on x's device");
    TORCH_CHECK(keep_slot->is_cuda() && keep_slot->device() == x.device() && keep_slot->scalar_type() == at::kLong &&
                    keep_slot->numel() == 1,
                "mhc_boundary: keep_slot must be int64 [1] on x's device");
    a.keep = reinterpret_cast<__nv_bfloat16*>(keep->data_ptr());
    a.keep_slot = keep_slot->data_ptr<int64_t>();
    a.keep_stride = keep->stride(0);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t e = dsv4::mhc_boundary_launch(a, pdl, c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "mhc_boundary launch failed: %s", cudaGetErrorString(e));
}

// the checks and kernel arguments shared by sparse_attn_decode and sparse_attn_prefill (`fn` names the caller in the
// messages; H must be a multiple of `heads`, the heads of one CTA)
dsv4::AttnArgs attn_args(const char* fn, int64_t heads, const at::Tensor& q, const at::Tensor& kv_win,
                         const at::Tensor& idx_win, const c10::optional<at::Tensor>& kv_comp,
                         const c10::optional<at::Tensor>& idx_comp, const at::Tensor& sink, at::Tensor& o, double scale,
                         const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
  const int64_t D = dsv4::kAttnD, HG = heads;
  DSV4_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 4, "%s: q must be CUDA bf16 [B, S, H, D]", fn);
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2);
  DSV4_CHECK(q.size(3) == D && H % HG == 0 && H >= HG && q.stride(3) == 1,
             "%s: q must be [B, S, H, %lld] with H a multiple of %lld and unit column stride (got H = %lld, D = %lld)",
             fn, LL(D), LL(HG), LL(H), LL(q.size(3)));
  DSV4_CHECK(B * S >= 1 && B * S <= 65535, "%s: 1 to 65535 queries (got %lld)", fn, LL(B * S));
  DSV4_CHECK(kv_comp.has_value() == idx_comp.has_value(), "%s: kv_comp and idx_comp come together", fn);
  // bf16 rows of 512, or packed FP8 rows (uint8, kAttnPackedBytes), both parts alike, 16-byte aligned
  const bool packed = kv_win.scalar_type() == at::kByte;
  const int64_t row_len = packed ? dsv4::kAttnPackedBytes : D;
  const int64_t esz = packed ? 1 : 2;
  auto rows_ok = [&](const at::Tensor& t) {
    return t.is_cuda() && t.device() == q.device() && t.scalar_type() == (packed ? at::kByte : at::kBFloat16) &&
           t.dim() == 3 && t.size(0) == B && t.size(2) == row_len && t.stride(2) == 1 && (t.stride(1) * esz) % 16 == 0 &&
           (t.stride(0) * esz) % 16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  auto list_ok = [&](const at::Tensor& t) {
    return t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kInt && t.dim() == 3 && t.size(0) == B &&
           t.size(1) == S;
  };
  DSV4_CHECK(rows_ok(kv_win), "%s: kv_win must be bf16 [B, N, 512] (or packed uint8 [B, N, 592]) on q's device with "
             "16-byte aligned rows", fn);
  DSV4_CHECK(list_ok(idx_win), "%s: idx_win must be int32 [B, S, Lw]", fn);
  const int64_t Lw = idx_win.size(2);
  int64_t Lc = 0;
  if (kv_comp.has_value()) {
    DSV4_CHECK(rows_ok(*kv_comp), "%s: kv_comp must be rows of kv_win's kind, [B, N, 512] bf16 or [B, N, 592] uint8, on "
               "q's device with 16-byte aligned rows", fn);
    DSV4_CHECK(list_ok(*idx_comp), "%s: idx_comp must be int32 [B, S, Lc]", fn);
    Lc = idx_comp->size(2);
  }
  DSV4_CHECK(Lw + Lc >= 1 && Lw + Lc <= dsv4::kAttnLongMaxSlots, "%s: lists of 1 to %d slots (got %lld)", fn,
             dsv4::kAttnLongMaxSlots, LL(Lw + Lc));
  DSV4_CHECK(sink.is_cuda() && sink.device() == q.device() && sink.scalar_type() == at::kFloat && sink.is_contiguous() &&
             sink.numel() == H, "%s: sink must be fp32 [H]", fn);
  DSV4_CHECK(o.is_cuda() && o.device() == q.device() && o.scalar_type() == at::kBFloat16 && o.dim() == 4 && o.size(0) == B &&
             o.size(1) == S && o.size(2) == H && o.size(3) == D && o.stride(3) == 1 && o.stride(2) % 4 == 0 &&
             o.stride(1) % 4 == 0 && o.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(o.data_ptr()) % 8 == 0,
             "%s: o must be bf16 [B, S, H, 512], 8-byte aligned rows", fn);
  DSV4_CHECK(q.stride(2) % 8 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 && q.stride(0) % 8 == 0 &&
             q.stride(1) % 8 == 0, "%s: q rows must be 16-byte aligned", fn);
  DSV4_CHECK(cos.has_value() == sin.has_value(), "%s: cos and sin come together", fn);
  int64_t rd2 = 0;
  if (cos.has_value()) {
    rd2 = cos->dim() == 2 ? cos->size(1) : 0;
    auto table_ok = [&](const at::Tensor& t) {
      return t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
             t.dim() == 2 && t.size(0) == S && t.size(1) == rd2;
    };
    DSV4_CHECK(table_ok(*cos) && table_ok(*sin) && rd2 >= 2 && rd2 % 2 == 0 && 2 * rd2 <= D,
               "%s: cos and sin must be contiguous fp32 [S = %lld, rd2] on q's device, rd2 even and 2 * rd2 <= %lld", fn,
               LL(S), LL(D));
  }
  dsv4::AttnArgs a{};
  if (rd2 > 0) {
    a.cos = cos->data_ptr<float>();
    a.sin = sin->data_ptr<float>();
    a.rd2 = static_cast<int>(rd2);
  }
  a.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  a.kw = reinterpret_cast<const unsigned char*>(kv_win.data_ptr());
  a.kc = kv_comp.has_value() ? reinterpret_cast<const unsigned char*>(kv_comp->data_ptr()) : a.kw;
  a.packed = packed ? 1 : 0;
  a.iw = idx_win.data_ptr<int>();
  a.ic = idx_comp.has_value() ? idx_comp->data_ptr<int>() : a.iw;
  a.sink = sink.data_ptr<float>();
  a.o = reinterpret_cast<__nv_bfloat16*>(o.data_ptr());
  a.sq_b = q.stride(0), a.sq_s = q.stride(1), a.sq_h = q.stride(2);
  a.skw_b = kv_win.stride(0) * esz, a.skw_n = kv_win.stride(1) * esz;
  const at::Tensor& kc = kv_comp.has_value() ? *kv_comp : kv_win;
  const at::Tensor& ic = idx_comp.has_value() ? *idx_comp : idx_win;
  a.skc_b = kc.stride(0) * esz, a.skc_n = kc.stride(1) * esz;
  a.siw_b = idx_win.stride(0), a.siw_s = idx_win.stride(1), a.siw_l = idx_win.stride(2);
  a.sic_b = ic.stride(0), a.sic_s = ic.stride(1), a.sic_l = ic.stride(2);
  a.so_b = o.stride(0), a.so_s = o.stride(1), a.so_h = o.stride(2);
  a.S = static_cast<int>(S);
  a.Lw = static_cast<int>(Lw);
  a.Lc = static_cast<int>(Lc);
  a.scale = static_cast<float>(scale);
  return a;
}

// sparse MQA attention with a sink, decode (attn.cu): o [B, S, H, 512] from q, the window rows + list and the
// compressed rows + list (both or neither)
void sparse_attn_decode(const at::Tensor& q, const at::Tensor& kv_win, const at::Tensor& idx_win,
                        const c10::optional<at::Tensor>& kv_comp, const c10::optional<at::Tensor>& idx_comp,
                        const at::Tensor& sink, at::Tensor& o, double scale, bool pdl,
                        const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                        int64_t max_cluster) {
  const int64_t D = dsv4::kAttnD, HG = dsv4::kAttnHeads;
  DSV4_CHECK(max_cluster == 8 || max_cluster == 16, "sparse_attn_decode: max_cluster must be 8 or 16 (got %lld)",
             LL(max_cluster));
  dsv4::AttnArgs a = attn_args("sparse_attn_decode", HG, q, kv_win, idx_win, kv_comp, idx_comp, sink, o, scale, cos, sin);
  a.wide = max_cluster == 16 ? 1 : 0;
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), L = a.Lw + a.Lc;
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor scratch;
  if (L > dsv4::kAttnMaxSlots) {  // the long lists' splits and their fp32 scratch (allocated on the stream)
    int sms = 0;
    DSV4_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device()) == cudaSuccess,
               "sparse_attn_decode: no SM count for device %d", static_cast<int>(q.get_device()));
    const dsv4::AttnLongPlan p = dsv4::sparse_attn_long_plan(static_cast<int>(L), static_cast<int>(B * S),
                                                             static_cast<int>(H / HG), sms);
    const int64_t qh = B * S * (H / HG);
    const int64_t nb = qh * p.nblk * HG, np = qh * p.nsplit * HG;
    scratch = at::empty({nb + 2 * np + np * D}, q.options().dtype(at::kFloat));
    float* f = scratch.data_ptr<float>();
    a.pacc = f;  // first: 16-byte aligned
    a.bmax = f + np * D;
    a.pm = a.bmax + nb;
    a.pz = a.pm + np;
    a.nblk = p.nblk;
    a.bps = p.bps;
    a.nsplit = p.nsplit;
  }
  const cudaError_t e = dsv4::sparse_attn_decode_launch(a, static_cast<int>(B * S), static_cast<int>(H / HG), pdl,
                                                        c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "sparse_attn_decode launch failed: %s", cudaGetErrorString(e));
}

// sparse MQA attention with a sink, prefill chunks (attn.cu): sparse_attn_decode's contract for any number of queries
// and H a multiple of 64, one CTA per (query, 64 heads)
void sparse_attn_prefill(const at::Tensor& q, const at::Tensor& kv_win, const at::Tensor& idx_win,
                         const c10::optional<at::Tensor>& kv_comp, const c10::optional<at::Tensor>& idx_comp,
                         const at::Tensor& sink, at::Tensor& o, double scale, bool pdl,
                         const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
  const int64_t HG = dsv4::kAttnPrefillHeads;
  const dsv4::AttnArgs a =
      attn_args("sparse_attn_prefill", HG, q, kv_win, idx_win, kv_comp, idx_comp, sink, o, scale, cos, sin);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaError_t e = dsv4::sparse_attn_prefill_launch(a, static_cast<int>(q.size(0) * q.size(1)),
                                                         static_cast<int>(q.size(2) / HG), pdl,
                                                         c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "sparse_attn_prefill launch failed: %s", cudaGetErrorString(e));
}

// top-k entry indices per query row (topk.cu): o [B, S, K] int32 from scores [B, S, N] and n_visible [S]; mode 0 picks
// the kernel, 1 the clusters, 2 the one-CTA kernel (16-bit scores, N <= 32768)
void topk_select(const at::Tensor& x, const at::Tensor& nvis, at::Tensor& o, bool pdl, int64_t mode) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.stride(2) == 1,
              "topk_select: scores must be CUDA [B, S, N] with a unit stride on N");
  const auto st = x.scalar_type();
  const int kind = st == at::kBFloat16 ? 0 : st == at::kHalf ? 1 : st == at::kFloat ? 2 : -1;
  TORCH_CHECK(kind >= 0, "topk_select: scores must be bf16, f16 or fp32");
  const int64_t B = x.size(0), S = x.size(1), N = x.size(2);
  DSV4_CHECK(B * S >= 1 && B * S <= dsv4::kTopkMaxRows, "topk_select: 1 to %d rows (got %lld)", dsv4::kTopkMaxRows,
             LL(B * S));
  DSV4_CHECK(N >= 1 && N <= dsv4::kTopkMaxN, "topk_select: rows of 1 to %d entries (got %lld)", dsv4::kTopkMaxN, LL(N));
  TORCH_CHECK(nvis.is_cuda() && nvis.device() == x.device() && nvis.dim() == 1 && nvis.size(0) == S &&
              nvis.is_contiguous() && (nvis.scalar_type() == at::kLong || nvis.scalar_type() == at::kInt),
              "topk_select: n_visible must be int64 or int32 [S] on the scores' device");
  TORCH_CHECK(o.is_cuda() && o.device() == x.device() && o.scalar_type() == at::kInt && o.dim() == 3 &&
              o.size(0) == B && o.size(1) == S && o.stride(2) == 1,
              "topk_select: o must be int32 [B, S, K] with a unit stride on K");
  const int64_t K = o.size(2);
  DSV4_CHECK(K >= 1 && K <= N && K <= dsv4::kTopkMaxK, "topk_select: k must be 1..min(N, %d) (got %lld, N = %lld)",
             dsv4::kTopkMaxK, LL(K), LL(N));
  dsv4::TopkArgs a{};
  a.x = x.data_ptr();
  a.nvis = nvis.data_ptr();
  a.o = o.data_ptr<int>();
  a.sx_b = x.stride(0), a.sx_s = x.stride(1), a.so_b = o.stride(0), a.so_s = o.stride(1);
  a.S = static_cast<int>(S);
  a.N = static_cast<int>(N);
  a.K = static_cast<int>(K);
  a.kind = kind;
  a.nvis_i64 = nvis.scalar_type() == at::kLong;
  DSV4_CHECK(mode >= 0 && mode <= 2, "topk_select: mode must be 0, 1 or 2 (got %lld)", LL(mode));
  DSV4_CHECK(dsv4::topk_select_path(a.N, kind, static_cast<int>(B * S), static_cast<int>(mode)) >= 0,
             "topk_select: the one-CTA kernel takes 16-bit scores of at most %d entries", dsv4::kTopkCtaMaxN);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t e = dsv4::topk_select_launch(a, static_cast<int>(B * S), static_cast<int>(mode), pdl,
                                                 c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "topk_select launch failed: %s", cudaGetErrorString(e));
}

// the decode MoE router (router.cu): weights [T, k] fp32 and experts [T, k] int64 from x [T, D] and the gate [E, D];
// bias for score layers, tid2eid + ids for hash layers
void router(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
            const c10::optional<at::Tensor>& tid2eid, const c10::optional<at::Tensor>& ids, at::Tensor& logits,
            at::Tensor& counter, at::Tensor& w_out, at::Tensor& i_out, int64_t func, bool norm, double route_scale,
            bool pdl) {
  auto bf16c = [](const at::Tensor& t) { return t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(); };
  TORCH_CHECK(bf16c(x) && x.dim() == 2 && bf16c(w) && w.dim() == 2 && x.size(1) == w.size(1),
              "router: x [T, D] and the gate [E, D] must be contiguous CUDA bf16");
  const int64_t T = x.size(0), D = x.size(1), E = w.size(0), K = w_out.numel() / (T > 0 ? T : 1);
  DSV4_CHECK(T >= 1 && T <= dsv4::kRouterMaxT, "router: 1 to %d tokens (got %lld)", dsv4::kRouterMaxT, LL(T));
  DSV4_CHECK(E % 32 == 0 && E >= 32 && E <= dsv4::kRouterMaxE, "router: E must be a multiple of 32 up to %d (got %lld)",
             dsv4::kRouterMaxE, LL(E));
  DSV4_CHECK(D % 8 == 0 && D >= 8 && D <= dsv4::kRouterMaxD, "router: D must be a multiple of 8 up to %d (got %lld)",
             dsv4::kRouterMaxD, LL(D));
  DSV4_CHECK(K >= 1 && K <= E && K <= dsv4::kRouterMaxK, "router: k must be 1..min(E, %d) (got %lld)",
             dsv4::kRouterMaxK, LL(K));
  TORCH_CHECK(w_out.is_cuda() && w_out.scalar_type() == at::kFloat && w_out.is_contiguous() && w_out.numel() == T * K &&
              i_out.is_cuda() && i_out.scalar_type() == at::kLong && i_out.is_contiguous() && i_out.numel() == T * K,
              "router: w_out fp32 and i_out int64, contiguous [T, k]");
  TORCH_CHECK(logits.is_cuda() && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
              logits.numel() == T * E, "router: logits must be contiguous fp32 [T, E]");
  TORCH_CHECK(counter.is_cuda() && counter.scalar_type() == at::kInt && counter.numel() >= 1,
              "router: counter must be int32 [>= 1]");
  TORCH_CHECK(func >= 0 && func <= 2, "router: func must be 0 (softmax), 1 (sigmoid) or 2 (sqrtsoftplus)");
  const bool hashed = tid2eid.has_value();
  TORCH_CHECK(hashed == ids.has_value() && hashed != bias.has_value(),
              "router: either bias (score layers) or tid2eid and ids (hash layers)");
  if (hashed) {
    TORCH_CHECK(tid2eid->is_cuda() && tid2eid->scalar_type() == at::kLong && tid2eid->dim() == 2 &&
                tid2eid->size(1) == K && tid2eid->stride(1) == 1, "router: tid2eid must be int64 [vocab, k], unit inner stride");
    TORCH_CHECK(ids->is_cuda() && ids->scalar_type() == at::kLong && ids->is_contiguous() && ids->numel() == T,
                "router: ids must be contiguous int64 [T]");
  } else {
    TORCH_CHECK(bias->is_cuda() && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == E &&
                reinterpret_cast<uintptr_t>(bias->data_ptr()) % 16 == 0, "router: bias must be contiguous 16-byte aligned fp32 [E]");
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "router: x and the gate must be 16-byte aligned");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&w, &logits, &counter, &w_out, &i_out}) {
    TORCH_CHECK(t->device() == x.device(), "router: every tensor must be on x's device");
  }
  TORCH_CHECK((hashed ? tid2eid->device() == x.device() && ids->device() == x.device() : bias->device() == x.device()),
              "router: every tensor must be on x's device");
  dsv4::RouterArgs a{};
  a.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  a.w = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
  a.bias = hashed ? nullptr : bias->data_ptr<float>();
  a.tid2eid = hashed ? tid2eid->data_ptr<int64_t>() : nullptr;
  a.ids = hashed ? ids->data_ptr<int64_t>() : nullptr;
  a.s_tid = hashed ? tid2eid->stride(0) : 0;
  a.logits = logits.data_ptr<float>();
  a.counter = counter.data_ptr<int>();
  a.w_out = w_out.data_ptr<float>();
  a.i_out = i_out.data_ptr<int64_t>();
  a.T = static_cast<int>(T);
  a.E = static_cast<int>(E);
  a.D = static_cast<int>(D);
  a.k = static_cast<int>(K);
  a.func = static_cast<int>(func);
  a.norm = norm ? 1 : 0;
  a.route_scale = static_cast<float>(route_scale);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t e = dsv4::router_launch(a, pdl, c10::cuda::getCurrentCUDAStream().stream());
  DSV4_CHECK(e == cudaSuccess, "router launch failed: %s", cudaGetErrorString(e));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_read", &stream_read, "bandwidth probe: one plain read of a buffer (probe.cu, benchmarks)");
  m.def("gemv", &gemv, "skinny GEMV (1-8 tokens) on fp8 block-scaled or bf16 weights (gemv.cu)");
  m.def("gemv_smem", &gemv_smem, "dynamic shared memory bytes of one gemv CTA");
  m.def("act_quant", &act_quant, "FP8 1x128 activation quantization, power-of-two scales (gemm.cu)");
  m.def("gemm_cluster_fit", &gemm_cluster_fit, "clusters of `splits` prefill-GEMM CTAs the device holds at once");
  m.def("gemm_fp8", &gemm_fp8, "prefill GEMM on fp8 block-scaled weights, TMA + wgmma (gemm.cu)");
  m.def("mhc_boundary", &mhc_boundary, "one mHC boundary (post, pre, RMSNorm) of 1-8 tokens (mhc.cu)");
  m.def("sparse_attn_decode_smem", &dsv4::sparse_attn_decode_smem,
        "dynamic shared memory of one sparse_attn_decode CTA for a list of this many slots (-1: unsupported)");
  m.def("sparse_attn_decode_cluster", &dsv4::sparse_attn_decode_cluster,
        "CTAs per cluster of sparse_attn_decode for (slots, queries, head groups, packed, max_cluster); 0: split path");
  m.def("sparse_attn_decode", &sparse_attn_decode, "sparse MQA attention with a sink, 1-8 queries (attn.cu)");
  m.def("sparse_attn_prefill", &sparse_attn_prefill,
        "sparse MQA attention with a sink, prefill chunks: one CTA per (query, 64 heads), wgmma (attn.cu)");
  m.def("sparse_attn_prefill_smem", &dsv4::sparse_attn_prefill_smem, "dynamic shared memory of one sparse_attn_prefill CTA");
  m.def("topk_select", &topk_select, "top-k entry indices per query row, ties to the lower entry (topk.cu)");
  m.def("topk_select_cluster", &dsv4::topk_select_cluster, "CTAs per row of topk_select for (N entries, rows)");
  m.def("topk_select_path", &dsv4::topk_select_path,
        "topk_select's kernel for (N entries, score kind 0 bf16 / 1 f16 / 2 fp32, rows, mode): 0 one CTA, 1 clusters");
  m.def("moe_decode", &moe_decode, "decode MoE experts of one token: MXFP4 routed + FP8 shared (moe.cu)");
  m.def("router", &router, "decode MoE router of 1-8 tokens: gate logits, scores, top-k or hash, weights (router.cu)");
}
