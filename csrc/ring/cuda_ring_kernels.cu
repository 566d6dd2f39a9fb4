#include <stdexcept>
#include <string>

#include "ring/ring_allreduce.h"

namespace gradsync {

void CudaRingKernels::finish(cudaError_t launched) {
  if (launched == cudaSuccess && synchronize_) launched = cudaStreamSynchronize(stream_);
  check(launched);
}

void CudaRingKernels::check(cudaError_t launched) {
  if (launched != cudaSuccess) throw std::runtime_error(std::string("gradsync ring kernel: ") + cudaGetErrorString(launched));
}

void CudaRingKernels::cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, float scale) {
  check(convert_cuda(src, src_dtype, dst, dst_dtype, n, scale, stream_));
}

void CudaRingKernels::add(const float* a, const void* b, DType b_dtype, int64_t n, float b_scale, float* out) {
  check(reduce_cast_cuda(a, DType::kFloat32, b, b_dtype, n, b_scale, out, stream_));
}

void CudaRingKernels::fp8_encode_f32(const float* src, int64_t n, void* out) {
  check(fp8_encode_cuda(fp8_format(), src, DType::kFloat32, n, 1.0f, static_cast<uint8_t*>(out), stream_));
}

void CudaRingKernels::fp8_decode_f32(const void* in, int64_t n, float* dst) {
  check(fp8_decode_cuda(fp8_format(), static_cast<const uint8_t*>(in), n, 1.0f, dst, DType::kFloat32, stream_));
}

void CudaRingKernels::residual(const float* sum, const float* decoded, int64_t n, float* out) {
  check(feedback_residual_cuda(sum, decoded, n, out, stream_));
}

void CudaRingKernels::encode(int64_t begin, int64_t n, void* out) {
  if (residual_) {
    feedback_encode(nullptr, begin, n, out);
    return finish(cudaSuccess);
  }
  finish(fp8() ? fp8_encode_cuda(fp8_format(), local_at(begin), dtype_, n, prescale_, static_cast<uint8_t*>(out), stream_)
               : convert_cuda(local_at(begin), dtype_, out, wire_, n, prescale_, stream_));
}

void CudaRingKernels::reduce_encode(const void* in, int64_t begin, int64_t n, void* out) {
  if (residual_) {
    feedback_encode(in, begin, n, out);
    return finish(cudaSuccess);
  }
  finish(fp8() ? fp8_reduce_encode_cuda(fp8_format(), static_cast<const uint8_t*>(in), local_at(begin), dtype_, n,
                                        prescale_, static_cast<uint8_t*>(out), stream_)
               : reduce_cast_cuda(in, wire_, local_at(begin), dtype_, n, prescale_, out, stream_));
}

void CudaRingKernels::decode(const void* in, int64_t begin, int64_t n) {
  void* dst = result_at(begin);
  finish(fp8() ? fp8_decode_cuda(fp8_format(), static_cast<const uint8_t*>(in), n, postscale_, dst, dtype_, stream_)
               : convert_cuda(in, wire_, dst, dtype_, n, postscale_, stream_));
}

}  // namespace gradsync
