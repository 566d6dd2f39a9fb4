#include <chrono>
#include <stdexcept>
#include <string>

#include "ring/ring_allreduce.h"
#include "transport/nccl.h"

namespace gradsync {
namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("gradsync: ") + what + ": " + cudaGetErrorString(e));
}

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) {
    check(cudaMalloc(&ptr, bytes), "cudaMalloc");
    const cudaError_t e = cudaMemset(ptr, 0x3c, bytes);  // 0x3c3c: fp16 1.06, fp32 0.0115
    if (e != cudaSuccess) {
      cudaFree(ptr);
      check(e, "cudaMemset");
    }
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void* ptr = nullptr;
};

struct Stream {
  Stream() { check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(stream); }
  cudaStream_t stream = nullptr;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

NcclHopCost measure_nccl_hop_cost(int device, int hops, int64_t bytes, int64_t timeout_ms) {
  if (hops < 1) throw std::invalid_argument("gradsync: hops must be at least 1, got " + std::to_string(hops));
  if (bytes < 2 || bytes % 2) throw std::invalid_argument("gradsync: bytes must be even and at least 2, got " + std::to_string(bytes));
  check(cudaSetDevice(device), "cudaSetDevice");
  const int64_t n = bytes / 2;  // an fp16 payload of n elements, reduced into n fp32 ones
  DeviceBuffer local(n * 4), send(bytes), recv(bytes);
  Stream compute, wire;
  NcclComm comm(NcclComm::unique_id(), 0, 1, device, timeout_ms);
  CudaRingKernels kernels(Codec::kFp16, local.ptr, local.ptr, DType::kFloat32, 1.0f, 1.0f, compute.stream,
                          /*synchronize=*/false);
  // one ring hop as ring_paired issues it: a send and a receive in one group, then the kernel that
  // reduces what arrived into the next send
  const auto issue = [&](NcclTransport& t, int count) {
    for (int i = 0; i < count; ++i) {
      t.group_begin();
      t.send(send.ptr, bytes, 0, 0);
      const int64_t h = t.recv(recv.ptr, bytes, 0, 0);
      t.group_end();
      t.wait(h);
      kernels.reduce_encode(recv.ptr, 0, n, send.ptr);
    }
  };
  {
    NcclTransport warm(comm, compute.stream, wire.stream);  // connections, kernel modules
    issue(warm, 8);
    comm.synchronize(compute.stream);
  }
  NcclTransport t(comm, compute.stream, wire.stream);
  const auto start = std::chrono::steady_clock::now();
  issue(t, hops);
  const double issued = seconds_since(start);
  comm.synchronize(compute.stream);
  return {issued / hops, seconds_since(start) / hops};
}

}  // namespace gradsync
