// The squared-sum reduction of the grad scores' split layout (docs/formats.md: the grad scores'
// bf16 path), as CUDA kernels that a C++ call launches for a whole decision group: for each
// member k, with g its output gradient, p its columns of the FP32 product X̂'Ŵ'ᵀ, y its FP32
// output X Wᵀ, c = α_x·α_w and e_ρ its columns of each residue product,
//
//   [Σ (g(c·p − y))², Σ (g(c·p − y + c·e_1))², …]
//
// summed over the group's members into one float64 vector. The arithmetic per element is the
// Triton reduction's (scores/fused.py: FP32, no FMA when built with -fmad=false); the partial
// sums run in another order, so the scores agree with it to rounding (the GPU tests bound it).
// The order is fixed by the launch shape alone, so two runs give the same bits.
//
// Two launches per group and member count: `resserve_sq_partials` writes one FP32 partial sum
// per block and output for one member (blocks of kSumThreads x kSumIters elements of the member's
// row-major [rows, cols] view); `resserve_sum_partials` adds every partial of the group in
// float64, one block per output, and adds the result into out.
//
// Build check (no torch headers here; the torch binding is group_sums_binding.cpp):
//   nvcc -std=c++17 -O3 -arch=sm_90 -c kernels/group_sums.cu

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace resserve {

constexpr int kSumThreads = 256;
constexpr int kSumIters = 64;  // 16384 elements per block: ~500 blocks for a [4096, 2048] member
constexpr int kSumWarps = kSumThreads / 32;
constexpr int kMaxE = 4;

struct Residues {
  const __nv_bfloat16* e[kMaxE];
  int64_t ld[kMaxE];
};

// V consecutive elements of a row as floats: V = 1 any layout, V = 4 vector loads (the caller
// checks the alignment: 16 bytes for FP32, 8 bytes for 16-bit types).
template <int V>
__device__ __forceinline__ void load(const float* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else {
    v[0] = *p;
  }
}
template <int V>
__device__ __forceinline__ void load(const __nv_bfloat16* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  } else {
    v[0] = __bfloat162float(*p);
  }
}
template <int V>
__device__ __forceinline__ void load(const __half* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&t.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&t.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  } else {
    v[0] = __half2float(*p);
  }
}

// Each thread takes V consecutive elements of a row per step (cols a multiple of V), kSumIters / V
// steps, so a block covers kSumThreads * kSumIters elements whatever V is.
template <typename G, int NE, int V>
__global__ void __launch_bounds__(kSumThreads)
    sq_partials_kernel(const G* __restrict__ g, int64_t ld_g, const float* __restrict__ p, int64_t ld_p,
                       const float* __restrict__ y, int64_t ld_y, const float* __restrict__ cp, Residues es,
                       int64_t n, int64_t cols, float* __restrict__ part) {
  const float c = *cp;
  float acc[NE + 1];
#pragma unroll
  for (int j = 0; j <= NE; ++j) acc[j] = 0.0f;
  // Element idx of the row-major view, from one division per thread: each step moves
  // kSumThreads * V elements on.
  constexpr int kStep = kSumThreads * V;
  int64_t idx = static_cast<int64_t>(blockIdx.x) * (kSumThreads * kSumIters) + static_cast<int64_t>(threadIdx.x) * V;
  int64_t row = idx / cols, col = idx - row * cols;
  for (int it = 0; it < kSumIters / V && idx < n; ++it, idx += kStep) {
    if (it) {
      col += kStep;
      while (col >= cols) {
        col -= cols;
        ++row;
      }
    }
    float gv[V], pv[V], yv[V];
    load<V>(g + row * ld_g + col, gv);
    load<V>(p + row * ld_p + col, pv);
    load<V>(y + row * ld_y + col, yv);
    float gd[V];
#pragma unroll
    for (int u = 0; u < V; ++u) {
      gd[u] = __fmul_rn(gv[u], __fsub_rn(__fmul_rn(c, pv[u]), yv[u]));
      acc[0] = __fadd_rn(acc[0], __fmul_rn(gd[u], gd[u]));
    }
#pragma unroll
    for (int j = 0; j < NE; ++j) {
      float ev[V];
      load<V>(es.e[j] + row * es.ld[j] + col, ev);
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const float t = __fadd_rn(gd[u], __fmul_rn(gv[u], __fmul_rn(c, ev[u])));
        acc[j + 1] = __fadd_rn(acc[j + 1], __fmul_rn(t, t));
      }
    }
  }
  // Warp sums by shuffles, then the warps' sums in warp order: a fixed order.
  __shared__ float warp_sums[kSumWarps][kMaxE + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j <= NE; ++j) {
    float v = acc[j];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, off));
    if (lane == 0) warp_sums[warp][j] = v;
  }
  __syncthreads();
  if (threadIdx.x <= NE) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kSumWarps; ++w) s = __fadd_rn(s, warp_sums[w][threadIdx.x]);
    part[static_cast<int64_t>(blockIdx.x) * (NE + 1) + threadIdx.x] = s;
  }
}

// One block per output j: the float64 sum of part[:, j] (threads take strided rows, then a
// tree over the threads), added into out[j].
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const float* __restrict__ part, int64_t nparts, int width, double* __restrict__ out) {
  __shared__ double sums[kSumThreads];
  const int j = blockIdx.x;
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < nparts; i += kSumThreads) s = __dadd_rn(s, static_cast<double>(part[i * width + j]));
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) sums[threadIdx.x] = __dadd_rn(sums[threadIdx.x], sums[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0) out[j] = __dadd_rn(out[j], sums[0]);
}

template <typename G, int V>
int launch_partials(const void* g, int64_t ld_g, const float* p, int64_t ld_p, const float* y, int64_t ld_y,
                    const float* c, const Residues& es, int ne, int64_t n, int64_t cols, float* part,
                    unsigned blocks, cudaStream_t stream) {
  const G* gt = static_cast<const G*>(g);
  switch (ne) {
#define RESSERVE_PARTIALS(NE)                                                                                    \
  case NE:                                                                                                       \
    sq_partials_kernel<G, NE, V><<<blocks, kSumThreads, 0, stream>>>(gt, ld_g, p, ld_p, y, ld_y, c, es, n, cols, \
                                                                     part);                                      \
    break;
    RESSERVE_PARTIALS(0)
    RESSERVE_PARTIALS(1)
    RESSERVE_PARTIALS(2)
    RESSERVE_PARTIALS(3)
    RESSERVE_PARTIALS(4)
#undef RESSERVE_PARTIALS
    default: return cudaErrorInvalidValue;
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename G>
int launch_partials(bool vec, const void* g, int64_t ld_g, const float* p, int64_t ld_p, const float* y, int64_t ld_y,
                    const float* c, const Residues& es, int ne, int64_t n, int64_t cols, float* part,
                    unsigned blocks, cudaStream_t stream) {
  return vec ? launch_partials<G, 4>(g, ld_g, p, ld_p, y, ld_y, c, es, ne, n, cols, part, blocks, stream)
             : launch_partials<G, 1>(g, ld_g, p, ld_p, y, ld_y, c, es, ne, n, cols, part, blocks, stream);
}

// Whether pointer `ptr` and row stride `ld` (elements of `size` bytes) allow loads of 4 elements.
inline bool aligned4(const void* ptr, int64_t ld, int size) {
  return reinterpret_cast<uintptr_t>(ptr) % (4 * size) == 0 && ld % 4 == 0;
}

}  // namespace resserve

// The blocks `resserve_sq_partials` launches for a member of `n` elements (its rows of the
// partials: the caller sizes the group's buffer with it).
extern "C" int64_t resserve_sq_partials_blocks(int64_t n) {
  const int64_t per = static_cast<int64_t>(resserve::kSumThreads) * resserve::kSumIters;
  return n <= 0 ? 0 : (n + per - 1) / per;
}

// One member's partial sums into part ([blocks, ne + 1] FP32, blocks from
// resserve_sq_partials_blocks(rows * cols)). g: the gradient (g_dtype 0 bf16, 1 fp16, 2 fp32),
// p and y FP32, es[j] bf16; every input [rows, cols] with its own row stride and unit column
// stride; c one FP32 value on the device. Returns a cudaError_t (0 on success).
extern "C" int resserve_sq_partials(const void* g, int g_dtype, int64_t ld_g, const float* p, int64_t ld_p,
                                    const float* y, int64_t ld_y, const float* c, const void* const* es,
                                    const int64_t* ld_e, int ne, int64_t rows, int64_t cols, float* part,
                                    void* stream) {
  using namespace resserve;
  if (ne < 0 || ne > kMaxE || rows < 0 || cols <= 0) return cudaErrorInvalidValue;
  if (ld_g < cols || ld_p < cols || ld_y < cols) return cudaErrorInvalidValue;
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  if (!g || !p || !y || !c || !part) return cudaErrorInvalidValue;
  Residues r{};
  for (int j = 0; j < ne; ++j) {
    if (!es[j] || ld_e[j] < cols) return cudaErrorInvalidValue;
    r.e[j] = static_cast<const __nv_bfloat16*>(es[j]);
    r.ld[j] = ld_e[j];
  }
  const int64_t blocks = resserve_sq_partials_blocks(n);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  const auto b = static_cast<unsigned>(blocks);
  bool vec = cols % 4 == 0 && aligned4(g, ld_g, g_dtype == 2 ? 4 : 2) && aligned4(p, ld_p, 4) && aligned4(y, ld_y, 4);
  for (int j = 0; j < ne; ++j) vec = vec && aligned4(r.e[j], r.ld[j], 2);
  switch (g_dtype) {
    case 0: return launch_partials<__nv_bfloat16>(vec, g, ld_g, p, ld_p, y, ld_y, c, r, ne, n, cols, part, b, s);
    case 1: return launch_partials<__half>(vec, g, ld_g, p, ld_p, y, ld_y, c, r, ne, n, cols, part, b, s);
    case 2: return launch_partials<float>(vec, g, ld_g, p, ld_p, y, ld_y, c, r, ne, n, cols, part, b, s);
    default: return cudaErrorInvalidValue;
  }
}

// out[j] += Σ_i part[i, j] in float64, for part [nparts, width] FP32 (one row per block of every
// member of a group) and out float64 [width].
extern "C" int resserve_sum_partials(const float* part, int64_t nparts, int width, double* out, void* stream) {
  if (nparts < 0 || width <= 0 || width > resserve::kMaxE + 1 || !out || (nparts && !part)) return cudaErrorInvalidValue;
  resserve::sum_partials_kernel<<<width, resserve::kSumThreads, 0, static_cast<cudaStream_t>(stream)>>>(part, nparts, width,
                                                                                                        out);
  return static_cast<int>(cudaGetLastError());
}
