// Scalar number formats shared bit-for-bit by the CPU and CUDA kernels.
//
// Every conversion here rounds to nearest, ties to even, exactly like IEEE hardware conversions
// (x86 F16C, CUDA's __float2half_rn) and like torch's own casts. Keeping one definition for both
// back ends is what makes the CPU kernels a bitwise twin of the CUDA ones, for every finite value,
// infinity and signed zero. NaN stays NaN, but where a kernel stores through the hardware's own
// conversion its sign and payload are the hardware's (CUDA's canonical 0x7fff, F16C's quieted
// input), so NaN bits are not part of the twin contract; the ring's sums are (hop_sum).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GS_HD __host__ __device__ __forceinline__
#else
#define GS_HD inline
#endif

namespace gradsync {

// Element types a kernel reads or writes. Values are part of the Python binding (gradsync/_C).
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

GS_HD int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

GS_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

GS_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// A ring hop's sum, decoded + mine, with one NaN for every NaN: which operand's NaN an addition
// returns is up to the instruction set (and the compiler's operand order), and on GPUs it is always
// a canonical one, so the sum's NaN is fixed here for every twin to encode the same bits.
GS_HD float hop_sum(float decoded, float mine) {
  const float s = decoded + mine;
  return s != s ? bits_float(0x7fc00000u) : s;
}

// 2^k as a float, exact for -126 <= k <= 127.
GS_HD float pow2(int k) { return bits_float(static_cast<uint32_t>(127 + k) << 23); }

GS_HD bool is_finite_bits(uint32_t abs_bits) { return abs_bits < 0x7f800000u; }

// Error feedback's residual of one element: what encoding `sum` lost, or 0 where that is not
// finite (an overflowed step must not poison the steps after it).
GS_HD float feedback_residual(float sum, float decoded) {
  const float r = sum - decoded;
  return is_finite_bits(float_bits(r) & 0x7fffffffu) ? r : 0.0f;
}

// Error feedback's residual where a sum is not encoded but stored, times postscale, into a 16-bit
// tensor (a reduce-scatter's own chunk): that rounding is the one encoding the sum gets.
GS_HD float store_residual(float sum, float stored, float postscale) {
  return feedback_residual(sum, stored / postscale);
}

// Rounds a finite, non-negative float (given as bits) to a binary format with E exponent bits and
// M mantissa bits (IEEE-style bias, subnormals, no sign) and returns its code. The code may exceed
// the format's largest finite code: callers decide between saturation and infinity.
template <int E, int M>
GS_HD uint32_t round_to_minifloat(uint32_t abs_bits) {
  constexpr int kBias = (1 << (E - 1)) - 1;
  constexpr int kMinExp = 1 - kBias;
  int exp = static_cast<int>(abs_bits >> 23) - 127;
  uint32_t man = abs_bits & 0x7fffffu;
  if (abs_bits >> 23) {
    man |= 0x800000u;
  } else {
    exp = -126;  // fp32 subnormal
  }
  const int target_exp = exp > kMinExp ? exp : kMinExp;
  const int shift = 23 - M + (target_exp - exp);
  if (shift > 24) return 0;  // below half the smallest subnormal
  uint32_t q = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  q += (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
  // q counts units of 2^(target_exp - M) including the implicit bit, so adding it to the biased
  // exponent field carries into the exponent on mantissa overflow.
  return (static_cast<uint32_t>(target_exp + kBias - 1) << M) + q;
}

// Decodes an unsigned minifloat code that is finite in its format.
template <int E, int M>
GS_HD float minifloat_to_float(uint32_t code) {
  constexpr int kBias = (1 << (E - 1)) - 1;
  const uint32_t exp = code >> M;
  const uint32_t man = code & ((1u << M) - 1u);
  if (exp == 0) return static_cast<float>(man) * pow2(1 - kBias - M);
  return bits_float(((exp + 127 - kBias) << 23) | (man << (23 - M)));
}

// ---- fp16 (IEEE binary16) ----
GS_HD uint16_t float_to_half_bits(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (!is_finite_bits(abs)) return static_cast<uint16_t>(sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u));
  uint32_t code = round_to_minifloat<5, 10>(abs);
  if (code > 0x7c00u) code = 0x7c00u;  // overflow rounds to infinity
  return static_cast<uint16_t>(sign | code);
}

GS_HD float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t abs = h & 0x7fffu;
  if (abs >= 0x7c00u) return bits_float(sign | 0x7f800000u | ((abs & 0x3ffu) << 13));
  return bits_float(sign | float_bits(minifloat_to_float<5, 10>(abs)));
}

// ---- bf16 ---- (NaN becomes 0x7fc0, as in torch)
GS_HD uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

GS_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// ---- fp8 ----
// e4m3 ("fn": no infinity, 0x7f/0xff are NaN, largest finite 448) and e5m2 (IEEE-like, largest
// finite 57344). Finite values beyond the largest finite saturate; the block-scaled codec never
// produces such values. Non-finite inputs map explicitly: NaN of either sign to the code 0x7f, and
// infinity to infinity where the format has one (e5m2) or to NaN of its sign where it has not (e4m3),
// so that overflow stays visible.
enum class Fp8Format : int32_t { kE4M3 = 0, kE5M2 = 1 };

template <Fp8Format F>
struct Fp8Traits;
template <>
struct Fp8Traits<Fp8Format::kE4M3> {
  static constexpr int kExpBits = 4, kManBits = 3;
  static constexpr uint32_t kMaxCode = 0x7e, kNanCode = 0x7f, kInfCode = 0x7f;
  static constexpr float kMax = 448.0f;
  static constexpr int kMaxFrexpExp = 9;  // 448 = 0.875 * 2^9
};
template <>
struct Fp8Traits<Fp8Format::kE5M2> {
  static constexpr int kExpBits = 5, kManBits = 2;
  static constexpr uint32_t kMaxCode = 0x7b, kNanCode = 0x7f, kInfCode = 0x7c;
  static constexpr float kMax = 57344.0f;
  static constexpr int kMaxFrexpExp = 16;  // 57344 = 0.875 * 2^16
};

// `max_code` lowers the saturation point (see fp8_block_max_code).
template <Fp8Format F>
GS_HD uint8_t float_to_fp8(float f, uint32_t max_code = Fp8Traits<F>::kMaxCode) {
  using T = Fp8Traits<F>;
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t abs = x & 0x7fffffffu;
  // NaN takes one code whatever its sign: a GPU multiply returns a canonical positive NaN where x86
  // keeps the operand's sign, and every device must encode the same input to the same bytes
  if (!is_finite_bits(abs)) return static_cast<uint8_t>(abs == 0x7f800000u ? sign | T::kInfCode : T::kNanCode);
  uint32_t code = round_to_minifloat<T::kExpBits, T::kManBits>(abs);
  if (code > max_code) code = max_code;
  return static_cast<uint8_t>(sign | code);
}

template <Fp8Format F>
GS_HD float fp8_to_float(uint8_t q) {
  using T = Fp8Traits<F>;
  const uint32_t sign = static_cast<uint32_t>(q & 0x80u) << 24;
  const uint32_t abs = q & 0x7fu;
  if (abs == T::kNanCode || (F == Fp8Format::kE5M2 && abs > T::kInfCode)) return bits_float(sign | 0x7fc00000u);
  if (F == Fp8Format::kE5M2 && abs == T::kInfCode) return bits_float(sign | 0x7f800000u);
  return bits_float(sign | float_bits(minifloat_to_float<T::kExpBits, T::kManBits>(abs)));
}

// The block scale exponent k: the largest power of two with absmax * 2^k <= the format's largest
// finite value, clamped to [-126, 126] so that 2^k and 2^-k are both normal floats. Power-of-two
// scales make scaling exact, so encode and decode round exactly once, in the fp8 cast.
template <Fp8Format F>
GS_HD int fp8_block_exponent(float absmax) {
  const uint32_t bits = float_bits(absmax);
  const uint32_t exp_field = bits >> 23;
  if (absmax == 0.0f) return 0;
  if (exp_field == 0) return 126;  // subnormal absmax
  const int frexp_exp = static_cast<int>(exp_field) - 126;  // absmax = m * 2^frexp_exp, m in [0.5, 1)
  const bool fits = (bits & 0x7fffffu) <= 0x600000u;         // m <= 0.875
  int k = Fp8Traits<F>::kMaxFrexpExp - (fits ? 0 : 1) - frexp_exp;
  return k < -126 ? -126 : (k > 126 ? 126 : k);
}

// The largest code whose value times the decode scale 2^-k is still a finite float. It is the
// format's largest code except when the block's absmax lies within a few binades of FLT_MAX, where
// rounding up would otherwise decode to infinity.
template <Fp8Format F>
GS_HD uint32_t fp8_block_max_code(int k) {
  using T = Fp8Traits<F>;
  const float limit = 3.40282347e38f * pow2(k);  // exact: k >= -126
  if (limit >= T::kMax) return T::kMaxCode;
  uint32_t code = round_to_minifloat<T::kExpBits, T::kManBits>(float_bits(limit));
  if (minifloat_to_float<T::kExpBits, T::kManBits>(code) > limit) --code;
  return code;
}

}  // namespace gradsync
