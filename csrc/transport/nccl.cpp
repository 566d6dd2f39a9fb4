#include "transport/nccl.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace gradsync {
namespace {
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("gradsync: ") + what + ": " + cudaGetErrorString(e));
}
}  // namespace

std::string NcclComm::unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw std::runtime_error(std::string("gradsync: ncclGetUniqueId failed: ") + ncclGetErrorString(r));
  return std::string(id.internal, sizeof(id.internal));
}

NcclComm::NcclComm(const std::string& unique_id, int rank, int size, int device)
    : rank_(rank), size_(size), device_(device) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) throw std::invalid_argument("gradsync: malformed ncclUniqueId");
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  const ncclResult_t r = ncclCommInitRank(&comm_, size, id, rank);
  if (r != ncclSuccess) {
    comm_ = nullptr;
    throw std::runtime_error(std::string("gradsync: ncclCommInitRank failed: ") + ncclGetErrorString(r) + " (" +
                             ncclGetLastError(nullptr) + ")");
  }
}

NcclComm::~NcclComm() {
  if (!comm_) return;
  cudaSetDevice(device_);
  if (aborted_) return;
  ncclCommDestroy(comm_);  // every call was synchronized: nothing is in flight
}

void NcclComm::abort() {
  if (comm_ && !aborted_) {
    aborted_ = true;
    ncclCommAbort(comm_);
  }
}

void NcclComm::check(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return;
  const std::string message = std::string("gradsync: ") + what + " failed: " + ncclGetErrorString(result) + " (" +
                              ncclGetLastError(comm_) + ")";
  abort();
  throw std::runtime_error(message);
}

void NcclComm::synchronize(cudaStream_t stream, int64_t timeout_ms) {
  if (aborted_) throw std::runtime_error("gradsync: the NCCL communicator was aborted after an earlier failure");
  cudaEvent_t done;
  check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  check_cuda(cudaEventRecord(done, stream), "cudaEventRecord");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const cudaError_t state = cudaEventQuery(done);
    if (state == cudaSuccess) break;
    if (state != cudaErrorNotReady) {
      cudaEventDestroy(done);
      abort();
      check_cuda(state, "an all-reduce kernel failed");
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      cudaEventDestroy(done);
      check(async, "an NCCL transfer");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      cudaEventDestroy(done);
      abort();
      throw std::runtime_error("gradsync: the NCCL all-reduce did not complete within " +
                               std::to_string(timeout_ms / 1000) + " s (a peer died or stopped calling); "
                               "the communicator was aborted");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  cudaEventDestroy(done);
}

NcclTransport::~NcclTransport() {
  for (cudaEvent_t e : owned_) cudaEventDestroy(e);
}

cudaEvent_t NcclTransport::record(cudaStream_t stream) {
  cudaEvent_t e;
  check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  owned_.push_back(e);
  check_cuda(cudaEventRecord(e, stream), "cudaEventRecord");
  return e;
}

void NcclTransport::group_begin() {
  if (depth_++ == 0) comm_.check(ncclGroupStart(), "ncclGroupStart");
}

void NcclTransport::group_end() {
  if (--depth_ > 0) return;
  comm_.check(ncclGroupEnd(), "ncclGroupEnd");
  for (int64_t h : in_group_) done_[static_cast<size_t>(h)] = record(wire_);  // after the group's kernel
  in_group_.clear();
}

void NcclTransport::fence() { check_cuda(cudaStreamWaitEvent(wire_, record(compute_), 0), "cudaStreamWaitEvent"); }

int64_t NcclTransport::send(const void* data, int64_t bytes, int peer, uint32_t) {
  fence();  // the payload is written by kernels issued before this send
  comm_.check(ncclSend(data, static_cast<size_t>(bytes), ncclUint8, peer, comm_.get(), wire_), "ncclSend");
  return -1;
}

int64_t NcclTransport::recv(void* data, int64_t bytes, int peer, uint32_t) {
  comm_.check(ncclRecv(data, static_cast<size_t>(bytes), ncclUint8, peer, comm_.get(), wire_), "ncclRecv");
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
