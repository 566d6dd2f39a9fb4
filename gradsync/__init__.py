"""gradsync: cheaper, safer gradient synchronization for PyTorch data parallelism.

Fused multi-tensor flatten/unflatten and gradient codecs (fp16, bf16, block-scaled fp8) on CPU and CUDA,
and a ring all-reduce (and reduce-scatter) that sends the compressed wire and accumulates in fp32.
"""
from ._extension import load as _load

_build_info, _C = _load()
__version__ = _build_info.version

from . import hooks  # noqa: E402
from .data_parallel import DataParallel  # noqa: E402
from .distributed import AllReduceWork, all_gather, all_reduce, reduce_scatter, shutdown  # noqa: E402
from .ops import (  # noqa: E402
    CODECS,
    FP8_BLOCK_SIZE,
    compress,
    decompress,
    flatten,
    payload_nbytes,
    unflatten,
)

__all__ = ["AllReduceWork", "CODECS", "DataParallel", "FP8_BLOCK_SIZE", "all_gather", "all_reduce", "compress",
           "decompress", "flatten", "hooks", "payload_nbytes", "reduce_scatter", "shutdown", "unflatten", "__version__"]
