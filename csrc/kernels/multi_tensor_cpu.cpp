#include <algorithm>

#include "codec.h"
#include "multi_tensor.h"

namespace gradsync {
namespace {

void copy_strided(const Segment& s, int64_t begin, int64_t count, void* flat, DType flat_dtype, float scale,
                  Direction direction) {
  // Rows along the innermost dimension, so that a transposed or sliced tensor still runs through
  // the vectorized converter whenever its innermost stride is 1.
  const int64_t row = s.sizes[s.ndim - 1];
  const int64_t inner_stride = s.strides[s.ndim - 1];
  const int tsize = dtype_size(s.dtype), fsize = dtype_size(flat_dtype);
  int64_t i = begin;
  const int64_t end = begin + count;
  while (i < end) {
    const int64_t len = std::min(end - i, row - i % row);
    char* t = static_cast<char*>(s.data) + strided_offset(s, i) * tsize;
    char* f = static_cast<char*>(flat) + (s.flat_offset + i) * fsize;
    if (inner_stride == 1) {
      if (direction == Direction::kToFlat) convert_cpu(t, s.dtype, f, flat_dtype, len, scale);
      else convert_cpu(f, flat_dtype, t, s.dtype, len, scale);
    } else {
      for (int64_t j = 0; j < len; ++j) {
        char* tj = t + j * inner_stride * tsize;
        char* fj = f + j * fsize;
        if (direction == Direction::kToFlat) convert_cpu(tj, s.dtype, fj, flat_dtype, 1, scale);
        else convert_cpu(fj, flat_dtype, tj, s.dtype, 1, scale);
      }
    }
    i += len;
  }
}

}  // namespace

void multi_tensor_copy_cpu(const Segment* segments, int64_t num_segments, void* flat, DType flat_dtype, float scale,
                           Direction direction, int64_t chunk_begin, int64_t chunk_end) {
  if (chunk_begin >= chunk_end) return;
  int64_t seg = find_segment(segments, num_segments, chunk_begin);
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    while (seg + 1 < num_segments && segments[seg + 1].first_chunk <= c) ++seg;
    const Segment& s = segments[seg];
    const int64_t begin = (c - s.first_chunk) * kCpuChunk;
    const int64_t count = std::min(kCpuChunk, s.numel - begin);
    if (s.ndim != 0) {
      copy_strided(s, begin, count, flat, flat_dtype, scale, direction);
      continue;
    }
    char* t = static_cast<char*>(s.data) + begin * dtype_size(s.dtype);
    char* f = static_cast<char*>(flat) + (s.flat_offset + begin) * dtype_size(flat_dtype);
    if (direction == Direction::kToFlat) convert_cpu(t, s.dtype, f, flat_dtype, count, scale);
    else convert_cpu(f, flat_dtype, t, s.dtype, count, scale);
  }
}

}  // namespace gradsync
