"""gradsync.all_reduce: a ring all-reduce with a compressed wire and fp32 accumulation.

Each hop decodes what it receives, adds the local contribution in fp32 and re-encodes; the fully
reduced chunk is encoded once and every rank decodes the same bytes, so the result is bitwise
identical on every rank (small CPU buffers take one direct exchange instead: DIRECT_BYTES). It runs
over any torch.distributed process group: CUDA tensors of an NCCL group
travel over gradsync's own NCCL communicator, made once per group; CPU tensors (gloo), and CUDA
tensors of a non-NCCL group through pinned host memory, over the group's own send/recv.
"""
import atexit
import contextlib
import datetime
import math
import numbers
import os
import struct
import sys
import threading
import warnings
import weakref
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import _C
from .ops import FLOAT_DTYPES, _CODEC_IDS, _check_codec, _check_memory, _check_writable, _eager_under_compile

OPS = ("avg", "sum")
SLICE_BYTES = 1 << 20
"""The largest slice on the wire, the unit of pipelining: the ring aims at eight slices per chunk, between
a quarter of this and this (smaller slices drown in per-message cost)."""
NCCL_SLICE_BYTES = 128 << 20
"""The same over NCCL, where the host issues every hop (an NCCL group, events, a kernel launch: tens of
microseconds) while a GPU moves a slice of 1 MB in a few: so slices of 32 to 128 MB, which leaves one
slice per chunk below 32 MB. What slicing would hide there is only the per-hop kernel, several times
faster than the link (gradsync.model chooses this value; see README, "Where it pays")."""

DIRECT_BYTES = 64 << 10
"""Payloads up to this size (per rank, on the wire) skip the ring in groups of up to 8 ranks, for CPU
tensors: every rank sends its encoded contribution to every other at once and sums all of them in rank
order in fp32. That is one hop of latency instead of the ring's 2(n-1), for (n-1) payloads sent instead
of 2(n-1)/n, a trade that pays while a payload crosses the link faster than a few hops' latency."""

EXIT_RELEASE_S = 5.0
"""How long the exit waits, in all, for the teardowns of the groups gradsync let go of (those
torch.distributed destroyed before :func:`shutdown` ran, and groups made by hand): a healthy gloo
group's takes milliseconds."""

_FLOAT32_TINY = 2.0**-126  # float32's smallest normal number

_engines = {}
_stopping = {}  # group -> its engine, while shutdown() waits for its calls
_to_stop = {}  # the groups whose engines the running shutdown() has yet to stop (an ordered set)
_shutdowns = 0  # shutdown() calls running
_shutting_down = []  # the threads running them (one entry per call)
_engines_lock = threading.RLock()  # an RLock for its owner check (see _locked): never taken twice
_stopped = threading.Condition(_engines_lock)  # notified as shutdown() lets go of each group
_attach_locks = weakref.WeakKeyDictionary()  # group -> the lock of its NCCL communicator's bootstrap
_broken = weakref.WeakKeyDictionary()  # group -> why its ring is unusable, for engines shutdown() released
_sequences = weakref.WeakKeyDictionary()  # group -> its calls so far, for engines shutdown() released
_registered = weakref.WeakSet()  # groups of torch.distributed's registry, whose destruction it tells
_DESTROYED = "gradsync: torch.distributed destroyed this process group"
# In a child made by fork() from a process with live groups of several ranks: a group torch.distributed
# does not list may be one of the parent's, made by hand, whose connections the child must not drive.
_forked_from_groups = False
_MAKE_CHILD_GROUPS = ("dist.destroy_process_group(), then init_process_group() with a rendezvous of the child's own, "
                      "then its groups")
_UNLISTED_IN_CHILD = ("gradsync: this process was made by fork() from one with process groups of several ranks, and "
                      "torch.distributed does not list this group: it may be one of the parent's, made by hand, whose "
                      "connections are the parent's, and gradsync cannot tell; in the child, make groups through "
                      "torch.distributed: " + _MAKE_CHILD_GROUPS)


class AllReduceWork:
    """The handle of an asynchronous :func:`all_reduce` (or :func:`reduce_scatter`, :func:`all_gather`); the
    tensors must not be touched until ``wait()``."""

    def __init__(self, work, tensor):
        self._work = work
        self._tensor = tensor
        self._pid = os.getpid()

    def wait(self, timeout: Optional[Union[datetime.timedelta, float]] = None) -> bool:
        """Blocks until the all-reduce is done and returns True, as ``Work.wait()`` does; raises its error
        if it failed (see :func:`all_reduce` for what the tensor then holds).

        ``timeout`` (a ``timedelta`` or seconds) bounds this wait alone: past it, ``RuntimeError``, and
        the call goes on (its tensors are not to be touched until a later ``wait()`` returns), bounded
        by the group's own timeout. 0, as for ``Work.wait()``, is no bound.
        """
        seconds = _wait_seconds(timeout)
        if self._unfinished_in_forked_child():
            raise RuntimeError(self._forked())
        return self._work.wait(seconds)

    def _unfinished_in_forked_child(self):
        return os.getpid() != self._pid and not self._work.is_completed()

    @staticmethod
    def _forked():
        return ("gradsync: this call was issued before fork() and had not completed: gradsync's thread that runs "
                "it stayed in the parent, so it does not complete in the child")

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future:  # a torch._C.Future, like Work.get_future()
        """A ``torch.futures.Future`` completed with the reduced tensor (or the all-reduce's error):
        the tensor itself, not the one-element list a ``Work``'s future holds.

        Its callbacks run on gradsync's communication thread: keep them short, and never wait in one
        for another gradsync call (a synchronous one on a group gradsync has run calls on raises
        there: pass ``async_op=True``; so does ``wait()`` for a later call of the group, which that
        thread runs after the callback; a Future's ``wait()`` there blocks forever).
        """
        if self._unfinished_in_forked_child():
            future = torch.futures.Future()
            future.set_exception(RuntimeError(self._forked()))
            return future
        return self._work.get_future()


def _wait_seconds(timeout):
    """-1 for no timeout (None, or 0 as torch's Work.wait takes it)."""
    if timeout is None:
        return -1.0
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta, a number of seconds or None, got {timeout!r}")
    if not seconds >= 0:
        raise ValueError(f"timeout must be at least 0 seconds, got {timeout!r}")
    return seconds or -1.0


_LOADING = "_gradsync_loading"  # a parameter's mark while a load is under way


class _ForgetResidualsOnLoad:
    """``load_state_dict`` hooks of a module: the parameters a load wrote (their autograd versions
    moved, or other tensors took their place: ``assign=True``, torch's ``swap_tensors`` mode) restart
    the error feedback of the object held weakly (its ``_forget_residuals(written)``, parameter ids),
    as in a new process. The parameters watched are the module's, or those the object names
    (``_watched_parameters(module)``). A load that wrote nothing (``strict=False`` with other keys,
    a size mismatch) changes nothing. A copy of the module (``copy.deepcopy``, ``torch.save``) gets
    inert hooks: the copy's own wrapper or hooks register theirs."""

    def __init__(self, owner):
        self._owner = weakref.ref(owner) if owner is not None else None
        self._key, self._token, self._versions = id(self), None, {}

    def register(self, module):
        """The hooks' handles."""
        return [module.register_load_state_dict_pre_hook(self.before), module.register_load_state_dict_post_hook(self)]

    def _watched(self, module):
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            return None, []
        watched = getattr(owner, "_watched_parameters", None)
        return owner, list(watched(module) if watched is not None else module.parameters())

    def before(self, module, *args):  # before its own and its submodules' load
        # A mark in each parameter's __dict__, which a tensor put in its place lacks: ids are taken
        # again once the old are freed, and a weak reference stops swap_tensors (which swaps __dict__).
        # Plain ints, under this hook's key: a load that raised leaves its mark until this hook's next.
        self._token, self._versions = int.from_bytes(os.urandom(8), "little"), {}
        for p in self._watched(module)[1]:
            p.__dict__.setdefault(_LOADING, {})[self._key] = self._token
            self._versions[id(p)] = p._version

    def __call__(self, module, incompatible_keys):
        owner, params = self._watched(module)
        written = set()
        for p in params:
            marks = p.__dict__.get(_LOADING, {})
            if marks.get(self._key) != self._token or self._versions.get(id(p)) != p._version:
                written.add(id(p))
            marks.pop(self._key, None)
            if not marks:
                p.__dict__.pop(_LOADING, None)
        self._token, self._versions = None, {}
        if owner is not None and written:
            owner._forget_residuals(written)

    def __reduce__(self):
        return type(self), (None,)


def _check_flag(value, name):
    if value not in (True, False):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_scale(value, name):
    """The float of a finite number (or one-element real tensor) that stays non-zero as a float (an
    int beyond float's range, or a Fraction below it, is refused like inf and 0)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a number or a one-element real tensor, got a {value.dtype} tensor of "
                             f"shape {tuple(value.shape)}")
        if value.is_meta:
            raise ValueError(f"{name} is a tensor on the meta device, which holds no value")
        value = value.item()
    narrowed = 0.0
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        try:
            narrowed = float(value)
        except OverflowError:
            narrowed = math.inf
    if not math.isfinite(narrowed) or narrowed == 0:
        raise ValueError(f"{name} must be a finite, non-zero number, got {value!r}")
    return narrowed


def _op_name(op):
    """"avg" or "sum" for those strings and torch.distributed.ReduceOp.AVG / SUM; "premul_sum" for
    ``ReduceOp.PREMUL_SUM(factor)`` (a sum of the inputs times ``factor``)."""
    if isinstance(op, str):
        if op in OPS:
            return op
    elif isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        if op == dist.ReduceOp.PREMUL_SUM:
            if type(op) is dist.ReduceOp.RedOpType:
                raise ValueError("op ReduceOp.PREMUL_SUM needs its factor: ReduceOp.PREMUL_SUM(factor) "
                                 "(torch.distributed._make_nccl_premul_sum(factor))")
            return "premul_sum"
        for name in OPS:
            if op == getattr(dist.ReduceOp, name.upper()):
                return name
    raise ValueError(f"op must be one of {', '.join(OPS)} (or torch.distributed.ReduceOp.AVG / SUM / "
                     f"PREMUL_SUM(factor)), got {op!r}")


def _op_factor(op, world_size):
    """The factor every input is multiplied by: 1/world_size for "avg", 1 for "sum", ``factor`` for
    ``ReduceOp.PREMUL_SUM(factor)``."""
    name = _op_name(op)
    if name != "premul_sum":
        return 1.0 / world_size if name == "avg" else 1.0
    try:
        factor = op.factor
    except AttributeError:  # torch releases before ReduceOp.factor: the op's pickled state holds it
        try:
            factor = op.__getstate__()[1]
        except Exception as e:
            raise ValueError(f"cannot read the factor of {op!r} on this torch: {e}") from None
    return _check_scale(factor, "ReduceOp.PREMUL_SUM's factor")


def resolve_scales(op, world_size, prescale=None, postscale=None):
    """(prescale, postscale) whose product is 1/world_size for "avg", 1 for "sum" and ``factor`` for
    ``ReduceOp.PREMUL_SUM(factor)``.

    By default the whole factor is applied before the sum (prescale = 1/n): every partial sum then
    stays within the inputs' range, so an fp16 wire cannot overflow where the inputs did not, at the
    cost of log2(n) bits at the bottom of fp16's range (values below n * 3e-8 flush to zero). bf16
    and the block-scaled fp8 codecs are indifferent to the split. Give one factor and gradsync
    derives the other; give both and their product must be right.
    """
    target = _op_factor(op, world_size)
    if prescale is None and postscale is None:
        return _in_float32(target, "the op's factor"), 1.0
    if postscale is None:
        prescale = _in_float32(_check_scale(prescale, "prescale"), "prescale")
        return prescale, _in_float32(target / prescale, "the postscale it leaves")
    postscale = _in_float32(_check_scale(postscale, "postscale"), "postscale")
    if prescale is None:
        return _in_float32(target / postscale, "the prescale it leaves"), postscale
    prescale = _check_scale(prescale, "prescale")
    if not math.isclose(prescale * postscale, target, rel_tol=1e-6):
        raise ValueError(f"prescale * postscale must be {target:g} for op={_op_name(op)!r} on {world_size} ranks, "
                         f"got {prescale:g} * {postscale:g}")
    return _in_float32(prescale, "prescale"), _in_float32(postscale, "postscale")


def _in_float32(value, name):
    """A factor the kernels apply in float32: it must stay finite and non-zero there, and normal (a
    subnormal factor keeps few bits of what it multiplies)."""
    try:
        narrowed = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        narrowed = math.inf
    if not math.isfinite(narrowed) or abs(narrowed) < _FLOAT32_TINY:
        raise ValueError(f"{name} must be a finite, non-zero float32 of at least 2**-126 in magnitude, as gradsync "
                         f"applies it in float32: {value!r} is {narrowed} there")
    return value


def _check_residual(residual, tensor, *others, numel_means=None):
    """``others``: more tensors of the call (a reduce-scatter's output) the residual must not share
    memory with. ``numel_means``: how the caller's arguments give ``tensor``'s numel, for the message."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
    if residual.is_nested or residual.layout != torch.strided:
        raise ValueError("residual must be a contiguous float32 tensor, got a "
                         f"{'nested' if residual.is_nested else str(residual.layout)} one")
    if residual.dtype != torch.float32:
        raise ValueError(f"residual must be a contiguous float32 tensor, got {residual.dtype}")
    if not residual.is_contiguous():
        raise ValueError("residual must be a contiguous float32 tensor, got a non-contiguous one")
    _check_memory(residual, "residual", "the ring")
    _check_writable(residual, "residual")
    if numel_means is not None and residual.numel() != tensor.numel():
        raise ValueError(f"residual must hold {numel_means} = {tensor.numel()} elements, got {residual.numel()}")
    if residual.numel() != tensor.numel() or residual.device != tensor.device:
        raise ValueError(f"residual must match the tensor's numel and device: got {residual.numel()} elements on "
                         f"{residual.device} for a tensor of {tensor.numel()} on {tensor.device}")
    for other in (tensor, *others):
        if _overlap(residual, other):
            raise ValueError("residual shares memory with the tensors it feeds back into: the kernels write it while "
                             "they read those, so give it memory of its own")


def _overlap(a, b):
    """Whether two contiguous tensors share bytes."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    a_end, b_end = a.data_ptr() + a.numel() * a.element_size(), b.data_ptr() + b.numel() * b.element_size()
    return a.data_ptr() < b_end and b.data_ptr() < a_end


def _check_member(group, name):
    """``dist.new_group`` gives a rank outside the group a placeholder, not a group."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{name}: this rank is not a member of the group (dist.new_group gives the ranks outside it "
                         "a placeholder)")


def _resolve_group(group, name="group", caller="all_reduce"):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"gradsync.{caller} needs torch.distributed to be initialized "
                           "(torch.distributed.init_process_group)")
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if _destroyed(group):
        raise RuntimeError(_DESTROYED)
    _check_member(group, name)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


def _check_waitable(group, async_op, caller):
    """A call waited for on its own group's thread (in a callback of that group's future) would wait
    there for itself, forever; on another group's thread, it could wait for a call queued behind one
    that waits for that thread (hierarchical_average's calls wait for each other across groups)."""
    engine = _engines.get(group) or _stopping.get(group)
    if async_op or engine is None or not _C._on_engine_thread():  # a group without an engine has nothing queued
        return
    if engine.on_own_worker_thread:
        raise RuntimeError(f"gradsync.{caller} on this group from a callback of one of its futures, which runs on "
                           "the group's communication thread, would wait there for itself: pass async_op=True")
    raise RuntimeError(f"gradsync.{caller} from a callback of a gradsync future, which runs on gradsync's "
                       "communication thread of another group, would hold that thread while it waits, and calls of "
                       "the two groups may wait for each other (hierarchical_average's do): pass async_op=True")


@contextlib.contextmanager
def _locked():
    """The engine table's lock. The thread that holds it can come back for it only from a signal
    handler (or a finalizer) run in the middle of gradsync's own bookkeeping on that thread: it
    would wait forever, and going in would find the table half updated, so that call raises."""
    lock = _engines_lock
    if lock._is_owned():
        raise RuntimeError(_REENTERED)
    with lock:
        yield


_REENTERED = ("gradsync was called from a signal handler (or a finalizer) that interrupted gradsync's own bookkeeping "
              "on this thread; have the handler set a flag that the training loop reads, and call gradsync there")


def _engine(group, tensor):
    stale = []
    try:
        engine = _engine_of(group, stale)
    finally:
        if stale:  # on a thread of gradsync's own: a peer that is gone can hold it up
            _C._release_engines([e for _, e in stale])
    if tensor.is_cuda and _uses_nccl(group):
        if engine.nccl_device < 0:
            # one communicator per group, even when two threads make its first CUDA call at once; a lock
            # per group, since the bootstrap is a collective that other groups' must not wait for
            with _locked():
                attach_lock = _attach_locks.setdefault(group, threading.RLock())  # an RLock for its owner check
            if attach_lock._is_owned():  # a handler run while this thread joins the group's communicator
                raise RuntimeError(_REENTERED)
            with attach_lock:
                if engine.nccl_device < 0:
                    _attach_nccl(engine, group, tensor.device)
        _check_nccl_device(tensor, group)
    return engine


def _engine_of(group, stale):
    """The group's engine, made where it has none. The engines of groups torch.distributed destroyed
    go into ``stale``, to be released, when an engine is made or a call comes on such a group (the
    calls of gradsync.DataParallel and of the hooks reach no other check of the group), and so do
    the idle engines of groups that no one but gradsync holds any more (made by hand and dropped,
    as fault-tolerance libraries drop a group for the next)."""
    engine = _engines.get(group)
    if engine is not None and not _destroyed(group):  # without the lock, which a signal handler's call may need
        return engine  # (shutdown() may stop it meanwhile: _submit then takes the group's next engine)
    with _locked():  # one engine per group, even when two threads make its first call at once
        engine = _engines.get(group)
        destroyed = _destroyed(group)
        if engine is None or destroyed:
            stale += [(g, _engines.pop(g)) for g in [g for g in _engines if _destroyed(g)]]
            for g, _ in stale:
                _broken[g] = _DESTROYED
                _sequences.pop(g, None)
            for g in _idle_and_held_by_gradsync_alone():  # stopped: their calls' order and state are final
                idle = _engines.pop(g)
                stale.append((g, idle))
                _sequences[g] = idle.sequence  # for a call still made on it (through a weak reference)
                if idle.broken:
                    _broken[g] = idle.broken
            if destroyed:  # its engine is in stale, or shutdown() released it
                engine, _broken[group] = None, _DESTROYED
        on_engine_thread = _C._on_engine_thread()
        # A callback's call while shutdown() finishes the group's calls runs among them, in its turn,
        # as it does on the peers: shutdown() waits for the thread it runs on, and a new engine's tags
        # would meet those of the calls being finished.
        if engine is None and group in _stopping and on_engine_thread and _stopping[group].accepts_calls:
            engine = _stopping[group]
        # a call from another thread (or a callback's, once the engine's thread has ended, so that
        # nothing there waits for it) takes its turn after them
        while engine is None and group in _stopping:
            if threading.get_ident() in _shutting_down:  # a handler run in this thread's shutdown(): it
                raise RuntimeError(_REENTERED)  # would wait for the shutdown() it interrupted
            _stopped.wait()
            engine = _engines.get(group)
        if engine is None and group in _broken:  # ... as they would a failed call's late messages
            raise RuntimeError(_broken[group])
        if engine is None and _backend_name(group) == "fake":
            raise ValueError("gradsync: the group's backend is torch's fake one (FakeProcessGroup, for dry runs), "
                             "whose messages carry nothing; gradsync's calls cannot run on it")
        if engine is None and _forked_from_groups and group.size() > 1 and not _group_is_live(group):
            raise RuntimeError(_UNLISTED_IN_CHILD)
        if engine is None:
            engine = _engines[group] = _C.RingEngine(group, _sequences.get(group, 0))
            if _group_is_live(group):
                _registered.add(group)
            if _shutdowns and on_engine_thread:  # a running shutdown() stops what its calls' callbacks start
                _to_stop[group] = None
    return engine


def _reference_counts(table):
    """{key: its reference count} as this function sees it: the same for every key that only the
    table holds, whatever the interpreter's own references (see _HELD_BY_A_TABLE_ALONE)."""
    return {key: sys.getrefcount(key) for key in table}


# what _reference_counts sees of a key that nothing else holds (measured: interpreters differ)
_HELD_BY_A_TABLE_ALONE = next(iter(_reference_counts({object(): None}).values()))


def _idle_and_held_by_gradsync_alone():
    """The groups of ``_engines`` held by nothing but the table (in Python) and their engine (in C++,
    besides their Python object), not named in torch's registry, and whose engines had no call (a
    group subclassed in Python needs its Python object for its calls): their engines are stopped.
    Not those of an NCCL communicator, which every rank would have to join anew, should a weak
    reference still reach the group."""
    idle = []
    for group, count in _reference_counts(_engines).items():
        engine = _engines[group]
        if count <= _HELD_BY_A_TABLE_ALONE and engine.group_references <= 2 and engine.nccl_device < 0 and \
                not _named_in_torchs_registry(group) and engine.stop_if_idle():
            idle.append(group)
    return idle


def _named_in_torchs_registry(group):
    """Whether torch's registry of group names (which holds its groups weakly) gives the group back:
    it would give a new Python object for it once gradsync let go of this one, which no engine's
    calls would know of."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(group.group_name) is group
    except Exception:  # noqa: BLE001 (a group without a name, or none registered under it)
        return False


def _check_nccl_device(tensor, group):
    """A CUDA tensor on the device of the group's gradsync NCCL communicator, where there is one."""
    engine = _engines.get(group) or _stopping.get(group)
    if tensor.is_cuda and engine is not None and 0 <= engine.nccl_device != tensor.device.index:
        raise ValueError(f"tensor is on {tensor.device}, but this rank's gradsync NCCL communicator for the group "
                         f"is on cuda:{engine.nccl_device}: keep each rank's tensors on one GPU")


def _backend_name(group):
    """The group's backend as torch.distributed names it ("gloo", "nccl", "cpu:gloo,cuda:nccl"). A
    group made outside its registry (as fault-tolerance libraries make them) names its own, and one
    made without a backend (torch's "undefined": the accelerator's alone) is named by what it has."""
    try:
        name = str(dist.get_backend(group)).lower()
        if name != "undefined":
            return name
    except ValueError:  # not in torch.distributed's registry
        pass
    names = {}
    for device in ("cpu", "cuda"):
        try:
            names[device] = str(group._get_backend(torch.device(device)).name()).lower()
        except Exception:  # noqa: BLE001 - no backend for that device
            pass
    if len(set(names.values())) == 1:
        return next(iter(names.values()))
    return ",".join(f"{device}:{name}" for device, name in names.items())


def _without_cpu_backend(backend):
    """Whether a group of that backend has none for CPU tensors ("nccl", or backends named per device
    without "cpu:"). A group named otherwise says so itself, at its first post."""
    devices = [part.split(":")[0].strip() for part in backend.split(",") if ":" in part]
    return backend == "nccl" or (bool(devices) and "cpu" not in devices)


def _uses_nccl(group):
    """Whether the group moves CUDA tensors with NCCL ("nccl", or "cuda:nccl" in a combined backend)."""
    return _moves_cuda_with_nccl(_backend_name(group))


def _moves_cuda_with_nccl(backend):
    return backend == "nccl" or "cuda:nccl" in backend


def _timeout_of(group):
    """The timeout ``group`` was made with (init_process_group / new_group); None where its backends
    do not say."""
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            pass
    return None


def _group_timeout_s(group):
    """The timeout the group was created with, else NCCL's default."""
    timeout = _timeout_of(group)
    if timeout is None:
        timeout = dist.distributed_c10d.default_pg_nccl_timeout
    return timeout.total_seconds() if timeout is not None else 600.0


def _attach_nccl(engine, group, device):
    """gradsync's own NCCL communicator for the group: rank 0 makes the unique id, which travels to
    the other ranks through the group itself, then every rank joins (ncclCommInitRank)."""
    if not _C.build_info()["cuda"]:
        raise RuntimeError("gradsync was built without CUDA: it cannot all-reduce CUDA tensors")
    if not _group_is_live(group):  # the unique id travels through torch.distributed's collectives
        raise ValueError("gradsync: CUDA tensors over NCCL need a group of torch.distributed's registry "
                         "(gradsync's NCCL communicator is bootstrapped through its collectives); a group made "
                         "outside it takes CPU tensors")
    if os.environ.get("NCCL_COMM_BLOCKING", "").strip() == "1":
        warnings.warn("NCCL_COMM_BLOCKING=1 makes gradsync's NCCL communicator blocking: a peer that dies before "
                      "joining it then makes the others wait forever instead of raising after the group's timeout",
                      RuntimeWarning, stacklevel=4)
    unique_id = [_C.nccl_unique_id() if group.rank() == 0 else None]
    dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0), group=group, device=device)
    engine.attach_nccl(unique_id[0], device.index, _group_timeout_s(group))


# The collectives run eagerly wherever they are called: torch.compile leaves them out of its graphs
# (a graph break), as it would any call into an extension, without tracing their checks first.
@_eager_under_compile
def all_reduce(tensor: torch.Tensor, *, op: str = "avg", codec: str = "none", group=None,
               prescale: Optional[float] = None, postscale: Optional[float] = None, async_op: bool = False,
               check_call: bool = True, residual: Optional[torch.Tensor] = None):
    """All-reduces ``tensor`` in place across ``group`` (default: the default group).

    ``op``: "avg" (default) or "sum", or ``torch.distributed.ReduceOp.AVG`` / ``SUM`` /
    ``PREMUL_SUM(factor)`` (the sum of the inputs times ``factor``). ``codec``: the wire format, one of :data:`gradsync.CODECS`
    ("none" sends the tensor's own dtype). Sums are accumulated in fp32 at every hop. ``prescale`` /
    ``postscale``: see :func:`resolve_scales`. With ``async_op=True`` returns an
    :class:`AllReduceWork` at once; calls on one group run in the order they were issued, which must
    be the same on every rank. ``check_call`` first verifies (one small exchange) that every rank
    passes the same numel, dtype, codec and scaling, and raises on every rank if not; a rank whose
    arguments are wrong, or that cannot allocate the call's workspaces, raises its error and the
    others a ValueError naming it.

    ``residual`` (error feedback): a contiguous float32 tensor with ``tensor``'s numel and device,
    zeros at first. It is added to this rank's contribution before that is encoded, and overwritten
    with what the encoding lost; every rank encodes each element exactly once per call, so the
    residuals of all ranks sum to the error of the result and the next call pays it back.

    The tensor must be contiguous float32/float16/bfloat16, on CPU or CUDA. Ranks that disagree on
    the call raise before anything is written. After a transport failure (a peer died, the group's
    timeout passed) the tensor's and the residual's contents are unspecified, and later calls on the
    group raise.
    """
    return _all_reduce(tensor, op, codec, group, prescale, postscale, async_op, check_call, residual)


@_eager_under_compile
def _all_reduce(tensor, op, codec, group, prescale, postscale, async_op, check_call, residual, layout=0):
    """:func:`all_reduce`, the call's record carrying ``layout`` (see ``RingCall::layout``): ranks
    whose tensors hold different things of the same size raise on every rank, with the check."""
    with _refused_on_error(group, tensor, check_call, _ALL_REDUCE):
        _check_tensor(tensor, "tensor", "all_reduce")
        _check_writable(tensor, "tensor")
        _check_codec(codec)
        async_op, check_call = _check_flag(async_op, "async_op"), _check_flag(check_call, "check_call")
        if residual is not None:
            _check_residual(residual, tensor)
        group = _resolve_group(group)
        _check_waitable(group, async_op, "all_reduce")
        _check_backend(tensor, "tensor", group)
        _check_nccl_device(tensor, group)
        prescale, postscale = resolve_scales(op, group.size(), prescale, postscale)
    handle = _issue(tensor, codec, group, prescale, postscale, check_call, residual, layout=layout)
    if async_op:
        return handle
    handle.wait()
    return None


def _issue(tensor, codec, group, prescale, postscale, check_call, residual, after=None, layout=0):
    """The call of :func:`all_reduce` on checked arguments and resolved scales, whose product may be
    any factor (gradsync.DataParallel averages over the ranks still training under ``join()``).
    ``after``: an :class:`AllReduceWork` of another group that writes ``tensor``, which the call waits
    for on gradsync's thread (see :func:`_all_gather_after`)."""
    _check_not_capturing(tensor, "all_reduce")
    work = _submit(group, tensor, lambda engine: engine.all_reduce(
        tensor, _CODEC_IDS[codec], prescale, postscale, bool(check_call), _slice_bytes(engine, tensor), residual,
        DIRECT_BYTES, after._work if after is not None else None, layout))
    return AllReduceWork(work, tensor)


def _submit(group, tensor, call):
    """``call(engine)`` on the group's engine. One that shutdown() stopped between being found and
    being given the call took nothing: the call goes to the group's next engine, in its turn."""
    while True:
        engine = _engine(group, tensor)
        try:
            return call(engine)
        except RuntimeError:
            with _locked():
                stopped_meanwhile = _engines.get(group) is not engine and not engine.accepts_calls
            if not stopped_meanwhile:
                raise


# the ring's operations, as a call's record names them (RingOp in csrc/ring/ring_allreduce.h)
_ALL_REDUCE, _REDUCE_SCATTER, _ALL_GATHER = 0, 1, 2


@contextlib.contextmanager
def _refused_on_error(group, tensor, check_call, op):
    """Arguments that are wrong on one rank raise there; this rank still takes its turn in the call
    (RingEngine.refuse), so that the peers raise too, naming it, rather than pair their call with
    this rank's next one and sum different tensors."""
    try:
        yield
    except Exception as error:
        _refuse(group, tensor, check_call, op, error)
        raise


def _refuse(group, tensor, check_call, op, error):
    try:
        try:
            checked = _check_flag(check_call, "check_call")
        except TypeError:  # what the peers most likely pass: the default
            checked = True
        _refusal(group, tensor, checked, op, f"{type(error).__name__}: {error}")
    except Exception:  # the peers cannot be told: they wait for this rank until the group's timeout
        pass


def _refusal(group, tensor, checked, op, why, peers_unchecked=False):
    """This rank's turn in a call it does not make: with ``checked``, the peers' agreement check
    raises ``why`` on every rank; without, this rank's ring becomes unusable (its peers, already in
    the ring, time out). Returns the call's handle, whose wait() raises ``why`` (None on one rank).
    ``peers_unchecked``: the peers may be making the call unchecked, so that a checked refusal waits
    for checks they never send, until the group's timeout; the exit does not wait for it."""
    group = _resolve_group(group)
    if group.size() == 1:
        return None
    engine = _engines.get(group) or _stopping.get(group)
    device = _refusal_device(_backend_name(group), engine.nccl_device if engine is not None else -1,
                             tensor.device if isinstance(tensor, torch.Tensor) else None)
    if device.type == "cuda":
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                return None
    placeholder = torch.empty(0, dtype=torch.float32, device=device)
    work = _submit(group, placeholder, lambda engine: engine.refuse(
        placeholder, op, checked, _slice_bytes(engine, placeholder), why))
    if checked and peers_unchecked:
        with _locked():
            _unanswered[group] = [w for w in _unanswered.get(group, ()) if not w.is_completed()] + [work]
    return AllReduceWork(work, placeholder)


def _refusal_device(backend, nccl_device, tensor_device):
    """Where a refused call's placeholder goes: where the peers' call of the group checks. ``backend``
    the group's, ``nccl_device`` the GPU of the group's gradsync NCCL communicator (-1: none yet),
    ``tensor_device`` the refused tensor's device (None: not a tensor)."""
    cuda_tensor = tensor_device is not None and tensor_device.type == "cuda"
    if _moves_cuda_with_nccl(backend) and (cuda_tensor or _without_cpu_backend(backend)):  # checked over NCCL
        if nccl_device >= 0:  # even for a tensor on another GPU: the device check is what refused it
            return torch.device("cuda", nccl_device)
        # joined here: on the refused call's GPU, as its peers join on theirs
        return tensor_device if cuda_tensor else torch.device("cuda", torch.cuda.current_device())
    return tensor_device if cuda_tensor else torch.device("cpu")


def _check_tensor(t, name, caller):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_strided(t, name, caller)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; gradsync.{caller} takes float32, float16 or bfloat16")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; gradsync.{caller} takes CPU or CUDA tensors")
    _check_memory(t, name, "the ring")  # a rank passing a negative view would sum what is stored


def _check_strided(t, name, caller):
    if t.is_nested or t.layout != torch.strided:
        raise ValueError(f"{name} is a {'nested' if t.is_nested else str(t.layout)} tensor; gradsync.{caller} takes "
                         "dense (strided) tensors")


def _check_not_capturing(t, caller):
    """The ring runs on gradsync's own thread and streams, which a CUDA graph captured on the caller's
    stream cannot hold: refused before anything is queued (peers that were not capturing then time out)."""
    if t.is_cuda:
        with torch.cuda.device(t.device):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"gradsync.{caller} cannot be captured in a CUDA graph (the ring runs on gradsync's "
                                   "own thread and streams); call it outside the capture")


def _check_backend(t, name, group):
    backend = _backend_name(group)
    if (t.is_cuda and _moves_cuda_with_nccl(backend)) or not _without_cpu_backend(backend):
        return
    if backend == "nccl":
        raise ValueError(f"{name} is on cpu, but the group's backend is nccl, which moves CUDA tensors only: move it "
                         "to this rank's GPU, or use a group with a CPU backend (e.g. backend=\"cpu:gloo,cuda:nccl\")")
    to_gpu = "move it to this rank's GPU, or " if _moves_cuda_with_nccl(backend) else ""
    raise ValueError(f"{name} is on {t.device}, but the group's backend is {backend}, without one for CPU tensors, "
                     "which gradsync's ring over a process group needs (it moves host memory; CUDA tensors are staged "
                     f"there): {to_gpu}use a group with a CPU backend (e.g. backend=\"cpu:gloo,cuda:nccl\")")


def _slice_bytes(engine, tensor):
    return NCCL_SLICE_BYTES if tensor.is_cuda and engine.nccl_device >= 0 else SLICE_BYTES


def _check_chunked_call(output, input, codec, group, async_op, check_call, caller):
    """What reduce_scatter and all_gather check alike: the whole buffer (a reduce-scatter's input,
    an all-gather's output) holds the group's chunks of the other tensor's numel, which is either
    memory of its own or this rank's chunk of the whole. Returns (group, async_op, check_call)."""
    _check_tensor(output, "output", caller)
    _check_tensor(input, "input", caller)
    _check_writable(output, "output")
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(f"output ({output.dtype} on {output.device}) and input ({input.dtype} on "
                         f"{input.device}) must have one dtype and device")
    _check_codec(codec)
    async_op, check_call = _check_flag(async_op, "async_op"), _check_flag(check_call, "check_call")
    group = _resolve_group(group, caller=caller)
    _check_waitable(group, async_op, caller)
    (whole, whole_name), (part, part_name) = ((input, "input"), (output, "output")) if caller == "reduce_scatter" \
        else ((output, "output"), (input, "input"))
    n, rank = group.size(), group.rank()
    if whole.numel() != n * part.numel():
        raise ValueError(f"{whole_name} must hold {n} chunks of {part_name}'s {part.numel()} elements "
                         f"({n * part.numel()} elements), got {whole.numel()}")
    if _overlap(whole, part) and part.data_ptr() != whole.data_ptr() + rank * part.numel() * part.element_size():
        raise ValueError(f"{part_name} overlaps {whole_name} other than as this rank's own chunk of it "
                         f"({whole_name}[{rank * part.numel()}:{(rank + 1) * part.numel()}])")
    _check_backend(whole, whole_name, group)
    _check_nccl_device(whole, group)
    return group, async_op, check_call


@_eager_under_compile
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, op: str = "avg", codec: str = "none", group=None,
                   prescale: Optional[float] = None, postscale: Optional[float] = None, async_op: bool = False,
                   check_call: bool = True, residual: Optional[torch.Tensor] = None):
    """Reduces ``input`` across ``group`` and writes this rank's share into ``output``, as
    ``torch.distributed.reduce_scatter_tensor`` does: ``input`` holds ``group.size()`` chunks of
    ``output.numel()`` elements end to end, and rank r's ``output`` becomes the reduction of chunk r.

    The first half of :func:`all_reduce`'s ring, n-1 hops: the wire carries ``codec`` and every
    hop sums in fp32. The last hop, on the rank that owns the chunk, writes its fp32 sum (times
    ``postscale``) straight into ``output``: the reduced chunk goes on no wire, so it is never
    encoded, and only the n-1 partial sums the peers sent are rounded to the codec, one rounding
    fewer than :func:`all_reduce` (at world size 1, none). ``op``, ``codec``,
    ``prescale``/``postscale``, ``async_op``, ``check_call`` and ``residual`` (here with
    ``input``'s numel; a rank's residual over its own chunk becomes 0, as it encodes none of it, or
    what storing the sum into a 16-bit ``output`` lost) as
    for :func:`all_reduce`. ``input`` is only read; ``output`` may be this rank's own chunk of it
    (in place), or memory of its own.
    """
    return _reduce_scatter(output, input, op, codec, group, prescale, postscale, async_op, check_call, residual)


@_eager_under_compile
def _reduce_scatter(output, input, op, codec, group, prescale, postscale, async_op, check_call, residual, layout=0):
    """:func:`reduce_scatter` with a ``layout``, as :func:`_all_reduce`."""
    with _refused_on_error(group, input, check_call, _REDUCE_SCATTER):
        group, async_op, check_call = _check_chunked_call(output, input, codec, group, async_op, check_call,
                                                          "reduce_scatter")
        if residual is not None:
            _check_residual(residual, input, output)
        prescale, postscale = resolve_scales(op, group.size(), prescale, postscale)
        _check_not_capturing(input, "reduce_scatter")
    handle = _issue_reduce_scatter(output, input, codec, group, prescale, postscale, check_call, residual, layout)
    if async_op:
        return handle
    handle.wait()
    return None


def _issue_reduce_scatter(output, input, codec, group, prescale, postscale, check_call, residual, layout=0):
    """The call of :func:`reduce_scatter` on checked arguments and resolved scales."""
    work = _submit(group, input, lambda engine: engine.reduce_scatter(
        output, input, _CODEC_IDS[codec], prescale, postscale, bool(check_call), _slice_bytes(engine, input), residual,
        layout))
    return AllReduceWork(work, output)


@_eager_under_compile
def all_gather(output: torch.Tensor, input: torch.Tensor, *, codec: str = "none", group=None, async_op: bool = False,
               check_call: bool = True):
    """Gathers every rank's ``input`` into ``output``, as ``torch.distributed.all_gather_into_tensor``
    does: ``output`` holds ``group.size()`` chunks of ``input.numel()`` elements end to end, and chunk
    r becomes rank r's ``input``.

    The second half of :func:`all_reduce`'s ring, n-1 hops, through gradsync's own transport (its
    NCCL communicator for CUDA tensors on an NCCL group), so it never interleaves with torch's
    collectives on the same group. Each rank's ``input`` is encoded to ``codec`` once and every rank
    decodes the same bytes, its own chunk included: ``output`` is bitwise identical on every rank,
    and with "none" (default) it is exactly the inputs. ``input`` may be this rank's own chunk of
    ``output`` (in place: no copy into it); otherwise it is copied there once the ranks agree on the
    call. ``async_op`` and ``check_call`` as for :func:`all_reduce`; with the check, ranks that
    disagree raise before anything is written.
    """
    with _refused_on_error(group, output, check_call, _ALL_GATHER):
        group, async_op, check_call = _check_chunked_call(output, input, codec, group, async_op, check_call,
                                                          "all_gather")
        _check_not_capturing(output, "all_gather")
    handle = _all_gather_after(output, input, codec, group, check_call, None)
    if async_op:
        return handle
    handle.wait()
    return None


def _all_gather_after(output, input, codec, group, check_call, after):
    """:func:`all_gather` on checked arguments. ``after``: an :class:`AllReduceWork` of another
    group that writes ``input``, which the call waits for on gradsync's thread, so that calls on
    several groups can be issued at once in an order every rank shares (a failed one makes this call
    raise on every rank, its check, if any, naming this rank)."""
    work = _submit(group, output, lambda engine: engine.all_gather(
        output, input, _CODEC_IDS[codec], bool(check_call), _slice_bytes(engine, output),
        after._work if after is not None else None))
    return AllReduceWork(work, output)


def _registered_groups():
    """torch.distributed's live groups (None where this torch keeps them elsewhere)."""
    return getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)


def _group_is_live(group):
    if not dist.is_initialized():
        return False
    live = _registered_groups()
    return live is None or group in live


def _destroyed(group):
    """A group of torch.distributed's registry that it has since destroyed."""
    return group in _registered and not _group_is_live(group)


def shutdown():
    """Finishes every issued all-reduce and releases gradsync's per-group engines (threads, workspaces).

    Call it before ``torch.distributed.destroy_process_group()``, from a thread of your own (not in
    a future's callback, which runs on gradsync's thread: that raises); it also runs at exit, where
    the calls of a group whose DataParallel step failed here after its peers' calls went unchecked
    (their checks never come) are ended, not waited for. A group that
    torch.distributed has already destroyed is let go of on a thread of its own, since tearing down a
    gloo group whose peers are gone can block (at exit, waited for up to ``EXIT_RELEASE_S``, unless a
    call failed on it, which leaves it to the process's end). A group whose
    ring a failure left unusable stays so: later calls on it raise, as they did before. A call
    issued meanwhile from another thread on a group whose calls shutdown() is finishing waits for
    them, then starts
    a new engine (which this shutdown() leaves running) and takes its turn after them; one issued
    from a callback on gradsync's thread (asynchronous, as there) runs among them, in its turn, as
    on the ranks that did not shut down.
    """
    if _C._on_engine_thread():  # it would wait for the very call whose callback is running
        raise RuntimeError("gradsync.shutdown() cannot run on gradsync's communication thread (in a callback of an "
                           "all-reduce's future); call it from the thread that issued the calls")
    global _shutdowns
    me, counted = threading.get_ident(), False
    try:  # a KeyboardInterrupt anywhere leaves the count and the threads as it found them
        with _locked():
            _shutting_down.append(me)
            _shutdowns += 1
            counted = True
            _to_stop.update(dict.fromkeys(_engines))
        _stop_engines()
    finally:
        if counted or me in _shutting_down:
            with _locked():
                _shutdowns -= counted
                if me in _shutting_down:
                    _shutting_down.remove(me)


def _stop_engines():
    released = []  # at exit: the engines of groups torch.distributed destroyed, released together below
    finished = True
    try:
        while True:  # in the order they were made: a call's callbacks may issue calls on groups made after it
            with _locked():
                group = next((g for g in _engines if g in _to_stop), None)
                if group is None:
                    _to_stop.clear()  # what is left lost its engine otherwise (a group torch.distributed destroyed)
                    break
                del _to_stop[group]
                engine = _stopping[group] = _engines.pop(group)
            try:
                engine.stop()
            finally:
                _settle_stopped(group, engine)
            if not _group_is_live(group):
                # torch.distributed destroyed it: let go of it on a thread of its own (tearing down a gloo
                # group whose peers are gone can block). At exit, waiting a while for that: the backend's
                # threads, left running into the interpreter's finalization, abort the process where one
                # takes the GIL. A group a call failed on, or one whose teardown takes longer (a torch
                # call of the caller's still waits for a peer), is left to the process's end.
                if not _exiting:
                    _C._release_engines([engine])
                elif engine.broken:
                    engine.abandon_group()
                else:
                    released.append(engine)
    finally:
        group = None  # the engines' references are then the last, unless the caller holds one
        if released:
            _C._release_engines(released)
        # these, and those begun before (by shutdown(), or a call that found its group destroyed)
        if _exiting:
            finished = _C._wait_for_releases(EXIT_RELEASE_S)
    if not finished:  # not in the finally: raised as an error (-W error), it would replace an exception in flight
        warnings.warn(f"gradsync: the teardown of a process group it let go of (one torch.distributed destroyed, or "
                      f"one made by hand) still waits after {EXIT_RELEASE_S:g} s (a torch call still pending on it?); "
                      "the process exits without it, and can abort if that ends during the interpreter's "
                      "finalization. Wait for your calls before destroy_process_group()", RuntimeWarning, stacklevel=1)


def _settle_stopped(group, engine, why=None):
    """The bookkeeping of a group whose engine has stopped: why it is unusable (``why`` where the
    engine does not say), before a new engine can be made for it, and its calls so far."""
    with _locked():
        try:
            if engine.broken or why:
                _broken[group] = engine.broken or why
            _sequences[group] = engine.sequence  # a later engine's calls pair with the peers' next ones
        finally:  # even under a KeyboardInterrupt: the calls waiting for the group would wait forever
            del _stopping[group]
            _stopped.notify_all()


def _forget_engines_in_forked_child():
    """A child made by fork() inherits the parent's engines but not their threads: shutting one down
    would wait for its thread forever, at exit too. The child leaves them alone; its first
    all-reduce on a group of one rank starts an engine of its own, and calls on the inherited groups
    of several ranks raise. (All-reduces issued before the fork do not complete in the child.)"""
    global _engines_lock, _stopped, _attach_locks, _shutdowns, _forked_from_groups
    _C._forget_releases_after_fork()  # the exit would wait for the parent's releases, if not forever
    for engine in [*_engines.values(), *_stopping.values()]:
        engine.abandon_after_fork()
    # a group of several ranks is the parent's connections, which the child must not drive
    live = dist.is_available() and dist.is_initialized()
    # the groups gradsync uses or used (shutdown() keeps their calls so far), and torch's
    used = [*_engines, *_stopping, *_sequences.keys(), *_broken.keys()]
    for group in [*used, *((_registered_groups() or {}) if live else {})]:
        if group.size() > 1 and not _destroyed(group):
            _forked_from_groups = True
            _broken[group] = ("gradsync: this process group was made before fork(), and its connections are the "
                              "parent's; make the child's groups anew: " + _MAKE_CHILD_GROUPS)
    _engines.clear()
    _stopping.clear()
    _to_stop.clear()
    _unanswered.clear()
    # a lock another thread of the parent held stays held in the child, whose copy has no such thread
    _engines_lock, _attach_locks = threading.RLock(), weakref.WeakKeyDictionary()
    _stopped = threading.Condition(_engines_lock)
    _shutdowns = 0  # one running in another thread of the parent
    _shutting_down.clear()


_exiting = False
# group -> its checked refusals whose peers may be in an unchecked call (a DataParallel step after
# its first), and so never answer: they wait until the group's timeout
_unanswered = weakref.WeakKeyDictionary()


def _shutdown_at_exit():
    """shutdown(), except for the groups where such a refusal still waits: the process ending fails
    those peers at once (their connections close), while waiting would hold the exit until the
    group's timeout. Their calls end now, raising, and their groups are kept to the process's end
    (a gloo group torn down with its peers waiting can block). A group with gradsync's NCCL
    communicator is waited for, as before. An exception meanwhile (a KeyboardInterrupt, which
    arrives once the call being waited for has ended) ends the calls of every group not yet stopped
    in the same way, rather than leave them to run into the interpreter's finalization, and goes on."""
    global _exiting
    _exiting = True
    aborting = []
    try:
        with _locked():
            waiting = [g for g, works in _unanswered.items() if not all(w.is_completed() for w in works)]
            # as shutdown() stops them: a callback's call on the group goes to the aborted engine, and fails
            aborting = [g for g in waiting if g in _engines and _engines[g].nccl_device < 0]
            for group in aborting:
                _stopping[group] = _engines.pop(group)
            _unanswered.clear()
        _abandon_calls(aborting)
        shutdown()
    except BaseException:
        moved = list(aborting)
        for _ in range(8):  # the callbacks of the calls ended here may issue calls on groups that had no engine
            with _locked():
                for group in list(_engines):
                    _stopping[group] = _engines.pop(group)
                    _to_stop.pop(group, None)
                    moved.append(group)
                rest = [g for g in moved if g in _stopping]  # those an interrupt left unsettled included
            if not rest:
                break
            try:
                _abandon_calls(rest)
            except BaseException:  # noqa: BLE001 - a second interrupt: the first is raised below
                pass
        raise


def _abandon_calls(groups):
    """At exit: the calls of these groups (their engines moved to ``_stopping``) end now, raising,
    and the groups are kept to the process's end. An exception meanwhile (a second
    KeyboardInterrupt) is raised once every group's calls have ended."""
    interrupted = None
    for group in groups:
        engine = _stopping[group]
        try:
            engine.abandon_group()  # first: an interrupt that ends abort_calls() must not skip it
            engine.abort_calls()
        except Exception:  # noqa: BLE001 - the other groups, and shutdown(), must run whatever this group did
            pass
        except BaseException as e:  # noqa: BLE001 - raised below, once the others are done
            interrupted = interrupted or e
        finally:
            _settle_stopped(group, engine, "gradsync: the group's calls were abandoned as the process exits")
    if interrupted is not None:
        raise interrupted


atexit.register(_shutdown_at_exit)
os.register_at_fork(after_in_child=_forget_engines_in_forked_child)
