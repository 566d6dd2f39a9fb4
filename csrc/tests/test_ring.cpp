// The ring schedule on an in-process transport: the plan's chunk/slice/layout arithmetic, and whole
// all-reduces on threads (one per rank) whose results must agree bitwise and match the exact sum.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
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
    LocalTransport transport(hub, r, ranks, in_order);
    CpuRingKernels kernels(codec, data[r].data(), apart ? results[r].data() : data[r].data(), DType::kFloat32,
                           prescale, 1.0f);
    std::vector<int64_t> offsets;
    const int64_t bytes = direct ? direct_image_bytes(kernels, numel, ranks)
                                 : plan.layout([&](int64_t n) { return kernels.payload_bytes(n); }, offsets);
    std::vector<uint8_t> recv_image(bytes + 1), send_image(bytes + 1);
    check_ring_call(transport, RingCall{numel, 0, static_cast<int32_t>(codec), prescale, 1.0f, slice, direct}, 1u << 20);
    if (direct) direct_allreduce(transport, kernels, numel, recv_image.data(), send_image.data(), 0);
    else ring_allreduce(transport, kernels, plan, recv_image.data(), send_image.data(), 0);
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
    LocalTransport transport(hub, r, ranks, in_order);
    CpuRingKernels kernels(codec, data[r].data(), data[r].data(), DType::kFloat32, 1.0f, 1.0f);
    kernels.scatter_into(in_place ? data[r].data() + r * chunk : results[r].data(), r * chunk);
    std::vector<int64_t> offsets;
    const int64_t bytes = plan.layout([&](int64_t n) { return kernels.payload_bytes(n); }, offsets);
    std::vector<uint8_t> recv_image(bytes + 1), send_image(bytes + 1);
    ring_reduce_scatter(transport, kernels, plan, recv_image.data(), send_image.data(), 0);
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

}  // namespace

int main() {
  for (int ranks = 1; ranks <= 6; ++ranks) {
    for (int64_t numel : {0L, 1L, 5L, 127L, 128L, 129L, 1009L, 100003L}) {
      for (int64_t slice : {1L, 128L, 1000L, 1L << 20}) check_plan(numel, ranks, slice);
    }
  }
  const Codec codecs[] = {Codec::kNone, Codec::kFp16, Codec::kBf16, Codec::kFp8E4M3, Codec::kFp8E5M2};
  for (int ranks = 1; ranks <= 5; ++ranks) {
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
  // slices: about eight per chunk, within [max / 4, max] bytes
  CHECK(ring_slice_elems(1 << 24, 4, 1, 1 << 20) == 1 << 19, "8 slices of a 4 MB chunk");
  CHECK(ring_slice_elems(1 << 24, 4, 4, 1 << 20) == 1 << 18, "1 MB slices cap a 16 MB chunk");
  CHECK(ring_slice_elems(1 << 20, 4, 2, 1 << 20) == 1 << 17, "256 KB floor for a 512 KB chunk");
  CHECK(ring_slice_elems(0, 4, 2, 1 << 20) == 1 << 17 && ring_slice_elems(5, 3, 1, 1) == 1 &&
            ring_slice_elems(100, 2, 4, 0) == 1, "degenerate sizes");
  // a disagreeing rank makes every rank throw, and agreeing ones none, in direct and in ring
  // exchanges, with either matching
  for (int ranks : {2, 3, kDirectExchangeRanks, kDirectExchangeRanks + 1, 11}) {
    // everyone agrees; rank 1's numel differs; its schedule does; it could not prepare the call
    for (int variant = 0; variant < 8; ++variant) {
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
                                                variant >> 1 == 2 && odd, 0, variant >> 1 == 3 && odd}, 0);
          } catch (const std::invalid_argument& e) {
            threw[r] = variant >> 1 != 3 || std::string(e.what()).find("rank(s) 1 could not prepare") != std::string::npos;
          }
        });
      }
      for (auto& t : threads) t.join();
      CHECK(std::count(threw.begin(), threw.end(), 1) == (disagree ? ranks : 0), "agreement misjudged");
    }
  }
  return gradsync_test::finish("ring");
}
