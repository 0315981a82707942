// Fused quantize-and-extend for FP4 activations with residue compensation (docs/formats.md: NVFP4, MXFP4, channel selection, K-Ext, the fused kernel).
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
// 16 bytes (copied into shared memory asynchronously one iteration ahead, ROWS rows at a time).
// A CTA covers THREADS consecutive groups of one row, so a warp
// never straddles rows and lane l holds group 32w + l. Block amax is reduced with warp shuffles
// over adjacent lanes: NVFP4 (16) = 2 lanes, MXFP4 (32) = 4 lanes. With k = 8*ratio channels
// selected in every group, group g's residues land at compacted positions g*k .. g*k + k - 1,
// so a residue block of B values spans B/k adjacent lanes (again a shuffle reduction); that is the
// exact path's layout. The fast path first collects the residues of the ROWS rows a thread loads
// together and quantizes them transposed (`extension_fast`): lane l takes k*ROWS consecutive
// ones, so a residue block spans B/(k*ROWS) lanes and one block scale serves ROWS rows' worth.
// Lanes past the last group (up to K_E/k) carry zero residues and write the zero padding.
// The fast path takes an iteration's ROWS rows when their blocks meet the conditions under
// "fast path" below; a warp whose rows do not runs the exact path for them.
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
// The ceil rule from q = amax / 6 (correctly rounded): the smallest e with 2^e >= q, clamped.
__device__ __forceinline__ int mxfp4_exponent_of_sixth(float q) {
  const uint32_t bits = __float_as_uint(q);
  const int field = static_cast<int>((bits & 0x7F800000u) >> 23);
  const uint32_t mant = bits & 0x7FFFFFu;
  int e;
  if (field == 0) e = mant > (1u << 22) ? -126 : -127;
  else e = field - 127 + (mant != 0u ? 1 : 0);
  return max(-127, min(127, e));
}

__device__ __forceinline__ int mxfp4_exponent(float amax, int rounding) {
  int e;
  if (rounding == kCeil) {
    return mxfp4_exponent_of_sixth(__fdiv_rn(amax, 6.0f));
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

// max |x| over one group's 8 inputs, from the packed 16-bit pairs: three packed max-of-magnitudes
// (max.xorsign.abs: |result| = max(|a|, |b|), exact) and one FP32 max over the last pair's halves.
// Cheaper than 8 FP32 maxes, and the unpacked inputs need not be live until their row is encoded.
template <bool BF16>
__device__ __forceinline__ float packed_abs_max(const uint4 raw) {
  uint32_t a, b, m;
  if (BF16) {
    asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(a) : "r"(raw.x), "r"(raw.y));
    asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(b) : "r"(raw.z), "r"(raw.w));
    asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
    return fmaxf(fabsf(__uint_as_float(m << 16)), fabsf(__uint_as_float(m & 0xFFFF0000u)));
  } else {
    asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(a) : "r"(raw.x), "r"(raw.y));
    asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(b) : "r"(raw.z), "r"(raw.w));
    asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
    return fmaxf(fabsf(__half2float(__ushort_as_half(static_cast<unsigned short>(m & 0xFFFFu)))),
                 fabsf(__half2float(__ushort_as_half(static_cast<unsigned short>(m >> 16)))));
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
// The same arithmetic in fewer instructions, exact under conditions checked per row group (a
// warp whose rows break one of them takes the exact path above, `process_row`, for those rows):
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
//   max(a, 1) (e in {0, 1, 2}), the grid sum g = a + (1.5*2^22 + 1)*p is a single rounding to the
//   grid step 0.5*p with ties to even (the constant is an even multiple of the step, so the
//   parity of the grid points is that of v), so g = (1.5*2^22 + 1)*p + v exactly, v the grid
//   value. Bit for bit, g = A + e*2^23 + L with A = 0x4AC00000 = 299*2^22 and L = v/(0.5p) + 2 in
//   [2, 6], while the code is v/(0.5p) + 2e (p = 1: 0, 0.5, 1, 1.5, 2 -> 0..4; p = 2: 2, 3, 4 ->
//   4..6; p = 4: 4, 6 -> 6, 7). One high multiply turns g into the code: with M = 2^32 - 3*2^10,
//   mulhi(bits(g), M) = bits(g) - ceil(3*bits(g)/2^22) = bits(g) - (897 + 6e + 1) (the +2 in L
//   makes the ceiling's fraction nonzero), which is L - 898 - 6e = code - 896 - 8e, i.e. the code
//   mod 8. The kernel is bound by the integer/logic pipe (half the issue rate); a high multiply
//   runs on the FMA pipe. v = g - (1.5*2^22 + 1)*p = fma(h, -(1.5 + 2^-22), g) with h = 2^22*p =
//   float(bits(g) & 0xFF800000), exactly (residues need it).

constexpr float kMagic = 6291457.0f;  // 1.5 * 2^22 + 1

__device__ __forceinline__ float refined_reciprocal(float d) {
  float y0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(d));
  return __fmaf_rn(y0, __fmaf_rn(-d, y0, 1.0f), y0);
}

__device__ __forceinline__ float fast_div(float x, float d, float y) {
  const float q0 = __fmul_rn(x, y);
  return __fmaf_rn(y, __fmaf_rn(-d, q0, x), q0);
}

// Grid sum of q (see above) and the power of two p it used.
__device__ __forceinline__ float e2m1_sum(float q, float* p) {
  const float a = fminf(fabsf(q), 6.0f);
  *p = __uint_as_float(__float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u);
  return __fmaf_rn(*p, kMagic, a);
}

// FP4 nibble from the grid sum: the code (see above) in bits 0..2, q's sign in bit 3. q >> 28
// is also a high multiply (its bits above 3 are zero); one LOP3 takes the low 3 bits of the one
// and bit 3 of the other.
__device__ __forceinline__ uint32_t e2m1_nibble(float g, float q) {
  uint32_t v, qs, n;
  asm("mul.hi.u32 %0, %1, 0xFFFFF400;" : "=r"(v) : "r"(__float_as_uint(g)));
  asm("mul.hi.u32 %0, %1, 16;" : "=r"(qs) : "r"(__float_as_uint(q)));
  asm("lop3.b32 %0, %1, %2, 7, 0xE4;" : "=r"(n) : "r"(v), "r"(qs));  // (v & 7) | (qs & ~7)
  return n;
}

// packed + nibble * 16^t as one integer multiply-add (FMA pipe; nibbles never overlap).
__device__ __forceinline__ uint32_t put_nibble(uint32_t packed, uint32_t nibble, int t) {
  uint32_t r;
  asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(nibble), "r"(1u << (4 * t)), "r"(packed));
  return r;
}

// Grid value from the grid sum alone.
__device__ __forceinline__ float e2m1_value(float g) {
  return __fmaf_rn(__uint_as_float(__float_as_uint(g) & 0xFF800000u), -1.5000002384185791f /* 1.5 + 2^-22 */, g);
}

struct Tensor {
  float alpha, six_alpha, y6;  // NVFP4: alpha, 6*alpha and its refined reciprocal
  float bound;                 // NVFP4: largest block amax the fast path takes
  float y_six;                 // MXFP4: the refined reciprocal of 6
  int rounding;
};

// mxfp4_exponent with amax / 6 (ceil rule) by the fast division where it is correctly rounded
// (amax zero or >= 2^-100: a normal quotient), the IEEE division otherwise.
__device__ __forceinline__ int mxfp4_exponent_fast(float amax, const Tensor& c) {
  if (c.rounding != kCeil) return mxfp4_exponent(amax, c.rounding);
  const float q = amax == 0.0f || amax >= 7.888609052210118e-31f /* 2^-100 */ ? fast_div(amax, 6.0f, c.y_six)
                                                                               : __fdiv_rn(amax, 6.0f);
  return mxfp4_exponent_of_sixth(q);
}

// Scale of one block: d (the divisor: float(s)*alpha, or 2^e), y (its reciprocal: refined, or
// 2^-e) and the stored byte.
template <int FMT>
__device__ __forceinline__ void block_scale(float amax, const Tensor& c, float* d, float* y, uint8_t* byte) {
  if (FMT == kNVFP4) {
    float s = fast_div(amax, c.six_alpha, c.y6);
    if (s == 0.0f) s = 1.0f;
    s = fminf(fmaxf(s, 0.001953125f /* 2^-9 */), 448.0f);
    const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
    *byte = static_cast<uint8_t>(b);
    *d = __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3))), c.alpha);
    *y = refined_reciprocal(*d);
  } else {
    const int e = mxfp4_exponent_fast(amax, c);
    *byte = static_cast<uint8_t>(e + 127);
    *d = pow2_exact(e);
    *y = pow2_exact(-e);
  }
}

// block_scale for a base block, and whether its row may take the fast path (given a fast-path
// tensor scale): NVFP4 amax <= 448*alpha*2^100, MXFP4 exponent <= 14.
template <int FMT>
__device__ __forceinline__ bool block_scale_checked(float amax, const Tensor& c, float* d, float* y, uint8_t* byte) {
  block_scale<FMT>(amax, c, d, y, byte);
  return FMT == kNVFP4 ? amax <= c.bound : *byte <= 127 + 14;
}

// Codes of N values of one block (nibble t in bits 4t..4t+3). OUT: 0 nothing else, 1 their
// residues, 2 their grid sums (for residues formed later, `residue_fast`).
template <int FMT, int N, int OUT>
__device__ __forceinline__ uint32_t encode_fast(const float (&v)[N], float d, float y, float (&out)[N]) {
  uint32_t packed = 0;
#pragma unroll
  for (int t = 0; t < N; ++t) {
    const float q = FMT == kNVFP4 ? fast_div(v[t], d, y) : __fmaf_rn(v[t], y, 0.0f);
    float p;
    const float g = e2m1_sum(q, &p);
    packed = put_nibble(packed, e2m1_nibble(g, q), t);
    if (OUT == 1) {
      const float m = __fmaf_rn(p, -kMagic, g);
      out[t] = __fsub_rn(v[t], __fmul_rn(__uint_as_float(__float_as_uint(m) | (__float_as_uint(q) & 0x80000000u)), d));
    }
    if (OUT == 2) out[t] = g;
  }
  return packed;
}

// The residue of x from its grid sum g and block divisor d: x - (+-v)*d, the sign taken from x
// (the sign of q except for x = -0, where only the residue's zero sign differs, which nothing
// reads: amax takes |r| and a zero quotient is +0 either way).
__device__ __forceinline__ float residue_fast(float x, float g, float d) {
  const float v = e2m1_value(g);
  return __fsub_rn(x, __fmul_rn(__uint_as_float(__float_as_uint(v) | (__float_as_uint(x) & 0x80000000u)), d));
}

template <int FMT, int LANES, int N, int OUT>
__device__ __forceinline__ uint32_t quantize_fast(const float (&v)[N], float amax, const Tensor& c, uint8_t* byte,
                                                  float (&out)[N]) {
  float d, y;
  block_scale<FMT>(amax, c, &d, &y, byte);
  return encode_fast<FMT, N, OUT>(v, d, y, out);
}

template <int N>
__device__ __forceinline__ float abs_max(const float (&v)[N]) {
  float a = 0.0f;
#pragma unroll
  for (int t = 0; t < N; ++t) a = fmaxf(a, fabsf(v[t]));
  return a;
}

// The extension blocks of ROWS rows, quantized with the rows' residues transposed across the
// warp: the warp's rows hold 32*KS*ROWS selected residues (row by row, ascending position), and
// lane l quantizes V = KS*ROWS consecutive ones, positions l*V..l*V+V-1, so a residue block spans
// B/V lanes and each lane computes one block scale per ROWS rows instead of ROWS of them.
// `buf` is the warp's transposition buffer; `rows`: how many of the ROWS rows exist.
template <int FMT, int KS, int ROWS>
__device__ __forceinline__ void extension_fast(const Params& p, const float* buf, const int64_t row0, const int g,
                                               const int rows, const Tensor& c) {
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
  if (i >= rows || pos >= p.KE) return;
  const int64_t row = row0 + i;
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

// What a thread keeps for the whole launch.
template <int KW>
struct Thread {
  Tensor c;
  float alpha, six_alpha;
  uint32_t mask;
  int g, lane, s;  // s: SPLIT, this lane's rank in its block (it computes rows = s mod L)
  bool has_input, fast_tensor;
  int pick[KW];
  float* spill;
  float* wbuf;
  int64_t xs, cs, ss;  // row strides: input elements, code bytes, scale bytes
};

// Starts copying this thread's inputs of rows row0 .. row0 + rows - 1 into its slots of the
// shared buffer at `to` ([ROWS][kThreads] 16-byte slots; zeros past the last row or group) with
// asynchronous copies, as one commit group: no registers are held while the copy is in flight.
// xo[i]: row i's offset from row 0 in elements (precomputed: no 64-bit multiplies per row).
// FULL: all ROWS rows exist, no predicates.
template <int ROWS, bool FULL>
__device__ __forceinline__ void stage_rows(uint32_t to, const uint16_t* xp, const int64_t (&xo)[ROWS], int rows,
                                           bool has_input) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const bool live = has_input && (FULL || i < rows);
    const uint16_t* src = i == 0 ? xp : xp + xo[i];
    if (FULL) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to + i * kThreads * 16), "l"(src),
                   "r"(has_input ? 16 : 0) : "memory");
    } else {
      // a row past the last is zero-filled from a valid address (row 0 of this thread, or x)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to + i * kThreads * 16),
                   "l"(live ? src : xp), "r"(live ? 16 : 0) : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int ROWS>
__device__ __forceinline__ void read_rows(uint4 (&raw)[ROWS], const uint4* src) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i) raw[i] = src[i * kThreads + threadIdx.x];
}

// One iteration: rows row0 .. row0 + rows - 1 (FULL: rows == ROWS, known at compile time, so
// the common case carries no per-row bounds checks), from their inputs `raw`. cp, sp: this
// thread's code and scale-byte pointers at row row0 (sp: SPLIT, at row row0 + s).
template <bool BF16, int FMT, int KSEL, int ROWS, bool FULL>
__device__ __forceinline__ void iteration(const Params& p, const Thread<(KSEL > 0 && KSEL < 8 ? KSEL : 1)>& t,
                                          const int64_t row0, const int rows_left, const uint4 (&raw)[ROWS], uint8_t* cp,
                                          uint8_t* sp) {
  constexpr int B = FMT == kNVFP4 ? 16 : 32;
  constexpr int BASE_LANES = B / kGroup;
  constexpr int KW = KSEL > 0 && KSEL < 8 ? KSEL : 1;
  constexpr bool KEXT = KSEL > 0 && KSEL < 8;
  constexpr int L = BASE_LANES;
  constexpr bool SPLIT = ROWS >= L;       // the block's L lanes share its rows' scale work
  constexpr int NB = SPLIT ? ROWS / L : ROWS;  // block scales this lane computes
  const int rows = FULL ? ROWS : rows_left;
  const int s = t.s, g = t.g;

  float am[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) am[i] = packed_abs_max<BF16>(raw[i]);
  // Block amaxes: SPLIT, bm[j] of row j*L + s; else bm[i] of row i. Two lanes per block (NVFP4):
  // each lane sends its partner the half of the partner's row; four (MXFP4): every row's amax
  // is reduced over the block's lanes and each lane keeps its own row's.
  float bm[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    if (SPLIT && L == 2) {
      const float mine = s ? am[2 * j + 1] : am[2 * j], theirs = s ? am[2 * j] : am[2 * j + 1];
      bm[j] = fmaxf(mine, __shfl_xor_sync(kFull, theirs, 1));
    } else if (SPLIT) {
      float m = 0.0f;
#pragma unroll
      for (int k = 0; k < L; ++k) {
        const float r = lane_max<L>(am[j * L + k]);
        m = s == k ? r : m;
      }
      bm[j] = m;
    } else {
      bm[j] = lane_max<L>(am[j]);
    }
  }
  float dj[NB], yj[NB];
  uint8_t byte[NB];
  bool ok = t.fast_tensor;
#pragma unroll
  for (int j = 0; j < NB; ++j) ok = block_scale_checked<FMT>(bm[j], t.c, &dj[j], &yj[j], &byte[j]) && ok;
  if (!__all_sync(kFull, ok)) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
      if (FULL || i < rows) process_row<BF16, FMT, KSEL>(p, raw[i], row0 + i, g, t.has_input, t.mask, t.alpha, t.six_alpha);
    return;
  }
  float d[ROWS], y[ROWS];
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    if (SPLIT) {
      if (t.has_input && (FULL || j * L + s < rows)) sp[j * L * t.ss] = byte[j];
      // row j*L + k's divisor and reciprocal come from lane k of the block
#pragma unroll
      for (int k = 0; k < L; ++k) {
        d[j * L + k] = __shfl_sync(kFull, dj[j], (t.lane & ~(L - 1)) | k);
        y[j * L + k] = __shfl_sync(kFull, yj[j], (t.lane & ~(L - 1)) | k);
      }
    } else {
      if (t.has_input && g % L == 0 && (FULL || j < rows)) sp[j * t.ss] = byte[j];
      d[j] = dj[j];
      y[j] = yj[j];
    }
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    if (!FULL && i >= rows) break;
    float f[kGroup], r[kGroup];  // r: full, residues; K-Ext, grid sums
    unpack_group<BF16>(raw[i], f);
    const uint32_t base = encode_fast<FMT, kGroup, KSEL == 0 ? 0 : (KSEL == 8 ? 1 : 2)>(f, d[i], y[i], r);
    if (t.has_input) *reinterpret_cast<uint32_t*>(cp + i * t.cs) = base;
    if (KSEL == 8) {
      float unused[kGroup];
      uint8_t byte;
      const float ra = lane_max<BASE_LANES>(abs_max(r));
      const uint32_t res = quantize_fast<FMT, BASE_LANES, kGroup, 0>(r, ra, t.c, &byte, unused);
      if (t.has_input) {
        const int64_t row = row0 + i;
        *reinterpret_cast<uint32_t*>(p.rcodes + row * (p.K / 2) + g * 4) = res;
        if (g % BASE_LANES == 0) p.rscales[row * (p.K / B) + g / BASE_LANES] = byte;
      }
    }
    if (KEXT) {
      // The residues of the selected channels only, in ascending channel order. Each input goes
      // through this thread's slots in shared memory next to its grid sum, (x_j, g_j) pairs
      // (`pick`: each selection slot's pair; a missing bit reads a zero pair).
      float4* s4 = reinterpret_cast<float4*>(t.spill);
#pragma unroll
      for (int c = 0; c < 4; ++c) s4[c * kThreads + threadIdx.x] = make_float4(f[2 * c], r[2 * c], f[2 * c + 1], r[2 * c + 1]);
      const float2* s2 = reinterpret_cast<const float2*>(t.spill);
      float e[KW];
#pragma unroll
      for (int k = 0; k < KW; ++k) {
        const float2 xg = s2[t.pick[k]];
        e[k] = residue_fast(xg.x, xg.y, d[i]);
      }
      float* ext_row = t.wbuf + i * 32 * KW + t.lane * KW;
      if (KW == 4) *reinterpret_cast<float4*>(ext_row) = make_float4(e[0], e[KW > 1 ? 1 : 0], e[KW > 2 ? 2 : 0], e[KW > 3 ? 3 : 0]);
      else if (KW == 2) *reinterpret_cast<float2*>(ext_row) = make_float2(e[0], e[KW > 1 ? 1 : 0]);
      else ext_row[0] = e[0];
    }
  }
  if (KEXT) {
    __syncwarp();
    extension_fast<FMT, KW, ROWS>(p, t.wbuf, row0, g, rows, t.c);
    __syncwarp();  // the buffer is rewritten by the next rows
  }
}

// KSEL: channels selected per group: 0 (plain), 1/2/4 (K-Ext), 8 (full, separate outputs).
// ROWS: rows per thread and iteration; their loads are all issued before any compute, so that
// more bytes are in flight per thread. An iteration's rows take the fast path together or, when
// a block of one of them breaks its conditions anywhere in the warp, the exact path together.
// NVFP4 with ROWS >= 2 splits the base block scales over the two lanes of a block: lane parity
// s reduces the amax of rows i = s (mod 2) from both lanes' halves, computes and stores their
// scales, and the pair trades d and y for the other rows, which halves the per-block scale work
// (an exact division, the E4M3 round trip, a refined reciprocal).
template <bool BF16, int FMT, int KSEL, int ROWS>
__global__ void __launch_bounds__(kThreads) quantize_extend_kernel(const Params p) {
  constexpr int B = FMT == kNVFP4 ? 16 : 32;
  constexpr int BASE_LANES = B / kGroup;
  constexpr int KW = KSEL > 0 && KSEL < 8 ? KSEL : 1;
  constexpr bool KEXT = KSEL > 0 && KSEL < 8;
  constexpr bool SPLIT = ROWS >= BASE_LANES;
  Thread<KW> t;
  t.g = blockIdx.x * kThreads + threadIdx.x;
  t.has_input = t.g < p.K / kGroup;
  t.lane = threadIdx.x & 31;
  t.s = t.lane % BASE_LANES;
  t.alpha = FMT == kNVFP4 ? *p.alpha : 0.0f;
  t.six_alpha = __fmul_rn(6.0f, t.alpha);
  t.mask = (KEXT && t.has_input) ? p.mask[t.g] : 0u;
  t.c.alpha = t.alpha;
  t.c.six_alpha = t.six_alpha;
  t.c.y6 = FMT == kNVFP4 ? refined_reciprocal(t.six_alpha) : 0.0f;
  t.c.bound = __fmul_rn(__fmul_rn(448.0f, t.alpha), 1.2676506002282294e30f /* 2^100 */);
  t.c.y_six = refined_reciprocal(6.0f);
  t.c.rounding = p.rounding;
  // alpha in [2^-87, 36]: every NVFP4 divisor in [2^-96, 2^14] (see the fast-path notes).
  t.fast_tensor = FMT != kNVFP4 || (t.alpha >= 6.462348535570529e-27f /* 2^-87 */ && t.alpha <= 36.0f);

  // This group's selection, ascending (slot k: the k-th lowest mask bit), as float2 offsets into
  // the thread's (input, grid sum) pairs in `spill`: channel j at [2*(j/2*kThreads + tid) + j%2]
  // (the pairs of channels 2c, 2c+1 are one float4, at float4 [c*kThreads + tid]), a zero pair at
  // [8*kThreads + tid] for a missing bit.
  __shared__ __align__(16) float spill[KEXT ? 18 * kThreads : 1];
  t.spill = spill;
  {
    const int tid = threadIdx.x;
    if (KEXT) reinterpret_cast<float2*>(spill)[8 * kThreads + tid] = make_float2(0.0f, 0.0f);
    uint32_t m = t.mask;
#pragma unroll
    for (int k = 0; k < KW; ++k) {
      const int j = __ffs(m) - 1;
      m &= m - 1u;
      t.pick[k] = j < 0 ? 8 * kThreads + tid : 2 * ((j / 2) * kThreads + tid) + j % 2;
    }
  }

  // The warps' transposition buffers for the extension (see extension_fast).
  __shared__ __align__(16) float xbuf[KEXT ? kThreads * KW * ROWS : 1];
  t.wbuf = xbuf + (threadIdx.x / 32) * 32 * KW * ROWS;

  // Row pointers, advanced by whole iterations (no per-row 64-bit index arithmetic).
  const int64_t W = p.K + p.KE;
  t.xs = p.K;
  t.cs = W / 2;
  t.ss = W / B;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * ROWS, step = static_cast<int64_t>(gridDim.y) * ROWS;
  const uint16_t* xp = static_cast<const uint16_t*>(p.x) + first * t.xs + static_cast<int64_t>(t.g) * kGroup;
  uint8_t* cp = p.codes + first * t.cs + static_cast<int64_t>(t.g) * 4;
  // This lane's scale bytes: SPLIT, row j*L + s at sp + j*L*ss; else row i at sp + i*ss.
  uint8_t* sp = p.scales + first * t.ss + t.g / BASE_LANES + (SPLIT ? t.s * t.ss : 0);
  int64_t xstep = step * t.xs;
  const int64_t cstep = step * t.cs, sstep = step * t.ss;

  // Software pipelined: the next iteration's rows are copied (asynchronously, into shared memory)
  // before this one's are processed, so every warp keeps loads in flight while it computes.
  // Without it, loads were outstanding only between iterations and the kernel waited on memory
  // latency at about 2/3 of the copy rate.
  __shared__ __align__(16) uint4 stage[2 * ROWS * kThreads];
  const auto rows_at = [&](int64_t r) { return r >= p.M ? 0 : (p.M - r < ROWS ? static_cast<int>(p.M - r) : ROWS); };
  int64_t xo[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) xo[i] = i * t.xs;
  const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(stage + threadIdx.x));
  const uint32_t stage_bytes = ROWS * kThreads * 16;
  int64_t row0 = first;
  uint32_t buf = 0;  // byte offset of the buffer holding this iteration's rows
  uint4 raw[ROWS];
  // a thread without input never dereferences xp: point it at x (valid) for the zero fills
  if (!t.has_input) xp = static_cast<const uint16_t*>(p.x), xstep = 0;
  stage_rows<ROWS, false>(stage0, xp, xo, rows_at(row0), t.has_input);
  for (; row0 + ROWS <= p.M; row0 += step, cp += cstep, sp += sstep) {
    xp += xstep;
    if (row0 + step + ROWS <= p.M) stage_rows<ROWS, true>(stage0 + (buf ^ stage_bytes), xp, xo, ROWS, t.has_input);
    else stage_rows<ROWS, false>(stage0 + (buf ^ stage_bytes), xp, xo, rows_at(row0 + step), t.has_input);
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    read_rows<ROWS>(raw, stage + buf / 16);
    iteration<BF16, FMT, KSEL, ROWS, true>(p, t, row0, ROWS, raw, cp, sp);
    buf ^= stage_bytes;
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if (row0 < p.M) {
    read_rows<ROWS>(raw, stage + buf / 16);
    iteration<BF16, FMT, KSEL, ROWS, false>(p, t, row0, rows_at(row0), raw, cp, sp);
  }
}

// CTAs that fit on the device at once for this kernel (occupancy x SMs); 0 if unknown. `cache`:
// the kernel's own per-device cache (the query costs microseconds of host time per launch).
inline int resident_ctas(void (*kernel)(Params), int (&cache)[64]) {
  int dev = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (cache[dev] > 0) return cache[dev];
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess)
    return 0;
  return cache[dev] = sms * per_sm;
}

// max_ctas: > 0, at most that many CTAs; 0, one CTA per ROWS rows (no cap); < 0, as many CTAs as
// are resident at once, each looping over its rows (one wave: no partial last wave).
template <bool BF16, int FMT, int KSEL, int ROWS>
cudaError_t launch_kernel(const Params& p, int max_ctas, cudaStream_t stream) {
  void (*kernel)(Params) = quantize_extend_kernel<BF16, FMT, KSEL, ROWS>;
  static int resident[64] = {0};  // per instantiation, per device
  const int64_t iters = (p.M + ROWS - 1) / ROWS;
  const int64_t gx = (p.groups + kThreads - 1) / kThreads;
  if (max_ctas < 0) max_ctas = resident_ctas(kernel, resident);
  int64_t gy = iters < 65535 ? iters : 65535;
  if (max_ctas > 0 && gy * gx > max_ctas) gy = max_ctas / gx > 0 ? max_ctas / gx : 1;
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <bool BF16, int FMT, int ROWS>
cudaError_t launch_rows(const Params& p, int ksel, int max_ctas, cudaStream_t stream) {
  switch (ksel) {
    case 0: return launch_kernel<BF16, FMT, 0, ROWS>(p, max_ctas, stream);
    case 1: return launch_kernel<BF16, FMT, 1, ROWS>(p, max_ctas, stream);
    case 2: return launch_kernel<BF16, FMT, 2, ROWS>(p, max_ctas, stream);
    case 4: return launch_kernel<BF16, FMT, 4, ROWS>(p, max_ctas, stream);
    case 8: return launch_kernel<BF16, FMT, 8, ROWS>(p, max_ctas, stream);
    default: return cudaErrorInvalidValue;
  }
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
