#include "engine.h"

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <c10/core/StreamGuard.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "ring/ring_allreduce.h"

#ifdef GRADSYNC_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/multi_tensor.h"
#endif

namespace {
// Releases of engines begun on threads of their own and not finished yet. Never destroyed: those
// threads may still run while the process's static objects go.
struct Releases {
  std::mutex mutex;
  std::condition_variable finished;
  int running = 0;
};
Releases* releases = new Releases();
}  // namespace

namespace gradsync {

constexpr uint32_t kTagBase = 1u << 30;  // gradsync's tags: [2^30, 2^31)
constexpr uint32_t kTagsPerCall = 1u << 24;
constexpr uint32_t kCallSlots = 64;

namespace {
thread_local const RingEngine* t_worker_of = nullptr;  // the engine whose worker thread this is
}  // namespace

RingWork::RingWork(const at::Tensor& tensor, const RingEngine* engine)
    : tensor_(tensor),
      engine_(engine),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::TensorType::get(), tensor.is_cuda() ? std::vector<c10::Device>{tensor.device()} : std::vector<c10::Device>{})) {}

bool RingWork::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_CHECK(done_ || t_worker_of != engine_,
              "gradsync: waiting for a call of this group on the group's communication thread (in a callback of "
              "one of its futures), which runs that call after this callback, would wait forever: chain it with "
              "get_future().then(...) instead");
  // after wait() the future is complete too, as with torch's Work; but a callback of that future
  // (run by the completing thread) that waits for this call has its outcome already
  auto finished = [&] { return released_ || (done_ && std::this_thread::get_id() == completer_); };
  if (timeout_s < 0 || timeout_s > 1e9) {  // beyond 30 years, steady_clock's nanoseconds would overflow
    done_cv_.wait(lock, finished);
  } else {
    TORCH_CHECK(done_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), finished),
                "gradsync: the call did not complete within the ", timeout_s, " s given to wait(); it is still "
                "running (its tensors must not be touched until a wait() returns), bounded by the group's timeout");
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

bool RingWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return released_ || (done_ && std::this_thread::get_id() == completer_);  // in a callback too, as wait()
}

void RingWork::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    error_ = error;
    completer_ = std::this_thread::get_id();
  }
  // the future's callbacks run here, on the engine's thread. What they throw (or recording the
  // future's CUDA events, on a device that has failed since) must not end that thread: wait() has
  // the call's outcome in error_.
  try {
    if (error) future_->setError(error);
    else future_->markCompleted(c10::IValue(tensor_));
  } catch (const std::exception& e) {
    TORCH_WARN("gradsync: completing an all-reduce's future failed: ", e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
  }
  done_cv_.notify_all();
  tensor_ = at::Tensor();
}

RingEngine::RingEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, uint32_t first_sequence)
    : transport_(std::move(group)), sequence_(first_sequence), worker_([this] { run(); }) {}

RingEngine::~RingEngine() {
  stop();
#ifdef GRADSYNC_WITH_CUDA
  if (stream_device_ >= 0) {  // streams made for a join, whether or not it succeeded
    int current = -1;
    const bool restore = cudaGetDevice(&current) == cudaSuccess;
    cudaSetDevice(stream_device_);
    nccl_comm_.store(nullptr, std::memory_order_release);
    nccl_.reset();
    // the device workspaces go back to torch's allocator while the stream they were made on exists
    recv_image_ = at::Tensor();
    send_image_ = at::Tensor();
    check_table_ = at::Tensor();
    if (compute_stream_) cudaStreamDestroy(compute_stream_);
    if (wire_stream_) cudaStreamDestroy(wire_stream_);
    if (restore) cudaSetDevice(current);  // the destroying thread's device, as it was
  }
#endif
}

void RingEngine::attach_nccl(const std::string& unique_id, int device, double timeout_s) {
#ifdef GRADSYNC_WITH_CUDA
  TORCH_CHECK(!nccl(), "gradsync: this group already has an NCCL communicator");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  // What can fail on this rank alone comes before the join, which the peers wait in (until the
  // timeout) for a rank that never comes. The check's table is made once: allocated per call, it
  // could fail on this rank alone after its peers entered the check. Streams outlive a failed join.
  at::Tensor table = at::empty({size() * static_cast<int64_t>(sizeof(RingCall))},
                               at::TensorOptions().dtype(at::kByte).device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))));
  // loaded before any of gradsync's NCCL kernels runs (kernels/cuda_common.h, load_kernels)
  cudaError_t loaded = load_cast_kernels();
  if (loaded == cudaSuccess) loaded = load_fp8_kernels();
  if (loaded == cudaSuccess) loaded = load_multi_tensor_kernels();
  if (loaded != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    TORCH_CHECK(false, "gradsync: its CUDA kernels cannot be loaded on cuda:", device, " (", cudaGetErrorString(loaded),
                "): was it built for this GPU's architecture? python -m gradsync.report shows the arch list it was "
                "built for (TORCH_CUDA_ARCH_LIST at build time)");
  }
  if (stream_device_ != device && stream_device_ >= 0) {  // a failed join's streams, on another GPU
    const c10::cuda::CUDAGuard old(static_cast<c10::DeviceIndex>(stream_device_));
    if (compute_stream_) cudaStreamDestroy(compute_stream_);
    if (wire_stream_) cudaStreamDestroy(wire_stream_);
    compute_stream_ = wire_stream_ = nullptr;
  }
  stream_device_ = device;
  if (!compute_stream_) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_stream_, cudaStreamNonBlocking));
  if (!wire_stream_) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&wire_stream_, cudaStreamNonBlocking));
  auto comm = std::make_unique<NcclComm>(unique_id, rank(), size(), device, static_cast<int64_t>(timeout_s * 1000));
  std::lock_guard<std::mutex> lock(mutex_);  // published to the worker through the queue's mutex
  check_table_ = std::move(table);
  nccl_ = std::move(comm);
  nccl_comm_.store(nccl_.get(), std::memory_order_release);
#else
  (void)unique_id, (void)device, (void)timeout_s;
  TORCH_CHECK(false, "gradsync was built without CUDA");
#endif
}

std::string RingEngine::broken() const {
#ifdef GRADSYNC_WITH_CUDA
  if (broken_.empty() && nccl() && nccl()->aborted()) {
    return "gradsync: this group's NCCL communicator was aborted after an earlier failure; later calls on the group raise";
  }
#endif
  return broken_;
}

int RingEngine::nccl_device() const {
#ifdef GRADSYNC_WITH_CUDA
  return nccl() ? nccl()->device() : -1;
#else
  return -1;
#endif
}

void RingEngine::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

namespace {
DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "gradsync's collectives take float32, float16 or bfloat16 tensors");
  }
}
// The record every rank must agree on before the ring starts.
RingCall ring_call(const at::Tensor& t, const RingOptions& o, int64_t slice_elems, bool direct, RingOp op) {
  return RingCall{t.numel(), static_cast<int32_t>(dtype_of(t)), static_cast<int32_t>(o.codec),
                  static_cast<float>(o.prescale), static_cast<float>(o.postscale), slice_elems, direct ? 1 : 0,
                  op, 0, o.layout};
}
void check_residual(const at::Tensor& input, const RingOptions& options) {
  if (options.residual.defined()) {
    const at::Tensor& r = options.residual;
    TORCH_CHECK(r.scalar_type() == at::kFloat && r.is_contiguous() && r.numel() == input.numel() &&
                    r.device() == input.device(),
                "gradsync: the residual must be a contiguous float32 tensor with the input's numel and device");
  }
}

// The ring writes through raw pointers, behind autograd: bump what it writes, as torch's in-place
// collectives do at the call, so that a tensor saved for backward and then overwritten raises there.
// Inference tensors keep no version (the Python functions refuse them outside inference mode, where
// bumping one would throw, after the call was queued).
void bump_versions(std::initializer_list<const at::Tensor*> written) {
  for (const at::Tensor* t : written) {
    if (t->defined() && !t->is_inference()) torch::autograd::impl::bump_version(*t);
  }
}
}  // namespace

std::shared_ptr<RingWork> RingEngine::all_reduce(at::Tensor tensor, const RingOptions& options) {
  TORCH_CHECK(tensor.is_contiguous(), "gradsync.all_reduce: the tensor must be contiguous");
  dtype_of(tensor);
  check_residual(tensor, options);
  auto work = submit(Job{tensor, at::Tensor(), options, std::make_shared<RingWork>(tensor, this)});
  bump_versions({&tensor, &options.residual});
  return work;
}

std::shared_ptr<RingWork> RingEngine::reduce_scatter(at::Tensor output, at::Tensor input, const RingOptions& options) {
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous(), "gradsync.reduce_scatter: the tensors must be contiguous");
  TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.device() == output.device(),
              "gradsync.reduce_scatter: output and input must have one dtype and device");
  TORCH_CHECK(input.numel() == output.numel() * size(), "gradsync.reduce_scatter: the input must hold ", size(),
              " chunks of the output's ", output.numel(), " elements, not ", input.numel());
  dtype_of(input);
  check_residual(input, options);
  Job job{input, output, options, std::make_shared<RingWork>(output, this)};
  job.op = kReduceScatter;
  auto work = submit(std::move(job));
  bump_versions({&output, &options.residual});
  return work;
}

std::shared_ptr<RingWork> RingEngine::all_gather(at::Tensor output, at::Tensor input, const RingOptions& options) {
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous(), "gradsync.all_gather: the tensors must be contiguous");
  TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.device() == output.device(),
              "gradsync.all_gather: output and input must have one dtype and device");
  TORCH_CHECK(output.numel() == input.numel() * size(), "gradsync.all_gather: the output must hold ", size(),
              " chunks of the input's ", input.numel(), " elements, not ", output.numel());
  TORCH_CHECK(!options.residual.defined(), "gradsync.all_gather takes no residual");
  dtype_of(output);
  Job job{output, at::Tensor(), options, std::make_shared<RingWork>(output, this)};
  job.op = kAllGather;
  job.gather_input = input;
  auto work = submit(std::move(job));
  bump_versions({&output});
  return work;
}

void RingEngine::place_gather_input(const Job& job) const {
  // below autograd, the views too: this thread has none of the caller's no_grad or inference mode
  // (a view of a view made under no_grad would raise here), and the copy is the collective's raw
  // write, which all_gather() has already accounted for
  at::AutoDispatchBelowADInplaceOrView below;
  const at::Tensor& input = job.gather_input;  // both contiguous, of any shapes: their elements count
  at::Tensor own = job.tensor.view(-1).narrow(0, rank() * input.numel(), input.numel());
  if (input.numel() == 0 || own.data_ptr() == input.data_ptr()) return;
  own.copy_(input.view(-1));
}

std::shared_ptr<RingWork> RingEngine::refuse(at::Tensor placeholder, RingOp op, const RingOptions& options,
                                             std::string why) {
  TORCH_CHECK(placeholder.numel() == 0 && placeholder.scalar_type() == at::kFloat,
              "gradsync: a refused call's placeholder is an empty float32 tensor");
  TORCH_CHECK(op == kAllReduce || op == kReduceScatter || op == kAllGather, "gradsync: unknown ring operation ", op);
  Job job{placeholder, op == kReduceScatter ? placeholder : at::Tensor(), options,
          std::make_shared<RingWork>(placeholder, this)};
  job.op = op;
  job.options.residual = at::Tensor();
  job.options.after = nullptr;
  job.refusal = why.empty() ? std::string("gradsync: the call was refused") : std::move(why);
  return submit(std::move(job));
}

bool RingEngine::on_worker_thread() { return t_worker_of != nullptr; }
bool RingEngine::on_own_worker_thread() const { return t_worker_of == this; }

bool RingEngine::stop_if_idle() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ || running_ || !queue_.empty()) return false;
    stopping_ = let_go_ = true;
  }
  queue_cv_.notify_all();
  return true;
}

bool RingEngine::accepts_calls() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !stopping_ || (!let_go_ && on_worker_thread() && !ended_);
}

std::shared_ptr<RingWork> RingEngine::submit(Job job) {
  const at::Tensor& tensor = job.tensor;
#ifdef GRADSYNC_WITH_CUDA
  if (tensor.is_cuda() && job.refusal.empty()) {  // a refused call never reads its (empty) tensor
    // the worker starts once the caller's stream has produced the tensor
    const c10::cuda::CUDAGuard guard(tensor.device());
    cudaEvent_t event;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    job.ready = std::shared_ptr<void>(event, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
    C10_CUDA_CHECK(cudaEventRecord(event, c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream()));
  }
#else
  TORCH_CHECK(!tensor.is_cuda(), "gradsync was built without CUDA");
#endif
  auto work = job.work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // a call a callback issues while stop() waits runs before the worker ends: its peers' runs too
    TORCH_CHECK(!stopping_ || (!let_go_ && on_worker_thread() && !ended_),
                "gradsync: the ring engine of this group is shut down");
    queue_.push_back(std::move(job));
  }
  queue_cv_.notify_one();
  return work;
}

void RingEngine::run() {
  t_worker_of = this;
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {  // stopping, and every issued call has run
        ended_ = true;
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    std::exception_ptr error;
    settled_posted_ = transport_.posted();
    bool nccl_aborted_before = false;
#ifdef GRADSYNC_WITH_CUDA
    nccl_aborted_before = nccl() && nccl()->aborted();
#endif
    try {
      if (!broken_.empty()) throw std::runtime_error(broken_);
      execute(job);
    } catch (const std::invalid_argument&) {  // the ranks disagree: every message completed cleanly
      error = std::current_exception();
    } catch (const std::exception& e) {
      error = std::current_exception();
      if (after_failure(job, e.what(), nccl_aborted_before)) error = std::make_exception_ptr(mid_ring_failure(e.what()));
    } catch (...) {
      error = std::current_exception();
      after_failure(job, "an unknown exception", nccl_aborted_before);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = false;  // before the future completes: a caller who waited for it finds the engine idle
    }
    {
      std::optional<c10::StreamGuard> guard;
      try {
        if (job.stream) guard.emplace(*job.stream);
      } catch (const std::exception&) {  // a device that has failed: complete on the thread's current stream
      }
      job.work->complete(error);
    }
    job.tensor = at::Tensor();
    job.output = at::Tensor();
    job.gather_input = at::Tensor();
    job.options.residual = at::Tensor();
    job.options.after = nullptr;
  }
}

std::runtime_error RingEngine::mid_ring_failure(const char* what) const {
  return std::runtime_error(
      "gradsync: a call on this process group failed in the ring (rank " + std::to_string(rank()) + " of " +
      std::to_string(size()) + "), and the group's ring is unusable from now on: " + what +
      ". A peer that died or stalls fails it so, as does one that made another call: calls are checked "
      "only with check_call, which gradsync.DataParallel and the DDP hooks use on a bucket's first step only");
}

bool RingEngine::after_failure(const Job& job, const char* what, bool nccl_aborted_before) {
  // A call that failed before posting anything (an allocation, a group without a CPU backend) leaves
  // the ring as it was; one whose post the group refused does not (see ProcessGroupTransport::posted).
  // Messages of the process group that may still be in flight would be received by a later call:
  // that fails every later call on the group. An aborted NCCL communicator fails its own later calls.
  const bool in_flight = transport_.posted() != settled_posted_;
  bool device_in_flight = false;
#ifdef GRADSYNC_WITH_CUDA
  device_in_flight = nccl() && nccl()->aborted() && !nccl_aborted_before;
#else
  (void)nccl_aborted_before;
#endif
  if (in_flight) {
    mark_unusable(what);
    // receives posted straight into a host result (codec "none") stay posted: a late peer still lands
    // there (CUDA tensors over the process group receive into the pinned workspaces only)
    if (!job.tensor.is_cuda()) new at::Tensor(job.tensor);  // leaked on purpose, as the workspaces below
  }
  if (in_flight || device_in_flight) {  // never reused: messages or kernels may still write them
    new at::Tensor(std::move(recv_image_));  // leaked on purpose; the next call allocates new ones
    new at::Tensor(std::move(send_image_));
  }
  return in_flight;
}

uint8_t* RingEngine::workspace(at::Tensor& buffer, int64_t bytes, const at::Device& device, bool pinned) {
  pinned = pinned && device.is_cpu();
  if (!buffer.defined() || buffer.numel() < bytes || buffer.device() != device ||
      (device.is_cpu() && buffer.is_pinned() != pinned)) {
    buffer = at::empty({std::max<int64_t>(bytes, 1)},
                       at::TensorOptions().dtype(at::kByte).device(device).pinned_memory(pinned));
  }
  return buffer.data_ptr<uint8_t>();
}

void RingEngine::set_error_feedback(CodecRingKernels& kernels, const Job& job) {
  if (job.options.residual.defined()) kernels.set_error_feedback(job.options.residual.data_ptr<float>());
}

void RingEngine::wait_for_dependency(const Job& job) {
  if (!job.options.after) return;
  job.options.after->wait();
  job.options.after->future()->wait();  // complete already: makes the current streams wait for its events
}

void RingEngine::execute(Job& job) {
  const at::Tensor& t = job.tensor;
  const RingOptions& o = job.options;
  const int n = transport_.size();
  const DType dtype = dtype_of(t);
  const Codec codec = static_cast<Codec>(o.codec);
  const uint32_t tag_base = kTagBase + (sequence_++ % kCallSlots) * kTagsPerCall;

  // slices of at most slice_bytes on the wire (ring_plan.h), but few enough that one call's tags fit its range
  const int64_t wire_size = codec == Codec::kFp8E4M3 || codec == Codec::kFp8E5M2 ? 1
                            : codec == Codec::kNone ? dtype_size(dtype) : 2;
  const bool scatter = job.op == kReduceScatter;
  const auto plan_of = [&](int64_t slice) {
    return job.op == kAllReduce ? RingPlan(t.numel(), n, slice) : RingPlan::scatter(t.numel(), n, slice);
  };
  int64_t slice_elems = ring_slice_elems(t.numel(), n, wire_size, o.slice_bytes);
  while (ring_tag_span(plan_of(slice_elems)) + n >= kTagsPerCall) slice_elems *= 2;
  const RingPlan plan = plan_of(slice_elems);
#ifdef GRADSYNC_WITH_CUDA
  if (t.is_cuda() && nccl()) return execute_nccl(job, plan, slice_elems);
#endif

  // small host buffers: the direct exchange (its final sum has no CUDA twin, so CUDA tensors take the ring)
  const int64_t payload_bytes = wire_size == 1 ? fp8_payload_bytes(t.numel()) : t.numel() * wire_size;
  const bool direct = job.op == kAllReduce && !t.is_cuda() && n > 1 && n <= kDirectExchangeRanks && t.numel() > 0 &&
                      payload_bytes <= o.direct_bytes;
  std::unique_ptr<CodecRingKernels> kernels;
  uint8_t *recv_image = nullptr, *send_image = nullptr;
  std::exception_ptr unprepared;
  std::string unprepared_what = "an unknown exception";
#ifdef GRADSYNC_WITH_CUDA
  std::unique_ptr<c10::cuda::CUDAStreamGuard> guard;
#endif
  try {
    if (!job.refusal.empty()) throw std::invalid_argument(job.refusal);
    const bool pinned = t.is_cuda();
#ifdef GRADSYNC_WITH_CUDA
    if (t.is_cuda()) {
      // current on this thread (for the rest of the call), so that the engine's device buffers come
      // from this stream's pool and never from the default stream's, whose blocks the caller's
      // later kernels may still be using
      guard = std::make_unique<c10::cuda::CUDAStreamGuard>(c10::cuda::getStreamFromPool(false, t.device().index()));
      job.stream = guard->current_stream();
      const cudaStream_t stream = guard->current_stream().stream();
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(job.ready.get()), 0));
      wait_for_dependency(job);
      kernels = std::make_unique<CudaRingKernels>(codec, t.data_ptr(), t.data_ptr(), dtype,
                                                  static_cast<float>(o.prescale), static_cast<float>(o.postscale), stream);
    }
#endif
    if (!kernels) {
      wait_for_dependency(job);
      kernels = std::make_unique<CpuRingKernels>(codec, t.data_ptr(), t.data_ptr(), dtype,
                                                 static_cast<float>(o.prescale), static_cast<float>(o.postscale));
    }
    set_error_feedback(*kernels, job);
    if (scatter) kernels->scatter_into(job.output.data_ptr(), plan.chunk_begin((rank() + 1) % n));
    if (direct) {
      recv_image = workspace(recv_image_, direct_image_bytes(*kernels, t.numel(), n), at::kCPU, false);
      send_image = workspace(send_image_, payload_bytes, at::kCPU, false);
    } else {
      std::vector<int64_t> offsets;
      const int64_t image_bytes = plan.layout([&](int64_t len) { return kernels->payload_bytes(len); }, offsets);
      recv_image = workspace(recv_image_, image_bytes, at::kCPU, pinned);
      send_image = workspace(send_image_, image_bytes, at::kCPU, pinned);
    }
  } catch (const std::exception& e) {
    unprepared = std::current_exception();
    unprepared_what = e.what();
  } catch (...) {
    unprepared = std::current_exception();
  }
  if (o.check_call) {  // at the top of the call's tags, which every rank finds there whatever its numel
    checked(ring_call(t, o, slice_elems, direct, job.op), unprepared,
            [&](const RingCall& call) { check_ring_call(transport_, call, tag_base + kTagsPerCall - n); });
  }
  if (unprepared) {
    if (!o.check_call && n > 1) {  // the peers are in the ring, waiting for this rank
      if (job.refusal.empty()) {
        mark_unusable(unprepared_what);
      } else {
        broken_ = "gradsync: a call on this group was refused here with check_call=False, so its peers, already in "
                  "the ring, could not be told, and the group's ring is unusable: " + job.refusal;
      }
    }
    std::rethrow_exception(unprepared);
  }
  if (direct) {
    return direct_allreduce(transport_, static_cast<CpuRingKernels&>(*kernels), t.numel(), recv_image, send_image,
                            tag_base);
  }
  if (job.op == kAllGather) place_gather_input(job);  // on the kernels' stream, once the ranks agree
  if (scatter) ring_reduce_scatter(transport_, *kernels, plan, recv_image, send_image, tag_base);
  else if (job.op == kAllGather) ring_all_gather(transport_, *kernels, plan, recv_image, send_image, tag_base);
  else ring_allreduce(transport_, *kernels, plan, recv_image, send_image, tag_base);
}

void RingEngine::mark_unusable(const std::string& what) {
  broken_ = "gradsync: an earlier call on this group (all-reduce, reduce-scatter or all-gather) failed, so the "
            "group's ring is unusable: " + what;
}

void RingEngine::checked(RingCall call, const std::exception_ptr& unprepared,
                         const std::function<void(const RingCall&)>& check) {
  call.unprepared = unprepared ? 1 : 0;
  try {
    check(call);
  } catch (const std::invalid_argument&) {  // every message of the check has completed
    settled_posted_ = transport_.posted();
    if (unprepared) std::rethrow_exception(unprepared);
    throw;
  }
}

#ifdef GRADSYNC_WITH_CUDA
void RingEngine::execute_nccl(Job& job, const RingPlan& plan, int64_t slice_elems) {
  const at::Tensor& t = job.tensor;
  const RingOptions& o = job.options;
  TORCH_CHECK(t.device().index() == nccl()->device(), "gradsync: this group's NCCL communicator is on cuda:",
              nccl()->device(), " but the tensor is on ", t.device());
  TORCH_CHECK(!nccl()->aborted(), "gradsync: this group's NCCL communicator was aborted after an earlier "
              "failure; later calls on the group raise");
  // buffers allocated here come from the compute stream's pool (see execute)
  const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(compute_stream_, t.device().index()));
  job.stream = guard.current_stream();
  const DType dtype = dtype_of(t);
  const int n = size();
  // Once a transfer is enqueued, a failure of any kind leaves messages in flight that a later call
  // would receive: abort the communicator, and let the kernels queued behind it finish first.
  const auto aborting_on_failure = [&](auto&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      if (nccl()->abort(compute_stream_)) throw;
      new at::Tensor(t);  // leaked on purpose: kernels still queued may write them
      if (job.output.defined()) new at::Tensor(job.output);
      if (job.gather_input.defined()) new at::Tensor(job.gather_input);
      if (o.residual.defined()) new at::Tensor(o.residual);
      new at::Tensor(check_table_);
      throw std::runtime_error(std::string(e.what()) + "; the call's kernels were still queued 10 s after the abort, so "
                               "the tensor (and residual) may still change: gradsync keeps them allocated");
    } catch (...) {
      nccl()->abort(compute_stream_);
      throw;
    }
  };
  // as in execute: what can fail on this rank alone comes before the check, which tells the others
  std::unique_ptr<CudaRingKernels> kernels;
  uint8_t *recv_image = nullptr, *send_image = nullptr;
  std::exception_ptr unprepared;
  try {
    if (!job.refusal.empty()) throw std::invalid_argument(job.refusal);
    wait_for_dependency(job);
    kernels = std::make_unique<CudaRingKernels>(static_cast<Codec>(o.codec), t.data_ptr(), t.data_ptr(), dtype,
                                                static_cast<float>(o.prescale), static_cast<float>(o.postscale),
                                                compute_stream_, /*synchronize=*/false);
    set_error_feedback(*kernels, job);
    if (job.op == kReduceScatter) kernels->scatter_into(job.output.data_ptr(), plan.chunk_begin((rank() + 1) % n));
    std::vector<int64_t> offsets;
    const int64_t image_bytes = plan.layout([&](int64_t len) { return kernels->payload_bytes(len); }, offsets);
    recv_image = workspace(recv_image_, image_bytes, t.device(), false);
    send_image = workspace(send_image_, image_bytes, t.device(), false);
  } catch (...) {
    unprepared = std::current_exception();
  }
  if (o.check_call && n > 1) {  // the records travel in device memory, like every NCCL message
    checked(ring_call(t, o, slice_elems, false, job.op), unprepared, [&](const RingCall& call) {
      const int64_t record = sizeof(RingCall);
      auto* records = reinterpret_cast<RingCall*>(check_table_.data_ptr<uint8_t>());
      std::vector<RingCall> host(n);
      aborting_on_failure([&] {
        NcclTransport transport(*nccl(), compute_stream_, wire_stream_);
        C10_CUDA_CHECK(cudaMemcpyAsync(records + rank(), &call, record, cudaMemcpyHostToDevice, compute_stream_));
        exchange_ring_calls(transport, records, 0);
        nccl()->synchronize(compute_stream_);
        // on the compute stream, not the legacy default one, which would wait for the caller's work
        C10_CUDA_CHECK(cudaMemcpyAsync(host.data(), records, n * record, cudaMemcpyDeviceToHost, compute_stream_));
        C10_CUDA_CHECK(cudaStreamSynchronize(compute_stream_));
      });
      compare_ring_calls(host.data(), n, rank());  // every rank raises alike; the communicator stays usable
    });
  }
  if (unprepared) {
    if (!o.check_call && n > 1) nccl()->abort(compute_stream_);  // the peers are in the ring, matched by order
    std::rethrow_exception(unprepared);
  }
  aborting_on_failure([&] {
    // the check does not touch the tensor, so it need not wait for the caller's stream
    C10_CUDA_CHECK(cudaStreamWaitEvent(compute_stream_, static_cast<cudaEvent_t>(job.ready.get()), 0));
    if (job.op == kAllGather) place_gather_input(job);  // on the compute stream, current here
    NcclTransport transport(*nccl(), compute_stream_, wire_stream_);
    if (job.op == kReduceScatter) ring_reduce_scatter(transport, *kernels, plan, recv_image, send_image, 0);
    else if (job.op == kAllGather) ring_all_gather(transport, *kernels, plan, recv_image, send_image, 0);
    else ring_allreduce(transport, *kernels, plan, recv_image, send_image, 0);
    nccl()->synchronize(compute_stream_);
  });
}
#endif

void bind_ring(pybind11::module& m) {
  namespace py = pybind11;
  m.def("nccl_unique_id", []() {
#ifdef GRADSYNC_WITH_CUDA
    return py::bytes(NcclComm::unique_id());
#else
    TORCH_CHECK(false, "gradsync was built without CUDA");
    return py::bytes();
#endif
  });
  // for benchmarks/bench_nccl_hop.py: a list of {bytes, issue_s, pipelined_s, alone_s}, sizes x repeats
  m.def("_nccl_hop_cost", [](int device, int hops, std::vector<int64_t> sizes, int repeats, double timeout_s) {
    py::list out;
#ifdef GRADSYNC_WITH_CUDA
    std::vector<NcclHopCost> costs;
    {
      py::gil_scoped_release release;
      costs = measure_nccl_hop_cost(device, hops, sizes, repeats, static_cast<int64_t>(timeout_s * 1000));
    }
    for (size_t i = 0; i < costs.size(); ++i) {
      py::dict row;
      row["bytes"] = sizes[i / static_cast<size_t>(repeats)];
      row["issue_s"] = costs[i].issue_s;
      row["pipelined_s"] = costs[i].pipelined_s;
      row["alone_s"] = costs[i].alone_s;
      out.append(row);
    }
#else
    (void)device, (void)hops, (void)sizes, (void)repeats, (void)timeout_s;
    TORCH_CHECK(false, "gradsync was built without CUDA");
#endif
    return out;
  }, py::arg("device"), py::arg("hops"), py::arg("sizes"), py::arg("repeats") = 1, py::arg("timeout_s") = 60.0);
  m.def("_on_engine_thread", &RingEngine::on_worker_thread);
  // The engines of groups torch.distributed destroyed: stopped (once their calls are done) and rid of
  // their groups on a thread of their own, so that the interpreter may exit while a call of theirs
  // still waits for a peer. _wait_for_releases waits up to wait_s (the GIL released) for every
  // release begun so far, and says whether they all finished: at exit, a teardown that ends during
  // the interpreter's finalization aborts the process where it takes the GIL (torch 2.14's does as it
  // ends, letting go of the backend's Python object).
  m.def("_release_engines", [](std::vector<std::shared_ptr<RingEngine>> engines) {
    Releases& counted = *releases;
    {
      std::lock_guard<std::mutex> lock(counted.mutex);
      ++counted.running;
    }
    std::thread([engines = std::move(engines), &counted]() mutable {
      for (auto& engine : engines) {
        engine->stop();
        engine->release_group();
      }
      engines.clear();
      std::lock_guard<std::mutex> lock(counted.mutex);
      --counted.running;
      counted.finished.notify_all();
    }).detach();
  }, py::arg("engines"));
  m.def("_wait_for_releases", [](double wait_s) {
    Releases& counted = *releases;
    py::gil_scoped_release unlocked;  // the backend's teardown may need the GIL
    std::unique_lock<std::mutex> lock(counted.mutex);
    return counted.finished.wait_for(lock, std::chrono::duration<double>(wait_s), [&] { return counted.running == 0; });
  }, py::arg("wait_s"));
  // In a forked child: the parent's release threads did not survive the fork, and their count and
  // mutex are as they left them; the child counts its own.
  m.def("_forget_releases_after_fork", [] { releases = new Releases(); });
  py::class_<RingWork, std::shared_ptr<RingWork>>(m, "RingWork")
      .def("wait", &RingWork::wait, py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &RingWork::is_completed)
      .def("get_future", [](const RingWork& w) { return std::make_shared<torch::jit::PythonFutureWrapper>(w.future()); });
  py::class_<RingEngine, std::shared_ptr<RingEngine>>(m, "RingEngine")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, uint32_t>(), py::arg("group"), py::arg("first_sequence") = 0)
      .def("stop", &RingEngine::stop, py::call_guard<py::gil_scoped_release>())
      .def("stop_if_idle", &RingEngine::stop_if_idle)
      .def("abandon_group", &RingEngine::abandon_group)
      .def("abort_calls", &RingEngine::abort_calls, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("sequence", &RingEngine::sequence)
      .def_property_readonly("on_own_worker_thread", &RingEngine::on_own_worker_thread)
      .def_property_readonly("accepts_calls", &RingEngine::accepts_calls)
      // In a forked child: the engine's thread did not survive the fork, and its mutex and condition
      // variable are as that thread left them, so stopping or destroying the engine could wait
      // forever. It is kept, untouched, for the rest of the process.
      .def("abandon_after_fork", [](std::shared_ptr<RingEngine> e) { new std::shared_ptr<RingEngine>(std::move(e)); })
      .def_property_readonly("broken", &RingEngine::broken)
      .def_property_readonly("group_references", &RingEngine::group_references)
      .def_property_readonly("rank", &RingEngine::rank)
      .def_property_readonly("size", &RingEngine::size)
      .def_property_readonly("nccl_device", &RingEngine::nccl_device)
      .def(
          "refuse",
          [](RingEngine& e, at::Tensor placeholder, int op, bool check_call, int64_t slice_bytes, std::string why) {
            return e.refuse(std::move(placeholder), static_cast<RingOp>(op),
                            RingOptions{0, 1.0, 1.0, check_call, slice_bytes}, std::move(why));
          },
          py::arg("placeholder"), py::arg("op"), py::arg("check_call"), py::arg("slice_bytes"), py::arg("why"))
      .def("attach_nccl", &RingEngine::attach_nccl, py::arg("unique_id"), py::arg("device"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce",
          [](RingEngine& e, at::Tensor tensor, int64_t codec, double prescale, double postscale, bool check_call,
             int64_t slice_bytes, std::optional<at::Tensor> residual, int64_t direct_bytes,
             std::shared_ptr<RingWork> after, int32_t layout) {
            return e.all_reduce(std::move(tensor), RingOptions{codec, prescale, postscale, check_call, slice_bytes,
                                                               residual.value_or(at::Tensor()), direct_bytes, after,
                                                               layout});
          },
          py::arg("tensor"), py::arg("codec"), py::arg("prescale"), py::arg("postscale"), py::arg("check_call"),
          py::arg("slice_bytes"), py::arg("residual") = py::none(), py::arg("direct_bytes") = 0,
          py::arg("after") = py::none(), py::arg("layout") = 0)
      .def(
          "all_gather",
          [](RingEngine& e, at::Tensor output, at::Tensor input, int64_t codec, bool check_call, int64_t slice_bytes,
             std::shared_ptr<RingWork> after) {
            return e.all_gather(std::move(output), std::move(input),
                                RingOptions{codec, 1.0, 1.0, check_call, slice_bytes, at::Tensor(), 0, after});
          },
          py::arg("output"), py::arg("input"), py::arg("codec"), py::arg("check_call"), py::arg("slice_bytes"),
          py::arg("after") = py::none())
      .def(
          "reduce_scatter",
          [](RingEngine& e, at::Tensor output, at::Tensor input, int64_t codec, double prescale, double postscale,
             bool check_call, int64_t slice_bytes, std::optional<at::Tensor> residual, int32_t layout) {
            return e.reduce_scatter(std::move(output), std::move(input),
                                    RingOptions{codec, prescale, postscale, check_call, slice_bytes,
                                                residual.value_or(at::Tensor()), 0, nullptr, layout});
          },
          py::arg("output"), py::arg("input"), py::arg("codec"), py::arg("prescale"), py::arg("postscale"),
          py::arg("check_call"), py::arg("slice_bytes"), py::arg("residual") = py::none(), py::arg("layout") = 0);
}

}  // namespace gradsync
