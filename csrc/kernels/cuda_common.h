// Helpers shared by the CUDA kernels: element access in any DType and launch sizes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "numerics.h"

namespace gradsync {

template <DType T>
__device__ __forceinline__ float load_one(const void* p, int64_t i) {
  if constexpr (T == DType::kFloat32) return static_cast<const float*>(p)[i];
  else if constexpr (T == DType::kFloat16) return __half2float(static_cast<const __half*>(p)[i]);
  else return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

// Stores v as a T; returns the value stored.
template <DType T>
__device__ __forceinline__ float store_one(void* p, int64_t i, float v) {
  if constexpr (T == DType::kFloat32) {
    static_cast<float*>(p)[i] = v;
    return v;
  } else if constexpr (T == DType::kFloat16) {
    const __half h = __float2half_rn(v);
    static_cast<__half*>(p)[i] = h;
    return __half2float(h);
  } else {
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    static_cast<__nv_bfloat16*>(p)[i] = b;
    return __bfloat162float(b);
  }
}

template <typename... Errors>
inline cudaError_t first_error(Errors... errors) {
  cudaError_t first = cudaSuccess;
  ((first = first != cudaSuccess ? first : errors), ...);
  return first;
}

// Loads the kernels now; the first error. CUDA loads a kernel at its first launch by default
// (CUDA_MODULE_LOADING=LAZY, which torch sets), under the context's lock and after the device's
// queued work has drained: a first launch while NCCL kernels wait for a peer could wait forever.
template <typename... Kernels>
inline cudaError_t load_kernels(Kernels... kernels) {
  cudaFuncAttributes attributes;
  return first_error(cudaFuncGetAttributes(&attributes, kernels)...);
}

// f(std::integral_constant<DType, T>{}) for each of the three dtypes T; the first error.
template <typename F>
inline cudaError_t for_each_dtype(F f) {
  return first_error(f(std::integral_constant<DType, DType::kFloat32>{}),
                     f(std::integral_constant<DType, DType::kFloat16>{}),
                     f(std::integral_constant<DType, DType::kBFloat16>{}));
}

// Enough blocks of `threads` threads to fill every SM of the current device a few times over;
// grid-stride loops cover the rest.
inline int64_t max_resident_blocks(int threads) {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();  // do not leave the failure for the next launch check
    sms = 132;
  }
  return static_cast<int64_t>(sms) * (2048 / threads) * 2;
}

}  // namespace gradsync
