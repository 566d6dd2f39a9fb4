// CPU codecs: scale-and-cast between float32/float16/bfloat16 and the block-scaled fp8 codec.
// A portable scalar path defines the semantics (numerics.h); an AVX2+F16C path, chosen at run
// time, produces the same bits.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "codec.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GS_HAVE_X86 1
#define GS_AVX2 __attribute__((target("avx2,f16c,fma")))
#endif

namespace gradsync {
namespace {

enum class Isa : int { kScalar = 0, kAvx2 = 1 };

bool cpu_has_avx2() {
#ifdef GS_HAVE_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

std::atomic<int> g_isa{static_cast<int>(cpu_has_avx2() ? Isa::kAvx2 : Isa::kScalar)};

bool use_avx2() { return g_isa.load(std::memory_order_relaxed) == static_cast<int>(Isa::kAvx2); }

inline float load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat16: return half_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_float(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(p)[i] = v; break;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = float_to_half_bits(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v); break;
  }
}

void convert_scalar(const void* src, DType st, void* dst, DType dt, int64_t begin, int64_t end, float scale) {
  for (int64_t i = begin; i < end; ++i) store_float(dst, dt, i, load_float(src, st, i) * scale);
}

void reduce_cast_scalar(const void* in, DType wt, const void* local, DType lt, int64_t begin, int64_t end,
                        float prescale, void* out) {
  for (int64_t i = begin; i < end; ++i) store_float(out, wt, i, hop_sum(load_float(in, wt, i), load_float(local, lt, i) * prescale));
}

void reduce_cast_feedback_scalar(const void* in, DType wt, const void* local, DType lt, int64_t begin, int64_t end,
                                 float prescale, float* residual, void* out) {
  for (int64_t i = begin; i < end; ++i) {
    float sum = load_float(local, lt, i) * prescale;
    if (in) sum = hop_sum(load_float(in, wt, i), sum);
    sum = hop_sum(sum, residual[i]);
    store_float(out, wt, i, sum);
    residual[i] = feedback_residual(sum, load_float(out, wt, i));
  }
}

template <Fp8Format F>
struct Fp8DecodeTable {
  float value[256];
  Fp8DecodeTable() {
    for (int q = 0; q < 256; ++q) value[q] = fp8_to_float<F>(static_cast<uint8_t>(q));
  }
};

template <Fp8Format F>
const float* fp8_table() {
  static const Fp8DecodeTable<F> table;
  return table.value;
}

template <Fp8Format F>
void fp8_values_scalar(const uint8_t* codes, int64_t n, float decode_scale, float* out) {
  const float* table = fp8_table<F>();
  for (int64_t i = 0; i < n; ++i) out[i] = table[codes[i]] * decode_scale;
}

float absmax_finite_scalar(const float* v, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i]);
    if (a <= 3.40282347e38f) m = std::max(m, a);  // skips Inf and NaN
  }
  return m;
}

// A block of fp32 values ready to encode: its finite absmax, and whether every value is finite
// (then its codes need no special cases).
struct BlockSum {
  float absmax;
  bool all_finite;
};

// From the largest magnitude, as bits, of out[0, i) and the values of out[i, n).
inline BlockSum block_sum(uint32_t top, const float* out, int64_t i, int64_t n) {
  for (; i < n; ++i) top = std::max(top, float_bits(out[i]) & 0x7fffffffu);
  if (is_finite_bits(top)) return {bits_float(top), true};
  return {absmax_finite_scalar(out, n), false};
}

template <Fp8Format F>
void fp8_codes_scalar(const float* v, int64_t n, float mul, uint32_t max_code, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_fp8<F>(v[i] * mul, max_code);
}

// The loops over a gradient prefetch it this far ahead: on the machine measured the hardware
// prefetcher alone left a source read from DRAM waiting (the fp16 hop of 16M elements, one thread:
// 0.58-0.60 -> 0.47-0.48 ns per element), and it does not cross 4 KB pages.
constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch_ahead(const void* base, DType t, int64_t i, int64_t n) {
  const int64_t ahead = i + kPrefetchBytes / dtype_size(t);
  if (ahead < n) __builtin_prefetch(static_cast<const char*>(base) + ahead * dtype_size(t));
}

#ifdef GS_HAVE_X86
template <DType T>
GS_AVX2 inline __m256 load8(const void* p, int64_t i) {
  if constexpr (T == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (T == DType::kFloat16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Eight lanes of hop_sum (numerics.h).
GS_AVX2 inline __m256 hop_sum8(__m256 decoded, __m256 mine) {
  const __m256 s = _mm256_add_ps(decoded, mine);
  return _mm256_blendv_ps(s, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_cmp_ps(s, s, _CMP_UNORD_Q));
}

// Packs the low 16 bits of eight 32-bit lanes (each < 2^16) into eight uint16.
GS_AVX2 inline __m128i pack_u32_to_u16(__m256i x) {
  const __m256i packed = _mm256_packus_epi32(x, x);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xd8));
}

// Eight lanes as eight T (float16 or bfloat16), rounded to nearest even.
template <DType T>
GS_AVX2 inline __m128i narrow8(__m256 v) {
  if constexpr (T == DType::kFloat16) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    return pack_u32_to_u16(r);
  }
}

template <DType T>
GS_AVX2 inline void store8(void* p, int64_t i, __m256 v) {
  if constexpr (T == DType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, v);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), narrow8<T>(v));
  }
}

// Results of at least this many elements are written with non-temporal stores unless the caller
// reads them again at once: a decoded gradient or a flattened bucket is not read again before it has
// left the cache, and streaming it skips reading each line before writing it (measured here:
// 1-to-4-byte expansion 0.57 -> 0.35 ns per element; 4-to-2-byte 10-20 % faster).
constexpr int64_t kStreamMinElems = 1 << 14;

GS_AVX2 inline bool streams_to(const void* dst, int size, int64_t n) {
  return n >= kStreamMinElems && reinterpret_cast<uintptr_t>(dst) % size == 0;
}

// Elements of `size` bytes before `dst + i` is 32-byte aligned (dst is `size`-aligned).
inline int64_t to_alignment(const void* dst, int size = 4) {
  return (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32 / size;
}

// dst[i..] = src[i..] * scale through non-temporal stores, whole vectors from i (dst + i 32-byte
// aligned); returns where the vectors stopped. The caller fences once it has written everything.
template <DType S>
GS_AVX2 inline int64_t stream_scaled_from(const void* src, float* dst, int64_t i, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(src, S, i, n);
    _mm256_stream_ps(dst + i, _mm256_mul_ps(load8<S>(src, i), s));
    _mm256_stream_ps(dst + i + 8, _mm256_mul_ps(load8<S>(src, i + 8), s));
  }
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_mul_ps(load8<S>(src, i), s));
  return i;
}

template <DType S, DType D>
GS_AVX2 void convert_avx2_t(const void* src, void* dst, int64_t n, float scale, bool cache_result) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  if (!cache_result && streams_to(dst, dtype_size(D), n)) {
    const int64_t head = to_alignment(dst, dtype_size(D));
    convert_scalar(src, S, dst, D, 0, head, scale);
    if constexpr (D == DType::kFloat32) {
      i = stream_scaled_from<S>(src, static_cast<float*>(dst), head, n, scale);
    } else {
      for (i = head; i + 16 <= n; i += 16) {
        prefetch_ahead(src, S, i, n);
        const __m128i low = narrow8<D>(_mm256_mul_ps(load8<S>(src, i), s));
        const __m128i high = narrow8<D>(_mm256_mul_ps(load8<S>(src, i + 8), s));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i), _mm256_set_m128i(high, low));
      }
    }
    convert_scalar(src, S, dst, D, i, n, scale);
    _mm_sfence();  // the streamed lines reach memory before anything this thread does next
    return;
  }
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(src, S, i, n);
    store8<D>(dst, i, _mm256_mul_ps(load8<S>(src, i), s));
    store8<D>(dst, i + 8, _mm256_mul_ps(load8<S>(src, i + 8), s));
  }
  for (; i + 8 <= n; i += 8) store8<D>(dst, i, _mm256_mul_ps(load8<S>(src, i), s));
  convert_scalar(src, S, dst, D, i, n, scale);
}

template <DType S>
GS_AVX2 void convert_avx2_from(const void* src, void* dst, DType dt, int64_t n, float scale, bool cache_result) {
  switch (dt) {
    case DType::kFloat32: return convert_avx2_t<S, DType::kFloat32>(src, dst, n, scale, cache_result);
    case DType::kFloat16: return convert_avx2_t<S, DType::kFloat16>(src, dst, n, scale, cache_result);
    default: return convert_avx2_t<S, DType::kBFloat16>(src, dst, n, scale, cache_result);
  }
}

GS_AVX2 inline void convert_avx2(const void* src, DType st, void* dst, DType dt, int64_t n, float scale,
                                 bool cache_result) {
  switch (st) {
    case DType::kFloat32: return convert_avx2_from<DType::kFloat32>(src, dst, dt, n, scale, cache_result);
    case DType::kFloat16: return convert_avx2_from<DType::kFloat16>(src, dst, dt, n, scale, cache_result);
    default: return convert_avx2_from<DType::kBFloat16>(src, dst, dt, n, scale, cache_result);
  }
}

template <DType W, DType L>
GS_AVX2 void reduce_cast_avx2_t(const void* in, const void* local, int64_t n, float prescale, void* out) {
  const __m256 s = _mm256_set1_ps(prescale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(local, L, i, n);
    store8<W>(out, i, hop_sum8(load8<W>(in, i), _mm256_mul_ps(load8<L>(local, i), s)));
    store8<W>(out, i + 8, hop_sum8(load8<W>(in, i + 8), _mm256_mul_ps(load8<L>(local, i + 8), s)));
  }
  for (; i + 8 <= n; i += 8) {
    store8<W>(out, i, hop_sum8(load8<W>(in, i), _mm256_mul_ps(load8<L>(local, i), s)));
  }
  reduce_cast_scalar(in, W, local, L, i, n, prescale, out);
}

template <DType W>
GS_AVX2 void reduce_cast_avx2_wire(const void* in, const void* local, DType lt, int64_t n, float prescale, void* out) {
  switch (lt) {
    case DType::kFloat32: return reduce_cast_avx2_t<W, DType::kFloat32>(in, local, n, prescale, out);
    case DType::kFloat16: return reduce_cast_avx2_t<W, DType::kFloat16>(in, local, n, prescale, out);
    default: return reduce_cast_avx2_t<W, DType::kBFloat16>(in, local, n, prescale, out);
  }
}

GS_AVX2 void reduce_cast_avx2(const void* in, DType wt, const void* local, DType lt, int64_t n, float prescale,
                              void* out) {
  switch (wt) {
    case DType::kFloat32: return reduce_cast_avx2_wire<DType::kFloat32>(in, local, lt, n, prescale, out);
    case DType::kFloat16: return reduce_cast_avx2_wire<DType::kFloat16>(in, local, lt, n, prescale, out);
    default: return reduce_cast_avx2_wire<DType::kBFloat16>(in, local, lt, n, prescale, out);
  }
}

// Eight lanes of feedback_residual (numerics.h).
GS_AVX2 inline __m256 feedback_residual8(__m256 sum, __m256 decoded) {
  const __m256 r = _mm256_sub_ps(sum, decoded);
  const __m256 a = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u))), r);
  return _mm256_and_ps(r, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
}

template <DType W, DType L, bool kIn>
GS_AVX2 void reduce_cast_feedback_avx2_t(const void* in, const void* local, int64_t n, float prescale, float* residual,
                                         void* out) {
  const __m256 s = _mm256_set1_ps(prescale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 16 == 0) {
      prefetch_ahead(local, L, i, n);
      prefetch_ahead(residual, DType::kFloat32, i, n);
    }
    const __m256 mine = _mm256_mul_ps(load8<L>(local, i), s);
    const __m256 sum = hop_sum8(kIn ? hop_sum8(load8<W>(in, i), mine) : mine, _mm256_loadu_ps(residual + i));
    store8<W>(out, i, sum);
    _mm256_storeu_ps(residual + i, feedback_residual8(sum, load8<W>(out, i)));
  }
  reduce_cast_feedback_scalar(in, W, local, L, i, n, prescale, residual, out);
}

template <DType W, DType L>
GS_AVX2 void reduce_cast_feedback_avx2_local(const void* in, const void* local, int64_t n, float prescale,
                                             float* residual, void* out) {
  if (in) return reduce_cast_feedback_avx2_t<W, L, true>(in, local, n, prescale, residual, out);
  reduce_cast_feedback_avx2_t<W, L, false>(in, local, n, prescale, residual, out);
}

template <DType W>
GS_AVX2 void reduce_cast_feedback_avx2_wire(const void* in, const void* local, DType lt, int64_t n, float prescale,
                                            float* residual, void* out) {
  switch (lt) {
    case DType::kFloat32: return reduce_cast_feedback_avx2_local<W, DType::kFloat32>(in, local, n, prescale, residual, out);
    case DType::kFloat16: return reduce_cast_feedback_avx2_local<W, DType::kFloat16>(in, local, n, prescale, residual, out);
    default: return reduce_cast_feedback_avx2_local<W, DType::kBFloat16>(in, local, n, prescale, residual, out);
  }
}

GS_AVX2 void reduce_cast_feedback_avx2(const void* in, DType wt, const void* local, DType lt, int64_t n,
                                       float prescale, float* residual, void* out) {
  switch (wt) {
    case DType::kFloat32: return reduce_cast_feedback_avx2_wire<DType::kFloat32>(in, local, lt, n, prescale, residual, out);
    case DType::kFloat16: return reduce_cast_feedback_avx2_wire<DType::kFloat16>(in, local, lt, n, prescale, residual, out);
    default: return reduce_cast_feedback_avx2_wire<DType::kBFloat16>(in, local, lt, n, prescale, residual, out);
  }
}

// Eight lanes of float_to_fp8<F> (numerics.h), branch-free, as eight bytes. The FPU rounds: adding
// and subtracting C = 2^(e + 23 - M), e the lane's exponent (at least the format's smallest normal
// one), rounds |v| to nearest-even on the format's grid. The rounded value times 2^(bias - 15) is
// then exact in fp16, whose bits hold the fp8 code's exponent and mantissa fields in place (fp8
// subnormals land on fp16 subnormals), so F16C's conversion reads the code off.
template <Fp8Format F, bool kAllFinite>
GS_AVX2 inline __m128i fp8_codes8(__m256 v, __m256 max_value) {
  using T = Fp8Traits<F>;
  constexpr int kBias = (1 << (T::kExpBits - 1)) - 1;
  constexpr int kM = T::kManBits;
  const __m256i x = _mm256_castps_si256(v);
  const __m256i abs_bits = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256 a = _mm256_min_ps(_mm256_castsi256_ps(abs_bits), _mm256_set1_ps(T::kMax));
  const __m256i exp = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7f800000)),
                                       _mm256_set1_epi32((127 + 1 - kBias) << 23));
  const __m256 magic = _mm256_castsi256_ps(_mm256_add_epi32(exp, _mm256_set1_epi32((23 - kM) << 23)));
  __m256 r = _mm256_min_ps(_mm256_sub_ps(_mm256_add_ps(a, magic), magic), max_value);
  if constexpr (kAllFinite) {
    r = _mm256_or_ps(r, _mm256_castsi256_ps(_mm256_andnot_si256(abs_bits, x)));  // sign
  } else {
    // non-finite lanes take a value whose code is the special one: e4m3's NaN code is 480's slot;
    // e5m2's infinity and NaN codes are fp16's own
    __m256 special;
    if constexpr (F == Fp8Format::kE4M3) {
      special = _mm256_set1_ps(480.0f);
    } else {
      special = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7fe00000)), _mm256_set1_ps(INFINITY),
                                 _mm256_castsi256_ps(_mm256_cmpeq_epi32(abs_bits, _mm256_set1_epi32(0x7f800000))));
    }
    r = _mm256_blendv_ps(r, special, _mm256_castsi256_ps(_mm256_cmpgt_epi32(abs_bits, _mm256_set1_epi32(0x7f7fffff))));
    const __m256i nan_lanes = _mm256_cmpgt_epi32(abs_bits, _mm256_set1_epi32(0x7f800000));
    r = _mm256_or_ps(r, _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_or_si256(abs_bits, nan_lanes), x)));  // sign; NaN: none
  }
  if constexpr (kBias != 15) r = _mm256_mul_ps(r, _mm256_set1_ps(pow2(kBias - 15)));
  const __m128i half = _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if constexpr (kM == 2) {
    const __m128i code = _mm_srli_epi16(half, 8);
    return _mm_packus_epi16(code, code);
  } else {
    // fp16's sign lands one bit above the code's: each lane is now the bytes (magnitude, sign), and
    // magnitude - 128 * sign is the signed byte whose bits are the code
    const __m128i code = _mm_maddubs_epi16(_mm_srli_epi16(half, 10 - kM), _mm_set1_epi16(static_cast<int16_t>(0x8001)));
    return _mm_packs_epi16(code, code);
  }
}

// Eight values(codes) * decode_scale. The code, placed in an fp16's bits (e5m2 is fp16's top byte;
// e4m3's fields sit one bit lower and are rebiased by an exact multiply), is widened by F16C;
// NaN codes become the same NaN bits as the scalar path's. kNoSpecial: the caller knows there are
// none, and passes the scale with the rebiasing folded in (half_decode_scale).
template <Fp8Format F, bool kNoSpecial = false>
GS_AVX2 inline __m256 fp8_values8(const uint8_t* codes, __m256 decode_scale) {
  const __m128i high = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256 sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  __m256 v, nan_lanes;
  if constexpr (F == Fp8Format::kE5M2) {
    v = _mm256_cvtph_ps(high);
    if constexpr (kNoSpecial) return _mm256_mul_ps(v, decode_scale);
    nan_lanes = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  } else {
    // sign stays, the fields move one bit down: the arithmetic shift copies the sign, the mask drops the copy
    const __m128i half = _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
    if constexpr (kNoSpecial) return _mm256_mul_ps(_mm256_cvtph_ps(half), decode_scale);
    v = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
    nan_lanes = _mm256_cmp_ps(_mm256_andnot_ps(sign_mask, v), _mm256_set1_ps(480.0f), _CMP_EQ_OQ);
  }
  const __m256 nan = _mm256_or_ps(_mm256_and_ps(v, sign_mask), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
  return _mm256_mul_ps(_mm256_blendv_ps(v, nan, nan_lanes), decode_scale);
}

// decode_scale times e4m3's rebiasing factor 256 (e5m2 needs none): multiplying by the product
// gives the bits of multiplying by the factors in turn, as the first is exact, unless the product
// overflows; then this returns false and the caller takes the general path.
template <Fp8Format F>
inline bool half_decode_scale(float decode_scale, float* out) {
  *out = F == Fp8Format::kE4M3 ? decode_scale * 256.0f : decode_scale;
  return std::fabs(*out) <= 3.40282347e38f || !(std::fabs(decode_scale) <= 3.40282347e38f);
}

// Whether a whole block's codes include a special one: NaN (e4m3), infinity or NaN (e5m2).
template <Fp8Format F>
GS_AVX2 inline bool has_special_codes(const uint8_t* codes) {
  const __m256i field = _mm256_set1_epi8(F == Fp8Format::kE4M3 ? 0x7f : 0x7c);
  __m256i any = _mm256_setzero_si256();
  for (int i = 0; i < kFp8BlockSize; i += 32) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_and_si256(c, field), field));
  }
  return !_mm256_testz_si256(any, any);
}

template <Fp8Format F>
GS_AVX2 inline void fp8_values_avx2(const uint8_t* codes, int64_t n, float decode_scale, float* out) {
  const __m256 d = _mm256_set1_ps(decode_scale);
  int64_t i = 0;
  float hd = 0.0f;
  if (n == kFp8BlockSize && half_decode_scale<F>(decode_scale, &hd) && !has_special_codes<F>(codes)) {
    const __m256 h = _mm256_set1_ps(hd);
    for (; i < n; i += 8) _mm256_storeu_ps(out + i, fp8_values8<F, true>(codes + i, h));
    return;
  }
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, fp8_values8<F>(codes + i, d));
  fp8_values_scalar<F>(codes + i, n - i, decode_scale, out + i);
}

// The fp16 bits of eight lanes v = x * 2^(bias - 15), x finite and at most the format's largest
// value in magnitude, rounded to the format: on this scale the format's grid is fp16's exponent
// range with M mantissa bits, so one rounding constant serves every lane and nothing is clamped.
template <Fp8Format F>
GS_AVX2 inline __m128i fp8_halves_finite8(__m256 v) {
  constexpr int kM = Fp8Traits<F>::kManBits;
  const __m256i x = _mm256_castps_si256(v);
  const __m256i abs_bits = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256i exp = _mm256_max_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f800000)),
                                       _mm256_set1_epi32((127 - 14) << 23));
  const __m256 magic = _mm256_castsi256_ps(_mm256_add_epi32(exp, _mm256_set1_epi32((23 - kM) << 23)));
  __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(abs_bits), magic), magic);
  r = _mm256_or_ps(r, _mm256_castsi256_ps(_mm256_andnot_si256(abs_bits, x)));  // sign
  return _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Sixteen codes from the fp16 bits of fp8_halves_finite8, as in fp8_codes8.
template <Fp8Format F>
GS_AVX2 inline __m128i fp8_codes16(__m128i low, __m128i high) {
  constexpr int kM = Fp8Traits<F>::kManBits;
  if constexpr (kM == 2) return _mm_packus_epi16(_mm_srli_epi16(low, 8), _mm_srli_epi16(high, 8));
  const __m128i sign_weights = _mm_set1_epi16(static_cast<int16_t>(0x8001));
  return _mm_packs_epi16(_mm_maddubs_epi16(_mm_srli_epi16(low, 10 - kM), sign_weights),
                         _mm_maddubs_epi16(_mm_srli_epi16(high, 10 - kM), sign_weights));
}

template <Fp8Format F, bool kAllFinite>
GS_AVX2 inline void fp8_codes_avx2(const float* v, int64_t n, float mul, uint32_t max_code, uint8_t* out) {
  using T = Fp8Traits<F>;
  constexpr int kBias = (1 << (T::kExpBits - 1)) - 1;
  int64_t i = 0;
  // Finite blocks take the short loop, all but those whose saturation point is lowered (absmax
  // above 1.75 * 2^127) and those whose multiplier would be subnormal (e4m3 blocks of absmax above
  // 1.75 * 2^126), which denormals treated as zero (torch.set_flush_denormal) would make zero. A
  // product the multiplier leaves subnormal rounds to code zero either way.
  const float half_mul = mul * pow2(kBias - 15);
  if (kAllFinite && max_code == T::kMaxCode && half_mul >= std::numeric_limits<float>::min()) {
    const __m256 hm = _mm256_set1_ps(half_mul);
    for (; i + 16 <= n; i += 16) {
      const __m128i low = fp8_halves_finite8<F>(_mm256_mul_ps(_mm256_loadu_ps(v + i), hm));
      const __m128i high = fp8_halves_finite8<F>(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8), hm));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), fp8_codes16<F>(low, high));
    }
  }
  const __m256 m = _mm256_set1_ps(mul);
  const __m256 max_value = _mm256_set1_ps(minifloat_to_float<T::kExpBits, T::kManBits>(max_code));
  for (; i + 8 <= n; i += 8) {
    const __m128i codes = fp8_codes8<F, kAllFinite>(_mm256_mul_ps(_mm256_loadu_ps(v + i), m), max_value);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), codes);
  }
  fp8_codes_scalar<F>(v + i, n - i, mul, max_code, out + i);
}

GS_AVX2 inline __m256 max_finite_abs(__m256 m, __m256 v) {
  const __m256 a = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u))), v);
  return _mm256_max_ps(m, _mm256_and_ps(a, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ)));
}

GS_AVX2 inline __m256i abs_bits8(__m256 v) { return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff)); }

GS_AVX2 inline uint32_t horizontal_max_u32(__m256i m) {
  __m128i x = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4e));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(x));
}

GS_AVX2 inline float horizontal_max(__m256 m) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  return *std::max_element(lanes, lanes + 8);
}

// One fp8 block's out = src * scale and its BlockSum, from the largest magnitude as bits (unsigned
// order is magnitude order, and infinities and NaNs come above every finite value).
template <DType S>
GS_AVX2 inline BlockSum convert_absmax_avx2_t(const void* src, int64_t n, float scale, float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(load8<S>(src, i), s);
    _mm256_storeu_ps(out + i, v);
    m = _mm256_max_epu32(m, abs_bits8(v));
  }
  convert_scalar(src, S, out, DType::kFloat32, i, n, scale);
  return block_sum(horizontal_max_u32(m), out, i, n);
}

GS_AVX2 inline BlockSum convert_absmax_avx2(const void* src, DType st, int64_t n, float scale, float* out) {
  switch (st) {
    case DType::kFloat32: return convert_absmax_avx2_t<DType::kFloat32>(src, n, scale, out);
    case DType::kFloat16: return convert_absmax_avx2_t<DType::kFloat16>(src, n, scale, out);
    default: return convert_absmax_avx2_t<DType::kBFloat16>(src, n, scale, out);
  }
}

// One block's summand into out: [values(codes) * decode_scale +] local * prescale [+ residual],
// each addition a hop_sum. A block without special codes whose sums are all finite takes a loop with
// none of NaN's special cases; anything else is redone on the full one.
template <Fp8Format F, DType L, bool kIn, bool kResidual>
GS_AVX2 inline BlockSum fp8_block_sum_avx2_t(const uint8_t* codes, float decode_scale, const void* local,
                                             float prescale, const float* residual, int64_t n, float* out) {
  const __m256 d = _mm256_set1_ps(decode_scale);
  const __m256 s = _mm256_set1_ps(prescale);
  float hd = 0.0f;
  if (n == kFp8BlockSize && !(kIn && (!half_decode_scale<F>(decode_scale, &hd) || has_special_codes<F>(codes)))) {
    const __m256 h = _mm256_set1_ps(hd);
    __m256i top = _mm256_setzero_si256();
    for (int64_t i = 0; i < n; i += 8) {
      __m256 v = _mm256_mul_ps(load8<L>(local, i), s);
      if constexpr (kIn) v = _mm256_add_ps(fp8_values8<F, true>(codes + i, h), v);
      if constexpr (kResidual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + i));
      _mm256_storeu_ps(out + i, v);
      top = _mm256_max_epu32(top, abs_bits8(v));
    }
    const uint32_t bits = horizontal_max_u32(top);
    if (is_finite_bits(bits)) return {bits_float(bits), true};
  }
  __m256 m = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(load8<L>(local, i), s);
    if constexpr (kIn) v = hop_sum8(fp8_values8<F>(codes + i, d), v);
    if constexpr (kResidual) v = hop_sum8(v, _mm256_loadu_ps(residual + i));
    _mm256_storeu_ps(out + i, v);
    m = max_finite_abs(m, v);
  }
  for (int64_t j = i; j < n; ++j) {
    float v = load_float(local, L, j) * prescale;
    if constexpr (kIn) v = hop_sum(fp8_to_float<F>(codes[j]) * decode_scale, v);
    if constexpr (kResidual) v = hop_sum(v, residual[j]);
    out[j] = v;
  }
  return {std::max(horizontal_max(m), absmax_finite_scalar(out + i, n - i)), false};
}

template <Fp8Format F, DType L, bool kResidual>
GS_AVX2 inline BlockSum fp8_block_sum_avx2_local(const uint8_t* codes, float decode_scale, const void* local,
                                                 float prescale, const float* residual, int64_t n, float* out) {
  if (codes) return fp8_block_sum_avx2_t<F, L, true, kResidual>(codes, decode_scale, local, prescale, residual, n, out);
  return fp8_block_sum_avx2_t<F, L, false, kResidual>(codes, decode_scale, local, prescale, residual, n, out);
}

// codes == nullptr: no incoming payload; residual == nullptr: no error feedback.
template <Fp8Format F, bool kResidual>
GS_AVX2 inline BlockSum fp8_block_sum_avx2(const uint8_t* codes, float decode_scale, const void* local, DType lt,
                                           float prescale, const float* residual, int64_t n, float* out) {
  switch (lt) {
    case DType::kFloat32:
      return fp8_block_sum_avx2_local<F, DType::kFloat32, kResidual>(codes, decode_scale, local, prescale, residual, n, out);
    case DType::kFloat16:
      return fp8_block_sum_avx2_local<F, DType::kFloat16, kResidual>(codes, decode_scale, local, prescale, residual, n, out);
    default:
      return fp8_block_sum_avx2_local<F, DType::kBFloat16, kResidual>(codes, decode_scale, local, prescale, residual, n,
                                                                       out);
  }
}

// codes_finite: the codes are those of finite values, so none is special.
template <Fp8Format F>
GS_AVX2 inline void fp8_feedback_residual_avx2(const uint8_t* codes, float decode_scale, const float* sum, int64_t n,
                                               bool codes_finite, float* residual) {
  const __m256 d = _mm256_set1_ps(decode_scale);
  int64_t i = 0;
  float hd = 0.0f;
  if (codes_finite && half_decode_scale<F>(decode_scale, &hd)) {
    const __m256 h = _mm256_set1_ps(hd);
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(residual + i, feedback_residual8(_mm256_loadu_ps(sum + i), fp8_values8<F, true>(codes + i, h)));
    }
  }
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(residual + i, feedback_residual8(_mm256_loadu_ps(sum + i), fp8_values8<F>(codes + i, d)));
  }
  for (; i < n; ++i) residual[i] = feedback_residual(sum[i], fp8_to_float<F>(codes[i]) * decode_scale);
}
#endif  // GS_HAVE_X86

// The per-block loops, written once over an instruction-set policy and compiled whole for each
// set, so that the vector helpers inline into them.
#define GS_ALWAYS_INLINE __attribute__((always_inline)) inline

struct ScalarIsa {
  static void convert(const void* src, DType st, void* dst, DType dt, int64_t n, float scale) {
    convert_scalar(src, st, dst, dt, 0, n, scale);
  }
  static bool streams(const void*, int64_t) { return false; }
  static void stream_scaled(const float*, int64_t, float, float*) {}
  static void fence() {}
  static BlockSum convert_absmax(const void* src, DType st, int64_t n, float scale, float* out) {
    convert_scalar(src, st, out, DType::kFloat32, 0, n, scale);
    return {absmax_finite_scalar(out, n), false};
  }
  template <Fp8Format F>
  static BlockSum block_sum(const uint8_t* codes, float decode_scale, const void* local, DType lt, float prescale,
                            const float* residual, int64_t n, float* out) {
    for (int64_t i = 0; i < n; ++i) {
      float v = load_float(local, lt, i) * prescale;
      if (codes) v = hop_sum(fp8_to_float<F>(codes[i]) * decode_scale, v);
      if (residual) v = hop_sum(v, residual[i]);
      out[i] = v;
    }
    return {absmax_finite_scalar(out, n), false};
  }
  template <Fp8Format F>
  static void feedback_residual(const uint8_t* codes, float decode_scale, const float* sum, int64_t n, bool,
                                float* residual) {
    for (int64_t i = 0; i < n; ++i) residual[i] = gradsync::feedback_residual(sum[i], fp8_to_float<F>(codes[i]) * decode_scale);
  }
  template <Fp8Format F>
  static void codes(const float* v, int64_t n, float mul, uint32_t max_code, bool, uint8_t* out) {
    fp8_codes_scalar<F>(v, n, mul, max_code, out);
  }
  template <Fp8Format F>
  static void values(const uint8_t* codes, int64_t n, float decode_scale, float* out) {
    fp8_values_scalar<F>(codes, n, decode_scale, out);
  }
};

#ifdef GS_HAVE_X86
struct Avx2Isa {
  GS_AVX2 static void convert(const void* src, DType st, void* dst, DType dt, int64_t n, float scale) {
    convert_avx2(src, st, dst, dt, n, scale, /*cache_result=*/true);
  }
  // whether fp32 results of n elements at dst go out through non-temporal stores (dst 32-byte aligned)
  GS_AVX2 static bool streams(const void* dst, int64_t n) {
    return n >= kStreamMinElems && reinterpret_cast<uintptr_t>(dst) % 32 == 0;
  }
  // out = v * scale, streamed where whole vectors fit (out 32-byte aligned); fence() before others read
  GS_AVX2 static void stream_scaled(const float* v, int64_t n, float scale, float* out) {
    const int64_t i = stream_scaled_from<DType::kFloat32>(v, out, 0, n, scale);
    convert_scalar(v, DType::kFloat32, out, DType::kFloat32, i, n, scale);
  }
  GS_AVX2 static void fence() { _mm_sfence(); }
  GS_AVX2 static BlockSum convert_absmax(const void* src, DType st, int64_t n, float scale, float* out) {
    return convert_absmax_avx2(src, st, n, scale, out);
  }
  // [values(codes) * decode_scale +] local * prescale [+ residual]: codes, residual may be null
  template <Fp8Format F>
  GS_AVX2 static BlockSum block_sum(const uint8_t* codes, float decode_scale, const void* local, DType lt,
                                    float prescale, const float* residual, int64_t n, float* out) {
    if (residual) return fp8_block_sum_avx2<F, true>(codes, decode_scale, local, lt, prescale, residual, n, out);
    return fp8_block_sum_avx2<F, false>(codes, decode_scale, local, lt, prescale, nullptr, n, out);
  }
  template <Fp8Format F>
  GS_AVX2 static void feedback_residual(const uint8_t* codes, float decode_scale, const float* sum, int64_t n,
                                        bool codes_finite, float* residual) {
    fp8_feedback_residual_avx2<F>(codes, decode_scale, sum, n, codes_finite, residual);
  }
  template <Fp8Format F>
  GS_AVX2 static void codes(const float* v, int64_t n, float mul, uint32_t max_code, bool all_finite, uint8_t* out) {
    if (all_finite) return fp8_codes_avx2<F, true>(v, n, mul, max_code, out);
    fp8_codes_avx2<F, false>(v, n, mul, max_code, out);
  }
  template <Fp8Format F>
  GS_AVX2 static void values(const uint8_t* codes, int64_t n, float decode_scale, float* out) {
    fp8_values_avx2<F>(codes, n, decode_scale, out);
  }
};
#endif

// The fp8 loops prefetch a whole block of their source kPrefetchBlocks blocks ahead: kPrefetchBytes
// of an fp32 source, half that of a 16-bit one.
constexpr int64_t kPrefetchBlocks = kPrefetchBytes / (4 * kFp8BlockSize);

GS_ALWAYS_INLINE void prefetch_block(const void* base, DType t, int64_t block, int64_t n) {
  const int64_t start = block * kFp8BlockSize;
  if (!base || start >= n) return;
  const char* p = static_cast<const char*>(base) + start * dtype_size(t);
  const int64_t bytes = std::min<int64_t>(kFp8BlockSize, n - start) * dtype_size(t);
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line);
}

// Encodes one block of fp32 values: its codes at `codes`, its decode scale at `scale_at`.
template <Fp8Format F, class Isa>
GS_ALWAYS_INLINE void fp8_encode_block(const float* block, int64_t len, BlockSum sum, uint8_t* codes,
                                       uint8_t* scale_at) {
  const int k = fp8_block_exponent<F>(sum.absmax);
  Isa::template codes<F>(block, len, pow2(k), fp8_block_max_code<F>(k), sum.all_finite, codes);
  const float decode_scale = pow2(-k);
  std::memcpy(scale_at, &decode_scale, 4);
}

template <Fp8Format F, class Isa>
GS_ALWAYS_INLINE void fp8_encode_loop(const void* src, DType st, int64_t n, float scale, uint8_t* payload, int64_t b0,
                                      int64_t b1) {
  uint8_t* scales = payload + fp8_scales_offset(n);
  alignas(32) float block[kFp8BlockSize];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * kFp8BlockSize;
    const int64_t len = std::min<int64_t>(kFp8BlockSize, n - start);
    prefetch_block(src, st, b + kPrefetchBlocks, n);
    const BlockSum sum = Isa::convert_absmax(static_cast<const char*>(src) + start * dtype_size(st), st, len, scale, block);
    fp8_encode_block<F, Isa>(block, len, sum, payload + start, scales + 4 * b);
  }
  if (b1 == fp8_num_blocks(n)) std::memset(payload + n, 0, fp8_scales_offset(n) - n);
}

// The ring's hop: out = encode([decode(in) +] local * prescale [+ residual]); with a residual (error
// feedback) it is then overwritten with what the encoding lost. in may be null when residual is not.
template <Fp8Format F, class Isa>
GS_ALWAYS_INLINE void fp8_reduce_encode_loop(const uint8_t* in, const void* local, DType lt, int64_t n, float prescale,
                                             float* residual, uint8_t* out) {
  uint8_t* out_scales = out + fp8_scales_offset(n);
  alignas(32) float block[kFp8BlockSize];
  for (int64_t b = 0; b < fp8_num_blocks(n); ++b) {
    const int64_t start = b * kFp8BlockSize;
    const int64_t len = std::min<int64_t>(kFp8BlockSize, n - start);
    prefetch_block(local, lt, b + kPrefetchBlocks, n);
    prefetch_block(residual, DType::kFloat32, b + kPrefetchBlocks, n);
    float in_scale = 0.0f;
    if (in) std::memcpy(&in_scale, in + fp8_scales_offset(n) + 4 * b, 4);
    const BlockSum sum = Isa::template block_sum<F>(in ? in + start : nullptr, in_scale,
                                                    static_cast<const char*>(local) + start * dtype_size(lt), lt,
                                                    prescale, residual ? residual + start : nullptr, len, block);
    fp8_encode_block<F, Isa>(block, len, sum, out + start, out_scales + 4 * b);
    if (residual) {
      float out_scale;
      std::memcpy(&out_scale, out_scales + 4 * b, 4);
      Isa::template feedback_residual<F>(out + start, out_scale, block, len, sum.all_finite, residual + start);
    }
  }
  std::memset(out + n, 0, fp8_scales_offset(n) - n);
}

template <Fp8Format F, class Isa>
GS_ALWAYS_INLINE void fp8_decode_loop(const uint8_t* payload, int64_t n, float scale, void* dst, DType dt, int64_t b0,
                                      int64_t b1) {
  const uint8_t* scale_bytes = payload + fp8_scales_offset(n);
  // blocks start at multiples of 128 elements, so all are aligned where the first one is
  const bool stream = dt == DType::kFloat32 &&
                      Isa::streams(static_cast<float*>(dst) + b0 * kFp8BlockSize, (b1 - b0) * kFp8BlockSize);
  alignas(32) float block[kFp8BlockSize];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * kFp8BlockSize;
    const int64_t len = std::min<int64_t>(kFp8BlockSize, n - start);
    float decode_scale;
    std::memcpy(&decode_scale, scale_bytes + 4 * b, 4);
    Isa::template values<F>(payload + start, len, decode_scale, block);
    if (stream) {
      Isa::stream_scaled(block, len, scale, static_cast<float*>(dst) + start);
    } else {
      Isa::convert(block, DType::kFloat32, static_cast<char*>(dst) + start * dtype_size(dt), dt, len, scale);
    }
  }
  if (stream) Isa::fence();
}

// The decoded values of a payload of n elements' elements [begin, begin + len), begin a multiple of
// the block.
template <Fp8Format F, class Isa>
GS_ALWAYS_INLINE void fp8_values_loop(const uint8_t* payload, int64_t n, int64_t begin, int64_t len, float* out) {
  const uint8_t* scale_bytes = payload + fp8_scales_offset(n);
  for (int64_t at = 0; at < len; at += kFp8BlockSize) {
    float decode_scale;
    std::memcpy(&decode_scale, scale_bytes + 4 * ((begin + at) / kFp8BlockSize), 4);
    Isa::template values<F>(payload + begin + at, std::min(kFp8BlockSize, len - at), decode_scale, out + at);
  }
}

#ifdef GS_HAVE_X86
#define GS_DISPATCH(loop, ...)                                                  \
  if (use_avx2()) return loop##_avx2<F>(__VA_ARGS__);                          \
  return loop##_scalar<F>(__VA_ARGS__)
#define GS_ISA_ENTRY(loop, params, args)                                        \
  template <Fp8Format F> GS_AVX2 void loop##_avx2 params { loop##_loop<F, Avx2Isa> args; } \
  template <Fp8Format F> void loop##_scalar params { loop##_loop<F, ScalarIsa> args; }
#else
#define GS_DISPATCH(loop, ...) return loop##_scalar<F>(__VA_ARGS__)
#define GS_ISA_ENTRY(loop, params, args) \
  template <Fp8Format F> void loop##_scalar params { loop##_loop<F, ScalarIsa> args; }
#endif

GS_ISA_ENTRY(fp8_encode, (const void* src, DType st, int64_t n, float scale, uint8_t* payload, int64_t b0, int64_t b1),
             (src, st, n, scale, payload, b0, b1))
GS_ISA_ENTRY(fp8_reduce_encode, (const uint8_t* in, const void* local, DType lt, int64_t n, float prescale,
                                 float* residual, uint8_t* out),
             (in, local, lt, n, prescale, residual, out))
GS_ISA_ENTRY(fp8_decode, (const uint8_t* payload, int64_t n, float scale, void* dst, DType dt, int64_t b0, int64_t b1),
             (payload, n, scale, dst, dt, b0, b1))
GS_ISA_ENTRY(fp8_values, (const uint8_t* payload, int64_t n, int64_t begin, int64_t len, float* out),
             (payload, n, begin, len, out))

template <Fp8Format F>
void fp8_encode_blocks(const void* src, DType st, int64_t n, float scale, uint8_t* payload, int64_t b0, int64_t b1) {
  GS_DISPATCH(fp8_encode, src, st, n, scale, payload, b0, b1);
}

template <Fp8Format F>
void fp8_reduce_encode_blocks(const uint8_t* in, const void* local, DType lt, int64_t n, float prescale,
                              float* residual, uint8_t* out) {
  GS_DISPATCH(fp8_reduce_encode, in, local, lt, n, prescale, residual, out);
}

template <Fp8Format F>
void fp8_values_blocks(const uint8_t* payload, int64_t n, int64_t begin, int64_t len, float* out) {
  GS_DISPATCH(fp8_values, payload, n, begin, len, out);
}

template <Fp8Format F>
void fp8_decode_blocks(const uint8_t* payload, int64_t n, float scale, void* dst, DType dt, int64_t b0, int64_t b1) {
  GS_DISPATCH(fp8_decode, payload, n, scale, dst, dt, b0, b1);
}

// The reduce-decode kernels work through their elements in pieces this long, so that the sums stay
// in the L1 cache between the passes over them; a multiple of the fp8 block.
constexpr int64_t kReducePiece = 16 * kFp8BlockSize;

// One piece of a reduce-decode: sum[0, len) holds decode(in) of the piece where `decoded`; then
// sum = [sum +] local * prescale [+ residual] and out = cast<lt>(sum * postscale).
void reduce_decoded_piece(bool decoded, const void* local, DType lt, int64_t len, float prescale, float postscale,
                          float* residual, float* sum, void* out) {
  if (residual) {
    // the sum with the residual, which becomes sum - sum = 0 (0 where not finite) ...
    reduce_cast_feedback_cpu(decoded ? sum : nullptr, DType::kFloat32, local, lt, len, prescale, residual, sum);
  } else if (decoded) {
    reduce_cast_cpu(sum, DType::kFloat32, local, lt, len, prescale, sum);
  } else {
    convert_cpu(local, lt, sum, DType::kFloat32, len, prescale, /*cache_result=*/true);
  }
  convert_cpu(sum, DType::kFloat32, out, lt, len, postscale);
  if (!residual || lt == DType::kFloat32) return;
  // ... but storing it into a 16-bit tensor rounds it: that loss is the residual
  alignas(32) float stored[kReducePiece];
  convert_cpu(out, lt, stored, DType::kFloat32, len, 1.0f, /*cache_result=*/true);
  for (int64_t j = 0; j < len; ++j) residual[j] = store_residual(sum[j], stored[j], postscale);
}

}  // namespace

void convert_cpu(const void* src, DType st, void* dst, DType dt, int64_t n, float scale, bool cache_result) {
#ifdef GS_HAVE_X86
  if (use_avx2()) return convert_avx2(src, st, dst, dt, n, scale, cache_result);
#endif
  convert_scalar(src, st, dst, dt, 0, n, scale);
}

void fp8_encode_cpu(Fp8Format format, const void* src, DType src_dtype, int64_t n, float scale, uint8_t* payload,
                    int64_t block_begin, int64_t block_end) {
  if (format == Fp8Format::kE4M3) {
    fp8_encode_blocks<Fp8Format::kE4M3>(src, src_dtype, n, scale, payload, block_begin, block_end);
  } else {
    fp8_encode_blocks<Fp8Format::kE5M2>(src, src_dtype, n, scale, payload, block_begin, block_end);
  }
}

void fp8_decode_cpu(Fp8Format format, const uint8_t* payload, int64_t n, float scale, void* dst, DType dst_dtype,
                    int64_t block_begin, int64_t block_end) {
  if (format == Fp8Format::kE4M3) {
    fp8_decode_blocks<Fp8Format::kE4M3>(payload, n, scale, dst, dst_dtype, block_begin, block_end);
  } else {
    fp8_decode_blocks<Fp8Format::kE5M2>(payload, n, scale, dst, dst_dtype, block_begin, block_end);
  }
}

void reduce_cast_cpu(const void* in, DType wire, const void* local, DType local_dtype, int64_t n, float prescale,
                     void* out) {
#ifdef GS_HAVE_X86
  if (use_avx2()) return reduce_cast_avx2(in, wire, local, local_dtype, n, prescale, out);
#endif
  reduce_cast_scalar(in, wire, local, local_dtype, 0, n, prescale, out);
}

void fp8_reduce_encode_cpu(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype, int64_t n,
                           float prescale, uint8_t* out) {
  if (format == Fp8Format::kE4M3) fp8_reduce_encode_blocks<Fp8Format::kE4M3>(in, local, local_dtype, n, prescale, nullptr, out);
  else fp8_reduce_encode_blocks<Fp8Format::kE5M2>(in, local, local_dtype, n, prescale, nullptr, out);
}

void reduce_cast_feedback_cpu(const void* in, DType wire, const void* local, DType local_dtype, int64_t n,
                              float prescale, float* residual, void* out) {
#ifdef GS_HAVE_X86
  if (use_avx2()) return reduce_cast_feedback_avx2(in, wire, local, local_dtype, n, prescale, residual, out);
#endif
  reduce_cast_feedback_scalar(in, wire, local, local_dtype, 0, n, prescale, residual, out);
}

void fp8_reduce_encode_feedback_cpu(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype,
                                    int64_t n, float prescale, float* residual, uint8_t* out) {
  if (format == Fp8Format::kE4M3) {
    fp8_reduce_encode_blocks<Fp8Format::kE4M3>(in, local, local_dtype, n, prescale, residual, out);
  } else {
    fp8_reduce_encode_blocks<Fp8Format::kE5M2>(in, local, local_dtype, n, prescale, residual, out);
  }
}

void reduce_decode_cpu(const void* in, DType wire, const void* local, DType local_dtype, int64_t n, float prescale,
                       float postscale, float* residual, void* out) {
  alignas(32) float sum[kReducePiece];
  const int size = dtype_size(local_dtype);
  for (int64_t at = 0; at < n; at += kReducePiece) {
    const int64_t len = std::min(kReducePiece, n - at);
    // decoding a 16-bit or fp32 wire into fp32 is exact
    if (in) convert_cpu(static_cast<const char*>(in) + at * dtype_size(wire), wire, sum, DType::kFloat32, len, 1.0f, true);
    reduce_decoded_piece(in != nullptr, static_cast<const char*>(local) + at * size, local_dtype, len, prescale,
                         postscale, residual ? residual + at : nullptr, sum, static_cast<char*>(out) + at * size);
  }
}

void fp8_reduce_decode_cpu(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype, int64_t n,
                           float prescale, float postscale, float* residual, void* out) {
  if (!in) return reduce_decode_cpu(nullptr, DType::kFloat32, local, local_dtype, n, prescale, postscale, residual, out);
  alignas(32) float sum[kReducePiece];
  const int size = dtype_size(local_dtype);
  for (int64_t at = 0; at < n; at += kReducePiece) {
    const int64_t len = std::min(kReducePiece, n - at);
    if (format == Fp8Format::kE4M3) fp8_values_blocks<Fp8Format::kE4M3>(in, n, at, len, sum);
    else fp8_values_blocks<Fp8Format::kE5M2>(in, n, at, len, sum);
    reduce_decoded_piece(true, static_cast<const char*>(local) + at * size, local_dtype, len, prescale, postscale,
                         residual ? residual + at : nullptr, sum, static_cast<char*>(out) + at * size);
  }
}

bool set_cpu_isa(const char* name) {
  Isa isa;
  if (std::strcmp(name, "auto") == 0) {
    isa = cpu_has_avx2() ? Isa::kAvx2 : Isa::kScalar;
  } else if (std::strcmp(name, "avx2") == 0) {
    if (!cpu_has_avx2()) return false;
    isa = Isa::kAvx2;
  } else if (std::strcmp(name, "scalar") == 0) {
    isa = Isa::kScalar;
  } else {
    return false;
  }
  g_isa.store(static_cast<int>(isa));
  return true;
}

const char* cpu_isa() { return use_avx2() ? "avx2" : "scalar"; }

}  // namespace gradsync
