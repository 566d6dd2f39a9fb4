// Exhaustive checks of the shared scalar formats (numerics.h): every code of every 8- and 16-bit
// format round-trips, every tie rounds to even, overflow and non-finite inputs map as documented.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "check.h"
#include "kernels/numerics.h"

using namespace gradsync;

namespace {

template <typename Encode, typename Decode>
void check_format(const char* name, int codes, uint32_t sign_bit, Encode encode, Decode decode) {
  // round trip of every finite code, ties to even between neighbours
  for (int c = 0; c < codes; ++c) {
    const float v = decode(c);
    if (std::isnan(v)) {
      CHECK(std::isnan(decode(encode(v))), "%s: NaN code 0x%x", name, c);
      continue;
    }
    if (v == 0.0f && c != 0 && c != static_cast<int>(sign_bit)) continue;
    CHECK(static_cast<int>(encode(v)) == c, "%s: code 0x%x (%g) re-encodes to 0x%x", name, c, v, encode(v));
    if ((c & (sign_bit - 1)) == 0 || std::isinf(v)) continue;
    const float prev = decode(c - 1);  // next smaller magnitude, same sign
    if (std::isnan(prev) || std::isinf(prev)) continue;
    const float mid = static_cast<float>((static_cast<double>(prev) + v) / 2);
    const int even = (c % 2 == 0) ? c : c - 1;
    CHECK(static_cast<int>(encode(mid)) == even, "%s: tie %g between 0x%x and 0x%x gave 0x%x", name, mid, c - 1, c,
          encode(mid));
    CHECK(static_cast<int>(encode(std::nextafter(mid, v))) == c, "%s: above tie below 0x%x", name, c);
    CHECK(static_cast<int>(encode(std::nextafter(mid, prev))) == c - 1, "%s: below tie above 0x%x", name, c - 1);
  }
}

template <Fp8Format F>
void check_block_exponent() {
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = rng() & 0x7fffffffu;
    const float a = bits_float(bits);
    if (!std::isfinite(a) || a == 0.0f) continue;
    const int k = fp8_block_exponent<F>(a);
    const double scaled = static_cast<double>(a) * std::ldexp(1.0, k);
    CHECK(scaled <= Fp8Traits<F>::kMax, "absmax %g k %d overflows", a, k);
    if (k > -126 && k < 126) CHECK(scaled * 2 > Fp8Traits<F>::kMax, "absmax %g k %d wastes range", a, k);
  }
  for (int k = -126; k <= 126; ++k) {
    const uint32_t max_code = fp8_block_max_code<F>(k);
    const double top = static_cast<double>(fp8_to_float<F>(static_cast<uint8_t>(max_code))) * std::ldexp(1.0, -k);
    CHECK(top <= std::numeric_limits<float>::max(), "k %d: max code decodes to %g", k, top);
    if (max_code < Fp8Traits<F>::kMaxCode) {
      const double next = static_cast<double>(fp8_to_float<F>(static_cast<uint8_t>(max_code + 1))) * std::ldexp(1.0, -k);
      CHECK(next > std::numeric_limits<float>::max(), "k %d: max code %u is not the largest", k, max_code);
    }
  }
}

}  // namespace

int main() {
  check_format("fp16", 1 << 16, 0x8000, [](float f) { return float_to_half_bits(f); },
               [](int c) { return half_bits_to_float(static_cast<uint16_t>(c)); });
  check_format("bf16", 1 << 16, 0x8000, [](float f) { return float_to_bf16_bits(f); },
               [](int c) { return bf16_bits_to_float(static_cast<uint16_t>(c)); });
  check_format("e4m3", 256, 0x80, [](float f) { return float_to_fp8<Fp8Format::kE4M3>(f); },
               [](int c) { return fp8_to_float<Fp8Format::kE4M3>(static_cast<uint8_t>(c)); });
  check_format("e5m2", 256, 0x80, [](float f) { return float_to_fp8<Fp8Format::kE5M2>(f); },
               [](int c) { return fp8_to_float<Fp8Format::kE5M2>(static_cast<uint8_t>(c)); });

  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(float_to_half_bits(65520.0f) == 0x7c00, "65520 -> inf");
  CHECK(float_to_half_bits(std::nextafter(65520.0f, 0.0f)) == 0x7bff, "just below 65520 -> 65504");
  CHECK(float_to_half_bits(-inf) == 0xfc00 && (float_to_half_bits(nan) & 0x7fff) > 0x7c00, "fp16 specials");
  CHECK(float_to_half_bits(1e-8f) == 0 && float_to_half_bits(6e-8f) == 1, "fp16 subnormal edge");
  CHECK(float_to_bf16_bits(nan) == 0x7fc0 && float_to_bf16_bits(-inf) == 0xff80, "bf16 specials");
  CHECK(float_to_fp8<Fp8Format::kE4M3>(1000.0f) == 0x7e, "e4m3 saturates");
  CHECK(float_to_fp8<Fp8Format::kE4M3>(inf) == 0x7f && float_to_fp8<Fp8Format::kE4M3>(-inf) == 0xff, "e4m3 inf -> NaN");
  CHECK(float_to_fp8<Fp8Format::kE5M2>(inf) == 0x7c && float_to_fp8<Fp8Format::kE5M2>(-inf) == 0xfc, "e5m2 inf");
  CHECK(float_to_fp8<Fp8Format::kE5M2>(nan) == 0x7f, "e5m2 NaN");
  CHECK(std::isinf(fp8_to_float<Fp8Format::kE5M2>(0x7c)) && std::isnan(fp8_to_float<Fp8Format::kE4M3>(0x7f)), "decode specials");
  CHECK(float_to_fp8<Fp8Format::kE4M3>(bits_float(1)) == 0, "fp32 subnormal -> 0");

  check_block_exponent<Fp8Format::kE4M3>();
  check_block_exponent<Fp8Format::kE5M2>();
  return gradsync_test::finish("numerics");
}
