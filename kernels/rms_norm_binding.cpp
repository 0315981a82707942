// Torch binding of the exact RMSNorm steps (kernels/rms_norm.cu): the launches of
// resserve_export/algorithms/scores/norm.py's `_ExactNorm` from C++ instead of Triton's Python
// launcher. An extension of its own, so that its build failing leaves the others usable. Built
// just in time by resserve_export.algorithms.kernel through torch.utils.cpp_extension.load.
// Outputs are passed in (the Python side allocates them in the layouts the eager chain has).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" int resserve_norm_square(const void* x, int dtype, float* p, int64_t rows, int64_t N, void* stream);
extern "C" int resserve_norm_output(const void* x, int dtype, const void* w, int w_fp32, const float* r, void* y,
                                    int64_t rows, int64_t N, int gemma, void* stream);
extern "C" int resserve_norm_backward(const void* dy, const void* w, int w_fp32, const void* x, int dtype,
                                      const float* r, const float* gp, void* out, int64_t rows, int64_t N,
                                      const int64_t* lead, int gemma, int grad, void* stream);

namespace {

int dtype_code(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "x must be bfloat16 or float16, got ",
              x.scalar_type());
  return x.scalar_type() == at::kBFloat16 ? 0 : 1;
}

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0, "x must be a contiguous CUDA tensor");
}

// The factor: x's dtype (Llama's form) or FP32 (Gemma's 1 + w), [N] contiguous on x's device.
int factor_fp32(const at::Tensor& w, const at::Tensor& x) {
  TORCH_CHECK(w.device() == x.device() && w.is_contiguous() && w.numel() == x.size(-1) &&
                  (w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat),
              "w must be a contiguous [", x.size(-1), "] tensor of x's dtype or float32 on ", x.device());
  return w.scalar_type() == at::kFloat;
}

int64_t rows_of(const at::Tensor& x) { return x.numel() / x.size(-1); }

void done(int err, const char* what) { TORCH_CHECK(err == 0, "resserve ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err))); }

// p (FP32, x's shape, contiguous) = x².
void norm_square(const at::Tensor& x, at::Tensor p) {
  check_rows(x);
  TORCH_CHECK(p.device() == x.device() && p.scalar_type() == at::kFloat && p.is_contiguous() && p.numel() == x.numel(),
              "p must be a contiguous float32 tensor of x's size");
  const c10::cuda::CUDAGuard guard(x.device());
  done(resserve_norm_square(x.data_ptr(), dtype_code(x), p.data_ptr<float>(), rows_of(x), x.size(-1),
                            c10::cuda::getCurrentCUDAStream().stream()),
       "norm_square");
}

// y (x's dtype and shape, contiguous) = w · narrow(x · r) or narrow(x · r · w) (gemma: w = 1 + w in FP32).
void norm_output(const at::Tensor& x, const at::Tensor& w, const at::Tensor& r, at::Tensor y, bool gemma) {
  check_rows(x);
  const int wf = factor_fp32(w, x);
  TORCH_CHECK(r.device() == x.device() && r.scalar_type() == at::kFloat && r.is_contiguous() && r.numel() == rows_of(x),
              "r must be a contiguous float32 tensor of one value per row");
  TORCH_CHECK(y.device() == x.device() && y.scalar_type() == x.scalar_type() && y.is_contiguous() && y.numel() == x.numel(),
              "y must be a contiguous tensor of x's dtype and size");
  const c10::cuda::CUDAGuard guard(x.device());
  done(resserve_norm_output(x.data_ptr(), dtype_code(x), w.data_ptr(), wf, r.data_ptr<float>(), y.data_ptr(), rows_of(x),
                            x.size(-1), gemma, c10::cuda::getCurrentCUDAStream().stream()),
       "norm_output");
}

// lead: (d1, d2, s0, s1, s2) of dy and (o0, o1, o2) of out, as norm.py's `_lead` gives them; out
// FP32 (grad false: the product gh · x) or x's dtype (grad: x's gradient), r and gp one FP32 value a
// row (gp only read with grad).
void norm_backward(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& x, const at::Tensor& r,
                   const at::Tensor& gp, at::Tensor out, bool gemma, bool grad, const std::vector<int64_t>& lead) {
  check_rows(x);
  const int wf = factor_fp32(w, x);
  TORCH_CHECK(lead.size() == 8, "lead must hold d1, d2, s0, s1, s2, o0, o1, o2");
  TORCH_CHECK(dy.device() == x.device() && dy.scalar_type() == x.scalar_type() && dy.numel() == x.numel() &&
                  (dy.size(-1) == 1 || dy.stride(-1) == 1),
              "dy must have x's dtype and size and a last dim of unit stride");
  TORCH_CHECK(out.device() == x.device() && out.numel() == x.numel() && (out.size(-1) == 1 || out.stride(-1) == 1) &&
                  out.scalar_type() == (grad ? x.scalar_type() : at::kFloat),
              "out must have x's size, a last dim of unit stride and ", grad ? "x's dtype" : "float32");
  TORCH_CHECK(r.device() == x.device() && r.scalar_type() == at::kFloat && r.is_contiguous() && r.numel() == rows_of(x),
              "r must be a contiguous float32 tensor of one value per row");
  if (grad) {
    TORCH_CHECK(gp.device() == x.device() && gp.scalar_type() == at::kFloat && gp.is_contiguous() &&
                    gp.numel() == rows_of(x),
                "gp must be a contiguous float32 tensor of one value per row");
  }
  TORCH_CHECK(lead[0] * lead[1] > 0 && rows_of(x) % (lead[0] * lead[1]) == 0, "lead's dims do not divide the rows");
  const c10::cuda::CUDAGuard guard(x.device());
  done(resserve_norm_backward(dy.data_ptr(), w.data_ptr(), wf, x.data_ptr(), dtype_code(x), r.data_ptr<float>(),
                              grad ? gp.data_ptr<float>() : nullptr, out.data_ptr(), rows_of(x), x.size(-1), lead.data(),
                              gemma, grad, c10::cuda::getCurrentCUDAStream().stream()),
       "norm_backward");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("norm_square", &norm_square, "x² in FP32 (the exact RMSNorm's first step)");
  m.def("norm_output", &norm_output, "The exact RMSNorm's output from x and each row's 1/rms");
  m.def("norm_backward", &norm_backward, "The exact RMSNorm's backward product or input gradient");
}
