// Fused quantize-and-extend for FP4 activations with residue compensation (SPEC §3-§6, §11).
//
//   x [M, K] (bf16 or fp16)  ->  base FP4 codes + block scales of x, and in the same pass the
//   selected residues r = x - QDQ(x), compacted per mask byte and quantized into the extension
//   columns of the extended activation [X^ | R^_S | 0] (width K + K_E, zero padded).
//   ratio 0: base only; ratio 1 ("full"): base + every channel's residue in separate tensors.
//
// Build check (no torch headers here; the torch binding is binding.cpp):
//   nvcc -std=c++17 -O3 -fmad=false -arch=sm_90 -c kernels/quantize_extend.cu
//
// Layout of the work: one thread = one selection group = 8 consecutive channels of one row,
// loaded with one 16-byte load. A CTA covers THREADS consecutive groups of one row, so a warp
// never straddles rows and lane l holds group 32w + l. Block amax is reduced with warp shuffles
// over adjacent lanes: NVFP4 (16) = 2 lanes, MXFP4 (32) = 4 lanes. With k = 8*ratio channels
// selected in every group, group g's residues land at compacted positions g*k .. g*k + k - 1,
// so a residue block of B values spans B/k adjacent lanes (again a shuffle reduction); that is the
// exact path's layout. The fast path first collects the residues of the ROWS rows a thread loads
// together and quantizes them transposed (`extension_fast`): lane l takes k*ROWS consecutive
// ones, so a residue block spans B/(k*ROWS) lanes and one block scale serves ROWS rows' worth.
// Lanes past the last group (up to K_E/k) carry zero residues and write the zero padding.
// The fast path takes a row when its inputs meet the conditions under "fast path" below; a warp
// whose row does not runs the exact path for that row.
//
// Arithmetic is the reference's, operation for operation (nvfp4.py, mxfp4.py, fp4.py), written
// with explicit round-to-nearest intrinsics so that no multiply is fused into an add; build with
// -fmad=false all the same. NVFP4: s = amax / (6*alpha) (product first), 0 -> 1, clamp
// [2^-9, 448], E4M3 RNE; code = E2M1(x / (float(s)*alpha)) (product first, one IEEE division).
// MXFP4: exponent from the FP32 bits (ceil / floor / even), x * 2^-e (exact, equal to x / 2^e).
// E2M1 rounding is done in integer/float code (Hopper has no FP4 conversion instruction).

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace resserve {

constexpr int kGroup = 8;
constexpr int kThreads = 128;
constexpr unsigned kFull = 0xffffffffu;

enum Fmt : int { kNVFP4 = 0, kMXFP4 = 1 };
enum Rounding : int { kCeil = 0, kFloor = 1, kEven = 2 };

struct Params {
  const void* x;         // [M, K] bf16/fp16, 16-byte aligned rows
  const uint8_t* mask;   // [K/8] (partial ratios)
  const float* alpha;    // NVFP4 tensor scale (device scalar)
  uint8_t* codes;        // [M, (K + K_E)/2]
  uint8_t* scales;       // [M, (K + K_E)/B]  E4M3 bytes or E8M0
  uint8_t* rcodes;       // full ratio: [M, K/2]
  uint8_t* rscales;      // full ratio: [M, K/B]
  int64_t M;
  int K;
  int KE;
  int rounding;
  int groups;            // groups launched per row: max(K/8, K_E/k)
};

// CTAs per row-iteration grid: 0 = one row block per CTA row (grid.y = ceil(M/ROWS)), else at
// most this many CTAs in all, each looping over rows (fewer, longer-lived CTAs).

// ---------------------------------------------------------------- element and scale helpers

// E2M1 of a >= 0, round to nearest, ties to even, saturating at 6: returns the magnitude code
// (0..7) and sets *v to its value. Below 1 the grid is 0, 0.5, 1 (step 0.5): adding 1.5 * 2^23 to
// 2a rounds it to an integer with ties to even (2a is exact, so one FMA is one rounding). From 1
// up the grid keeps one mantissa bit: round the FP32 pattern at bit 22 (RNE); then
// (bits >> 22) - 252 is the code ((E - 127) * 2 + m + 2) and (bits >> 22) << 22 the value.
// NaN inputs are not supported (the reference's amax propagates NaN, this kernel's does not).
__device__ __forceinline__ uint32_t e2m1_round(float a, float* v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  if (a < 1.0f) {
    const float t = __fmaf_rn(a, 2.0f, kMagic);
    *v = __fmul_rn(__fsub_rn(t, kMagic), 0.5f);
    return __float_as_uint(t) - 0x4B400000u;
  }
  const uint32_t u = __float_as_uint(a);
  const uint32_t r = min((u + 0x1FFFFFu + ((u >> 22) & 1u)) >> 22, 259u);  // 259 <-> 6.0
  *v = __uint_as_float(r << 22);
  return r - 252u;
}

// Code (sign bit 3 from the quotient's sign, as the reference's `q < 0`) and its value
// (code 8 is -0, as the reference's decode table).
__device__ __forceinline__ uint32_t e2m1_code(float q, float* value) {
  float v;
  const uint32_t m = e2m1_round(fabsf(q), &v);
  const bool neg = q < 0.0f;
  *value = neg ? -v : v;
  return m | (neg ? 8u : 0u);
}

// 2^e for integer e in [-127, 127], exact (2^-127 is subnormal).
__device__ __forceinline__ float pow2_exact(int e) {
  return e == -127 ? __uint_as_float(0x00400000u) : __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}

// NVFP4 block scale: returns float(s) and stores the E4M3 byte.
__device__ __forceinline__ float nvfp4_scale(float amax, float six_alpha, uint8_t* byte) {
  float s = __fdiv_rn(amax, six_alpha);
  if (s == 0.0f) s = 1.0f;
  s = fminf(fmaxf(s, 0.001953125f /* 2^-9 */), 448.0f);
  const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
  *byte = static_cast<uint8_t>(b);
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}

// MXFP4 block exponent (mxfp4.scale_exponent), clamped to [-127, 127].
__device__ __forceinline__ int mxfp4_exponent(float amax, int rounding) {
  int e;
  if (rounding == kCeil) {
    const uint32_t bits = __float_as_uint(__fdiv_rn(amax, 6.0f));
    const int field = static_cast<int>((bits & 0x7F800000u) >> 23);
    const uint32_t mant = bits & 0x7FFFFFu;
    if (field == 0) e = mant > (1u << 22) ? -126 : -127;
    else e = field - 127 + (mant != 0u ? 1 : 0);
  } else if (rounding == kFloor) {
    e = static_cast<int>((__float_as_uint(amax) & 0x7F800000u) >> 23) - 127 - 2;
  } else {
    const int32_t bits = static_cast<int32_t>(__float_as_uint(amax));
    e = static_cast<int>((static_cast<uint32_t>(bits + (1 << 21)) & 0x7F800000u) >> 23) - 127 - 2;
  }
  return max(-127, min(127, e));
}

// q[t] = x[t] / d, correctly rounded (IEEE), for the values of one thread that share the
// divisor d. The compiler's own division recomputes the reciprocal for every element and wraps
// each one in a slow-path branch, which serialises the 8 elements. Here the reciprocal is
// computed once and each quotient takes the same fast sequence the compiler emits
// (q0 = x*y, r = x - d*q0, q = q0 + y*r, with y the Newton-refined approximate reciprocal).
// That sequence is correctly rounded as long as nothing underflows or overflows; when any
// value of the thread lies outside a generous safe range (d in [2^-26, 2^100], nonzero |x| in
// [d*2^-100, d*2^100]) every quotient of the thread is recomputed with the IEEE division.
template <int N>
__device__ __forceinline__ void divide_all(const float (&x)[N], float d, float amax, float (&q)[N]) {
  float y0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(d));
  const float y = __fmaf_rn(y0, __fmaf_rn(-d, y0, 1.0f), y0);
  const float lo = __fmul_rn(d, 7.888609052210118e-31f /* 2^-100 */);
  bool ok = d >= 1.4901161193847656e-08f /* 2^-26 */ && d <= 1.2676506002282294e30f /* 2^100 */ &&
            amax <= __fmul_rn(d, 1.2676506002282294e30f);
#pragma unroll
  for (int t = 0; t < N; ++t) {
    const float q0 = __fmul_rn(x[t], y);
    const float r = __fmaf_rn(-d, q0, x[t]);
    q[t] = __fmaf_rn(y, r, q0);
    const float a = fabsf(x[t]);
    ok &= !(a < lo && a > 0.0f);
  }
  if (!ok) {
#pragma unroll
    for (int t = 0; t < N; ++t) q[t] = __fdiv_rn(x[t], d);
  }
}

template <int LANES>
__device__ __forceinline__ float lane_max(float v) {
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Quantizes N values whose block spans LANES adjacent lanes. Returns the packed nibbles
// (value t in bits 4t..4t+3); *scale_byte gets the block's scale byte.
template <int FMT, int LANES, int N>
__device__ __forceinline__ uint32_t quantize_values(const float (&v)[N], float alpha, float six_alpha, int rounding,
                                                    uint8_t* scale_byte, float (*residue)[N]) {
  float amax = 0.0f;
#pragma unroll
  for (int t = 0; t < N; ++t) amax = fmaxf(amax, fabsf(v[t]));
  amax = lane_max<LANES>(amax);
  uint32_t packed = 0;
  if (FMT == kNVFP4) {
    const float sf = nvfp4_scale(amax, six_alpha, scale_byte);
    const float d = __fmul_rn(sf, alpha);
    float q[N];
    divide_all<N>(v, d, amax, q);
#pragma unroll
    for (int t = 0; t < N; ++t) {
      float val;
      const uint32_t c = e2m1_code(q[t], &val);
      packed |= c << (4 * t);
      if (residue) (*residue)[t] = __fsub_rn(v[t], __fmul_rn(val, d));
    }
  } else {
    const int e = mxfp4_exponent(amax, rounding);
    *scale_byte = static_cast<uint8_t>(e + 127);
    const float inv = pow2_exact(-e), scale = pow2_exact(e);
#pragma unroll
    for (int t = 0; t < N; ++t) {
      float val;
      const uint32_t c = e2m1_code(__fmul_rn(v[t], inv), &val);
      packed |= c << (4 * t);
      if (residue) (*residue)[t] = __fsub_rn(v[t], __fmul_rn(val, scale));
    }
  }
  return packed;
}

template <bool BF16>
__device__ __forceinline__ void unpack_group(const uint4 raw, float (&f)[kGroup]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (BF16) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    } else {
      f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xFFFFu)));
      f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
}

// ---------------------------------------------------------------- exact path

// One row's work for this thread's group g, every operation in the reference's form: the
// fallback of the fast path below. Every lane of the warp calls it (shuffles).
template <bool BF16, int FMT, int KSEL>
__device__ __forceinline__ void process_row(const Params& p, const uint4 raw, const int64_t row, const int g,
                                            const bool has_input, const uint32_t mask, const float alpha,
                                            const float six_alpha) {
  constexpr int B = FMT == kNVFP4 ? 16 : 32;  // block size
  constexpr int BASE_LANES = B / kGroup;      // 2 or 4
  constexpr int KS = KSEL == 0 ? 1 : KSEL;
  constexpr int RES_LANES = KSEL == 8 ? BASE_LANES : B / KS;  // lanes per residue block
  const int W = p.K + p.KE;                                   // extended width

  float f[kGroup];
  unpack_group<BF16>(raw, f);

  // Base quantization; residues in registers.
  float r[kGroup];
  uint8_t sbyte;
  const uint32_t base =
      quantize_values<FMT, BASE_LANES, kGroup>(f, alpha, six_alpha, p.rounding, &sbyte, KSEL ? &r : nullptr);
  if (has_input) {
    *reinterpret_cast<uint32_t*>(p.codes + row * (W / 2) + g * 4) = base;
    if (g % BASE_LANES == 0) p.scales[row * (W / B) + g / BASE_LANES] = sbyte;
  }
  if (KSEL == 0) return;

  if (KSEL == 8) {
    // Full compensation: every channel's residue, same block layout as the base.
    const uint32_t res = quantize_values<FMT, BASE_LANES, kGroup>(r, alpha, six_alpha, p.rounding, &sbyte, nullptr);
    if (has_input) {
      *reinterpret_cast<uint32_t*>(p.rcodes + row * (p.K / 2) + g * 4) = res;
      if (g % BASE_LANES == 0) p.rscales[row * (p.K / B) + g / BASE_LANES] = sbyte;
    }
    return;
  }

  // K-Ext: pick the selected residues in ascending channel order (compile-time register
  // indices only: each slot takes the lowest remaining mask bit through a select chain).
  float sel[KS];
  uint32_t m = mask;
#pragma unroll
  for (int t = 0; t < KS; ++t) {
    const int j = __ffs(m) - 1;  // -1 when no bit is left
    m &= m - 1u;
    float v = 0.0f;
#pragma unroll
    for (int c = 0; c < kGroup; ++c) v = j == c ? r[c] : v;
    sel[t] = v;
  }
  const uint32_t ext = quantize_values<FMT, RES_LANES, KS>(sel, alpha, six_alpha, p.rounding, &sbyte, nullptr);
  const int pos = g * KS;  // first compacted position of this group
  uint8_t* ext_codes = p.codes + row * (W / 2) + p.K / 2;
  if (KS == 1) {
    const uint32_t hi = __shfl_down_sync(kFull, ext, 1);
    if ((g & 1) == 0 && pos < p.KE) ext_codes[pos / 2] = static_cast<uint8_t>(ext | (hi << 4));
  } else if (pos < p.KE) {
    if (KS == 2) ext_codes[pos / 2] = static_cast<uint8_t>(ext);
    else *reinterpret_cast<uint16_t*>(ext_codes + pos / 2) = static_cast<uint16_t>(ext);
  }
  if (g % RES_LANES == 0 && pos < p.KE) p.scales[row * (W / B) + p.K / B + pos / B] = sbyte;
}

// ---------------------------------------------------------------- fast path
//
// The same arithmetic in fewer instructions, exact under conditions checked per row (a warp
// whose row breaks one of them takes the exact path above, `process_row`):
//
// * Division: x / d as the compiler's fast sequence (q0 = x*y, r = x - d*q0, q = q0 + y*r, y the
//   Newton-refined reciprocal), computed once per block for d, and once per launch for 6*alpha.
//   It is correctly rounded while nothing overflows and x/d is not tiny. Tiny quotients
//   (|q| < 2^-100) only need the right sign and zero-ness (their code is 0 or 8, value +-0,
//   residue x): with alpha in [2^-87, 36] every divisor lies in [2^-96, 2^14], so a nonzero bf16
//   or fp16 x (>= 2^-133) gives |x/d| >= 2^-147, nonzero both ways, and residues are either x
//   or multiples of d*2^-27. Overflow is excluded by block amax <= 448*alpha*2^100.
//   MXFP4 multiplies by 2^-e; with e <= 14 no nonzero input underflows to zero.
// * Sign: the fast sequence maps x = -0 to q = +0 (and MXFP4 uses fma(x, 2^-e, +0)), so the sign
//   bit of q is exactly the reference's `q < 0`.
// * E2M1: one path for every binade. With a = min(|q|, 6) and p = 2^e the power of two of
//   max(a, 1) (e in {0, 1, 2}), t = a + 1.5*2^22*p is a single rounding to the grid step 0.5*p
//   with ties to even (the magic constant is an even multiple of the step), and
//   v = t - 1.5*2^22*p is the grid value, exactly. The code is the bit pattern of v*2^-126 shifted
//   right by 22 (0.5 lands on the smallest normal's half, a subnormal: 0.5 -> 1, 1 -> 2, ...,
//   6 -> 7).

constexpr float kMagic = 6291456.0f;  // 1.5 * 2^22
constexpr int kSpillM = 9 * kThreads;  // words from an input slot to its grid magnitude

__device__ __forceinline__ float refined_reciprocal(float d) {
  float y0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(d));
  return __fmaf_rn(y0, __fmaf_rn(-d, y0, 1.0f), y0);
}

__device__ __forceinline__ float fast_div(float x, float d, float y) {
  const float q0 = __fmul_rn(x, y);
  return __fmaf_rn(y, __fmaf_rn(-d, q0, x), q0);
}

// Magnitude of q rounded to the E2M1 grid (RNE, saturating at 6), as its value.
__device__ __forceinline__ float e2m1_grid(float q) {
  const float a = fminf(fabsf(q), 6.0f);
  const float p = __uint_as_float(__float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u);
  const float t = __fmaf_rn(p, kMagic, a);
  return __fmaf_rn(p, -kMagic, t);
}

struct Tensor {
  float alpha, six_alpha, y6;  // NVFP4: alpha, 6*alpha and its refined reciprocal
  float bound;                 // NVFP4: largest block amax the fast path takes
  int rounding;
};

// Scale of one block: d (the divisor: float(s)*alpha, or 2^e), y (its reciprocal: refined, or
// 2^-e) and the stored byte. Returns false when the block must take the exact path.
template <int FMT>
__device__ __forceinline__ bool block_scale(float amax, const Tensor& c, float* d, float* y, uint8_t* byte) {
  if (FMT == kNVFP4) {
    float s = fast_div(amax, c.six_alpha, c.y6);
    if (s == 0.0f) s = 1.0f;
    s = fminf(fmaxf(s, 0.001953125f /* 2^-9 */), 448.0f);
    const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
    *byte = static_cast<uint8_t>(b);
    *d = __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3))), c.alpha);
    *y = refined_reciprocal(*d);
    return amax <= c.bound;
  } else {
    const int e = mxfp4_exponent(amax, c.rounding);
    *byte = static_cast<uint8_t>(e + 127);
    *d = pow2_exact(e);
    *y = pow2_exact(-e);
    return e <= 14;
  }
}

// Codes of N values of one block (nibble t in bits 4t..4t+3). OUT: 0 nothing else, 1 their
// residues, 2 their grid magnitudes (for residues formed later, `residue_fast`).
template <int FMT, int N, int OUT>
__device__ __forceinline__ uint32_t encode_fast(const float (&v)[N], float d, float y, float (&out)[N]) {
  uint32_t packed = 0;
#pragma unroll
  for (int t = 0; t < N; ++t) {
    const float q = FMT == kNVFP4 ? fast_div(v[t], d, y) : __fmaf_rn(v[t], y, 0.0f);
    const float m = e2m1_grid(q);
    const uint32_t qb = __float_as_uint(q);
    const uint32_t code = __float_as_uint(__fmul_rn(m, 1.1754943508222875e-38f /* 2^-126 */)) >> 22;
    packed |= (code | ((qb >> 28) & 8u)) << (4 * t);
    if (OUT == 1) out[t] = __fsub_rn(v[t], __fmul_rn(__uint_as_float(__float_as_uint(m) | (qb & 0x80000000u)), d));
    if (OUT == 2) out[t] = m;
  }
  return packed;
}

// The residue of x from its grid magnitude m and block divisor d: x - (+-m)*d, the sign taken from
// x (the sign of q except for x = -0, where only the residue's zero sign differs, which nothing
// reads: amax takes |r| and a zero quotient is +0 either way).
__device__ __forceinline__ float residue_fast(float x, float m, float d) {
  return __fsub_rn(x, __fmul_rn(__uint_as_float(__float_as_uint(m) | (__float_as_uint(x) & 0x80000000u)), d));
}

template <int FMT, int LANES, int N, int OUT>
__device__ __forceinline__ uint32_t quantize_fast(const float (&v)[N], float amax, const Tensor& c, uint8_t* byte,
                                                  float (&out)[N], float* d_out = nullptr) {
  float d, y;
  block_scale<FMT>(amax, c, &d, &y, byte);
  if (d_out) *d_out = d;
  return encode_fast<FMT, N, OUT>(v, d, y, out);
}

template <int N>
__device__ __forceinline__ float abs_max(const float (&v)[N]) {
  float a = 0.0f;
#pragma unroll
  for (int t = 0; t < N; ++t) a = fmaxf(a, fabsf(v[t]));
  return a;
}

// One row's work for this thread's group g on the fast path; `f` are the group's inputs and
// `amax` their block's amax (already reduced over the block's lanes).
template <int FMT, int KSEL>
__device__ __forceinline__ void process_row_fast(const Params& p, const float (&f)[kGroup], float amax,
                                                 const int64_t row, const int g, const bool has_input,
                                                 const int (&pick)[KSEL > 0 && KSEL < 8 ? KSEL : 1], float* spill,
                                                 float* ext_row, const Tensor& c) {
  constexpr int B = FMT == kNVFP4 ? 16 : 32;
  constexpr int BASE_LANES = B / kGroup;
  constexpr int KS = KSEL == 0 ? 1 : KSEL;
  const int W = p.K + p.KE;

  float r[kGroup];  // full: residues; K-Ext: grid magnitudes
  float d;
  uint8_t sbyte;
  const uint32_t base =
      quantize_fast<FMT, BASE_LANES, kGroup, KSEL == 0 ? 0 : (KSEL == 8 ? 1 : 2)>(f, amax, c, &sbyte, r, &d);
  if (has_input) {
    *reinterpret_cast<uint32_t*>(p.codes + row * (W / 2) + g * 4) = base;
    if (g % BASE_LANES == 0) p.scales[row * (W / B) + g / BASE_LANES] = sbyte;
  }
  if (KSEL == 0) return;

  if (KSEL == 8) {
    float unused[kGroup];
    const float ra = lane_max<BASE_LANES>(abs_max(r));
    const uint32_t res = quantize_fast<FMT, BASE_LANES, kGroup, 0>(r, ra, c, &sbyte, unused);
    if (has_input) {
      *reinterpret_cast<uint32_t*>(p.rcodes + row * (p.K / 2) + g * 4) = res;
      if (g % BASE_LANES == 0) p.rscales[row * (p.K / B) + g / BASE_LANES] = sbyte;
    }
    return;
  }

  // K-Ext: the residues of the selected channels only, in ascending channel order. Inputs and
  // grid magnitudes go through this thread's slots in shared memory (`pick`: the word offset of
  // each slot's input, its magnitude kSpillM words further; a missing bit reads zeros).
  float4* s4 = reinterpret_cast<float4*>(spill);
  s4[threadIdx.x] = make_float4(f[0], f[1], f[2], f[3]);
  s4[kThreads + threadIdx.x] = make_float4(f[4], f[5], f[6], f[7]);
  s4[kSpillM / 4 + threadIdx.x] = make_float4(r[0], r[1], r[2], r[3]);
  s4[kSpillM / 4 + kThreads + threadIdx.x] = make_float4(r[4], r[5], r[6], r[7]);
  // Quantized later, rows together (`extension_fast`): this thread's KS residues of this row.
#pragma unroll
  for (int k = 0; k < KS; ++k) ext_row[k] = residue_fast(spill[pick[k]], spill[pick[k] + kSpillM], d);
}

// The extension blocks of ROWS rows, quantized with the rows' residues transposed across the
// warp: the warp's rows hold 32*KS*ROWS selected residues (row by row, ascending position), and
// lane l quantizes V = KS*ROWS consecutive ones, positions l*V..l*V+V-1, so a residue block spans
// B/V lanes and each lane computes one block scale per ROWS rows instead of ROWS of them.
// `buf` is the warp's transposition buffer; `live`: bit i set when row row0+i took the fast path.
template <int FMT, int KS, int ROWS>
__device__ __forceinline__ void extension_fast(const Params& p, const float* buf, const int64_t row0, const int g,
                                               const unsigned live, const Tensor& c) {
  constexpr int B = FMT == kNVFP4 ? 16 : 32;
  constexpr int V = KS * ROWS;
  constexpr int LANES = B / V;  // lanes per residue block
  constexpr int N = V < 8 ? V : 8;
  const int lane = threadIdx.x & 31;
  const int i = lane * ROWS / 32;  // this lane's row
  const int pos = (g - lane) * KS + (lane * V) % (32 * KS);  // first extension position
  float v[V];
#pragma unroll
  for (int t = 0; t < V; ++t) v[t] = buf[lane * V + t];
  const float amax = lane_max<LANES>(abs_max(v));
  float d, y;
  uint8_t byte;
  block_scale<FMT>(amax, c, &d, &y, &byte);
  uint32_t code[V / N];
#pragma unroll
  for (int h = 0; h < V / N; ++h) {
    float part[N], unused[N];
#pragma unroll
    for (int t = 0; t < N; ++t) part[t] = v[h * N + t];
    code[h] = encode_fast<FMT, N, 0>(part, d, y, unused);
  }
  const uint32_t hi = V == 1 ? __shfl_down_sync(kFull, code[0], 1) : 0u;
  const int64_t row = row0 + i;
  if (!((live >> i) & 1u) || pos >= p.KE) return;
  const int W = p.K + p.KE;
  uint8_t* ext = p.codes + row * (W / 2) + p.K / 2 + pos / 2;
  if (V == 1) {
    if ((lane & 1) == 0) *ext = static_cast<uint8_t>(code[0] | (hi << 4));
  } else if (V == 2) {
    *ext = static_cast<uint8_t>(code[0]);
  } else if (V == 4) {
    *reinterpret_cast<uint16_t*>(ext) = static_cast<uint16_t>(code[0]);
  } else if (V == 8) {
    *reinterpret_cast<uint32_t*>(ext) = code[0];
  } else {
    *reinterpret_cast<uint2*>(ext) = make_uint2(code[0], code[V / N - 1]);
  }
  if (pos % B == 0) p.scales[row * (W / B) + p.K / B + pos / B] = byte;
}

// ---------------------------------------------------------------- kernel

// KSEL: channels selected per group: 0 (plain), 1/2/4 (K-Ext), 8 (full, separate outputs).
// ROWS: rows per thread and iteration; their loads are all issued before any compute, so that
// more bytes are in flight per thread.
template <bool BF16, int FMT, int KSEL, int ROWS>
__global__ void __launch_bounds__(kThreads) quantize_extend_kernel(const Params p) {
  constexpr int B = FMT == kNVFP4 ? 16 : 32;
  constexpr int BASE_LANES = B / kGroup;
  constexpr int KW = KSEL > 0 && KSEL < 8 ? KSEL : 1;
  const int g = blockIdx.x * kThreads + threadIdx.x;
  const bool has_input = g < p.K / kGroup;
  const float alpha = FMT == kNVFP4 ? *p.alpha : 0.0f;
  const float six_alpha = __fmul_rn(6.0f, alpha);
  const uint32_t mask = (KSEL > 0 && KSEL < 8 && has_input) ? p.mask[g] : 0u;
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + static_cast<int64_t>(g) * kGroup;

  Tensor c;
  c.alpha = alpha;
  c.six_alpha = six_alpha;
  c.y6 = FMT == kNVFP4 ? refined_reciprocal(six_alpha) : 0.0f;
  c.bound = __fmul_rn(__fmul_rn(448.0f, alpha), 1.2676506002282294e30f /* 2^100 */);
  c.rounding = p.rounding;
  // alpha in [2^-87, 36]: every NVFP4 divisor in [2^-96, 2^14] (see the fast-path notes).
  const bool fast_tensor = FMT != kNVFP4 || (alpha >= 6.462348535570529e-27f /* 2^-87 */ && alpha <= 36.0f);

  // This group's selection, ascending (slot k: the k-th lowest mask bit), as word offsets into
  // the thread's input slots in `spill`: channel j < 4 at [4*tid + j], j >= 4 at
  // [4*(kThreads + tid) + j - 4], a zero word at [8*kThreads + tid] for a missing bit; the grid
  // magnitudes mirror that layout kSpillM words further.
  __shared__ float spill[KSEL > 0 && KSEL < 8 ? 2 * kSpillM : 1];
  int pick[KW];
  {
    const int tid = threadIdx.x;
    if (KSEL > 0 && KSEL < 8) spill[8 * kThreads + tid] = spill[kSpillM + 8 * kThreads + tid] = 0.0f;
    uint32_t m = mask;
#pragma unroll
    for (int k = 0; k < KW; ++k) {
      const int j = __ffs(m) - 1;
      m &= m - 1u;
      pick[k] = j < 0 ? 8 * kThreads + tid : (j < 4 ? 4 * tid + j : 4 * (kThreads + tid) + j - 4);
    }
  }

  // The warps' transposition buffers for the extension (see extension_fast).
  constexpr bool KEXT = KSEL > 0 && KSEL < 8;
  __shared__ float xbuf[KEXT ? kThreads * KW * ROWS : 1];
  float* wbuf = xbuf + (threadIdx.x / 32) * 32 * KW * ROWS;
  const int lane = threadIdx.x & 31;

  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * ROWS; row0 < p.M;
       row0 += static_cast<int64_t>(gridDim.y) * ROWS) {
    uint4 raw[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      raw[i] = make_uint4(0u, 0u, 0u, 0u);
      if (has_input && row0 + i < p.M) raw[i] = __ldcs(reinterpret_cast<const uint4*>(x + (row0 + i) * p.K));
    }
    unsigned live = 0;  // rows on the fast path, whose extension is still to be quantized
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      if (row0 + i >= p.M) continue;  // uniform across the CTA: one row at a time
      float f[kGroup];
      unpack_group<BF16>(raw[i], f);
      const float amax = lane_max<BASE_LANES>(abs_max(f));
      bool ok = fast_tensor;
      if (FMT == kNVFP4) ok = ok && amax <= c.bound;
      else ok = ok && mxfp4_exponent(amax, p.rounding) <= 14;
      if (__all_sync(kFull, ok)) {
        process_row_fast<FMT, KSEL>(p, f, amax, row0 + i, g, has_input, pick, spill, wbuf + i * 32 * KW + lane * KW, c);
        live |= 1u << i;
      } else {
        process_row<BF16, FMT, KSEL>(p, raw[i], row0 + i, g, has_input, mask, alpha, six_alpha);
      }
    }
    if (KEXT) {
      __syncwarp();
      extension_fast<FMT, KW, ROWS>(p, wbuf, row0, g, live, c);
      __syncwarp();  // the buffer is rewritten by the next rows
    }
  }
}

template <bool BF16, int FMT, int ROWS>
cudaError_t launch_rows(const Params& p, int ksel, int max_ctas, cudaStream_t stream) {
  const int64_t iters = (p.M + ROWS - 1) / ROWS;
  const int64_t gx = (p.groups + kThreads - 1) / kThreads;
  int64_t gy = iters < 65535 ? iters : 65535;
  if (max_ctas > 0 && gy * gx > max_ctas) gy = max_ctas / gx > 0 ? max_ctas / gx : 1;
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  switch (ksel) {
    case 0: quantize_extend_kernel<BF16, FMT, 0, ROWS><<<grid, kThreads, 0, stream>>>(p); break;
    case 1: quantize_extend_kernel<BF16, FMT, 1, ROWS><<<grid, kThreads, 0, stream>>>(p); break;
    case 2: quantize_extend_kernel<BF16, FMT, 2, ROWS><<<grid, kThreads, 0, stream>>>(p); break;
    case 4: quantize_extend_kernel<BF16, FMT, 4, ROWS><<<grid, kThreads, 0, stream>>>(p); break;
    case 8: quantize_extend_kernel<BF16, FMT, 8, ROWS><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <bool BF16, int FMT>
cudaError_t launch_fmt(const Params& p, int ksel, int rows, int max_ctas, cudaStream_t stream) {
  if (rows == 1) return launch_rows<BF16, FMT, 1>(p, ksel, max_ctas, stream);
  if (rows == 2) return launch_rows<BF16, FMT, 2>(p, ksel, max_ctas, stream);
  return launch_rows<BF16, FMT, 4>(p, ksel, max_ctas, stream);
}

}  // namespace resserve

// ---------------------------------------------------------------- launcher (C ABI)

// Returns a cudaError_t (0 on success); cudaErrorInvalidValue for arguments that break the
// layout contract (checked here so that no launch can write out of bounds).
extern "C" int resserve_quantize_extend(const void* x, int is_bf16, int64_t M, int K, const uint8_t* mask, int ksel,
                                        int fmt, int rounding, const float* alpha, uint8_t* codes, uint8_t* scales,
                                        int KE, uint8_t* rcodes, uint8_t* rscales, int rows, int max_ctas, void* stream) {
  using namespace resserve;
  if (rows != 1 && rows != 2 && rows != 4) return cudaErrorInvalidValue;
  if (fmt != kNVFP4 && fmt != kMXFP4) return cudaErrorInvalidValue;
  const int B = fmt == kNVFP4 ? 16 : 32;
  const int pad = fmt == kNVFP4 ? 64 : 128;
  if (M < 0 || K <= 0 || K % B || KE < 0 || rounding < 0 || rounding > 2) return cudaErrorInvalidValue;
  if (ksel != 0 && ksel != 1 && ksel != 2 && ksel != 4 && ksel != 8) return cudaErrorInvalidValue;
  const bool partial = ksel > 0 && ksel < 8;
  if (partial != (KE > 0)) return cudaErrorInvalidValue;
  if (partial && ((K + KE) % pad || static_cast<int64_t>(KE) < static_cast<int64_t>(K) / 8 * ksel)) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  if (!x || !codes || !scales || (fmt == kNVFP4 && !alpha) || (partial && !mask) || (ksel == 8 && (!rcodes || !rscales)))
    return cudaErrorInvalidValue;
  // codes: 4-byte stores, 8-byte ones for the extension at 4 selected channels per group.
  if (reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(codes) % (ksel == 4 ? 8 : 4) ||
      (ksel == 8 && reinterpret_cast<uintptr_t>(rcodes) % 4))
    return cudaErrorMisalignedAddress;
  Params p{x, mask, alpha, codes, scales, rcodes, rscales, M, K, KE, rounding, 0};
  p.groups = K / kGroup;
  if (partial && KE / ksel > p.groups) p.groups = KE / ksel;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (is_bf16) return fmt == kNVFP4 ? launch_fmt<true, kNVFP4>(p, ksel, rows, max_ctas, s) : launch_fmt<true, kMXFP4>(p, ksel, rows, max_ctas, s);
  return fmt == kNVFP4 ? launch_fmt<false, kNVFP4>(p, ksel, rows, max_ctas, s) : launch_fmt<false, kMXFP4>(p, ksel, rows, max_ctas, s);
}

extern "C" const char* resserve_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }
