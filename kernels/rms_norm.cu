// The elementwise steps of an RMSNorm with the eager chain's bits (the grad scores' exact norms,
// resserve_export/algorithms/scores/norm.py): the same three steps as that module's Triton
// kernels, launched from C++ (a Triton launch costs the host ≈ 65 µs in the scores' profile, a
// C++ launch about a fifth of it; bench/results/plan.md). Each value is rounded where the eager
// ops round: FP32 products and sums rounded to nearest (no FMA: built with -fmad=false), then
// narrowed to bf16 or fp16 where the eager chain narrows. The row reductions between the steps
// stay PyTorch's own ops (the caller's).
//
// x, dy and the outputs of the same dtype (bf16 or fp16); w the norm's factor: x's dtype in
// Llama's form (w · narrow(x · r)), FP32 1 + w in Gemma's (narrow(x · r · (1 + w))); r and gp one
// FP32 value per row. One block per row, its threads striding over the row's N columns.
//
// Build check (no torch headers here; the torch binding is rms_norm_binding.cpp):
//   nvcc -std=c++17 -O3 -arch=sm_90 -c kernels/rms_norm.cu

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace resserve {

constexpr int kNormThreads = 256;

__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(float v) { return v; }

template <typename T>
__device__ __forceinline__ T narrow_to(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 narrow_to<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half narrow_to<__half>(float v) { return __float2half_rn(v); }

// v rounded to T and back: the eager chain's narrowing of an FP32 intermediate.
template <typename T>
__device__ __forceinline__ float narrowed(float v) { return widen(narrow_to<T>(v)); }

// p = x² in FP32 (the forward's first step; its row mean is the caller's).
template <typename T>
__global__ void __launch_bounds__(kNormThreads) norm_square_kernel(const T* __restrict__ x, float* __restrict__ p, int64_t N) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * N;
  for (int64_t c = threadIdx.x; c < N; c += kNormThreads) {
    const float v = widen(x[base + c]);
    p[base + c] = __fmul_rn(v, v);
  }
}

// y = w · narrow(x · r) (Llama) or narrow(x · r · (1 + w)) (Gemma), stored in x's dtype.
template <typename T, typename W, bool GEMMA>
__global__ void __launch_bounds__(kNormThreads)
    norm_output_kernel(const T* __restrict__ x, const W* __restrict__ w, const float* __restrict__ r, T* __restrict__ y,
                       int64_t N) {
  const int64_t row = blockIdx.x, base = row * N;
  const float rr = r[row];
  for (int64_t c = threadIdx.x; c < N; c += kNormThreads) {
    float h = __fmul_rn(widen(x[base + c]), rr);
    if (!GEMMA) h = narrowed<T>(h);
    y[base + c] = narrow_to<T>(__fmul_rn(widen(w[c]), h));
  }
}

// Row `row` of x (contiguous) is row (i0, i1, i2) of dy and out, at their strides (the leading
// dims of a tensor of at most 4 dims, padded in front). gh = dy · w (narrowed in Llama's form);
// GRAD: out = narrow(gh · r + gp · (2x)), x's gradient; else out = gh · x in FP32, the product
// whose row sum is 1/rms's gradient.
template <typename T, typename W, bool GEMMA, bool GRAD>
__global__ void __launch_bounds__(kNormThreads)
    norm_backward_kernel(const T* __restrict__ dy, const W* __restrict__ w, const T* __restrict__ x,
                         const float* __restrict__ r, const float* __restrict__ gp, void* __restrict__ out, int64_t N,
                         int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2, int64_t o0, int64_t o1,
                         int64_t o2) {
  const int64_t row = blockIdx.x;
  const int64_t i2 = row % d2, i1 = (row / d2) % d1, i0 = row / (d1 * d2);
  const int64_t xb = row * N, db = i0 * s0 + i1 * s1 + i2 * s2, ob = i0 * o0 + i1 * o1 + i2 * o2;
  const float rr = GRAD ? r[row] : 0.0f, g = GRAD ? gp[row] : 0.0f;
  for (int64_t c = threadIdx.x; c < N; c += kNormThreads) {
    const float xv = widen(x[xb + c]);
    float gh = __fmul_rn(widen(dy[db + c]), widen(w[c]));
    if (!GEMMA) gh = narrowed<T>(gh);
    if (GRAD) {
      const float dx = __fadd_rn(__fmul_rn(gh, rr), __fmul_rn(g, __fmul_rn(2.0f, xv)));
      static_cast<T*>(out)[ob + c] = narrow_to<T>(dx);
    } else {
      static_cast<float*>(out)[ob + c] = __fmul_rn(gh, xv);
    }
  }
}

template <typename T>
int square(const void* x, float* p, int64_t rows, int64_t N, cudaStream_t s) {
  norm_square_kernel<T><<<static_cast<unsigned>(rows), kNormThreads, 0, s>>>(static_cast<const T*>(x), p, N);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, typename W>
int output(const void* x, const void* w, const float* r, void* y, int64_t rows, int64_t N, bool gemma, cudaStream_t s) {
  const auto xt = static_cast<const T*>(x);
  const auto wt = static_cast<const W*>(w);
  if (gemma)
    norm_output_kernel<T, W, true><<<static_cast<unsigned>(rows), kNormThreads, 0, s>>>(xt, wt, r, static_cast<T*>(y), N);
  else
    norm_output_kernel<T, W, false><<<static_cast<unsigned>(rows), kNormThreads, 0, s>>>(xt, wt, r, static_cast<T*>(y), N);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, typename W>
int backward(const void* dy, const void* w, const void* x, const float* r, const float* gp, void* out, int64_t rows,
             int64_t N, const int64_t* lead, bool gemma, bool grad, cudaStream_t s) {
  const auto dyt = static_cast<const T*>(dy);
  const auto wt = static_cast<const W*>(w);
  const auto xt = static_cast<const T*>(x);
  const unsigned grid = static_cast<unsigned>(rows);
#define RESSERVE_NORM_BWD(G, D)                                                                              \
  norm_backward_kernel<T, W, G, D><<<grid, kNormThreads, 0, s>>>(dyt, wt, xt, r, gp, out, N, lead[0], lead[1], \
                                                                 lead[2], lead[3], lead[4], lead[5], lead[6], lead[7])
  if (gemma && grad) RESSERVE_NORM_BWD(true, true);
  else if (gemma) RESSERVE_NORM_BWD(true, false);
  else if (grad) RESSERVE_NORM_BWD(false, true);
  else RESSERVE_NORM_BWD(false, false);
#undef RESSERVE_NORM_BWD
  return static_cast<int>(cudaGetLastError());
}

}  // namespace resserve

// dtype: 0 bf16, 1 fp16 (x, dy and the narrow outputs); w_fp32: the factor is FP32 (Gemma's
// 1 + w), else x's dtype. Every call returns a cudaError_t (0 on success).

extern "C" int resserve_norm_square(const void* x, int dtype, float* p, int64_t rows, int64_t N, void* stream) {
  using namespace resserve;
  if (rows < 0 || rows > INT32_MAX || N <= 0 || (rows && (!x || !p))) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return square<__nv_bfloat16>(x, p, rows, N, s);
    case 1: return square<__half>(x, p, rows, N, s);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" int resserve_norm_output(const void* x, int dtype, const void* w, int w_fp32, const float* r, void* y,
                                    int64_t rows, int64_t N, int gemma, void* stream) {
  using namespace resserve;
  if (rows < 0 || rows > INT32_MAX || N <= 0 || (rows && (!x || !w || !r || !y))) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == 0 && w_fp32) return output<__nv_bfloat16, float>(x, w, r, y, rows, N, gemma, s);
  if (dtype == 0) return output<__nv_bfloat16, __nv_bfloat16>(x, w, r, y, rows, N, gemma, s);
  if (dtype == 1 && w_fp32) return output<__half, float>(x, w, r, y, rows, N, gemma, s);
  if (dtype == 1) return output<__half, __half>(x, w, r, y, rows, N, gemma, s);
  return cudaErrorInvalidValue;
}

// lead: d1, d2, s0, s1, s2 (dy's leading dims and strides) then o0, o1, o2 (out's strides).
extern "C" int resserve_norm_backward(const void* dy, const void* w, int w_fp32, const void* x, int dtype,
                                      const float* r, const float* gp, void* out, int64_t rows, int64_t N,
                                      const int64_t* lead, int gemma, int grad, void* stream) {
  using namespace resserve;
  if (rows < 0 || rows > INT32_MAX || N <= 0 || !lead || lead[0] <= 0 || lead[1] <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!dy || !w || !x || !out || (grad && (!r || !gp))) return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == 0 && w_fp32) return backward<__nv_bfloat16, float>(dy, w, x, r, gp, out, rows, N, lead, gemma, grad, s);
  if (dtype == 0) return backward<__nv_bfloat16, __nv_bfloat16>(dy, w, x, r, gp, out, rows, N, lead, gemma, grad, s);
  if (dtype == 1 && w_fp32) return backward<__half, float>(dy, w, x, r, gp, out, rows, N, lead, gemma, grad, s);
  if (dtype == 1) return backward<__half, __half>(dy, w, x, r, gp, out, rows, N, lead, gemma, grad, s);
  return cudaErrorInvalidValue;
}
