#include "transport/process_group.h"

namespace gradsync {
namespace {
at::Tensor host_bytes(const void* data, int64_t bytes) {
  return at::from_blob(const_cast<void*>(data), {bytes}, at::TensorOptions().dtype(at::kByte));
}
}  // namespace

int64_t ProcessGroupTransport::send(const void* data, int64_t bytes, int peer, uint32_t tag) {
  std::vector<at::Tensor> tensors{host_bytes(data, bytes)};
  pending_.push_back(group_->send(tensors, peer, static_cast<int>(tag)));
  ++posted_;
  return static_cast<int64_t>(pending_.size()) - 1;
}

int64_t ProcessGroupTransport::recv(void* data, int64_t bytes, int peer, uint32_t tag) {
  std::vector<at::Tensor> tensors{host_bytes(data, bytes)};
  pending_.push_back(group_->recv(tensors, peer, static_cast<int>(tag)));
  ++posted_;
  return static_cast<int64_t>(pending_.size()) - 1;
}

void ProcessGroupTransport::wait(int64_t handle) {
  auto& work = pending_.at(static_cast<size_t>(handle));
  if (!work) return;
  work->wait();
  work.reset();
}

void ProcessGroupTransport::wait_all() {
  for (auto& work : pending_) {
    if (!work) continue;
    work->wait();
    work.reset();
  }
  pending_.clear();
}

}  // namespace gradsync
