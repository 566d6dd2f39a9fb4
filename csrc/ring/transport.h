// The narrow interface between the ring algorithm and a wire. The ring knows nothing else of it.
#pragma once

#include <cstdint>

namespace gradsync {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Post a message to/from a peer; never blocks. The buffer stays untouched until the message is
  // complete. Messages between two ranks match by tag, and by order within a tag.
  virtual int64_t send(const void* data, int64_t bytes, int peer, uint32_t tag) = 0;
  virtual int64_t recv(void* data, int64_t bytes, int peer, uint32_t tag) = 0;
  // Blocks until that message is complete (for a receive: its bytes are readable by the kernels);
  // throws on failure or timeout.
  virtual void wait(int64_t handle) = 0;
  // Blocks until every posted message is complete; throws on failure or timeout.
  virtual void wait_all() = 0;

  // A rendezvous transport (gloo) moves nothing before the receive exists, so the ring posts every
  // receive of a phase up front. A stream-ordered transport (NCCL) runs messages in the order they
  // were issued, so the ring issues each hop's send and receive together, inside group_begin/end.
  virtual bool posts_receives_ahead() const { return true; }
  virtual void group_begin() {}
  virtual void group_end() {}
  // Messages issued after this are ordered after every kernel issued before it (a no-op where the
  // kernels finish before they return).
  virtual void fence() {}
};

}  // namespace gradsync
