#include "ring/ring_allreduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iomanip>
#include <limits>
#include <memory>
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

void CpuRingKernels::encode(int64_t begin, int64_t n, void* out) {
  if (residual_) return reduce_encode_feedback(nullptr, begin, n, out);
  if (out == local_at(begin) && prescale_ == 1.0f && wire_ == dtype_) return;  // already its own payload
  if (fp8()) {
    fp8_encode_cpu(fp8_format(), local_at(begin), dtype_, n, prescale_, static_cast<uint8_t*>(out), 0,
                   fp8_num_blocks(n));
  } else {
    convert_cpu(local_at(begin), dtype_, out, wire_, n, prescale_, /*cache_result=*/true);  // sent next
  }
}

void CpuRingKernels::reduce_encode_feedback(const void* in, int64_t begin, int64_t n, void* out) {
  if (fp8()) {
    fp8_reduce_encode_feedback_cpu(fp8_format(), static_cast<const uint8_t*>(in), local_at(begin), dtype_, n,
                                   prescale_, residual_ + begin, static_cast<uint8_t*>(out));
  } else {
    reduce_cast_feedback_cpu(in, wire_, local_at(begin), dtype_, n, prescale_, residual_ + begin, out);
  }
}

void CpuRingKernels::reduce_encode(const void* in, int64_t begin, int64_t n, void* out) {
  if (residual_) return reduce_encode_feedback(in, begin, n, out);
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

void CpuRingKernels::reduce_decode(const void* in, int64_t begin, int64_t n) {
  float* residual = residual_ ? residual_ + begin : nullptr;
  if (fp8()) {
    fp8_reduce_decode_cpu(fp8_format(), static_cast<const uint8_t*>(in), local_at(begin), dtype_, n, prescale_,
                          postscale_, residual, result_at(begin));
  } else {
    reduce_decode_cpu(in, wire_, local_at(begin), dtype_, n, prescale_, postscale_, residual, result_at(begin));
  }
}

void CpuRingKernels::decode_fp32(const void* in, int64_t n, float* out) const {
  if (fp8()) {
    fp8_decode_cpu(fp8_format(), static_cast<const uint8_t*>(in), n, 1.0f, out, DType::kFloat32, 0, fp8_num_blocks(n));
  } else {
    convert_cpu(in, wire_, out, DType::kFloat32, n, 1.0f, /*cache_result=*/true);
  }
}

void CpuRingKernels::sum_decoded(const void* const* payloads, int count, int64_t n, int64_t keep_begin,
                                 int64_t keep_end) {
  const std::unique_ptr<float[]> scratch(new float[2 * static_cast<size_t>(n)]);  // written before it is read
  float *sum = scratch.get(), *term = sum + n;
  decode_fp32(payloads[0], n, sum);
  for (int i = 1; i < count; ++i) {
    decode_fp32(payloads[i], n, term);
    for (int64_t j = 0; j < n; ++j) sum[j] += term[j];
  }
  convert_cpu(sum, DType::kFloat32, result_at(0), dtype_, n, postscale_);
  if (!residual_ || dtype_ == DType::kFloat32 || keep_begin >= keep_end) return;
  convert_cpu(result_at(keep_begin), dtype_, term + keep_begin, DType::kFloat32, keep_end - keep_begin, 1.0f);
  for (int64_t j = keep_begin; j < keep_end; ++j) {
    const float lost = sum[j] - term[j] / postscale_;
    if (std::isfinite(lost)) residual_[j] += lost;  // an overflowed sum leaves nothing to pay back
  }
}

void* CpuRingKernels::result_as_payload(int64_t begin) {
  return !scatter_ && codec_ == Codec::kNone && postscale_ == 1.0f ? result_at(begin) : nullptr;
}

uint32_t ring_tag_span(const RingPlan& plan) {
  return static_cast<uint32_t>(2 * std::max(plan.ranks() - 1, 1) * std::max(plan.max_slices(), 1));
}

void exchange_ring_calls(Transport& t, RingCall* table, uint32_t tag) {
  const int n = t.size(), r = t.rank();
  // every record straight to every rank: one hop of latency. Not over NCCL, which would connect
  // (buffers included) every pair of ranks for it, where the ring only ever uses its neighbours.
  if (n <= kDirectExchangeRanks && t.posts_receives_ahead()) {
    t.group_begin();
    for (int s = 1; s < n; ++s) {
      t.recv(&table[mod(r - s, n)], sizeof(RingCall), mod(r - s, n), tag);
      t.send(&table[r], sizeof(RingCall), mod(r + s, n), tag);
    }
    t.group_end();
    t.wait_all();
    return;
  }
  // all-gather around the ring, n - 1 hops but only the ring's two peers: step s forwards the
  // record of rank r - s
  for (int s = 0; s < n - 1; ++s) {
    t.group_begin();
    const int64_t h = t.recv(&table[mod(r - s - 1, n)], sizeof(RingCall), mod(r - 1, n), tag + s);
    t.send(&table[mod(r - s, n)], sizeof(RingCall), mod(r + 1, n), tag + s);
    t.group_end();
    t.wait(h);
  }
  t.wait_all();
}

namespace {

const char* dtype_name(int32_t dtype) {
  static const char* const names[] = {"float32", "float16", "bfloat16"};
  return dtype >= 0 && dtype < 3 ? names[dtype] : "unknown";
}

const char* op_name(int32_t op) {
  static const char* const names[] = {"all_reduce", "reduce_scatter", "all_gather"};
  return op >= 0 && op < 3 ? names[op] : "unknown";
}

const char* codec_name(int32_t codec) {
  static const char* const names[] = {"none", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"};
  return codec >= 0 && codec < 5 ? names[codec] : "unknown";
}

}  // namespace

void compare_ring_calls(const RingCall* table, int n, int self) {
  const std::string op = std::string("gradsync.") + op_name(table[self].op);
  std::ostringstream unprepared;
  for (int i = 0; i < n; ++i) {
    if (table[i].unprepared) unprepared << (unprepared.tellp() ? ", " : "") << i;
  }
  if (unprepared.tellp()) {
    throw std::invalid_argument(op + ": group rank(s) " + unprepared.str() + " could not prepare the call "
                                "(its arguments, allocating its workspaces, or an earlier call whose result it reads) "
                                "and raise the reason there; no rank has written anything");
  }
  std::ostringstream diff;
  const auto describe = [&](const RingCall& c) {
    // every field, and the scales to the last bit, as the records are compared byte for byte
    diff << std::setprecision(std::numeric_limits<float>::max_digits10) << "numel " << c.numel << ", dtype "
         << dtype_name(c.dtype) << ", codec " << codec_name(c.codec) << ", prescale " << c.prescale << ", postscale "
         << c.postscale << ", slices of " << c.slice_elems << " elements, schedule " << (c.direct ? "direct" : "ring")
         << ", operation " << op_name(c.op);
    if (c.layout) diff << ", layout " << c.layout << " (which tensors the buffer holds, or what follows the call)";
  };
  for (int i = 0; i < n; ++i) {
    if (std::memcmp(&table[i], &table[0], sizeof(RingCall)) != 0) {
      diff << " group rank " << i << " has ";
      describe(table[i]);
      diff << " but group rank 0 has ";
      describe(table[0]);
      diff << ";";
    }
  }
  if (!diff.str().empty()) {
    const bool layouts = std::any_of(table, table + n, [&](const RingCall& c) { return c.layout != table[0].layout; });
    throw std::invalid_argument(op + ": the ranks disagree on the call:" + diff.str() +
                                " every rank must pass the same numel, dtype, codec and scaling" +
                                (layouts ? " (gradsync.fsdp: and reduce the same parameters; "
                                           "hooks.hierarchical_average: and use one codec across the nodes)"
                                         : ""));
  }
}

void check_ring_call(Transport& t, const RingCall& call, uint32_t tag) {
  const int n = t.size();
  if (n == 1) return;
  auto table = std::make_unique<RingCall[]>(n);
  table[t.rank()] = call;
  try {
    exchange_ring_calls(t, table.get(), tag);
  } catch (...) {
    static_cast<void>(table.release());  // leaked on purpose: messages still in flight may read or write it
    throw;
  }
  compare_ring_calls(table.get(), n, t.rank());
}

namespace {

// Where one call's payloads live and how its messages are addressed; shared by both schedules.
struct RingCallLayout {
  RingCallLayout(Transport& t, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image, uint8_t* send_image,
                 uint32_t tag_base)
      : t(t), kernels(kernels), plan(plan), recv_image(recv_image), send_image(send_image), tag_base(tag_base),
        n(plan.ranks()), r(t.rank()), next(mod(r + 1, n)), prev(mod(r - 1, n)), own(mod(r + 1, n)),
        k_max(plan.max_slices()) {
    plan.layout([&](int64_t len) { return kernels.payload_bytes(len); }, offsets);
  }
  uint8_t* slot(uint8_t* image, int c, int k) const { return image + offsets[static_cast<size_t>(c) * k_max + k]; }
  int64_t bytes(int c, int k) const { return kernels.payload_bytes(plan.slice_len(c, k)); }
  uint32_t tag(int step, int k) const { return tag_base + static_cast<uint32_t>(step * k_max + k); }
  // Where a reduced payload of the all-gather is received: straight into the result when decoding
  // it would only copy it, else into the receive image.
  uint8_t* landing(int c, int k) const {
    uint8_t* result = in_result(c, k);
    return result ? result : slot(recv_image, c, k);
  }
  // Where this rank's outgoing payload of a slice is written and sent from: in place in the result
  // when it doubles as the payload (each element of the input is read once in the reduce-scatter,
  // by the kernel that overwrites it), else in the send image.
  uint8_t* outgoing(int c, int k) const {
    uint8_t* result = in_result(c, k);
    return result ? result : slot(send_image, c, k);
  }
  uint8_t* in_result(int c, int k) const {
    return static_cast<uint8_t*>(kernels.result_as_payload(plan.slice_begin(c, k)));
  }
  void encode(int c, int k) const { kernels.encode(plan.slice_begin(c, k), plan.slice_len(c, k), outgoing(c, k)); }
  void reduce_encode(int c, int k) const {
    kernels.reduce_encode(slot(recv_image, c, k), plan.slice_begin(c, k), plan.slice_len(c, k), outgoing(c, k));
  }
  void decode(const uint8_t* payload, int c, int k) const { kernels.decode(payload, plan.slice_begin(c, k), plan.slice_len(c, k)); }
  // A reduce-scatter's last hop, into the result (in: nullptr for a single rank).
  void reduce_decode(const uint8_t* in, int c, int k) const {
    kernels.reduce_decode(in, plan.slice_begin(c, k), plan.slice_len(c, k));
  }
  // This rank's own reduced slice into the result, unless it was reduced there.
  void decode_own(int k) const {
    if (!in_result(own, k)) decode(slot(send_image, own, k), own, k);
  }

  Transport& t;
  RingKernels& kernels;
  const RingPlan& plan;
  uint8_t *recv_image, *send_image;
  uint32_t tag_base;
  int n, r, next, prev, own, k_max;
  std::vector<int64_t> offsets;
};

// For a rendezvous transport: every receive of a phase is posted up front, and each slice is
// forwarded as soon as it is reduced. The phases `op` makes: both, or one of them.
void ring_posted_ahead(const RingCallLayout& L, RingOp op) {
  Transport& t = L.t;
  const RingPlan& plan = L.plan;
  const int n = L.n, r = L.r;
  std::vector<int64_t> handles(static_cast<size_t>(n - 1) * L.k_max, -1);
  if (op == kAllGather) {
    for (int k = 0; k < plan.slices(L.own); ++k) L.encode(L.own, k);
  } else {
    // Reduce-scatter: step s receives chunk r-s-1, adds the local part and forwards it.
    for (int s = 0; s < n - 1; ++s) {
      const int c = mod(r - s - 1, n);
      for (int k = 0; k < plan.slices(c); ++k) handles[s * L.k_max + k] = t.recv(L.slot(L.recv_image, c, k), L.bytes(c, k), L.prev, L.tag(s, k));
    }
    for (int k = 0; k < plan.slices(r); ++k) {
      L.encode(r, k);
      t.send(L.outgoing(r, k), L.bytes(r, k), L.next, L.tag(0, k));
    }
    for (int s = 0; s < n - 1; ++s) {
      const int c = mod(r - s - 1, n);
      for (int k = 0; k < plan.slices(c); ++k) {
        t.wait(handles[s * L.k_max + k]);
        if (s == n - 2 && op == kReduceScatter) {
          L.reduce_decode(L.slot(L.recv_image, c, k), c, k);
          continue;
        }
        L.reduce_encode(c, k);
        if (s < n - 2) t.send(L.outgoing(c, k), L.bytes(c, k), L.next, L.tag(s + 1, k));
      }
    }
    t.wait_all();
    if (op == kReduceScatter) return;
  }

  // All-gather of the encoded reduced chunks: this rank owns chunk r+1; step s receives chunk r-s,
  // forwards it, then decodes it into the result (unless it was received there).
  for (int s = 0; s < n - 1; ++s) {
    const int c = mod(r - s, n);
    for (int k = 0; k < plan.slices(c); ++k) handles[s * L.k_max + k] = t.recv(L.landing(c, k), L.bytes(c, k), L.prev, L.tag(n - 1 + s, k));
  }
  for (int k = 0; k < plan.slices(L.own); ++k) t.send(L.outgoing(L.own, k), L.bytes(L.own, k), L.next, L.tag(n - 1, k));
  for (int k = 0; k < plan.slices(L.own); ++k) L.decode_own(k);
  for (int s = 0; s < n - 1; ++s) {
    const int c = mod(r - s, n);
    for (int k = 0; k < plan.slices(c); ++k) {
      t.wait(handles[s * L.k_max + k]);
      uint8_t* payload = L.landing(c, k);
      if (s < n - 2) t.send(payload, L.bytes(c, k), L.next, L.tag(n + s, k));
      if (payload == L.slot(L.recv_image, c, k)) L.decode(payload, c, k);
    }
  }
  t.wait_all();
}

// For a stream-ordered transport: hop (step, slice) sends and receives in one group; every rank
// issues the hops in the same order, and a chunk with fewer slices leaves its partner's receive
// unpaired. The host never waits: wait() orders the kernels after the receive on the device. A
// send waits for every kernel issued before it, so each hop's kernel (and its wait) is issued after
// the next hop: the transfer of slice k+1 then overlaps the kernel of slice k instead of following
// it, unless that send reads what the kernel writes. The phases `op` makes: both, or one of them.
void ring_paired(const RingCallLayout& L, RingOp op) {
  Transport& t = L.t;
  const RingPlan& plan = L.plan;
  const int n = L.n, r = L.r;
  std::function<void()> pending;
  const uint8_t* pending_writes = nullptr;
  auto flush = [&] {
    if (pending) pending();
    pending = nullptr;
    pending_writes = nullptr;
  };
  auto defer = [&](std::function<void()> kernel, const uint8_t* writes) {
    pending = std::move(kernel);
    pending_writes = writes;
  };
  auto hop = [&](int step, int send_c, const uint8_t* send_at, int recv_c, uint8_t* recv_at, int k) {
    const bool sends = k < plan.slices(send_c);
    if (sends && send_at == pending_writes) flush();
    t.group_begin();
    if (sends) t.send(send_at, L.bytes(send_c, k), L.next, L.tag(step, k));
    const int64_t h = k < plan.slices(recv_c) ? t.recv(recv_at, L.bytes(recv_c, k), L.prev, L.tag(step, k)) : -1;
    t.group_end();
    flush();
    return h;
  };
  if (op == kAllGather) {
    for (int k = 0; k < plan.slices(L.own); ++k) L.encode(L.own, k);
  } else {
    for (int k = 0; k < plan.slices(r); ++k) L.encode(r, k);
    for (int s = 0; s < n - 1; ++s) {
      const int cs = mod(r - s, n), cr = mod(r - s - 1, n);
      for (int k = 0; k < std::max(plan.slices(cs), plan.slices(cr)); ++k) {
        const int64_t h = hop(s, cs, L.outgoing(cs, k), cr, L.slot(L.recv_image, cr, k), k);
        if (h >= 0 && s == n - 2 && op == kReduceScatter) {  // the last hop's sum goes on no wire
          defer([&t, &L, h, cr, k] { t.wait(h); L.reduce_decode(L.slot(L.recv_image, cr, k), cr, k); }, nullptr);
        } else if (h >= 0) {
          defer([&t, &L, h, cr, k] { t.wait(h); L.reduce_encode(cr, k); }, L.outgoing(cr, k));
        }
      }
    }
    flush();
    if (op == kReduceScatter) {
      t.wait_all();
      return;
    }
    t.fence();  // the all-gather may land in the input, which the reduce-scatter kernels read
  }
  for (int s = 0; s < n - 1; ++s) {
    const int cs = mod(r + 1 - s, n), cr = mod(r - s, n);
    for (int k = 0; k < std::max(plan.slices(cs), plan.slices(cr)); ++k) {
      const uint8_t* payload = k < plan.slices(cs) ? (s == 0 ? L.outgoing(L.own, k) : L.landing(cs, k)) : nullptr;
      const int64_t h = hop(n - 1 + s, cs, payload, cr, L.landing(cr, k), k);
      if (h >= 0 && L.landing(cr, k) == L.slot(L.recv_image, cr, k)) {
        defer([&t, &L, h, cr, k] { t.wait(h); L.decode(L.landing(cr, k), cr, k); }, nullptr);
      } else {
        t.wait(h);
      }
    }
    if (s == 0) {
      for (int k = 0; k < plan.slices(L.own); ++k) L.decode_own(k);
    }
  }
  flush();
  t.wait_all();
}

}  // namespace

namespace {
void ring_run(Transport& t, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image, uint8_t* send_image,
              uint32_t tag_base, RingOp op) {
  const RingCallLayout layout(t, kernels, plan, recv_image, send_image, tag_base);
  if (plan.ranks() == 1) {
    // no wire: an all-reduce or all-gather keeps its numerics (the result is the decoded encoding,
    // as other ranks would see it); a reduce-scatter's sum is never encoded anyway
    for (int k = 0; k < plan.slices(0); ++k) {
      if (op != kReduceScatter) layout.encode(0, k);
      else layout.reduce_decode(nullptr, 0, k);
    }
    for (int k = 0; op != kReduceScatter && k < plan.slices(0); ++k) layout.decode_own(k);
    return;
  }
  if (t.posts_receives_ahead()) ring_posted_ahead(layout, op);
  else ring_paired(layout, op);
}
}  // namespace

void ring_allreduce(Transport& t, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image,
                    uint8_t* send_image, uint32_t tag_base) {
  ring_run(t, kernels, plan, recv_image, send_image, tag_base, kAllReduce);
}

void ring_reduce_scatter(Transport& t, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image,
                         uint8_t* send_image, uint32_t tag_base) {
  ring_run(t, kernels, plan, recv_image, send_image, tag_base, kReduceScatter);
}

void ring_all_gather(Transport& t, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image,
                     uint8_t* send_image, uint32_t tag_base) {
  ring_run(t, kernels, plan, recv_image, send_image, tag_base, kAllGather);
}

int64_t direct_image_bytes(const RingKernels& kernels, int64_t numel, int ranks) {
  return ranks * ((kernels.payload_bytes(numel) + 15) / 16 * 16);
}

void direct_allreduce(Transport& t, CpuRingKernels& kernels, int64_t numel, uint8_t* recv_image, uint8_t* send_image,
                      uint32_t tag) {
  const int n = t.size(), r = t.rank();
  const int64_t bytes = kernels.payload_bytes(numel), stride = direct_image_bytes(kernels, numel, 1);
  std::vector<const void*> payloads(static_cast<size_t>(n));
  kernels.encode(0, numel, send_image);
  payloads[r] = send_image;
  t.group_begin();  // everything posted before any wait, as a rendezvous transport needs
  for (int s = 1; s < n; ++s) {
    const int peer = mod(r - s, n);
    payloads[peer] = recv_image + peer * stride;
    t.recv(recv_image + peer * stride, bytes, peer, tag);
  }
  for (int s = 1; s < n; ++s) t.send(send_image, bytes, mod(r + s, n), tag);
  t.group_end();
  t.wait_all();
  kernels.sum_decoded(payloads.data(), n, numel, numel * r / n, numel * (r + 1) / n);
}

}  // namespace gradsync
