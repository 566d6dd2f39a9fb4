// Transport over a torch.distributed ProcessGroup's point-to-point send/recv (gloo on CPU).
//
// Messages carry host memory. Tags live in gradsync's own range (>= 2^30), apart from the small
// tags of user point-to-point traffic; gloo keeps point-to-point apart from collectives by itself.
// A wait's timeout is the group's (the `timeout` given to init_process_group / new_group, or set
// since by torch.distributed's _set_pg_timeout): a dead peer closes its connections, and a peer
// that never answers runs into that timeout.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <mutex>
#include <vector>

#include "ring/transport.h"

namespace gradsync {

class ProcessGroupTransport : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)), rank_(group_->getRank()), size_(group_->getSize()) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int64_t send(const void* data, int64_t bytes, int peer, uint32_t tag) override;
  int64_t recv(void* data, int64_t bytes, int peer, uint32_t tag) override;
  void wait(int64_t handle) override;
  void wait_all() override;
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }
  // No message may be in flight, and none is sent after: the last reference to a destroyed group.
  void release_group() {
    pending_.clear();
    group_.reset();
  }
  // From any thread: the messages in flight end (their waits throw), and later ones are refused.
  // For calls whose peers will never answer, which the process ends without.
  void abort();
  // How many messages were ever posted: unchanged across a failed call means none is in flight.
  // A post the group refused counts (gloo refuses a connection a dead peer closed): the peers'
  // messages of that call may be on their way here. Not where the group has no CPU backend: there
  // every rank's post is refused alike (see posting()).
  int64_t posted() const { return posted_; }

 private:
  void wait_for(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout);
  void wait_one(size_t handle, std::chrono::milliseconds timeout);
  template <typename Post>
  c10::intrusive_ptr<c10d::Work> posting(const Post& post);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_, size_;
  std::mutex mutex_;  // pending_ and aborted_, against abort() from another thread
  bool aborted_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_;  // index = handle; null once waited for
  int64_t posted_ = 0;
};

}  // namespace gradsync
