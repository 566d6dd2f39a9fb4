// Ring all-reduce over any Transport: reduce-scatter then all-gather, n-1 steps each, chunked and
// pipelined. Each hop decodes what it receives, adds the local contribution in fp32 and re-encodes
// (one fused kernel); the fully reduced chunk is encoded once and every rank decodes the same bytes,
// so the result is bitwise identical on every rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "ring/ring_plan.h"
#include "ring/transport.h"

namespace gradsync {

// The element-wise work of one all-reduce, over element ranges [begin, begin + n) of the buffer.
class RingKernels {
 public:
  virtual ~RingKernels() = default;
  virtual int64_t payload_bytes(int64_t n) const = 0;
  // out = encode(local * prescale)
  virtual void encode(int64_t begin, int64_t n, void* out) = 0;
  // out = encode(decode(in) + local * prescale)
  virtual void reduce_encode(const void* in, int64_t begin, int64_t n, void* out) = 0;
  // result = decode(in) * postscale
  virtual void decode(const void* in, int64_t begin, int64_t n) = 0;
  // result = ([decode(in) +] local * prescale) * postscale, the sum never encoded: a reduce-scatter's
  // last hop, whose sum goes on no wire. in may be null (a single rank).
  virtual void reduce_decode(const void* in, int64_t begin, int64_t n) = 0;
  // Where the payload of elements [begin, ...) may live in the result itself, when decoding it
  // would only copy it (codec "none", postscale 1, memory the transport reaches): the all-gather
  // receives there, and this rank's own payloads are encoded and reduced there in place (out ==
  // result in encode and reduce_encode). nullptr otherwise.
  virtual void* result_as_payload(int64_t begin) { (void)begin; return nullptr; }
};

// What the kernels of one codec share: local and result are contiguous arrays of `dtype` (they may
// be the same); the cast codecs carry `wire_` elements.
class CodecRingKernels : public RingKernels {
 public:
  CodecRingKernels(Codec codec, const void* local, void* result, DType dtype, float prescale, float postscale);
  int64_t payload_bytes(int64_t n) const override;

  // Error feedback: `residual` (fp32, one per element of the buffer, on the kernels' device) is
  // added to this rank's contribution before it is encoded and then overwritten with what that
  // encoding lost (the *_feedback kernels of codec.h). Each rank encodes every element exactly once
  // per all-reduce (its reduce-scatter hops plus its own reduced chunk), so the residuals of all
  // ranks sum to the error of the result, and adding them to the next call's inputs cancels it. A
  // reduce-scatter never encodes a rank's own chunk: its residual there becomes 0, or what storing
  // the sum into a 16-bit result lost.
  void set_error_feedback(float* residual) { residual_ = residual; }
  // A reduce-scatter's result: `result` holds the buffer's elements [begin, begin + its length)
  // alone, and nothing is received or reduced in place there (result_as_payload is nullptr).
  void scatter_into(void* result, int64_t begin) {
    result_ = result;
    result_begin_ = begin;
    scatter_ = true;
  }

 protected:
  bool fp8() const { return codec_ == Codec::kFp8E4M3 || codec_ == Codec::kFp8E5M2; }
  Fp8Format fp8_format() const { return codec_ == Codec::kFp8E4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2; }
  const char* local_at(int64_t begin) const { return static_cast<const char*>(local_) + begin * dtype_size(dtype_); }
  void* result_at(int64_t begin) const {
    return static_cast<char*>(result_) + (begin - result_begin_) * dtype_size(dtype_);
  }
  Codec codec_;
  const void* local_;
  void* result_;
  DType dtype_, wire_;
  float prescale_, postscale_;
  float* residual_ = nullptr;
  int64_t result_begin_ = 0;
  bool scatter_ = false;
};

// The host-memory kernels.
class CpuRingKernels : public CodecRingKernels {
 public:
  using CodecRingKernels::CodecRingKernels;
  void encode(int64_t begin, int64_t n, void* out) override;
  void reduce_encode(const void* in, int64_t begin, int64_t n, void* out) override;
  void decode(const void* in, int64_t begin, int64_t n) override;
  void reduce_decode(const void* in, int64_t begin, int64_t n) override;
  void* result_as_payload(int64_t begin) override;
  // result[0, n) = (decode(payloads[0]) + decode(payloads[1]) + ...) * postscale, added in fp32 in
  // that order. With a residual, what rounding result[keep_begin, keep_end) into a 16-bit tensor
  // lost is added to it: that rounding encodes the sum, as the ring's owner of a chunk does.
  void sum_decoded(const void* const* payloads, int count, int64_t n, int64_t keep_begin, int64_t keep_end);

 private:
  void reduce_encode_feedback(const void* in, int64_t begin, int64_t n, void* out);  // in may be null
  void decode_fp32(const void* in, int64_t n, float* out) const;
};

#ifdef GRADSYNC_WITH_CUDA
// The CUDA kernels on one stream. With `synchronize`, every call returns after its kernel has
// finished, so that a host transport may read what it wrote; payload images may then live in
// pinned host memory, which the kernels read and write directly.
class CudaRingKernels : public CodecRingKernels {
 public:
  CudaRingKernels(Codec codec, const void* local, void* result, DType dtype, float prescale, float postscale,
                  cudaStream_t stream, bool synchronize = true)
      : CodecRingKernels(codec, local, result, dtype, prescale, postscale), stream_(stream), synchronize_(synchronize) {}
  void encode(int64_t begin, int64_t n, void* out) override;
  void reduce_encode(const void* in, int64_t begin, int64_t n, void* out) override;
  void decode(const void* in, int64_t begin, int64_t n) override;
  void reduce_decode(const void* in, int64_t begin, int64_t n) override;

 private:
  cudaError_t reduce_encode_feedback(const void* in, int64_t begin, int64_t n, void* out);  // in may be null
  void finish(cudaError_t launched);
  cudaStream_t stream_;
  bool synchronize_;
};
#endif

// The collectives of the ring; a RingCall carries which one a rank makes.
enum RingOp : int32_t { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2 };

// What every rank must agree on before the ring starts.
struct RingCall {
  int64_t numel;
  int32_t dtype;
  int32_t codec;
  float prescale;
  float postscale;
  int64_t slice_elems;
  int32_t direct;  // 1: direct_allreduce, 0: the ring
  int32_t op;  // a RingOp
  int32_t unprepared;  // 1: this rank could not prepare the call (its workspaces, say) and raises why
  // The caller's fingerprint of what the buffer holds beyond its size (gradsync.fsdp: which of the
  // module's parameters) or of what follows the call (hooks.hierarchical_average's reduce-scatter in
  // the node: the codec of the all-reduce across the nodes), 0 for none. Also the record's last
  // bytes: records are compared bytewise, so no byte of one is left undefined.
  int32_t layout = 0;
};
static_assert(sizeof(RingCall) == 48, "RingCall has implicit padding");

// Tags of one call occupy [tag_base, tag_base + ring_tag_span(plan)).
uint32_t ring_tag_span(const RingPlan& plan);

// Groups up to this size exchange call records directly, every rank with every other (one hop of
// latency); larger ones around the ring (n - 1 hops, but no peers beyond the ring's two).
constexpr int kDirectExchangeRanks = 8;

// Exchanges `call` among the ranks; throws std::invalid_argument on every rank, naming the ranks
// that differ or could not prepare the call, if any.
void check_ring_call(Transport& transport, const RingCall& call, uint32_t tag);
// The two halves, for transports whose memory the host cannot read directly: an all-gather of every
// rank's record into `table` (n records, this rank's at its index, in transport memory), and the
// comparison (throws std::invalid_argument, in the words of rank `self`'s operation).
void exchange_ring_calls(Transport& transport, RingCall* table, uint32_t tag);
void compare_ring_calls(const RingCall* table, int n, int self);

// The all-reduce. `recv_image` and `send_image` are workspaces of plan.layout(...) bytes each, in
// memory the transport and the kernels can both use. The result is written in the all-gather,
// slice by slice as the reduced payloads arrive (decoded while they are still in cache), and, where
// it doubles as the payload (RingKernels::result_as_payload), by the reduce-scatter's kernels, each
// element after its one read of the input: result and input may be the same memory. A transport
// failure can leave the result partly written, and the transport may still hold receives posted into
// both images (and, where result_as_payload, the result) and sends from them: after a throw the
// caller keeps that memory alive, or the transport shut down, before reusing or freeing it.
void ring_allreduce(Transport& transport, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image,
                    uint8_t* send_image, uint32_t tag_base);

// The reduce-scatter half alone, on a RingPlan::scatter plan: each rank's last hop adds its part to
// the chunk it receives and writes the fp32 sum, times postscale, straight into the result
// (RingKernels::reduce_decode): the reduced chunk (the buffer's chunk `rank`) goes on no wire, so it
// is never encoded, one rounding fewer than the all-reduce's. The result holds that chunk alone
// (CodecRingKernels::scatter_into). The input is only read; the result may be the input's own chunk,
// each element read before it is written.
void ring_reduce_scatter(Transport& transport, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image,
                         uint8_t* send_image, uint32_t tag_base);

// The all-gather half alone, on a RingPlan::scatter plan, in place: the buffer's chunk `rank` holds
// this rank's part, which is encoded once (prescale) and travels around the ring; every rank decodes
// the same bytes (postscale) into every chunk, its own included, so the result is bitwise identical
// on every rank. Where the result doubles as the payload (codec "none", postscale 1) nothing is
// copied: the peers' chunks are received straight into it.
void ring_all_gather(Transport& transport, RingKernels& kernels, const RingPlan& plan, uint8_t* recv_image,
                     uint8_t* send_image, uint32_t tag_base);

// For buffers so small that the ring's 2(n-1) hop latencies dominate: every rank sends its encoded
// contribution to every other in one exchange (one hop of latency; n-1 payloads out and n-1 in),
// then sums the n decoded contributions in rank order in fp32. Each contribution is rounded to the
// wire format once, its own rank's included, and every rank adds the same values in the same
// order, so the result is bitwise identical on every rank. `recv_image` holds
// direct_image_bytes(...) bytes, `send_image` one payload; messages use the one tag `tag`.
int64_t direct_image_bytes(const RingKernels& kernels, int64_t numel, int ranks);
void direct_allreduce(Transport& transport, CpuRingKernels& kernels, int64_t numel, uint8_t* recv_image,
                      uint8_t* send_image, uint32_t tag);

}  // namespace gradsync
