"""DDP communication hooks: gradsync's ring in place of DDP's all-reduce, one import away.

    from gradsync import hooks
    ddp.register_comm_hook(None, hooks.fp16_compress_hook)                    # default group
    ddp.register_comm_hook(group, hooks.bf16_compress_hook)                   # a ProcessGroup, as torch's hooks take
    ddp.register_comm_hook(hooks.GradSyncState(codec="fp8_e4m3", error_feedback=True), hooks.allreduce_hook)
    ddp.register_comm_hook(hooks.HierarchicalState(local_size=8), hooks.hierarchical_hook)  # nodes of 8 GPUs

Each hook hands the bucket to :func:`gradsync.all_reduce` asynchronously and returns its future at
once, so the bucket travels while autograd computes the gradients of earlier layers. The ring
encodes the bucket slice by slice as it sends (the fused scale-and-encode kernel), accumulates in
fp32 at every hop, and decodes the average back into the bucket; every rank ends with the same bits.

Unlike torch's fp16/bf16 hooks, which divide in 16 bit and sum in 16 bit at every hop, on the ring
a rank's own gradients are never rounded to the wire format before they are added: each hop adds
them in fp32 to the partial sum it received, and only that sum goes on the wire in the codec (the
direct exchange of small CPU buckets rounds each contribution once, then sums them in fp32). Inf
and NaN survive every codec, so ``torch.amp.GradScaler`` sees an overflow on any rank and skips the step everywhere.
"""
import os
import threading
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .distributed import (_ALL_GATHER, _ALL_REDUCE, _REDUCE_SCATTER, _all_gather_after, _check_backend, _check_flag,
                          _check_member, _check_nccl_device, _check_not_capturing, _check_residual, _check_scale,
                          _check_strided, _check_tensor, _issue, _issue_reduce_scatter, _refuse, _refused_on_error,
                          _resolve_group, _timeout_of, all_reduce, resolve_scales)
from .ops import _CODEC_IDS, _check_codec, _check_own_elements, _check_writable, _eager_under_compile

__all__ = ["GradSyncState", "HierarchicalState", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook",
           "fp8_compress_hook", "hierarchical_average", "hierarchical_hook"]


class GradSyncState:
    """What a gradsync hook needs besides the bucket.

    ``process_group``: the group to average over (None: the default group). ``codec``: the wire
    format of :func:`allreduce_hook` (the named hooks use their own). ``prescale`` / ``postscale``:
    see :func:`gradsync.distributed.resolve_scales` (default: the 1/n factor before the sum).

    ``error_feedback``: keep, per bucket, the fp32 residual of what this rank's encodings lost and
    add it to the next step's gradient, so that compression errors cancel over steps instead of
    accumulating in the weights. Residuals are keyed by the bucket's parameters: when DDP rebuilds
    its buckets after the first step, each parameter's residual moves with it into its new bucket.
    Under DDP's ``find_unused_parameters=True``, a parameter no rank used in a step loses the
    residual sent for it (DDP drops its slot), as with torch's PowerSGD; but where its gradient is
    that slot (``gradient_as_bucket_view``, gradients zeroed rather than set to None) the gradient
    holds the averaged residual, and the optimizer steps it. Residuals go with the state
    (and with their parameters): a new state for each run of a long-lived model keeps no old copy.

    A state can be saved with the training checkpoint (``torch.save``, pickle) and registered again
    after loading, as torch's ``PowerSGDState``. What is saved is its settings: residuals and the
    record of agreed buckets are keyed by this process's parameter objects, so a loaded state starts
    error feedback from zeros (as DeepSpeed's 1-bit Adam does on loading) and checks its buckets
    again. A process group cannot be saved: a state made for the default group (None or
    ``dist.group.WORLD``) loads with None; one made for another group raises when its hook runs
    until ``state.process_group`` is set again. On another group (``process_group`` set to another,
    or the default group made again after ``destroy_process_group``), a state checks its buckets
    again.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, codec: str = "fp16",
                 error_feedback: bool = False, prescale: Optional[float] = None,
                 postscale: Optional[float] = None):
        _check_codec(codec)
        self.process_group = process_group
        self.codec = codec
        self.error_feedback = _check_flag(error_feedback, "error_feedback")
        # checked here, not at the first backward; whether their product is right depends on the group's size
        self.prescale = None if prescale is None else _check_scale(prescale, "prescale")
        self.postscale = None if postscale is None else _check_scale(postscale, "postscale")
        self._residuals = {}  # parameter ids of a bucket -> (fp32 residual, [(param id, offset, numel)])
        # per model: the buckets every rank agreed on, keyed by the id of a parameter and dropped with it,
        # on the group _checked_on refers to (weakly)
        self._checked, self._checked_on = {}, None

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self._process_group

    @process_group.setter
    def process_group(self, group: Optional[dist.ProcessGroup]) -> None:
        _check_member(group, "process_group")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        self._process_group = group
        self._group_not_loaded = False

    def __getstate__(self):
        state = self.__dict__.copy()
        group = state.pop("_process_group")
        state["_group_not_loaded"] = self._group_not_loaded or not (group is None or group is dist.group.WORLD)
        state["_residuals"], state["_checked"], state["_checked_on"] = {}, {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._process_group = None
        self._checked_on = None  # absent from states saved before it

    def __deepcopy__(self, memo):
        """A copy in this process (``copy.deepcopy`` of a DDP model, ``AveragedModel``, which copy its
        hooks' states): the same settings and the same process group, a process-wide handle that is
        shared, not copied; residuals and the record of agreed buckets start afresh, as a loaded
        state's do (they belong to the original's parameters)."""
        copy = object.__new__(type(self))
        memo[id(self)] = copy
        copy.__dict__.update(self.__dict__)
        copy._residuals, copy._checked, copy._checked_on = {}, {}, None
        return copy

    def __copy__(self):
        return self.__deepcopy__({})

    def needs_check(self, bucket: dist.GradBucket, codec: str) -> bool:
        """Whether this bucket's next all-reduce should first verify that every rank agrees on it
        (numel, dtype, codec, scaling): until one such all-reduce has succeeded, and again whenever
        DDP's buckets change. Later steps skip the check, which costs a hop of latency per bucket
        (n-1 beyond 8 ranks and always over NCCL)."""
        params = bucket.parameters()
        return not params or self._check_key(bucket, codec) not in self._agreed().get(id(params[0]), ())

    def _agreed(self):
        """The record of agreed buckets on the group the state now resolves to: buckets agreed on
        another group (the state set to another, or the default group made again after
        ``destroy_process_group``, where a restarted peer has a fresh state) are checked again."""
        group = _resolve_group(self.process_group) if dist.is_initialized() else None
        if (self._checked_on() if self._checked_on is not None else None) is not group:
            self._checked, self._checked_on = {}, None if group is None else weakref.ref(group)
        return self._checked

    def _check_key(self, bucket, codec):
        buffer = bucket.buffer()
        return (tuple(id(p) for p in bucket.parameters()), buffer.numel(), buffer.dtype, codec, self.prescale,
                self.postscale)

    def _value_once_agreed(self, bucket, codec):
        """The future callback of a checked all-reduce: its value, the bucket recorded as agreed on
        first (a failed all-reduce raises here instead, and the next call checks again)."""
        params = bucket.parameters()
        key, anchor, param = self._check_key(bucket, codec), id(params[0]), weakref.ref(params[0])

        def value(fut):
            result = fut.value()
            if anchor not in self._checked and param() is not None:
                self._checked[anchor] = set()
                _drop_with(self, param(), "_checked", anchor)
            if anchor in self._checked:
                self._checked[anchor].add(key)
            return result
        return value

    def residual(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The fp32 residual of ``bucket`` (zeros for parameters never seen before)."""
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        entry = self._residuals.get(key)
        buffer = bucket.buffer()
        if entry is not None and entry[0].numel() == buffer.numel() and entry[0].device == buffer.device:
            return entry[0]
        layout, offset = [], 0
        for p in params:
            layout.append((id(p), offset, p.numel()))
            offset += p.numel()
        residual = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        if offset == buffer.numel():
            self._adopt(residual, layout)
        self._residuals[key] = (residual, layout)
        if params:  # dropped with the model, so that a later model reusing these ids starts clean
            _drop_with(self, params[0], "_residuals", key)
        return residual

    def _adopt(self, residual, layout):
        """Moves the residuals of this layout's parameters out of the buckets DDP has replaced."""
        wanted = {pid: offset for pid, offset, _ in layout}
        for key in list(self._residuals):
            old, old_layout = self._residuals[key]
            kept = []
            for pid, offset, numel in old_layout:
                if pid in wanted:
                    residual[wanted[pid]:wanted[pid] + numel].copy_(old[offset:offset + numel])
                else:
                    kept.append((pid, offset, numel))
            if not kept:
                del self._residuals[key]  # every parameter of that bucket has moved on
            elif len(kept) < len(old_layout):
                old_layout[:] = kept


# the state of hooks registered with None or a ProcessGroup, per group (None: the default group at
# the time): held weakly, so that a destroyed group, or the default group of an earlier
# init_process_group, takes its residuals and its record of agreed buckets with it
_default_states = weakref.WeakKeyDictionary()


def _check_dense(buffer):
    if buffer.layout != torch.strided:
        raise TypeError(f"gradsync's DDP hooks average dense gradients only, and this bucket is {buffer.layout} (e.g. "
                        "torch.nn.Embedding(..., sparse=True)): use sparse=False, or DDP without a hook")


# per state (by id: a state need not be hashable), the finalizers _drop_with set on parameters,
# detached when the state goes; the hook's callbacks add them on gradsync's thread too (reentrant:
# a collection inside _drop_with may finalize another state)
_finalizers_of = {}
_finalizers_lock = threading.RLock()


def _drop_with(state, param, table, key):
    """``state.<table>[key]`` dropped when ``param`` is collected. The finalizer goes with the state
    too: a new state for each run of a long-lived model leaves none behind on its parameters."""
    with _finalizers_lock:
        finalizers = _finalizers_of.get(id(state))
        if finalizers is None:
            finalizers = _finalizers_of[id(state)] = []
            weakref.finalize(state, _detach, id(state))
        finalizers[:] = [f for f in finalizers if f.alive]
        finalizers.append(weakref.finalize(param, _forget, weakref.ref(state), table, key))


def _detach(state_id):
    with _finalizers_lock:
        finalizers = _finalizers_of.pop(state_id, [])
    for finalizer in finalizers:
        finalizer.detach()


def _forget(state_ref, table, key):
    """Drops a state's entry for a model that is gone. The state is held weakly: a state dropped
    before its model frees its residuals at once."""
    state = state_ref()
    if state is not None:
        getattr(state, table).pop(key, None)


def _resolve_state(state):
    if state is None or isinstance(state, dist.ProcessGroup):
        group = _resolve_group(state)
        if group not in _default_states:  # its settings only: holding the group would keep it (and this entry) alive
            _default_states[group] = GradSyncState()
        return state, _default_states[group]
    if isinstance(state, HierarchicalState):  # its process group is the one across nodes only
        raise TypeError("a gradsync.hooks.HierarchicalState is the state of hierarchical_hook alone")
    if isinstance(state, GradSyncState):
        if state._group_not_loaded:
            raise RuntimeError("this GradSyncState was loaded from a checkpoint, which cannot hold the process group "
                               "it was made for (not the default group): set state.process_group to that group "
                               "before training")
        return state.process_group, state
    raise TypeError(f"the hook state must be None, a torch.distributed ProcessGroup or a gradsync.hooks.GradSyncState, "
                    f"got {type(state).__name__}")


def _check_bucket(bucket):
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(f"gradsync's DDP hooks take DDP's GradBucket, got {type(bucket).__name__}: torch.compile "
                        "with torch._dynamo.config.optimize_ddp='python_reducer' hands hooks one (grad, param) "
                        "tuple at a time, which gradsync's hooks do not take; keep optimize_ddp's default")


def _reduce_bucket(state, bucket: dist.GradBucket, codec: Optional[str]) -> torch.futures.Future[torch.Tensor]:
    group, options = _resolve_state(state)
    _check_bucket(bucket)
    codec = codec or options.codec
    buffer = bucket.buffer()
    check = options.needs_check(bucket, codec)
    with _refused_on_error(group, buffer, check, _ALL_REDUCE):  # this rank's turn all the same: its peers raise too
        _check_dense(buffer)
        reduced = _reducible(buffer, codec)
        residual = options.residual(bucket) if _check_flag(options.error_feedback, "state.error_feedback") else None
    work = all_reduce(reduced, codec=codec, group=group, prescale=options.prescale, postscale=options.postscale,
                      async_op=True, residual=residual, check_call=check)
    # DDP reads a hook's result as a Python object: a Python callback stores it as one
    agreed = check and bool(bucket.parameters())
    done = work.get_future().then(options._value_once_agreed(bucket, codec) if agreed else _value)
    return done if reduced is buffer else done.then(_copy_into(buffer))


def _value(fut):
    return fut.value()


def _reducible(buffer: torch.Tensor, codec: str) -> torch.Tensor:
    """The tensor a hook reduces: the bucket, or, for the float64 bucket of a float64 model, an fp32
    copy of it (gradsync's rings sum in fp32, and a compressing codec rounds far coarser than that)."""
    if buffer.dtype != torch.float64:
        return buffer
    if codec == "none":
        raise TypeError("gradsync's DDP hooks: the bucket is float64, and codec 'none' would reduce it in fp32, "
                        "gradsync's accumulation precision; use torch's own all-reduce (no hook) for float64 gradients "
                        "or pass a compressing codec")
    return buffer.float()


def _copy_into(buffer: torch.Tensor):
    def copy(fut):
        return buffer.copy_(fut.value())
    return copy


def allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket with gradsync's ring, on the wire codec of ``state`` (a
    :class:`GradSyncState`; None or a ProcessGroup mean codec "fp16").

    Example::
        >>> ddp_model.register_comm_hook(GradSyncState(codec="fp8_e4m3", error_feedback=True), allreduce_hook)
    """
    return _reduce_bucket(state, bucket, None)


def fp16_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket sending IEEE fp16 on the wire, summing in fp32 at every hop.

    A drop-in for torch's ``fp16_compress_hook``: the same state (None or a ProcessGroup, or a
    :class:`GradSyncState` for error feedback and scaling), the same registration.

    Example::
        >>> ddp_model.register_comm_hook(process_group, fp16_compress_hook)
    """
    return _reduce_bucket(state, bucket, "fp16")


def bf16_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket sending bfloat16 on the wire, summing in fp32 at every hop. Works on CPU
    over gloo too (torch's own bf16 hook needs CUDA and NCCL).

    Example::
        >>> ddp_model.register_comm_hook(process_group, bf16_compress_hook)
    """
    return _reduce_bucket(state, bucket, "bf16")


def fp8_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket sending block-scaled fp8 (e4m3, one power-of-two scale per 128 values:
    about a quarter of fp32's bytes), summing in fp32 at every hop. Pair it with error feedback::

        >>> ddp_model.register_comm_hook(GradSyncState(error_feedback=True), fp8_compress_hook)

    (the state's codec is ignored; for e5m2 use ``allreduce_hook`` with ``codec="fp8_e5m2"``).
    """
    return _reduce_bucket(state, bucket, "fp8_e4m3")


class HierarchicalState(GradSyncState):
    """The state of :func:`hierarchical_hook`: ``local_group``, the ranks of this rank's node, and
    ``cross_group``, the ranks at this rank's place on every node.

    Give ``local_size`` (ranks per node, default: torchrun's ``LOCAL_WORLD_SIZE``) and both groups
    are made here from the default group, each node being ``local_size`` consecutive ranks as
    torchrun numbers them; making groups is collective, so every rank constructs its state at the
    same point; ranks that disagree on ``local_size``, or one whose ``codec`` or ``error_feedback``
    is refused, raise on every rank, and the groups time out as the default group does. Or pass
    both groups, which are checked (collectively too, over the groups themselves: groups that
    differ between their ranks wait for their timeout): every rank of a cross group must hold the
    same place in a node of the same size, and every rank of a node see as many nodes; a
    ``local_size`` given with them must be the node's size. ``codec`` (default fp8 e4m3) and
    ``error_feedback`` apply to the all-reduce across nodes; the residual then has the shard's
    size, 1/``local_size`` of the bucket's (and starts from zeros again when DDP rebuilds its
    buckets after the first step). Unlike a :class:`GradSyncState` it cannot be saved (pickling
    raises TypeError): both of its groups are process groups; make a new one after loading a checkpoint.
    ``copy.deepcopy`` (of a DDP model that uses it, say) shares the groups. The groups it makes live
    until ``destroy_process_group``, as ``new_group``'s do: to make states again in one process,
    pass the first one's groups (or destroy them).
    """

    def __init__(self, local_size: Optional[int] = None, codec: str = "fp8_e4m3", error_feedback: bool = False, *,
                 local_group: Optional[dist.ProcessGroup] = None, cross_group: Optional[dist.ProcessGroup] = None):
        if (local_group is None) != (cross_group is None):
            raise ValueError("pass both local_group and cross_group, or neither (and local_size)")

        def check_arguments():  # before any exchange, with local_size's where the groups are made here
            _check_codec(codec)
            _check_flag(error_feedback, "error_feedback")

        if local_group is None:
            local_group, cross_group = _node_groups(local_size, check_arguments)
        else:
            check_arguments()
            _check_node_groups(local_group, cross_group, local_size)
        super().__init__(cross_group, codec, error_feedback)
        self.local_group, self.cross_group = local_group, cross_group
        self._shard_residuals = {}
        self.broken = None  # why a failed step left this state unusable

    def __getstate__(self):
        raise TypeError("a gradsync.hooks.HierarchicalState holds process groups, which cannot be saved: make a new "
                        "one after loading a checkpoint (every rank, as making it is collective)")

    def __deepcopy__(self, memo):  # as GradSyncState's: the groups shared, the residuals afresh
        copy = super().__deepcopy__(memo)
        copy._shard_residuals = {}
        return copy

    def shard_residual(self, bucket: dist.GradBucket, numel: int, device: torch.device) -> torch.Tensor:
        params = tuple(id(p) for p in bucket.parameters())
        key = (params, numel, device)
        residual = self._shard_residuals.get(key)
        if residual is None:
            # a rebuilt bucket's parameters leave their old one, whose residual is dropped with it
            for old in [k for k in self._shard_residuals if set(k[0]) & set(params)]:
                del self._shard_residuals[old]
            residual = self._shard_residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
            if bucket.parameters():  # dropped with the model
                _drop_with(self, bucket.parameters()[0], "_shard_residuals", key)
        return residual


def _node_groups(local_size, check_arguments=lambda: None):
    """(this rank's node group, this rank's group across the nodes), nodes of local_size consecutive
    ranks. Every rank's local_size, and whether ``check_arguments()`` (the state's other arguments)
    raised, are compared first, so that ranks that disagree (torchrun's LOCAL_WORLD_SIZE on nodes of
    different sizes, a typo on one rank) raise on every rank rather than make groups that never
    meet. The groups time out as the default group does."""
    from_env = local_size is None
    if from_env:
        local_size = os.environ.get("LOCAL_WORLD_SIZE")
    shown = local_size if local_size is None or isinstance(local_size, (int, str)) else repr(local_size)
    size = _ranks_per_node(local_size)
    try:
        check_arguments()
        refused = None
    except (TypeError, ValueError) as error:
        refused = error
    values = [None] * dist.get_world_size()
    why = None if refused is None else (type(refused) is TypeError, str(refused))
    dist.all_gather_object(values, (size, shown, why))
    if refused is not None:
        raise refused
    for peer, (_, _, why) in enumerate(values):
        if why is not None:  # raised as that rank's error was
            raise (TypeError if why[0] else ValueError)(f"HierarchicalState: rank {peer} refused its arguments "
                                                        f"({why[1]}), so no groups are made")
    if len({each if each is not None else ("not one", given) for each, given, _ in values}) > 1:
        source = "LOCAL_WORLD_SIZE" if from_env else "local_size"
        raise ValueError(f"the ranks disagree on {source} (ranks per node), rank by rank {[g for _, g, _ in values]}: "
                         "hierarchical sync needs nodes of one size, each of consecutive ranks; pass the same "
                         "local_size on every rank, or local_group and cross_group")
    if local_size is None:
        raise ValueError("HierarchicalState needs local_size (ranks per node): LOCAL_WORLD_SIZE is not set")
    if size is None:
        raise ValueError(f"local_size must be a positive integer, got {local_size!r}")
    local_size, world = size, dist.get_world_size()
    if world % local_size:
        raise ValueError(f"local_size {local_size} does not divide the world size {world}")
    rank = dist.get_rank()
    timeout = _timeout_of(dist.group.WORLD)
    nodes = [list(range(start, start + local_size)) for start in range(0, world, local_size)]
    places = [list(range(place, world, local_size)) for place in range(local_size)]
    # every rank makes every group
    local = [dist.new_group(ranks, timeout=timeout) for ranks in nodes][rank // local_size]
    cross = [dist.new_group(ranks, timeout=timeout) for ranks in places][rank % local_size]
    return local, cross


def _ranks_per_node(value):
    """``value`` as a positive int, or None where it is not one."""
    if isinstance(value, bool) or not str(value).isdecimal() or int(value) < 1:
        return None
    return int(value)


def _check_two_groups(local_group, cross_group):
    for group, name in ((local_group, "local_group"), (cross_group, "cross_group")):
        _check_member(group, name)
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{name} must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    if local_group is cross_group:
        raise ValueError("local_group and cross_group must be two groups, this rank's node and its place across the "
                         "nodes; got the same group for both")


def _check_node_groups(local_group, cross_group, local_size=None):
    """Every rank of the cross group holds the same place in a node of the same size: otherwise its
    shards would be different chunks of the buckets, and summed all the same. Groups that do not
    cover the default group average within parts of it: a warning, since DDP may run on a subgroup.
    The exchanges run on the given groups: groups that differ between their ranks (a node of other
    ranks on one of them) wait for the groups' timeout."""
    _check_two_groups(local_group, cross_group)
    if local_size is not None and _ranks_per_node(local_size) != local_group.size():
        raise ValueError(f"local_size {local_size!r} contradicts local_group, whose node has {local_group.size()} "
                         "ranks: pass local_size, or local_group and cross_group")
    mine = (local_group.rank(), local_group.size())
    places = [None] * cross_group.size()
    dist.all_gather_object(places, mine, group=cross_group)
    # a node's ranks see the same number of nodes: otherwise one whose cross group is itself alone
    # (nodes of 2 and 1 ranks) passed the check above, and its peers raised without it
    nodes = [None] * local_group.size()
    dist.all_gather_object(nodes, cross_group.size(), group=local_group)
    if any(place != mine for place in places):
        raise ValueError(f"the cross group's ranks must hold the same place in nodes of one size, got (place, node "
                         f"size) {places}")
    if len(set(nodes)) > 1:
        raise ValueError(f"the node's ranks must see the same number of nodes (their cross groups' sizes), got "
                         f"{nodes}: hierarchical sync needs nodes of one size")
    covered, world = local_group.size() * cross_group.size(), dist.get_world_size()
    if covered != world:
        warnings.warn(f"HierarchicalState: its groups average over {local_group.size()} x {cross_group.size()} = "
                      f"{covered} ranks, and the default group has {world}: a DDP model on the default group would "
                      "be averaged within parts of it only, which then drift apart", stacklevel=3)


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket in three steps, as Horovod's hierarchical all-reduce does: the node's
    ranks reduce-scatter it with gradsync's ring in the bucket's own dtype (codec "none", fp32
    sums), each shard is all-reduced across the nodes by gradsync's ring on the state's codec
    (1/``local_size`` of the bucket per rank, every rank on its own link), and the node's ranks
    all-gather the shards with gradsync's ring. Every rank ends with the same bits.

    Against gradsync's flat ring over all n ranks: only the c-1 hops between nodes (c nodes) round
    to the codec, not n-1 (one node rounds nothing), and the host issues 2(c-1) hops per slice
    across nodes instead of 2(n-1) — the flat GPU ring's limit past a few nodes
    (``python -m gradsync.model``). The bytes
    each link carries are those of NCCL's own multi-node rings, less the codec's saving. The three
    steps are issued at once, in bucket order, each waiting on gradsync's threads for the one before,
    so every rank runs them in the same order; they travel through gradsync's own transport, never
    among torch's collectives, so the groups may carry others too (DDP's own, the training loop's).

    A step that fails (ranks that disagree on the call, a transport failure) fails the bucket's
    future and leaves the state unusable: its later calls raise. Where the step's calls are checked
    (a bucket's first step), a call that fails at or before its check fails on every rank at once;
    otherwise, and for a transport failure, the peers fail at their group's timeout.

    Example::
        >>> ddp_model.register_comm_hook(HierarchicalState(local_size=8, error_feedback=True), hierarchical_hook)
    """
    if not isinstance(state, HierarchicalState):
        raise TypeError(f"hierarchical_hook takes a gradsync.hooks.HierarchicalState, got {type(state).__name__}")
    _check_bucket(bucket)
    buffer = bucket.buffer()
    check = state.needs_check(bucket, state.codec)
    try:
        # read when DDP calls the hook: a peer whose failed step was not yet known here makes the calls
        if state.broken:
            raise RuntimeError(f"gradsync.hooks.hierarchical_hook: an earlier step failed ({state.broken}); this "
                               "state's groups may hold collectives its peers still wait in")
        _check_dense(buffer)
        reduced = _reducible(buffer, state.codec)
        shard_numel = -(-buffer.numel() // state.local_group.size())
        feedback = _check_flag(state.error_feedback, "state.error_feedback")
        residual = state.shard_residual(bucket, shard_numel, buffer.device) if feedback else None
    except Exception as error:  # this rank's turns in the step's three calls, which its peers may make
        for group, op in _hierarchical_calls(state.local_group, state.cross_group):
            _refuse(group, buffer, check, op, error)
        raise
    done = hierarchical_average(reduced, state.local_group, state.cross_group, state.codec, check, residual)
    if reduced is not buffer:
        done = done.then(_copy_into(buffer))

    def failed(fut):
        try:
            return fut.value()
        except Exception as e:
            state.broken = str(e)
            raise
    done = done.then(failed)
    return done.then(state._value_once_agreed(bucket, state.codec)) if check and bucket.parameters() else done


def _takes_turns(group):
    """Whether a refusal can take this rank's turn on ``group`` (one it was given that it is in)."""
    return isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.NON_GROUP_MEMBER


def _hierarchical_calls(local_group, cross_group):
    """The groups and operations of a hierarchical step's calls, in the order they are issued."""
    return [(local_group, _REDUCE_SCATTER), (cross_group, _ALL_REDUCE), (local_group, _ALL_GATHER)]


@_eager_under_compile
def hierarchical_average(tensor: torch.Tensor, local_group: dist.ProcessGroup, cross_group: dist.ProcessGroup,
                         codec: str, check_call: bool = True, residual: Optional[torch.Tensor] = None
                         ) -> torch.futures.Future[torch.Tensor]:
    """:func:`hierarchical_hook`'s average of a tensor of any shape, in place (a strided one through a
    contiguous copy); returns a future of it at once. ``residual``: error feedback of the all-reduce
    across the nodes, a float32 tensor of ceil(numel / local_group.size()) elements. Its three calls
    (:func:`gradsync.reduce_scatter` in the node, :func:`gradsync.all_reduce` across the nodes,
    :func:`gradsync.all_gather` in the node) are issued here and run on gradsync's threads, each
    after the one before: calls of the caller's own on these groups queue behind them."""
    # a call this rank does not make is still its turn on that group (refused), so that the peers
    # raise, naming it, instead of waiting for it until the group's timeout
    unissued = _hierarchical_calls(local_group, cross_group)
    try:
        _check_two_groups(local_group, cross_group)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"hierarchical_average: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        _check_codec(codec)
        check_call = _check_flag(check_call, "check_call")
        _check_strided(tensor, "tensor", "hooks.hierarchical_average")
        _check_writable(tensor, "tensor")  # written in place, behind autograd's back
        _check_own_elements(tensor, "tensor")
        per_node = local_group.size()
        shard_numel = -(-tensor.numel() // per_node)
        flat = tensor.contiguous().view(-1)  # the shards are chunks of its elements (of a copy where it is strided)
        padded = flat if shard_numel * per_node == flat.numel() else \
            torch.cat([flat, flat.new_zeros(shard_numel * per_node - flat.numel())])
        # memory of its own, copied into the tensor by the all-gather once the ranks agree on it: a step
        # that fails before leaves the tensor as it was
        shard = tensor.new_empty(shard_numel)
        _check_tensor(padded, "tensor", "hierarchical_average")
        if residual is not None:
            _check_residual(residual, shard, padded, numel_means="ceil(tensor.numel() / local_group.size()) = "
                                                                 f"ceil({tensor.numel()} / {per_node})")
        inference = torch.is_inference_mode_enabled()  # the copies made here are inference tensors too
        for group in (local_group, cross_group):
            _check_backend(shard, "tensor", group)
            _check_nccl_device(shard, group)
        _check_not_capturing(shard, "hierarchical_average")
        made_here = [shard] + ([flat] if not tensor.is_contiguous() else []) + ([padded] if padded is not flat else [])
        # the node's ranks must agree on the codec across the nodes too: each cross group holds one
        # place of every node, so a node whose ranks differ would pass the cross groups' checks
        scattered = _issue_reduce_scatter(shard, padded, "none", local_group, *resolve_scales("avg", per_node),
                                          check_call, None, layout=_CODEC_IDS[codec] + 1)
        del unissued[0]
        # one node: nothing crosses a node, so nothing is rounded to the codec
        across = _issue(shard, codec if cross_group.size() > 1 else "none", cross_group,
                        *resolve_scales("avg", cross_group.size()), check_call, residual, after=scattered)
        del unissued[0]
        gathered = _all_gather_after(padded, shard, "none", local_group, check_call, after=across)
        del unissued[0]
    except Exception as error:
        for group, op in unissued:
            if _takes_turns(group) and not (op == _ALL_REDUCE and group is local_group):
                _refuse(group, tensor, check_call, op, error)
        raise

    def copy_back(fut):  # on gradsync's thread of the node's group, which has none of the caller's modes
        fut.value()  # raises the failed step's error, if any
        with torch.inference_mode() if inference else torch.no_grad():
            if padded is not flat:
                flat.copy_(padded[:flat.numel()])
            if not tensor.is_contiguous():
                tensor.copy_(flat.view(tensor.shape))
        if tensor.is_cuda:  # allocated on the caller's stream, last used on this one
            stream = torch.cuda.current_stream(tensor.device)
            for made in made_here:
                made.record_stream(stream)
        return tensor

    return gathered.get_future().then(copy_back)


# DDP.register_comm_hook refuses any hook whose __name__ is "bf16_compress_hook" unless CUDA and
# NCCL are present, a check meant for torch's own hook; gradsync's runs on any group.
bf16_compress_hook.__name__ = "gradsync_bf16_compress_hook"
