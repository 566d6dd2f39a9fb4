"""gradsync.DataParallel: data parallelism without DDP, hooked into autograd.

Gradients are packed into fixed buckets as autograd produces them; each bucket is all-reduced by
gradsync's ring as soon as its last gradient arrives, while backward goes on, and the averaged
gradients are written back before ``backward()`` returns.
"""
import contextlib
import contextvars
import dataclasses
import functools
import math
import numbers
import os
import sys
import types
import warnings
import weakref
import zlib
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel import DistributedDataParallel

from .distributed import _ALL_REDUCE, _ForgetResidualsOnLoad, _check_flag, _issue, _refusal, _resolve_group
from .ops import (FLOAT_DTYPES, FP8_BLOCK_SIZE, _PLAIN_TENSORS, _byte_span, _check_codec, _data_ptr,
                  _eager_under_compile, _storage_nbytes, flatten, unflatten)

__all__ = ["DataParallel"]

_FIRST_BUCKET_BYTES = 1 << 20  # small, so that communication starts early in backward (as DDP does)
_FLAG_ALIGN = FP8_BLOCK_SIZE  # the used flags sit in fp8 blocks of their own, apart from any gradient's scale


class _Bucket:
    """The gradients of ``params`` end to end, then, from the next block on, one flag per parameter:
    1 where this rank produced its gradient since the last synchronized step, else 0. Averaged with
    the gradients, a flag is 0 exactly where no rank produced one (zeros stay zeros on every wire,
    and a block of flags keeps them apart from any gradient's scale). Two marks follow the flags:
    1 in the first where this step's backward is the first since a forward of the wrapper, in the
    second where it is a later one, so that a rank's call paired with another step's (a backward
    made on some ranks only) leaves both averages non-zero on every rank."""

    def __init__(self, params, device, error_feedback, as_views):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.flags_at = -(-self.numel // _FLAG_ALIGN) * _FLAG_ALIGN
        self.marks_at = self.flags_at + len(params)
        self.buffer = torch.zeros(self.marks_at + 2, dtype=torch.float32, device=device)
        self.residual = torch.zeros_like(self.buffer) if error_feedback else None
        # gradient_as_bucket_view: the fp32 gradients live in the buffer (copied in only when autograd
        # made one afresh; never copied out)
        self.views, self.view_at = None, None
        if as_views and all(p.dtype == torch.float32 for p in params):
            self.views = [self._view(j) for j in range(len(params))]
            self.view_at = [v.data_ptr() for v in self.views]  # where each view must point
        self.saved_grads = {}  # index -> the gradient of a parameter this rank did not use, before the call
        self.ready = 0
        self.expected = len(params)  # gradients that make it ready in this step: trainable and reached
        self.work = None
        self.unused = []  # indices of the parameters this rank had not used when the bucket went out
        self.mask = None  # (unused, the flags for it on the device): the last mask, reused while it holds
        self.saved_residuals = {}  # index -> the residual of a parameter this rank did not use, before the call

    def segment(self, j, of):
        return of[self.offsets[j]:self.offsets[j + 1]]

    def _view(self, j):
        """Parameter j's segment of the buffer in the parameter's own layout where its elements are
        dense (channels_last, say), so that fused optimizers find the layouts they expect."""
        p, segment = self.params[j], self.segment(j, self.buffer)
        return segment.as_strided(p.shape, p.stride()) if _memory_order(p) is not None else segment.view_as(p)

    def view(self, j):
        """Parameter j's view of the buffer, made again if something rebound the last one's data
        (``module.to(...)`` sets ``grad.data`` on the gradient that was the view)."""
        if self.views[j].data_ptr() != self.view_at[j]:
            self.views[j] = self._view(j)
        return self.views[j]

    def holds(self, j):
        """Whether parameter j's gradient is its view of the buffer."""
        grad = self.params[j].grad
        return grad is not None and grad.data_ptr() == self.view_at[j] and grad.stride() == self.view(j).stride()

    def adopt(self, j):
        """Moves parameter j's gradient (one autograd made, or None: zeros) into its view of the buffer
        (one made with create_graph=True is copied there and kept, with its graph)."""
        if self.holds(j):  # every step but the first and those after zero_grad(set_to_none=True)
            return
        with torch.no_grad():  # a backward with create_graph=True must not attach the buffer to its graph
            grad, view = self.params[j].grad, self.view(j)
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            if grad is None or not grad.requires_grad:
                self.params[j].grad = view
            # else create_graph=True made it: it keeps its graph, and the average is written into it

    @torch.no_grad()
    def drop_views(self):
        """Keeps copies from now on: each gradient that is a view moves into memory of its own."""
        if self.views is not None:
            for j, p in enumerate(self.params):
                if self.holds(j):
                    p.grad = p.grad.clone()
            self.views = self.view_at = None

    def set_flags(self, unused, later):
        """The flags, and the marks of a first (``later`` False) or a later backward of a forward."""
        flags = self.buffer[self.flags_at:]
        if not unused:
            flags.fill_(1.0)  # kernels: a copy from the host would wait for the backward's kernels
            self.buffer[self.marks_at + (not later)].zero_()
            return
        if self.mask is None or self.mask[0] != (unused, later):  # copied from the host only when it changes
            mask = torch.ones(len(self.params) + 2, dtype=torch.float32, pin_memory=flags.is_cuda)
            mask[unused] = 0.0
            mask[len(self.params) + (not later)] = 0.0
            self.mask = ((unused, later), mask.to(flags.device, non_blocking=True))  # pinned: no wait
        flags.copy_(self.mask[1])


def _memory_order(p):
    """The dimensions of ``p`` from the fastest-varying in memory on, where its elements are dense
    (the order of its view of a bucket); None for an empty or sparse-strided tensor (row-major)."""
    dense, expected, order = p.numel() > 0, 1, []
    for stride, size, dim in sorted((st, sz, d) for d, (st, sz) in enumerate(zip(p.stride(), p.shape)) if sz != 1):
        dense, expected = dense and stride == expected, expected * size
        order.append(dim)
    return tuple(order) if dense else None


def _members(module):
    """The module's parameters and buffers, as parameters() and buffers() list them (each once, in
    the same order), in one walk over the submodules: this runs before every forward."""
    params, buffers, seen, stack = [], [], set(), [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        params += m._parameters.values()
        buffers += m._buffers.values()
        stack += reversed([c for c in m._modules.values() if c is not None])
    return ([p for p in dict.fromkeys(params) if p is not None],
            [b for b in dict.fromkeys(buffers) if b is not None])


def _tensors_in(obj):
    """The tensors in a forward's output, through lists, tuples, dicts and dataclasses (as DDP looks)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, field.name))


def _reached_leaves(output):
    """The ids of the leaf tensors whose gradient a backward from ``output`` accumulates: the
    AccumulateGrad nodes of its autograd graph."""
    reached, seen, stack = set(), set(), []
    for t in _tensors_in(output):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            reached.add(id(variable))
        stack.extend(f for f, _ in node.next_functions if f is not None and f not in seen)
    return reached


class _Announcement:
    """What a forward under join() tells the ranks that have joined, read once it has arrived."""

    def __init__(self, work, flags, group):
        self._work, self._flags, self._group, self._values = work, flags, group, None

    def _read(self):
        if self._values is None:
            self._work.wait()
            self._values = self._flags.tolist()
            self._work = self._flags = None
        return self._values

    @property
    def synchronizes(self):
        return self._read()[0] > 0

    @property
    def broadcasts(self):
        return self._read()[1] > 0

    @property
    def with_grad(self):
        """Whether the forward ran with gradients enabled (whether it decides the next broadcast)."""
        return self._read()[2] > 0

    @property
    def active(self):
        """The group ranks still training."""
        return [r for r, flag in enumerate(self._read()[3:]) if flag > 0]

    @property
    def source(self):
        """Where buffers come from: the highest rank still training (rank 0 may have joined)."""
        return dist.get_global_rank(self._group, max(self.active))


class _Join(Join):
    """torch's Join, after which the wrapper's forwards announce nothing more, also when the loop raised."""

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for joinable in self._joinables:
                if isinstance(joinable, DataParallel):
                    joinable._leave_join()


class _JoinHook(JoinHook):
    def __init__(self, wrapper, divide_by_initial_world_size):
        wrapper._divide_by_initial_world_size = _check_flag(divide_by_initial_world_size,
                                                            "divide_by_initial_world_size")
        self.wrapper = wrapper

    def main_hook(self):
        self.wrapper._shadow_iteration()

    def post_hook(self, is_last_joiner):
        self.wrapper._sync_final_model(is_last_joiner)


_LIBRARIES = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def _caller_stacklevel():
    """The stacklevel, for a warning issued by the caller of this function, of the first frame
    outside gradsync and torch: the user's call (whichever wrappers torch.compile's support put
    between)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


def _under_compiled_autograd():
    # not imported: compiled autograd cannot be on (looked up so that gradsync never imports Dynamo)
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and (ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


def _on_grad(wrapper, param):
    wrapper = wrapper()
    if wrapper is not None and not wrapper._retired:
        wrapper._on_grad(param)


_owners = {}  # id of a parameter -> weak references of the wrappers that average it, oldest first


def _claim(params, wrapper):
    """Makes ``wrapper`` the one that averages ``params``. An older wrapper still alive whose module
    is wrapped again (whatever was frozen since), or whose parameters it all takes over, retires: two
    sets of hooks would each average (and, with gradient_as_bucket_view, each move) the same
    gradients. One that only shares some (a tied parameter), or that runs inside the new wrapper's
    module, keeps its hooks, and neither makes a shared gradient a view of its bucket: the second
    hook would read a view the first one's call is still writing, and one end of step would leave
    ``.grad`` a view of the bucket the other had written."""
    new = wrapper()
    ids = {id(p) for p in params}
    inside = {id(m) for m in new.module.modules()}
    shared = {}  # an older wrapper that keeps its hooks -> the ids of the parameters both average
    for p in params:
        live = [(ref, ref()) for ref in _owners.get(id(p), ()) if ref is not wrapper]
        live = [(ref, older) for ref, older in live if older is not None and not older._retired]
        for _, older in live:
            if id(older) not in inside and (older.module is new.module or older._trainable_ids <= ids):
                older._retired = True
            else:
                shared.setdefault(older, set()).add(id(p))
        _owners[id(p)] = [ref for ref, older in live if not older._retired] + [wrapper]
    for older, both in shared.items():
        older._share(both)
        new._share(both)


def _drop_hint(hint):
    if DistributedDataParallel._active_ddp_module is hint:
        DistributedDataParallel._active_ddp_module = None


def _release(ids, wrapper):
    for i in ids:
        refs = [ref for ref in _owners.get(i, ()) if ref is not wrapper]
        if refs:
            _owners[i] = refs
        else:
            _owners.pop(i, None)


def _signature(module, settings):
    """(kind, name, description) of what every rank must have alike: the settings, each parameter's
    and buffer's shape and dtype, whether it trains, and the element order in memory of a gradient
    that is a view of its bucket (``gradient_as_bucket_view``)."""
    entries = [("settings", "", ", ".join(f"{k}={v!r}" for k, v in settings.items()))]
    for name, p in module.named_parameters():
        layout = ""
        if settings["gradient_as_bucket_view"] and p.requires_grad and p.dtype == torch.float32:
            layout = f", memory order {_memory_order(p)}"
        entries.append(("parameter", name, f"shape {tuple(p.shape)}, {p.dtype}{layout}, "
                                           f"requires_grad={p.requires_grad}"))
    entries += [("buffer", name, f"shape {tuple(b.shape)}, {b.dtype}") for name, b in module.named_buffers()]
    return entries


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()


def _drain_failed_step(wrapper_ref, callback_ref):
    """Run as autograd drops a backward's end-of-step callback: if the step did not finish (the
    backward raised), its calls are waited for now, before the caller sees the error, so that none
    writes into a gradient that is a bucket's view after the caller zeroed it or a later backward
    added to it."""
    wrapper = wrapper_ref()
    if wrapper is not None and wrapper._in_backward and wrapper._step_callback is callback_ref:
        wrapper._refuse_unsent_buckets()  # before the caller can make another call
        for bucket in wrapper._buckets:
            if bucket.work is not None:
                with contextlib.suppress(Exception):  # the step is abandoned anyway
                    bucket.work.wait()


def _apart(tensors):
    """(the tensors that share memory with no other one, those that do): buffers may be views of
    one tensor (a model's rotary tables), which one unflatten must not write twice."""
    shared, reach, widest = set(), -1, None
    for start, end, i in sorted((*_byte_span(t), i) for i, t in enumerate(tensors)):
        if start < reach:
            shared.update((i, widest))
        if end > reach:
            reach, widest = end, i
    return ([t for i, t in enumerate(tensors) if i not in shared],
            [t for i, t in enumerate(tensors) if i in shared])


_copying = contextvars.ContextVar("copying", default=False)


def _named_device(value, device, name):
    """The device ``value`` (an index of ``device``'s type, a name or a torch.device) names; an
    index-less one of ``device``'s type is its type's current device, as for DDP."""
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        raise TypeError(f"{name} must be a device index, a device name or a torch.device, got {type(value).__name__}")
    try:
        named = torch.device(device.type, value) if isinstance(value, int) else torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{name}: {error}") from None
    if named.index is None and named.type == device.type != "cpu":
        named = torch.device(named.type, getattr(torch, named.type).current_device())
    return named


def _check_device_ids(device_ids, output_device, device):
    """DDP's ``device_ids`` and ``output_device``, checked against ``device``, where the module is:
    ([index], index), or (None, None) where neither is given."""
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        raise TypeError(f"device_ids must be None or a list of one device, got {type(device_ids).__name__}")
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids can only be None or hold a single device (one process per device), got "
                         f"{list(device_ids)}")
    if not device_ids:  # DDP takes [] as None
        if output_device is not None:
            raise ValueError(f"output_device={output_device!r} needs device_ids (the module's GPU)")
        return None, None
    if device.type == "cpu":
        raise ValueError(f"device_ids and output_device are for a module on one GPU; this one is on cpu "
                         f"(device_ids={list(device_ids)}): leave them out")
    named = _named_device(device_ids[0], device, "device_ids[0]")
    if named != device:
        raise ValueError(f"device_ids names {named}, but the module's parameters are on {device}; move the module "
                         "to the rank's device first, then wrap it")
    output = _named_device(device_ids[0] if output_device is None else output_device, device, "output_device")
    if output != device:
        raise ValueError(f"output_device names {output}, but the output stays where the module puts it, on "
                         f"{device} (as DDP's does); leave output_device out or name {device}")
    return [device.index], device.index


def _copy_of(module, settings, training):
    """A DataParallel rebuilt from a copy (see DataParallel.__reduce_ex__)."""
    token = _copying.set(True)
    try:
        wrapper = DataParallel(module, **settings)
    finally:
        _copying.reset(token)
    wrapper.training = training  # the module's own modes came with its copy (a frozen BatchNorm's included)
    return wrapper


class DataParallel(torch.nn.Module, Joinable):
    """Wraps ``module`` for data-parallel training over ``process_group`` (None: the default group).

    - At construction every rank must wrap the same model (parameters' and buffers' shapes and
      dtypes, which parameters train) with the same settings (``codec``, ``bucket_cap_mb``,
      ``error_feedback``, ``broadcast_buffers``, ``find_unused_parameters``,
      ``gradient_as_bucket_view``); a ValueError names what differs, as
      DDP's check of shapes does. Then parameters and buffers are broadcast from the group's rank
      0, so every replica starts equal; with ``broadcast_buffers`` (default) buffers are broadcast
      again before every training-mode forward but those that follow a forward made inside
      ``no_sync()`` (once per accumulated step), as DDP does, one broadcast per dtype. Unlike
      DDP's, that broadcast takes the buffers the module holds now (one replaced since wrapping
      too), so they must keep the shapes and dtypes they were wrapped with: a broadcasting
      forward after one changed (a cache grown on demand, a cast after wrapping) raises on the
      ranks where it changed, and the others wait in the broadcast until the group's timeout.
    - ``device_ids`` and ``output_device`` are DDP's, for a module on one GPU:
      ``device_ids=[local_rank]`` must name the device the module is on (DDP does not check), and
      the forward's inputs are moved there as DDP moves them (the tensors in tuples, lists, dicts
      and named tuples; those on another GPU copied on a side stream). ``output_device``
      (default: that device) may name only that device too: the output stays where the module
      puts it, as under DDP, which ignores it. A CPU module takes neither (a ValueError, as from
      DDP); ``device_ids=[]`` is None.
    - Trainable parameters (float32, float16 or bfloat16, with dense gradients) are split into
      buckets of ``bucket_cap_mb`` MiB of fp32 gradients, in reverse registration order (the order
      backward usually produces them; the first bucket is 1 MiB so that communication starts
      early). After the first synchronized step they are rebuilt once, as DDP's are, in the order
      in which that step's gradients arrived on rank 0 (parameters that got none last), so that
      layers registered in another order than they run in overlap too: one broadcast of that
      order, and gradients and residuals move with their parameters. Each
      bucket is packed by one fused flatten kernel and all-reduced by gradsync's ring on the wire
      ``codec``, with fp32 sums at every hop, as soon as its last gradient has been accumulated;
      buckets are issued in the same order on every rank.
      The first synchronized step with each set of buckets verifies that every rank has the same
      buckets and codec; later steps skip that check (a hop of latency per bucket, n-1 hops
      beyond 8 ranks and always over NCCL).
    - ``gradient_as_bucket_view``: as DDP's, the ``.grad`` of each float32 parameter becomes a view
      of its bucket, so that gradients take no memory beside the buckets and are neither copied
      into them nor back (a gradient autograd makes afresh, after ``zero_grad(set_to_none=True)``,
      is copied in once as it arrives), in the parameter's own layout where its elements are dense
      (channels_last). Buckets that hold a float16 or bfloat16 parameter keep the copies. Every
      rank must pass the same, and its float32 parameters must have the same memory order on every
      rank (checked at construction: channels_last on one rank alone would mix elements).
      Gradients are then written while their bucket's call runs: after a backward that raised,
      the next forward waits for that step's calls and zeroes the gradients of the buckets that
      had gone out (their calls wrote into them, and so may the caller have).
    - ``error_feedback``: each bucket keeps the fp32 residual of its compression error and adds
      it to the next step's gradients (see :func:`gradsync.all_reduce`).
    - A parameter that gets no gradient on this rank in a step contributes zeros (or the
      gradient it holds from before); after the step it holds the average over the ranks if any
      rank produced a gradient for it since the last synchronized step (``no_sync()`` included),
      and is left untouched (None stays None, and its error-feedback residual is kept) if none
      did, as with DDP's ``find_unused_parameters=True`` (here with or without the option of that
      name, which changes only when buckets go out): each bucket carries a used flag per
      parameter, so this costs no extra communication. Left at
      that, a bucket holding a parameter this rank does not use goes out at the end of backward
      (and the buckets after it with it; the rebuild puts the parameters the first step left
      unused in the last buckets). ``find_unused_parameters=True`` makes each
      synchronized forward walk the autograd graph of its output, as DDP does, so that a
      parameter the graph does not reach no longer holds its bucket back, and communication
      overlaps backward in steps that leave parameters unused (branches, experts); the walk
      costs a pass over the graph per forward. A parameter the walk missed that gets a gradient
      all the same (used outside the forward, or inside a reentrant checkpoint) raises, as under
      DDP (where that happens on some ranks only, the others fail at the group's timeout, waiting
      for buckets that rank no longer sends). An output the walk cannot look into (it follows
      tensors, lists, tuples, dicts and dataclasses) reaches no trainable parameter: such a step
      waits for every one (the first time with a warning). A parameter frozen after wrapping
      (``requires_grad=False``) does not hold back its bucket and counts as one this rank did not
      use, unless a backward inside ``no_sync()`` gave it a gradient since the last synchronized
      step that it still holds: that gradient then takes part in the step's average. Wrap the
      model once it is final and on its device: a forward after its parameters were moved to
      another device, replaced (``load_state_dict(assign=True)``) or unfrozen raises, unless it
      runs under ``torch.no_grad()`` (as ``torch.func.functional_call`` with other weights may).
    - Hooks registered on the parameters (``register_post_accumulate_grad_hook``: clipping, noise)
      run before gradsync reads the gradient, as they do before DDP's reducer, also when registered
      after wrapping (from the next forward on).
    - A step whose backward raised is abandoned at the next forward or backward (its calls are
      waited for; the buckets it had not sent take their turn as refused calls, so that peers
      whose backward did not raise fail rather than pair those calls with its next ones).
    - ``with model.join():`` trains on uneven inputs, as DDP's ``join()`` does (it is a
      ``torch.distributed.algorithms.join.Joinable``, so ``Join([model, ...])`` works too): a
      rank that has run out of batches shadows the others' buffer broadcasts and all-reduces,
      contributing zero gradients, until every rank has; then every rank takes the parameters (and
      broadcast buffers) of the last rank to finish. Gradients are divided by the group's size
      (``divide_by_initial_world_size=True``) or by the number of ranks still training. Inside
      the context each forward costs one more small all-reduce (which tells the ranks that have
      joined what to shadow). While a rank has joined it shadows one backward per synchronized
      forward: a forward whose backward did not run followed by another, or a second backward of
      one forward (reentrant checkpointing), raises there, and the joined rank fails at the
      group's timeout.
    - Every backward pass that accumulates gradients is a step: a backward of the wrapped module
      called directly communicates too, so every rank must make it (made on some ranks only, it
      pairs with the others' next step: a wrong average, then a timeout; take such gradients with
      ``torch.autograd.grad``, which accumulates none), and reentrant
      activation checkpointing (``use_reentrant=True``) all-reduces once per nested backward pass
      (right, but repeated work; a parameter averaged in an inner pass is left as it is by the
      outer ones, since no rank used it there): prefer ``use_reentrant=False``. A
      parameter whose gradient is accumulated again after its bucket went out in the same step (one
      used in several reentrant checkpoints, or inside one and outside) raises, as DDP does: that
      part of its gradient would not be averaged.
    - ``with model.no_sync():`` backward passes accumulate local gradients without communicating;
      the next synchronized backward averages the accumulated gradients. As with DDP, what counts
      is where the forwards ran, not the backward: a forward made outside ``no_sync()`` (and that
      returned) makes the backward passes after it communicate, every gradient they produce
      included, that of a forward made inside ``no_sync()`` meanwhile too; a forward made inside
      stops that once a synchronized backward has run. Unlike DDP, whose first backward after a
      synchronized forward alone communicates, a second backward before the next forward (of a
      second loss, or ``retain_graph=True``) communicates too, so that no replica keeps gradients
      of its own.
    - ``torch.compile(model)``, or wrapping a compiled module, compiles the wrapped module; this
      wrapper's bookkeeping runs eagerly around it. As for DDP, Dynamo's DDPOptimizer splits the
      compiled forward at bucket boundaries (``bucket_cap_mb``, but never below its 1 MiB first
      bucket), so the compiled backward delivers gradients bucket by bucket and the buckets go out
      while it runs (``torch._dynamo.config.optimize_ddp = False`` keeps one graph). Compiled
      autograd is refused: a ``RuntimeError`` on every rank in the first gradient hook.
    - It is a ``torch.nn.Module``: ``forward`` calls the wrapped module, ``train()``/``eval()``
      reach it, and, as with DDP, ``state_dict()`` keys carry the prefix ``module.`` (save
      ``model.module.state_dict()`` for unprefixed keys); error-feedback residuals are not in it,
      and a checkpoint loaded into the module (``load_state_dict``, of the wrapper or the module,
      DCP's ``set_state_dict``) restarts those of the parameters it writes from zeros, as a new
      process would. As DDP, it can be copied
      (``copy.deepcopy``, an ``AveragedModel``, ``torch.save(model)``) when it runs on the default
      group: the copy wraps a copy of the module with the same settings, without a collective, and
      its residuals start from zeros. Its gradient hooks go with it, as
      DDP's go with its reducer: keep the wrapper while it trains (``net = DataParallel(net).module``
      trains alone); once it is gone, the module trains alone or can be wrapped again. A wrapper
      caught in a reference cycle goes when the cycle collector runs, at its own time on each rank:
      break the cycle, or call ``gc.collect()`` on every rank, before wrapping the module again.
      A module wrapped again while its older wrapper lives (``model = DataParallel(net)`` run
      twice) is averaged by the newer wrapper only: the older one's hooks stop and its forward
      raises. A wrapper that only shares a tied parameter with a newer one, or runs inside it,
      keeps its hooks, as two DDPs would; the buckets of both that hold a parameter they share keep
      copies under ``gradient_as_bucket_view``. ``copy.copy`` raises (use ``copy.deepcopy``).
    """

    def __init__(self, module: torch.nn.Module, *, codec: str = "fp16", bucket_cap_mb: float = 25,
                 process_group: Optional[dist.ProcessGroup] = None, error_feedback: bool = False,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, device_ids=None, output_device=None):
        super().__init__()
        Joinable.__init__(self)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if torch.is_inference_mode_enabled():  # DDP wraps there, then its first backward fails
            raise RuntimeError("gradsync.DataParallel cannot be made inside torch.inference_mode(): its buckets would "
                               "be inference tensors, which no training outside it can write; wrap the module outside "
                               "it")
        _check_codec(codec)
        error_feedback = _check_flag(error_feedback, "error_feedback")
        broadcast_buffers = _check_flag(broadcast_buffers, "broadcast_buffers")
        find_unused_parameters = _check_flag(find_unused_parameters, "find_unused_parameters")
        gradient_as_bucket_view = _check_flag(gradient_as_bucket_view, "gradient_as_bucket_view")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {type(bucket_cap_mb).__name__}")
        if not 0 < bucket_cap_mb < math.inf:
            raise ValueError(f"bucket_cap_mb must be positive and finite, got {bucket_cap_mb!r}")
        lazy = [name for name, t in [*module.named_parameters(), *module.named_buffers()]
                if torch.nn.parameter.is_lazy(t)]
        if lazy:
            raise ValueError(f"gradsync.DataParallel: {lazy[0]!r} is not initialized yet (a lazy module); run a "
                             "forward pass to give the module its shapes before wrapping it")
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("gradsync.DataParallel: the module has no parameters that require gradients")
        for name, p in module.named_parameters():
            if p.requires_grad and p.dtype not in FLOAT_DTYPES:
                raise TypeError(f"gradsync.DataParallel: parameter {name!r} is {p.dtype}; gradsync averages "
                                "float32, float16 and bfloat16 gradients")
        devices = sorted({str(t.device) for t in list(module.parameters()) + list(module.buffers())})
        if len(devices) > 1:
            raise ValueError(f"gradsync.DataParallel: the module's parameters and buffers are on several devices "
                             f"({', '.join(devices)}); move the module to one device first")
        if devices == ["meta"]:  # no values to broadcast: DDP fails on them deep inside its first broadcast
            raise ValueError("gradsync.DataParallel: the module is on the meta device (its parameters hold no "
                             "values); materialize them first (module.to_empty(device=...) and initialize them)")
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for name, t in named:  # a DTensor's buckets would be plain tensors: its gradient lost, or torch's error
                if t.numel() and not _data_ptr(t) and type(t) not in _PLAIN_TENSORS and _storage_nbytes(t) != 0:
                    raise TypeError(f"gradsync.DataParallel: {kind} {name!r} is a {type(t).__name__}, a tensor "
                                    "subclass whose values live in the tensors it wraps, which buckets can neither "
                                    "view nor fill; wrap a module of plain tensors (for tensor-parallel DTensor "
                                    "parameters, DDP with a gradsync hook on the data-parallel group)")
        self.device_ids, self.output_device = _check_device_ids(device_ids, output_device, params[0].device)
        self._copies_on_side_stream = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"  # as DDP's
        self.module = module
        self.codec = codec
        self.process_group = _resolve_group(process_group, "process_group", caller="DataParallel")
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._device = params[0].device
        # what Dynamo's DDPOptimizer reads to split a compiled forward at bucket boundaries, so that
        # the compiled backward delivers gradients bucket by bucket; it refuses buckets smaller than its
        # first (1 MiB)
        self._dynamo_hint = types.SimpleNamespace(
            bucket_bytes_cap=max(int(bucket_cap_mb * 2**20), dist._DEFAULT_FIRST_BUCKET_BYTES))
        self._outer_ddp_module = None  # what the wrapped forward's hint replaced
        self._param_ids = {id(p) for p in module.parameters()}
        self._param_names = {name for name, _ in module.named_parameters()}
        self._trainable_ids = {id(p) for p in params}
        # the fast walk, unless the module's class lists its parameters or buffers its own way
        self._walk_members = [[id(t) for t in ts] for ts in _members(module)] == \
            [[id(p) for p in module.parameters()], [id(b) for b in module.buffers()]]
        self._sync = True  # False inside no_sync()
        self._forward_synced = True  # whether the last forward with gradients ran outside no_sync()
        # a forward outside no_sync() makes the backward passes after it communicate (DDP: only the
        # first), and a forward inside it stops them only once a synchronized step has run since
        self._backward_syncs = True
        self._sync_pending = False  # a forward outside no_sync() whose step has not run yet
        self._backwards = 0  # the synchronized backward passes since the last forward outside no_sync()
        self._later = False  # whether this step's backward is not the first of them
        self._marks = None  # the last step's marks (see _Bucket), until read: (tensor, CUDA event or None)
        self._step_callback = lambda: None  # a weak reference to this step's end-of-step callback
        self._buffers_seen = []  # the module's buffers, as the last forward's check found them
        self._root = dist.get_global_rank(self.process_group, 0)
        self._bucket_cap_mb, self._error_feedback = bucket_cap_mb, error_feedback  # for copies
        if not _copying.get():  # a copy is made on one rank, of a replica that was checked and broadcast
            self._check_replicas(dict(codec=codec, bucket_cap_mb=float(bucket_cap_mb), error_feedback=error_feedback,
                                      broadcast_buffers=broadcast_buffers,
                                      find_unused_parameters=find_unused_parameters,
                                      gradient_as_bucket_view=gradient_as_bucket_view))
            self._broadcast(list(module.parameters()) + list(module.buffers()))
        self._buffer_layouts = [(b.shape, b.dtype) for b in module.buffers()]  # as every rank agreed

        self._shared = set()  # ids of parameters another wrapper averages too: never views of a bucket
        self._make_buckets(list(reversed(params)), error_feedback)
        self._rebuilt = False  # whether the buckets follow the order of a synchronized step's gradients
        self._arrival = []  # ids of the parameters in the order their gradients arrived, until then
        self._next = 0  # the next bucket to issue, in order
        self._arrived = set()  # ids of the parameters whose gradient has arrived in this step
        self._used = set()  # ... or in a backward inside no_sync() since the last synchronized step
        self._abandoned = set()  # ... or in a step abandoned since: used if its gradient is still there
        self._reached = None  # with find_unused_parameters: the leaves this step's forwards reach, else None
        self._walk_failed = False  # a forward of this step whose output the walk could not look into
        self._warned_walk = False
        self._warned_create_graph = False
        self._checked = False  # whether every rank has agreed on the buckets (on the first synced step)
        self._in_backward = False
        self._unsent_refused = False  # whether a step that did not reach its end has refused its unsent buckets
        # under join(): whether each step divides by the group's size, else by the ranks still training
        self._divide_by_initial_world_size = True
        self._announced = None  # the last forward's announcement to the ranks that have joined
        self._step_announced = None  # ... that of the forward whose backward synchronizes next
        self._shadowed = False  # the last synchronized step ran while a rank had joined
        self._prescale = 1.0 / self.process_group.size()  # the factor of this step's all-reduces
        self._shadow = None  # a joined rank's zero buckets
        # the hooks hold the wrapper weakly and go with it, as DDP's do: a module wrapped again, or
        # used bare once its wrapper is gone, is not averaged by a forgotten wrapper too
        self._retired = False  # a newer wrapper averages this one's parameters
        ref = weakref.ref(self)
        _claim(params, ref)
        handles = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad, ref)) for p in params]
        self._grad_hooks = list(zip(params, handles))
        # the tensors that hold the hooks: torch.utils.swap_tensors keeps a parameter's Python object
        # (and id) but gives it another tensor, without them. Their gradient accumulators, held as
        # DDP's reducer holds them, keep them alive, so that no later tensor takes one's address.
        self._hooked_tensor = {id(p): p._cdata for p in params}
        self._grad_accumulators = [torch.autograd.graph.get_gradient_edge(p).node for p in params]
        # a checkpoint loaded into the module starts error feedback afresh, as in a new process
        handles += _ForgetResidualsOnLoad(self).register(module)
        weakref.finalize(self, _remove_hooks, handles)
        weakref.finalize(self, _release, [id(p) for p in params], ref)
        weakref.finalize(self, _drop_hint, self._dynamo_hint)  # left behind by a compiled forward that raised

    def __reduce_ex__(self, protocol):
        """Copies (``copy.deepcopy``, an EMA of the model, ``torch.save(model)``) wrap a copy of the
        module anew, as DDP's do: same settings, the default group, no collective; residuals
        restart from zeros, and hooks registered on the wrapper itself are not copied."""
        if self.process_group is not dist.distributed_c10d._get_default_group():
            raise TypeError("gradsync.DataParallel over a group other than the default one cannot be copied or "
                            "saved (a process group cannot be); copy or save model.module and wrap it again")
        settings = dict(codec=self.codec, bucket_cap_mb=self._bucket_cap_mb, error_feedback=self._error_feedback,
                        broadcast_buffers=self.broadcast_buffers, find_unused_parameters=self.find_unused_parameters,
                        gradient_as_bucket_view=self.gradient_as_bucket_view, device_ids=self.device_ids,
                        output_device=self.output_device)
        return _copy_of, (self.module, settings, self.training)

    def __copy__(self):
        raise TypeError("copy.copy of a gradsync.DataParallel would wrap the same module a second time; use "
                        "copy.deepcopy (a copy of the module, wrapped anew)")

    def _check_replicas(self, settings):
        """Every rank must wrap the same model with the same settings: two small all-reduces (the
        numbers of parameters and buffers, then a checksum per entry), before anything is broadcast
        (a broadcast of flattened tensors would not notice two shapes of one size)."""
        entries = _signature(self.module, settings)
        counts = [sum(1 for kind, _, _ in entries if kind == k) for k in ("parameter", "buffer")]
        highest, lowest = self._extremes(counts)  # the sums' lengths first: one all-reduce must match in size
        for k, kind in enumerate(("parameters", "buffers")):
            if highest[k] != lowest[k]:
                raise ValueError(f"gradsync.DataParallel: the ranks wrap different models: the number of {kind} "
                                 f"differs across ranks (here {counts[k]}; between {lowest[k]} and {highest[k]}). "
                                 "Every rank must build the same model")
        # names stay out of the sums: a rank whose module was compiled names its parameters "_orig_mod.*"
        highest, lowest = self._extremes([zlib.crc32(f"{kind}: {what}".encode()) for kind, _, what in entries])
        differ = [i for i, (a, b) in enumerate(zip(highest, lowest)) if a != b]
        if differ:
            kind, name, what = entries[differ[0]]
            name = "the wrapper's settings" if kind == "settings" else f"{kind} {name!r}"
            raise ValueError(f"gradsync.DataParallel: the ranks wrap different models: {name} differs across ranks "
                             f"(here: {what}){f', and {len(differ) - 1} more' if len(differ) > 1 else ''}. Every rank "
                             "must build the same model, in the same memory format, with the same settings")

    def _extremes(self, values):
        """(the highest, the lowest) of each of these integers across the group: one all-reduce."""
        values = torch.tensor(values, dtype=torch.int64)
        extremes = torch.cat([values, -values]).to(self._device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.process_group)
        highest, negated_lowest = extremes.cpu().view(2, -1).tolist()
        return highest, [-v for v in negated_lowest]

    def _make_buckets(self, params, error_feedback, residuals=None):
        """Buckets of ``params`` in this order (the first of at most 1 MiB), each gradient that is a
        bucket's view moved into it, and each residual given (parameter id -> its segment) copied."""
        self._buckets, self._bucket_of, self._index_of = [], {}, {}
        cap = max(1, int(self._bucket_cap_mb * 2**20))
        limit, current, size = min(cap, _FIRST_BUCKET_BYTES), [], 0
        for p in params:
            current.append(p)
            size += 4 * p.numel()
            if size >= limit:
                self._add_bucket(current, error_feedback)
                current, size, limit = [], 0, cap
        if current:
            self._add_bucket(current, error_feedback)
        for bucket in self._buckets:
            for j, p in enumerate(bucket.params):
                if residuals is not None:
                    bucket.segment(j, bucket.residual).copy_(residuals[id(p)])
                if bucket.views is not None and p.grad is not None:
                    bucket.adopt(j)

    def _rebuild_buckets(self):
        """Once, after the first synchronized step, as DDP does: the buckets in the order in which
        rank 0's gradients arrived (the parameters that got none after them, in the old order), so
        that a model whose layers run in another order than they were registered in overlaps too.
        One broadcast of that order; gradients and residuals move with their parameters."""
        self._rebuilt = True
        params = [p for b in self._buckets for p in b.params]
        position = {id(p): i for i, p in enumerate(params)}
        arrived = list(dict.fromkeys(position[i] for i in self._arrival if i in position))
        self._arrival = []
        order = torch.tensor(arrived + sorted(set(range(len(params))) - set(arrived)), device=self._device)
        dist.broadcast(order, src=self._root, group=self.process_group)
        order = order.tolist()
        if order == list(range(len(params))):
            return
        error_feedback = self._buckets[0].residual is not None
        old_buffers = [b.buffer for b in self._buckets if b.views is not None]
        with torch.no_grad():
            residuals = {id(p): b.segment(j, b.residual) for b in self._buckets for j, p in enumerate(b.params)} \
                if error_feedback else None
            self._make_buckets([params[i] for i in order], error_feedback, residuals)
            for p in params:  # a view of an old bucket whose new one keeps copies: its own memory, not the old bucket's
                if p.grad is not None and any(p.grad._base is buffer for buffer in old_buffers):
                    p.grad = p.grad.clone()
        self._shadow = None
        self._checked = False  # the new buckets are checked once, as the first ones were

    def _add_bucket(self, params, error_feedback):
        as_views = self.gradient_as_bucket_view and not any(id(p) in self._shared for p in params)
        bucket = _Bucket(params, self._device, error_feedback, as_views)
        for j, p in enumerate(params):
            self._bucket_of[id(p)] = bucket  # ids: a tensor's own __hash__ runs in Python
            self._index_of[id(p)] = j
        self._buckets.append(bucket)

    def _share(self, ids):
        """``ids``: parameters that another wrapper with live hooks averages too (see ``_claim``)."""
        self._shared |= ids
        for bucket in self._buckets:
            if any(id(p) in ids for p in bucket.params):
                bucket.drop_views()

    def _check_buffers(self, buffers):
        """Each rank broadcasts the buffers as it holds them, so they must keep the shapes and dtypes
        every rank agreed on at wrapping: a buffer grown on one rank would take part of another's values."""
        if [(b.shape, b.dtype) for b in buffers] == self._buffer_layouts:
            return
        now = list(self.module.named_buffers())
        changed = f"the module has {len(now)} buffers but had {len(self._buffer_layouts)}"
        if len(now) == len(self._buffer_layouts):  # else buffers cannot be paired by their place
            changed = next(f"buffer {name!r} is {tuple(b.shape)} {b.dtype} but was {tuple(shape)} {dtype}"
                           for (name, b), (shape, dtype) in zip(now, self._buffer_layouts)
                           if (b.shape, b.dtype) != (shape, dtype))
        raise RuntimeError(f"gradsync.DataParallel: {changed} when it was wrapped. Buffers are broadcast from one "
                           "rank before every training forward, so every rank must keep them as they were wrapped; "
                           "give buffers their final size before wrapping, or pass broadcast_buffers=False")

    def _broadcast(self, tensors, src=None, keep_versions=False):
        """The tensors, from ``src`` (global rank): one broadcast per dtype, and one per tensor that
        shares memory with another. ``keep_versions`` (the buffers before a forward, as DDP) leaves
        autograd's version counters as they were: a buffer saved for backward by one forward
        (BatchNorm's running statistics, two forwards before one backward) is rewritten before the
        next one."""
        src = self._root if src is None else src
        receives = dist.get_rank() != src  # the source's tensors already hold the values
        by_dtype = {}
        for t in tensors:
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t.detach())  # the same version counter
        for dtype, group in by_dtype.items():
            data, aliased = _apart(group)
            kept = tuple(t for t in group if not t.is_inference()) if keep_versions else ()
            with torch.autograd._unsafe_preserve_version_counter(kept):
                if data:  # one broadcast per dtype; the fused kernels take floats, torch.cat the rest (step counts)
                    fused = dtype in FLOAT_DTYPES
                    flat = flatten(data) if fused else torch.cat([t.reshape(-1) for t in data])
                    dist.broadcast(flat, src=src, group=self.process_group)
                    if fused and receives:
                        unflatten(flat, data)
                    elif receives:
                        for t, part in zip(data, flat.split([t.numel() for t in data])):
                            t.copy_(part.view(t.shape))
                for t in aliased:  # each takes the source's values, whatever the others wrote
                    dense = t if t.is_contiguous() else t.contiguous()
                    dist.broadcast(dense, src=src, group=self.process_group)
                    if dense is not t and receives:
                        t.copy_(dense)

    @property
    def buckets(self):
        """The parameters of each bucket, in the order buckets are all-reduced."""
        return [list(b.params) for b in self._buckets]

    # Under torch.compile the wrapped module is compiled and the bookkeeping around it runs eagerly,
    # on real tensors (its collectives, and the walk of the output's autograd graph), as with DDP.
    def forward(self, *args, **kwargs):
        self._before_forward()
        try:
            if self.device_ids and (args or kwargs):
                args, kwargs = self._moved_to_device(args, kwargs)
            output = self.module(*args, **kwargs)
        except BaseException:
            self._take_hint_back()
            raise
        self._after_forward(output)
        return output

    def _hand_hint_to_dynamo(self):
        """Makes the hint what Dynamo's DDPOptimizer reads while the wrapped forward is compiled, as
        DDP's forward and torch's composable replicate() do, keeping what it replaces (unless a
        compiled forward that raised left the hint itself behind)."""
        active = DistributedDataParallel._active_ddp_module
        DistributedDataParallel._active_ddp_module = self._dynamo_hint
        if active is not self._dynamo_hint:
            self._outer_ddp_module = active

    def _take_hint_back(self):
        DistributedDataParallel._active_ddp_module, self._outer_ddp_module = self._outer_ddp_module, None

    @_eager_under_compile
    def _moved_to_device(self, args, kwargs):
        """The forward's inputs on the module's device, as DDP moves them where ``device_ids`` is given
        (torch's own helper: the tensors in tuples, lists, dicts and named tuples)."""
        moved_args, moved_kwargs = _to_kwargs(args, kwargs, self._device, self._copies_on_side_stream)
        return moved_args[0], moved_kwargs[0]

    @_eager_under_compile
    def _before_forward(self):
        self._check_parameters(swaps_allowed=not torch.is_grad_enabled())
        self._check_marks()
        if self._step_failed():
            self._abandon_step()
        broadcasts = self._broadcasts_buffers()
        if self._join_config.enable:
            self._check_one_backward_per_forward()  # before any collective of this forward
            Join.notify_join_context(self)
            self._announced = self._announce(joined=False, broadcasts=broadcasts)
        if torch.is_grad_enabled():
            self._forward_synced = self._sync
            self._hooks_last()
        if broadcasts:
            self._check_buffers(self._buffers_seen)
            self._broadcast(self._buffers_seen, self._announced.source if self._join_config.enable else None,
                            keep_versions=True)
        self._hand_hint_to_dynamo()

    @_eager_under_compile
    def _after_forward(self, output):
        self._take_hint_back()
        if torch.is_grad_enabled():  # once the forward returned: one that raised changes nothing
            if self._sync:
                self._backward_syncs = self._sync_pending = True
                self._backwards = 0
            elif not self._sync_pending:
                self._backward_syncs = False
        if self.find_unused_parameters and self._backward_syncs and torch.is_grad_enabled():
            reached = _reached_leaves(output)
            if not reached & self._trainable_ids:  # an output the walk cannot look into: wait for every one
                self._walk_failed = True
                if not self._warned_walk:
                    self._warned_walk = True
                    warnings.warn(f"gradsync.DataParallel(find_unused_parameters=True): the forward's output "
                                  f"({type(output).__name__}) reaches no trainable parameter (the walk follows "
                                  "tensors, lists, tuples, dicts and dataclasses); in such steps buckets wait for "
                                  "every parameter", stacklevel=_caller_stacklevel())
            self._reached = None if self._walk_failed else reached | (self._reached or set())

    def _hooks_last(self):
        """Moves each parameter's averaging hook behind the post-accumulate-grad hooks registered on it
        since (a hook that clips or adds noise to .grad in place): as DDP's reducer, gradsync then
        reads the gradient those hooks leave, and no hook edits a gradient its bucket is sending."""
        for param, handle in self._grad_hooks:
            hooks = param._post_accumulate_grad_hooks  # torch's dict of them by handle id, run in its order
            if hooks is not None and next(reversed(hooks)) != handle.id and handle.id in hooks:
                hooks[handle.id] = hooks.pop(handle.id)  # autograd reads the dict's own order: not move_to_end's

    def _broadcasts_buffers(self):
        """Before a training forward, unless the last one was made inside no_sync(): once per step. The
        module's own mode counts (it may be set through the module rather than this wrapper)."""
        return (self.broadcast_buffers and self.module.training and torch.is_grad_enabled() and self._forward_synced
                and bool(self._buffers_seen))

    def _check_parameters(self, swaps_allowed=False):
        """swaps_allowed: a forward that trains nothing may run on parameters swapped in for it
        (torch.func.functional_call under no_grad, as with DDP)."""
        if self._retired:
            raise RuntimeError("gradsync.DataParallel: the module was wrapped again, and the newer wrapper averages its "
                               "gradients; train through that one")
        params, self._buffers_seen = _members(self.module) if self._walk_members else \
            (list(self.module.parameters()), list(self.module.buffers()))
        if {id(p) for p in params} == self._param_ids and all(p.device == self._device for p in params) and \
                all(id(p) in self._trainable_ids for p in params if p.requires_grad) and \
                all(p._cdata == self._hooked_tensor.get(id(p), p._cdata) for p in params):
            if not all(p.dtype == torch.float32 for b in self._buckets if b.views is not None for p in b.params):
                raise RuntimeError("gradsync.DataParallel: a parameter whose gradient is a view of its fp32 bucket "
                                   "(gradient_as_bucket_view=True) changed its dtype after wrapping; cast the module "
                                   "first, then wrap it")
            odd = next((p for p in params if p.requires_grad and p.dtype not in FLOAT_DTYPES), None)
            if odd is None or swaps_allowed:
                return
            raise RuntimeError(f"gradsync.DataParallel: parameter {self._name(odd)!r} became {odd.dtype} after the "
                               "module was wrapped (module.double(), say); gradsync averages float32, float16 and "
                               "bfloat16 gradients")
        if swaps_allowed:
            return
        raise RuntimeError(f"gradsync.DataParallel: {self._first_change(params)} after the module was wrapped, and "
                           "gradsync would not average it; move the module, load its weights and choose its trainable "
                           "parameters first, then wrap it. torch.func.functional_call swaps parameters too: call it "
                           "under torch.no_grad(), or on model.module")

    def _forget_residuals(self, written):
        for bucket in self._buckets:
            for j, p in enumerate(bucket.params):
                if id(p) in written:
                    if bucket.residual is not None:
                        bucket.segment(j, bucket.residual).zero_()
                    bucket.saved_residuals.pop(j, None)

    def _first_change(self, params):
        names = {id(p): name for name, p in self.module.named_parameters()}
        for p in params:
            name = names.get(id(p), "(unnamed)")
            if p.device != self._device:
                return f"parameter {name!r} is on {p.device}, its bucket on {self._device}"
            if id(p) not in self._param_ids and name not in self._param_names:
                return f"parameter {name!r} was added"
            if id(p) not in self._param_ids:
                return f"parameter {name!r} was replaced (a new tensor, as load_state_dict(assign=True) makes)"
            if p.requires_grad and id(p) not in self._trainable_ids:
                return f"parameter {name!r} was unfrozen (requires_grad set)"
            if p._cdata != self._hooked_tensor.get(id(p), p._cdata):
                return (f"parameter {name!r} was swapped for another tensor, which has none of gradsync's gradient "
                        "hooks (torch.utils.swap_tensors: load_state_dict, .to() or .half() under "
                        "torch.__future__.set_swap_module_params_on_conversion(True))")
        return "a parameter was removed from the module"

    @contextlib.contextmanager
    def no_sync(self):
        """The backward passes of forwards made inside accumulate local gradients and communicate nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context manager for training on uneven inputs, as ``DistributedDataParallel.join()``.

        Wrap the training loop in it: a rank whose batches run out keeps shadowing the others'
        buffer broadcasts and all-reduces with zero gradients until every rank has run out; then
        every rank takes the parameters (and, with ``broadcast_buffers``, the buffers) of the last
        rank to finish, the highest of them on a tie.

        ``divide_by_initial_world_size``: divide gradients by the group's size (default: each
        sample weighs the same in every step), else by the number of ranks still training.
        ``throw_on_early_termination``: every rank raises once one has run out instead. ``enable``:
        False turns it off. Another collective in the loop (SyncBatchNorm, a metric's all-reduce)
        is not shadowed: use ``throw_on_early_termination=True`` there.
        """
        enable = _check_flag(enable, "enable")
        throw_on_early_termination = _check_flag(throw_on_early_termination, "throw_on_early_termination")
        return _Join([self], enable, throw_on_early_termination,
                     divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook with which ``torch.distributed.algorithms.join.Join`` makes a rank that has run out
        of inputs shadow the others (keyword: ``divide_by_initial_world_size``, default True)."""
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _check_one_backward_per_forward(self):
        """Under join(), while a rank has joined, it shadows one backward per synchronized forward."""
        if not (torch.is_grad_enabled() and self._sync):
            return
        previous, self._step_announced = self._step_announced, None
        if previous is not None and len(previous.active) < self.process_group.size():
            raise RuntimeError("gradsync.DataParallel under join(): a synchronized forward followed another whose "
                               "backward did not run (or raised) while a rank had joined, and that rank waits to "
                               "shadow it. Run other forwards under torch.no_grad() or no_sync()")

    def _announce(self, joined, broadcasts=False):
        """Under join(), before a forward's own communication: tells the ranks that have joined (they
        send zeros) whether this forward broadcasts buffers, whether its backward synchronizes and
        whether it ran with gradients, and every rank which ranks still train."""
        group = self.process_group
        flags = torch.zeros(3 + group.size())
        sync = not joined and torch.is_grad_enabled() and self._sync
        if not joined:
            flags[0], flags[1], flags[2] = float(sync), float(broadcasts), float(torch.is_grad_enabled())
            flags[3 + group.rank()] = 1.0
        flags = flags.to(self._device)
        announced = _Announcement(dist.all_reduce(flags, group=group, async_op=True), flags, group)
        if sync:
            self._step_announced = announced
        return announced

    def _leave_join(self):
        """The join context's end: forwards announce nothing more."""
        self._join_config = type(self._join_config).construct_disabled_join_config()
        self._announced = self._step_announced = self._shadow = None
        self._shadowed = False

    def _shadow_iteration(self):
        """A joined rank's part in the others' forward and backward, as their announcement says."""
        self._check_parameters()
        announced = self._announce(joined=True)
        if announced.with_grad:  # the others' next forward broadcasts buffers, or not, as this one's does
            self._forward_synced = announced.synchronizes
        if announced.broadcasts:
            self._check_buffers(self._buffers_seen)
            self._broadcast(self._buffers_seen, announced.source, keep_versions=True)
        if not announced.synchronizes:
            return
        ranks = self.process_group.size() if self._divide_by_initial_world_size else len(announced.active)
        if self._shadow is None:
            self._shadow = torch.empty(max(b.buffer.numel() for b in self._buckets), device=self._device)
        for bucket in self._buckets:  # in the others' order; zero gradients and zero used flags
            zeros = self._shadow[:bucket.buffer.numel()].zero_()
            _issue(zeros, self.codec, self.process_group, 1.0 / ranks, 1.0, not self._checked, None).wait()
        self._checked = True
        self._rebuilt, self._arrival = True, []  # as the others, who keep their buckets in a shadowed step

    def _sync_final_model(self, is_last_joiner):
        group = self.process_group
        last = torch.tensor([group.rank() if is_last_joiner else -1], device=self._device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group)
        buffers = list(self.module.buffers()) if self.broadcast_buffers else []
        if buffers:
            self._check_buffers(buffers)
        self._broadcast(list(self.module.parameters()) + buffers, dist.get_global_rank(group, int(last.item())))
        self._leave_join()

    def _on_grad(self, param):
        if _under_compiled_autograd():  # raised on every rank, before anything is sent
            raise RuntimeError(
                "gradsync.DataParallel does not run under compiled autograd (torch._dynamo.config.compiled_autograd"
                "=True): its gradient hooks hand each bucket to gradsync's own thread and end the step with an "
                "autograd callback, which a compiled backward graph cannot hold. Turn compiled autograd off: "
                "torch.compile(gradsync.DataParallel(net)) still compiles forward and backward, and sends the buckets "
                "while the compiled backward runs")
        if param.grad is not None and param.grad.layout != torch.strided:
            raise RuntimeError(f"gradsync.DataParallel: parameter {self._name(param)!r} has a {param.grad.layout} "
                               "gradient; gradsync averages dense gradients only (e.g. torch.nn.Embedding(..., "
                               "sparse=False))")
        if param.grad is not None and param.grad.requires_grad and not self._warned_create_graph:
            self._warned_create_graph = True
            warnings.warn("gradsync.DataParallel: backward(create_graph=True): the averages are written into .grad "
                          "outside autograd, so a graph through them (a gradient penalty) differentiates this rank's "
                          "own gradient, not the average (DDP warns likewise)")
        bucket, j = self._bucket_of[id(param)], self._index_of[id(param)]
        if self._step_failed():  # the backward before this one raised
            kept = param.grad.clone() if bucket.views is not None and bucket.work is not None and bucket.holds(j) \
                else None
            self._abandon_step()
            if kept is not None:  # this backward's gradient, accumulated into the view the abandon zeroes
                with torch.no_grad():
                    bucket.view(j).copy_(kept)
        if bucket.views is not None and bucket.work is None:
            bucket.adopt(j)
        if not self._backward_syncs:
            self._used.add(id(param))
            return
        if not self._in_backward:
            self._start_step()
            for b in self._buckets:  # a parameter frozen since wrapping, or not reached, gets none to wait for
                b.expected = sum(1 for p in b.params if p.requires_grad and self._reaches(p))
        if id(param) in self._arrived:  # accumulated again within the step: a nested (reentrant) backward
            if bucket.work is not None:
                raise RuntimeError(
                    f"gradsync.DataParallel: parameter {self._name(param)!r} received more gradient after its bucket "
                    "was all-reduced in this backward pass, which would leave that part unaveraged: it is used in "
                    "several reentrant activation checkpoints, or inside one and outside it. Use "
                    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
            return  # its bucket has not gone out: the flatten will read the whole sum
        if not self._reaches(param):  # raised whether or not its bucket went out: the same on every rank
            raise RuntimeError(
                f"gradsync.DataParallel: parameter {self._name(param)!r} received a gradient, but "
                "find_unused_parameters=True found it unreachable from the forward's output, so its bucket does not "
                "wait for it (it is used outside the wrapped forward, in a forward under no_sync() made before "
                "the step's synchronized forward whose output this backward runs through too, inside a "
                "reentrant activation checkpoint, or the output holds it in a type other than tensors, lists, "
                "tuples, dicts and dataclasses). Use it inside the forward, backward each no_sync() forward within "
                "no_sync(), torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or "
                "find_unused_parameters=False")
        self._arrived.add(id(param))
        if not self._rebuilt:
            self._arrival.append(id(param))
        bucket.ready += 1
        self._issue(force=False)

    def _start_step(self):
        self._check_marks()
        self._later, self._backwards = self._backwards > 0, self._backwards + 1
        ranks = self.process_group.size()
        announced, self._step_announced = self._step_announced, None  # this step's: one per forward
        if self._join_config.enable:
            if announced is None and self._shadowed:
                raise RuntimeError("gradsync.DataParallel under join(): a second synchronized backward of one forward "
                                   "(reentrant activation checkpointing, or backward(retain_graph=True) run again) "
                                   "while a rank has joined, which shadows one backward per forward. Use "
                                   "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
            self._shadowed = announced is not None and len(announced.active) < ranks
            if announced is not None and not self._divide_by_initial_world_size:
                ranks = len(announced.active)
        self._prescale = 1.0 / ranks
        self._in_backward = True
        finish = self._finish_backward  # autograd holds it until the backward ends, whether it runs or not
        self._step_callback = weakref.ref(finish)
        drain = weakref.finalize(finish, _drain_failed_step, weakref.ref(self), self._step_callback)
        drain.atexit = False  # a step cut short by the interpreter's exit has nothing left to protect
        torch.autograd.Variable._execution_engine.queue_callback(finish)

    def _step_failed(self):
        """Whether this step's backward ended without reaching its end (it raised): it is over, or
        autograd dropped its end-of-step callback with it."""
        return self._in_backward and (torch._C._current_graph_task_id() == -1 or self._step_callback() is None)

    def _reaches(self, param):
        return self._reached is None or id(param) in self._reached

    def _name(self, param):
        return next((n for n, q in self.module.named_parameters() if q is param), "?")

    def _abandon_step(self):
        """A step that did not reach its end: its calls finish before its buffers are reused. What it
        accumulated counts as used at the next synchronized step, unless its gradient was set to None
        since (the batch skipped). The residuals of its calls are not restored: error feedback drops
        that step's old error. Gradients that are views of a bucket whose call ran are zeroed: the
        call wrote into them, while the backward or the caller may have written too."""
        self._refuse_unsent_buckets()
        for bucket in self._buckets:
            if bucket.work is not None:
                with contextlib.suppress(Exception):
                    bucket.work.wait()
                if bucket.views is not None:
                    with torch.no_grad():
                        bucket.buffer.zero_()
                    self._arrived -= {id(p) for p in bucket.params}
        self._abandoned |= self._arrived
        self._arrival = []  # the order of a step that did not reach its end
        self._reset()

    def _refuse_unsent_buckets(self):
        """The buckets a step that did not reach its end had not sent take their turn as refused
        calls, before any later call of this rank: peers whose backward reached its end sent them,
        and would otherwise pair those calls with this rank's next ones. At a bucket's first call,
        which every rank checks, the peers then raise naming this rank; later calls are not checked,
        so the peers fail at the group's timeout rather than sum another step, as do this rank's
        next calls, queued behind the refusals. Where every rank's backward raised alike, every
        rank refuses the same buckets, which fails nothing. Nothing waits for the refusals here, nor
        does the process's exit, where the peers' calls went unchecked: its end fails them at once."""
        if not self._in_backward or self._unsent_refused:
            return
        self._unsent_refused = True
        for k, bucket in enumerate(self._buckets):
            if bucket.work is None:
                with contextlib.suppress(Exception):  # a refusal raises at its wait(), which nothing calls
                    _refusal(self.process_group, bucket.buffer, checked=True, op=_ALL_REDUCE,
                             peers_unchecked=self._checked,
                             why=f"gradsync.DataParallel: rank {self.process_group.rank()}'s backward ended before it "
                                 f"sent bucket {k} of the step (it raised there), and the step is abandoned")

    def _reset(self):
        for bucket in self._buckets:
            bucket.ready, bucket.work, bucket.unused = 0, None, []
            bucket.saved_residuals.clear()
            bucket.saved_grads.clear()
        self._next = 0
        self._arrived.clear()
        self._reached = None
        self._walk_failed = False
        self._in_backward = False
        self._unsent_refused = False
        self._sync_pending = False

    def _issue(self, force):
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if not force and bucket.ready < bucket.expected:
                return
            bucket.unused = [j for j, p in enumerate(bucket.params) if not self._used_here(p)]  # in order
            if bucket.views is None:
                flatten([p.grad if p.grad is not None else torch.zeros_like(p)
                         for p in bucket.params], dtype=torch.float32, out=bucket.buffer[:bucket.numel])
            else:
                self._fill_views(bucket)
            bucket.set_flags(bucket.unused, self._later)
            if bucket.residual is not None:
                bucket.residual[bucket.flags_at:].zero_()  # the flags' own rounding must not make a 0 a 1 next step
                # a parameter no rank uses gets nothing, so its residual must outlive the call unpaid
                bucket.saved_residuals = {j: bucket.segment(j, bucket.residual).clone() for j in bucket.unused}
            bucket.work = _issue(bucket.buffer, self.codec, self.process_group, self._prescale, 1.0,
                                 not self._checked, bucket.residual)
            self._next += 1

    @staticmethod
    @torch.no_grad()
    def _fill_views(bucket):
        """The buffer of a bucket whose gradients are its views, as the flatten would fill another."""
        unused = set(bucket.unused)
        for j, p in enumerate(bucket.params):
            if j in unused and not p.requires_grad and p.grad is not None:
                # frozen since wrapping, not used here: its gradient goes out, and stays out of the
                # buffer unless some rank used it (then the average is written into its view)
                if bucket.holds(j):
                    p.grad = p.grad.clone()
                bucket.view(j).copy_(p.grad)
            elif j in unused and p.grad is None:
                bucket.view(j).zero_()  # and the gradient stays None unless some rank used it
            else:
                bucket.adopt(j)  # its hook did, unless the gradient was set since
                if j in unused:  # kept as it is if no rank used it
                    bucket.saved_grads[j] = bucket.view(j).clone()

    def _used_here(self, p):
        """A parameter frozen since wrapping is one this rank did not use, unless a backward inside
        no_sync() (or one abandoned) gave it a gradient that it still holds: every rank then gets the
        average, which that gradient is part of."""
        if not p.requires_grad and p.grad is None:
            return False
        return id(p) in self._arrived or id(p) in self._used or (id(p) in self._abandoned and p.grad is not None)

    def _finish_backward(self):
        try:
            self._issue(force=True)
            for bucket in self._buckets:
                bucket.work.wait()
            self._take_marks()
            # the flags are read (one copy to the host) only where a parameter may have no gradient to
            # write: this rank did not use it, or its gradient was set to None since it did
            unsure = {}
            for b in self._buckets:
                unused = set(b.unused)
                indices = [j for j, p in enumerate(b.params) if j in unused or p.grad is None]
                if indices:
                    unsure[b] = indices
            flags = torch.cat([b.buffer[b.flags_at:b.marks_at] for b in unsure]).tolist() if unsure else []
            at = 0
            for bucket in self._buckets:
                unused_everywhere = set()
                if bucket in unsure:
                    unused_everywhere = {j for j in unsure[bucket] if flags[at + j] == 0}
                    at += len(bucket.params)
                self._write_back(bucket, unused_everywhere)
            self._checked = True
        except BaseException:
            self._abandon_step()
            raise
        self._used.clear()
        self._abandoned.clear()
        self._reset()
        if not self._rebuilt:
            if self._shadowed:  # a rank has joined, and would not know to take part: keep these buckets
                self._rebuilt, self._arrival = True, []
            else:
                self._rebuild_buckets()

    def _take_marks(self):
        """The marks of the step's last call, read now on the CPU; on a GPU at the next forward or
        backward, as reading them at this backward's end would wait for the call."""
        bucket = self._buckets[-1]
        marks = bucket.buffer[bucket.marks_at:]
        if not marks.is_cuda:
            self._marks = (marks, None)
            self._check_marks()
            return
        done = torch.cuda.Event()
        self._marks = (marks.to("cpu", non_blocking=True), done)  # on the current stream of the marks' device
        done.record(torch.cuda.current_stream(marks.device))

    def _check_marks(self):
        """Raises where some ranks sent the last step's calls from the first backward of a forward and
        others from a later one: every rank of the call reads the same averages, so every one raises."""
        if self._marks is None:
            return
        (marks, done), self._marks = self._marks, None
        if done is not None:
            done.synchronize()
        first, later = marks.tolist()
        if first != 0.0 and later != 0.0:
            raise RuntimeError(
                "gradsync.DataParallel: the ranks' all-reduces of the last step paired different backward passes: "
                "on some ranks the first backward after a forward of the wrapper, on others a later one of the "
                "same forward (a backward made on some ranks only, such as a diagnostic backward, or one of the "
                "wrapped module called directly, pairs its all-reduces with the others' next step). Those "
                "gradients mix two steps, and each later step would too; make the same backward passes on every "
                "rank, or take such gradients with torch.autograd.grad, which accumulates none. (Where every rank "
                "makes several backward passes of one forward, a forward of the wrapper with gradients made on some "
                "ranks only in between counts as the forward of the next ones: make it on model.module)")

    @torch.no_grad()
    def _write_back(self, bucket, unused_everywhere):
        """The averages into the gradients, but for the parameters no rank used, which keep the
        gradient they have (None stays None) and their residual."""
        if bucket.views is not None:
            for j, p in enumerate(bucket.params):
                if j in unused_everywhere:
                    if j in bucket.saved_grads:
                        bucket.view(j).copy_(bucket.saved_grads[j])
                    if j in bucket.saved_residuals:
                        bucket.segment(j, bucket.residual).copy_(bucket.saved_residuals[j])
                elif p.grad is not None and p.grad.requires_grad:  # with its graph (see adopt)
                    p.grad.copy_(bucket.view(j))
                elif not bucket.holds(j):
                    p.grad = bucket.view(j)
            return
        run = []  # consecutive parameters written by one unflatten

        def flush(end):
            if run:
                unflatten(bucket.buffer[bucket.offsets[run[0]]:bucket.offsets[end]],
                          [bucket.params[j].grad for j in run])
                run.clear()

        for j, p in enumerate(bucket.params):
            if j in unused_everywhere:
                flush(j)
                if j in bucket.saved_residuals:
                    bucket.segment(j, bucket.residual).copy_(bucket.saved_residuals[j])
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p)
            run.append(j)
        flush(len(bucket.params))
