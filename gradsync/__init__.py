"""gradsync: cheaper, safer gradient synchronization for PyTorch data parallelism.

Fused multi-tensor flatten/unflatten and gradient codecs (fp16, bf16, block-scaled fp8) on CPU and CUDA.
"""
from ._extension import load as _load

_build_info, _C = _load()
__version__ = _build_info.version

from .ops import (  # noqa: E402
    CODECS,
    FP8_BLOCK_SIZE,
    compress,
    decompress,
    flatten,
    payload_nbytes,
    unflatten,
)

__all__ = ["CODECS", "FP8_BLOCK_SIZE", "compress", "decompress", "flatten", "payload_nbytes", "unflatten",
           "__version__"]
