#include <algorithm>

#include "cuda_common.h"
#include "multi_tensor.h"

namespace gradsync {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per vector access: 16 bytes of 16-bit data, 2 x 16 bytes of fp32

// Loads/stores kVec elements at p + i (16-byte aligned).
template <DType T>
__device__ __forceinline__ void load_vec(const void* p, int64_t i, float (&v)[kVec]) {
  if constexpr (T == DType::kFloat32) {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 a = q[0], b = q[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (T == DType::kFloat16) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
        v[2 * j] = f.x; v[2 * j + 1] = f.y;
      } else {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
        v[2 * j] = f.x; v[2 * j + 1] = f.y;
      }
    }
  }
}

template <DType T>
__device__ __forceinline__ void store_vec(void* p, int64_t i, const float (&v)[kVec]) {
  if constexpr (T == DType::kFloat32) {
    float4* q = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (T == DType::kFloat16) {
        const __half2 h = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
        w[j] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
        w[j] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Copies `count` elements from src (type S) to dst (type D), both contiguous, scaling in fp32.
template <DType S, DType D>
__device__ void copy_contiguous(const void* src, void* dst, int64_t count, float scale, bool aligned) {
  int64_t first_scalar = 0;
  if (aligned) {
    const int64_t vecs = count / kVec;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float x[kVec];
      load_vec<S>(src, v * kVec, x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[j] *= scale;
      store_vec<D>(dst, v * kVec, x);
    }
    first_scalar = vecs * kVec;
  }
  for (int64_t i = first_scalar + threadIdx.x; i < count; i += blockDim.x) {
    store_one<D>(dst, i, load_one<S>(src, i) * scale);
  }
}

template <DType F, Direction Dir, DType T>
__device__ void copy_chunk(const Segment& s, int64_t begin, int64_t count, void* flat, float scale) {
  char* flat_at = static_cast<char*>(flat) + (s.flat_offset + begin) * dtype_size(F);
  if (s.ndim == 0) {
    char* tensor_at = static_cast<char*>(s.data) + begin * dtype_size(T);
    if constexpr (Dir == Direction::kToFlat) copy_contiguous<T, F>(tensor_at, flat_at, count, scale, s.aligned);
    else copy_contiguous<F, T>(flat_at, tensor_at, count, scale, s.aligned);
    return;
  }
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t t = strided_offset(s, begin + i);
    if constexpr (Dir == Direction::kToFlat) store_one<F>(flat_at, i, load_one<T>(s.data, t) * scale);
    else store_one<T>(s.data, t, load_one<F>(flat_at, i) * scale);
  }
}

template <DType F, Direction Dir>
__global__ void __launch_bounds__(kThreads) multi_tensor_copy_kernel(const Segment* segments, int64_t num_segments,
                                                                     int64_t num_chunks, void* flat, float scale) {
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Segment& s = segments[find_segment(segments, num_segments, c)];
    const int64_t begin = (c - s.first_chunk) * kCudaChunk;
    const int64_t count = min(kCudaChunk, s.numel - begin);
    switch (s.dtype) {
      case DType::kFloat32: copy_chunk<F, Dir, DType::kFloat32>(s, begin, count, flat, scale); break;
      case DType::kFloat16: copy_chunk<F, Dir, DType::kFloat16>(s, begin, count, flat, scale); break;
      default: copy_chunk<F, Dir, DType::kBFloat16>(s, begin, count, flat, scale); break;
    }
  }
}

template <DType F>
cudaError_t launch(const Segment* segments, int64_t num_segments, int64_t num_chunks, void* flat, float scale,
                   Direction direction, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(num_chunks, max_resident_blocks(kThreads)));
  if (direction == Direction::kToFlat) {
    multi_tensor_copy_kernel<F, Direction::kToFlat>
        <<<grid, kThreads, 0, stream>>>(segments, num_segments, num_chunks, flat, scale);
  } else {
    multi_tensor_copy_kernel<F, Direction::kFromFlat>
        <<<grid, kThreads, 0, stream>>>(segments, num_segments, num_chunks, flat, scale);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t load_multi_tensor_kernels() {
  return for_each_dtype([](auto f) {
    constexpr DType F = decltype(f)::value;
    return load_kernels(multi_tensor_copy_kernel<F, Direction::kToFlat>, multi_tensor_copy_kernel<F, Direction::kFromFlat>);
  });
}

cudaError_t multi_tensor_copy_cuda(const Segment* segments, int64_t num_segments, int64_t num_chunks, void* flat,
                                   DType flat_dtype, float scale, Direction direction, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  switch (flat_dtype) {
    case DType::kFloat32: return launch<DType::kFloat32>(segments, num_segments, num_chunks, flat, scale, direction, stream);
    case DType::kFloat16: return launch<DType::kFloat16>(segments, num_segments, num_chunks, flat, scale, direction, stream);
    default: return launch<DType::kBFloat16>(segments, num_segments, num_chunks, flat, scale, direction, stream);
  }
}

}  // namespace gradsync
