"""gradsync: cheaper, safer gradient synchronization for PyTorch data parallelism.

Fused multi-tensor flatten/unflatten and gradient codecs (fp16, bf16, block-scaled fp8) on CPU and CUDA,
and a ring all-reduce (and reduce-scatter) that sends the compressed wire and accumulates in fp32.
"""
from . import _extension

try:
    _build_info, _C = _extension.load()
    _load_error = None
except ImportError as error:
    if not _extension.diagnosing():
        raise
    _build_info, _C, _load_error = None, None, error  # python -m gradsync.report says what it can and why
    try:
        _build_info = _extension.read_build_info()
    except ImportError:
        pass

    def __getattr__(name):  # the API of a gradsync that did not load: the reason, not "no attribute"
        if name.startswith("__"):  # what introspection probes for (hasattr) stays an AttributeError
            raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
        raise ImportError(f"gradsync.{name}: {_load_error}")

__version__ = _build_info.version if _build_info else "unknown"

if _C is not None:
    from . import hooks
    from .data_parallel import DataParallel
    from .distributed import AllReduceWork, all_gather, all_reduce, reduce_scatter, shutdown
    from .ops import (
        CODECS,
        FP8_BLOCK_SIZE,
        compress,
        decompress,
        flatten,
        payload_nbytes,
        unflatten,
    )

    __all__ = ["AllReduceWork", "CODECS", "DataParallel", "FP8_BLOCK_SIZE", "all_gather", "all_reduce", "compress",
               "decompress", "flatten", "hooks", "payload_nbytes", "reduce_scatter", "shutdown", "unflatten",
               "__version__"]
