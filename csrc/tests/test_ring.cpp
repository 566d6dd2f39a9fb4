// The ring schedule on an in-process transport: the plan's chunk/slice/layout arithmetic, and whole
// all-reduces on threads (one per rank) whose results must agree bitwise and match the exact sum,
// every message checked for its tag and for landing on a send buffer still in use.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "check.h"
#include "ring/ring_allreduce.h"

using namespace gradsync;

namespace {

// Rendezvous semantics like gloo's: a message moves once both its send and its receive are posted,
// and its sizes must match.
class Hub {
 public:
  struct Message {
    const void* send_data = nullptr;
    void* recv_data = nullptr;
    int64_t send_bytes = -1, recv_bytes = -1;
    bool done = false;
    std::string error;
  };
  std::shared_ptr<Message> post(int src, int dst, uint32_t tag, bool is_send, const void* send, void* recv,
                                int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& queue = pending_[{src, dst, tag}];
    std::shared_ptr<Message> m;
    for (auto& candidate : queue) {  // the oldest message still missing this side
      if ((is_send ? candidate->send_bytes : candidate->recv_bytes) < 0) { m = candidate; break; }
    }
    if (!m) queue.push_back(m = std::make_shared<Message>());
    if (is_send) { m->send_data = send; m->send_bytes = bytes; } else { m->recv_data = recv; m->recv_bytes = bytes; }
    if (m->send_bytes >= 0 && m->recv_bytes >= 0) {
      if (m->send_bytes != m->recv_bytes) m->error = "size mismatch";
      else std::memcpy(m->recv_data, m->send_data, m->send_bytes);
      m->done = true;
      queue.erase(std::find(queue.begin(), queue.end(), m));
      cv_.notify_all();
    }
    return m;
  }
  void wait(const std::shared_ptr<Message>& m) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, std::chrono::seconds(20), [&] { return m->done; })) throw std::runtime_error("timeout");
    if (!m->error.empty()) throw std::runtime_error(m->error);
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::tuple<int, int, uint32_t>, std::vector<std::shared_ptr<Message>>> pending_;
};

// `in_order`: NCCL's matching instead of gloo's: tags are ignored, messages between two ranks pair
// up in the order they were issued, and the ring must use its paired (stream-ordered) schedule. As
// on NCCL's stream, a group (or a lone send or receive) starts after the previous one has finished,
// so a payload received in one group can be forwarded in a later one.
class LocalTransport : public Transport {
 public:
  LocalTransport(Hub& hub, int rank, int size, bool in_order = false)
      : hub_(hub), rank_(rank), size_(size), in_order_(in_order) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool posts_receives_ahead() const override { return !in_order_; }
  void group_begin() override {
    if (depth_++ == 0) serialize();
  }
  void group_end() override { CHECK(--depth_ >= 0, "group_end without group_begin"); }
  int64_t send(const void* data, int64_t bytes, int peer, uint32_t tag) override {
    if (depth_ == 0) serialize();
    if (in_order_) {  // a stream-ordered send reads its payload as the kernels issued before it left it
      sent_.emplace_back(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + bytes);
      data = sent_.back().data();
    }
    messages_.push_back(hub_.post(rank_, peer, in_order_ ? 0 : tag, true, data, nullptr, bytes));
    return static_cast<int64_t>(messages_.size()) - 1;
  }
  int64_t recv(void* data, int64_t bytes, int peer, uint32_t tag) override {
    if (depth_ == 0) serialize();
    messages_.push_back(hub_.post(peer, rank_, in_order_ ? 0 : tag, false, nullptr, data, bytes));
    return static_cast<int64_t>(messages_.size()) - 1;
  }
  void wait(int64_t handle) override {
    if (handle >= 0) hub_.wait(messages_.at(handle));
  }
  void wait_all() override {
    for (auto& m : messages_) hub_.wait(m);
    messages_.clear();
  }

 private:
  void serialize() {
    if (in_order_) for (auto& m : messages_) hub_.wait(m);
  }
  Hub& hub_;
  int rank_, size_;
  bool in_order_;
  int depth_ = 0;
  std::vector<std::shared_ptr<Hub::Message>> messages_;
  std::deque<std::vector<uint8_t>> sent_;
};

// Passes everything on to another transport; the checks below watch what goes through. What one
// finds is reported after the call, so that no rank stops halfway and leaves its peers waiting.
class Forwarding : public Transport {
 public:
  explicit Forwarding(Transport& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int64_t send(const void* data, int64_t bytes, int peer, uint32_t tag) override {
    return inner_.send(data, bytes, peer, tag);
  }
  int64_t recv(void* data, int64_t bytes, int peer, uint32_t tag) override {
    return inner_.recv(data, bytes, peer, tag);
  }
  void wait(int64_t handle) override { inner_.wait(handle); }
  void wait_all() override { inner_.wait_all(); }
  bool posts_receives_ahead() const override { return inner_.posts_receives_ahead(); }
  void group_begin() override { inner_.group_begin(); }
  void group_end() override { inner_.group_end(); }
  void fence() override { inner_.fence(); }
  const std::string& problems() const { return problems_; }  // the first one found, "" if none

 protected:
  void flag(const std::string& problem) {
    if (problems_.empty()) problems_ = problem;
  }
  Transport& inner_;
  std::string problems_;
};

// Records every message of one call as (direction, peer, tag). Each tag must lie in the call's
// [base, base + span), or it could pair with a message of the call before or after; none may
// repeat, as the ring gives every (step, slice) a tag of its own (which is what the span counts),
// so that no two of its messages rely on the order of posting alone to pair up.
class TagLog : public Forwarding {
 public:
  TagLog(Transport& inner, uint32_t base, uint32_t span) : Forwarding(inner), base_(base), span_(span) {}
  int64_t send(const void* data, int64_t bytes, int peer, uint32_t tag) override {
    note(true, peer, tag);
    return inner_.send(data, bytes, peer, tag);
  }
  int64_t recv(void* data, int64_t bytes, int peer, uint32_t tag) override {
    note(false, peer, tag);
    return inner_.recv(data, bytes, peer, tag);
  }

 private:
  void note(bool sends, int peer, uint32_t tag) {
    const std::string message = std::string(sends ? "send to " : "receive from ") + std::to_string(peer) + " tag " +
                                std::to_string(tag);
    if (tag - base_ >= span_) {
      flag(message + " outside [" + std::to_string(base_) + ", " + std::to_string(base_ + span_) + ")");
    } else if (!seen_.emplace(sends, peer, tag).second) {
      flag(message + " repeated");
    }
  }
  uint32_t base_, span_;
  std::set<std::tuple<bool, int, uint32_t>> seen_;
};

// A rendezvous transport (gloo) may read a send's buffer until the send is waited, so a receive
// posted over that buffer can overwrite bytes not yet sent. The hub copies a send as soon as it is
// matched, which hides this; so the receive is flagged when posted. A stream-ordered transport
// runs a receive after every send issued before it: nothing to flag there.
class SendBufferGuard : public Forwarding {
 public:
  using Forwarding::Forwarding;
  int64_t send(const void* data, int64_t bytes, int peer, uint32_t tag) override {
    const int64_t handle = inner_.send(data, bytes, peer, tag);
    if (posts_receives_ahead()) unwaited_[handle] = {static_cast<const uint8_t*>(data), bytes};
    return handle;
  }
  int64_t recv(void* data, int64_t bytes, int peer, uint32_t tag) override {
    const uint8_t* at = static_cast<const uint8_t*>(data);
    for (const auto& sent : unwaited_) {
      if (at < sent.second.first + sent.second.second && sent.second.first < at + bytes) {
        flag("receive from " + std::to_string(peer) + " tag " + std::to_string(tag) +
             " posted over the buffer of a send not yet waited");
      }
    }
    return inner_.recv(data, bytes, peer, tag);
  }
  void wait(int64_t handle) override {
    inner_.wait(handle);
    unwaited_.erase(handle);
  }
  void wait_all() override {
    inner_.wait_all();
    unwaited_.clear();
  }

 private:
  std::map<int64_t, std::pair<const uint8_t*, int64_t>> unwaited_;  // by handle: data, bytes
};

// Runs fn(rank) on one thread per rank; returns what each threw ("" if nothing).
template <typename Fn>
std::vector<std::string> on_ranks(int ranks, Fn fn) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(ranks);
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

constexpr uint32_t kCallTag = 1u << 20, kTagBase = 1000;

// Rank r's part of one call: the record exchange, then the schedule `call` names, on a transport
// that checks its tags and its send buffers; throws what either found.
void run_rank(Hub& hub, int r, bool in_order, CpuRingKernels& kernels, const RingPlan& plan, const RingCall& call) {
  LocalTransport local(hub, r, plan.ranks(), in_order);
  SendBufferGuard guard(local);
  check_ring_call(guard, call, kCallTag);
  std::vector<int64_t> offsets;
  const int64_t bytes = call.direct ? direct_image_bytes(kernels, call.numel, plan.ranks())
                                    : plan.layout([&](int64_t n) { return kernels.payload_bytes(n); }, offsets);
  std::vector<uint8_t> recv_image(bytes + 1), send_image(bytes + 1);
  TagLog tags(guard, kTagBase, call.direct ? 1 : ring_tag_span(plan));
  uint8_t *recv = recv_image.data(), *send = send_image.data();
  if (call.direct) direct_allreduce(tags, kernels, call.numel, recv, send, kTagBase);
  else if (call.op == kReduceScatter) ring_reduce_scatter(tags, kernels, plan, recv, send, kTagBase);
  else if (call.op == kAllGather) ring_all_gather(tags, kernels, plan, recv, send, kTagBase);
  else ring_allreduce(tags, kernels, plan, recv, send, kTagBase);
  const std::string problems = tags.problems() + (tags.problems().empty() ? "" : "; ") + guard.problems();
  if (!problems.empty()) throw std::logic_error(problems);
}

// `ranks` inputs of small integers, whose every partial sum is exact in fp16 and bf16, and their sum.
std::vector<std::vector<float>> small_integers(int ranks, int64_t numel, uint32_t seed, std::vector<double>& exact) {
  std::vector<std::vector<float>> data(ranks, std::vector<float>(numel));
  exact.assign(numel, 0.0);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(-8, 8);
  for (auto& d : data) {
    for (int64_t i = 0; i < numel; ++i) exact[i] += d[i] = static_cast<float>(small(rng));
  }
  return data;
}

void check_plan(int64_t numel, int ranks, int64_t slice) {
  const RingPlan plan(numel, ranks, slice);
  int64_t covered = 0;
  for (int c = 0; c < ranks; ++c) {
    CHECK(plan.chunk_begin(c) == covered, "numel %ld ranks %d: chunk %d starts at %ld", long(numel), ranks, c,
          long(plan.chunk_begin(c)));
    CHECK(plan.chunk_begin(c) % kRingAlign == 0 || plan.chunk_len(c) == 0, "chunk %d misaligned", c);
    CHECK(plan.slices(c) <= plan.max_slices(), "chunk %d has more slices than chunk 0", c);
    int64_t in_chunk = 0;
    for (int k = 0; k < plan.slices(c); ++k) {
      CHECK(plan.slice_begin(c, k) == plan.chunk_begin(c) + in_chunk, "slice %d/%d starts wrong", c, k);
      CHECK(plan.slice_len(c, k) > 0 && plan.slice_begin(c, k) % kRingAlign == 0, "slice %d/%d empty or misaligned", c, k);
      in_chunk += plan.slice_len(c, k);
    }
    CHECK(in_chunk == plan.chunk_len(c), "chunk %d slices cover %ld of %ld", c, long(in_chunk), long(plan.chunk_len(c)));
    covered += plan.chunk_len(c);
  }
  CHECK(covered == numel, "chunks cover %ld of %ld", long(covered), long(numel));
  std::vector<int64_t> offsets;
  const int64_t image = plan.layout([](int64_t n) { return fp8_payload_bytes(n); }, offsets);
  int64_t expected_end = 0;
  for (int c = 0; c < ranks; ++c) {
    for (int k = 0; k < plan.slices(c); ++k) {
      const int64_t at = offsets[static_cast<size_t>(c) * plan.max_slices() + k];
      CHECK(at % 16 == 0 && at == expected_end, "payload %d/%d at %ld", c, k, long(at));
      expected_end = at + (fp8_payload_bytes(plan.slice_len(c, k)) + 15) / 16 * 16;
    }
  }
  CHECK(image == expected_end, "image size %ld", long(image));
}

// `direct`: direct_allreduce instead of the ring; `prescale` (a power of two, so that sums stay
// exact); `apart`: the result in a buffer of its own instead of over the input, which must then be
// left as it was.
void check_allreduce(int ranks, int64_t numel, Codec codec, int64_t slice, bool in_order, bool direct = false,
                     float prescale = 1.0f, bool apart = false) {
  std::vector<double> exact;
  std::vector<std::vector<float>> data = small_integers(ranks, numel, static_cast<uint32_t>(numel * 31 + ranks), exact);
  const std::vector<std::vector<float>> inputs = data;
  std::vector<std::vector<float>> results(ranks, std::vector<float>(numel, -1.0f));
  Hub hub;
  const RingPlan plan(numel, ranks, slice);
  const std::vector<std::string> errors = on_ranks(ranks, [&](int r) {
    CpuRingKernels kernels(codec, data[r].data(), apart ? results[r].data() : data[r].data(), DType::kFloat32,
                           prescale, 1.0f);
    run_rank(hub, r, in_order, kernels, plan, RingCall{numel, 0, int32_t(codec), prescale, 1.0f, slice, direct, 0, 0});
  });
  for (int r = 0; r < ranks; ++r) {
    CHECK(errors[r].empty(), "ranks %d numel %ld codec %d%s%s: rank %d: %s", ranks, long(numel), int(codec),
          in_order ? ", in order" : "", direct ? ", direct" : "", r, errors[r].c_str());
  }
  if (apart) {
    for (int r = 0; r < ranks; ++r) CHECK(data[r] == inputs[r], "ranks %d codec %d: rank %d's input changed", ranks, int(codec), r);
    data = results;
  }
  for (double& e : exact) e *= prescale;
  for (int r = 1; r < ranks; ++r) {
    CHECK(std::memcmp(data[r].data(), data[0].data(), numel * 4) == 0, "ranks %d numel %ld codec %d: rank %d differs",
          ranks, long(numel), int(codec), r);
  }
  // fp8: at most one rounding of relative size `rel` per hop, of partial sums below 8 * ranks; the
  // direct exchange rounds only each contribution, below 8, once
  const double rel = codec == Codec::kFp8E4M3 ? 1.0 / 16 : codec == Codec::kFp8E5M2 ? 1.0 / 8 : 0.0;
  for (int64_t i = 0; i < numel; ++i) {
    const double tolerance = ranks * rel * 8.0 * prescale * (direct ? 1 : ranks);
    CHECK(std::fabs(data[0][i] - exact[i]) <= tolerance, "ranks %d numel %ld codec %d: [%ld] %g vs %g", ranks,
          long(numel), int(codec), long(i), data[0][i], exact[i]);
  }
}

// A reduce-scatter's plan: chunks of exactly `chunk` elements, the ring's chunk c the buffer's c + n - 1.
void check_scatter_plan(int64_t chunk, int ranks, int64_t slice) {
  const RingPlan plan = RingPlan::scatter(chunk * ranks, ranks, slice);
  for (int c = 0; c < ranks; ++c) {
    CHECK(plan.chunk_begin(c) == (c + ranks - 1) % ranks * chunk && plan.chunk_len(c) == chunk,
          "chunk %ld ranks %d: ring chunk %d at %ld, %ld long", long(chunk), ranks, c, long(plan.chunk_begin(c)),
          long(plan.chunk_len(c)));
    CHECK(plan.slices(c) == plan.max_slices(), "ring chunk %d: %d slices of %d", c, plan.slices(c), plan.max_slices());
    int64_t in_chunk = 0;
    for (int k = 0; k < plan.slices(c); ++k) {
      CHECK(plan.slice_begin(c, k) == plan.chunk_begin(c) + in_chunk && plan.slice_len(c, k) > 0, "slice %d/%d", c, k);
      in_chunk += plan.slice_len(c, k);
    }
    CHECK(in_chunk == chunk, "ring chunk %d: slices cover %ld of %ld", c, long(in_chunk), long(chunk));
  }
}

// Rank r's result must be the exact sum of chunk r (small integers; fp8 within its rounding), the
// input untouched, or (`in_place`) the result written over the input's own chunk.
void check_reduce_scatter(int ranks, int64_t chunk, Codec codec, int64_t slice, bool in_order, bool in_place) {
  const int64_t numel = chunk * ranks;
  std::vector<double> exact;
  std::vector<std::vector<float>> data = small_integers(ranks, numel, static_cast<uint32_t>(chunk * 17 + ranks), exact);
  const std::vector<std::vector<float>> inputs = data;
  std::vector<std::vector<float>> results(ranks, std::vector<float>(chunk, -1.0f));
  Hub hub;
  const RingPlan plan = RingPlan::scatter(numel, ranks, slice);
  const std::vector<std::string> errors = on_ranks(ranks, [&](int r) {
    CpuRingKernels kernels(codec, data[r].data(), data[r].data(), DType::kFloat32, 1.0f, 1.0f);
    kernels.scatter_into(in_place ? data[r].data() + r * chunk : results[r].data(), r * chunk);
    run_rank(hub, r, in_order, kernels, plan, RingCall{numel, 0, int32_t(codec), 1.0f, 1.0f, slice, 0, 1, 0});
  });
  const double rel = codec == Codec::kFp8E4M3 ? 1.0 / 16 : codec == Codec::kFp8E5M2 ? 1.0 / 8 : 0.0;
  for (int r = 0; r < ranks; ++r) {
    CHECK(errors[r].empty(), "reduce-scatter ranks %d chunk %ld codec %d: rank %d: %s", ranks, long(chunk), int(codec),
          r, errors[r].c_str());
    for (int64_t i = 0; i < numel; ++i) {
      if (in_place && i / std::max<int64_t>(chunk, 1) == r) continue;
      CHECK(data[r][i] == inputs[r][i], "reduce-scatter ranks %d codec %d: rank %d's input changed at %ld", ranks,
            int(codec), r, long(i));
    }
    const float* result = in_place ? data[r].data() + r * chunk : results[r].data();
    for (int64_t i = 0; i < chunk; ++i) {
      CHECK(std::fabs(result[i] - exact[r * chunk + i]) <= ranks * rel * 8.0 * ranks,
            "reduce-scatter ranks %d chunk %ld codec %d%s: rank %d [%ld] %g vs %g", ranks, long(chunk), int(codec),
            in_order ? ", in order" : "", r, long(i), result[i], exact[r * chunk + i]);
    }
  }
}

// In place, every rank's chunk r must become rank r's: its exact values with "none" and the cast
// codecs (small integers), within fp8's rounding otherwise; the same bits on every rank, its own
// chunk's included.
void check_all_gather(int ranks, int64_t chunk, Codec codec, int64_t slice, bool in_order) {
  const int64_t numel = chunk * ranks;
  std::vector<double> unused;
  const std::vector<std::vector<float>> parts =
      small_integers(ranks, chunk, static_cast<uint32_t>(chunk * 7 + ranks), unused);
  std::vector<std::vector<float>> data(ranks, std::vector<float>(numel, std::nanf("")));
  for (int r = 0; r < ranks; ++r) std::copy(parts[r].begin(), parts[r].end(), data[r].begin() + r * chunk);
  Hub hub;
  const RingPlan plan = RingPlan::scatter(numel, ranks, slice);
  const std::vector<std::string> errors = on_ranks(ranks, [&](int r) {
    CpuRingKernels kernels(codec, data[r].data(), data[r].data(), DType::kFloat32, 1.0f, 1.0f);
    run_rank(hub, r, in_order, kernels, plan, RingCall{numel, 0, int32_t(codec), 1.0f, 1.0f, slice, 0, kAllGather, 0});
  });
  const double rel = codec == Codec::kFp8E4M3 ? 1.0 / 16 : codec == Codec::kFp8E5M2 ? 1.0 / 8 : 0.0;
  for (int r = 0; r < ranks; ++r) {
    CHECK(errors[r].empty(), "all-gather ranks %d chunk %ld codec %d: rank %d: %s", ranks, long(chunk), int(codec), r,
          errors[r].c_str());
    CHECK(std::memcmp(data[r].data(), data[0].data(), numel * sizeof(float)) == 0,
          "all-gather ranks %d chunk %ld codec %d: rank %d's result differs from rank 0's", ranks, long(chunk),
          int(codec), r);
    for (int64_t i = 0; i < numel; ++i) {
      const float expected = parts[i / chunk][i % chunk];
      CHECK(std::fabs(data[r][i] - expected) <= rel * std::fabs(expected), "all-gather ranks %d chunk %ld codec %d%s: "
            "rank %d [%ld] %g vs %g", ranks, long(chunk), int(codec), in_order ? ", in order" : "", r, long(i),
            data[r][i], expected);
    }
  }
}

// Codec "none" carries the input's own dtype, the cast codecs theirs, fp8 codes and block scales.
void check_payload_layout() {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const auto bytes = [dtype](Codec codec, int64_t n) {
      return CpuRingKernels(codec, nullptr, nullptr, dtype, 1.0f, 1.0f).payload_bytes(n);
    };
    for (int64_t n : {1L, 129L, 1009L}) {
      CHECK(bytes(Codec::kNone, n) == n * dtype_size(dtype), "dtype %d: codec none, %ld elements in %ld bytes",
            int(dtype), long(n), long(bytes(Codec::kNone, n)));
      CHECK(bytes(Codec::kFp16, n) == 2 * n && bytes(Codec::kBf16, n) == 2 * n, "dtype %d: cast codecs", int(dtype));
      CHECK(bytes(Codec::kFp8E4M3, n) == fp8_payload_bytes(n) && bytes(Codec::kFp8E5M2, n) == fp8_payload_bytes(n),
            "dtype %d: fp8 codecs", int(dtype));
    }
  }
}

std::vector<uint8_t> as_dtype(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(&bytes[4 * i], &values[i], 4);
    } else {
      const uint16_t h = dtype == DType::kFloat16 ? float_to_half_bits(values[i]) : float_to_bf16_bits(values[i]);
      std::memcpy(&bytes[2 * i], &h, 2);
    }
  }
  return bytes;
}

double element(const std::vector<uint8_t>& bytes, DType dtype, int64_t i) {
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, &bytes[4 * i], 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, &bytes[2 * i], 2);
  return dtype == DType::kFloat16 ? half_bits_to_float(h) : bf16_bits_to_float(h);
}

// Any input dtype and both scales, the result in place: the all-reduce on the ring or (`direct`) by
// the direct exchange, or (`scatter`; numel a multiple of ranks) the reduce-scatter into the input's
// own chunk. Inputs are small integers and scales powers of two, so the cast codecs stay exact in
// every dtype; fp8 is bounded as in check_allreduce, plus the rounding of its sums to the dtype.
void check_scaled(int ranks, int64_t numel, DType dtype, Codec codec, float prescale, float postscale, bool in_order,
                  bool direct, bool scatter) {
  std::vector<double> exact;
  const std::vector<std::vector<float>> values =
      small_integers(ranks, numel, static_cast<uint32_t>(numel * 13 + ranks * 3 + int(dtype)), exact);
  std::vector<std::vector<uint8_t>> data;
  for (const auto& v : values) data.push_back(as_dtype(v, dtype));
  const int64_t chunk = numel / ranks, size = dtype_size(dtype);
  Hub hub;
  const RingPlan plan = scatter ? RingPlan::scatter(numel, ranks, 256) : RingPlan(numel, ranks, 256);
  const std::vector<std::string> errors = on_ranks(ranks, [&](int r) {
    CpuRingKernels kernels(codec, data[r].data(), data[r].data(), dtype, prescale, postscale);
    if (scatter) kernels.scatter_into(data[r].data() + r * chunk * size, r * chunk);
    run_rank(hub, r, in_order, kernels, plan,
             RingCall{numel, int32_t(dtype), int32_t(codec), prescale, postscale, 256, direct, scatter, 0});
  });
  char what[160];
  std::snprintf(what, sizeof what, "%s ranks %d numel %ld dtype %d codec %d scales %g, %g%s",
                scatter ? "reduce-scatter" : direct ? "direct all-reduce" : "all-reduce", ranks, long(numel),
                int(dtype), int(codec), prescale, postscale, in_order ? ", in order" : "");
  const double rel = codec == Codec::kFp8E4M3 ? 1.0 / 16 : codec == Codec::kFp8E5M2 ? 1.0 / 8 : 0.0;
  const double fp8_bound = ranks * rel * 8.0 * (direct ? 1 : ranks) * prescale * postscale;
  const double to_dtype = rel == 0 || dtype == DType::kFloat32 ? 0 : dtype == DType::kFloat16 ? 0x1p-11 : 0x1p-8;
  for (int r = 0; r < ranks; ++r) {
    CHECK(errors[r].empty(), "%s: rank %d: %s", what, r, errors[r].c_str());
    if (!scatter && r > 0) {
      CHECK(data[r] == data[0], "%s: rank %d differs", what, r);
      continue;
    }
    for (int64_t i = scatter ? r * chunk : 0; i < (scatter ? (r + 1) * chunk : numel); ++i) {
      const double want = exact[i] * prescale * postscale, got = element(data[r], dtype, i);
      CHECK(std::fabs(got - want) <= fp8_bound + std::fabs(want) * to_dtype, "%s: rank %d [%ld] %g vs %g", what, r,
            long(i), got, want);
    }
  }
}

// Error feedback from zero residuals: what each rank's encodings lost, summed over the ranks, is
// the result's error, exact - result / postscale, up to the fp32 roundings of the hops' sums.
// Inputs are not integers, so that every lossy codec loses something, and slices of 128 elements
// start all over the buffer, where each kernel must use the residuals at its own offset.
void check_error_feedback(int ranks, int64_t numel, Codec codec, bool in_order, bool direct, bool scatter) {
  const float prescale = 0.5f, postscale = 0.25f;
  std::mt19937 rng(static_cast<uint32_t>(numel * 7 + ranks));
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  std::vector<std::vector<float>> data(ranks, std::vector<float>(numel));
  std::vector<std::vector<float>> residuals(ranks, std::vector<float>(numel, 0.0f));
  std::vector<double> exact(numel, 0.0);
  for (auto& d : data) {
    for (int64_t i = 0; i < numel; ++i) exact[i] += (d[i] = value(rng)) * prescale;
  }
  const std::vector<std::vector<float>> inputs = data;
  const int64_t chunk = numel / ranks;
  Hub hub;
  const RingPlan plan = scatter ? RingPlan::scatter(numel, ranks, 128) : RingPlan(numel, ranks, 128);
  const std::vector<std::string> errors = on_ranks(ranks, [&](int r) {
    CpuRingKernels kernels(codec, data[r].data(), data[r].data(), DType::kFloat32, prescale, postscale);
    kernels.set_error_feedback(residuals[r].data());
    if (scatter) kernels.scatter_into(data[r].data() + r * chunk, r * chunk);
    run_rank(hub, r, in_order, kernels, plan,
             RingCall{numel, 0, int32_t(codec), prescale, postscale, 128, direct, scatter, 0});
  });
  for (int r = 0; r < ranks; ++r) {
    CHECK(errors[r].empty(), "error feedback ranks %d codec %d: rank %d: %s", ranks, int(codec), r, errors[r].c_str());
  }
  // Inputs that are not integers make the order of the fp32 sums show: every rank must hold the
  // same bits, and the direct exchange adds the contributions in rank order.
  for (int r = 1; r < ranks && !scatter; ++r) {
    CHECK(std::memcmp(data[r].data(), data[0].data(), numel * 4) == 0, "error feedback ranks %d codec %d%s%s: rank %d "
          "differs", ranks, int(codec), in_order ? ", in order" : "", direct ? ", direct" : "", r);
  }
  for (int64_t i = 0; i < numel && direct && codec == Codec::kNone; ++i) {
    float sum = 0.0f;
    for (int r = 0; r < ranks; ++r) sum += inputs[r][i] * prescale;
    CHECK(data[0][i] == sum * postscale, "direct exchange ranks %d%s: [%ld] %.9g, not the sum in rank order %.9g",
          ranks, in_order ? ", in order" : "", long(i), data[0][i], sum * postscale);
  }
  for (int64_t i = 0; i < numel; ++i) {
    double lost = 0;
    for (int r = 0; r < ranks; ++r) lost += residuals[r][i];
    const double result = data[scatter ? i / chunk : 0][i];
    CHECK(std::fabs(exact[i] - result / postscale - lost) <= 1e-5,
          "error feedback ranks %d codec %d%s%s%s: [%ld] exact %.9g, result / postscale %.9g, residuals %.9g", ranks,
          int(codec), in_order ? ", in order" : "", direct ? ", direct" : "", scatter ? ", reduce-scatter" : "",
          long(i), exact[i], result / postscale, lost);
  }
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a run killed mid-way still shows the section it was in
  for (int ranks = 1; ranks <= 6; ++ranks) {
    for (int64_t numel : {0L, 1L, 5L, 127L, 128L, 129L, 1009L, 100003L}) {
      for (int64_t slice : {1L, 128L, 1000L, 1L << 20}) check_plan(numel, ranks, slice);
    }
  }
  const Codec codecs[] = {Codec::kNone, Codec::kFp16, Codec::kBf16, Codec::kFp8E4M3, Codec::kFp8E5M2};
  for (int ranks = 1; ranks <= 5; ++ranks) {
    std::printf("ring: all-reduce, %d ranks\n", ranks);
    for (int64_t numel : {0L, 1L, static_cast<int64_t>(ranks - 1), 127L, 129L, 1009L, 40000L}) {
      for (Codec codec : codecs) {
        for (bool in_order : {false, true}) {
          check_allreduce(ranks, numel, codec, 256, in_order);
          check_allreduce(ranks, numel, codec, 256, in_order, /*direct=*/true);
          check_allreduce(ranks, numel, codec, 256, in_order, false, /*prescale=*/0.25f);
          check_allreduce(ranks, numel, codec, 256, in_order, false, 0.25f, /*apart=*/true);
          check_allreduce(ranks, numel, codec, 256, in_order, false, 1.0f, /*apart=*/true);
        }
      }
    }
  }
  for (int ranks = 1; ranks <= 5; ++ranks) {
    std::printf("ring: reduce-scatter, %d ranks\n", ranks);
    for (int64_t chunk : {0L, 1L, 127L, 128L, 129L, 1000L}) {
      for (int64_t slice : {1L, 128L, 1000L}) check_scatter_plan(chunk, ranks, slice);
      for (Codec codec : codecs) {
        for (bool in_order : {false, true}) {
          check_reduce_scatter(ranks, chunk, codec, 256, in_order, false);
          check_reduce_scatter(ranks, chunk, codec, 256, in_order, true);
        }
      }
    }
  }
  for (int ranks = 1; ranks <= 5; ++ranks) {
    std::printf("ring: all-gather, %d ranks\n", ranks);
    for (int64_t chunk : {0L, 1L, 127L, 128L, 129L, 1000L}) {
      for (Codec codec : codecs) {
        for (bool in_order : {false, true}) check_all_gather(ranks, chunk, codec, 256, in_order);
      }
    }
  }
  check_payload_layout();
  // (prescale, postscale): the sum; the average of 4 ranks; a sum halved on the wire and doubled back
  const float scales[][2] = {{1.0f, 1.0f}, {1.0f, 0.25f}, {0.5f, 2.0f}};
  for (int ranks = 1; ranks <= 4; ++ranks) {
    std::printf("ring: input dtypes and postscale, %d ranks\n", ranks);
    for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      for (Codec codec : codecs) {
        for (const auto& scale : scales) {
          if (dtype == DType::kFloat32 && scale[1] == 1.0f) continue;  // the cases above
          for (bool in_order : {false, true}) {
            check_scaled(ranks, 1009, dtype, codec, scale[0], scale[1], in_order, false, false);
            check_scaled(ranks, 1009, dtype, codec, scale[0], scale[1], in_order, /*direct=*/true, false);
            check_scaled(ranks, 300 * ranks, dtype, codec, scale[0], scale[1], in_order, false, /*scatter=*/true);
          }
        }
      }
    }
  }
  std::printf("ring: error feedback\n");
  for (int ranks = 2; ranks <= 4; ++ranks) {
    for (Codec codec : codecs) {
      for (bool in_order : {false, true}) {
        check_error_feedback(ranks, 1009, codec, in_order, false, false);
        check_error_feedback(ranks, 1009, codec, in_order, /*direct=*/true, false);
        check_error_feedback(ranks, 250 * ranks, codec, in_order, false, /*scatter=*/true);
      }
    }
  }
  std::printf("ring: slices and call agreement\n");
  // slices: about eight per chunk, within [max / 4, max] bytes
  CHECK(ring_slice_elems(1 << 24, 4, 1, 1 << 20) == 1 << 19, "8 slices of a 4 MB chunk");
  CHECK(ring_slice_elems(1 << 24, 4, 4, 1 << 20) == 1 << 18, "1 MB slices cap a 16 MB chunk");
  CHECK(ring_slice_elems(1 << 20, 4, 2, 1 << 20) == 1 << 17, "256 KB floor for a 512 KB chunk");
  CHECK(ring_slice_elems(0, 4, 2, 1 << 20) == 1 << 17 && ring_slice_elems(5, 3, 1, 1) == 1 &&
            ring_slice_elems(100, 2, 4, 0) == 1, "degenerate sizes");
  // a disagreeing rank makes every rank throw, and agreeing ones none, in direct and in ring
  // exchanges, with either matching
  for (int ranks : {2, 3, kDirectExchangeRanks, kDirectExchangeRanks + 1, 11}) {
    // everyone agrees; rank 1's numel differs; its schedule does; it could not prepare the call; its
    // layout differs
    for (int variant = 0; variant < 10; ++variant) {
      const bool in_order = variant & 1, disagree = variant >> 1;
      Hub hub;
      std::vector<std::thread> threads;
      std::vector<int> threw(ranks, 0);
      for (int r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
          LocalTransport transport(hub, r, ranks, in_order);
          try {
            const bool odd = r == 1;
            check_ring_call(transport, RingCall{variant >> 1 == 1 && odd ? 11 : 10, 0, 1, 1.0f, 1.0f, 256,
                                                variant >> 1 == 2 && odd, 0, variant >> 1 == 3 && odd,
                                                variant >> 1 == 4 && odd ? 7 : 5}, 0);
          } catch (const std::invalid_argument& e) {
            const std::string what = e.what();
            threw[r] = variant >> 1 == 3 ? what.find("rank(s) 1 could not prepare") != std::string::npos
                       : variant >> 1 == 4 ? what.find("group rank 1 has numel 10") != std::string::npos &&
                                                 what.find("layout 7 (which tensors") != std::string::npos
                                           : 1;
          }
        });
      }
      for (auto& t : threads) t.join();
      CHECK(std::count(threw.begin(), threw.end(), 1) == (disagree ? ranks : 0), "agreement misjudged");
    }
  }
  return gradsync_test::finish("ring");
}
