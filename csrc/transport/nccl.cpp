#include "transport/nccl.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace gradsync {
namespace {
// The pause between two polls. A non-blocking ncclGroupEnd hands every group to a fresh NCCL
// thread (NCCL >= 2.23), which settles within microseconds, as does a short all-reduce: yield for
// the first 2 ms, so that a hop pays no sleep, then sleep 100 us, so that a long wait leaves the
// core to others.
class Backoff {
 public:
  void pause() {
    if (std::chrono::steady_clock::now() - start_ < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};
// A query's cudaErrorNotReady is also left as the thread's last error, which the next kernel launch
// would then report as its own failure (launches are checked with cudaGetLastError): clear it.
void not_ready_seen() { static_cast<void>(cudaGetLastError()); }
// Freeing a communicator happens in destructors and on paths that already throw, so a failure to
// free it is reported, not raised: the process goes on without those resources.
void report_free_failure(ncclResult_t r, const char* what) {
  if (r == ncclSuccess || r == ncclInProgress) return;  // an aborting comm may settle later
  std::fprintf(stderr, "gradsync: %s failed: %s; its resources may leak\n", what, ncclGetErrorString(r));
}
}  // namespace

std::string NcclComm::unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw std::runtime_error(std::string("gradsync: ncclGetUniqueId failed: ") + ncclGetErrorString(r));
  return std::string(id.internal, sizeof(id.internal));
}

NcclComm::NcclComm(const std::string& unique_id, int rank, int size, int device, int64_t timeout_ms)
    : rank_(rank), size_(size), device_(device), timeout_ms_(timeout_ms) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) throw std::invalid_argument("gradsync: malformed ncclUniqueId");
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
  check(r, "ncclCommInitRank");  // on failure the communicator is aborted, which frees it
}

NcclComm::~NcclComm() {
  if (!comm_ || aborted_) return;
  cudaSetDevice(device_);
  // Every call was synchronized, so finalizing only flushes NCCL's own state and takes milliseconds;
  // a longer wait means peers have already gone, and aborting frees the same resources locally.
  constexpr int64_t kFinalizeMs = 10000;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::min(timeout_ms_, kFinalizeMs));
  ncclResult_t state = ncclCommFinalize(comm_);
  Backoff backoff;
  while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
    backoff.pause();
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
  }
  if (state == ncclSuccess) report_free_failure(ncclCommDestroy(comm_), "ncclCommDestroy");
  else report_free_failure(ncclCommAbort(comm_), "ncclCommAbort");
}

ncclComm_t NcclComm::get() const {
  if (aborted_) throw std::runtime_error("gradsync: this group's NCCL communicator was aborted after an earlier failure");
  return comm_;
}

bool NcclComm::abort(cudaStream_t drain) {
  if (comm_ && !aborted_) {
    aborted_ = true;
    report_free_failure(ncclCommAbort(comm_), "ncclCommAbort");
  }
  if (!drain) return true;
  // NCCL's kernels leave once aborted, so the kernels queued behind them run now; wait for them, but
  // never forever (the caller then keeps what they may still write).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  Backoff backoff;
  cudaError_t state;
  while ((state = cudaStreamQuery(drain)) == cudaErrorNotReady) {
    not_ready_seen();
    if (std::chrono::steady_clock::now() >= deadline) break;
    backoff.pause();
  }
  return state != cudaErrorNotReady;  // drained, or failed (a failed context runs nothing more)
}

void NcclComm::fail(const std::string& message, cudaStream_t drain) {
  abort(drain);
  throw std::runtime_error("gradsync: " + message);
}

std::string NcclComm::describe(ncclResult_t result) const {
  // NCCL keeps one last-warning text per process, shared with torch's own communicators
  return std::string(ncclGetErrorString(result)) + " (NCCL's last warning, maybe unrelated: " +
         ncclGetLastError(nullptr) + ")";
}

void NcclComm::check(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return;
  if (result != ncclInProgress) fail(std::string(what) + " failed: " + describe(result));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
  Backoff backoff;
  for (;;) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail(std::string(what) + " failed: " + describe(state));
    if (std::chrono::steady_clock::now() > deadline) {
      fail(std::string(what) + " did not complete within " + std::to_string(timeout_ms_ / 1000) +
           " s (a peer died or never called it); the communicator was aborted");
    }
    backoff.pause();
  }
}

void NcclComm::synchronize(cudaStream_t stream) {
  if (aborted_) throw std::runtime_error("gradsync: the NCCL communicator was aborted after an earlier failure");
  cudaEvent_t done;
  check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  const cudaError_t recorded = cudaEventRecord(done, stream);
  if (recorded != cudaSuccess) {
    cudaEventDestroy(done);
    check_cuda(recorded, "cudaEventRecord");
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
  Backoff backoff;
  for (;;) {
    const cudaError_t state = cudaEventQuery(done);
    if (state == cudaSuccess) break;
    if (state == cudaErrorNotReady) not_ready_seen();
    else {
      cudaEventDestroy(done);
      fail(std::string("an all-reduce kernel failed: ") + cudaGetErrorString(state));
    }
    ncclResult_t async = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &async);
    if (queried != ncclSuccess) async = queried;
    if (async != ncclSuccess && async != ncclInProgress) {
      cudaEventDestroy(done);
      fail("an NCCL transfer failed: " + describe(async), stream);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      cudaEventDestroy(done);
      fail("the NCCL all-reduce did not complete within " + std::to_string(timeout_ms_ / 1000) +
               " s (a peer died or stopped calling); the communicator was aborted",
           stream);
    }
    backoff.pause();
  }
  cudaEventDestroy(done);
}

NcclTransport::~NcclTransport() {
  // An exception between group_begin and group_end leaves this thread's NCCL group open, and every
  // later NCCL call of the thread would join it: close it. That launches the group's transfers,
  // which is harmless only because the engine aborts the communicator right after (every
  // transport lives inside RingEngine::execute_nccl's aborting_on_failure).
  close_group();
  for (cudaEvent_t e : owned_) cudaEventDestroy(e);
}

void NcclTransport::close_group() {
  while (depth_ > 0) {
    --depth_;
    ncclGroupEnd();
  }
}

void NcclTransport::call(ncclResult_t result, const char* what) {
  // NCCL ends a group that saw an error by discarding its calls and returning the error
  if (result != ncclSuccess && result != ncclInProgress) close_group();
  comm_.check(result, what);
}

cudaEvent_t NcclTransport::record(cudaStream_t stream) {
  cudaEvent_t e;
  check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  owned_.push_back(e);
  check_cuda(cudaEventRecord(e, stream), "cudaEventRecord");
  return e;
}

void NcclTransport::group_begin() {
  if (depth_ == 0) call(ncclGroupStart(), "ncclGroupStart");  // counted once open: a failed start has nothing to end
  ++depth_;
}

void NcclTransport::group_end() {
  if (--depth_ > 0) return;
  comm_.check(ncclGroupEnd(), "ncclGroupEnd");  // enqueues the group's transfers; may be in progress
  for (int64_t h : in_group_) done_[static_cast<size_t>(h)] = record(wire_);  // after the group's kernel
  in_group_.clear();
}

void NcclTransport::fence() { check_cuda(cudaStreamWaitEvent(wire_, record(compute_), 0), "cudaStreamWaitEvent"); }

int64_t NcclTransport::send(const void* data, int64_t bytes, int peer, uint32_t) {
  fence();  // the payload is written by kernels issued before this send
  call(ncclSend(data, static_cast<size_t>(bytes), ncclUint8, peer, comm_.get(), wire_), "ncclSend");
  return -1;
}

int64_t NcclTransport::recv(void* data, int64_t bytes, int peer, uint32_t) {
  call(ncclRecv(data, static_cast<size_t>(bytes), ncclUint8, peer, comm_.get(), wire_), "ncclRecv");
  const int64_t handle = static_cast<int64_t>(done_.size());
  done_.push_back(nullptr);
  if (depth_ > 0) in_group_.push_back(handle);
  else done_.back() = record(wire_);
  return handle;
}

void NcclTransport::wait(int64_t handle) {
  if (handle < 0) return;
  check_cuda(cudaStreamWaitEvent(compute_, done_.at(static_cast<size_t>(handle)), 0), "cudaStreamWaitEvent");
}

void NcclTransport::wait_all() { check_cuda(cudaStreamWaitEvent(compute_, record(wire_), 0), "cudaStreamWaitEvent"); }

}  // namespace gradsync
