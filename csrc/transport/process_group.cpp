#include "transport/process_group.h"

#include <typeinfo>

namespace gradsync {
namespace {
at::Tensor host_bytes(const void* data, int64_t bytes) {
  return at::from_blob(const_cast<void*>(data), {bytes}, at::TensorOptions().dtype(at::kByte));
}

// The group's backend for host memory; null where it has none (torch's getBackend throws).
c10::intrusive_ptr<c10d::Backend> cpu_backend(c10d::ProcessGroup& group) {
  try {
    return group.getBackend(c10::DeviceType::CPU);
  } catch (const std::exception&) {
    return nullptr;
  }
}

// The group's timeout as it is now: torch.distributed's _set_pg_timeout changes it after the group
// was made (torch's collectives follow), while gloo's point-to-point waits keep the one the group's
// connections were made with unless told.
std::chrono::milliseconds current_timeout(c10d::ProcessGroup& group) {
  constexpr std::chrono::milliseconds its_own(0);  // torch's kNoTimeout: a backend that does not say keeps its own
  const auto backend = cpu_backend(group);
  try {  // a backend may not implement getBackendOptions
    const auto options = backend ? backend->getBackendOptions() : nullptr;
    return options ? options->timeout : its_own;
  } catch (const std::exception&) {
    return its_own;
  }
}

// A group of torch's own class without a CPU backend refuses every rank's post alike. (A group
// subclassed in Python posts by its own methods, whatever backends it registered.)
bool without_cpu_backend(c10d::ProcessGroup& group) {
  return typeid(group) == typeid(c10d::ProcessGroup) && !cpu_backend(group);
}

constexpr const char* kAborted = "gradsync: the group's calls were abandoned as the process exits";
}  // namespace

// A work's wait returns false once abort() ended it (a backend of Python's may return false, or
// None, for a plain success: only an abort counts).
void ProcessGroupTransport::wait_for(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
  if (work->wait(timeout)) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) throw std::runtime_error(kAborted);
}

// A post the group refuses counts (see posted()), unless the group has no CPU backend to refuse
// it: then every rank's post is refused alike and none went anywhere.
template <typename Post>
c10::intrusive_ptr<c10d::Work> ProcessGroupTransport::posting(const Post& post) {
  try {
    auto work = post();
    ++posted_;
    return work;
  } catch (const std::exception& e) {
    if (!without_cpu_backend(*group_)) {
      ++posted_;
      throw;
    }
    const auto* error = dynamic_cast<const c10::Error*>(&e);  // torch's: without its C++ backtrace
    throw std::runtime_error(std::string("gradsync: the process group has no backend for CPU tensors, and the ring "
                                         "over it moves host memory (CUDA tensors are staged there): ") +
                             (error ? error->what_without_backtrace() : e.what()));
  }
}

int64_t ProcessGroupTransport::send(const void* data, int64_t bytes, int peer, uint32_t tag) {
  std::vector<at::Tensor> tensors{host_bytes(data, bytes)};
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) throw std::runtime_error(kAborted);
  pending_.push_back(posting([&] { return group_->send(tensors, peer, static_cast<int>(tag)); }));
  return static_cast<int64_t>(pending_.size()) - 1;
}

int64_t ProcessGroupTransport::recv(void* data, int64_t bytes, int peer, uint32_t tag) {
  std::vector<at::Tensor> tensors{host_bytes(data, bytes)};
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) throw std::runtime_error(kAborted);
  pending_.push_back(posting([&] { return group_->recv(tensors, peer, static_cast<int>(tag)); }));
  return static_cast<int64_t>(pending_.size()) - 1;
}

// The work is copied out under the lock and waited for without it, so that abort() can reach it.
void ProcessGroupTransport::wait_one(size_t handle, std::chrono::milliseconds timeout) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    work = pending_.at(handle);
  }
  if (!work) return;
  wait_for(work, timeout);
  std::lock_guard<std::mutex> lock(mutex_);
  pending_[handle].reset();
}

void ProcessGroupTransport::wait(int64_t handle) { wait_one(static_cast<size_t>(handle), current_timeout(*group_)); }

void ProcessGroupTransport::wait_all() {
  const auto timeout = current_timeout(*group_);
  size_t posted;  // only this (the worker's) thread posts
  {
    std::lock_guard<std::mutex> lock(mutex_);
    posted = pending_.size();
  }
  for (size_t i = 0; i < posted; ++i) wait_one(i, timeout);
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.clear();
}

void ProcessGroupTransport::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  aborted_ = true;
  for (auto& work : pending_) {
    try {
      if (work) work->abort();
    } catch (const std::exception&) {  // torch's base Work cannot abort: that wait runs to its end
    }
  }
}

}  // namespace gradsync
