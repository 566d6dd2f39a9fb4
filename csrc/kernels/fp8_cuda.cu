// Block-scaled fp8 codec on CUDA: one warp per block of kFp8BlockSize elements where a block is
// encoded, one thread per element where it is only decoded. Same semantics
// and bits as fp8_encode_cpu / fp8_decode_cpu (codec.h, numerics.h).
#include <algorithm>

#include "codec.h"
#include "cuda_common.h"

namespace gradsync {
namespace {

constexpr int kThreads = 256;
constexpr int kPerLane = kFp8BlockSize / 32;

// This thread's lane, its warp's index in the grid and the grid's number of warps.
struct WarpSlot {
  int lane;
  int64_t warp, num_warps;
};

__device__ __forceinline__ WarpSlot warp_slot() {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  return {static_cast<int>(threadIdx.x & 31), thread >> 5, (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5};
}

// The bytes between the codes and the scales of a payload of n elements are zero.
__device__ __forceinline__ void zero_padding(uint8_t* payload, int64_t n) {
  const int64_t pad = fp8_scales_offset(n) - n;
  if (blockIdx.x == 0 && threadIdx.x < pad) payload[n + threadIdx.x] = 0;
}

// One warp encodes block b from the kPerLane values each lane holds (element b*128 + j*32 + lane);
// returns the block's decode scale.
template <Fp8Format F>
__device__ __forceinline__ float encode_block_warp(const float (&v)[kPerLane], int64_t b, int64_t n, int lane,
                                                  uint8_t* codes, float* scales) {
  float absmax = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float a = fabsf(v[j]);
    if (a <= 3.40282347e38f) absmax = fmaxf(absmax, a);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, offset));
  const int k = fp8_block_exponent<F>(absmax);
  const float mul = pow2(k);
  const uint32_t max_code = fp8_block_max_code<F>(k);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t i = b * kFp8BlockSize + j * 32 + lane;
    if (i < n) codes[i] = float_to_fp8<F>(v[j] * mul, max_code);
  }
  if (lane == 0) scales[b] = pow2(-k);
  return pow2(-k);
}

template <Fp8Format F, DType S>
__global__ void __launch_bounds__(kThreads) fp8_encode_kernel(const void* src, int64_t n, float scale,
                                                              uint8_t* payload) {
  const WarpSlot w = warp_slot();
  float* scales = reinterpret_cast<float*>(payload + fp8_scales_offset(n));
  for (int64_t b = w.warp; b < fp8_num_blocks(n); b += w.num_warps) {
    float v[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = b * kFp8BlockSize + j * 32 + w.lane;
      v[j] = i < n ? load_one<S>(src, i) * scale : 0.0f;
    }
    encode_block_warp<F>(v, b, n, w.lane, payload, scales);
  }
  zero_padding(payload, n);
}

// out = encode(decode(in) + local * prescale), one warp per block (the ring's per-hop kernel).
template <Fp8Format F, DType L>
__global__ void __launch_bounds__(kThreads) fp8_reduce_encode_kernel(const uint8_t* in, const void* local, int64_t n,
                                                                     float prescale, uint8_t* out) {
  const WarpSlot w = warp_slot();
  const float* in_scales = reinterpret_cast<const float*>(in + fp8_scales_offset(n));
  float* out_scales = reinterpret_cast<float*>(out + fp8_scales_offset(n));
  for (int64_t b = w.warp; b < fp8_num_blocks(n); b += w.num_warps) {
    const float in_scale = in_scales[b];
    float v[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = b * kFp8BlockSize + j * 32 + w.lane;
      v[j] = i < n ? hop_sum(fp8_to_float<F>(in[i]) * in_scale, load_one<L>(local, i) * prescale) : 0.0f;
    }
    encode_block_warp<F>(v, b, n, w.lane, out, out_scales);
  }
  zero_padding(out, n);
}

// fp8_reduce_encode_kernel with error feedback (codec.h); in == nullptr when kIn is false.
template <Fp8Format F, DType L, bool kIn>
__global__ void __launch_bounds__(kThreads) fp8_reduce_encode_feedback_kernel(const uint8_t* in, const void* local,
                                                                              int64_t n, float prescale,
                                                                              float* residual, uint8_t* out) {
  const WarpSlot w = warp_slot();
  float* out_scales = reinterpret_cast<float*>(out + fp8_scales_offset(n));
  for (int64_t b = w.warp; b < fp8_num_blocks(n); b += w.num_warps) {
    const float in_scale = kIn ? reinterpret_cast<const float*>(in + fp8_scales_offset(n))[b] : 0.0f;
    float v[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t i = b * kFp8BlockSize + j * 32 + w.lane;
      if (i < n) {
        const float mine = load_one<L>(local, i) * prescale;
        v[j] = hop_sum(kIn ? hop_sum(fp8_to_float<F>(in[i]) * in_scale, mine) : mine, residual[i]);
      } else {
        v[j] = 0.0f;
      }
    }
    const float out_scale = encode_block_warp<F>(v, b, n, w.lane, out, out_scales);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {  // each lane reads back the codes it wrote
      const int64_t i = b * kFp8BlockSize + j * 32 + w.lane;
      if (i < n) residual[i] = feedback_residual(v[j], fp8_to_float<F>(out[i]) * out_scale);
    }
  }
  zero_padding(out, n);
}

template <Fp8Format F, DType D>
__global__ void __launch_bounds__(kThreads) fp8_decode_kernel(const uint8_t* payload, int64_t n, float scale,
                                                              void* dst) {
  const float* scales = reinterpret_cast<const float*>(payload + fp8_scales_offset(n));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    store_one<D>(dst, i, (fp8_to_float<F>(payload[i]) * scales[i / kFp8BlockSize]) * scale);
  }
}

// A reduce-scatter's last hop (codec.h, fp8_reduce_decode_cpu), one thread per element: decoding
// needs no block-wide absmax.
template <Fp8Format F, DType L, bool kResidual>
__global__ void __launch_bounds__(kThreads) fp8_reduce_decode_kernel(const uint8_t* in, const void* local, int64_t n,
                                                                     float prescale, float postscale, float* residual,
                                                                     void* out) {
  const float* scales = reinterpret_cast<const float*>(in + fp8_scales_offset(n));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float sum = hop_sum(fp8_to_float<F>(in[i]) * scales[i / kFp8BlockSize], load_one<L>(local, i) * prescale);
    if constexpr (kResidual) sum = hop_sum(sum, residual[i]);
    const float stored = store_one<L>(out, i, sum * postscale);
    // nothing was encoded; storing into a 16-bit tensor is the one rounding
    if constexpr (kResidual) residual[i] = L == DType::kFloat32 ? 0.0f : store_residual(sum, stored, postscale);
  }
}

unsigned grid_for(int64_t work_items, int items_per_block) {
  const int64_t blocks = (work_items + items_per_block - 1) / items_per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, max_resident_blocks(kThreads))));
}

template <Fp8Format F>
cudaError_t encode(const void* src, DType st, int64_t n, float scale, uint8_t* payload, cudaStream_t stream) {
  const unsigned grid = grid_for(fp8_num_blocks(n), kThreads / 32);
  switch (st) {
    case DType::kFloat32: fp8_encode_kernel<F, DType::kFloat32><<<grid, kThreads, 0, stream>>>(src, n, scale, payload); break;
    case DType::kFloat16: fp8_encode_kernel<F, DType::kFloat16><<<grid, kThreads, 0, stream>>>(src, n, scale, payload); break;
    default: fp8_encode_kernel<F, DType::kBFloat16><<<grid, kThreads, 0, stream>>>(src, n, scale, payload); break;
  }
  return cudaGetLastError();
}

template <Fp8Format F>
cudaError_t decode(const uint8_t* payload, int64_t n, float scale, void* dst, DType dt, cudaStream_t stream) {
  const unsigned grid = grid_for(n, kThreads);
  switch (dt) {
    case DType::kFloat32: fp8_decode_kernel<F, DType::kFloat32><<<grid, kThreads, 0, stream>>>(payload, n, scale, dst); break;
    case DType::kFloat16: fp8_decode_kernel<F, DType::kFloat16><<<grid, kThreads, 0, stream>>>(payload, n, scale, dst); break;
    default: fp8_decode_kernel<F, DType::kBFloat16><<<grid, kThreads, 0, stream>>>(payload, n, scale, dst); break;
  }
  return cudaGetLastError();
}

template <Fp8Format F>
cudaError_t reduce_encode(const uint8_t* in, const void* local, DType lt, int64_t n, float prescale, uint8_t* out,
                          cudaStream_t stream) {
  const unsigned grid = grid_for(fp8_num_blocks(n), kThreads / 32);
  switch (lt) {
    case DType::kFloat32: fp8_reduce_encode_kernel<F, DType::kFloat32><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
    case DType::kFloat16: fp8_reduce_encode_kernel<F, DType::kFloat16><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
    default: fp8_reduce_encode_kernel<F, DType::kBFloat16><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, out); break;
  }
  return cudaGetLastError();
}

template <Fp8Format F, DType L>
void reduce_encode_feedback_local(const uint8_t* in, const void* local, int64_t n, float prescale, float* residual,
                                  uint8_t* out, cudaStream_t stream) {
  const unsigned grid = grid_for(fp8_num_blocks(n), kThreads / 32);
  if (in) {
    fp8_reduce_encode_feedback_kernel<F, L, true><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, residual, out);
  } else {
    fp8_reduce_encode_feedback_kernel<F, L, false><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, residual, out);
  }
}

template <Fp8Format F>
cudaError_t reduce_encode_feedback(const uint8_t* in, const void* local, DType lt, int64_t n, float prescale,
                                   float* residual, uint8_t* out, cudaStream_t stream) {
  switch (lt) {
    case DType::kFloat32: reduce_encode_feedback_local<F, DType::kFloat32>(in, local, n, prescale, residual, out, stream); break;
    case DType::kFloat16: reduce_encode_feedback_local<F, DType::kFloat16>(in, local, n, prescale, residual, out, stream); break;
    default: reduce_encode_feedback_local<F, DType::kBFloat16>(in, local, n, prescale, residual, out, stream); break;
  }
  return cudaGetLastError();
}

template <Fp8Format F, DType L>
void reduce_decode_local(const uint8_t* in, const void* local, int64_t n, float prescale, float postscale,
                         float* residual, void* out, cudaStream_t stream) {
  const unsigned grid = grid_for(n, kThreads);
  if (residual) {
    fp8_reduce_decode_kernel<F, L, true><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, postscale, residual, out);
  } else {
    fp8_reduce_decode_kernel<F, L, false><<<grid, kThreads, 0, stream>>>(in, local, n, prescale, postscale, residual, out);
  }
}

template <Fp8Format F>
cudaError_t reduce_decode(const uint8_t* in, const void* local, DType lt, int64_t n, float prescale, float postscale,
                          float* residual, void* out, cudaStream_t stream) {
  switch (lt) {
    case DType::kFloat32: reduce_decode_local<F, DType::kFloat32>(in, local, n, prescale, postscale, residual, out, stream); break;
    case DType::kFloat16: reduce_decode_local<F, DType::kFloat16>(in, local, n, prescale, postscale, residual, out, stream); break;
    default: reduce_decode_local<F, DType::kBFloat16>(in, local, n, prescale, postscale, residual, out, stream); break;
  }
  return cudaGetLastError();
}

template <Fp8Format F>
cudaError_t load_format() {
  return for_each_dtype([](auto t) {
    constexpr DType T = decltype(t)::value;
    return load_kernels(fp8_encode_kernel<F, T>, fp8_reduce_encode_kernel<F, T>,
                        fp8_reduce_encode_feedback_kernel<F, T, true>, fp8_reduce_encode_feedback_kernel<F, T, false>,
                        fp8_decode_kernel<F, T>, fp8_reduce_decode_kernel<F, T, true>,
                        fp8_reduce_decode_kernel<F, T, false>);
  });
}

}  // namespace

cudaError_t load_fp8_kernels() { return first_error(load_format<Fp8Format::kE4M3>(), load_format<Fp8Format::kE5M2>()); }

cudaError_t fp8_reduce_encode_feedback_cuda(Fp8Format format, const uint8_t* in, const void* local,
                                            DType local_dtype, int64_t n, float prescale, float* residual,
                                            uint8_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return format == Fp8Format::kE4M3
             ? reduce_encode_feedback<Fp8Format::kE4M3>(in, local, local_dtype, n, prescale, residual, out, stream)
             : reduce_encode_feedback<Fp8Format::kE5M2>(in, local, local_dtype, n, prescale, residual, out, stream);
}

cudaError_t fp8_reduce_encode_cuda(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype,
                                   int64_t n, float prescale, uint8_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return format == Fp8Format::kE4M3
             ? reduce_encode<Fp8Format::kE4M3>(in, local, local_dtype, n, prescale, out, stream)
             : reduce_encode<Fp8Format::kE5M2>(in, local, local_dtype, n, prescale, out, stream);
}

cudaError_t fp8_reduce_decode_cuda(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype,
                                   int64_t n, float prescale, float postscale, float* residual, void* out,
                                   cudaStream_t stream) {
  if (!in) return reduce_decode_cuda(nullptr, DType::kFloat32, local, local_dtype, n, prescale, postscale, residual, out, stream);
  if (n == 0) return cudaSuccess;
  return format == Fp8Format::kE4M3
             ? reduce_decode<Fp8Format::kE4M3>(in, local, local_dtype, n, prescale, postscale, residual, out, stream)
             : reduce_decode<Fp8Format::kE5M2>(in, local, local_dtype, n, prescale, postscale, residual, out, stream);
}

cudaError_t fp8_encode_cuda(Fp8Format format, const void* src, DType src_dtype, int64_t n, float scale,
                            uint8_t* payload, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return format == Fp8Format::kE4M3 ? encode<Fp8Format::kE4M3>(src, src_dtype, n, scale, payload, stream)
                                    : encode<Fp8Format::kE5M2>(src, src_dtype, n, scale, payload, stream);
}

cudaError_t fp8_decode_cuda(Fp8Format format, const uint8_t* payload, int64_t n, float scale, void* dst,
                            DType dst_dtype, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return format == Fp8Format::kE4M3 ? decode<Fp8Format::kE4M3>(payload, n, scale, dst, dst_dtype, stream)
                                    : decode<Fp8Format::kE5M2>(payload, n, scale, dst, dst_dtype, stream);
}

}  // namespace gradsync
