// The CPU kernels: scalar and AVX2 paths give the same bits (and those of numerics.h where a kernel
// is composed of others), fp8 blocks meet their error bound, and the multi-tensor copy handles contiguous, strided and empty segments.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "kernels/codec.h"
#include "kernels/multi_tensor.h"

using namespace gradsync;

namespace {

std::vector<float> random_bit_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = bits_float(rng());
    if (!std::isfinite(x)) x = 1.5f;
  }
  return v;
}

const DType kTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

void check_convert_paths_agree() {
  if (!set_cpu_isa("avx2")) {
    std::printf("no AVX2: only the scalar path is tested\n");
    return;
  }
  const size_t n = 10007;
  const std::vector<float> src32 = random_bit_floats(n, 1);
  for (DType st : kTypes) {
    std::vector<uint8_t> src(n * 4);
    set_cpu_isa("scalar");
    convert_cpu(src32.data(), DType::kFloat32, src.data(), st, n, 1.0f);
    for (DType dt : kTypes) {
      std::vector<uint8_t> a(n * 4), b(n * 4);
      set_cpu_isa("scalar");
      convert_cpu(src.data(), st, a.data(), dt, n, 0.3f);
      set_cpu_isa("avx2");
      convert_cpu(src.data(), st, b.data(), dt, n, 0.3f);
      CHECK(std::memcmp(a.data(), b.data(), n * dtype_size(dt)) == 0, "convert %d -> %d differs", int(st), int(dt));
    }
  }
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    std::vector<float> x = random_bit_floats(128 * 100 + 3, 2);
    x[5] = INFINITY;
    x[300] = NAN;
    std::vector<uint8_t> a(fp8_payload_bytes(x.size())), b(a.size());
    set_cpu_isa("scalar");
    fp8_encode_cpu(f, x.data(), DType::kFloat32, x.size(), 1.0f, a.data(), 0, fp8_num_blocks(x.size()));
    set_cpu_isa("avx2");
    fp8_encode_cpu(f, x.data(), DType::kFloat32, x.size(), 1.0f, b.data(), 0, fp8_num_blocks(x.size()));
    CHECK(a == b, "fp8 encode paths differ (format %d)", int(f));
  }
  set_cpu_isa("auto");
}

// Blocks as gradients make them: each block's values within some binades of its own magnitude, that
// magnitude anywhere from subnormal to FLT_MAX, few mantissa bits so that many values are exact
// ties on the fp8 grid, zeros of both signs. Every kernel gives the scalar path's bits on them.
std::vector<float> graded_blocks(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> x(n);
  for (int64_t b = 0; b < n; b += kFp8BlockSize) {
    const int top = static_cast<int>(rng() % 278) - 149;  // the block's largest binade, 2^-149 .. 2^128
    const int spread = static_cast<int>(rng() % 40);
    for (int64_t i = b; i < std::min(n, b + kFp8BlockSize); ++i) {
      const int e = std::max(-149, top - 1 - static_cast<int>(rng() % (spread + 1)));
      const uint32_t r = rng();
      float v = std::ldexp(static_cast<float>(r % 64) + 64.0f, e - 6);  // 7 significant bits at 2^e
      if (r % 97 == 0) v = 0.0f;
      x[i] = (r >> 31) ? -v : v;
    }
  }
  return x;
}

void check_fp8_paths_agree_on_graded_blocks() {
  if (!set_cpu_isa("avx2")) return;
  const int64_t n = kFp8BlockSize * 4000 + 77;
  const std::vector<float> x = graded_blocks(n, 7), y = graded_blocks(n, 8);
  const int64_t nb = fp8_num_blocks(n), bytes = fp8_payload_bytes(n);
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (DType st : kTypes) {
      std::vector<uint8_t> src(n * 4), local(n * 4);
      convert_cpu(x.data(), DType::kFloat32, src.data(), st, n, 1.0f);
      convert_cpu(y.data(), DType::kFloat32, local.data(), st, n, 1.0f);
      for (float scale : {1.0f, 0.3f}) {
        std::vector<uint8_t> enc[2], sum[2], fed[2];
        std::vector<float> dec[2], residual[2];
        for (int isa = 0; isa < 2; ++isa) {
          set_cpu_isa(isa ? "avx2" : "scalar");
          enc[isa].resize(bytes);
          sum[isa].resize(bytes);
          fed[isa].resize(bytes);
          dec[isa].resize(n);
          fp8_encode_cpu(f, src.data(), st, n, scale, enc[isa].data(), 0, nb);
          fp8_reduce_encode_cpu(f, enc[0].data(), local.data(), st, n, scale, sum[isa].data());
          fp8_decode_cpu(f, sum[0].data(), n, scale, dec[isa].data(), DType::kFloat32, 0, nb);
          residual[isa] = y;
          for (float& r : residual[isa]) r *= 0.01f;
          fp8_reduce_encode_feedback_cpu(f, enc[0].data(), local.data(), st, n, scale, residual[isa].data(),
                                         fed[isa].data());
        }
        CHECK(fed[0] == fed[1] && std::memcmp(residual[0].data(), residual[1].data(), n * 4) == 0,
              "fp8 %d feedback, local dtype %d, scale %g: paths differ", int(f), int(st), scale);
        CHECK(enc[0] == enc[1], "fp8 %d encode from dtype %d, scale %g: paths differ", int(f), int(st), scale);
        CHECK(sum[0] == sum[1], "fp8 %d reduce-encode, local dtype %d, scale %g: paths differ", int(f), int(st), scale);
        CHECK(std::memcmp(dec[0].data(), dec[1].data(), n * 4) == 0, "fp8 %d decode, scale %g: paths differ", int(f),
              scale);
      }
    }
  }
  set_cpu_isa("auto");
}

// The fused hop is the composition it replaces: encode(decode(in) + float(local) * prescale), the
// sum in fp32 and its block scales chosen from it, bit for bit, on every instruction set.
void check_fp8_reduce_encode_is_decode_add_encode() {
  const int64_t n = kFp8BlockSize * 300 + 77;
  const std::vector<float> x = graded_blocks(n, 9), y = graded_blocks(n, 10);
  const int64_t nb = fp8_num_blocks(n), bytes = fp8_payload_bytes(n);
  for (const char* isa : {"scalar", "avx2"}) {
    if (!set_cpu_isa(isa)) continue;
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (DType st : kTypes) {
        std::vector<uint8_t> src(n * 4), local(n * 4), enc(bytes), fused(bytes), composed(bytes);
        convert_cpu(x.data(), DType::kFloat32, src.data(), st, n, 1.0f);
        convert_cpu(y.data(), DType::kFloat32, local.data(), st, n, 1.0f);
        for (float scale : {1.0f, 0.3f}) {
          fp8_encode_cpu(f, src.data(), st, n, scale, enc.data(), 0, nb);
          fp8_reduce_encode_cpu(f, enc.data(), local.data(), st, n, scale, fused.data());
          std::vector<float> received(n), mine(n), sum(n);
          fp8_decode_cpu(f, enc.data(), n, 1.0f, received.data(), DType::kFloat32, 0, nb);
          convert_cpu(local.data(), st, mine.data(), DType::kFloat32, n, 1.0f);
          for (int64_t i = 0; i < n; ++i) {
            const float product = mine[i] * scale;
            sum[i] = received[i] + product;
          }
          fp8_encode_cpu(f, sum.data(), DType::kFloat32, n, 1.0f, composed.data(), 0, nb);
          CHECK(fused == composed, "%s fp8 %d reduce-encode, local dtype %d, scale %g: not decode, add, encode", isa,
                int(f), int(st), scale);
        }
      }
    }
  }
  set_cpu_isa("auto");
}

void check_fp8_roundtrip() {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f), spread(-2.0f, 2.0f);
  const int64_t n = 128 * 50 + 17;
  std::vector<float> x(n);
  for (int64_t b = 0; b < n; b += 128) {
    const float centre = exponent(rng);
    for (int64_t i = b; i < std::min(n, b + 128); ++i) x[i] = std::pow(10.0f, centre + spread(rng)) * (i % 3 ? 1 : -1);
  }
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const double rel = f == Fp8Format::kE4M3 ? 1.0 / 16 : 1.0 / 8;
    const double sub = f == Fp8Format::kE4M3 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -17);
    std::vector<uint8_t> payload(fp8_payload_bytes(n));
    std::vector<float> y(n);
    fp8_encode_cpu(f, x.data(), DType::kFloat32, n, 1.0f, payload.data(), 0, fp8_num_blocks(n));
    fp8_decode_cpu(f, payload.data(), n, 1.0f, y.data(), DType::kFloat32, 0, fp8_num_blocks(n));
    const float* scales = reinterpret_cast<const float*>(payload.data() + fp8_scales_offset(n));
    for (int64_t i = 0; i < n; ++i) {
      const double bound = std::max(rel * std::fabs(x[i]), sub * scales[i / kFp8BlockSize]);
      CHECK(std::fabs(static_cast<double>(y[i]) - x[i]) <= bound, "fp8 %d element %ld: %g -> %g", int(f), long(i), x[i], y[i]);
    }
  }
}

void check_multi_tensor_copy() {
  // a: contiguous fp32[5], b: empty, c: fp16 3x4 matrix read transposed (strides 1, 4), d: bf16[70000]
  std::vector<float> a = {1, 2, 3, 4, 5};
  std::vector<uint16_t> c(12), d(70000);
  for (int i = 0; i < 12; ++i) c[i] = float_to_half_bits(static_cast<float>(i));
  for (int i = 0; i < 70000; ++i) d[i] = float_to_bf16_bits(static_cast<float>(i % 251));
  Segment s[4];
  std::memset(s, 0, sizeof(s));
  s[0].data = a.data(); s[0].numel = 5; s[0].dtype = DType::kFloat32;
  s[1].data = nullptr; s[1].numel = 0; s[1].dtype = DType::kFloat32; s[1].flat_offset = 5;
  s[2].data = c.data(); s[2].numel = 12; s[2].dtype = DType::kFloat16; s[2].flat_offset = 5;
  s[2].ndim = 2; s[2].sizes[0] = 4; s[2].sizes[1] = 3; s[2].strides[0] = 1; s[2].strides[1] = 4;
  s[3].data = d.data(); s[3].numel = 70000; s[3].dtype = DType::kBFloat16; s[3].flat_offset = 17;
  const int64_t chunks = plan_chunks(s, 4, kCpuChunk);
  CHECK(chunks == 1 + 0 + 1 + 3, "chunks %ld", long(chunks));
  std::vector<float> flat(70017);
  multi_tensor_copy_cpu(s, 4, flat.data(), DType::kFloat32, 2.0f, Direction::kToFlat, 0, chunks);
  for (int i = 0; i < 5; ++i) CHECK(flat[i] == 2 * a[i], "a[%d]", i);
  for (int r = 0; r < 4; ++r)
    for (int col = 0; col < 3; ++col) CHECK(flat[5 + r * 3 + col] == 2.0f * (col * 4 + r), "c^T[%d][%d]", r, col);
  for (int i = 0; i < 70000; ++i) CHECK(flat[17 + i] == 2.0f * (i % 251), "d[%d]", i);
  // back, halving: the original values return
  std::fill(c.begin(), c.end(), 0);
  std::fill(d.begin(), d.end(), 0);
  multi_tensor_copy_cpu(s, 4, flat.data(), DType::kFloat32, 0.5f, Direction::kFromFlat, 0, chunks);
  for (int i = 0; i < 12; ++i) CHECK(half_bits_to_float(c[i]) == i, "c[%d]", i);
  for (int i = 0; i < 70000; ++i) CHECK(bf16_bits_to_float(d[i]) == i % 251, "d[%d] back", i);
}

// Error feedback composed of the primitives, as the fused kernels must compute it.
void feedback_reference(const void* in, Fp8Format* fp8, DType wire, const void* local, DType lt, int64_t n, float prescale,
                        float* residual, void* out) {
  std::vector<float> sum(n), lost(n);
  if (in) {
    if (fp8) fp8_decode_cpu(*fp8, static_cast<const uint8_t*>(in), n, 1.0f, lost.data(), DType::kFloat32, 0, fp8_num_blocks(n));
    else convert_cpu(in, wire, lost.data(), DType::kFloat32, n, 1.0f);
    reduce_cast_cpu(lost.data(), DType::kFloat32, local, lt, n, prescale, sum.data());
  } else {
    convert_cpu(local, lt, sum.data(), DType::kFloat32, n, prescale);
  }
  reduce_cast_cpu(sum.data(), DType::kFloat32, residual, DType::kFloat32, n, 1.0f, sum.data());
  if (fp8) {
    fp8_encode_cpu(*fp8, sum.data(), DType::kFloat32, n, 1.0f, static_cast<uint8_t*>(out), 0, fp8_num_blocks(n));
    fp8_decode_cpu(*fp8, static_cast<const uint8_t*>(out), n, 1.0f, lost.data(), DType::kFloat32, 0, fp8_num_blocks(n));
  } else {
    convert_cpu(sum.data(), DType::kFloat32, out, wire, n, 1.0f);
    convert_cpu(out, wire, lost.data(), DType::kFloat32, n, 1.0f);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float r = sum[i] - lost[i];
    residual[i] = std::isfinite(r) ? r : 0.0f;
  }
}

// One hop's inputs for each instruction set, local dtype and codec: n elements of local part and an
// incoming payload of the codec, random bits with non-finite values among them, and a residual.
struct HopCase {
  const char* isa;
  DType lt, wire;
  int codec;
  Fp8Format* fp8;  // null for the cast codecs
  const std::vector<uint8_t>& local;
  const std::vector<uint8_t>& in;
  const std::vector<float>& residual;
};

template <typename F>
void for_each_hop_case(int64_t n, F check) {
  const std::vector<float> base = random_bit_floats(n, 4);
  std::vector<float> residual(n);
  std::mt19937 rng(5);
  std::normal_distribution<float> small(0.0f, 1e-3f);
  for (auto& r : residual) r = small(rng);
  residual[7] = INFINITY;
  for (const char* isa : {"scalar", "avx2"}) {
    if (!set_cpu_isa(isa)) continue;
    for (DType lt : kTypes) {
      std::vector<uint8_t> local(n * 4);
      convert_cpu(base.data(), DType::kFloat32, local.data(), lt, n, 1e-30f);
      if (lt == DType::kFloat32) {
        static_cast<float*>(static_cast<void*>(local.data()))[3] = NAN;
        static_cast<float*>(static_cast<void*>(local.data()))[200] = -INFINITY;
      }
      for (int codec = 0; codec < 5; ++codec) {
        Fp8Format format = codec == 3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
        Fp8Format* fp8 = codec >= 3 ? &format : nullptr;
        const DType wire = codec == 0 ? lt : codec == 1 ? DType::kFloat16 : DType::kBFloat16;
        std::vector<uint8_t> in(fp8 ? fp8_payload_bytes(n) : n * dtype_size(wire));
        std::vector<float> scaled = random_bit_floats(n, 6 + codec);
        convert_cpu(scaled.data(), DType::kFloat32, scaled.data(), DType::kFloat32, n, 1e-30f);
        scaled[11] = INFINITY;
        if (fp8) fp8_encode_cpu(format, scaled.data(), DType::kFloat32, n, 1.0f, in.data(), 0, fp8_num_blocks(n));
        else convert_cpu(scaled.data(), DType::kFloat32, in.data(), wire, n, 1.0f);
        check(HopCase{isa, lt, wire, codec, fp8, local, in, residual});
      }
    }
  }
  set_cpu_isa("auto");
}

// The fused error-feedback kernels give the bits of the primitives composed, on every path, with
// and without an incoming payload, non-finite inputs included.
void check_feedback_kernels() {
  const int64_t n = 128 * 37 + 5;
  for_each_hop_case(n, [&](const HopCase& h) {
    const int64_t bytes = h.in.size();
    for (bool has_in : {true, false}) {
      const void* src = has_in ? h.in.data() : nullptr;
      std::vector<uint8_t> a(bytes), b(bytes);
      std::vector<float> ra = h.residual, rb = h.residual;
      set_cpu_isa("scalar");
      feedback_reference(src, h.fp8, h.wire, h.local.data(), h.lt, n, 0.37f, ra.data(), a.data());
      set_cpu_isa(h.isa);
      if (h.fp8) {
        fp8_reduce_encode_feedback_cpu(*h.fp8, static_cast<const uint8_t*>(src), h.local.data(), h.lt, n, 0.37f,
                                       rb.data(), b.data());
      } else {
        reduce_cast_feedback_cpu(src, h.wire, h.local.data(), h.lt, n, 0.37f, rb.data(), b.data());
      }
      CHECK(a == b, "%s feedback payload differs (codec %d, local dtype %d, in %d)", h.isa, h.codec, int(h.lt),
            int(has_in));
      CHECK(std::memcmp(ra.data(), rb.data(), n * 4) == 0, "%s feedback residual differs (codec %d, local dtype %d, in %d)",
            h.isa, h.codec, int(h.lt), int(has_in));
      // an fp32 wire loses nothing; every other one loses something
      bool lost = false;
      for (float r : rb) lost |= r != 0.0f;
      CHECK(lost == !(h.codec == 0 && h.lt == DType::kFloat32), "codec %d, local dtype %d: residual %s", h.codec,
            int(h.lt), lost ? "not zero" : "zero");
      for (float r : rb) CHECK(std::isfinite(r), "non-finite residual (codec %d)", h.codec);
    }
  });
}

float element(const void* p, DType t, int64_t i) {
  if (t == DType::kFloat32) return static_cast<const float*>(p)[i];
  const uint16_t bits = static_cast<const uint16_t*>(p)[i];
  return t == DType::kFloat16 ? half_bits_to_float(bits) : bf16_bits_to_float(bits);
}

// The reduce-scatter's last hop, element by element from numerics.h: the sum is cast to the local
// dtype, never encoded, and a residual becomes 0, or for a 16-bit dtype what that cast lost.
void reduce_decode_reference(const uint8_t* in, Fp8Format* fp8, DType wire, const void* local, DType lt, int64_t n,
                             float prescale, float postscale, float* residual, void* out) {
  for (int64_t i = 0; i < n; ++i) {
    float sum = element(local, lt, i) * prescale;
    if (in && fp8) {
      float scale;
      std::memcpy(&scale, in + fp8_scales_offset(n) + 4 * (i / kFp8BlockSize), 4);
      const float v = *fp8 == Fp8Format::kE4M3 ? fp8_to_float<Fp8Format::kE4M3>(in[i]) : fp8_to_float<Fp8Format::kE5M2>(in[i]);
      sum = hop_sum(v * scale, sum);
    } else if (in) {
      sum = hop_sum(element(in, wire, i), sum);
    }
    if (residual) sum = hop_sum(sum, residual[i]);
    const float v = sum * postscale;
    if (lt == DType::kFloat32) static_cast<float*>(out)[i] = v;
    else static_cast<uint16_t*>(out)[i] = lt == DType::kFloat16 ? float_to_half_bits(v) : float_to_bf16_bits(v);
    if (residual) residual[i] = lt == DType::kFloat32 ? 0.0f : store_residual(sum, element(out, lt, i), postscale);
  }
}

// The reduce-decode kernels on every path give the reference's bits: with and without an incoming
// payload and a residual, in place over the local part, non-finite values included, over several
// of their pieces and a short last block.
void check_reduce_decode_kernels() {
  const int64_t n = 128 * 37 + 5;
  for_each_hop_case(n, [&](const HopCase& h) {
    for (int variant = 0; variant < 8; ++variant) {
      const bool has_in = variant & 1, feedback = variant & 2, in_place = variant & 4;
      const uint8_t* src = has_in ? h.in.data() : nullptr;
      std::vector<uint8_t> expected(n * dtype_size(h.lt)), apart(n * dtype_size(h.lt)), local = h.local;
      std::vector<float> ra = h.residual, rb = h.residual;
      reduce_decode_reference(src, h.fp8, h.wire, h.local.data(), h.lt, n, 0.37f, 3.0f, feedback ? ra.data() : nullptr,
                              expected.data());
      void* out = in_place ? local.data() : apart.data();
      float* residual = feedback ? rb.data() : nullptr;
      if (h.fp8) fp8_reduce_decode_cpu(*h.fp8, src, local.data(), h.lt, n, 0.37f, 3.0f, residual, out);
      else reduce_decode_cpu(src, h.wire, local.data(), h.lt, n, 0.37f, 3.0f, residual, out);
      CHECK(std::memcmp(out, expected.data(), expected.size()) == 0,
            "%s reduce-decode differs (codec %d, local dtype %d, in %d, feedback %d, in place %d)", h.isa, h.codec,
            int(h.lt), int(has_in), int(feedback), int(in_place));
      CHECK(std::memcmp(ra.data(), rb.data(), n * 4) == 0, "%s reduce-decode residual differs (codec %d)", h.isa, h.codec);
    }
  });
}

}  // namespace

int main() {
  check_convert_paths_agree();
  check_fp8_roundtrip();
  check_fp8_paths_agree_on_graded_blocks();
  check_fp8_reduce_encode_is_decode_add_encode();
  check_multi_tensor_copy();
  check_feedback_kernels();
  check_reduce_decode_kernels();
  return gradsync_test::finish("kernels_cpu");
}
