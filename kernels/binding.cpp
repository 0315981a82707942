// Torch binding of the fused quantize-and-extend kernel (kernels/quantize_extend.cu) and of the
// exact bf16 operand of FP4 codes (kernels/exact_operand.cu).
// Built just in time by resserve_export.kernel through torch.utils.cpp_extension.load.
// Outputs are passed in (the Python wrapper allocates them), so tests can poison them first.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" int resserve_quantize_extend(const void* x, int is_bf16, int64_t M, int K, const uint8_t* mask, int ksel,
                                        int fmt, int rounding, const float* alpha, uint8_t* codes, uint8_t* scales,
                                        int KE, uint8_t* rcodes, uint8_t* rscales, int rows, int max_ctas,
                                        void* stream);
extern "C" const char* resserve_error_string(int err);
extern "C" int resserve_exact_bf16(const uint8_t* codes, int64_t codes_stride, const uint8_t* scales,
                                   int64_t scales_stride, const float* factors, int64_t M, int64_t width, int block,
                                   void* out, void* stream);

namespace {

uint8_t* bytes_or_null(const at::Tensor& t) {
  return t.defined() && t.numel() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr;
}

void check_out(const at::Tensor& t, const at::Tensor& x, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.device() == x.device(), name, " must be on ", x.device());
  TORCH_CHECK(t.element_size() == 1 && t.is_contiguous(), name, " must be a contiguous one-byte tensor");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must have shape [", rows, ", ", cols,
              "], got ", t.sizes());
}

// fmt: 0 NVFP4, 1 MXFP4; rounding: 0 ceil, 1 floor, 2 even; ksel: 0, 1, 2, 4 (K-Ext) or 8 (full).
void quantize_extend_out(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& alpha, at::Tensor codes,
                         at::Tensor scales, at::Tensor rcodes, at::Tensor rscales, int64_t ksel, int64_t fmt,
                         int64_t rounding, int64_t KE, int64_t rows, int64_t max_ctas) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "x must be bfloat16 or float16, got ",
              x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t B = fmt == 0 ? 16 : 32;
  TORCH_CHECK(K % B == 0 && K < (int64_t{1} << 30), "K=", K, " must be a multiple of ", B);
  check_out(codes, x, M, (K + KE) / 2, "codes");
  check_out(scales, x, M, (K + KE) / B, "scales");
  if (ksel == 8) {
    check_out(rcodes, x, M, K / 2, "rcodes");
    check_out(rscales, x, M, K / B, "rscales");
  }
  if (ksel > 0 && ksel < 8) {
    TORCH_CHECK(mask.device() == x.device() && mask.scalar_type() == at::kByte && mask.is_contiguous() &&
                    mask.numel() == K / 8,
                "mask must be a contiguous uint8 [K/8] tensor on ", x.device());
  }
  if (fmt == 0) {
    TORCH_CHECK(alpha.device() == x.device() && alpha.scalar_type() == at::kFloat && alpha.numel() == 1,
                "alpha must be a float32 scalar tensor on ", x.device());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int err = resserve_quantize_extend(
      x.data_ptr(), x.scalar_type() == at::kBFloat16, M, static_cast<int>(K),
      ksel > 0 && ksel < 8 ? static_cast<const uint8_t*>(mask.data_ptr()) : nullptr, static_cast<int>(ksel),
      static_cast<int>(fmt), static_cast<int>(rounding), fmt == 0 ? alpha.data_ptr<float>() : nullptr,
      bytes_or_null(codes), bytes_or_null(scales), static_cast<int>(KE), ksel == 8 ? bytes_or_null(rcodes) : nullptr,
      ksel == 8 ? bytes_or_null(rscales) : nullptr, static_cast<int>(rows), static_cast<int>(max_ctas), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "resserve quantize_extend failed: ", resserve_error_string(err));
}

// codes [M, width/2] and scales [M, width/block] (uint8, unit column stride, any row stride),
// factors float32 [256] (each scale byte's value), out contiguous bf16 [M, width].
void exact_bf16_out(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& factors, at::Tensor out,
                    int64_t block) {
  TORCH_CHECK(codes.is_cuda() && codes.dim() == 2 && codes.element_size() == 1 && codes.stride(1) == 1,
              "codes must be a 2-D one-byte CUDA tensor with unit column stride");
  const int64_t M = codes.size(0), width = 2 * codes.size(1);
  TORCH_CHECK(block == 16 || block == 32, "block must be 16 or 32, got ", block);
  TORCH_CHECK(width % block == 0, "width ", width, " must be a multiple of the block ", block);
  TORCH_CHECK(scales.device() == codes.device() && scales.dim() == 2 && scales.element_size() == 1 &&
                  scales.size(0) == M && scales.size(1) == width / block && scales.stride(1) == 1,
              "scales must be a one-byte [", M, ", ", width / block, "] tensor with unit column stride on ", codes.device());
  TORCH_CHECK(factors.device() == codes.device() && factors.scalar_type() == at::kFloat && factors.is_contiguous() &&
                  factors.numel() == 256,
              "factors must be a contiguous float32 [256] tensor on ", codes.device());
  TORCH_CHECK(out.device() == codes.device() && out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == M && out.size(1) == width,
              "out must be a contiguous bfloat16 [", M, ", ", width, "] tensor on ", codes.device());
  const c10::cuda::CUDAGuard guard(codes.device());
  const int err = resserve_exact_bf16(static_cast<const uint8_t*>(codes.data_ptr()), M ? codes.stride(0) : width / 2,
                                      static_cast<const uint8_t*>(scales.data_ptr()), M ? scales.stride(0) : width / block,
                                      factors.data_ptr<float>(), M, width, static_cast<int>(block), out.data_ptr(),
                                      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "resserve exact_bf16 failed: ", resserve_error_string(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_extend_out", &quantize_extend_out, "Fused FP4 quantize-and-extend (outputs passed in)");
  m.def("exact_bf16_out", &exact_bf16_out, "bf16 operand of FP4 codes and block scales (output passed in)");
}
