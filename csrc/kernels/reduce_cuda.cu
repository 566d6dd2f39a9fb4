// The ring's per-hop kernel for the cast codecs on CUDA: out = cast<wire>(in + local * prescale),
// element-wise in fp32; the twin of reduce_cast_cpu.
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
    store_one<W>(out, i, load_one<W>(in, i) + load_one<L>(local, i) * prescale);
  }
}

template <DType W>
void launch(const void* in, const void* local, DType lt, int64_t n, float prescale, void* out, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, max_resident_blocks(kThreads));
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, blocks));
  switch (lt) {
    case DType::kFloat32: reduce_cast_kernel<W, DType::kFloat32><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
    case DType::kFloat16: reduce_cast_kernel<W, DType::kFloat16><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
    default: reduce_cast_kernel<W, DType::kBFloat16><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
  }
}

}  // namespace

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

}  // namespace gradsync
