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

// The grad scores' bf16 operands of one activation x [M, K] in one call (what
// `Candidates._prepare_with_kernel` composes from `quantize_extend`, `quantize_full` and
// `exact_bf16`, with the same launches, so the same bits): for each compensated ratio in order,
// ksel 1/2/4 (K-Ext of width widths[i], masks[i] its uint8 [K/8] selection) or 8 (full), one
// quantize-and-extend launch and one operand launch. Returns [X̂', R̂'_1, …]: X̂' from the first
// ratio's launch (a column view of the same bf16 tensor as R̂'_1 when that ratio is K-Ext).
// alpha: the NVFP4 input scale (float32 scalar on x's device; ignored for MXFP4); factors: the
// format's 256 scale-byte values (float32, `scores.fused.scale_factors`).
std::vector<at::Tensor> prepare_operands(const at::Tensor& x, const std::vector<at::Tensor>& masks,
                                         const std::vector<int64_t>& ksels, const std::vector<int64_t>& widths,
                                         const at::Tensor& alpha, const at::Tensor& factors, int64_t fmt,
                                         int64_t rounding, int64_t rows, int64_t max_ctas) {
  TORCH_CHECK(!ksels.empty() && ksels.size() == widths.size() && ksels.size() == masks.size(),
              "one mask, ksel and width per compensated ratio, at least one");
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "x must be a 2-D CUDA tensor");
  const int64_t M = x.size(0), K = x.size(1), B = fmt == 0 ? 16 : 32;
  // The kernel reads x in 16-byte vectors: contiguous and aligned, as `kernel._prepare` makes it.
  const at::Tensor xc = !x.is_contiguous() ? x.contiguous()
                        : reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 ? x.clone()
                                                                          : x;
  const auto u8 = x.options().dtype(at::kByte);
  const at::Tensor none = at::empty({0}, u8), none2 = at::empty({0, 0}, u8);
  std::vector<at::Tensor> out{at::Tensor()};
  for (size_t i = 0; i < ksels.size(); ++i) {
    const int64_t ksel = ksels[i], KE = ksel == 8 ? 0 : widths[i];
    TORCH_CHECK(ksel == 1 || ksel == 2 || ksel == 4 || ksel == 8, "ksel must be 1, 2, 4 or 8, got ", ksel);
    at::Tensor codes = at::empty({M, (K + KE) / 2}, u8), scales = at::empty({M, (K + KE) / B}, u8);
    at::Tensor rcodes = ksel == 8 ? at::empty({M, K / 2}, u8) : none2;
    at::Tensor rscales = ksel == 8 ? at::empty({M, K / B}, u8) : none2;
    quantize_extend_out(xc, ksel == 8 ? none : masks[i], alpha, codes, scales, rcodes, rscales, ksel, fmt, rounding, KE,
                        rows, max_ctas);
    auto operand = [&](const at::Tensor& c, const at::Tensor& sc) {
      at::Tensor o = at::empty({M, 2 * c.size(1)}, x.options().dtype(at::kBFloat16));
      exact_bf16_out(c, sc, factors, o, B);
      return o;
    };
    if (ksel == 8) {
      if (!out[0].defined()) out[0] = operand(codes, scales);
      out.push_back(operand(rcodes, rscales));
    } else if (!out[0].defined()) {  // [X̂' | R̂'] in one operand launch; both are column views of it
      const at::Tensor both = operand(codes, scales);
      out[0] = both.narrow(1, 0, K);
      out.push_back(both.narrow(1, K, KE));
    } else {
      out.push_back(operand(codes.narrow(1, K / 2, KE / 2), scales.narrow(1, K / B, KE / B)));
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_extend_out", &quantize_extend_out, "Fused FP4 quantize-and-extend (outputs passed in)");
  m.def("exact_bf16_out", &exact_bf16_out, "bf16 operand of FP4 codes and block scales (output passed in)");
  m.def("prepare_operands", &prepare_operands, "The grad scores' bf16 operands of one activation, every ratio in one call");
}
