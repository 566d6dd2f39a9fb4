// The ring engine of one process group: a worker thread that runs the group's all-reduces in the
// order they were issued (the same order on every rank), with workspaces reused across calls.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Stream.h>
#include <torch/extension.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include "ring/ring_allreduce.h"
#include "ring/ring_plan.h"
#include "transport/process_group.h"
#ifdef GRADSYNC_WITH_CUDA
#include "transport/nccl.h"
#endif

namespace gradsync {

class RingEngine;

// Completion of one asynchronous all-reduce, also as a torch Future holding the tensor.
class RingWork {
 public:
  RingWork(const at::Tensor& tensor, const RingEngine* engine);
  // blocks until the future is complete too; rethrows the all-reduce's error. Throws at once on the
  // thread of the engine that runs the call, which would wait there for itself. timeout_s >= 0
  // bounds this wait alone (the call goes on, bounded by the group's timeout).
  bool wait(double timeout_s = -1);
  bool is_completed();
  void complete(std::exception_ptr error);
  c10::intrusive_ptr<c10::ivalue::Future> future() const { return future_; }

 private:
  at::Tensor tensor_;
  const RingEngine* engine_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;      // the outcome is known (error_ holds it)
  bool released_ = false;  // ... and the future is complete, its callbacks run
  std::thread::id completer_;  // the thread running the future's callbacks
  std::exception_ptr error_;
};

struct RingOptions {
  int64_t codec;
  double prescale;
  double postscale;
  bool check_call;
  int64_t slice_bytes;
  at::Tensor residual;  // undefined, or fp32 like the tensor: error feedback (see CodecRingKernels)
  int64_t direct_bytes = 0;  // CPU payloads up to this size go through direct_allreduce, not the ring
  // A call of another group's engine whose result this one reads: the call starts once it is done
  // (on the device too), and takes its turn as a call this rank could not prepare if it failed.
  std::shared_ptr<RingWork> after;
  int32_t layout = 0;  // RingCall::layout
};

class RingEngine {
 public:
  // `first_sequence`: where the calls' tags start, the count of calls that earlier engines of the
  // group made (sequence()), so that an engine made after shutdown() pairs with peers that kept theirs.
  explicit RingEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, uint32_t first_sequence = 0);
  ~RingEngine();
  std::shared_ptr<RingWork> all_reduce(at::Tensor tensor, const RingOptions& options);
  // `output` becomes this rank's chunk of `input` (size() chunks) reduced across the group.
  std::shared_ptr<RingWork> reduce_scatter(at::Tensor output, at::Tensor input, const RingOptions& options);
  // `output` (size() chunks) becomes every rank's `input`, chunk r rank r's; `input` is copied into
  // this rank's chunk once the ranks agree on the call, unless it is that chunk (in place).
  std::shared_ptr<RingWork> all_gather(at::Tensor output, at::Tensor input, const RingOptions& options);
  // Takes this rank's turn in a call it refused (`why`: its arguments were wrong here): the call's
  // agreement check tells the peers, which raise naming this rank instead of pairing their call
  // with this rank's next one. `placeholder`: an empty float32 tensor on the device the call would
  // have used. The returned work fails with `why`.
  std::shared_ptr<RingWork> refuse(at::Tensor placeholder, RingOp op, const RingOptions& options, std::string why);
  // Whether the calling thread is an engine's worker (running a call's future callbacks, say), and
  // whether it is this engine's, which a call waited for there would wait for forever.
  static bool on_worker_thread();
  bool on_own_worker_thread() const;
  // Whether a call the calling thread submits now runs on this engine: until stop(), and after it,
  // from an engine's worker (a call's callback) until this engine's worker has ended (not after
  // stop_if_idle()).
  bool accepts_calls();
  // How many calls this engine's group has made (earlier engines' included); read it once stopped.
  uint32_t sequence() const { return sequence_; }
  // Runs every issued call, then ends the worker thread. Idempotent; the destructor calls it.
  void stop();
  // Stops the engine where it has no call, issued or running: later calls raise, those of its own
  // worker's callbacks too (they go to the group's next engine), so sequence() and broken() are
  // final. Whether it did; stop() still ends the worker.
  bool stop_if_idle();
  // Keeps the process group alive forever: for a group that torch.distributed already destroyed,
  // whose last release could block in the backend's teardown once peers have exited.
  void abandon_group() { new c10::intrusive_ptr<c10d::ProcessGroup>(transport_.group()); }
  // At exit, for a group whose queued calls wait for peers that will never answer (the process's
  // end fails those peers): the calls in flight over the process group end, raising, as do the
  // ones queued, then the worker ends. A call over the NCCL communicator, or a message its backend
  // cannot abort, is waited for as stop() does.
  void abort_calls() {
    transport_.abort();
    stop();
  }
  // Drops this engine's reference to a group that torch.distributed destroyed while its peers go on,
  // so that the backend's threads and sockets go with it. Once stopped; no call may follow
  // (_release_engines in the bindings).
  void release_group() { transport_.release_group(); }
  // How many references to the group there are, this engine's included; 0 once released.
  size_t group_references() const { return transport_.group().use_count(); }
  // Why the group's ring (or its NCCL communicator) is unusable, "" if it is not; read it once the
  // engine has stopped.
  std::string broken() const;
  int rank() const { return transport_.rank(); }
  int size() const { return transport_.size(); }
  // CUDA tensors of this group travel over gradsync's own NCCL communicator from now on (all ranks
  // call this together, with the unique id rank 0 made). Failed or timed-out calls abort it; so does
  // a join that does not complete within timeout_s (a peer that died after the id went out).
  void attach_nccl(const std::string& unique_id, int device, double timeout_s);
  int nccl_device() const;

 private:
  struct Job {
    at::Tensor tensor;
    at::Tensor output;  // a reduce-scatter's (tensor is then its input); undefined otherwise
    RingOptions options;
    std::shared_ptr<RingWork> work;
    RingOp op = kAllReduce;
    at::Tensor gather_input;  // an all-gather's (tensor is then its output)
    std::string refusal;  // non-empty: a call this rank refused (see refuse())
#ifdef GRADSYNC_WITH_CUDA
    std::shared_ptr<void> ready;  // a CUDA event recorded on the caller's stream
#endif
    // The (drained) stream the call ran on: current while its future completes, so that the
    // future's events and callbacks see the tensor's device and no unrelated work.
    std::optional<c10::Stream> stream;
  };
  std::shared_ptr<RingWork> submit(Job job);
  void run();
  // After a call failed for another reason than the ranks' disagreement: whether it left messages of
  // the process group in flight (the ring is then unusable).
  bool after_failure(const Job& job, const char* what, bool nccl_aborted_before);
  // What a call that failed with messages in flight raises: the backend's error, and what causes it.
  std::runtime_error mid_ring_failure(const char* what) const;
  // Later calls on the group raise, saying why: messages of a failed call may still arrive.
  void mark_unusable(const std::string& what);
  void execute(Job& job);
  // The agreement check, `call` carrying whether this rank prepared the call (`unprepared`: why
  // not). A rank that did not raises its own error, the others std::invalid_argument naming it.
  void checked(RingCall call, const std::exception_ptr& unprepared, const std::function<void(const RingCall&)>& check);
  void execute_nccl(Job& job, const RingPlan& plan, int64_t slice_elems);
  static void set_error_feedback(CodecRingKernels& kernels, const Job& job);
  // Waits for the call's `after`, rethrowing its error; then orders the current stream after it.
  static void wait_for_dependency(const Job& job);
  // An all-gather's input into this rank's chunk of its output, on the current stream.
  void place_gather_input(const Job& job) const;
  uint8_t* workspace(at::Tensor& buffer, int64_t bytes, const at::Device& device, bool pinned);

  ProcessGroupTransport transport_;
  std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  bool ended_ = false;  // the worker ran every call and ended (stopping)
  bool running_ = false;  // the worker is running a call, until its future completes
  bool let_go_ = false;  // stopped by stop_if_idle()
  std::string broken_;  // set once a transport failure left messages in flight
  int64_t settled_posted_ = 0;  // the transport's count of posted messages when none was last in flight
  uint32_t sequence_ = 0;
  at::Tensor recv_image_, send_image_;
#ifdef GRADSYNC_WITH_CUDA
  // The communicator, attached by a caller's thread while the worker may be running a CPU call:
  // others read it through nccl(), never through the owning pointer.
  NcclComm* nccl() const { return nccl_comm_.load(std::memory_order_acquire); }
  std::unique_ptr<NcclComm> nccl_;
  std::atomic<NcclComm*> nccl_comm_{nullptr};
  at::Tensor check_table_;  // the agreement check's records, in device memory
  cudaStream_t compute_stream_ = nullptr, wire_stream_ = nullptr;
  int stream_device_ = -1;
#endif
  std::thread worker_;
};

void bind_ring(pybind11::module& m);

}  // namespace gradsync
