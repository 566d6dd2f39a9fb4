"""Fused gradient kernels: multi-tensor flatten/unflatten and the wire codecs.

Every function runs one fused pass over its data (one kernel launch on CUDA) and has a CPU and a
CUDA implementation that produce the same bits. None of them is differentiable.
"""
import math
import numbers
from typing import Optional, Sequence

import torch

from . import _C

CODECS = ("none", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
"""Codec names accepted by :func:`compress` and :func:`decompress`."""

FP8_BLOCK_SIZE = int(_C.build_info()["fp8_block_size"])
"""Elements per fp8 scale block. Layout of an fp8 payload of n elements (uint8): n fp8 codes, zero
padding up to a multiple of 16 bytes, then one float32 decode scale (a power of two) per block."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CODEC_IDS = {name: i for i, name in enumerate(CODECS)}
_CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _check_tensor(value, name):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {value.device}; gradsync's kernels take CPU or CUDA tensors")
    if value.layout != torch.strided:
        raise ValueError(f"{name} has layout {value.layout}; gradsync's kernels take dense (strided) tensors")


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
        raise TypeError(f"{name} must be a real number, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def _check_codec(codec):
    if codec not in _CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")


def _check_tensor_list(tensors, name):
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of torch.Tensor, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check_float_tensor(t, f"{name}[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {tensors[0].device}; "
                             "all tensors must be on one device")
    return tensors


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

    Equals ``torch.cat([(t.float() * scale).to(dtype).flatten() for t in tensors])`` bit for bit.
    Inputs may mix float32/float16/bfloat16, have any shape, be empty or non-contiguous; all must be
    on one device. ``dtype`` defaults to the inputs' promoted dtype (or ``out.dtype``).
    """
    tensors = _check_tensor_list(tensors, "tensors")
    scale = _check_scale(scale)
    if dtype is None and out is not None:
        _check_tensor(out, "out")
        dtype = out.dtype
    if dtype is None:
        if not tensors:
            raise ValueError("tensors is empty: pass dtype= or out= to say what to return")
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
    _check_float_dtype(dtype, "dtype")
    numel = sum(t.numel() for t in tensors)
    if out is None:
        if not tensors:
            raise ValueError("tensors is empty: pass out= to say which device to use")
        out = torch.empty(numel, dtype=dtype, device=tensors[0].device)
    else:
        _check_out(out, numel, dtype, tensors[0].device if tensors else out.device)
    _C.flatten_into(tensors, out, scale)
    return out


def unflatten(flat: torch.Tensor, tensors, *, scale: float = 1.0) -> None:
    """Writes consecutive segments of ``flat`` into ``tensors`` in place, each element multiplied by
    ``scale`` in fp32 and cast to the tensor's dtype, in one pass (the inverse of :func:`flatten`).

    ``flat`` must hold at least as many elements as the tensors together; any extra tail is ignored.
    """
    _check_float_tensor(flat, "flat")
    tensors = _check_tensor_list(tensors, "tensors")
    scale = _check_scale(scale)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
    numel = sum(t.numel() for t in tensors)
    if flat.numel() < numel:
        raise ValueError(f"flat has {flat.numel()} elements but the tensors need {numel}")
    for i, t in enumerate(tensors):
        if t.device != flat.device:
            raise ValueError(f"tensors[{i}] is on {t.device} but flat is on {flat.device}")
        if t.numel() > 1 and any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
            raise ValueError(f"tensors[{i}] is an expanded view (a stride of 0); it cannot be written element-wise")
    _C.unflatten_from(flat, tensors, scale)


def _payload_dtype(codec, x_dtype):
    return x_dtype if codec == "none" else _CAST_DTYPES.get(codec, torch.uint8)


def _check_fp8_payload_alignment(payload, name):
    # CUDA kernels read and write the block scales as floats, which a misaligned address would fault on
    if payload.is_cuda and payload.data_ptr() % 4:
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
        out = torch.empty(length, dtype=dtype, device=x.device)
    else:
        _check_out(out, length, dtype, x.device)
    if codec == "none" or codec in _CAST_DTYPES:
        _C.flatten_into([x], out, scale)
    else:
        _check_fp8_payload_alignment(out, "out")
        _C.fp8_encode(x.contiguous().view(-1), out, _CODEC_IDS[codec], scale)
    return out


def decompress(payload: torch.Tensor, codec: str, numel: int, *, dtype: torch.dtype = torch.float32,
               scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decodes a payload of ``numel`` elements made by :func:`compress` into a 1-D ``dtype`` tensor,
    multiplied by ``scale`` in fp32 (into ``out`` when given)."""
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
        out = torch.empty(numel, dtype=dtype, device=payload.device)
    else:
        _check_out(out, numel, dtype, payload.device)
    if wire_numel is not None:
        _C.unflatten_from(payload.view(-1), [out], scale)
    else:
        _check_fp8_payload_alignment(payload, "payload")
        _C.fp8_decode(payload.view(-1), out, _CODEC_IDS[codec], scale)
    return out
