// Torch binding of the grad scores' group reduction (kernels/group_sums.cu): a whole decision
// group's split-layout sums in one C++ call, where the Python path makes two to three GEMM calls
// and a Triton launch with its bookkeeping per member (bench/results/plan.md: the scoring is
// bound by its host launches). A separate extension from binding.cpp, so that a build failure
// here leaves the quantize-and-extend kernel usable. Built just in time by
// resserve_export.algorithms.kernel through torch.utils.cpp_extension.load.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" int64_t resserve_sq_partials_blocks(int64_t n);
extern "C" int resserve_sq_partials(const void* g, int g_dtype, int64_t ld_g, const float* p, int64_t ld_p,
                                    const float* y, int64_t ld_y, const float* c, const void* const* es,
                                    const int64_t* ld_e, int ne, int64_t rows, int64_t cols, float* part,
                                    void* stream);
extern "C" int resserve_sum_partials(const float* part, int64_t nparts, int width, double* out, void* stream);

namespace {

constexpr int64_t kMaxE = 4;

int grad_code(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return 0;
    case at::kHalf: return 1;
    case at::kFloat: return 2;
    default: return -1;
  }
}

// t as [rows, cols] with unit column stride: a view where it has one, else a copy.
at::Tensor as_rows(const at::Tensor& t, int64_t rows, int64_t cols) {
  at::Tensor v = t.dim() == 2 ? t : t.reshape({rows, cols});
  TORCH_CHECK(v.size(0) == rows && v.size(1) == cols, "expected a [", rows, ", ", cols, "] tensor, got ", v.sizes());
  if (cols > 1 && v.stride(1) != 1) v = v.contiguous();
  if (rows > 1 && v.stride(0) < cols) v = v.contiguous();
  return v;
}

int64_t row_stride(const at::Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(1); }

// `Candidates.group_sums_fast` in the split layout with the group's products stacked, in one
// call: E_ρ = R̂'_ρ Ŵ'_ρᵀ (bf16 outputs), P = X̂'Ŵ'ᵀ (FP32 output) over the stacked members,
// and per member k Y_k = X W_kᵀ (FP32 output) and its sums over columns [rows[k], rows[k+1]) of
// P and every E_ρ. The GEMMs are the ATen calls the Python path makes (the same bits); the sums
// are kernels/group_sums.cu's. Returns float64 [1 + len(extras)]: the plain ratio's sum, then
// each compensated ratio's, over all members.
//
// xhat [M, K] bf16 (X̂'), x [M, K] bf16/fp16 (the members' input), extras[j] [M, w_j] bf16,
// b0 [N, K] bf16 (Ŵ' stacked), wres[j] [N, w_j] bf16, weights[k] [N_k, K] of x's dtype,
// grads[k] with M * N_k elements (bf16, fp16 or FP32), rows the members' offsets (0, …, N),
// c the FP32 scalar α_x·α_w on the device.
at::Tensor group_sums_split(const at::Tensor& xhat, const at::Tensor& x, const std::vector<at::Tensor>& extras,
                            const at::Tensor& b0, const std::vector<at::Tensor>& wres,
                            const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& grads,
                            const std::vector<int64_t>& rows, const at::Tensor& c) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "x must be a 2-D CUDA tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t ne = static_cast<int64_t>(extras.size()), members = static_cast<int64_t>(weights.size());
  TORCH_CHECK(ne <= kMaxE && static_cast<int64_t>(wres.size()) == ne, "one residue weight per residue operand, at most ",
              kMaxE);
  TORCH_CHECK(members > 0 && static_cast<int64_t>(grads.size()) == members &&
                  static_cast<int64_t>(rows.size()) == members + 1 && rows[0] == 0,
              "one gradient and one weight per member, and the members' row offsets from 0");
  TORCH_CHECK(xhat.device() == x.device() && xhat.dim() == 2 && xhat.size(0) == M && xhat.size(1) == K,
              "xhat must be [", M, ", ", K, "] on ", x.device());
  TORCH_CHECK(b0.device() == x.device() && b0.dim() == 2 && b0.size(0) == rows.back() && b0.size(1) == K,
              "b0 must be [", rows.back(), ", ", K, "] on ", x.device());
  TORCH_CHECK(c.device() == x.device() && c.scalar_type() == at::kFloat && c.numel() == 1,
              "c must be an FP32 scalar on ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> es;
  for (int64_t j = 0; j < ne; ++j) {
    TORCH_CHECK(extras[j].scalar_type() == at::kBFloat16 && wres[j].scalar_type() == at::kBFloat16,
                "residue operands and weights must be bfloat16");
    at::Tensor e = at::mm(extras[j], wres[j].t());
    TORCH_CHECK(e.size(0) == M && e.size(1) == rows.back(), "residue product ", j, " is ", e.sizes());
    es.push_back(e);
  }
  const at::Tensor prod = at::mm(xhat, b0.t(), at::kFloat);
  int64_t nparts = 0;
  std::vector<int64_t> first;
  for (int64_t k = 0; k < members; ++k) {
    first.push_back(nparts);
    nparts += resserve_sq_partials_blocks(M * (rows[k + 1] - rows[k]));
  }
  at::Tensor part = at::empty({std::max<int64_t>(nparts, 1), ne + 1}, x.options().dtype(at::kFloat));
  at::Tensor out = at::zeros({ne + 1}, x.options().dtype(at::kDouble));
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  for (int64_t k = 0; k < members; ++k) {
    const int64_t a = rows[k], n = rows[k + 1] - a;
    TORCH_CHECK(n > 0 && weights[k].dim() == 2 && weights[k].size(0) == n && weights[k].size(1) == K &&
                    weights[k].scalar_type() == x.scalar_type(),
                "member ", k, "'s weight must be [", n, ", ", K, "] of x's dtype");
    TORCH_CHECK(grads[k].device() == x.device() && grads[k].numel() == M * n, "member ", k, "'s gradient must have ",
                M * n, " elements on ", x.device());
    const int code = grad_code(grads[k].scalar_type());
    TORCH_CHECK(code >= 0, "gradients must be bfloat16, float16 or float32, got ", grads[k].scalar_type());
    const at::Tensor y = at::mm(x, weights[k].t(), at::kFloat);
    const at::Tensor g = as_rows(grads[k], M, n);
    const at::Tensor p = prod.narrow(1, a, n);
    const void* eptr[kMaxE] = {nullptr, nullptr, nullptr, nullptr};
    int64_t eld[kMaxE] = {0, 0, 0, 0};
    for (int64_t j = 0; j < ne; ++j) {
      eptr[j] = es[j].narrow(1, a, n).data_ptr();
      eld[j] = es[j].stride(0);
    }
    const int err = resserve_sq_partials(g.data_ptr(), code, row_stride(g), p.data_ptr<float>(), prod.stride(0),
                                         y.data_ptr<float>(), row_stride(y), c.data_ptr<float>(), eptr, eld,
                                         static_cast<int>(ne), M, n, part.data_ptr<float>() + first[k] * (ne + 1),
                                         stream);
    TORCH_CHECK(err == 0, "resserve sq_partials failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
  }
  const int err = resserve_sum_partials(part.data_ptr<float>(), nparts, static_cast<int>(ne + 1),
                                        out.data_ptr<double>(), stream);
  TORCH_CHECK(err == 0, "resserve sum_partials failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("group_sums_split", &group_sums_split,
        "The grad scores' split-layout sums of one group (its GEMMs and reductions) in one call");
}
