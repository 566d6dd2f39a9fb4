#include "ring/ring_allreduce.h"

#include <cstring>
#include <sstream>
#include <stdexcept>

namespace gradsync {

CodecRingKernels::CodecRingKernels(Codec codec, const void* local, void* result, DType dtype, float prescale,
                                   float postscale)
    : codec_(codec), local_(local), result_(result), dtype_(dtype),
      wire_(codec == Codec::kFp16 ? DType::kFloat16 : codec == Codec::kBf16 ? DType::kBFloat16 : dtype),
      prescale_(prescale), postscale_(postscale) {}

namespace {
int mod(int x, int n) { return ((x % n) + n) % n; }
}  // namespace

int64_t CodecRingKernels::payload_bytes(int64_t n) const {
  return fp8() ? fp8_payload_bytes(n) : n * dtype_size(wire_);
}

void CodecRingKernels::feedback_encode(const void* in, int64_t begin, int64_t n, void* out) {
  float* sum = scratch_;
  float* lost = scratch_ + scratch_stride_;
  float* carried = residual_ + begin;
  auto decode_f32 = [&](const void* payload, float* dst) {
    if (fp8()) fp8_decode_f32(payload, n, dst);
    else cast(payload, wire_, dst, DType::kFloat32, n, 1.0f);
  };
  if (in) {  // sum = decode(in) + local * prescale, as in the fused kernels
    decode_f32(in, lost);
    add(lost, local_at(begin), dtype_, n, prescale_, sum);
  } else {
    cast(local_at(begin), dtype_, sum, DType::kFloat32, n, prescale_);
  }
  add(sum, carried, DType::kFloat32, n, 1.0f, sum);
  if (fp8()) fp8_encode_f32(sum, n, out);
  else cast(sum, DType::kFloat32, out, wire_, n, 1.0f);
  decode_f32(out, lost);
  residual(sum, lost, n, carried);
}

void CpuRingKernels::cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, float scale) {
  convert_cpu(src, src_dtype, dst, dst_dtype, n, scale);
}

void CpuRingKernels::add(const float* a, const void* b, DType b_dtype, int64_t n, float b_scale, float* out) {
  reduce_cast_cpu(a, DType::kFloat32, b, b_dtype, n, b_scale, out);
}

void CpuRingKernels::fp8_encode_f32(const float* src, int64_t n, void* out) {
  fp8_encode_cpu(fp8_format(), src, DType::kFloat32, n, 1.0f, static_cast<uint8_t*>(out), 0, fp8_num_blocks(n));
}

void CpuRingKernels::fp8_decode_f32(const void* in, int64_t n, float* dst) {
  fp8_decode_cpu(fp8_format(), static_cast<const uint8_t*>(in), n, 1.0f, dst, DType::kFloat32, 0, fp8_num_blocks(n));
}

void CpuRingKernels::residual(const float* sum, const float* decoded, int64_t n, float* out) {
  feedback_residual_cpu(sum, decoded, n, out);
}

void CpuRingKernels::encode(int64_t begin, int64_t n, void* out) {
  if (residual_) return feedback_encode(nullptr, begin, n, out);
  if (fp8()) {
    fp8_encode_cpu(fp8_format(), local_at(begin), dtype_, n, prescale_, static_cast<uint8_t*>(out), 0,
                   fp8_num_blocks(n));
  } else {
    convert_cpu(local_at(begin), dtype_, out, wire_, n, prescale_);
  }
}

void CpuRingKernels::reduce_encode(const void* in, int64_t begin, int64_t n, void* out) {
  if (residual_) return feedback_encode(in, begin, n, out);
  if (fp8()) {
    fp8_reduce_encode_cpu(fp8_format(), static_cast<const uint8_t*>(in), local_at(begin), dtype_, n, prescale_,
                          static_cast<uint8_t*>(out));
  } else {
    reduce_cast_cpu(in, wire_, local_at(begin), dtype_, n, prescale_, out);
  }
}

void CpuRingKernels::decode(const void* in, int64_t begin, int64_t n) {
  void* dst = result_at(begin);
  if (fp8()) {
    fp8_decode_cpu(fp8_format(), static_cast<const uint8_t*>(in), n, postscale_, dst, dtype_, 0,
                   fp8_num_blocks(n));
  } else {
    convert_cpu(in, wire_, dst, dtype_, n, postscale_);
  }
}

void* CpuRingKernels::result_as_payload(int64_t begin) {
  return codec_ == Codec::kNone && postscale_ == 1.0f ? result_at(begin) : nullptr;
}

uint32_t ring_tag_span(const RingPlan& plan) {
  return static_cast<uint32_t>(2 * std::max(plan.ranks() - 1, 1) * std::max(plan.max_slices(), 1));
}

void exchange_ring_calls(Transport& t, RingCall* table, uint32_t tag) {
  const int n = t.size(), r = t.rank();
  // all-gather around the ring: step s forwards the record of rank r - s
  for (int s = 0; s < n - 1; ++s) {
    t.group_begin();
    const int64_t h = t.recv(&table[mod(r - s - 1, n)], sizeof(RingCall), mod(r - 1, n), tag + s);
    t.send(&table[mod(r - s, n)], sizeof(RingCall), mod(r + 1, n), tag + s);
    t.group_end();
    t.wait(h);
  }
  t.wait_all();
}

void compare_ring_calls(const RingCall* table, int n) {
  std::ostringstream diff;
  for (int i = 0; i < n; ++i) {
    const RingCall& c = table[i];
    if (std::memcmp(&c, &table[0], sizeof(RingCall)) != 0) {
      diff << " rank " << i << " has numel " << c.numel << ", dtype " << c.dtype << ", codec " << c.codec
           << ", prescale " << c.prescale << ", postscale " << c.postscale << " but rank 0 has numel "
           << table[0].numel << ", dtype " << table[0].dtype << ", codec " << table[0].codec << ", prescale "
           << table[0].prescale << ", postscale " << table[0].postscale << ";";
    }
  }
  if (!diff.str().empty()) {
    throw std::invalid_argument("gradsync.all_reduce: the ranks disagree on the call:" + diff.str() +
                                " every rank must pass the same numel, dtype, codec and scaling");
  }
}

void check_ring_call(Transport& t, const RingCall& call, uint32_t tag) {
  const int n = t.size();
  if (n == 1) return;
  std::vector<RingCall> table(n);
  table[t.rank()] = call;
  exchange_ring_calls(t, table.data(), tag);
  compare_ring_calls(table.data(), n);
}

void ring_allreduce(Transport& t, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image,
                    uint8_t* send_image, uint32_t tag_base) {
  const int n = plan.ranks(), r = t.rank(), next = mod(r + 1, n), prev = mod(r - 1, n);
  std::vector<int64_t> offsets;
  plan.layout([&](int64_t len) { return kernels.payload_bytes(len); }, offsets);
  const int k_max = plan.max_slices();
  auto slot = [&](uint8_t* image, int c, int k) { return image + offsets[static_cast<size_t>(c) * k_max + k]; };
  auto bytes = [&](int c, int k) { return kernels.payload_bytes(plan.slice_len(c, k)); };
  auto tag = [&](int step, int k) { return tag_base + static_cast<uint32_t>(step * k_max + k); };

  if (n == 1) {  // no wire, but the same numerics: the result is the decoded encoding of the sum
    for (int k = 0; k < plan.slices(0); ++k) kernels.encode(plan.slice_begin(0, k), plan.slice_len(0, k), slot(send_image, 0, k));
    for (int k = 0; k < plan.slices(0); ++k) kernels.decode(slot(send_image, 0, k), plan.slice_begin(0, k), plan.slice_len(0, k));
    return;
  }
  const int own = mod(r + 1, n);
  auto landing = [&](int c, int k) -> uint8_t* {
    void* direct = kernels.result_as_payload(plan.slice_begin(c, k));
    return direct ? static_cast<uint8_t*>(direct) : slot(recv_image, c, k);
  };

  if (!t.posts_receives_ahead()) {
    // Stream-ordered: hop (step, slice) sends and receives in one group; every rank issues the hops
    // in the same order, and a chunk with fewer slices leaves its partner's receive unpaired.
    auto hop = [&](int step, int send_c, uint8_t* send_at, int recv_c, uint8_t* recv_at, int k) {
      t.group_begin();
      if (k < plan.slices(send_c)) t.send(send_at, bytes(send_c, k), next, tag(step, k));
      const int64_t h = k < plan.slices(recv_c) ? t.recv(recv_at, bytes(recv_c, k), prev, tag(step, k)) : -1;
      t.group_end();
      t.wait(h);
      return h >= 0;
    };
    for (int k = 0; k < plan.slices(r); ++k) kernels.encode(plan.slice_begin(r, k), plan.slice_len(r, k), slot(send_image, r, k));
    for (int s = 0; s < n - 1; ++s) {
      const int cs = mod(r - s, n), cr = mod(r - s - 1, n);
      for (int k = 0; k < std::max(plan.slices(cs), plan.slices(cr)); ++k) {
        if (hop(s, cs, slot(send_image, cs, k), cr, slot(recv_image, cr, k), k)) {
          kernels.reduce_encode(slot(recv_image, cr, k), plan.slice_begin(cr, k), plan.slice_len(cr, k), slot(send_image, cr, k));
        }
      }
    }
    t.fence();  // the all-gather may land in the input, which the reduce-scatter kernels read
    for (int s = 0; s < n - 1; ++s) {
      const int cs = mod(r + 1 - s, n), cr = mod(r - s, n);
      for (int k = 0; k < std::max(plan.slices(cs), plan.slices(cr)); ++k) {
        uint8_t* payload = k < plan.slices(cs) ? (s == 0 ? slot(send_image, own, k) : landing(cs, k)) : nullptr;
        if (hop(n - 1 + s, cs, payload, cr, landing(cr, k), k) && landing(cr, k) == slot(recv_image, cr, k)) {
          kernels.decode(slot(recv_image, cr, k), plan.slice_begin(cr, k), plan.slice_len(cr, k));
        }
      }
      if (s == 0) {
        for (int k = 0; k < plan.slices(own); ++k) kernels.decode(slot(send_image, own, k), plan.slice_begin(own, k), plan.slice_len(own, k));
      }
    }
    t.wait_all();
    return;
  }

  // Reduce-scatter. Every receive is posted up front (a rendezvous transport moves no data before
  // the receive exists); step s receives chunk r-s-1, adds the local part and forwards it.
  std::vector<int64_t> handles(static_cast<size_t>(n - 1) * k_max, -1);
  for (int s = 0; s < n - 1; ++s) {
    const int c = mod(r - s - 1, n);
    for (int k = 0; k < plan.slices(c); ++k) handles[s * k_max + k] = t.recv(slot(recv_image, c, k), bytes(c, k), prev, tag(s, k));
  }
  for (int k = 0; k < plan.slices(r); ++k) {
    kernels.encode(plan.slice_begin(r, k), plan.slice_len(r, k), slot(send_image, r, k));
    t.send(slot(send_image, r, k), bytes(r, k), next, tag(0, k));
  }
  for (int s = 0; s < n - 1; ++s) {
    const int c = mod(r - s - 1, n);
    for (int k = 0; k < plan.slices(c); ++k) {
      t.wait(handles[s * k_max + k]);
      kernels.reduce_encode(slot(recv_image, c, k), plan.slice_begin(c, k), plan.slice_len(c, k), slot(send_image, c, k));
      if (s < n - 2) t.send(slot(send_image, c, k), bytes(c, k), next, tag(s + 1, k));
    }
  }
  t.wait_all();

  // All-gather of the encoded reduced chunks: this rank owns chunk r+1; step s receives chunk r-s,
  // forwards it, then decodes it into the result (or receives it there, when decoding is a copy).
  for (int s = 0; s < n - 1; ++s) {
    const int c = mod(r - s, n);
    for (int k = 0; k < plan.slices(c); ++k) handles[s * k_max + k] = t.recv(landing(c, k), bytes(c, k), prev, tag(n - 1 + s, k));
  }
  for (int k = 0; k < plan.slices(own); ++k) t.send(slot(send_image, own, k), bytes(own, k), next, tag(n - 1, k));
  for (int k = 0; k < plan.slices(own); ++k) kernels.decode(slot(send_image, own, k), plan.slice_begin(own, k), plan.slice_len(own, k));
  for (int s = 0; s < n - 1; ++s) {
    const int c = mod(r - s, n);
    for (int k = 0; k < plan.slices(c); ++k) {
      t.wait(handles[s * k_max + k]);
      uint8_t* payload = landing(c, k);
      if (s < n - 2) t.send(payload, bytes(c, k), next, tag(n + s, k));
      if (payload == slot(recv_image, c, k)) kernels.decode(payload, plan.slice_begin(c, k), plan.slice_len(c, k));
    }
  }
  t.wait_all();
}

}  // namespace gradsync
