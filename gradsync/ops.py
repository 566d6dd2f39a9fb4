"""Fused gradient kernels: multi-tensor flatten/unflatten and the wire codecs.

Every function runs one fused pass over its data (one kernel launch on CUDA) and has a CPU and a
CUDA implementation that produce the same bits. None of them is differentiable. The kernels are torch
operators (``torch.ops.gradsync``), so the functions also run inside ``torch.compile``d code, where
the checks that need memory addresses (shared memory, alignment) are left to the kernels' own guards.
"""
import functools
import math
import numbers
import struct
from typing import Optional, Sequence

import torch

from . import _C

CODECS = ("none", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
"""Codec names accepted by :func:`compress` and :func:`decompress`."""

FP8_BLOCK_SIZE = int(_C.build_info()["fp8_block_size"])
"""Elements per fp8 scale block. Layout of an fp8 payload of n elements (uint8): n fp8 codes, zero
padding up to a multiple of 16 bytes, then one float32 decode scale (a power of two) per block."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KERNELS = torch.ops.gradsync
_CODEC_IDS = {name: i for i, name in enumerate(CODECS)}
_CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _writes_only(*args):
    """What the kernels do to shapes, for torch.compile's fake tensors: nothing, as each writes into
    tensors it is given and returns nothing."""


for _kernel in ("flatten_into", "unflatten_from", "fp8_encode", "fp8_decode"):
    torch.library.register_fake(f"gradsync::{_kernel}")(_writes_only)


def _compiling():
    """Whether torch.compile is tracing: its fake tensors have shapes but no memory addresses."""
    return torch.compiler.is_compiling()


def _eager_under_compile(fn):
    """``fn`` run eagerly wherever it is called: while torch.compile traces a call, left out of the
    graph as ``torch.compiler.disable`` leaves it (a graph break); otherwise called directly, so that
    importing gradsync does not import torch._dynamo (a second) and eager calls cost nothing more."""
    why = (f"gradsync: {fn.__qualname__} runs eagerly, between compiled graphs (it talks to other ranks); "
           "compile without fullgraph=True, or call it outside the compiled function")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _compiling():
            torch._dynamo.graph_break(msg=why)  # what fullgraph=True reports, rather than torch's own disable
            return torch.compiler.disable(fn, reason=why)(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


def _check_tensor(value, name):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {value.device}; gradsync's kernels take CPU or CUDA tensors")
    if value.is_nested:
        raise ValueError(f"{name} is a nested tensor; gradsync's kernels take dense (strided) tensors")
    if value.layout != torch.strided:
        raise ValueError(f"{name} has layout {value.layout}; gradsync's kernels take dense (strided) tensors")
    if not _compiling():  # fake tensors have no memory, and torch.compile resolves negative views itself
        _check_memory(value, name, "the kernels")


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # without an address, their storage was freed


def _check_memory(t, name, reader):
    """What ``reader`` reads and writes through the tensor's address: its own elements, signed as stored."""
    if t.numel() and not _data_ptr(t):
        if _is_zero_tensor(t):  # a storage of the right size, never allocated
            raise ValueError(f"{name} is a ZeroTensor (torch._efficientzerotensor), which has no memory for "
                             f"{reader} to read or write; pass a materialized one (torch.zeros_like({name}))")
        if _storage_nbytes(t) is None or type(t) not in _PLAIN_TENSORS:
            raise ValueError(f"{name} has no memory of its own to read or write (a tensor subclass that wraps "
                             "others?); pass plain tensors")
    if not _within_storage(t):
        raise ValueError(f"{name} reaches past the end of its storage (resized or freed since the tensor was made)")
    if t.is_neg():
        raise ValueError(f"{name} is a negative view (torch._neg_view), whose sign {reader} would not apply; "
                         f"pass {name}.resolve_neg()")


def _is_zero_tensor(t):
    return type(t) in _PLAIN_TENSORS and t._is_zerotensor()  # a subclass may refuse the call


def _within_storage(t):
    """Whether every element of ``t`` lies inside its storage, which may have been shrunk (or freed,
    as FSDP frees unsharded parameters) since ``t`` was made."""
    if not t.numel():
        return True
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size() <= (_storage_nbytes(t) or 0)


def _storage_nbytes(t):
    """None for a tensor without storage."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def _data_ptr(t):
    try:
        return t.data_ptr()
    except RuntimeError:  # a tensor without storage
        return 0


def _check_numel(numel):
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral):
        raise TypeError(f"numel must be an int, got {type(numel).__name__}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return int(numel)


def _check_float_tensor(value, name):
    _check_tensor(value, name)
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {value.dtype}; gradsync takes float32, float16 or bfloat16 tensors")


def _check_float_dtype(dtype, name):
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")


def _check_scale(scale, name="scale"):
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        traced = " (torch.compile traces a numpy scalar as an array: pass float(scale))" \
            if _compiling() and type(scale).__name__ == "ndarray" else ""
        raise TypeError(f"{name} must be a real number, got {type(scale).__name__}{traced}")
    if _compiling():  # a traced scale may be symbolic; the kernel checks its range when it runs
        if type(scale) is not int:
            return scale
        # a plain int: rounded once, as in eager; one past float32's range is inf, which the kernel refuses
        return _float32_int(scale) if abs(scale).bit_length() <= 128 else math.inf if scale > 0 else -math.inf
    try:  # the kernels apply it in float32: it must be finite there too
        value = _float32_int(scale) if isinstance(scale, numbers.Integral) else float(scale)
        struct.pack("<f", value)  # raises where rounding to float32 overflows
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float, or rounding past float32's largest value
        finite = False
    if not finite:
        raise ValueError(f"{name} must be finite in float32 (at most {_FLOAT32_MAX:.7g} in magnitude), got {scale}")
    return value


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _float32_int(n):
    """An integer rounded once to float32's 24 bits (to nearest, ties to even), as torch converts an
    integer scale; float() first would round a large one twice."""
    n = int(n)
    magnitude, shift = abs(n), abs(n).bit_length() - 24
    if shift > 0:
        kept, rest = magnitude >> shift, magnitude & ((1 << shift) - 1)  # not divmod, which Dynamo cannot trace
        half = 1 << (shift - 1)
        if rest > half or (rest == half and kept & 1):
            kept += 1
        magnitude = kept << shift
    return math.copysign(float(magnitude), n)


def _check_codec(codec):
    if not isinstance(codec, str):
        raise TypeError(f"codec must be a str, one of {', '.join(CODECS)}; got {type(codec).__name__}")
    if codec not in _CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")


def _check_tensor_list(tensors, name):
    tensors = _as_list(tensors, name)
    for i, t in enumerate(tensors):
        _check_float_tensor(t, f"{name}[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {tensors[0].device}; "
                             "all tensors must be on one device")
    return tensors


def _as_list(tensors, name):
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of torch.Tensor, got {type(tensors).__name__}")
    return list(tensors)


def _plain_numel(tensors, buf, written):
    """The elements of ``tensors`` when every per-tensor check (and the shared-memory rule against
    ``buf`` and, when ``written``, between the tensors) would pass, else -1: then the Python checks
    run, to name the problem. Long lists of small parameters spend most of a call in those checks."""
    if _compiling():
        return -1
    try:
        return _C.plain_numel(tensors, buf, written)
    except (TypeError, RuntimeError):  # an element that is not a tensor, or has no storage
        return -1


def _check_out(out, numel, dtype, device, name="out"):
    _check_tensor(out, name)
    if out.dtype != dtype:
        raise ValueError(f"{name} has dtype {out.dtype}, expected {dtype}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}, expected {device}")
    if out.numel() != numel or out.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(out.shape)}, expected a 1-D tensor of {numel} elements")
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _byte_span(t):
    """[first, last + 1) byte addresses of a non-empty tensor's elements (torch strides are >= 0)."""
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.nbytes
    return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


_EXACT_CHECK_LIMIT = 1 << 24
"""Words (of the largest size that divides every element's address and length) beyond which strided
tensors whose address ranges meet are refused instead of compared element by element."""


def _dense(t):
    """Whether ``t``'s elements tile its byte span once (contiguous up to an order of its dims): then
    two such tensors share memory exactly when their spans meet."""
    expected = 1
    for size, stride in sorted((p for p in zip(t.shape, t.stride()) if p[0] != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _may_overlap_itself(t):
    """False when ``t``'s strides give every element its own address (each stride, in increasing
    order, beyond the reach of the smaller ones); True when they may not (expanded or as_strided)."""
    by_stride = []  # sorted by hand: torch.compile cannot sort symbolic strides, but compares them
    for stride, size in zip(t.stride(), t.shape):
        if size > 1:
            at = len(by_stride)
            while at and by_stride[at - 1][0] > stride:
                at -= 1
            by_stride.insert(at, (stride, size))
    reach = 0
    for stride, size in by_stride:
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _check_own_elements(t, name):
    """A destination must not hold one memory location twice: the result would depend on the order
    of the writes."""
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} is an expanded view (a stride of 0); it cannot be written element-wise")
    if _may_overlap_itself(t):
        if _compiling():
            raise ValueError(f"{name} has strides that may give two elements one address, which cannot be "
                             "checked under torch.compile; write into a contiguous tensor and copy it")
        if t.numel() > _EXACT_CHECK_LIMIT:
            raise ValueError(f"{name} has strides that may give two elements one address, and too many elements "
                             f"({t.numel()}) to check one by one; write into a contiguous tensor and copy it")
        if torch.unique(_words(t, t.element_size())).numel() < t.numel():
            raise ValueError(f"{name} overlaps itself (several elements at one address, as torch.as_strided can "
                             "make); it cannot be written element-wise")


def _words(t, unit):
    """The addresses / ``unit`` of every ``unit``-byte word ``t``'s elements occupy."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * (stride * t.element_size() // unit)
    first = offsets.reshape(-1) + t.data_ptr() // unit
    return torch.cat([first + k for k in range(t.element_size() // unit)])


def _sharing_pair(spans):
    """The indices (i, j) of two tensors that share a byte, or None. ``spans``: (start, end, index,
    tensor) of non-empty tensors on one device. Address ranges that meet are exact for dense tensors;
    strided ones (columns of one matrix) are compared word by word."""
    spans = sorted(spans, key=lambda s: s[:3])
    cluster, reach = [], -1
    for span in spans + [(math.inf, math.inf, -1, None)]:
        if span[0] >= reach and len(cluster) > 1:
            pair = _sharing_pair_in(cluster)
            if pair:
                return pair
        if span[0] >= reach:
            cluster = []
        cluster.append(span)
        reach = max(reach, span[1])
    return None


def _sharing_pair_in(cluster):
    """As _sharing_pair, for spans sorted by start whose ranges chain into one."""
    if all(_dense(t) for *_, t in cluster):
        widest = cluster[0]
        for span in cluster[1:]:
            if span[0] < widest[1]:
                return tuple(sorted((widest[2], span[2])))
            widest = max(widest, span, key=lambda s: s[1])
    unit = 0
    for *_, t in cluster:
        unit = math.gcd(unit, t.element_size(), t.data_ptr(), *(st * t.element_size() for st in t.stride()))
    total = sum(t.numel() * t.element_size() // unit for *_, t in cluster)
    if total > _EXACT_CHECK_LIMIT:
        i, j = sorted(span[2] for span in cluster[:2])
        raise _TooLargeToCheck(i, j, total)
    words = torch.cat([_words(t, unit) for *_, t in cluster])
    owners = torch.cat([torch.full((t.numel() * t.element_size() // unit,), k) for k, (*_, t) in enumerate(cluster)])
    words, order = torch.sort(words, stable=True)
    owners = owners[order]
    shared = ((words[1:] == words[:-1]) & (owners[1:] != owners[:-1])).nonzero()
    if not len(shared):
        return None
    k = int(shared[0])
    return tuple(sorted((cluster[int(owners[k])][2], cluster[int(owners[k + 1])][2])))


class _TooLargeToCheck(Exception):
    def __init__(self, i, j, words):
        super().__init__(i, j, words)
        self.pair, self.words = (i, j), words


def _check_segments(tensors, name, buf, buf_name, one=False):
    """Raises unless each of ``tensors`` (copied to or from consecutive segments of ``buf``) shares no
    memory with ``buf``, or is exactly its own segment of ``buf`` in ``buf``'s dtype (then each element
    is read and written in place, which is safe). Returns the tensors' spans for _sharing_pair (empty
    ones left out). ``one``: ``tensors`` is the single tensor called ``name``. Under torch.compile,
    which functionalizes the kernels' writes, there are no addresses to compare: no spans."""
    if _compiling():
        return []
    spans, offset = [], 0
    lo, hi = _byte_span(buf) if buf.numel() else (0, 0)
    for i, t in enumerate(tensors):
        numel = t.numel()
        if numel:
            start, end = _byte_span(t)
            spans.append((start, end, i, t))
            if (start < hi and lo < end and t.device == buf.device
                    and not (t.dtype == buf.dtype and start == lo + offset * buf.element_size() and t.is_contiguous())
                    and _shares(spans[-1], (lo, hi, -1, buf), label := name if one else f"{name}[{i}]", buf_name)):
                where = "" if one and t.dtype != buf.dtype else \
                    f" other than as its own segment ({buf_name}[{offset}:{offset + numel}]) of the same dtype"
                raise ValueError(f"{label} shares memory with {buf_name}{where}: the result would depend on the order "
                                 "of the kernel's reads and writes; clone() it first")
        offset += numel
    return spans


def _shares(a, b, a_name, b_name):
    try:
        return _sharing_pair([a, b]) is not None
    except _TooLargeToCheck as e:
        raise ValueError(f"{a_name} and {b_name} are strided tensors whose address ranges meet, too large "
                         f"({e.words} words) to check element by element for shared memory: clone() one of "
                         "them first") from None


def _check_writable(t, name):
    """The kernels write behind autograd's back: refuse tensors autograd would track, and, as
    torch's in-place ops do, inference tensors outside inference mode."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, and gradsync's kernels are not differentiable: write into it "
                         "under torch.no_grad() (or pass its .detach())")
    if not _compiling() and t.is_inference() and not torch.is_inference_mode_enabled():  # Dynamo cannot trace it
        raise ValueError(f"{name} is an inference tensor, which can be written only inside torch.inference_mode()")


def _fresh_under_compile(targets):
    """What a kernel writes for ``targets``: the targets themselves, or under torch.compile fresh
    tensors that :func:`_copy_back` then copies into them. Inductor moves reads made before a custom
    op's write of a tensor to after it (``y = buf * 2; flatten([y], out=buf); buf + y`` then reads
    the new buf), where it keeps an explicit copy_ in order."""
    return [torch.empty_like(t) for t in targets] if _compiling() else targets


def _copy_back(written, targets):
    # eager, the kernel wrote the targets (no per-tensor loop on the hot path); fresh tensors made
    # in a traced frame are copied even where this runs eagerly
    if not written or (written[0] is targets[0] and not _compiling()):
        return
    for fresh, target in zip(written, targets):
        if fresh is not target:
            target.copy_(fresh)


def payload_nbytes(codec: str, numel: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes on the wire for ``numel`` elements under ``codec`` (``dtype``: the input dtype, used by "none")."""
    _check_codec(codec)
    numel = _check_numel(numel)
    if codec == "none":
        _check_float_dtype(dtype, "dtype")
        return numel * torch.empty((), dtype=dtype).element_size()
    if codec in _CAST_DTYPES:
        return 2 * numel
    blocks = -(-numel // FP8_BLOCK_SIZE)
    return -(-numel // 16) * 16 + 4 * blocks


def flatten(tensors, *, dtype: Optional[torch.dtype] = None, scale: float = 1.0,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenates ``tensors`` into one contiguous 1-D buffer, each element multiplied by ``scale`` in
    fp32 and cast to ``dtype``, in one pass.

    Equals ``torch.cat([(t.float() * scale).to(dtype).flatten() for t in tensors])`` bit for bit (a NaN
    stays a NaN, its bits aside). ``out`` may hold inputs only as their own segments (in place); any
    other shared memory raises ValueError, as does an ``out`` that requires grad under grad mode.
    Inputs may mix float32/float16/bfloat16, have any shape, be empty or non-contiguous; all must be
    on one device. ``dtype`` defaults to the inputs' promoted dtype (or ``out.dtype``).
    """
    tensors = _as_list(tensors, "tensors")
    if out is not None:
        _check_tensor(out, "out")
    numel = _plain_numel(tensors, out, written=False)
    plain = numel >= 0
    if not plain:
        _check_tensor_list(tensors, "tensors")
        numel = sum(t.numel() for t in tensors)
        if numel >= 2**63:  # expanded views, say: more than one tensor can hold
            raise ValueError(f"tensors hold {numel} elements together, more than a tensor can (2**63 - 1)")
    scale = _check_scale(scale)
    dtype_name = "dtype"
    if dtype is None:
        if out is not None:
            dtype, dtype_name = out.dtype, "out's dtype"
        elif not tensors:
            raise ValueError("tensors is empty: pass out= to say what to return, and on which device")
        else:
            dtype, dtype_name = tensors[0].dtype, "the tensors' common dtype"
            for other in {t.dtype for t in tensors}:  # the distinct dtypes: long lists have one or two
                dtype = torch.promote_types(dtype, other)
    _check_float_dtype(dtype, dtype_name)
    if out is None:
        if not tensors:
            raise ValueError("tensors is empty: pass out= to say which device to use")
        written = out = torch.empty(numel, dtype=dtype, device=tensors[0].device)
    else:
        _check_out(out, numel, dtype, tensors[0].device if tensors else out.device)
        _check_writable(out, "out")
        if not plain:
            _check_segments(tensors, "tensors", out, "out")
        [written] = _fresh_under_compile([out])
    _KERNELS.flatten_into.default(tensors, written, scale)
    _copy_back([written], [out])
    return out


def unflatten(flat: torch.Tensor, tensors, *, scale: float = 1.0) -> None:
    """Writes consecutive segments of ``flat`` into ``tensors`` in place, each element multiplied by
    ``scale`` in fp32 and cast to the tensor's dtype, in one pass (the inverse of :func:`flatten`).

    ``flat`` must hold at least as many elements as the tensors together; any extra tail is ignored.
    A tensor may be its own segment of ``flat``; tensors that share memory otherwise (with ``flat`` or
    with each other) raise ValueError. Writes bump the tensors' autograd versions.
    """
    _check_float_tensor(flat, "flat")
    tensors = _as_list(tensors, "tensors")
    numel = _plain_numel(tensors, flat, written=True) if flat.dim() == 1 and flat.is_contiguous() else -1
    plain = numel >= 0
    if not plain:
        _check_tensor_list(tensors, "tensors")
        numel = sum(t.numel() for t in tensors)
    scale = _check_scale(scale)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
    if flat.numel() < numel:
        raise ValueError(f"flat has {flat.numel()} elements but the tensors need {numel}")
    if not plain:
        for i, t in enumerate(tensors):
            if t.device != flat.device:
                raise ValueError(f"tensors[{i}] is on {t.device} but flat is on {flat.device}")
            if not t.is_contiguous():
                _check_own_elements(t, f"tensors[{i}]")
            _check_writable(t, f"tensors[{i}]")
        _check_destinations(flat[:numel], tensors)
    written = _fresh_under_compile(tensors)
    _KERNELS.unflatten_from.default(flat, written, scale)
    _copy_back(written, tensors)


def _check_destinations(read, tensors):
    """No two tensors written share memory, nor does one share memory with the part of ``flat`` read,
    except as its own segment."""
    spans = _check_segments(tensors, "tensors", read, "flat")  # all on flat's device
    try:
        pair = _sharing_pair(spans)
    except _TooLargeToCheck as e:
        i, j = e.pair
        raise ValueError(f"tensors[{i}] and tensors[{j}] are strided tensors whose address ranges meet, too "
                         f"large ({e.words} words) to check element by element for shared memory: pass them "
                         "in separate calls") from None
    if pair:
        raise ValueError(f"tensors[{pair[0]}] and tensors[{pair[1]}] share memory: both would be written; pass "
                         "each destination once")


def _payload_dtype(codec, x_dtype):
    return x_dtype if codec == "none" else _CAST_DTYPES.get(codec, torch.uint8)


def _check_fp8_payload_alignment(payload, name):
    # CUDA kernels read and write the block scales as floats, which a misaligned address would fault on
    if payload.is_cuda and not _compiling() and payload.data_ptr() % 4:
        raise ValueError(f"{name}: an fp8 payload on CUDA must start at a 4-byte aligned address (its block "
                         f"scales are floats); this one starts {payload.data_ptr() % 4} bytes past one")


def compress(x: torch.Tensor, codec: str, *, scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Encodes ``x * scale`` (in fp32, any shape, read in row-major order) into the wire payload of ``codec``
    (into ``out`` when given: a contiguous 1-D tensor of the payload's dtype and length).

    "none" keeps ``x.dtype``; "fp16" and "bf16" give float16/bfloat16 tensors bit-identical to
    ``(x.float() * scale).to(dtype)``; the fp8 codecs give a uint8 payload (see FP8_BLOCK_SIZE) where
    every block of 128 elements carries its own power-of-two scale. Inf and NaN stay non-finite.
    """
    _check_float_tensor(x, "x")
    _check_codec(codec)
    scale = _check_scale(scale)
    dtype = _payload_dtype(codec, x.dtype)
    length = x.numel() if codec == "none" or codec in _CAST_DTYPES else payload_nbytes(codec, x.numel())
    if out is None:
        written = out = torch.empty(length, dtype=dtype, device=x.device)
    else:
        _check_out(out, length, dtype, x.device)
        _check_writable(out, "out")
        _check_segments([x], "x", out, "out", one=True)
        [written] = _fresh_under_compile([out])
    if codec == "none" or codec in _CAST_DTYPES:
        _KERNELS.flatten_into.default([x], written, scale)
    else:
        _check_fp8_payload_alignment(out, "out")
        _KERNELS.fp8_encode.default(x.contiguous().view(-1), written, _CODEC_IDS[codec], scale)
    _copy_back([written], [out])
    return out


def decompress(payload: torch.Tensor, codec: str, numel: int, *, dtype: torch.dtype = torch.float32,
               scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decodes a payload of ``numel`` elements made by :func:`compress` into a 1-D ``dtype`` tensor,
    multiplied by ``scale`` in fp32 (into ``out`` when given). An fp8 payload's length fixes
    ``numel`` only up to its 16-byte padding: pass the numel it was made with."""
    _check_tensor(payload, "payload")
    _check_codec(codec)
    numel = _check_numel(numel)
    _check_float_dtype(dtype, "dtype")
    scale = _check_scale(scale)
    if not payload.is_contiguous():
        raise ValueError("payload must be contiguous")
    if codec == "none":
        _check_float_tensor(payload, "payload")
    else:
        expected = _payload_dtype(codec, None)
        if payload.dtype != expected:
            raise ValueError(f"a {codec} payload has dtype {expected}, got {payload.dtype}")
    wire_numel = payload.numel() if codec != "fp8_e4m3" and codec != "fp8_e5m2" else None
    if wire_numel is not None and wire_numel != numel:
        raise ValueError(f"payload holds {wire_numel} elements but numel is {numel}")
    if wire_numel is None and payload.numel() != payload_nbytes(codec, numel):
        raise ValueError(f"payload has {payload.numel()} bytes but a {codec} payload of {numel} elements "
                         f"has {payload_nbytes(codec, numel)}")
    if out is None:
        written = out = torch.empty(numel, dtype=dtype, device=payload.device)
    else:
        _check_out(out, numel, dtype, payload.device)
        _check_writable(out, "out")
        _check_segments([payload], "payload", out, "out", one=True)
        [written] = _fresh_under_compile([out])
    if wire_numel is not None:
        _KERNELS.unflatten_from.default(payload.view(-1), [written], scale)
    else:
        _check_fp8_payload_alignment(payload, "payload")
        _KERNELS.fp8_decode.default(payload.view(-1), written, _CODEC_IDS[codec], scale)
    _copy_back([written], [out])
    return out
