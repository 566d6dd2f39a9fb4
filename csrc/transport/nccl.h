// Transport over gradsync's own NCCL communicator: stream-ordered point-to-point messages.
//
// A message is a ncclSend/ncclRecv on the `wire` stream; each ring hop pairs its send and receive in
// one NCCL group. The kernels run on the `compute` stream: a send first waits (on the device) for the
// kernels issued before it, and wait(handle) makes later kernels wait for that receive, so the host
// never blocks inside the ring. NcclComm::synchronize is the only host wait: it polls the stream
// and NCCL's asynchronous error, and aborts the communicator on an error or after the timeout, so a
// dead peer makes the survivors raise instead of hanging in a kernel forever.
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): a blocking ncclCommInitRank waits
// forever for a peer that died after the unique id went out, and a blocking call cannot be
// aborted. Any call may then return ncclInProgress; the host polls until it settles, within the
// same timeout.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ring/transport.h"

namespace gradsync {

// Throws, naming `what`, unless e is cudaSuccess.
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("gradsync: ") + what + ": " + cudaGetErrorString(e));
}

class NcclComm {
 public:
  static std::string unique_id();  // the bytes of a fresh ncclUniqueId (made by rank 0)
  // Joins the communicator; throws (after aborting it) if that does not complete within timeout_ms.
  NcclComm(const std::string& unique_id, int rank, int size, int device, int64_t timeout_ms);
  ~NcclComm();  // ncclCommFinalize + ncclCommDestroy, or ncclCommAbort after a failure
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const;  // throws once aborted: the handle is freed then
  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  // Blocks until `stream` has drained. On an NCCL or CUDA error, or after the timeout, aborts the
  // communicator and throws.
  void synchronize(cudaStream_t stream);
  // Returns once a call's `result` has settled (a non-blocking call may be ncclInProgress); on an
  // error or at the timeout aborts the communicator and throws, with NCCL's own message.
  void check(ncclResult_t result, const char* what);
  // Aborts the communicator (idempotent): NCCL's kernels and proxy threads give up, and every
  // later call raises. `drain`, when given, is then waited for (boundedly), so that no kernel
  // queued behind the aborted transfers writes the caller's memory after the failure is reported.
  // Returns whether `drain` (if any) has drained.
  bool abort(cudaStream_t drain = nullptr);

 private:
  [[noreturn]] void fail(const std::string& message, cudaStream_t drain = nullptr);
  std::string describe(ncclResult_t result) const;
  ncclComm_t comm_ = nullptr;
  int rank_, size_, device_;
  int64_t timeout_ms_;
  std::atomic<bool> aborted_{false};  // read by other threads than the one that aborts
};

class NcclTransport : public Transport {
 public:
  NcclTransport(NcclComm& comm, cudaStream_t compute, cudaStream_t wire) : comm_(comm), compute_(compute), wire_(wire) {}
  ~NcclTransport() override;
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  bool posts_receives_ahead() const override { return false; }
  void group_begin() override;
  void group_end() override;
  void fence() override;
  int64_t send(const void* data, int64_t bytes, int peer, uint32_t tag) override;
  int64_t recv(void* data, int64_t bytes, int peer, uint32_t tag) override;
  void wait(int64_t handle) override;
  void wait_all() override;

 private:
  cudaEvent_t record(cudaStream_t stream);
  void call(ncclResult_t result, const char* what);
  void close_group();  // ends this thread's open NCCL group, however deep
  NcclComm& comm_;
  cudaStream_t compute_, wire_;
  int depth_ = 0;
  std::vector<cudaEvent_t> done_;        // per receive handle: recorded on `wire` after it
  std::vector<int64_t> in_group_;        // receives of the open group, recorded at group_end
  std::vector<cudaEvent_t> owned_;       // every event made, destroyed with the transport
};

// What one ring hop costs over NCCL, on a one-rank communicator that sends to itself (so one GPU
// suffices), each hop issued as ring_paired issues it (events, a group of one send and one receive,
// the fp16 reduce kernel), for each payload size in turn, `repeats` times: `issue_s`, the host's
// time per hop issuing `hops` of them back to back; `pipelined_s`, per hop until the GPU has run
// them all (the longer of host and GPU per hop); `alone_s`, one hop issued and waited for (the
// latency of a hop, the host's wait included). A send to itself needs no NCCL proxy, so these are
// lower bounds of a hop between two GPUs.
struct NcclHopCost {
  double issue_s, pipelined_s, alone_s;
};
std::vector<NcclHopCost> measure_nccl_hop_cost(int device, int hops, const std::vector<int64_t>& sizes, int repeats,
                                               int64_t timeout_ms);

}  // namespace gradsync
