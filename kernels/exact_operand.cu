// The bf16 operand of an FP4 tensor with its tensor scale factored out (docs/formats.md: the grad
// scores' bf16 path): out[r, c] = E2M1(code[r, c]) * factor(scale byte of c's block), where
// factor is the block scale byte's FP32 value from the format's own decoder, passed in as a
// 256-entry table. The product has at most 6 significant bits (2 of the E2M1 value, at most 4 of
// an E4M3 scale; MXFP4 scales are powers of two), so it is exact in FP32 and in bf16: these are
// the bits of the PyTorch reference (emulate.exact_operand) and of the Triton kernel, one launch
// with a C++ call's host cost instead of a Triton launch's.
//
// codes [M, width/2] (two codes a byte, low nibble first) and scales [M, width/block], each with
// its own row stride and unit column stride (row-strided views of a wider tensor are read in
// place); out [M, width] contiguous bf16. One thread = eight code bytes = sixteen output columns
// where the layout is aligned for it, else one code byte = two output columns.
//
// Build check (no torch headers here; the torch binding is binding.cpp):
//   nvcc -std=c++17 -O3 -arch=sm_90 -c kernels/exact_operand.cu

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace resserve {

// E2M1 values by code: 0..7 positive, 8..15 their negatives (code 8 is -0).
__constant__ float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

constexpr int kExactThreads = 256;

__global__ void __launch_bounds__(kExactThreads)
    exact_bf16_kernel(const uint8_t* __restrict__ codes, int64_t codes_stride, const uint8_t* __restrict__ scales,
                      int64_t scales_stride, const float* __restrict__ factors, int64_t M, int64_t bytes, int block,
                      __nv_bfloat162* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kExactThreads + threadIdx.x;
  if (i >= M * bytes) return;
  const int64_t row = i / bytes, b = i - row * bytes;
  const uint8_t byte = codes[row * codes_stride + b];
  const float s = factors[scales[row * scales_stride + (2 * b) / block]];  // both columns share a block
  __nv_bfloat162 v;
  v.x = __float2bfloat16_rn(__fmul_rn(kE2M1[byte & 15], s));
  v.y = __float2bfloat16_rn(__fmul_rn(kE2M1[byte >> 4], s));
  out[i] = v;  // out is [M, 2 * bytes]: element pair i
}

// Sixteen codes a thread (8 bytes in, 32 bytes out), where the layout allows it (width a multiple
// of 16, codes' rows and pointer 8-byte aligned, out 16-byte aligned): the sixteen columns lie in
// one scale block (blocks are 16 or 32 wide and the chunk starts at a multiple of 16), so one
// factor serves them all. Each output is the same product as above, so the same bits.
__global__ void __launch_bounds__(kExactThreads)
    exact_bf16_x16_kernel(const uint8_t* __restrict__ codes, int64_t codes_stride, const uint8_t* __restrict__ scales,
                          int64_t scales_stride, const float* __restrict__ factors, int64_t M, int64_t chunks,
                          int block, uint4* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kExactThreads + threadIdx.x;
  if (i >= M * chunks) return;
  const int64_t row = i / chunks, ch = i - row * chunks;
  const uint2 raw = *reinterpret_cast<const uint2*>(codes + row * codes_stride + 8 * ch);
  const float s = factors[scales[row * scales_stride + (16 * ch) / block]];
  uint32_t words[8];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint32_t four = w ? raw.y : raw.x;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const uint32_t byte = (four >> (8 * b)) & 0xffu;
      __nv_bfloat162 v;
      v.x = __float2bfloat16_rn(__fmul_rn(kE2M1[byte & 15], s));
      v.y = __float2bfloat16_rn(__fmul_rn(kE2M1[byte >> 4], s));
      words[4 * w + b] = *reinterpret_cast<const uint32_t*>(&v);
    }
  }
  out[2 * i] = make_uint4(words[0], words[1], words[2], words[3]);  // out is [M, 16 * chunks]: 16 columns = 2 uint4
  out[2 * i + 1] = make_uint4(words[4], words[5], words[6], words[7]);
}

}  // namespace resserve

// Returns a cudaError_t (0 on success); cudaErrorInvalidValue for arguments that break the layout.
extern "C" int resserve_exact_bf16(const uint8_t* codes, int64_t codes_stride, const uint8_t* scales,
                                   int64_t scales_stride, const float* factors, int64_t M, int64_t width, int block,
                                   void* out, void* stream) {
  using namespace resserve;
  if (M < 0 || width <= 0 || (block != 16 && block != 32) || width % block) return cudaErrorInvalidValue;
  if (codes_stride < width / 2 || scales_stride < width / block) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  if (!codes || !scales || !factors || !out) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(out) % 4) return cudaErrorMisalignedAddress;
  const bool x16 = width % 16 == 0 && codes_stride % 8 == 0 && reinterpret_cast<uintptr_t>(codes) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (x16) {
    const int64_t n = M * (width / 16);
    const int64_t grid = (n + kExactThreads - 1) / kExactThreads;
    if (grid > INT32_MAX) return cudaErrorInvalidValue;
    exact_bf16_x16_kernel<<<static_cast<unsigned>(grid), kExactThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        codes, codes_stride, scales, scales_stride, factors, M, width / 16, block, static_cast<uint4*>(out));
    return static_cast<int>(cudaGetLastError());
  }
  const int64_t n = M * (width / 2);
  const int64_t grid = (n + kExactThreads - 1) / kExactThreads;
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  exact_bf16_kernel<<<static_cast<unsigned>(grid), kExactThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      codes, codes_stride, scales, scales_stride, factors, M, width / 2, block, static_cast<__nv_bfloat162*>(out));
  return static_cast<int>(cudaGetLastError());
}
