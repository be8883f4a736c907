// The one Python binding of dsv4's CUDA kernels (built by dsv4/kernels/cuda/__init__.py). Each function checks
// what the kernel needs (the Python wrappers in dsv4/ops/ validate shapes and pick configs) and launches on the
// current stream; nothing here synchronizes the host.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "gemv.h"

namespace {

void gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, at::Tensor& out,
          int64_t splits, int64_t wr, int64_t nstep, int64_t nchunk, bool pdl) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && out.is_cuda(), "gemv: tensors must be on CUDA");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "gemv: x [M, K], w [N, K], out [M, N]");
  const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || w.scalar_type() == at::kBFloat16, "gemv: w must be float8_e4m3fn or bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "gemv: x must be bf16 or fp32");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, "gemv: out must be bf16 or fp32");
  TORCH_CHECK(w.is_contiguous() && x.stride(1) == 1 && out.stride(1) == 1, "gemv: unit column strides, w contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "gemv: shape mismatch");
  TORCH_CHECK(M >= 1 && M <= 8, "gemv: 1 to 8 tokens");
  TORCH_CHECK(wr == 1 || wr == 2 || wr == 4 || wr == 8, "gemv: wr must be 1, 2, 4 or 8");
  TORCH_CHECK(splits >= 1 && splits <= 8, "gemv: splits must be 1..8");
  TORCH_CHECK(K % (fp8 ? 128 : 8) == 0, "gemv: K must be a multiple of ", fp8 ? 128 : 8);
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
  a.x_vec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && (x.stride(0) * x.element_size()) % 16 == 0;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t e = dsv4::gemv_launch(a, fp8, static_cast<int>(nstep), pdl, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(e == cudaSuccess, "gemv launch failed: ", cudaGetErrorString(e));
}

int64_t gemv_smem(bool fp8, bool x_split, int64_t M, int64_t ks, int64_t wr, int64_t nstep, int64_t nchunk) {
  return dsv4::gemv_smem_bytes(fp8, x_split, static_cast<int>(M), static_cast<int>(ks), static_cast<int>(wr),
                               static_cast<int>(nstep), static_cast<int>(nchunk));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "skinny GEMV (1-8 tokens) on fp8 block-scaled or bf16 weights (gemv.cu)");
  m.def("gemv_smem", &gemv_smem, "dynamic shared memory bytes of one gemv CTA");
}
