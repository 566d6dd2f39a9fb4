// Gradient codecs: names, wire payload layout, and the kernel entry points of both back ends.
//
// Payload layout (the same bytes on CPU and CUDA, and on the wire; a NaN's own bits may differ
// between back ends and instruction sets, as the README says):
//   "none"                 n elements of the input dtype
//   "fp16" / "bf16"        n IEEE half / bfloat16 values
//   "fp8_e4m3" / "fp8_e5m2"
//       bytes [0, n)                      one fp8 code per element
//       bytes [n, align16(n))             zero padding
//       bytes [align16(n), +4*nblocks)    one little-endian fp32 decode scale per block of
//                                         kFp8BlockSize elements (the last block may be short)
//   Element i decodes to fp8_value(code[i]) * scale[i / kFp8BlockSize]. Each block scale is a
//   power of two chosen from the block's largest finite magnitude, so no finite value overflows
//   and every block uses the format's full relative precision.
#pragma once

#include <cstdint>

#include "numerics.h"

namespace gradsync {

enum class Codec : int32_t { kNone = 0, kFp16 = 1, kBf16 = 2, kFp8E4M3 = 3, kFp8E5M2 = 4 };

constexpr int64_t kFp8BlockSize = 128;
constexpr int64_t kPayloadAlign = 16;

GS_HD int64_t fp8_num_blocks(int64_t n) { return (n + kFp8BlockSize - 1) / kFp8BlockSize; }
GS_HD int64_t fp8_scales_offset(int64_t n) { return (n + kPayloadAlign - 1) / kPayloadAlign * kPayloadAlign; }
GS_HD int64_t fp8_payload_bytes(int64_t n) { return fp8_scales_offset(n) + 4 * fp8_num_blocks(n); }

// CPU kernels process the blocks [block_begin, block_end) so that callers can split the work
// across threads. `src`/`dst` hold n elements of the given dtype, contiguous.
void fp8_encode_cpu(Fp8Format format, const void* src, DType src_dtype, int64_t n, float scale,
                    uint8_t* payload, int64_t block_begin, int64_t block_end);
void fp8_decode_cpu(Fp8Format format, const uint8_t* payload, int64_t n, float scale, void* dst,
                    DType dst_dtype, int64_t block_begin, int64_t block_end);

// The ring's per-hop reduction, fused: out = encode(decode(in) + float(local) * prescale), in fp32.
// Cast codecs ("none", fp16, bf16) carry elements of `wire` dtype; fp8 processes whole blocks.
void reduce_cast_cpu(const void* in, DType wire, const void* local, DType local_dtype, int64_t n, float prescale,
                     void* out);
void fp8_reduce_encode_cpu(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype, int64_t n,
                           float prescale, uint8_t* out);

// The same two kernels with error feedback, fused: sum = decode(in) + local * prescale + residual,
// each addition as in the kernels above (with in == nullptr: sum = local * prescale + residual);
// out = encode(sum); residual = sum - decode(out), or 0 where that is not finite (an overflowed
// step must not poison the steps after it).
void reduce_cast_feedback_cpu(const void* in, DType wire, const void* local, DType local_dtype, int64_t n,
                              float prescale, float* residual, void* out);
void fp8_reduce_encode_feedback_cpu(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype,
                                    int64_t n, float prescale, float* residual, uint8_t* out);

// A reduce-scatter's last hop, whose sum is this rank's result and goes on no wire: sum =
// [decode(in) +] local * prescale [+ residual], each addition as in the kernels above (in and
// residual may be null); out = cast<local_dtype>(sum * postscale). Nothing is encoded: a residual
// becomes 0 for a float32 out, and what storing the sum lost for a 16-bit one
// (store_residual). out may be local itself.
void reduce_decode_cpu(const void* in, DType wire, const void* local, DType local_dtype, int64_t n, float prescale,
                       float postscale, float* residual, void* out);
void fp8_reduce_decode_cpu(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype, int64_t n,
                           float prescale, float postscale, float* residual, void* out);

// Contiguous scale-and-cast: dst[i] = cast<dst_dtype>(float(src[i]) * scale). Large results bypass
// the cache (non-temporal stores) unless `cache_result`: say so for a result that is read at once,
// such as a payload about to be sent.
void convert_cpu(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, float scale,
                 bool cache_result = false);

// Selects the CPU instruction set used by the kernels: "auto" (the best the CPU has), "avx2" or
// "scalar". Returns false if the request cannot be honoured on this CPU.
bool set_cpu_isa(const char* name);
const char* cpu_isa();

#ifdef GRADSYNC_WITH_CUDA
}  // namespace gradsync
#include <cuda_runtime.h>
namespace gradsync {
cudaError_t fp8_encode_cuda(Fp8Format format, const void* src, DType src_dtype, int64_t n, float scale,
                            uint8_t* payload, cudaStream_t stream);
cudaError_t fp8_decode_cuda(Fp8Format format, const uint8_t* payload, int64_t n, float scale, void* dst,
                            DType dst_dtype, cudaStream_t stream);
cudaError_t convert_cuda(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, float scale,
                         cudaStream_t stream);
cudaError_t reduce_cast_cuda(const void* in, DType wire, const void* local, DType local_dtype, int64_t n,
                             float prescale, void* out, cudaStream_t stream);
cudaError_t fp8_reduce_encode_cuda(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype,
                                   int64_t n, float prescale, uint8_t* out, cudaStream_t stream);
cudaError_t reduce_cast_feedback_cuda(const void* in, DType wire, const void* local, DType local_dtype, int64_t n,
                                      float prescale, float* residual, void* out, cudaStream_t stream);
cudaError_t fp8_reduce_encode_feedback_cuda(Fp8Format format, const uint8_t* in, const void* local,
                                            DType local_dtype, int64_t n, float prescale, float* residual,
                                            uint8_t* out, cudaStream_t stream);
cudaError_t reduce_decode_cuda(const void* in, DType wire, const void* local, DType local_dtype, int64_t n,
                               float prescale, float postscale, float* residual, void* out, cudaStream_t stream);
cudaError_t fp8_reduce_decode_cuda(Fp8Format format, const uint8_t* in, const void* local, DType local_dtype,
                                   int64_t n, float prescale, float postscale, float* residual, void* out,
                                   cudaStream_t stream);
// Every kernel of the functions above, loaded now (see load_kernels in cuda_common.h).
cudaError_t load_cast_kernels();
cudaError_t load_fp8_kernels();
#endif

}  // namespace gradsync
