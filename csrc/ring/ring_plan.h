// How the ring cuts a buffer: n chunks (one per rank, each a multiple of the fp8 block so that
// blocks and 16-byte alignment hold; a reduce-scatter's are the size its caller gives), each chunk
// in slices that are encoded and sent separately so that the transfer of slice k+1 overlaps the
// reduction of slice k. Every rank computes the same plan.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace gradsync {

constexpr int64_t kRingAlign = 128;  // elements; = kFp8BlockSize

// Slice size in elements for a buffer whose elements take `wire_size` bytes on the wire: about
// eight slices per chunk, since pipelining hides all but one slice's transfer at each end of the
// ring, but at most `max_bytes` and at least a quarter of it, since every message has a fixed cost.
inline int64_t ring_slice_elems(int64_t numel, int ranks, int64_t wire_size, int64_t max_bytes) {
  constexpr int64_t kSlicesPerChunk = 8;
  const int64_t chunk_bytes = (numel + ranks - 1) / ranks * wire_size;
  max_bytes = std::max<int64_t>(1, max_bytes);
  const int64_t bytes = std::clamp(chunk_bytes / kSlicesPerChunk, std::max<int64_t>(1, max_bytes / 4), max_bytes);
  return std::max<int64_t>(1, bytes / wire_size);
}

class RingPlan {
 public:
  RingPlan(int64_t numel, int ranks, int64_t slice_elems)
      : RingPlan(numel, ranks, slice_elems, round_up((numel + ranks - 1) / ranks), 0) {}
  // For a reduce-scatter of `numel` = ranks * s elements: chunks of exactly s elements (aligned or
  // not), the ring's chunk c being the buffer's chunk c + ranks - 1, so that the chunk each rank
  // reduces last (the ring's chunk rank + 1) is the buffer's chunk `rank`.
  static RingPlan scatter(int64_t numel, int ranks, int64_t slice_elems) {
    return RingPlan(numel, ranks, slice_elems, numel / ranks, ranks - 1);
  }

  int ranks() const { return ranks_; }
  int64_t numel() const { return numel_; }
  int64_t chunk_begin(int c) const { return std::min(numel_, place(c) * chunk_); }
  int64_t chunk_len(int c) const { return std::min(numel_, (place(c) + 1) * chunk_) - chunk_begin(c); }
  int slices(int c) const { return static_cast<int>((chunk_len(c) + slice_ - 1) / slice_); }
  // the buffer's first chunk is never shorter than another
  int max_slices() const { return static_cast<int>((std::min(numel_, chunk_) + slice_ - 1) / slice_); }
  int64_t max_slice_len() const { return std::min(slice_, std::min(numel_, chunk_)); }
  int64_t slice_begin(int c, int k) const { return chunk_begin(c) + k * slice_; }
  int64_t slice_len(int c, int k) const { return std::min(slice_, chunk_len(c) - k * slice_); }

  // Byte offsets of every (chunk, slice) payload in a payload image, given the payload size of n
  // elements; each payload starts 16-byte aligned. Returns the image size.
  template <typename PayloadBytes>
  int64_t layout(PayloadBytes payload_bytes, std::vector<int64_t>& offsets) const {
    const int k_max = max_slices();
    offsets.assign(static_cast<size_t>(ranks_) * std::max(k_max, 1), 0);
    int64_t at = 0;
    for (int c = 0; c < ranks_; ++c) {
      for (int k = 0; k < slices(c); ++k) {
        offsets[static_cast<size_t>(c) * k_max + k] = at;
        at += (payload_bytes(slice_len(c, k)) + 15) / 16 * 16;
      }
    }
    return at;
  }

 private:
  RingPlan(int64_t numel, int ranks, int64_t slice_elems, int64_t chunk, int rotation)
      : numel_(numel), ranks_(ranks), rotation_(rotation), chunk_(chunk),
        slice_(std::max<int64_t>(kRingAlign, round_up(slice_elems))) {}
  static int64_t round_up(int64_t x) { return (x + kRingAlign - 1) / kRingAlign * kRingAlign; }
  int64_t place(int c) const { return (c + rotation_) % ranks_; }  // the buffer's chunk of the ring's chunk c
  int64_t numel_;
  int ranks_, rotation_;
  int64_t chunk_, slice_;
};

}  // namespace gradsync
