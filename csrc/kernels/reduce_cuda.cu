// Element-wise kernels of the ring for the cast codecs, twins of convert_cpu, reduce_cast_cpu,
// reduce_cast_feedback_cpu and reduce_decode_cpu: out = cast(src * scale),
// out = cast<wire>(in + local * prescale) and the reduce-scatter's last hop, in fp32.
#include <algorithm>

#include "codec.h"
#include "cuda_common.h"

namespace gradsync {
namespace {

constexpr int kThreads = 256;

template <DType W, DType L>
__global__ void __launch_bounds__(kThreads) reduce_cast_kernel(const void* in, const void* local, int64_t n,
                                                               float prescale, void* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    store_one<W>(out, i, hop_sum(load_one<W>(in, i), load_one<L>(local, i) * prescale));
  }
}

template <DType S, DType D>
__global__ void __launch_bounds__(kThreads) convert_kernel(const void* src, void* dst, int64_t n, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    store_one<D>(dst, i, load_one<S>(src, i) * scale);
  }
}

// reduce_cast_kernel with error feedback (codec.h); in == nullptr when kIn is false.
template <DType W, DType L, bool kIn>
__global__ void __launch_bounds__(kThreads) reduce_cast_feedback_kernel(const void* in, const void* local, int64_t n,
                                                                        float prescale, float* residual, void* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float mine = load_one<L>(local, i) * prescale;
    const float sum = hop_sum(kIn ? hop_sum(load_one<W>(in, i), mine) : mine, residual[i]);
    residual[i] = feedback_residual(sum, store_one<W>(out, i, sum));
  }
}

// A reduce-scatter's last hop (codec.h, reduce_decode_cpu): the sum is cast to the result's dtype,
// never encoded. kIn false: no incoming payload (in == nullptr, W unused).
template <DType W, DType L, bool kIn, bool kResidual>
__global__ void __launch_bounds__(kThreads) reduce_decode_kernel(const void* in, const void* local, int64_t n,
                                                                 float prescale, float postscale, float* residual,
                                                                 void* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float sum = load_one<L>(local, i) * prescale;
    if constexpr (kIn) sum = hop_sum(load_one<W>(in, i), sum);
    if constexpr (kResidual) sum = hop_sum(sum, residual[i]);
    const float stored = store_one<L>(out, i, sum * postscale);
    // nothing was encoded; storing into a 16-bit tensor is the one rounding
    if constexpr (kResidual) residual[i] = L == DType::kFloat32 ? 0.0f : store_residual(sum, stored, postscale);
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, max_resident_blocks(kThreads));
  return static_cast<unsigned>(std::max<int64_t>(1, blocks));
}

template <DType S>
void launch_convert(const void* src, void* dst, DType dt, int64_t n, float scale, cudaStream_t stream) {
  const unsigned grid = grid_for(n);
  switch (dt) {
    case DType::kFloat32: convert_kernel<S, DType::kFloat32><<<grid, kThreads, 0, stream>>>(src, dst, n, scale); break;
    case DType::kFloat16: convert_kernel<S, DType::kFloat16><<<grid, kThreads, 0, stream>>>(src, dst, n, scale); break;
    default: convert_kernel<S, DType::kBFloat16><<<grid, kThreads, 0, stream>>>(src, dst, n, scale); break;
  }
}

template <DType W>
void launch(const void* in, const void* local, DType lt, int64_t n, float prescale, void* out, cudaStream_t stream) {
  const unsigned grid = grid_for(n);
  switch (lt) {
    case DType::kFloat32: reduce_cast_kernel<W, DType::kFloat32><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
    case DType::kFloat16: reduce_cast_kernel<W, DType::kFloat16><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
    default: reduce_cast_kernel<W, DType::kBFloat16><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
  }
}

template <DType W, DType L>
void launch_feedback_local(const void* in, const void* local, int64_t n, float prescale, float* residual, void* out,
                           cudaStream_t stream) {
  const unsigned grid = grid_for(n);
  if (in) reduce_cast_feedback_kernel<W, L, true><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, residual, out);
  else reduce_cast_feedback_kernel<W, L, false><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, residual, out);
}

template <DType W>
void launch_feedback(const void* in, const void* local, DType lt, int64_t n, float prescale, float* residual, void* out,
                     cudaStream_t stream) {
  switch (lt) {
    case DType::kFloat32: launch_feedback_local<W, DType::kFloat32>(in, local, n, prescale, residual, out, stream); break;
    case DType::kFloat16: launch_feedback_local<W, DType::kFloat16>(in, local, n, prescale, residual, out, stream); break;
    default: launch_feedback_local<W, DType::kBFloat16>(in, local, n, prescale, residual, out, stream); break;
  }
}

template <DType W, DType L, bool kIn>
void launch_reduce_decode_in(const void* in, const void* local, int64_t n, float prescale, float postscale,
                             float* residual, void* out, cudaStream_t stream) {
  const unsigned grid = grid_for(n);
  if (residual) {
    reduce_decode_kernel<W, L, kIn, true><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, postscale, residual, out);
  } else {
    reduce_decode_kernel<W, L, kIn, false><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, postscale, residual, out);
  }
}

template <DType L>
void launch_reduce_decode(const void* in, DType wire, const void* local, int64_t n, float prescale, float postscale,
                          float* residual, void* out, cudaStream_t stream) {
  if (!in) return launch_reduce_decode_in<DType::kFloat32, L, false>(in, local, n, prescale, postscale, residual, out, stream);
  switch (wire) {
    case DType::kFloat32: return launch_reduce_decode_in<DType::kFloat32, L, true>(in, local, n, prescale, postscale, residual, out, stream);
    case DType::kFloat16: return launch_reduce_decode_in<DType::kFloat16, L, true>(in, local, n, prescale, postscale, residual, out, stream);
    default: return launch_reduce_decode_in<DType::kBFloat16, L, true>(in, local, n, prescale, postscale, residual, out, stream);
  }
}

}  // namespace

cudaError_t load_cast_kernels() {
  return for_each_dtype([](auto w) {
    return for_each_dtype([](auto l) {
      constexpr DType W = decltype(w)::value, L = decltype(l)::value;
      return load_kernels(reduce_cast_kernel<W, L>, convert_kernel<W, L>, reduce_cast_feedback_kernel<W, L, true>,
                          reduce_cast_feedback_kernel<W, L, false>, reduce_decode_kernel<W, L, true, false>,
                          reduce_decode_kernel<W, L, true, true>, reduce_decode_kernel<DType::kFloat32, L, false, false>,
                          reduce_decode_kernel<DType::kFloat32, L, false, true>);
    });
  });
}

cudaError_t convert_cuda(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, float scale,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (src_dtype) {
    case DType::kFloat32: launch_convert<DType::kFloat32>(src, dst, dst_dtype, n, scale, stream); break;
    case DType::kFloat16: launch_convert<DType::kFloat16>(src, dst, dst_dtype, n, scale, stream); break;
    default: launch_convert<DType::kBFloat16>(src, dst, dst_dtype, n, scale, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t reduce_cast_cuda(const void* in, DType wire, const void* local, DType local_dtype, int64_t n,
                             float prescale, void* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (wire) {
    case DType::kFloat32: launch<DType::kFloat32>(in, local, local_dtype, n, prescale, out, stream); break;
    case DType::kFloat16: launch<DType::kFloat16>(in, local, local_dtype, n, prescale, out, stream); break;
    default: launch<DType::kBFloat16>(in, local, local_dtype, n, prescale, out, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t reduce_cast_feedback_cuda(const void* in, DType wire, const void* local, DType local_dtype, int64_t n,
                                      float prescale, float* residual, void* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (wire) {
    case DType::kFloat32: launch_feedback<DType::kFloat32>(in, local, local_dtype, n, prescale, residual, out, stream); break;
    case DType::kFloat16: launch_feedback<DType::kFloat16>(in, local, local_dtype, n, prescale, residual, out, stream); break;
    default: launch_feedback<DType::kBFloat16>(in, local, local_dtype, n, prescale, residual, out, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t reduce_decode_cuda(const void* in, DType wire, const void* local, DType local_dtype, int64_t n,
                               float prescale, float postscale, float* residual, void* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (local_dtype) {
    case DType::kFloat32: launch_reduce_decode<DType::kFloat32>(in, wire, local, n, prescale, postscale, residual, out, stream); break;
    case DType::kFloat16: launch_reduce_decode<DType::kFloat16>(in, wire, local, n, prescale, postscale, residual, out, stream); break;
    default: launch_reduce_decode<DType::kBFloat16>(in, wire, local, n, prescale, postscale, residual, out, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace gradsync
