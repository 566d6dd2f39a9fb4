"""FSDP2 (``torch.distributed.fsdp.fully_shard``): gradsync's ring as the gradient reduce-scatter.

    from gradsync import fsdp
    model = fully_shard(model)                        # and its submodules, as usual
    fsdp.compress_reduce_scatter(model, codec="bf16")  # every FSDP module in model

FSDP2 reduce-scatters gradients with the process group's own collective in its ``reduce_dtype``
(``MixedPrecisionPolicy``): in bf16, NCCL rounds every partial sum to bf16. With gradsync the wire
carries ``codec`` while every hop sums in fp32, whatever ``reduce_dtype`` is; fp16 and the
block-scaled fp8 codecs become possible too. Built on FSDP2's ``set_custom_reduce_scatter``, a
private part of torch (``torch.distributed.fsdp._fully_shard._fsdp_api``).
"""
import torch
import torch.distributed as dist

from .distributed import _check_flag, _op_factor, reduce_scatter
from .ops import _check_codec

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterComm
except ImportError:  # a torch without FSDP2's custom reduce-scatter
    _ReduceScatterComm = object

__all__ = ["ReduceScatter", "compress_reduce_scatter"]


class ReduceScatter(_ReduceScatterComm):
    """An FSDP2 reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) through gradsync's ring,
    on the wire ``codec``, summing in fp32. It takes each op FSDP2 asks for: an average, a sum, and
    after ``set_gradient_divide_factor(f)`` the pre-multiplied sum ``ReduceOp.PREMUL_SUM(1 / f)``
    (the factor applied to each rank's part before it is encoded, as gradsync's average applies
    1/n).

    Each call's layout is checked across the ranks the first time it is seen (as gradsync's DDP
    hooks check each bucket once). ``error_feedback``: keep, per layout, the fp32 residual of what
    this rank's encodings lost and add it to the next step's gradients (see
    :func:`gradsync.all_reduce`); give each FSDP module an instance of its own, as
    :func:`compress_reduce_scatter` does. The residual has the unsharded gradients' size: an fp32
    copy of the module's gradients on every rank, which sharding otherwise avoids.

    FSDP2 calls a custom reduce-scatter synchronously, and gradsync's completes on the host: on a
    GPU, each module's backward waits for the previous module's reduce-scatter to finish instead
    of overlapping it (torch's own is only ordered on FSDP2's stream). Not measured on a GPU yet.
    """

    def __init__(self, codec: str = "bf16", *, error_feedback: bool = False):
        if _ReduceScatterComm is object:
            raise ImportError("gradsync.fsdp needs a torch whose FSDP2 has custom reduce-scatters "
                              "(FSDPModule.set_custom_reduce_scatter, torch 2.8 and later)")
        _check_codec(codec)
        self.codec = codec
        self.error_feedback = _check_flag(error_feedback, "error_feedback")
        self._checked = set()
        self._residuals = {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        try:
            factor = _op_factor(op, group.size())
        except ValueError:
            raise ValueError(f"gradsync.fsdp.ReduceScatter averages or sums (pre-multiplied or not), not {op!r}")
        key = (input_tensor.numel(), input_tensor.dtype, input_tensor.device, factor)
        residual = None
        if self.error_feedback:
            residual = self._residuals.get(key)
            if residual is None:
                residual = self._residuals[key] = torch.zeros(input_tensor.numel(), dtype=torch.float32,
                                                              device=input_tensor.device)
        work = reduce_scatter(output_tensor, input_tensor, op=op, codec=self.codec, group=group, async_op=True,
                              check_call=key not in self._checked, residual=residual)
        if async_op:  # checked again next time: whether this one succeeded is known at its wait()
            return work
        work.wait()
        self._checked.add(key)  # on every rank alike: the call succeeded everywhere or raised everywhere
        return None


def compress_reduce_scatter(module: torch.nn.Module, codec: str = "bf16", *, error_feedback: bool = False) -> int:
    """Makes every FSDP2 module in ``module`` (itself included) reduce-scatter its gradients with
    gradsync (a :class:`ReduceScatter` each); returns how many it found. Call it after
    ``fully_shard`` and before the first backward."""
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(ReduceScatter(codec, error_feedback=error_feedback))
            count += 1
    if not count:
        raise ValueError("gradsync.fsdp.compress_reduce_scatter: no FSDP2 module (fully_shard) in the module")
    return count
