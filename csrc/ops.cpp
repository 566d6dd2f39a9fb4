// The kernels as torch operators (torch.ops.gradsync.*, one schema each, the same function
// registered for CPU and CUDA) and the private module's other bindings: tensors in, raw pointers
// and device streams out. Argument checking with user-facing messages lives in gradsync/ops.py,
// and so do the operators' fake (shape-only) implementations; the checks here only guard the
// kernels against direct calls.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "engine.h"
#include "kernels/codec.h"
#include "kernels/multi_tensor.h"

#ifdef GRADSYNC_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#endif

namespace gradsync {
namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "gradsync kernels take float32, float16 or bfloat16 tensors, got ", t);
  }
}

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Describes `t` as a Segment; false if its layout has more than kMaxDims non-mergeable dimensions.
bool describe(const at::Tensor& t, Segment& s) {
  std::memset(&s, 0, sizeof(s));
  s.data = t.data_ptr();
  s.numel = t.numel();
  s.dtype = to_dtype(t.scalar_type());
  if (t.is_contiguous() || s.numel <= 1) return true;
  std::vector<int64_t> sizes, strides;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    if (!sizes.empty() && strides.back() == t.stride(d) * t.size(d)) {
      sizes.back() *= t.size(d);
      strides.back() = t.stride(d);
    } else {
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
    }
  }
  if (sizes.size() > static_cast<size_t>(kMaxDims)) return false;
  s.ndim = static_cast<int32_t>(sizes.size());
  for (int d = 0; d < s.ndim; ++d) {
    s.sizes[d] = sizes[d];
    s.strides[d] = strides[d];
  }
  return true;
}

// Whether every element lies inside the tensor's storage, which may have been shrunk or freed since
// the tensor was made a view of it.
bool within_storage(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return (last + 1) * static_cast<int64_t>(t.element_size()) <= static_cast<int64_t>(t.storage().nbytes());
}

void check_dense_cpu_or_cuda(const at::Tensor& t) {  // whose data_ptr() the kernels can read
  TORCH_CHECK((t.is_cpu() || t.is_cuda()) && t.layout() == at::kStrided,
              "gradsync: the kernels take dense CPU or CUDA tensors, got a ", t.layout(), " tensor on ", t.device());
  TORCH_CHECK(t.numel() == 0 || (t.has_storage() && t.data_ptr() != nullptr),
              "gradsync: the kernels take tensors with memory of their own (not a wrapper subclass, nor one whose "
              "storage was freed)");
  TORCH_CHECK_VALUE(within_storage(t), "gradsync: a tensor reaches past the end of its storage (resized or freed "
                    "since the tensor was made)");
}

// A Scalar, not a float, in the schemas: torch.compile passes a symbolic scale to a Scalar as it is,
// but specializes a float on its value, recompiling for every new one.
float scale_of(const at::Scalar& scale) {  // ops.py checks it too, except for a scale traced by torch.compile
  TORCH_CHECK_TYPE(!scale.isComplex() && !scale.isBoolean(), "gradsync: scale must be a real number, got ",
                   scale.type());
  const double value = scale.toDouble();
  const double rounds_to_inf = std::ldexp(2.0 - std::ldexp(1.0, -24), 127);  // float32's max plus half an ulp
  TORCH_CHECK(std::fabs(value) < rounds_to_inf, "gradsync: scale must be finite in float32 (as the kernels apply "
              "it), got ", value);
  return static_cast<float>(value);
}

void check_same_device(const at::Tensor& flat, const at::Tensor& t) {
  check_dense_cpu_or_cuda(t);
  TORCH_CHECK(t.device() == flat.device(), "gradsync: tensors must be on the flat buffer's device ", flat.device(),
              ", got ", t.device());
}

void multi_tensor_copy(const at::Tensor& flat, at::TensorList tensors, const at::Scalar& scale_arg,
                       Direction direction) {
  check_dense_cpu_or_cuda(flat);
  TORCH_CHECK(flat.is_contiguous(), "gradsync: the flat buffer must be contiguous");
  const DType flat_dtype = to_dtype(flat.scalar_type());
  const int fsize = dtype_size(flat_dtype);
  const float scale = scale_of(scale_arg);
  std::vector<Segment> segments(tensors.size());
  std::vector<at::Tensor> keep_alive;                             // contiguous copies of exotic layouts
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (user tensor, contiguous stand-in)
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    check_same_device(flat, t);
    Segment& s = segments[i];
    if (!describe(t, s)) {
      at::Tensor stand_in = t.contiguous();
      if (direction == Direction::kFromFlat) write_back.emplace_back(t, stand_in);
      else keep_alive.push_back(stand_in);
      describe(stand_in, s);
    }
    s.flat_offset = offset;
    TORCH_CHECK(s.numel <= flat.numel() - offset, "gradsync: the flat buffer holds ", flat.numel(),
                " elements, fewer than the tensors up to tensors[", i, "]");
    char* flat_at = static_cast<char*>(flat.data_ptr()) + offset * fsize;
    s.aligned = s.ndim == 0 && is_aligned16(s.data) && is_aligned16(flat_at);
    offset += s.numel;
  }
  if (flat.is_cuda()) {
#ifdef GRADSYNC_WITH_CUDA
    const c10::cuda::CUDAGuard guard(flat.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flat.device().index()).stream();
    const int64_t num_chunks = plan_chunks(segments.data(), static_cast<int64_t>(segments.size()), kCudaChunk);
    if (num_chunks > 0) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
      TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
                  "gradsync: flatten and unflatten on CUDA cannot be captured in a CUDA graph (each call copies its "
                  "table of tensors from host memory); call them outside the capture");
      const int64_t table_bytes = static_cast<int64_t>(segments.size() * sizeof(Segment));
      at::Tensor table = at::empty({table_bytes}, flat.options().dtype(at::kByte));
      // A pageable source is staged before cudaMemcpyAsync returns, so `segments` may die after it.
      C10_CUDA_CHECK(cudaMemcpyAsync(table.data_ptr(), segments.data(), table_bytes, cudaMemcpyHostToDevice, stream));
      C10_CUDA_CHECK(multi_tensor_copy_cuda(reinterpret_cast<const Segment*>(table.data_ptr()),
                                            static_cast<int64_t>(segments.size()), num_chunks, flat.data_ptr(),
                                            flat_dtype, scale, direction, stream));
    }
#else
    TORCH_CHECK(false, "gradsync was built without CUDA");
#endif
  } else {
    const int64_t num_chunks = plan_chunks(segments.data(), static_cast<int64_t>(segments.size()), kCpuChunk);
    at::parallel_for(0, num_chunks, 2, [&](int64_t begin, int64_t end) {
      multi_tensor_copy_cpu(segments.data(), static_cast<int64_t>(segments.size()), flat.data_ptr(), flat_dtype,
                            scale, direction, begin, end);
    });
  }
  for (auto& [user, stand_in] : write_back) user.copy_(stand_in);
}

void flatten_into(at::TensorList tensors, const at::Tensor& flat, const at::Scalar& scale) {
  multi_tensor_copy(flat, tensors, scale, Direction::kToFlat);
}

void unflatten_from(const at::Tensor& flat, at::TensorList tensors, const at::Scalar& scale) {
  for (const at::Tensor& t : tensors) {
    for (int64_t d = 0; d < t.dim() && t.numel() > 1; ++d) {
      TORCH_CHECK(t.stride(d) != 0 || t.size(d) <= 1, "gradsync: cannot write into an expanded tensor");
    }
  }
  multi_tensor_copy(flat, tensors, scale, Direction::kFromFlat);
}

Fp8Format to_fp8_format(int64_t codec) {
  TORCH_CHECK(codec == static_cast<int64_t>(Codec::kFp8E4M3) || codec == static_cast<int64_t>(Codec::kFp8E5M2),
              "gradsync: not an fp8 codec id: ", codec);
  return codec == static_cast<int64_t>(Codec::kFp8E4M3) ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
}

void check_payload(const at::Tensor& payload, int64_t n, const at::Tensor& x) {
  check_dense_cpu_or_cuda(payload);
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.is_contiguous() && payload.numel() == fp8_payload_bytes(n),
              "gradsync: an fp8 payload of ", n, " elements is ", fp8_payload_bytes(n), " contiguous bytes");
  TORCH_CHECK(x.is_contiguous() && x.numel() == n, "gradsync: expected a contiguous tensor of ", n, " elements");
  check_same_device(payload, x);
  // the CUDA kernels access the block scales as floats, which a misaligned address would fault on
  TORCH_CHECK(!payload.is_cuda() || reinterpret_cast<uintptr_t>(payload.data_ptr()) % 4 == 0,
              "gradsync: an fp8 payload on CUDA must start at a 4-byte aligned address");
}

void fp8_encode(const at::Tensor& x, const at::Tensor& payload, int64_t codec, const at::Scalar& scale_arg) {
  const Fp8Format format = to_fp8_format(codec);
  const int64_t n = x.numel();
  check_payload(payload, n, x);
  const float scale = scale_of(scale_arg);
  auto* out = static_cast<uint8_t*>(payload.data_ptr());
  if (x.is_cuda()) {
#ifdef GRADSYNC_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    C10_CUDA_CHECK(fp8_encode_cuda(format, x.data_ptr(), to_dtype(x.scalar_type()), n, scale, out,
                                   c10::cuda::getCurrentCUDAStream(x.device().index()).stream()));
#else
    TORCH_CHECK(false, "gradsync was built without CUDA");
#endif
    return;
  }
  const int64_t blocks = fp8_num_blocks(n);
  const DType st = to_dtype(x.scalar_type());
  at::parallel_for(0, blocks, kCpuChunk / kFp8BlockSize, [&](int64_t begin, int64_t end) {
    fp8_encode_cpu(format, x.data_ptr(), st, n, scale, out, begin, end);
  });
}

void fp8_decode(const at::Tensor& payload, const at::Tensor& out, int64_t codec, const at::Scalar& scale_arg) {
  const Fp8Format format = to_fp8_format(codec);
  const int64_t n = out.numel();
  check_payload(payload, n, out);
  const float scale = scale_of(scale_arg);
  const auto* in = static_cast<const uint8_t*>(payload.data_ptr());
  if (out.is_cuda()) {
#ifdef GRADSYNC_WITH_CUDA
    const c10::cuda::CUDAGuard guard(out.device());
    C10_CUDA_CHECK(fp8_decode_cuda(format, in, n, scale, out.data_ptr(), to_dtype(out.scalar_type()),
                                   c10::cuda::getCurrentCUDAStream(out.device().index()).stream()));
#else
    TORCH_CHECK(false, "gradsync was built without CUDA");
#endif
    return;
  }
  const int64_t blocks = fp8_num_blocks(n);
  const DType dt = to_dtype(out.scalar_type());
  at::parallel_for(0, blocks, kCpuChunk / kFp8BlockSize, [&](int64_t begin, int64_t end) {
    fp8_decode_cpu(format, in, n, scale, out.data_ptr(), dt, begin, end);
  });
}

// The fast path of gradsync/ops.py's per-tensor checks, for long lists of parameters: the number of
// elements of `tensors` when every check would pass, -1 when ops.py must run its own checks (which
// name the problem, and decide shared memory element by element). `buf`: the contiguous buffer the
// tensors are copied to or from (its first `numel` elements), which a tensor may share memory with
// only as its own segment; `written`: the tensors are written, so they must not require grad under
// grad mode, be inference tensors outside inference mode, be expanded, or share memory with each other.
int64_t plain_numel(const std::vector<at::Tensor>& tensors, const c10::optional<at::Tensor>& buf, bool written) {
  if (buf && (!buf->defined() || !buf->is_contiguous() || buf->layout() != at::kStrided)) return -1;
  if (tensors.empty()) return 0;
  const at::Device device = buf ? buf->device() : tensors[0].device();
  const bool grad_mode = at::GradMode::is_enabled();
  const bool inference_mode = c10::InferenceMode::is_enabled();
  struct Span {
    uintptr_t start, end;
    bool own;  // exactly its own segment of `buf`, in its dtype
  };
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  const uintptr_t lo = buf ? reinterpret_cast<uintptr_t>(buf->data_ptr()) : 0;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage() || t.is_nested() || t.is_neg()) return -1;
    const at::ScalarType type = t.scalar_type();
    if (t.layout() != at::kStrided || !(t.is_cpu() || t.is_cuda()) || t.device() != device ||
        (type != at::kFloat && type != at::kHalf && type != at::kBFloat16) ||
        (written && ((grad_mode && t.requires_grad()) || (!inference_mode && t.is_inference())))) {
      return -1;
    }
    const int64_t n = t.numel();
    if (n > 0) {
      const bool contiguous = t.is_contiguous();
      int64_t last = n - 1;  // offset of the last element, in elements
      if (!contiguous) {
        last = 0;
        std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
        for (int64_t d = 0; d < t.dim(); ++d) {
          last += (t.size(d) - 1) * t.stride(d);
          if (written && t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
        }
        if (written) {  // each stride beyond the reach of the smaller ones: no element written twice
          std::sort(dims.begin(), dims.end());
          int64_t reach = 0;
          for (const auto& [stride, size] : dims) {
            if (stride <= reach) return -1;
            reach += (size - 1) * stride;
          }
        }
      }
      if (t.data_ptr() == nullptr || !within_storage(t)) return -1;  // ops.py names it
      const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
      const bool own = buf && contiguous && type == buf->scalar_type() &&
                       start == lo + static_cast<uintptr_t>(offset * buf->element_size());
      spans.push_back({start, start + static_cast<uintptr_t>((last + 1) * t.element_size()), own});
    }
    if (n > std::numeric_limits<int64_t>::max() - offset) return -1;  // ops.py sums them without overflow
    offset += n;
  }
  const uintptr_t hi = buf ? lo + static_cast<uintptr_t>(std::min(offset, buf->numel()) * buf->element_size()) : 0;
  for (const Span& s : spans) {
    if (s.start < hi && lo < s.end && !s.own) return -1;
  }
  if (written) {
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.start < b.start; });
    for (size_t i = 1; i < spans.size(); ++i) {
      if (spans[i].start < spans[i - 1].end) return -1;  // sorted and disjoint so far: the previous reaches furthest
    }
  }
  return offset;
}

void set_isa(const std::string& name) {
  TORCH_CHECK(set_cpu_isa(name.c_str()), "gradsync: CPU instruction set '", name,
              "' is unknown or not supported by this CPU (choose auto, avx2 or scalar)");
}

// How many threads at::parallel_for gives the CPU kernels now: torch's intra-op thread count, or 1
// in an extension built without torch's parallel backend (at::parallel_for is inline).
int cpu_kernel_threads() {
  std::atomic<int> tasks{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { ++tasks; });
  return tasks.load();
}

py::dict build_info() {
  py::dict info;
  info["torch"] = TORCH_VERSION;
  info["fp8_block_size"] = kFp8BlockSize;
  info["payload_align"] = kPayloadAlign;
#ifdef GRADSYNC_WITH_CUDA
  info["cuda"] = py::str(std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10));
  info["nccl_compiled"] = py::str(std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
                                  std::to_string(NCCL_PATCH));
#else
  info["cuda"] = py::none();
  info["nccl_compiled"] = py::none();
#endif
  return info;
}

py::object nccl_runtime_version() {
#ifdef GRADSYNC_WITH_CUDA
  int v = 0;
  const ncclResult_t r = ncclGetVersion(&v);
  TORCH_CHECK(r == ncclSuccess, "gradsync: ncclGetVersion failed: ", ncclGetErrorString(r));
  return py::str(std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100));
#else
  return py::none();
#endif
}

}  // namespace
}  // namespace gradsync

// The kernels write into tensors they are given and return nothing, as torch's out= ops do: under
// torch.compile the writes are functionalized, so a compiled graph holds no hidden mutation.
// flatten_into and unflatten_from copy their segment table from host memory on CUDA, which a CUDA
// graph cannot capture: the tag keeps them out of torch.compile's CUDA graphs (mode="reduce-overhead").
TORCH_LIBRARY(gradsync, m) {
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 8
  const std::vector<at::Tag> host_table = {at::Tag::cudagraph_unsafe};
#else
  const std::vector<at::Tag> host_table = {};
#endif
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) out, Scalar scale) -> ()", host_table);
  m.def("unflatten_from(Tensor flat, Tensor(a!)[] tensors, Scalar scale) -> ()", host_table);
  m.def("fp8_encode(Tensor x, Tensor(a!) payload, int codec, Scalar scale) -> ()");
  m.def("fp8_decode(Tensor payload, Tensor(a!) out, int codec, Scalar scale) -> ()");
}

// CUDA too in a CPU build, where the kernels themselves say that gradsync was built without CUDA.
#define GRADSYNC_REGISTER_KERNELS(KEY)                  \
  TORCH_LIBRARY_IMPL(gradsync, KEY, m) {                \
    m.impl("flatten_into", &gradsync::flatten_into);     \
    m.impl("unflatten_from", &gradsync::unflatten_from); \
    m.impl("fp8_encode", &gradsync::fp8_encode);         \
    m.impl("fp8_decode", &gradsync::fp8_decode);         \
  }
GRADSYNC_REGISTER_KERNELS(CPU)
GRADSYNC_REGISTER_KERNELS(CUDA)

// Called as torch.ops.gradsync.* directly, the kernels keep autograd's books as torch's in-place
// ops do (torch's own fallbacks for custom operators bump only arguments that a result aliases, and
// these return nothing): with grad mode on, a write into a tensor that requires grad raises (the
// kernels are not differentiable), and every write bumps the version of what it mutates, so a
// tensor saved for backward and then overwritten fails backward.
namespace {
template <typename F>
void for_each_written(const c10::OperatorHandle& op, const torch::jit::Stack& stack, F f) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    if (!alias || !alias->isWrite()) continue;
    const c10::IValue& value = stack[first + i];
    if (value.isTensor()) f(args[i].name(), value.toTensor());
    if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) f(args[i].name(), t);
    }
  }
}

void refuse_tracked_writes(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) {
    for_each_written(op, *stack, [&](const std::string& name, const at::Tensor& t) {
      TORCH_CHECK_VALUE(!t.defined() || !t.requires_grad(), op.schema().name(), ": ", name, " requires grad, and "
                        "gradsync's kernels are not differentiable: write into it under torch.no_grad() (or pass its "
                        ".detach())");
    });
  }
  at::AutoDispatchBelowAutograd below;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

void bump_written_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  std::vector<at::Tensor> written;
  for_each_written(op, *stack, [&](const std::string&, const at::Tensor& t) { written.push_back(t); });
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) {
    if (t.defined()) torch::autograd::impl::bump_version(t);
  }
}
}  // namespace

#define GRADSYNC_REGISTER_AUTOGRAD(KEY, KERNEL) \
  TORCH_LIBRARY_IMPL(gradsync, KEY, m) {        \
    m.impl("flatten_into", KERNEL);             \
    m.impl("unflatten_from", KERNEL);           \
    m.impl("fp8_encode", KERNEL);               \
    m.impl("fp8_decode", KERNEL);               \
  }
GRADSYNC_REGISTER_AUTOGRAD(Autograd, torch::CppFunction::makeFromBoxedFunction<&refuse_tracked_writes>())
GRADSYNC_REGISTER_AUTOGRAD(ADInplaceOrView, torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>())

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace gradsync;
  m.def("plain_numel", &plain_numel, "Whether ops.py's per-tensor checks would pass: the elements, or -1",
        py::arg("tensors"), py::arg("buf"), py::arg("written"));
  m.def("set_cpu_isa", &set_isa, "Select the CPU kernels' instruction set: auto, avx2 or scalar");
  m.def("cpu_isa", []() { return std::string(cpu_isa()); });
  m.def("cpu_kernel_threads", &cpu_kernel_threads);
  m.def("build_info", &build_info);
  m.def("nccl_runtime_version", &nccl_runtime_version);
  bind_ring(m);
}
