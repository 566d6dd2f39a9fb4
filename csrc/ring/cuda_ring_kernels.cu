#include <stdexcept>
#include <string>

#include "ring/ring_allreduce.h"

namespace gradsync {

void CudaRingKernels::finish(cudaError_t launched) {
  if (launched == cudaSuccess && synchronize_) launched = cudaStreamSynchronize(stream_);
  if (launched != cudaSuccess) throw std::runtime_error(std::string("gradsync ring kernel: ") + cudaGetErrorString(launched));
}

cudaError_t CudaRingKernels::reduce_encode_feedback(const void* in, int64_t begin, int64_t n, void* out) {
  return fp8() ? fp8_reduce_encode_feedback_cuda(fp8_format(), static_cast<const uint8_t*>(in), local_at(begin), dtype_,
                                                 n, prescale_, residual_ + begin, static_cast<uint8_t*>(out), stream_)
               : reduce_cast_feedback_cuda(in, wire_, local_at(begin), dtype_, n, prescale_, residual_ + begin, out,
                                           stream_);
}

void CudaRingKernels::encode(int64_t begin, int64_t n, void* out) {
  if (residual_) return finish(reduce_encode_feedback(nullptr, begin, n, out));
  finish(fp8() ? fp8_encode_cuda(fp8_format(), local_at(begin), dtype_, n, prescale_, static_cast<uint8_t*>(out), stream_)
               : convert_cuda(local_at(begin), dtype_, out, wire_, n, prescale_, stream_));
}

void CudaRingKernels::reduce_encode(const void* in, int64_t begin, int64_t n, void* out) {
  if (residual_) return finish(reduce_encode_feedback(in, begin, n, out));
  finish(fp8() ? fp8_reduce_encode_cuda(fp8_format(), static_cast<const uint8_t*>(in), local_at(begin), dtype_, n,
                                        prescale_, static_cast<uint8_t*>(out), stream_)
               : reduce_cast_cuda(in, wire_, local_at(begin), dtype_, n, prescale_, out, stream_));
}

void CudaRingKernels::decode(const void* in, int64_t begin, int64_t n) {
  void* dst = result_at(begin);
  finish(fp8() ? fp8_decode_cuda(fp8_format(), static_cast<const uint8_t*>(in), n, postscale_, dst, dtype_, stream_)
               : convert_cuda(in, wire_, dst, dtype_, n, postscale_, stream_));
}

void CudaRingKernels::reduce_decode(const void* in, int64_t begin, int64_t n) {
  float* residual = residual_ ? residual_ + begin : nullptr;
  void* dst = result_at(begin);
  finish(fp8() ? fp8_reduce_decode_cuda(fp8_format(), static_cast<const uint8_t*>(in), local_at(begin), dtype_, n,
                                        prescale_, postscale_, residual, dst, stream_)
               : reduce_decode_cuda(in, wire_, local_at(begin), dtype_, n, prescale_, postscale_, residual, dst, stream_));
}

}  // namespace gradsync
