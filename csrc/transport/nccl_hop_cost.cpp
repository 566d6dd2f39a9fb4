#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "ring/ring_allreduce.h"
#include "transport/nccl.h"

namespace gradsync {
namespace {
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) {
    check_cuda(cudaMalloc(&ptr, bytes), "cudaMalloc");
    // 0x3c3c: fp16 1.06, fp32 0.0115; on the legacy stream, which the non-blocking streams do not
    // wait for: synchronized here
    cudaError_t e = cudaMemset(ptr, 0x3c, bytes);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      cudaFree(ptr);
      check_cuda(e, "cudaMemset");
    }
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  void leak() { ptr = nullptr; }  // for memory that kernels still queued may write
  void* ptr = nullptr;
};

struct Stream {
  Stream() { check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(stream); }
  cudaStream_t stream = nullptr;
};

struct DeviceRestorer {  // the caller's current device, as it was
  DeviceRestorer() { check_cuda(cudaGetDevice(&device), "cudaGetDevice"); }
  ~DeviceRestorer() { cudaSetDevice(device); }
  int device = 0;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

std::vector<NcclHopCost> measure_nccl_hop_cost(int device, int hops, const std::vector<int64_t>& sizes, int repeats,
                                               int64_t timeout_ms) {
  if (hops < 1) throw std::invalid_argument("gradsync: hops must be at least 1, got " + std::to_string(hops));
  if (repeats < 1) throw std::invalid_argument("gradsync: repeats must be at least 1, got " + std::to_string(repeats));
  int64_t largest = 2;
  for (int64_t bytes : sizes) {
    if (bytes < 2 || bytes % 2) throw std::invalid_argument("gradsync: sizes must be even and at least 2, got " + std::to_string(bytes));
    largest = std::max(largest, bytes);
  }
  const DeviceRestorer restorer;
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  DeviceBuffer local(largest * 2), send(largest), recv(largest);  // fp16 payloads reduced into fp32
  Stream compute, wire;
  NcclComm comm(NcclComm::unique_id(), 0, 1, device, timeout_ms);
  std::vector<NcclHopCost> costs;
  try {
    for (int64_t bytes : sizes) {
      const int64_t n = bytes / 2;
      CudaRingKernels kernels(Codec::kFp16, local.ptr, local.ptr, DType::kFloat32, 1.0f, 1.0f, compute.stream,
                              /*synchronize=*/false);
      // one ring hop as ring_paired issues it: a send and a receive in one group, then the kernel
      // that reduces what arrived into the next send
      const auto hop = [&](NcclTransport& t) {
        t.group_begin();
        t.send(send.ptr, bytes, 0, 0);
        const int64_t h = t.recv(recv.ptr, bytes, 0, 0);
        t.group_end();
        t.wait(h);
        kernels.reduce_encode(recv.ptr, 0, n, send.ptr);
      };
      {
        NcclTransport warm(comm, compute.stream, wire.stream);  // kernel modules, NCCL's buffers
        for (int i = 0; i < 8; ++i) hop(warm);
        comm.synchronize(compute.stream);
      }
      for (int r = 0; r < repeats; ++r) {
        NcclHopCost cost{};
        {
          NcclTransport t(comm, compute.stream, wire.stream);
          const auto start = std::chrono::steady_clock::now();
          for (int i = 0; i < hops; ++i) hop(t);
          cost.issue_s = seconds_since(start) / hops;
          comm.synchronize(compute.stream);
          cost.pipelined_s = seconds_since(start) / hops;
        }
        {
          NcclTransport t(comm, compute.stream, wire.stream);
          const int alone = std::max(1, hops / 8);
          const auto start = std::chrono::steady_clock::now();
          for (int i = 0; i < alone; ++i) {
            hop(t);
            comm.synchronize(compute.stream);
          }
          cost.alone_s = seconds_since(start) / alone;
        }
        costs.push_back(cost);
      }
    }
  } catch (...) {
    if (!comm.abort(compute.stream)) {  // nothing queued may outlive the buffers
      local.leak();
      send.leak();
      recv.leak();
    }
    throw;
  }
  return costs;
}

}  // namespace gradsync
