"""FSDP2 (``torch.distributed.fsdp.fully_shard``): gradsync's ring as the gradient reduce-scatter,
and as the all-reduce across replicas of a hybrid-sharded model.

    from gradsync import fsdp
    model = fully_shard(model)                        # and its submodules, as usual
    fsdp.compress_reduce_scatter(model, codec="bf16")  # every FSDP module in model

FSDP2 reduce-scatters gradients with the process group's own collective in its ``reduce_dtype``
(``MixedPrecisionPolicy``): in bf16, NCCL rounds every partial sum to bf16. With gradsync the wire
carries ``codec`` while every hop sums in fp32, whatever ``reduce_dtype`` is (float32, float16 or
bfloat16; a float64 model reduces with ``reduce_dtype=torch.float32``); fp16 and the
block-scaled fp8 codecs become possible too. Built on FSDP2's ``set_custom_reduce_scatter``, a
private part of torch (``torch.distributed.fsdp._fully_shard._fsdp_api``).

Hybrid sharding (shard within a node, replicate across nodes) spends its slow link on the
all-reduce of each gradient shard across the replicas. Shard over the node's ranks alone and let
gradsync make that all-reduce, compressed (FSDP2's ``set_all_reduce_hook``; finding the FSDP
modules' parameter groups reads FSDP2's private state too):

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(model, mesh=mesh["shard"])    # and its submodules, on the same 1-D mesh
    fsdp.compress_replica_all_reduce(model, mesh["replicate"].get_group(), codec="fp8_e4m3",
                                     error_feedback=True)
"""
import warnings
import zlib

import torch
import torch.distributed as dist

from .distributed import _ForgetResidualsOnLoad, _all_reduce, _check_flag, _op_factor, _reduce_scatter
from .ops import FLOAT_DTYPES, _check_codec, _eager_under_compile

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterComm
except ImportError:  # a torch without FSDP2's custom reduce-scatter
    _ReduceScatterComm = object

__all__ = ["ReduceScatter", "ReplicaAllReduce", "compress_reduce_scatter", "compress_replica_all_reduce"]


class ReduceScatter(_ReduceScatterComm):
    """An FSDP2 reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) through gradsync's ring,
    on the wire ``codec``, summing in fp32. It takes each op FSDP2 asks for: an average, a sum, and
    after ``set_gradient_divide_factor(f)`` the pre-multiplied sum ``ReduceOp.PREMUL_SUM(1 / f)``
    (the factor applied to each rank's part before it is encoded, as gradsync's average applies
    1/n). The factor may change from step to step (a token count, say): error feedback's residual
    carries over, paid back in the gradients' units, and the factor is checked across the ranks
    with a layout's first call only, or every call once the module has had two layouts (give
    every rank the same one).

    Each call's layout is checked across the ranks the first time it is seen (as gradsync's DDP
    hooks check each bucket once), and every call once there have been several layouts (a layout
    that depends on each rank's batch). A layout is the buffer's size and, once
    :func:`compress_reduce_scatter` has told the instance the module's parameters, which of them the
    buffer holds: two ranks that routed their batches to different experts of one size raise.
    ``error_feedback``: keep, per layout, the fp32 residual of what this rank's encodings lost and
    add it to the next step's gradients (see
    :func:`gradsync.all_reduce`); give each FSDP module an instance of its own, and make FSDP2
    reduce-scatter every parameter in every step (``set_reduce_scatter_unused_params(True)``), as
    :func:`compress_reduce_scatter` does: FSDP2 otherwise leaves out the parameters that got no
    gradient, and a step that uses others of the same total size (another expert) would take their
    residual. It leaves out frozen parameters all the same: :func:`compress_reduce_scatter` also tells
    the instance the module's parameters, so that a residual is kept per layout and set of
    parameters requiring gradients (an instance made by hand knows them not). The residual has the
    unsharded gradients' size: an fp32 copy of the module's gradients on every rank, which sharding
    otherwise avoids.

    FSDP2 calls a custom reduce-scatter synchronously, and gradsync's completes on the host: on a
    GPU, each module's backward waits for the previous module's reduce-scatter to finish instead
    of overlapping it (torch's own is only ordered on FSDP2's stream). Not measured on a GPU yet.
    """

    def __init__(self, codec: str = "bf16", *, error_feedback: bool = False):
        if _ReduceScatterComm is object:
            raise ImportError("gradsync.fsdp needs a torch whose FSDP2 has custom reduce-scatters "
                              "(FSDPModule.set_custom_reduce_scatter and its ReduceScatter; torch 2.11 and later)")
        _check_codec(codec)
        self.codec = codec
        self.error_feedback = _check_flag(error_feedback, "error_feedback")
        self._layouts = {}  # per group: the layouts checked there
        self._residuals = {}
        self._param_groups = ()  # the module's, set by compress_reduce_scatter: which residual a call takes

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _forget_residuals(self, written):  # a residual spans the module's parameters
        self._residuals.clear()

    def _watched_parameters(self, module):
        return _own_parameters(self)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        try:
            _op_factor(op, group.size())
        except (ValueError, AttributeError, RuntimeError):
            raise ValueError(f"gradsync.fsdp.ReduceScatter averages or sums (pre-multiplied or not), not {op!r}")
        _check_reduce_dtype(input_tensor.dtype, "ReduceScatter")
        layout = _layout(self._param_groups)
        # not the factor: one that changes every step (a token count) would make a layout, and a
        # residual, per step. The residual is paid back in the gradients' units, whatever the factor.
        key = (input_tensor.numel(), input_tensor.dtype, input_tensor.device, layout)
        residual = None
        if self.error_feedback:
            held = key + (_trainable(self._param_groups),)
            residual = self._residuals.get(held)
            if residual is None:
                residual = self._residuals[held] = torch.zeros(input_tensor.numel(), dtype=torch.float32,
                                                               device=input_tensor.device)
        layouts = self._layouts.setdefault(group, _Layouts())  # a separate reduce-scatter group checks its own
        work = _reduce_scatter(output_tensor, input_tensor, op=op, codec=self.codec, group=group, prescale=None,
                               postscale=None, async_op=True, check_call=layouts.needs_check(key), residual=residual,
                               layout=layout)
        if async_op:  # checked again next time: whether this one succeeded is known at its wait()
            return work
        work.wait()
        layouts.add(key)
        return None


class ReplicaAllReduce:
    """FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``) through gradsync: each gradient
    shard, once reduce-scattered over the module's (1-D) mesh, is all-reduced in place across
    ``group``, the ranks that hold the same shard (one per replica), on the wire ``codec`` and
    summing in fp32. ``op`` as for :func:`gradsync.all_reduce`: "avg" completes FSDP2's average over
    the shard group to one over every rank; with ``set_gradient_divide_factor(f)``, whose factor
    then covers every rank as in FSDP2's own hybrid sharding, pass "sum".

    FSDP2 calls the hook after every reduce-scatter: ``set_requires_all_reduce(False)``, which
    defers native hybrid sharding's all-reduce during gradient accumulation, has no effect here
    (each micro-batch's shard is all-reduced; the sums are the same); to communicate nothing until
    the last micro-batch, use ``set_requires_gradient_sync(False)``.

    Each shard's layout is checked across the replicas as :class:`ReduceScatter` checks its calls; that ``group``
    holds one rank per replica of the same shard is checked by :func:`compress_replica_all_reduce`.
    ``error_feedback``: keep, per layout, the fp32 residual of what this rank's encodings lost (see
    :func:`gradsync.all_reduce`): it has the shard's size, not the model's; as for
    :class:`ReduceScatter`, FSDP2 must then reduce-scatter every parameter in every step. Like
    :class:`ReduceScatter`, it completes on the host before the hook returns.
    """

    def __init__(self, group: dist.ProcessGroup, codec: str = "bf16", *, op="avg", error_feedback: bool = False):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"gradsync.fsdp.ReplicaAllReduce: group must be the replicas' ProcessGroup "
                            f"(mesh[\"replicate\"].get_group()), got {type(group).__name__}")
        _check_codec(codec)
        _op_factor(op, 1)  # an op all_reduce takes
        self.group, self.codec, self.op = group, codec, op
        self.error_feedback = _check_flag(error_feedback, "error_feedback")
        self._layouts = _Layouts()
        self._residuals = {}
        self._param_groups = ()  # set by compress_replica_all_reduce, as for ReduceScatter

    def _forget_residuals(self, written):  # a residual spans the module's parameters
        self._residuals.clear()

    def _watched_parameters(self, module):
        return _own_parameters(self)

    def __call__(self, shard: torch.Tensor) -> None:
        _check_reduce_dtype(shard.dtype, "ReplicaAllReduce")
        layout = _layout(self._param_groups)
        key = (shard.numel(), shard.dtype, shard.device, layout)
        residual = None
        if self.error_feedback:
            held = key + (_trainable(self._param_groups),)
            residual = self._residuals.get(held)
            if residual is None:
                residual = self._residuals[held] = torch.zeros(shard.numel(), dtype=torch.float32, device=shard.device)
        _all_reduce(shard, op=self.op, codec=self.codec, group=self.group, prescale=None, postscale=None,
                    async_op=False, check_call=self._layouts.needs_check(key), residual=residual, layout=layout)
        self._layouts.add(key)


class _Layouts:
    """The layouts a module's calls on one group had. A new one is checked across the ranks; the one
    every call has had is not again. Once there have been several, every call is checked: without
    error feedback FSDP2 leaves out the parameters that got no gradient, so a call's layout depends
    on each rank's batch, and two ranks can each bring a layout they know. Each successful call adds
    the same layout on every rank (it was checked, or the one known everywhere), so the ranks agree
    on whether to check."""

    def __init__(self):
        self._seen = set()

    def needs_check(self, key) -> bool:
        return key not in self._seen or len(self._seen) > 1

    def add(self, key) -> None:
        self._seen.add(key)


def _own_parameters(hook):
    """The sharded parameters of the hook's module's parameter groups: what a load restarts its
    residuals for (not a submodule's, which has hooks of its own; and after a forward that left them
    unsharded, FSDP2 puts these back in the module before they load)."""
    return [fp.sharded_param for g in hook._param_groups for fp in getattr(g, "fsdp_params", ())]


def _check_reduce_dtype(dtype, caller):
    """Raised on every rank alike before any exchange: FSDP2's reduce dtype is the same everywhere."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"gradsync.fsdp.{caller}: FSDP2 reduces this module's gradients in {dtype}, and gradsync "
                        "takes float32, float16 or bfloat16: give fully_shard mp_policy=MixedPrecisionPolicy("
                        "reduce_dtype=torch.float32) (gradsync sums in fp32 whatever the dtype)")


def _check_reduce_dtypes(found, caller):
    """Checks what FSDP2 will reduce each trainable parameter's gradient in (torch 2.15 reduces a
    group in their promoted dtype, which is float64 where any of them is)."""
    for _, groups in found:
        for g in groups:
            for fp in getattr(g, "fsdp_params", ()):
                if fp.sharded_param.requires_grad:
                    _check_reduce_dtype(_reduce_dtype_of(fp, getattr(fp, "mp_policy", None) or
                                                         getattr(g, "mp_policy", None)), caller)


def _reduce_dtype_of(fp, policy):
    """The MixedPrecisionPolicy's reduce_dtype, else the dtype the gradient was computed in (its
    param_dtype, else the parameter's own), or under torch 2.15 the parameter's grad_dtype, to
    which its FSDP2 reduces the gradients (a grad_dtype of None: as computed; none set: the
    parameter's dtype)."""
    param = fp.sharded_param
    if getattr(policy, "reduce_dtype", None) is not None:
        return policy.reduce_dtype
    computed = getattr(policy, "param_dtype", None) or param.dtype
    if not hasattr(type(fp), "unsharded_grad_dtype"):  # torch 2.14 and before
        return computed
    if getattr(param, "_has_grad_dtype_override", False):
        grad_dtype = param.grad_dtype
    elif getattr(fp, "_has_sharded_grad_dtype_override", False):
        grad_dtype = fp.sharded_grad_dtype
    else:
        grad_dtype = param.dtype
    return grad_dtype or computed


def _trainable(param_groups):
    """Which of the module's parameters require gradients now: with the call's size, which residual
    a call takes. Under error feedback every parameter is reduce-scattered in every step, but FSDP2
    leaves out the frozen ones: after one layer is frozen and another of its size unfrozen (a
    fine-tuning schedule), the same size would otherwise take the first layer's residual. (Read at
    each call: loading a state dict with assign=True gives FSDP2 new parameters.) Where the module's
    parameters are known, the layout the ranks check (which parameters were reduced) tells them
    apart too; a rank alone whose flags differ then brings a layout of its own, which it alone may
    check (it fails at the group's timeout), rather than sum other parameters into its own."""
    return tuple(fp.sharded_param.requires_grad for g in param_groups for fp in getattr(g, "fsdp_params", ()))


def _note_reduced_parameters(param_groups):
    """Makes each parameter group note, as its ``post_backward`` begins, which of its parameters that
    ``post_backward`` reduce-scatters, deciding as it does: those with a gradient (accumulated or
    not) and, under ``set_reduce_scatter_unused_params``, every one requiring it. Without error
    feedback that depends on each rank's batch (the experts a rank routed to), and buffers of the
    same size can hold different parameters: the calls' records carry it (see :func:`_layout`)."""
    for g in param_groups:
        if "_gradsync_reduced" not in g.__dict__:
            g._gradsync_reduced = None
            g.post_backward = _NotingPostBackward(g, g.post_backward)


class _NotingPostBackward:
    """A parameter group's ``post_backward`` that first notes which parameters it reduces. An object
    rather than a closure: copies and pickles of the group take it, bound to the copy."""

    def __init__(self, group, post_backward):
        self.group, self.post_backward = group, post_backward

    @_eager_under_compile  # as FSDP2's own post_backward, which Dynamo does not trace
    def __call__(self, *args):
        group = self.group
        group._gradsync_reduced = tuple(_reduced(group, fp) for fp in getattr(group, "fsdp_params", ()))
        if getattr(group, "reduce_grads", False):
            _accumulate_in_one_dtype(group)
        return self.post_backward(*args)


def _accumulate_in_one_dtype(group):
    """FSDP2 reduces a group's gradients in one buffer and asserts that they share a dtype, but
    after micro-batches without gradient sync (``set_requires_gradient_sync(False)``) the gradients
    of those are accumulated in the reduce dtype, while a parameter first used in the last one, or
    the zeros of one unused under ``set_reduce_scatter_unused_params`` (error feedback), are in the
    parameter's dtype (``param_dtype``): those become accumulated gradients of the others' dtype."""
    fsdp_params = [fp for fp in getattr(group, "fsdp_params", ()) if hasattr(fp, "_unsharded_param")]
    accumulated = [fp.unsharded_accumulated_grad for fp in fsdp_params
                   if getattr(fp, "unsharded_accumulated_grad", None) is not None]
    if not accumulated:
        return
    dtype = accumulated[0].dtype
    for fp in fsdp_params:
        param = fp.unsharded_param
        if fp.unsharded_accumulated_grad is not None or param.dtype == dtype:
            continue
        if param.grad is not None:
            fp.unsharded_accumulated_grad, param.grad = param.grad.to(dtype), None
        elif getattr(group, "reduce_scatter_unused_params", False) and param.requires_grad:
            fp.unsharded_accumulated_grad = torch.zeros_like(param, dtype=dtype)


def _reduced(group, fsdp_param):
    if not hasattr(fsdp_param, "_unsharded_param"):
        return False
    param = fsdp_param.unsharded_param
    return (getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None or param.grad is not None or
            (bool(getattr(group, "reduce_scatter_unused_params", False)) and param.requires_grad))


def _layout(param_groups):
    """The fingerprint of which parameters a call's buffer holds (``RingCall::layout``), as the
    groups' last ``post_backward`` noted; 0 where that is not known (an instance made by hand)."""
    noted = tuple(getattr(g, "_gradsync_reduced", None) for g in param_groups)
    if not noted or any(n is None for n in noted):
        return 0
    return zlib.crc32(repr(noted).encode()) % 0x7FFFFFFF + 1


def _fsdp_modules(module: torch.nn.Module, caller: str):
    """The FSDP2 modules in ``module`` (itself included) that manage parameters."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"gradsync.fsdp.{caller}: module must be a torch.nn.Module, got {type(module).__name__}")
    found = []
    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch releases with one parameter group per module
                groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
            if len(groups) > 1:  # refused before any module is changed (FSDP2's setters would raise midway)
                raise ValueError(f"gradsync.fsdp.{caller}: FSDP module {name or '(the module itself)'!r} has "
                                 f"{len(groups)} parameter groups (a per-parameter mesh from shard_placement_fn), "
                                 "which FSDP2 cannot give one custom reduce-scatter or all-reduce hook")
            if groups:
                found.append((m, groups))
    if not found:
        raise ValueError(f"gradsync.fsdp.{caller}: no FSDP2 module (fully_shard) with parameters in the module")
    return found


def _all_reduces_replicas(param_group):
    """Whether FSDP2 all-reduces this parameter group across replicas itself (HSDP, replicate)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo
    except ImportError:  # torch releases without FSDP2's replicate
        return bool(getattr(param_group, "_is_hsdp", False))
    return isinstance(param_group.mesh_info, DDPMeshInfo)


def _reduce_every_parameter(found, caller, error_feedback):
    """Error feedback keeps a residual per layout: FSDP2 must reduce-scatter every parameter in every
    step, zeros for those without a gradient, so that a layout is always the same parameters. Once
    neither gradsync's reduce-scatter nor its replica all-reduce of a module keeps a residual, the
    module gets back the setting it had."""
    if error_feedback and not all(hasattr(m, "set_reduce_scatter_unused_params") for m, _ in found):
        raise ValueError(f"gradsync.fsdp.{caller}: error_feedback needs FSDP2 to reduce-scatter every parameter "
                         "in every step (FSDPModule.set_reduce_scatter_unused_params), which this torch lacks")
    for m, groups in found:
        feedback = m.__dict__.setdefault("_gradsync_feedback", {})  # caller -> whether its hooks keep residuals
        feedback[caller] = error_feedback
        if any(feedback.values()):
            if "_gradsync_unused_params_found" not in m.__dict__:
                m._gradsync_unused_params_found = [getattr(g, "reduce_scatter_unused_params", False) for g in groups]
            m.set_reduce_scatter_unused_params(True, recurse=False)
        elif "_gradsync_unused_params_found" in m.__dict__:
            for g, value in zip(groups, m.__dict__.pop("_gradsync_unused_params_found")):
                g.reduce_scatter_unused_params = value


def _forget_residuals_on_load(module, caller, hook):
    """A checkpoint loaded into ``module`` (``load_state_dict``, DCP's ``set_state_dict``) starts the
    residuals of its ``caller`` hook afresh, as a new process would, if it wrote a parameter; a hook
    set again replaces this."""
    handles = module.__dict__.setdefault("_gradsync_on_load", {})
    for handle in handles.pop(caller, []):
        handle.remove()
    handles[caller] = _ForgetResidualsOnLoad(hook).register(module)


def _check_replica_group(found, group):
    """Every rank of ``group`` holds the same place in a shard group of the same size, for every
    module: otherwise it would sum different shards. Collective over ``group``."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"gradsync.fsdp.compress_replica_all_reduce: group must be the replicas' ProcessGroup "
                        f"(mesh[\"replicate\"].get_group()), got {type(group).__name__}")
    mine = [(getattr(g.mesh_info, "shard_mesh_rank", None), getattr(g.mesh_info, "shard_mesh_size", None))
            for _, groups in found for g in groups]
    places = [None] * group.size()
    dist.all_gather_object(places, mine, group=group)
    if group.size() == 1 and any(size is not None and size < dist.get_world_size() for _, size in mine):
        warnings.warn("gradsync.fsdp.compress_replica_all_reduce: the group has one rank, so nothing is all-reduced "
                      "across replicas; pass the replicas' group (mesh[\"replicate\"].get_group()), not the shard "
                      "group of a mesh whose shards have one rank", stacklevel=3)
    if any(place != mine for place in places):
        raise ValueError("gradsync.fsdp.compress_replica_all_reduce: the group's ranks must hold the same shard, one "
                         "per replica (mesh[\"replicate\"].get_group()), but their (place, size) in the shard group "
                         f"of each parameter group differ: {places}")


def compress_reduce_scatter(module: torch.nn.Module, codec: str = "bf16", *, error_feedback: bool = False) -> int:
    """Makes every FSDP2 module in ``module`` (itself included) reduce-scatter its gradients with
    gradsync (a :class:`ReduceScatter` each); returns how many it found (those that manage
    parameters). With ``error_feedback`` it also makes them reduce-scatter every parameter in every
    step (``set_reduce_scatter_unused_params(True)``; see :class:`ReduceScatter`). Call it after
    ``fully_shard`` and before the first backward."""
    found = _fsdp_modules(module, "compress_reduce_scatter")
    _check_reduce_dtypes(found, "compress_reduce_scatter")
    comms = [ReduceScatter(codec, error_feedback=error_feedback) for _ in found]  # bad arguments change nothing
    _reduce_every_parameter(found, "compress_reduce_scatter", comms[0].error_feedback)
    for (m, groups), comm in zip(found, comms):
        _note_reduced_parameters(groups)
        comm._param_groups = groups
        m.set_custom_reduce_scatter(comm)
        _forget_residuals_on_load(m, "compress_reduce_scatter", comm)
    return len(found)


def compress_replica_all_reduce(module: torch.nn.Module, group: dist.ProcessGroup, codec: str = "bf16", *,
                                op="avg", error_feedback: bool = False) -> int:
    """Makes every FSDP2 module in ``module`` (itself included) all-reduce its gradient shards across
    ``group`` with gradsync after each reduce-scatter (a :class:`ReplicaAllReduce` each, as FSDP2's
    all-reduce hook): hybrid sharding whose cross-replica all-reduce sends ``codec``. Shard the
    modules over a 1-D mesh of the ranks that share a replica (``mesh["shard"]``); a module sharded
    over a 2-D mesh already all-reduces across replicas itself, and raises. ``group`` must hold one
    rank per replica of the same shard: checked here, collectively over ``group`` (a ValueError
    otherwise, as for the shard group; ``None`` raises TypeError). With ``error_feedback`` it also
    makes the modules reduce-scatter every parameter in every step (see :class:`ReduceScatter`).
    Returns how many modules it found (those that manage parameters). Call it on every rank after
    ``fully_shard`` and before the first backward."""
    found = _fsdp_modules(module, "compress_replica_all_reduce")
    _check_reduce_dtypes(found, "compress_replica_all_reduce")
    for m, groups in found:
        if any(_all_reduces_replicas(g) for g in groups):
            raise ValueError("gradsync.fsdp.compress_replica_all_reduce: a module is sharded over a 2-D mesh (or "
                             "replicated), whose replicas FSDP2 all-reduces itself; shard over the 1-D mesh of one "
                             "replica (mesh[\"shard\"]) and pass the replicas' group (mesh[\"replicate\"].get_group())")
    hooks = [ReplicaAllReduce(group, codec, op=op, error_feedback=error_feedback) for _ in found]
    _check_replica_group(found, group)
    _reduce_every_parameter(found, "compress_replica_all_reduce", hooks[0].error_feedback)
    for (m, groups), hook in zip(found, hooks):
        _note_reduced_parameters(groups)
        hook._param_groups = groups
        m.set_all_reduce_hook(hook)
        _forget_residuals_on_load(m, "compress_replica_all_reduce", hook)
    return len(found)
