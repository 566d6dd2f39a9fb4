// Multi-tensor flatten/unflatten: one pass (one CUDA launch) over a whole list of tensors.
//
// The caller describes each tensor as a Segment of the flat buffer and cuts every segment into
// fixed-size chunks; a worker (CPU thread or CUDA block) takes whole chunks, so each chunk belongs to
// exactly one tensor and the element-wise work is uniform within it.
#pragma once

#include <cstdint>

#include "numerics.h"

namespace gradsync {

constexpr int kMaxDims = 6;

struct Segment {
  void* data;           // the tensor's first element
  int64_t numel;
  int64_t flat_offset;  // element offset of this tensor in the flat buffer
  int64_t first_chunk;  // index of the segment's first chunk in the whole list
  DType dtype;
  int32_t ndim;       // 0: contiguous; otherwise sizes/strides (in elements) of a strided view
  int32_t aligned;    // tensor and flat range both 16-byte aligned: vector loads/stores allowed
  int32_t reserved;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

enum class Direction : int32_t { kToFlat = 0, kFromFlat = 1 };

// Fills first_chunk for every segment; returns the total number of chunks.
inline int64_t plan_chunks(Segment* segments, int64_t num_segments, int64_t chunk_size) {
  int64_t total = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    segments[i].first_chunk = total;
    total += (segments[i].numel + chunk_size - 1) / chunk_size;
  }
  return total;
}

// Index of the segment holding `chunk`: the last one whose first_chunk <= chunk.
GS_HD int64_t find_segment(const Segment* segments, int64_t num_segments, int64_t chunk) {
  int64_t lo = 0, hi = num_segments;  // invariant: answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (segments[mid].first_chunk <= chunk) lo = mid; else hi = mid;
  }
  return lo;
}

// Offset in elements of the i-th element (row-major order) of a strided segment.
GS_HD int64_t strided_offset(const Segment& s, int64_t i) {
  int64_t off = 0;
  for (int d = s.ndim - 1; d >= 0; --d) {
    off += (i % s.sizes[d]) * s.strides[d];
    i /= s.sizes[d];
  }
  return off;
}

constexpr int64_t kCpuChunk = 1 << 15;

// Processes chunks [chunk_begin, chunk_end) of a plan made with kCpuChunk.
void multi_tensor_copy_cpu(const Segment* segments, int64_t num_segments, void* flat, DType flat_dtype,
                           float scale, Direction direction, int64_t chunk_begin, int64_t chunk_end);

#ifdef GRADSYNC_WITH_CUDA
}  // namespace gradsync
#include <cuda_runtime.h>
namespace gradsync {
constexpr int64_t kCudaChunk = 1 << 14;
// `segments` lives in device memory; the plan was made with kCudaChunk. One kernel launch.
cudaError_t multi_tensor_copy_cuda(const Segment* segments, int64_t num_segments, int64_t num_chunks, void* flat,
                                   DType flat_dtype, float scale, Direction direction, cudaStream_t stream);
// Every kernel of multi_tensor_copy_cuda, loaded now (see load_kernels in cuda_common.h).
cudaError_t load_multi_tensor_kernels();
#endif

}  // namespace gradsync
