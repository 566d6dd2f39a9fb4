#include <stdexcept>
#include <string>

#include "ring/ring_allreduce.h"

namespace gradsync {
namespace {
bool is_fp8(Codec c) { return c == Codec::kFp8E4M3 || c == Codec::kFp8E5M2; }
Fp8Format fp8_format(Codec c) { return c == Codec::kFp8E4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2; }
}  // namespace

CudaRingKernels::CudaRingKernels(Codec codec, const void* local, void* result, DType dtype, float prescale,
                                 float postscale, cudaStream_t stream, bool synchronize)
    : codec_(codec), local_(local), result_(result), dtype_(dtype),
      wire_(codec == Codec::kFp16 ? DType::kFloat16 : codec == Codec::kBf16 ? DType::kBFloat16 : dtype),
      prescale_(prescale), postscale_(postscale), stream_(stream), synchronize_(synchronize) {}

int64_t CudaRingKernels::payload_bytes(int64_t n) const {
  return is_fp8(codec_) ? fp8_payload_bytes(n) : n * dtype_size(wire_);
}

void CudaRingKernels::finish(cudaError_t launched) {
  if (launched == cudaSuccess && synchronize_) launched = cudaStreamSynchronize(stream_);
  if (launched != cudaSuccess) throw std::runtime_error(std::string("gradsync ring kernel: ") + cudaGetErrorString(launched));
}

void CudaRingKernels::encode(int64_t begin, int64_t n, void* out) {
  finish(is_fp8(codec_) ? fp8_encode_cuda(fp8_format(codec_), local_at(begin), dtype_, n, prescale_,
                                          static_cast<uint8_t*>(out), stream_)
                        : convert_cuda(local_at(begin), dtype_, out, wire_, n, prescale_, stream_));
}

void CudaRingKernels::reduce_encode(const void* in, int64_t begin, int64_t n, void* out) {
  finish(is_fp8(codec_) ? fp8_reduce_encode_cuda(fp8_format(codec_), static_cast<const uint8_t*>(in), local_at(begin),
                                                 dtype_, n, prescale_, static_cast<uint8_t*>(out), stream_)
                        : reduce_cast_cuda(in, wire_, local_at(begin), dtype_, n, prescale_, out, stream_));
}

void CudaRingKernels::decode(const void* in, int64_t begin, int64_t n) {
  void* dst = static_cast<char*>(result_) + begin * dtype_size(dtype_);
  finish(is_fp8(codec_) ? fp8_decode_cuda(fp8_format(codec_), static_cast<const uint8_t*>(in), n, postscale_, dst,
                                          dtype_, stream_)
                        : convert_cuda(in, wire_, dst, dtype_, n, postscale_, stream_));
}

}  // namespace gradsync
