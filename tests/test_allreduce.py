"""gradsync.all_reduce on real processes over gloo: accuracy against fp64, bitwise agreement
across ranks, subgroups, async calls, and every failure path."""
import contextlib
import datetime
import fractions
import hashlib
import itertools
import os
import random
import signal
import subprocess
import sys
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import gradsync
from distributed_harness import World, run_processes
from gradsync.distributed import _refusal_device, resolve_scales

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# unit roundoff of each wire format, and its absolute floor: half the smallest subnormal, for fp8
# times the block's scale d <= max(2a/FMAX, 2^-126), a the block's largest value (see README)
WIRE_U = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "fp16": 2.0**-11, "bf16": 2.0**-8,
          "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
FLOOR = {"float32": 2.0**-150, "bfloat16": 2.0**-134, "float16": 2.0**-25, "fp16": 2.0**-25, "bf16": 2.0**-134,
         "fp8_e4m3": 2.0**-10, "fp8_e5m2": 2.0**-17}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def rank_input(rank, numel, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    # gradient-like: magnitudes spread over a few decades, so that blocks differ in scale
    x = torch.randn(numel, generator=g) * torch.pow(10.0, torch.empty(numel).uniform_(-3, 1, generator=g))
    return x.to(dtype)


def digest(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def error_ratio(result, inputs, codec, op, dtype_name, size, sums=None, prescale=None, encodes=None):
    """max over elements of |result - fp64 reference| / (README's bound); <= 1 passes. ``sums``:
    (sum, sum of magnitudes) of the inputs in fp64, when already computed; ``prescale``: the call's,
    when it gave one; ``encodes``: how many times a partial sum goes through the wire format (an
    all-reduce's ``size``, a reduce-scatter's ``size - 1``)."""
    meaning = 1.0 / size if str(op).lower().endswith("avg") else 1.0  # a prescale changes the rounding only
    prescale, postscale = resolve_scales(op, size, prescale)  # the split of that factor, which the bound follows
    encodes = size if encodes is None else encodes
    if sums is None:
        xs = torch.stack([x.double() for x in inputs])
        sums = xs.sum(0), xs.abs().sum(0)
    ref = meaning * sums[0]
    s = abs(prescale) * sums[1]  # what the partial sums can reach
    wire = dtype_name if codec == "none" else codec
    wire_u = 0.0 if wire == "float32" else WIRE_U[wire]  # an fp32 wire carries fp32 sums unrounded
    floor = torch.zeros_like(s)
    if codec in FP8_MAX:
        blocks = torch.nn.functional.pad(s, (0, -s.numel() % 128)).view(-1, 128).amax(1)
        scales = torch.clamp(2 * blocks / FP8_MAX[codec], min=2.0**-126)
        floor = FLOOR[codec] * scales.repeat_interleave(128)[: s.numel()]
    elif wire != "float32":
        floor = torch.full_like(s, FLOOR[wire])
    # the postscale's product, rounded to the tensor's dtype, subnormals included
    u_out, floor_out = WIRE_U[dtype_name], FLOOR[dtype_name]
    # size fp32 roundings (the prescale's product, size - 1 additions) and one wire rounding per encode
    bound = postscale * (encodes * (wire_u * s + floor) + size * (2.0**-24 * s + 2.0**-150)) + \
        u_out * ref.abs() + floor_out
    return float(((result.double() - ref).abs() / bound).max()) if result.numel() else 0.0


@contextlib.contextmanager
def direct_bytes(value):
    """gradsync.distributed.DIRECT_BYTES (read at each call) set to `value` for a while; 0: the ring
    at every size. The worlds' processes outlive a test, so it is always restored."""
    saved = gradsync.distributed.DIRECT_BYTES
    gradsync.distributed.DIRECT_BYTES = saved if value is None else value
    try:
        yield
    finally:
        gradsync.distributed.DIRECT_BYTES = saved


def run_cases(rank, size, cases, direct=None):
    """Runs every (numel, codec, dtype, op) case; returns {case: (error ratio, result digest)}.
    ``direct``: DIRECT_BYTES for these calls (see direct_bytes)."""
    with direct_bytes(direct):
        return _run_cases(rank, size, cases)


def bottom_of_the_range(rank, size, dtype_name):
    """{(collective, codec, op): error ratio} for inputs at the bottom of their dtype's range, its
    subnormals included, where only the formats' absolute floors bound the error."""
    dtype = DTYPES[dtype_name]
    low, high = (-9, -4) if dtype == torch.float16 else (-45, -36)  # decades: float16's subnormals start at 6e-8
    inputs = []
    for r in range(size):
        g = torch.Generator().manual_seed(r)
        x = torch.randn(128 * size, generator=g, dtype=torch.float64)
        inputs.append((x * torch.pow(10.0, torch.empty_like(x).uniform_(low, high, generator=g))).to(dtype))
    out = {}
    for codec in gradsync.CODECS:
        for op in ("avg", "sum"):
            x = inputs[rank].clone()
            gradsync.all_reduce(x, op=op, codec=codec)
            out[("all_reduce", codec, op)] = error_ratio(x, inputs, codec, op, dtype_name, size)
            mine = slice(rank * 128, (rank + 1) * 128)
            chunk = torch.empty(128, dtype=dtype)
            gradsync.reduce_scatter(chunk, inputs[rank], op=op, codec=codec)
            out[("reduce_scatter", codec, op)] = error_ratio(chunk, [i[mine] for i in inputs], codec, op, dtype_name,
                                                             size, encodes=size - 1)
    return out


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_results_at_the_bottom_of_each_format_stay_within_the_bound(worlds, dtype_name):
    for ratios in worlds(3).run(bottom_of_the_range, dtype_name):
        assert all(ratio <= 1.0 for ratio in ratios.values()), {k: v for k, v in ratios.items() if v > 1}


def calls_from_a_signal_handler(rank, size):
    """A SIGALRM handler that all-reduces, over and over, while the main thread does too: a handler
    run between two bytecodes of gradsync's bookkeeping must not wait for what that code holds."""
    sums, pause = [], random.Random(0)

    def handler(signum, frame):
        x = torch.ones(8)
        gradsync.all_reduce(x, op="sum")
        sums.append(float(x.sum()))
        signal.setitimer(signal.ITIMER_REAL, pause.uniform(1e-4, 2e-3))
    previous = signal.signal(signal.SIGALRM, handler)
    t = torch.ones(8)
    gradsync.all_reduce(t, op="sum")  # the group's engine, made under the lock (see below)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1e-3)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            gradsync.all_reduce(t, op="sum")
    finally:  # ignored first: a handler run between the two would arm the timer again, for the default action
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # where the handler does interrupt that bookkeeping (a group's first call makes its engine), it raises
    group = dist.new_group([0])
    with gradsync.distributed._engines_lock:  # held by this thread, as by the code a handler interrupted
        with pytest.raises(RuntimeError, match="called from a signal handler .* that interrupted gradsync's own"):
            gradsync.all_reduce(t, group=group)
        gradsync.all_reduce(t)  # the default group's engine is there: nothing to wait for
    gradsync.all_reduce(t, group=group)
    # ... as it does where it runs in this thread's shutdown(), which its call would wait for
    holding = threading.Event()

    def hold_the_engine_until_shutdown_stops_it(fut):  # not where the call was done already (inline)
        if not gradsync._C._on_engine_thread() or holding.is_set():
            return
        holding.set()  # the calls after this one wait for this callback, so shutdown() waits for them
        deadline = time.monotonic() + 30
        while not gradsync.distributed._stopping and time.monotonic() < deadline:
            time.sleep(1e-3)
        os.kill(os.getpid(), signal.SIGALRM)
    signal.signal(signal.SIGALRM, lambda signum, frame: gradsync.all_reduce(torch.ones(8)))
    try:
        for _ in range(1000):
            gradsync.all_reduce(torch.randn(1 << 16), codec="fp8_e4m3", async_op=True).get_future().then(
                hold_the_engine_until_shutdown_stops_it)
            if holding.is_set():
                break
        assert holding.is_set(), "every call was done before its callback was attached"
        with pytest.raises(RuntimeError, match="called from a signal handler .* that interrupted gradsync's own"):
            gradsync.shutdown()
    finally:
        signal.signal(signal.SIGALRM, previous)
    gradsync.shutdown()
    gradsync.all_reduce(t, op="sum")
    return len(sums), set(sums) | {float(t.sum())}


def test_a_signal_handler_can_call_gradsync(worlds):
    [(calls, sums)] = worlds(1).run(calls_from_a_signal_handler, timeout=60)
    assert calls > 100 and sums == {8.0}, (calls, sums)


def _run_cases(rank, size, cases):
    """Each case's error is measured by one rank, in turn: check_results finds every rank's result
    bitwise the same, so one rank's error is every rank's."""
    out = {}
    prepared = {}
    for i, (numel, codec, dtype_name, op) in enumerate(cases):
        dtype = DTYPES[dtype_name]
        measures = i % size == rank
        if (numel, dtype) not in prepared:
            prepared.clear()
            prepared[(numel, dtype)] = rank_input(rank, numel, dtype), None
        mine, reference = prepared[(numel, dtype)]
        if measures and reference is None:  # every rank's input, and their sums in fp64
            inputs = [rank_input(r, numel, dtype) for r in range(size)]
            sums = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
            for each in inputs:
                sums[0].add_(each.double())
                sums[1].add_(each.double().abs())
            reference = inputs, sums
            prepared[(numel, dtype)] = mine, reference
        x = mine.clone()
        gradsync.all_reduce(x, op=op, codec=codec)
        again = mine.clone()  # a repeated call, naming the op as torch.distributed does, gives the same bits
        gradsync.all_reduce(again, op=getattr(dist.ReduceOp, op.upper()), codec=codec)
        assert torch.equal(again.view(torch.uint8), x.view(torch.uint8)), "repeated call differs"
        ratio = error_ratio(x, reference[0], codec, op, dtype_name, size, reference[1]) if measures else None
        out[(numel, codec, dtype_name, op)] = (ratio, digest(x))
    return out


def check_results(per_rank):
    for case in per_rank[0]:
        ratios = [r[case][0] for r in per_rank if r[case][0] is not None]
        digests = {r[case][1] for r in per_rank}
        assert len(digests) == 1, f"{case}: results differ across ranks"
        assert ratios, f"{case}: no rank measured its error"
        assert max(ratios) <= 1.0, f"{case}: error {max(ratios):.3g} x the bound"


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_codec_dtype_op_and_size_matches_fp64(worlds, size):
    numels = sorted({0, 1, max(size - 1, 1), 1009, 2**20 + 3})
    cases = [(n, codec, dtype, op) for n in numels for dtype in DTYPES for codec in gradsync.CODECS
             for op in ("avg", "sum") if n < 2**20 or dtype == "float32"]
    check_results(worlds(size).run(run_cases, cases))


@pytest.mark.parametrize("size", [2, 3, 4])
def test_small_buffers_through_the_ring_match_fp64(worlds, size):
    """The sizes that take the direct exchange by default, through the ring instead."""
    cases = [(n, codec, dtype, op) for n in sorted({1, size - 1, 1009}) for dtype in DTYPES
             for codec in gradsync.CODECS for op in ("avg", "sum")]
    check_results(worlds(size).run(run_cases, cases, 0))


def direct_exchange_calls(rank, size):
    """Small buffers: every contribution encoded once, all of them decoded and added in rank order
    in fp32, then scaled and cast: the bits of that sum computed here with gradsync's codecs."""
    same = {}
    for codec, (dtype_name, dtype), op, given in itertools.product(gradsync.CODECS, DTYPES.items(), ("avg", "sum"),
                                                                   (None, 3.0)):
        numel = 5003
        inputs = [rank_input(r, numel, dtype, seed=11) for r in range(size)]
        prescale, postscale = resolve_scales(op, size, given)
        assert prescale * postscale == pytest.approx(1 / size if op == "avg" else 1.0, rel=1e-15), op
        total = None
        for x in inputs:
            term = gradsync.decompress(gradsync.compress(x, codec, scale=prescale), codec, numel)
            total = term if total is None else total + term
        expected = (total * postscale).to(dtype)
        x = inputs[rank].clone()
        gradsync.all_reduce(x, op=op, codec=codec, prescale=given)
        same[(codec, dtype_name, op, given)] = torch.equal(x.view(torch.uint8), expected.view(torch.uint8))
    return same


@pytest.mark.parametrize("size", [2, 3])
def test_small_buffers_sum_every_rank_s_encoded_contribution_in_rank_order(worlds, size):
    for same in worlds(size).run(direct_exchange_calls):
        assert all(same.values()), [case for case, ok in same.items() if not ok]


def prescaled_ring_calls(rank, size):
    """A given prescale (3, not a power of two) and the postscale derived from it, through the ring."""
    out = {}
    for codec, op in itertools.product(gradsync.CODECS, ("avg", "sum")):
        inputs = [rank_input(r, 2**18 + 5, torch.float32, seed=13) for r in range(size)]
        x = inputs[rank].clone()
        assert gradsync.all_reduce(x, op=op, codec=codec, prescale=3.0) is None
        out[(codec, op)] = (error_ratio(x, inputs, codec, op, "float32", size, prescale=3.0), digest(x))
    return out


def test_a_given_prescale_through_the_ring_matches_fp64(worlds):
    check_results(worlds(3).run(prescaled_ring_calls))


def prescaled_ring_bits(rank, size):
    """Two ranks through the ring with prescale 3 and a 16-bit wire: each chunk's owner adds its own
    input times 3 to the peer's encoded input times 3 in fp32, encodes that sum, and every rank
    decodes it times the postscale (1/6 for avg, 1/3 for sum). Which rank owns which chunk is the
    ring's business: each element must be one of the two sums, and differ from a call without the
    prescale somewhere."""
    out = {}
    for codec, op in itertools.product(("fp16", "bf16"), ("avg", "sum")):
        numel = 2**18 + 5
        xs = [rank_input(r, numel, torch.float32, seed=17) for r in range(size)]
        post = 1 / 6 if op == "avg" else 1 / 3

        def owned_by(owner):
            received = gradsync.decompress(gradsync.compress(xs[1 - owner], codec, scale=3.0), codec, numel)
            total = received + xs[owner] * 3.0
            return gradsync.decompress(gradsync.compress(total, codec), codec, numel) * post
        x, plain = xs[rank].clone(), xs[rank].clone()
        gradsync.all_reduce(x, op=op, codec=codec, prescale=3.0)
        gradsync.all_reduce(plain, op=op, codec=codec)
        either = same_bits_each(x, owned_by(0)) | same_bits_each(x, owned_by(1))
        out[(codec, op)] = bool(either.all()) and not torch.equal(x, plain)
    return out


def same_bits_each(a, b):
    return a.view(torch.int32) == b.view(torch.int32)


def test_a_given_prescale_scales_what_the_ring_sends(worlds):
    for exact in worlds(2).run(prescaled_ring_bits):
        assert all(exact.values()), exact


def test_sixteen_million_elements(worlds):
    cases = [(16 * 2**20, codec, "float32", "avg") for codec in gradsync.CODECS]
    check_results(worlds(4).run(run_cases, cases))


def compressed_beats_torch_fp16(rank, size):
    """gradsync fp16 (fp32 sums) vs torch's fp16 hook path (fp16 sums) on the same data."""
    inputs = [rank_input(r, 1 << 16, torch.float32, seed=3) for r in range(size)]
    ref = torch.stack([x.double() for x in inputs]).mean(0)
    ours = inputs[rank].clone()
    gradsync.all_reduce(ours, codec="fp16")
    theirs = inputs[rank].half().div_(size)
    dist.all_reduce(theirs)
    return float((ours.double() - ref).norm() / ref.norm()), float((theirs.double() - ref).norm() / ref.norm())


def test_fp16_wire_is_at_least_as_accurate_as_torch_fp16_path(worlds):
    ours, theirs = worlds(4).run(compressed_beats_torch_fp16)[0]
    assert ours <= theirs


def subgroup_calls(rank, size):
    first = dist.new_group([0, 1, 2])
    second = dist.new_group([1, 3])
    out = {}
    for name, group, members in (("first", first, [0, 1, 2]), ("second", second, [1, 3])):
        if rank not in members:
            for call in (lambda: gradsync.all_reduce(torch.ones(3), group=group),
                         lambda: gradsync.reduce_scatter(torch.ones(1), torch.ones(len(members)), group=group)):
                with pytest.raises(ValueError, match="not a member of the group"):
                    call()
            continue
        # the direct exchange, and the ring (both halves) at a small and a large size
        for numel, direct in ((5000, None), (5000, 0), (2**20 + 3, None)):
            inputs = [rank_input(r, numel, torch.float32, seed=7) for r in members]
            x = inputs[members.index(rank)].clone()
            with direct_bytes(direct):
                gradsync.all_reduce(x, op="sum", codec="bf16", group=group)
            out[(name, numel, direct)] = (error_ratio(x, inputs, "bf16", "sum", "float32", len(members)), digest(x))
    return out


def test_subgroups(worlds):
    results = worlds(4).run(subgroup_calls)
    for name, members in (("first", [0, 1, 2]), ("second", [1, 3])):
        cases = [case for case in results[members[0]] if case[0] == name]
        assert len(cases) == 3
        for case in cases:
            assert len({results[r][case][1] for r in members}) == 1, case
            assert all(results[r][case][0] <= 1.0 for r in members), case


def async_calls(rank, size):
    a_inputs = [rank_input(r, 300000, torch.float32, seed=1) for r in range(size)]
    b_inputs = [rank_input(r, 70000, torch.bfloat16, seed=2) for r in range(size)]
    a, b = a_inputs[rank].clone(), b_inputs[rank].clone()
    work_a = gradsync.all_reduce(a, codec="fp8_e4m3", async_op=True)
    work_b = gradsync.all_reduce(b, codec="fp16", op="sum", async_op=True)
    assert isinstance(work_a, gradsync.AllReduceWork)
    work_b.wait()
    work_a.wait()
    assert work_a.is_completed() and work_b.is_completed()
    a_sync, b_sync = a_inputs[rank].clone(), b_inputs[rank].clone()
    gradsync.all_reduce(a_sync, codec="fp8_e4m3")
    gradsync.all_reduce(b_sync, codec="fp16", op="sum")
    return torch.equal(a, a_sync) and torch.equal(b, b_sync), digest(a) + digest(b)


def async_while_a_peer_is_late(rank, size):
    """The last rank calls 2 s late: the others' async calls return at once and complete only after it."""
    dist.barrier()
    x = rank_input(rank, 1 << 18, torch.float32, seed=5)
    if rank == size - 1:
        time.sleep(2.0)
    start = time.monotonic()
    work = gradsync.all_reduce(x, codec="fp16", async_op=True)
    returned = time.monotonic() - start
    pending = not work.is_completed()
    timed_out = False
    if rank != size - 1:  # a bounded wait gives up; the call goes on
        with pytest.raises(RuntimeError, match="did not complete within the 0.2 s given to wait\\(\\); it is still"):
            work.wait(timeout=0.2)
        timed_out = not work.is_completed()
    for bad, error in (("1", TypeError), (-1, ValueError), (float("nan"), ValueError)):
        with pytest.raises(error, match="timeout must be"):
            work.wait(bad)
    assert work.wait(datetime.timedelta(0)) is True and work.wait(60.0) is True  # 0: no bound, as torch's Work
    return returned, pending, time.monotonic() - start, digest(x), timed_out


def test_an_async_call_does_not_block_its_caller(worlds):
    results = worlds(3).run(async_while_a_peer_is_late)
    for returned, pending, waited, _, timed_out in results[:-1]:
        assert returned < 0.5 and pending and timed_out, (returned, pending, timed_out)
        assert waited > 1.5, waited
    assert len({r[3] for r in results}) == 1


def test_two_async_all_reduces_in_flight(worlds):
    results = worlds(3).run(async_calls)
    assert all(same for same, _ in results)
    assert len({d for _, d in results}) == 1


def future_calls(rank, size):
    x = rank_input(rank, 5000, torch.float32, seed=3)
    expected = x.clone()
    gradsync.all_reduce(expected, codec="fp16")
    fut = gradsync.all_reduce(x, codec="fp16", async_op=True).get_future()
    doubled = fut.then(lambda f: f.value() * 2)
    assert isinstance(fut, torch._C.Future)  # what torch.distributed Work.get_future() returns too
    value = fut.wait()
    assert value is x or value.data_ptr() == x.data_ptr()
    same = torch.equal(value, expected) and torch.equal(doubled.wait(), expected * 2)

    y = rank_input(rank, 5000, torch.float32, seed=4)
    work, ran = gradsync.all_reduce(y, codec="fp16", async_op=True), []
    # a slow callback that waits for its own call: no deadlock
    work.get_future().then(lambda f: (work.wait(), time.sleep(0.2), ran.append(work.is_completed())))
    # ... and once wait() returns, the future is complete, its callbacks run, as with torch's Work (in
    # which the work is complete too)
    work.wait()
    return same and work.get_future().done() and work.is_completed() and ran == [True] and \
        work.get_future().value().data_ptr() == y.data_ptr()


def concurrent_first_calls(rank, size):
    """Eight threads make a new group's first call at once, while making an engine is slow."""
    group = dist.new_group([0])
    make, made = gradsync.distributed._C.RingEngine, []

    def slow_engine(*args):
        time.sleep(0.05)
        made.append(make(*args))
        return made[-1]
    gradsync.distributed._C.RingEngine = slow_engine
    start, engines = threading.Barrier(8), []

    def first_call():
        start.wait()
        engines.append(gradsync.distributed._engine(group, torch.zeros(1)))
    try:
        threads = [threading.Thread(target=first_call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        gradsync.distributed._C.RingEngine = make
    x = torch.ones(3)
    gradsync.all_reduce(x, group=group)
    return len(made), len({id(e) for e in engines}), len(engines), x.tolist()


def test_threads_making_a_groups_first_call_at_once_share_one_engine(worlds):
    assert worlds(1).run(concurrent_first_calls) == [(1, 1, 8, [1.0, 1.0, 1.0])]


def test_the_future_holds_the_reduced_tensor(worlds):
    assert all(worlds(2).run(future_calls))


def error_feedback_calls(rank, size, codec, numel, dtype=torch.float32):
    """The residuals of all ranks sum to the result's error; repeated calls pay it back."""
    inputs = [rank_input(r, numel, dtype, seed=4) for r in range(size)]
    exact = torch.stack([x.double() for x in inputs]).sum(0) / size
    residual = torch.zeros(numel)
    x = inputs[rank].clone()
    gradsync.all_reduce(x, codec=codec, residual=residual)
    total = residual.clone()
    torch.distributed.all_reduce(total)
    accounted = float((x.double() + total.double() - exact).norm() / exact.norm())
    one_call = float((x.double() - exact).norm() / exact.norm())
    mean = x.double()
    steps = 16
    for _ in range(steps - 1):
        x = inputs[rank].clone()
        gradsync.all_reduce(x, codec=codec, residual=residual)
        mean += x.double()
    averaged = float((mean / steps - exact).norm() / exact.norm())
    overflow = inputs[rank].clone()
    overflow[::7] = float("inf")  # an overflowed step leaves no non-finite residual behind
    gradsync.all_reduce(overflow, codec=codec, residual=residual)
    assert torch.isfinite(residual).all() and not torch.isfinite(overflow[::7]).any()
    return accounted, one_call, averaged, digest(x)


@pytest.mark.parametrize("numel", [70001, 5001])  # the ring; the direct exchange of small buffers
@pytest.mark.parametrize("codec,dtype", [("fp16", torch.float32), ("bf16", torch.float32),
                                         ("fp8_e4m3", torch.float32), ("fp8_e5m2", torch.float32),
                                         # the direct exchange's rounding of the sum into the tensor counts
                                         ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_error_feedback_residuals_account_for_the_error(worlds, codec, dtype, numel):
    results = worlds(3).run(error_feedback_calls, codec, numel, dtype)
    assert len({r[3] for r in results}) == 1
    accounted, one_call, averaged, _ = results[0]
    assert accounted < 1e-6 < one_call
    assert averaged < one_call / 8


def disagreeing_calls(rank, size):
    messages = []
    for kind in ("numel", "far numel", "dtype", "codec", "scale", "schedule", "slices"):
        numel = 1000 + (rank if kind == "numel" else 0) + (2**20 if kind == "far numel" and rank == 0 else 0)
        numel += 2**18 if kind == "slices" else 0
        dtype = torch.float16 if kind == "dtype" and rank == size - 1 else torch.float32
        codec = "fp8_e5m2" if kind == "codec" and rank == 0 else "fp16"
        prescale = 0.5 if kind == "scale" and rank == 1 else None
        x = torch.randn(numel).to(dtype)
        before = x.clone()
        start = time.monotonic()
        saved_slice = gradsync.distributed.SLICE_BYTES
        if kind == "slices" and rank == 1:
            gradsync.distributed.SLICE_BYTES = 1 << 16
        try:
            with pytest.raises(ValueError) as info, direct_bytes(0 if kind == "schedule" and rank == 2 else None):
                gradsync.all_reduce(x, codec=codec, prescale=prescale)
        finally:
            gradsync.distributed.SLICE_BYTES = saved_slice
        # at once, not at the group's timeout (60 s)
        assert time.monotonic() - start < 10, f"{kind}: raised after {time.monotonic() - start:.1f} s"
        assert torch.equal(x, before), "a failed call wrote into the tensor"
        messages.append(str(info.value))
    y = torch.ones(10)  # the group still works afterwards
    gradsync.all_reduce(y, op="sum")
    assert torch.equal(y, torch.full((10,), float(size)))
    return messages


def test_ranks_that_disagree_all_raise_and_leave_tensors_alone(worlds):
    for messages in worlds(3).run(disagreeing_calls):
        assert all(m.startswith("gradsync.all_reduce: the ranks disagree") for m in messages), messages
        numel, far, dtype, codec, scale, schedule, slices = messages
        assert "group rank 1 has numel 1001" in numel and "group rank 0 has numel 1000" in numel
        assert "dtype float16" in dtype and "dtype float32" in dtype
        assert "codec fp8_e5m2" in codec and "codec fp16" in codec
        assert "prescale 0.5," in scale and "prescale 0.333333343," in scale  # to the last bit
        assert "schedule direct" in schedule and "schedule ring" in schedule
        # every field that differs is shown: here only the slices
        assert len(set(re.findall(r"slices of (\d+) elements", slices))) == 2, slices


def refused_on_one_rank(rank, size):
    """Each call is refused on rank 1 alone (its arguments); then every rank makes one more call.
    Rank 1 raises its own error; the others a ValueError naming it, at once; the next calls pair."""
    from torch.testing._internal.two_tensor import TwoTensor
    outcomes = []
    cases = [("residual", lambda x: gradsync.all_reduce(x, op="sum", residual=torch.zeros(x.numel() - 1))),
             ("scale", lambda x: gradsync.all_reduce(x, op="sum", prescale=1e-50)),
             ("codec", lambda x: gradsync.all_reduce(x, op="sum", codec="int8")),
             ("not a tensor", lambda x: gradsync.all_reduce(x.tolist(), op="sum")),
             ("reduce_scatter", lambda x: gradsync.reduce_scatter(torch.empty(x.numel() // size + 1), x, op="sum")),
             # the engine reads memory: a negative view's sign is not in it, a wrapper subclass has none
             ("negative view", lambda x: gradsync.all_reduce(torch._neg_view(x), op="sum")),
             ("negative residual", lambda x: gradsync.all_reduce(x, op="sum", residual=torch._neg_view(torch.zeros(1200)))),
             ("wrapper subclass", lambda x: gradsync.all_reduce(TwoTensor(x, x.clone()), op="sum")),
             ("unchecked", lambda x: gradsync.all_reduce(x, op="sum", codec="int8", check_call=0))]
    for kind, refused in cases:
        x = torch.full((1200,), 1.0 + rank)
        before = x.clone()
        start = time.monotonic()
        try:
            if rank == 1:
                refused(x)
            elif kind == "reduce_scatter":
                gradsync.reduce_scatter(torch.empty(x.numel() // size), x, op="sum")
            else:
                gradsync.all_reduce(x, op="sum", check_call=kind != "unchecked")
            outcome = "no error"
        except Exception as e:  # noqa: BLE001 - the type is part of what is checked
            outcome = f"{type(e).__name__}: {e}"
        if kind == "unchecked":  # the peers wait in the ring: they time out, and rank 1 must not pair on
            outcomes.append((kind, outcome, None, None))
            break
        seconds, untouched = time.monotonic() - start, torch.equal(x, before)
        y = torch.full((10,), 10.0 * (rank + 1))
        gradsync.all_reduce(y, op="sum")  # pairs with the peers' next call, not with the refused one
        outcomes.append((kind, outcome, seconds < 10 and untouched, y[0].item()))
    if rank == 1:
        try:
            gradsync.all_reduce(torch.ones(10))
            outcomes.append("the group was still usable")
        except RuntimeError as e:
            outcomes.append(str(e))
    return outcomes


def test_a_call_refused_on_one_rank_makes_every_rank_raise(worlds):
    # a rank whose arguments are wrong still takes its turn in the call: without that the others
    # paired their call with its next one, and summed different tensors
    world = World(3, group_timeout_s=5)
    try:
        results = world.run(refused_on_one_rank, timeout=120)
    finally:
        world.close()
    expected = 10.0 * (1 + 2 + 3)
    for rank, outcomes in enumerate(results):
        for kind, outcome, quick_and_untouched, y in outcomes[:8]:
            assert quick_and_untouched and y == expected, (rank, kind, outcome, y)
            if rank == 1:
                assert outcome.startswith(("ValueError", "TypeError")), (kind, outcome)
            else:
                assert outcome.startswith("ValueError") and "rank(s) 1 could not prepare the call (its arguments" \
                    in outcome, (rank, kind, outcome)
        kind, outcome, _, _ = outcomes[8]
        assert kind == "unchecked" and outcome.startswith("ValueError" if rank == 1 else "RuntimeError"), outcome
    assert [o[1] for o in results[1][5:8]] == [
        "ValueError: tensor is a negative view (torch._neg_view), whose sign the ring would not apply; pass "
        "tensor.resolve_neg()",
        "ValueError: residual is a negative view (torch._neg_view), whose sign the ring would not apply; pass "
        "residual.resolve_neg()",
        "ValueError: tensor has no memory of its own to read or write (a tensor subclass that wraps others?); pass "
        "plain tensors"]
    # rank 1's group is unusable, saying why
    assert "refused here with check_call=False" in results[1][9] and "unknown codec 'int8'" in results[1][9], results[1][9]


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_a_refused_call_takes_its_turn_where_the_peers_check(backend):
    # over NCCL the peers' agreement check runs on gradsync's communicator: a refused call's turn goes
    # there, even when the refusal was a tensor on another GPU (on that GPU the turn was refused again,
    # and the peers waited out the group's timeout)
    cuda0, cuda1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    assert _refusal_device(backend, 0, cuda1) == cuda0
    assert _refusal_device(backend, 1, cuda1) == cuda1
    assert _refusal_device(backend, -1, cuda1) == cuda1  # no communicator yet: the peers join on theirs
    assert _refusal_device("cpu:gloo,cuda:nccl", 0, cpu) == cpu  # the peers' CPU tensors check over gloo
    assert _refusal_device("cpu:gloo,cuda:nccl", 0, None) == cpu
    assert _refusal_device("nccl", 1, cpu) == cuda1  # a CPU tensor refused on an NCCL-only group
    assert _refusal_device("cuda:nccl", 1, cpu) == cuda1
    assert _refusal_device("cuda:gloo", -1, cpu) == cpu  # refused at its first post on every rank alike
    assert _refusal_device("gloo", -1, cuda1) == cuda1  # staged through pinned memory, on the tensor's GPU
    assert _refusal_device("gloo", -1, cpu) == cpu


def out_of_memory_on_one_rank(rank, size, victim, check_call):
    """The victim's address space is capped just above what it holds, so that allocating the call's
    workspaces fails there alone."""
    import resource
    gradsync.all_reduce(torch.ones(1 << 16), codec="fp16")  # the engine and its threads exist, workspaces small
    x = torch.randn(32 << 20)  # 64 MB per workspace on an fp16 wire
    before = x.clone()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if rank == victim:
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (16 << 20), hard))
    start = time.monotonic()
    try:
        gradsync.all_reduce(x, codec="fp16", check_call=check_call)
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - the type is part of what is checked
        outcome = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    seconds = time.monotonic() - start
    untouched = torch.equal(x, before)
    y = torch.ones(10)  # the group still works afterwards
    gradsync.all_reduce(y, op="sum")
    return seconds, outcome, untouched, torch.equal(y, torch.full((10,), float(size)))


def test_a_rank_out_of_memory_makes_every_rank_raise_at_once(worlds):
    # the workspaces are allocated before the agreement check, whose record carries the outcome:
    # the others raise at once instead of waiting out the group's timeout (60 s) in a ring the
    # victim never joins
    results = worlds(3).run(out_of_memory_on_one_rank, 1, True)
    for rank, (seconds, outcome, untouched, usable) in enumerate(results):
        assert seconds < 10 and untouched and usable, (rank, seconds, outcome)
        if rank == 1:
            assert outcome.startswith("RuntimeError") and "memory" in outcome, outcome
        else:
            assert outcome.startswith("ValueError") and "rank(s) 1 could not prepare the call" in outcome, outcome


def test_a_rank_out_of_memory_without_the_check_breaks_the_ring_everywhere():
    # nothing tells the others, who wait in the ring for the group's timeout; the victim must not
    # take its next call for a fresh start, since its peers' messages of the failed call are pending
    timeout_s = 5
    world = World(3, group_timeout_s=timeout_s)
    try:
        results = world.run(out_of_memory_on_one_rank, 1, False, timeout=120)
    except AssertionError as e:  # the call after the failure raises on every rank
        text = str(e)
    else:
        raise AssertionError(f"the group was still usable: {results}")
    finally:
        world.close()
    sections = text.split("--- rank ")[1:]
    assert len(sections) == 3 and all("group's ring is unusable" in t for t in sections), text
    assert "allocate" in sections[1], text  # the victim's own error carried on


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def many_calls(rank, size):
    """RSS growth over 1,000 calls of every kind: ring and direct exchange, every codec, async,
    error feedback, reduce-scatter."""
    big, small, residual = torch.randn(1 << 16), torch.randn(1000), torch.zeros(1 << 16)
    out = torch.empty((1 << 16) // size)

    def call(i):
        kind, codec = i % 6, ("fp16", "fp8_e4m3", "none", "bf16")[i % 4]
        if kind == 0:
            gradsync.all_reduce(big, codec=codec)
        elif kind == 1:
            gradsync.all_reduce(small, codec=codec)  # the direct exchange
        elif kind == 2:
            gradsync.all_reduce(big, codec=codec, async_op=True).wait()
        elif kind == 3:
            gradsync.all_reduce(big, codec="fp8_e4m3", residual=residual)
        elif kind == 4:
            gradsync.reduce_scatter(out, big, codec=codec)
        else:
            gradsync.all_reduce(small, codec=codec, check_call=False)
        big.copy_(small.repeat(66)[: big.numel()])  # keep the values finite and moving

    for i in range(120):
        call(i)
    growth = []
    for _ in range(3):  # a leak grows in every window once the heap's free space is used; a heap that
        # maps a new region once, in one window
        before = rss_bytes()
        for i in range(1000):
            call(i)
        growth.append(rss_bytes() - before)
    return growth


def test_memory_is_flat_over_a_thousand_calls(worlds):
    growth = worlds(2).run(many_calls)
    # 0 in most runs, and twice in many a single window grew by a few hundred KB; 300 bytes kept per
    # call grow the windows by about [70, 310, 300] KB
    assert all(sorted(windows)[1] < 128 * 2**10 for windows in growth), growth


def many_cuda_calls(rank, size):
    """Host and device memory across 1,000 calls on a CUDA tensor (gloo: staged through pinned
    host memory; NCCL: gradsync's communicator, its events and device workspaces)."""
    torch.cuda.set_device(0)
    x = torch.randn(1 << 16, device="cuda")
    for i in range(60):  # every codec, so that the workspaces have reached their size
        gradsync.all_reduce(x, codec=("fp16", "fp8_e4m3", "none")[i % 3])
    torch.cuda.synchronize()
    host, device = rss_bytes(), torch.cuda.memory_allocated()
    for i in range(1000):
        gradsync.all_reduce(x, codec=("fp16", "fp8_e4m3", "none")[i % 3])
    torch.cuda.synchronize()
    return rss_bytes() - host, torch.cuda.memory_allocated() - device


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_cuda_memory_is_flat_over_a_thousand_calls(backend):
    world = World(2 if backend == "gloo" else 1, backend=backend)  # NCCL: one rank per GPU
    try:
        growth = world.run(many_cuda_calls)
    finally:
        world.close()
    assert all(host < 8 * 2**20 and device == 0 for host, device in growth), growth


def die_mid_ring(rank, size, victim):
    x = torch.randn(8 * 2**20)
    if rank == victim:
        threading.Timer(0.05, lambda: os._exit(17)).start()
    start = time.monotonic()
    try:
        while True:  # keep the ring busy until the victim is gone
            gradsync.all_reduce(x, codec="fp16")
            if time.monotonic() - start > 60:
                return "no error after 60 s"
    except Exception as e:  # noqa: BLE001 - the survivors must raise, whatever the wire says
        return f"{type(e).__name__} after {time.monotonic() - start:.1f} s: {e}"


def test_a_dead_peer_makes_the_survivors_raise_within_the_timeout():
    timeout_s = 10
    world = World(3, group_timeout_s=timeout_s)
    try:
        for conn in world.conns:
            conn.send((die_mid_ring.__module__, die_mid_ring.__name__, (2,)))
        outcomes = []
        for rank in (0, 1):
            assert world.conns[rank].poll(timeout_s + 30), f"rank {rank} hangs"
            status, value = world.conns[rank].recv()
            outcomes.append(value)
        for value in outcomes:
            assert "no error" not in value, value
            seconds = float(value.split(" after ")[1].split(" s")[0])
            assert seconds <= timeout_s + 10, value
        world.procs[2].join(10)
        assert world.procs[2].exitcode == 17
    finally:
        world.close()


_made_in_python = {}


def all_reduce_ones(rank, size, made_in_python):
    if made_in_python:
        _made_in_python["group"] = group_made_in_python(rank, size)
    x = torch.ones(97)
    gradsync.all_reduce(x, op="sum", codec="fp16", group=_made_in_python.get("group"))
    return x.tolist() == [float(size)] * 97


def exit_now(rank, size):
    os._exit(0)


def two_calls_and_their_errors(rank, size):
    errors = []
    for _ in range(2):
        try:
            gradsync.all_reduce(torch.ones(97), codec="fp16", group=_made_in_python.get("group"))
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - the wording is what is checked
            errors.append(f"{type(e).__name__}: {e}")
    return errors


@pytest.mark.parametrize("made_in_python", [False, True], ids=["torch's group", "a group made in python"])
def test_a_peer_dead_between_calls_fails_every_survivors_ring_alike(made_in_python):
    """Rank 1 exits between calls. Its successor, rank 2, fails as it posts the first receive from
    it (gloo refuses a closed connection at once); that rank too must say which call failed where
    and hold its ring unusable, like rank 0, whose posts went out before the wire failed."""
    world = World(3, group_timeout_s=10)
    try:
        assert world.run(all_reduce_ones, made_in_python) == [True] * 3
        world.conns[1].send((exit_now.__module__, exit_now.__name__, ()))
        world.procs[1].join(30)
        assert world.procs[1].exitcode == 0
        errors = {}
        calls = (two_calls_and_their_errors.__module__, two_calls_and_their_errors.__name__, ())
        for rank in (0, 2):
            world.conns[rank].send(calls)
        for rank in (0, 2):
            assert world.conns[rank].poll(60), f"rank {rank} hangs"
            status, errors[rank] = world.conns[rank].recv()
            assert status == "ok", errors[rank]
        unusable = "an earlier call on this group (all-reduce, reduce-scatter or all-gather) failed"
        for rank, (first, later) in errors.items():
            assert f"failed in the ring (rank {rank} of 3), and the group's ring is unusable" in first, (rank, first)
            assert unusable in later, (rank, later)
            assert "no backend for CPU tensors" not in first + later, (rank, first, later)
    finally:
        world.close()


def calls_on_a_group_without_a_cpu_backend(rank, size):
    group = dist.new_group(backend="cuda:gloo")
    errors = []
    for call in (lambda: gradsync.all_reduce(torch.ones(8), group=group),
                 lambda: gradsync.reduce_scatter(torch.empty(1), torch.ones(size), group=group),
                 lambda: gradsync.all_gather(torch.empty(size), torch.ones(1), group=group)):
        try:
            call()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    x = torch.ones(8)
    gradsync.all_reduce(x, op="sum")
    return errors, x.tolist() == [float(size)] * 8


def test_cpu_tensors_on_a_group_without_a_cpu_backend_are_refused_at_once():
    world = World(3, group_timeout_s=30)
    try:
        for errors, default_group_sums in world.run(calls_on_a_group_without_a_cpu_backend, timeout=60):
            assert default_group_sums
            for error, name in zip(errors, ("tensor", "input", "output")):
                assert error.startswith(f"{name} is on cpu, but the group's backend is cuda:gloo, without one for CPU"), error
    finally:
        world.close()


def names_of_the_default_group(rank, size):
    from gradsync.distributed import _backend_name
    x = torch.ones(8)
    gradsync.all_reduce(x, op="sum")
    return str(dist.get_backend()), _backend_name(dist.group.WORLD), x.tolist() == [float(size)] * 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the group would be NCCL's alone")
def test_a_group_made_without_a_backend_is_named_by_the_one_it_has():
    """init_process_group() without a backend: torch names it "undefined" and gives it the
    accelerator's backend alone (NCCL on a GPU machine, gloo without one); gradsync moves tensors
    by that backend."""
    world = World(2, backend=None)
    try:
        for torch_name, name, summed in world.run(names_of_the_default_group, timeout=60):
            assert name == "gloo" and summed, (torch_name, name, summed)
    finally:
        world.close()


def calls_on_a_group_that_gains_its_cpu_backend_late(rank, size, folder):
    store = dist.FileStore(os.path.join(folder, "late-backend"), size)
    group = dist.ProcessGroup(dist.PrefixStore("group", store), rank, size)  # made outside the registry
    outcomes = []
    for call in range(3):
        if call == 1:
            gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, datetime.timedelta(seconds=30))
            group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        x = torch.ones(8)
        try:
            gradsync.all_reduce(x, op="sum", group=group)
            outcomes.append(x.tolist() == [float(size)] * 8)
        except RuntimeError as e:
            outcomes.append(str(e))
    return outcomes


def test_posts_refused_for_want_of_a_cpu_backend_leave_the_ring_usable():
    """Every rank's first post is refused alike, so nothing is in flight: once the group has a CPU
    backend its ring works (a refusal from a backend, as for a dead peer, would end it)."""
    world = World(3, group_timeout_s=30)
    try:
        for first, *later in world.run(calls_on_a_group_that_gains_its_cpu_backend_late, world.folder, timeout=60):
            assert str(first).startswith("gradsync: the process group has no backend for CPU tensors"), first
            assert "frame #" not in str(first), first  # torch's message without its C++ backtrace
            assert later == [True, True], later
    finally:
        world.close()


def call_once_and_time_the_failure(rank, size):
    x = torch.randn(1 << 20)
    before = x.clone()
    start = time.monotonic()
    try:
        gradsync.all_reduce(x, codec="fp8_e4m3")
    except Exception as e:  # noqa: BLE001 - whatever the wire says, it must say it in time
        seconds, message = time.monotonic() - start, f"{type(e).__name__}: {e}"
    else:
        return time.monotonic() - start, "no error", torch.equal(x, before), None
    gradsync.shutdown()  # releases the engine, not what the failure did to the group
    unusable = "an earlier call on this group .* failed, so the group's ring is unusable"
    with pytest.raises(RuntimeError, match=unusable) as later:
        gradsync.all_reduce(torch.ones(8))
    return seconds, message, torch.equal(x, before), str(later.value)


def test_a_silent_peer_makes_the_others_raise_within_the_timeout():
    """Rank 2 lives on but never calls: ranks 0 and 1 must raise after the group's timeout, and
    since the ring never reached its all-gather, their tensors are untouched."""
    timeout_s = 5
    world = World(3, group_timeout_s=timeout_s)
    try:
        for conn in world.conns[:2]:
            conn.send((call_once_and_time_the_failure.__module__, call_once_and_time_the_failure.__name__, ()))
        for rank in (0, 1):
            assert world.conns[rank].poll(timeout_s + 30), f"rank {rank} hangs"
            status, value = world.conns[rank].recv()
            assert status == "ok", value
            seconds, message, untouched, later = value
            assert message != "no error" and timeout_s - 1 <= seconds <= timeout_s + 10, (seconds, message)
            assert "failed in the ring (rank" in message and "A peer that died or stalls" in message, message
            assert untouched and later, message
    finally:
        world.close()


def silent_peer_of_a_subgroup(rank, size, timeout_s):
    sub = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s))
    if rank == size - 1:
        return None  # a member that never calls
    start = time.monotonic()
    try:
        gradsync.all_reduce(torch.randn(1 << 20), codec="fp16", group=sub)
    except Exception as e:  # noqa: BLE001 - whatever the wire says, it must say it in time
        return time.monotonic() - start, f"{type(e).__name__}: {e}"
    return time.monotonic() - start, "no error"


def test_the_timeout_is_the_call_s_own_group_s():
    """The default group waits 120 s; a subgroup made with a 5 s timeout raises after 5 s."""
    timeout_s = 5
    world = World(3, group_timeout_s=120)
    try:
        results = world.run(silent_peer_of_a_subgroup, timeout_s, timeout=60)
        for seconds, message in results[:2]:
            assert message != "no error" and timeout_s - 1 <= seconds <= timeout_s + 10, (seconds, message)
    finally:
        world.close()


_BY_HAND = itertools.count()  # every rank makes such groups in the same order


def made_by_hand(rank, size, timeout_s=30):
    """A gloo ProcessGroup made outside torch.distributed's registry, as fault-tolerance libraries make them."""
    store = dist.PrefixStore(f"by-hand-{next(_BY_HAND)}", dist.distributed_c10d._get_default_store())
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                            dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s)))
    return group


def a_group_made_by_hand(rank, size):
    """A ProcessGroup made outside torch.distributed's registry, as fault-tolerance libraries make
    them: gradsync's collectives take it, as torch's do."""
    group = made_by_hand(rank, size)
    x = torch.arange(6.0) * (rank + 1)
    expected = x.clone()
    dist.all_reduce(expected, group=group)
    gradsync.all_reduce(x, op="sum", group=group)
    gathered = torch.empty(6 * size)
    gradsync.all_gather(gathered, x, group=group)
    return torch.equal(x, expected) and torch.equal(gathered, expected.repeat(size))


def test_a_group_made_outside_torchs_registry(worlds):
    assert all(worlds(2).run(a_group_made_by_hand))


def threads_now():
    return len(os.listdir("/proc/self/task"))


def groups_made_by_hand_and_dropped(rank, size):
    """Per group: the sum on it, and on the groups still held; then the engines and threads left."""
    held = [made_by_hand(rank, size), group_made_in_python(rank, size)]
    # dropped with its call still running: a group subclassed in Python needs its Python object for it
    pending, big = group_made_in_python(rank, size), torch.full((1 << 22,), rank + 1.0)
    pending_work = gradsync.all_reduce(big, op="sum", group=pending, async_op=True)
    del pending
    # named in torch's registry, which holds it weakly and gives it back by name (as torchft does)
    named = made_by_hand(rank, size)
    named._set_group_name("gradsync-test-named")
    torch._C._distributed_c10d._register_process_group("gradsync-test-named", named)
    gradsync.all_reduce(torch.ones(10), group=named)
    del named
    engines_before, threads_before, sums = len(gradsync.distributed._engines), threads_now(), []
    for i in range(12):
        dropped = made_by_hand(rank, size)
        for group in (dropped, *held):
            x = torch.full((1000,), rank + i + 1.0)
            work = gradsync.all_reduce(x, op="sum", codec="fp16", group=group, async_op=True)
            sums.append(work.wait() is not None and x.unique().tolist())
        if i == 1:
            engines_before, threads_before = len(gradsync.distributed._engines), threads_now()
        del dropped, group
    sums.append(pending_work.wait() is not None and big.unique().tolist())
    named = torch._C._distributed_c10d._resolve_process_group("gradsync-test-named")
    x = torch.full((1000,), rank + 1.0)
    gradsync.all_reduce(x, op="sum", group=named)
    sums.append(named in gradsync.distributed._engines and x.unique().tolist())
    torch._C._distributed_c10d._unregister_process_group("gradsync-test-named")
    deadline = time.monotonic() + 20  # the released groups end on a thread of their own
    while threads_now() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    return sums, len(gradsync.distributed._engines) - engines_before, threads_now() - threads_before


def test_a_group_made_by_hand_and_dropped_is_let_go_of(worlds):
    """Fault-tolerance libraries make a group by hand for each configuration and drop the last one:
    gradsync held each one's engine, gloo's threads and sockets until shutdown() (four threads and
    five descriptors a group). Those held elsewhere keep their engines and their calls' order (one
    named in torch's registry included); one dropped with a call running is let go of once the call
    is done."""
    for sums, engines, threads in worlds(2).run(groups_made_by_hand_and_dropped):
        assert sums == [[2.0 * i + 3] for i in range(12) for _ in range(3)] + [[3.0], [3.0]], sums
        assert engines <= 0 and threads <= 0, (engines, threads)


def a_child_calls_on_a_group_made_by_hand_before_the_fork(rank, size):
    """Where gradsync never used it before the fork, it did not know of the group, and the child drove
    the parent's connections: it hung, and the parent aborted in gloo (epoll_ctl)."""
    group = made_by_hand(rank, size, timeout_s=10)
    gradsync.all_reduce(torch.ones(10))  # gradsync runs, on the default group
    out = {}
    if rank == 0:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                gradsync.all_reduce(torch.ones(8), op="sum", group=group)
                said = b"returned"
            except RuntimeError as e:
                said = str(e).encode()
            os.write(write, said[:4000])
            os._exit(0)
        os.close(write)
        deadline = time.monotonic() + 20
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                out["child"] = "hung"
                break
            time.sleep(0.02)
        out.setdefault("child", os.read(read, 4000).decode())
        os.close(read)
    dist.barrier()
    y = torch.full((8,), float(rank + 1))
    gradsync.all_reduce(y, op="sum", group=group)  # the parents' group is whole
    out["parents"] = y.tolist()
    gradsync.shutdown()  # no engine left for the later tests of this world to count
    return out


def test_a_forked_child_refuses_a_group_made_by_hand_before_the_fork(worlds):
    out = worlds(2).run(a_child_calls_on_a_group_made_by_hand_before_the_fork)
    assert "made by fork() from one with process groups" in out[0]["child"], out
    assert out[0]["parents"] == out[1]["parents"] == [3.0] * 8, out


def timeouts_set_since(rank, size):
    """torch.distributed's _set_pg_timeout, as torchtitan sets it after a first step: gradsync's
    waits follow it, lowered or raised, as torch's collectives do."""
    lowered = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    raised = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    x = torch.ones(1000)
    for group in (lowered, raised):
        gradsync.all_reduce(x, group=group)  # its engine made, as by a first step
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2), lowered)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=60), raised)
    if rank == 1:
        time.sleep(5)  # late, within the raised timeout
    gradsync.all_reduce(x, group=raised)
    if rank == 1:
        return None  # and never calls on the lowered group
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        gradsync.all_reduce(x, group=lowered)
    return time.monotonic() - start


def test_the_timeout_is_the_group_s_as_it_is_now(worlds):
    seconds, _ = worlds(2).run(timeouts_set_since, timeout=40)
    assert 1 <= seconds <= 12, seconds


def destroy_group_first(rank, size):
    x = torch.randn(100000)
    gradsync.all_reduce(x, codec="fp16")
    dist.destroy_process_group()
    start = time.monotonic()
    gradsync.shutdown()
    return time.monotonic() - start


def test_exit_after_the_group_is_destroyed_does_not_hang():
    world = World(3)
    try:
        assert max(world.run(destroy_group_first, timeout=60)) < 5
    finally:
        assert world.close(), "a rank did not exit by itself"


EXITS_AFTER_A_BAD_CALL = """
import datetime, os, sys, time
import torch, torch.distributed as dist, gradsync
rank = int(sys.argv[1])
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
t = torch.full((1000,), float(rank + 1))
if rank == 1:
    time.sleep(2)  # rank 0 has exited by now, but for the calls it issued
try:
    gradsync.all_reduce(torch.zeros(10, dtype=torch.float64) if rank == 0 else torch.zeros(10))
except (TypeError, ValueError) as error:
    print(type(error).__name__, error, flush=True)
gradsync.all_reduce(t, op="sum", async_op=rank == 0)
print("sum", t[0].item(), flush=True)
"""


def test_the_exit_finishes_the_calls_issued_after_a_refused_one(tmp_path):
    # rank 0 refuses a call (its peers check it), issues another and exits: its exit waits for both,
    # so rank 1 learns why the first failed, and sums the second
    ranks = run_processes([[sys.executable, "-c", EXITS_AFTER_A_BAD_CALL, str(rank)] for rank in range(2)], tmp_path)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    assert "group rank(s) 0 could not prepare the call" in ranks[1][1] and "sum 3.0" in ranks[1][1], ranks


CALLS_FROM_A_REFUSALS_CALLBACK = """
import datetime, os, sys, time
import torch, torch.distributed as dist, gradsync
from gradsync.distributed import _refusal
rank = int(sys.argv[1])
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
gradsync.all_reduce(torch.ones(10))
if rank == 1:  # DataParallel's turn for a bucket it did not send, its peer in the unchecked call
    work = _refusal(None, torch.ones(10), checked=True, op=0, why="refused here", peers_unchecked=True)
    work.get_future().then(lambda _: gradsync.all_reduce(torch.ones(10), async_op=True))
    sys.exit(3)
try:
    gradsync.all_reduce(torch.ones(100000), check_call=False)
except RuntimeError as error:
    print("failed:", error, flush=True)
"""


def test_a_call_from_the_callback_of_a_refusal_abandoned_at_exit_fails_at_once(tmp_path):
    # the exit ends the refusal's calls; a callback's call on the group goes to that engine and fails,
    # rather than start a new engine whose call the exit would wait for until the group's timeout
    start = time.monotonic()
    ranks = run_processes([[sys.executable, "-c", CALLS_FROM_A_REFUSALS_CALLBACK, str(rank)] for rank in range(2)],
                          tmp_path)
    assert [code for code, _, _ in ranks] == [0, 3] and "failed:" in ranks[0][1], ranks
    assert time.monotonic() - start < 40


DESTROYS_ITS_GROUP_WITHOUT_SHUTDOWN = """
import atexit, datetime, os, sys


def backend_threads_at_the_end():  # registered before gradsync's exit handler, so it runs after it
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    print("gloo threads:", sorted(name for name in names if "gloo" in name), flush=True)


atexit.register(backend_threads_at_the_end)
import torch, torch.distributed as dist, gradsync
rank = int(sys.argv[1])
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
t = torch.ones(1000)
for _ in range(3):
    gradsync.all_reduce(t)
    dist.all_reduce(t)
dist.destroy_process_group()  # without gradsync.shutdown() first
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the threads' names from /proc")
def test_a_group_destroyed_without_shutdown_is_torn_down_before_the_interpreter_finalizes(tmp_path):
    # gradsync kept the group to the process's end, so gloo's threads ran on into the interpreter's
    # finalization, where one that took the GIL aborted the process (about one run in 13)
    ranks = run_processes([[sys.executable, "-c", DESTROYS_ITS_GROUP_WITHOUT_SHUTDOWN, str(rank)] for rank in range(2)],
                          tmp_path)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    assert all("gloo threads: []" in out for _, out, _ in ranks), ranks
    assert not any("RuntimeWarning" in err for _, _, err in ranks), ranks  # its teardown ended in time


RANK_0_LOCKS_UNTIL_ITS_END = """
import fcntl, os, sys, time
rank = int(sys.argv[1])
# rank 0 holds the lock until its process has ended, its finalization too: a raw descriptor, which
# Python never closes (a file object's closes as the interpreter clears its modules)
alive = os.open("rank0-alive", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
if rank == 0:
    fcntl.flock(alive, fcntl.LOCK_EX)
def rank_0_ended(within_s=60):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            fcntl.flock(alive, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.1)
    return False
"""

LEAVES_A_TORCH_CALL_PENDING_ON_A_DESTROYED_GROUP = RANK_0_LOCKS_UNTIL_ITS_END + """
import atexit, datetime
exiting = None
def ended():  # registered before gradsync's exit handler, so it runs after it
    if exiting is not None:
        print(f"exit took {time.monotonic() - exiting:.1f} s", flush=True)
atexit.register(ended)
import torch, torch.distributed as dist, gradsync
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
subs = [dist.new_group([0, 1]) for _ in range(3)]
for sub in subs:
    gradsync.all_reduce(torch.ones(10), group=sub)
if rank == 1:
    if rank_0_ended():  # alive till then, but never making rank 0's calls below
        print("left once rank 0 had ended", flush=True)
    sys.exit(0)
works = [dist.all_reduce(torch.ones(10), group=sub, async_op=True) for sub in subs]  # torch's own, waiting
for sub in subs:
    dist.destroy_process_group(sub)
del sub, subs, works
exiting = time.monotonic()
"""


def test_the_exit_waits_a_bounded_time_for_a_destroyed_groups_teardown(tmp_path):
    # tearing a group down waits for the torch call that rank 1 never makes, until the group's
    # timeout (60 s here, 30 min by default), so the exit waits for the three at most EXIT_RELEASE_S
    # in all. Rank 1 leaves once rank 0's process has ended: ending the teardown during rank 0's
    # finalization aborts it with torch 2.14, whose teardown then takes the GIL (see README)
    ranks = run_processes([[sys.executable, "-c", LEAVES_A_TORCH_CALL_PENDING_ON_A_DESTROYED_GROUP, str(rank)]
                           for rank in range(2)], tmp_path)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    took = float(ranks[0][1].split("exit took ")[1].split()[0])
    assert took < 15, ranks[0]
    assert "left once rank 0 had ended" in ranks[1][1], ranks[1]
    # the exit says why the process may still abort
    assert "RuntimeWarning: gradsync: the teardown of a process group it let go of (one torch.distributed " \
           "destroyed, or one made by hand) still waits after 5 s (a torch call still pending on it?)" in ranks[0][2], \
        ranks[0]
    assert "RuntimeWarning" not in ranks[1][2], ranks[1]


INTERRUPTED_AS_IT_EXITS = RANK_0_LOCKS_UNTIL_ITS_END + """
import datetime, signal
import torch, torch.distributed as dist, gradsync
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
first, second, destroyed = dist.group.WORLD, dist.new_group([0, 1]), dist.new_group([0, 1])
gradsync.all_reduce(torch.ones(4), group=destroyed)
if rank == 1:
    time.sleep(3)  # rank 0's exit waits for this call, and is interrupted meanwhile
    gradsync.all_reduce(torch.ones(4), group=first)
    rank_0_ended()  # alive till then, but never making rank 0's call on the second group
    sys.exit(0)
gradsync.all_reduce(torch.ones(4), group=first, async_op=True)
def ended(future):
    try:
        future.value()
    except RuntimeError as e:
        print("the second group's call raised:", str(e).splitlines()[0], flush=True)
gradsync.all_reduce(torch.ones(4), group=second, async_op=True).get_future().then(ended)
pending = dist.all_reduce(torch.ones(4), group=destroyed, async_op=True)  # torch's own, which rank 1 never makes
dist.destroy_process_group(destroyed)
del destroyed  # its teardown waits for that call: the exit waits EXIT_RELEASE_S for it
def interrupt(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
signal.alarm(1)  # during the exit's shutdown(), as it waits for the first group's call
"""


@pytest.mark.parametrize("warnings_as_errors", [False, True])
def test_a_keyboard_interrupt_as_the_process_exits_ends_the_calls_shutdown_had_not_reached(tmp_path,
                                                                                            warnings_as_errors):
    # they ran on into the interpreter's finalization, where their callbacks could not run (or
    # aborted the process). The exit's warning of a teardown still waiting is not given then: as an
    # error (-W error) it replaced the interrupt, whose calls were left running
    start = time.monotonic()
    flags = ["-W", "error::RuntimeWarning"] if warnings_as_errors else []  # only gradsync's: torch may warn at import
    ranks = run_processes([[sys.executable, *flags, "-c", INTERRUPTED_AS_IT_EXITS, str(rank)] for rank in range(2)],
                          tmp_path)
    assert [code for code, _, _ in ranks] == [0, 0], ranks  # an exception in an exit handler is printed
    assert "KeyboardInterrupt" in ranks[0][2] and "RuntimeWarning" not in ranks[0][2], ranks[0]
    said = ranks[0][1]
    assert "the second group's call raised" in said, ranks[0]
    assert "the group's calls were abandoned as the process exits" in said, ranks[0]
    assert time.monotonic() - start < 50, ranks  # not the group's timeout


def group_made_in_python(rank, size):
    """A process group made in Python, as fault-tolerance libraries wrap one: its works' wait()
    returns None, which is no abort. It registers no backend."""
    inner = dist.new_group(list(range(size)))

    class Work(dist.Work):
        def __init__(self, work):
            super().__init__()
            self.work = work

        def wait(self, timeout=datetime.timedelta(0)):
            self.work.wait()

    class Wrapped(dist.ProcessGroup):
        def __init__(self):
            super().__init__(rank, size)

        def send(self, tensors, dst, tag=0):
            return Work(inner.send(tensors, dst, tag))

        def recv(self, tensors, src, tag=0):
            return Work(inner.recv(tensors, src, tag))

        def getBackendName(self):
            return "wrapped-gloo"

    return Wrapped()


def all_reduce_over_a_group_made_in_python(rank, size):
    x = torch.full((1000,), rank + 1.0)
    gradsync.all_reduce(x, op="sum", group=group_made_in_python(rank, size))
    return x.unique().tolist()


def test_a_process_group_made_in_python_carries_the_ring(worlds):
    assert worlds(2).run(all_reduce_over_a_group_made_in_python) == [[3.0], [3.0]]


FORKED_CHILD = """
import os, sys, time, torch, torch.distributed as dist, gradsync
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=0, world_size=1)
x = torch.randn(1000)
gradsync.all_reduce(x, codec="fp16")  # the group's engine and its thread exist now
pid = os.fork()
if pid == 0:  # a child with the parent's engine but not its thread
    y = torch.randn(1000)
    gradsync.all_reduce(y, codec="fp16")
    assert torch.equal(y, y.half().float())
    sys.exit(0)  # atexit: gradsync.shutdown()
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit("the forked child hung")
"""


WORKERS_FORKED_AFTER_A_WORLD = """
import datetime, os, sys, time, torch, torch.distributed as dist, gradsync
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("parent"), rank=0, world_size=1)
gradsync.all_reduce(torch.ones(10))
dist.destroy_process_group()  # a launcher that had a world of its own, gone before the workers
pids = []
for rank in range(2):
    pid = os.fork()
    if pid == 0:  # a worker: a world of its own and a group made by hand, as fault-tolerance libraries make it
        dist.init_process_group("gloo", init_method="file://" + os.path.abspath("workers"), rank=rank, world_size=2)
        store = dist.PrefixStore("by-hand", dist.distributed_c10d._get_default_store())
        group = dist.ProcessGroup(store, rank, 2)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                                dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=20)))
        x = torch.full((8,), rank + 1.0)
        gradsync.all_reduce(x, op="sum", group=group)
        gradsync.shutdown()
        os._exit(0 if x.tolist() == [3.0] * 8 else 3)
    pids.append(pid)
deadline, codes = time.monotonic() + 60, {}
while len(codes) < len(pids) and time.monotonic() < deadline:
    for pid in pids:
        done, status = (0, 0) if pid in codes else os.waitpid(pid, os.WNOHANG)
        if done:
            codes[pid] = os.waitstatus_to_exitcode(status)
    time.sleep(0.05)
for pid in set(pids) - set(codes):
    os.kill(pid, 9)
sys.exit(f"workers: {sorted(codes.values())}" if sorted(codes.values()) != [0, 0] else 0)
"""


A_GROUP_USED_THEN_SHUT_DOWN_BEFORE_A_FORK = """
import datetime, multiprocessing, os, signal, sys, time


def rank_main(rank, folder):
    import faulthandler
    faulthandler.enable(all_threads=True)  # where a rank aborts, the Python stacks say where
    import torch, torch.distributed as dist, gradsync
    # a world of one rank each, and a group of both made by hand (as fault-tolerance libraries do)
    dist.init_process_group("gloo", init_method=f"file://{folder}/world{rank}", rank=0, world_size=1)
    store = dist.FileStore(f"{folder}/by-hand", 2)
    group = dist.ProcessGroup(store, rank, 2)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                            dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=10)))
    gradsync.all_reduce(torch.ones(8), group=group)
    gradsync.shutdown()  # the group's engine is gone, and the group still the parent's
    said = ""
    if rank == 0:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                gradsync.all_reduce(torch.ones(8), group=group)
                os.write(write, b"returned")
            except RuntimeError as e:
                os.write(write, str(e).encode()[:2000])
            os._exit(0)
        os.close(write)
        deadline = time.monotonic() + 20
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                sys.exit("the child hung")
            time.sleep(0.02)
        said = os.read(read, 2000).decode()
    y = torch.full((8,), rank + 1.0)
    gradsync.all_reduce(y, op="sum", group=group)
    gradsync.shutdown()  # and the exit at once, which waits for the group's release (it aborted)
    sys.exit(0 if ("made before fork()" in said or rank == 1) and y.tolist() == [3.0] * 8 else f"{said!r} {y}")


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(rank, os.getcwd())) for rank in range(2)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + 60
    for p in ranks:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in ranks:
        if p.exitcode is None:
            p.kill()
            p.join(10)
    sys.exit(0 if [p.exitcode for p in ranks] == [0, 0] else f"exit codes {[p.exitcode for p in ranks]}")
"""


def run_script(tmp_path, text):
    """Runs ``text`` as a script in ``tmp_path``, over loopback, as the other script tests do."""
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))


def test_a_forked_child_refuses_a_group_gradsync_used_before_a_shutdown(tmp_path):
    out = run_script(tmp_path, A_GROUP_USED_THEN_SHUT_DOWN_BEFORE_A_FORK)
    assert out.returncode == 0, out.stdout + out.stderr


def test_workers_forked_by_a_process_whose_world_is_gone_use_groups_made_by_hand(tmp_path):
    out = run_script(tmp_path, WORKERS_FORKED_AFTER_A_WORLD)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_forked_child_all_reduces_and_exits(tmp_path):
    child = subprocess.run([sys.executable, "-c", FORKED_CHILD], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"), cwd=tmp_path)  # the installed gradsync
    assert child.returncode == 0, child.stderr[-3000:]


FAKE_BACKEND = """
import pytest, torch, torch.distributed as dist, gradsync
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
dist.all_reduce(torch.ones(8))  # torch's collectives do nothing there
for call in (lambda: gradsync.all_reduce(torch.ones(8)), lambda: gradsync.reduce_scatter(torch.ones(2), torch.ones(8))):
    with pytest.raises(ValueError, match="the group's backend is torch's fake one"):
        call()
"""


def test_the_fake_backend_is_refused_by_name(tmp_path):
    # before: a segmentation fault (a group whose backend keeps no options), or ranks said to disagree
    child = subprocess.run([sys.executable, "-c", FAKE_BACKEND], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
    assert child.returncode == 0, child.stderr[-3000:]


def world_of_one(rank, size):
    x = torch.randn(3000)
    y = x.clone()
    gradsync.all_reduce(y, codec="none")
    z = x.clone()
    gradsync.all_reduce(z, codec="fp16")
    return torch.equal(x, y), torch.equal(z, x.half().float())


def recording_callback(seen, action):
    """A future callback that runs ``action`` and appends "no error" or its RuntimeError's message."""
    def callback(future):
        try:
            action()
            seen.append("no error")
        except RuntimeError as e:
            seen.append(str(e))
    return callback


def in_a_callback_on_rank_0(rank, seen, action):
    """Rank 0 runs ``action`` in a callback of an all-reduce's future, on the group's thread. Rank 1
    makes its call only after rank 0 has attached the callback, so that the call cannot have finished
    before (a callback attached to a finished future runs at once, on the attaching thread)."""
    if rank == 0:
        done = gradsync.all_reduce(torch.ones(4), async_op=True).get_future().then(recording_callback(seen, action))
        dist.barrier()
        done.wait()
    else:
        dist.barrier()
        gradsync.all_reduce(torch.ones(4))


def shutdown_in_a_callback(rank, size):
    """gradsync.shutdown() in a future's callback, on gradsync's own thread: refused, not a crash.
    Rank 1 makes its call only after rank 0 has attached the callback, so that the callback runs
    when the call completes, on the thread that completes it."""
    seen = []
    in_a_callback_on_rank_0(rank, seen, gradsync.shutdown)
    x = torch.ones(4)
    gradsync.all_reduce(x, op="sum")  # the engine goes on
    return seen, x.tolist()


def call_while_shutting_down(rank, size):
    """A callback that issues calls on the group while rank 0's shutdown() finishes the group's
    calls: they run among them, in their turn, as rank 1's do (rank 1 does not shut down then).
    One waited for there is refused, and takes its turn: rank 1's raises naming rank 0. Before, both
    raised on rank 0 without taking their turn, and rank 1's calls paired with rank 0's next ones:
    same shapes, wrong sums. Rank 1 makes its calls once rank 0's shutdown() is waiting for them."""
    seen, sums = [], []

    def issue_two():
        with contextlib.suppress(RuntimeError):
            gradsync.all_reduce(torch.ones(4))  # waited for on the group's thread: refused
            seen.append("the waited call was not refused")
        c = torch.full((4,), 10.0)
        sums.append((c, gradsync.all_reduce(c, op="sum", async_op=True)))
    callback = recording_callback(seen, issue_two)
    if rank == 0:
        gradsync.all_reduce(torch.ones(4), async_op=True).get_future().then(callback)
        stopper = threading.Thread(target=gradsync.shutdown)
        stopper.start()
        deadline = time.monotonic() + 30
        while not gradsync.distributed._stopping and time.monotonic() < deadline:
            time.sleep(0.001)
        dist.barrier()
        stopper.join(30)
        assert not stopper.is_alive() and not gradsync.distributed._stopping
        c, work = sums[0]
        assert work.is_completed()  # shutdown() finished it
        work.wait()
    else:
        dist.barrier()
        gradsync.all_reduce(torch.ones(4))
        try:
            gradsync.all_reduce(torch.ones(4))
            seen.append("no error")
        except ValueError as e:
            seen.append(str(e))
        c = torch.full((4,), 20.0)
        gradsync.all_reduce(c, op="sum")
        gradsync.shutdown()
    x = torch.full((4,), 100.0 * (rank + 1))
    gradsync.all_reduce(x, op="sum")  # a new engine on each rank
    return seen, c.tolist(), x.tolist()


def test_calls_from_a_callback_while_shutdown_finishes_the_groups_calls_take_their_turn(worlds):
    (seen0, c0, x0), (seen1, c1, x1) = worlds(2).run(call_while_shutting_down)
    assert seen0 == ["no error"], seen0
    assert len(seen1) == 1 and "group rank(s) 0 could not prepare the call" in seen1[0], seen1
    assert c0 == c1 == [30.0] * 4 and x0 == x1 == [300.0] * 4


def call_from_a_thread_while_shutting_down(rank, size):
    """Rank 0's shutdown() finishes a call that waits for rank 1 while rank 0 issues its next call
    from another thread: that call waits for shutdown(), then pairs with rank 1's next call."""
    sums = []
    if rank == 0:
        first = torch.full((4,), 1.0)
        work = gradsync.all_reduce(first, op="sum", async_op=True)
        stopper = threading.Thread(target=gradsync.shutdown)
        stopper.start()
        deadline = time.monotonic() + 30
        while not gradsync.distributed._stopping and time.monotonic() < deadline:
            time.sleep(0.001)
        dist.barrier()  # rank 1 makes its first call half a second later: shutdown() is still waiting
        for value in (20.0, 300.0):
            x = torch.full((4,), value)
            gradsync.all_reduce(x, op="sum")
            sums.append(x[0].item())
        stopper.join(30)
        work.wait()
        sums.insert(0, first[0].item())
    else:
        dist.barrier()
        time.sleep(0.5)
        for value in (2.0, 40.0, 600.0):
            x = torch.full((4,), value)
            gradsync.all_reduce(x, op="sum")
            sums.append(x[0].item())
    return sums


def test_a_call_from_another_thread_while_shutdown_runs_waits_and_takes_its_turn(worlds):
    assert worlds(2).run(call_from_a_thread_while_shutting_down) == [[3.0, 60.0, 900.0]] * 2


def a_group_shut_down_while_another_waits(rank, size):
    """Rank 0's shutdown() has finished g1's calls and waits for one on g2, which rank 1 makes only
    after a call on g1: rank 0's next call on g1 goes ahead on a new engine rather than wait for the
    whole shutdown()."""
    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    for group in (g1, g2):  # their engines, made in this order: shutdown() stops g1's first
        gradsync.all_reduce(torch.ones(4), group=group)
    on_g1, on_g2 = torch.full((4,), rank + 1.0), torch.full((4,), 10.0 * (rank + 1))
    if rank == 0:
        work = gradsync.all_reduce(on_g2, op="sum", group=g2, async_op=True)
        stopper = threading.Thread(target=gradsync.shutdown)
        stopper.start()
        deadline = time.monotonic() + 30
        while g2 not in gradsync.distributed._stopping and time.monotonic() < deadline:
            time.sleep(0.001)
        gradsync.all_reduce(on_g1, op="sum", group=g1)
        stopper.join(30)
        work.wait()
        assert not stopper.is_alive()
    else:
        gradsync.all_reduce(on_g1, op="sum", group=g1)
        gradsync.all_reduce(on_g2, op="sum", group=g2)
    gradsync.shutdown()  # the world's later tests count engines
    for group in (g1, g2):
        dist.destroy_process_group(group)
    return on_g1[0].item(), on_g2[0].item()


def test_a_call_waits_for_shutdown_to_finish_its_own_groups_calls_only(worlds):
    assert worlds(2).run(a_group_shut_down_while_another_waits) == [(3.0, 30.0)] * 2


def test_shutdown_in_a_callback_raises(worlds):
    (seen, x), (_, y) = worlds(2).run(shutdown_in_a_callback)
    assert len(seen) == 1 and "cannot run on gradsync's communication thread" in seen[0], seen
    assert x == y == [2.0] * 4


def used_then_destroyed(size, count):
    """``count`` groups, each used by gradsync, then all destroyed by torch.distributed."""
    groups = [dist.new_group(list(range(size))) for _ in range(count)]
    for group in groups:
        gradsync.all_reduce(torch.ones(100000), group=group, codec="bf16")
    for group in groups:
        dist.destroy_process_group(group)


def lifecycle(rank, size):
    """What a group's life may bring: shutdown() on one rank only, a call waited for in a callback of
    the same group's future, groups made and destroyed over and over, a fork()."""
    out = {}
    for _ in range(3):
        gradsync.all_reduce(torch.ones(4))
    if rank == 0:
        gradsync.shutdown()  # its next call starts a new engine, which must pair with rank 1's
    x = torch.ones(4)
    gradsync.all_reduce(x, op="sum")
    out["after a shutdown on rank 0"] = x.tolist()

    seen = []  # rank 0 waits for a call in a callback on the group's thread
    in_a_callback_on_rank_0(rank, seen, lambda: gradsync.all_reduce(torch.ones(4)))
    if rank == 1:
        try:  # pairs with rank 0's refused call, which took its turn
            gradsync.all_reduce(torch.ones(4))
            seen.append("no error")
        except ValueError as e:
            seen.append(str(e))
    y = torch.ones(4)
    gradsync.all_reduce(y, op="sum")
    out["waited in a callback"] = seen, y.tolist()

    before = threads_now()
    for _ in range(12):
        group = dist.new_group(list(range(size)))
        gradsync.all_reduce(torch.ones(100000), group=group, codec="bf16")
        dist.destroy_process_group(group)
    gradsync.all_reduce(torch.ones(4))  # the default group's engine exists: no sweep here
    last = dist.new_group(list(range(size)))
    gradsync.all_reduce(torch.ones(4), group=last)  # a new engine lets go of the destroyed groups'
    deadline = time.monotonic() + 20
    while threads_now() > before + 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    out["threads added by 12 destroyed groups"] = threads_now() - before
    out["engines"] = len(gradsync.distributed._engines)
    with pytest.raises((RuntimeError, ValueError)):  # torch's own error, or gradsync's where torch has none
        gradsync.all_reduce(torch.ones(4), group=group)
    del group

    gradsync.shutdown()
    settled, before = -1, threads_now()
    while before != settled and time.monotonic() < deadline + 20:  # the 12 groups' threads ending
        time.sleep(0.3)
        settled, before = before, threads_now()
    used_then_destroyed(size, 6)
    gradsync.shutdown()  # lets go of the destroyed groups too (no new engine may ever come)
    deadline = time.monotonic() + 20
    while threads_now() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    out["threads left by 6 groups destroyed before shutdown()"] = threads_now() - before

    done = gradsync.all_reduce(torch.ones(4), async_op=True)
    done.wait()
    # rank 1 makes its part only once rank 0's child is over: in flight across the fork
    pending = gradsync.all_reduce(torch.ones(4), async_op=True) if rank == 0 else None
    pid = os.fork()
    if pid == 0:  # the inherited default group is the parent's connections
        try:
            gradsync.all_reduce(torch.ones(4))
            code = 1
        except RuntimeError as e:
            code = 0 if "made before fork()" in str(e) else 2
        done.wait()  # completed before the fork: as it was
        for wait in ([pending.wait, lambda: pending.get_future().wait()] if pending is not None else []):
            try:
                wait()
                code = 3
            except RuntimeError as e:  # not a wait for the parent's thread, forever
                code = code if "issued before fork() and had not completed" in str(e) else 4
        os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            out["forked child"] = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        out["forked child"] = "hung"
    dist.barrier()
    if pending is not None:
        pending.wait()
    else:
        gradsync.all_reduce(torch.ones(4))
    z = torch.ones(4)
    gradsync.all_reduce(z, op="sum")  # the parent's group goes on
    out["parent after the fork"] = z.tolist()
    return out


def waits_in_callbacks(rank, size):
    """Rank 0's callback of a call's future waits for the group's next call: that call runs on the
    thread running the callback, after it, so the wait raises rather than block that thread forever.
    A callback's wait for a call already done returns."""
    seen = []
    if rank == 1:
        dist.barrier()  # rank 0's first call completes only after its callbacks are in place
    first, second = torch.ones(4), torch.ones(4)
    w1 = gradsync.all_reduce(first, op="sum", async_op=True)
    w2 = gradsync.all_reduce(second, op="sum", async_op=True)

    def wait_for(work):
        def callback(fut):
            try:
                work.wait()
                seen.append("returned")
            except RuntimeError as e:
                seen.append(str(e))
        return callback
    chained = [w1.get_future().then(wait_for(w2)), w2.get_future().then(wait_for(w1))]
    if rank == 0:
        dist.barrier()
    w2.wait()
    for fut in chained:
        fut.wait()
    return seen, first.tolist(), second.tolist()


def test_a_wait_in_a_callback_for_a_later_call_of_the_group_raises(worlds):
    for rank, (seen, first, second) in enumerate(worlds(2).run(waits_in_callbacks, timeout=60)):
        assert first == second == [2.0] * 4
        if rank == 0:
            assert len(seen) == 2 and "would wait forever: chain it with get_future().then" in seen[0], seen
            assert seen[1] == "returned", seen


def test_a_group_survives_one_rank_s_shutdown_a_waiting_callback_and_a_fork_and_destroyed_groups_go(worlds):
    for rank, out in enumerate(worlds(2).run(lifecycle)):
        assert out["after a shutdown on rank 0"] == [2.0] * 4
        seen, y = out["waited in a callback"]
        words = "would wait there for itself: pass async_op=True" if rank == 0 else "0 could not prepare the call"
        assert len(seen) == 1 and words in seen[0], seen
        assert y == [2.0] * 4
        assert out["threads added by 12 destroyed groups"] <= 16, out  # 52 when none is let go
        assert out["engines"] == 2, out
        assert out["threads left by 6 groups destroyed before shutdown()"] <= 0, out
        assert out["forked child"] == 0, out
        assert out["parent after the fork"] == [2.0] * 4


def trained_after_destroy(rank, size, order, default_group):
    """One step of gradsync.DataParallel and of a DDP hook on a group, then the group destroyed
    (``order``: after shutdown(), or without): each later step raises, saying so, rather than
    communicate over it (they did, over the destroyed group or one a later call happened to start)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    group = None if default_group else dist.new_group(list(range(size)))
    torch.manual_seed(0)
    wrapped = gradsync.DataParallel(torch.nn.Linear(8, 2), codec="fp16", process_group=group)
    hooked = DDP(torch.nn.Linear(8, 2), process_group=group)
    hooked.register_comm_hook(gradsync.hooks.GradSyncState(group), gradsync.hooks.allreduce_hook)
    x = torch.randn(4, 8)
    for model in (wrapped, hooked):
        model(x).sum().backward()
    if order == "shutdown, destroy":
        gradsync.shutdown()
    dist.destroy_process_group(group)
    outcomes = []
    for model in (wrapped, hooked):
        model.zero_grad()
        try:
            model(x).sum().backward()
            outcomes.append("trained")
        except RuntimeError as e:
            outcomes.append(str(e))
    return outcomes


@pytest.mark.parametrize("order", ["shutdown, destroy", "destroy"])
def test_training_on_a_destroyed_group_raises(worlds, order):
    results = worlds(2).run(trained_after_destroy, order, False)
    world = World(2, group_timeout_s=20)  # the default group, destroyed: a world of its own
    try:
        results += world.run(trained_after_destroy, order, True, timeout=120)
    finally:
        world.close()
    for i, outcomes in enumerate(results):
        assert len(outcomes) == 2, outcomes
        assert "torch.distributed destroyed this process group" in outcomes[0], outcomes
        # the hook's state names the default group as None: gone with torch.distributed itself
        gone = "needs torch.distributed to be initialized" if i >= 2 else "torch.distributed destroyed this process"
        assert gone in outcomes[1], outcomes


def test_world_of_one_applies_the_codec_and_nothing_else(worlds):
    assert worlds(1).run(world_of_one) == [(True, True)]


def zero_tensors_refused(rank, size):
    """torch._efficientzerotensor: a plain tensor whose storage has a size but no memory (a segfault)."""
    zero, said = torch._efficientzerotensor(1000), []
    for call in (lambda: gradsync.all_reduce(zero), lambda: gradsync.reduce_scatter(torch.empty(1000 // size), zero),
                 lambda: gradsync.all_gather(zero, torch.ones(1000 // size))):
        try:
            call()
            said.append("no error")
        except ValueError as e:
            said.append(str(e))
    return said


def test_a_zero_tensor_is_refused_by_name(worlds):
    for said in worlds(1).run(zero_tensors_refused):
        assert [s.split(" is a ZeroTensor")[0] for s in said] == ["tensor", "input", "output"], said
        assert all("torch.zeros_like" in s for s in said), said


def same_bits_up_to_nan_payload(a, b):
    """Bit for bit, except that a NaN need only meet a NaN: a GPU's arithmetic returns its own
    canonical NaN where x86 passes an operand's through."""
    a, b = a.cpu().flatten(), b.cpu().flatten()
    nan = torch.isnan(a.float())
    return torch.equal(nan, torch.isnan(b.float())) and torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))


def cuda_matches_cpu(rank, size):
    """The ring on CUDA tensors (over gloo, through pinned host memory) against the same ring on CPU
    tensors: the per-hop CUDA kernels are twins of the CPU ones, so every bit must agree (a NaN's
    payload aside)."""
    torch.cuda.set_device(0)  # all ranks share one GPU: gloo, unlike NCCL, allows it
    same = {}
    for codec in gradsync.CODECS:
        for dtype_name, dtype in DTYPES.items():
            x = rank_input(rank, 100003, dtype, seed=5)
            on_cpu = x.clone()
            gradsync.all_reduce(on_cpu, codec=codec)
            on_gpu = x.cuda()
            gradsync.all_reduce(on_gpu, codec=codec)
            same[(codec, dtype_name)] = same_bits_up_to_nan_payload(on_gpu, on_cpu)
        # error feedback, with an overflow in the inputs
        x = rank_input(rank, 100003, torch.float32, seed=6)
        x[::11] = float("inf")
        residual = rank_input(rank, 100003, torch.float32, seed=7) * 1e-3
        on_cpu, cpu_residual = x.clone(), residual.clone()
        gradsync.all_reduce(on_cpu, codec=codec, residual=cpu_residual)
        on_gpu, gpu_residual = x.cuda(), residual.cuda()
        gradsync.all_reduce(on_gpu, codec=codec, residual=gpu_residual)
        same[(codec, "feedback")] = (same_bits_up_to_nan_payload(on_gpu, on_cpu)
                                     and same_bits_up_to_nan_payload(gpu_residual, cpu_residual))
    # NCCL-sized slices (one per chunk here), so that every per-hop kernel's grid strides more than once
    saved = gradsync.distributed.SLICE_BYTES
    gradsync.distributed.SLICE_BYTES = 64 << 20  # read at each call, on every rank alike
    try:
        for codec in ("fp16", "fp8_e4m3"):
            x = rank_input(rank, 9_000_011, torch.float32, seed=8)
            residual = rank_input(rank, x.numel(), torch.float32, seed=9) * 1e-3
            on_cpu, on_gpu = x.clone(), x.cuda()
            gradsync.all_reduce(on_cpu, codec=codec)
            gradsync.all_reduce(on_gpu, codec=codec)
            same[(codec, "big slices")] = same_bits_up_to_nan_payload(on_gpu, on_cpu)
            on_cpu, cpu_residual, on_gpu, gpu_residual = x.clone(), residual.clone(), x.cuda(), residual.cuda()
            gradsync.all_reduce(on_cpu, codec=codec, residual=cpu_residual)
            gradsync.all_reduce(on_gpu, codec=codec, residual=gpu_residual)
            same[(codec, "big slices, feedback")] = (same_bits_up_to_nan_payload(on_gpu, on_cpu)
                                                     and same_bits_up_to_nan_payload(gpu_residual, cpu_residual))
    finally:
        gradsync.distributed.SLICE_BYTES = saved
    return same


@pytest.mark.cuda
@pytest.mark.parametrize("size", [1, 3])
def test_ring_on_one_gpu_matches_the_cpu_ring_bitwise(worlds, size):
    for same in worlds(size).run(cuda_matches_cpu):
        assert all(same.values()), [case for case, ok in same.items() if not ok]


def isas_agree(rank, size):
    """The ring under the portable scalar kernels and under the AVX2 ones: the same bits, including
    the per-hop decode-add-encode, with Inf and NaN in the inputs and every input dtype; and with
    infinities alone, in few of the fp8 blocks (the others take the vector paths for finite blocks)."""
    from gradsync import _C
    same = {}
    for codec, (dtype_name, dtype), nan in itertools.product(gradsync.CODECS, DTYPES.items(), (True, False)):
        x = rank_input(rank, 50021, torch.float32, seed=8)
        x[rank::997] = float("inf") if rank % 2 else float("-inf")
        if nan:  # NaNs of opposite signs meeting in one sum, also in the vector loops' scalar tails
            nans = torch.cat([torch.arange(0, 50021, 7), torch.arange(50021 - 13, 50021)])
            x.view(torch.int32)[nans] = 0x7fc00000 if rank % 2 else -0x400000
        x = x.to(dtype)
        results = []
        for isa in ("scalar", "avx2"):
            _C.set_cpu_isa(isa)
            y = x.clone()
            gradsync.all_reduce(y, codec=codec)
            results.append(y.view(torch.uint8))
        _C.set_cpu_isa("auto")
        same[(codec, dtype_name, nan)] = torch.equal(*results)
    return same


def test_scalar_and_avx2_rings_agree_bitwise(worlds):
    from gradsync import _C
    if _C.cpu_isa() != "avx2":
        pytest.skip("no AVX2 on this CPU")
    for same in worlds(3).run(isas_agree):
        assert all(same.values()), [case for case, ok in same.items() if not ok]


def test_scales():
    assert resolve_scales("avg", 4) == (0.25, 1.0)
    assert resolve_scales("sum", 4) == (1.0, 1.0)
    assert resolve_scales("avg", 4, prescale=0.5) == (0.5, 0.5)
    assert resolve_scales("avg", 4, postscale=0.125) == (2.0, 0.125)
    assert resolve_scales("sum", 8, prescale=0.25, postscale=4.0) == (0.25, 4.0)
    with pytest.raises(ValueError, match="prescale \\* postscale must be 0.25"):
        resolve_scales("avg", 4, prescale=1.0, postscale=1.0)
    with pytest.raises(ValueError, match="op must be one of avg, sum"):
        resolve_scales("max", 4)
    # torch.distributed's own names for the two ops, as the enum value and as a ReduceOp object
    assert resolve_scales(dist.ReduceOp.AVG, 4) == (0.25, 1.0)
    assert resolve_scales(dist.ReduceOp.SUM, 4) == (1.0, 1.0)
    assert resolve_scales(dist.ReduceOp(dist.ReduceOp.SUM), 4) == (1.0, 1.0)
    for other in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT, "AVG", None):
        with pytest.raises(ValueError, match="op must be one of avg, sum"):
            resolve_scales(other, 4)
    with pytest.raises(ValueError, match="prescale must be a finite, non-zero number"):
        resolve_scales("avg", 4, prescale=0.0)
    # numbers beyond a float's range are refused as inf and 0 are (not an OverflowError, a ZeroDivisionError)
    for kwargs in (dict(prescale=10**400), dict(postscale=-(2**1024)), dict(prescale=fractions.Fraction(1, 3**1000)),
                   dict(postscale=fractions.Fraction(1, 3**1000))):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be a finite, non-zero number"):
            resolve_scales("avg", 4, **kwargs)
    assert resolve_scales("sum", 4, prescale=fractions.Fraction(1, 4), postscale=4) == (0.25, 4.0)
    with pytest.raises(ValueError, match="prescale is a tensor on the meta device, which holds no value"):
        resolve_scales("sum", 4, prescale=torch.tensor(0.5, device="meta"))
    # a pre-multiplied sum (FSDP2's after set_gradient_divide_factor), its factor a number or a tensor
    premul = dist._make_nccl_premul_sum  # ReduceOp.PREMUL_SUM(factor) on recent torch
    assert resolve_scales(premul(0.25), 8) == (0.25, 1.0)
    assert resolve_scales(premul(torch.tensor(0.5)), 8, postscale=2.0) == (0.25, 2.0)
    with pytest.raises(ValueError, match="prescale \\* postscale must be 0.125 for op='premul_sum'"):
        resolve_scales(premul(0.125), 8, prescale=1.0, postscale=1.0)
    with pytest.raises(ValueError, match="PREMUL_SUM's factor must be a finite, non-zero number"):
        resolve_scales(premul(float("inf")), 4)
    with pytest.raises(ValueError, match="PREMUL_SUM needs its factor"):
        resolve_scales(dist.ReduceOp.PREMUL_SUM, 4)
    # the kernels apply the factors in float32: each must be finite and non-zero there
    for kwargs in (dict(prescale=1e-50), dict(prescale=1e39), dict(postscale=1e-50)):
        with pytest.raises(ValueError, match="finite, non-zero float32"):
            resolve_scales("sum", 4, **kwargs)
    # the factor given is named when it is the one out of float32's range, the derived one otherwise
    for kwargs in (dict(prescale=1e-40), dict(prescale=1e39), dict(postscale=1e39), dict(postscale=1e-40)):
        with pytest.raises(ValueError, match=f"^{next(iter(kwargs))} must be a finite, non-zero float32"):
            resolve_scales("sum", 4, **kwargs)
    with pytest.raises(ValueError, match="the postscale it leaves must be a finite, non-zero float32"):
        resolve_scales("avg", 4, prescale=1e38)
    with pytest.raises(ValueError, match="the prescale it leaves must be a finite, non-zero float32"):
        resolve_scales(dist._make_nccl_premul_sum(1e30), 4, postscale=1e-10)
    # a one-element tensor is a number, as ReduceOp.PREMUL_SUM's factor may be
    assert resolve_scales("avg", 4, prescale=torch.tensor(0.5)) == (0.5, 0.5)
    assert resolve_scales("sum", 4, postscale=torch.tensor([2.0], dtype=torch.float64)) == (0.5, 2.0)
    for bad in (torch.tensor([0.5, 0.5]), torch.tensor(True), torch.tensor(1j)):
        with pytest.raises(ValueError, match="prescale must be a number or a one-element real tensor"):
            resolve_scales("avg", 4, prescale=bad)
    # ... and normal: a subnormal factor keeps few bits (2**-127 times 1e-3 is 24 bits short)
    for kwargs in (dict(prescale=2.0**-127), dict(postscale=-(2.0**-130)), dict(prescale=2.0**127)):
        with pytest.raises(ValueError, match="float32 of at least 2\\*\\*-126 in magnitude"):
            resolve_scales("sum", 4, **kwargs)
    assert resolve_scales("sum", 4, prescale=2.0**-126) == (2.0**-126, 2.0**126)
    assert resolve_scales("sum", 4, prescale=2.0**-100) == (2.0**-100, 2.0**100)


@pytest.mark.parametrize("call,error,words", [
    (lambda: gradsync.all_reduce(torch.arange(4)), TypeError, "tensor has dtype torch.int64"),
    (lambda: gradsync.all_reduce(torch.randn(4, 4).t()), ValueError, "tensor must be contiguous"),
    (lambda: gradsync.all_reduce([1.0]), TypeError, "tensor must be a torch.Tensor"),
    (lambda: gradsync.all_reduce(torch.ones(4).to_sparse()), ValueError, "tensor is a torch.sparse_coo tensor"),
    (lambda: gradsync.all_reduce(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)),
     ValueError, "tensor is a nested tensor"),
    (lambda: gradsync.all_reduce(torch.randn(4), codec="int8"), ValueError, "unknown codec 'int8'"),
    (lambda: gradsync.all_reduce(torch.randn(4)), RuntimeError, "torch.distributed to be initialized"),
    (lambda: gradsync.reduce_scatter(torch.randn(2), torch.randn(4)), RuntimeError,
     "gradsync.reduce_scatter needs torch.distributed to be initialized"),
    (lambda: gradsync.all_reduce(torch.randn(4), residual=torch.zeros(4, dtype=torch.float16)), ValueError,
     "residual must be a contiguous float32"),
    (lambda: gradsync.all_reduce(torch.randn(4), residual=torch.zeros(5)), ValueError, "residual must match"),
    (lambda: gradsync.all_reduce(torch.randn(4), residual=torch.zeros(4).to_sparse()), ValueError,
     "residual must be a contiguous float32 tensor, got a torch.sparse_coo one"),
    (lambda x=torch.randn(8): gradsync.all_reduce(x[:4], residual=x[3:7]), ValueError, "residual shares memory"),
    (lambda: gradsync.all_reduce(torch.randn(4), async_op="yes"), TypeError, "async_op must be True or False"),
    (lambda: gradsync.all_reduce(torch.randn(4), check_call=None), TypeError, "check_call must be True or False"),
    (lambda: gradsync.all_reduce(torch.randn(4), codec=["fp16"]), TypeError, "codec must be a str"),
])
def test_bad_input(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


def nccl_world_of_one(rank, size):
    """gradsync's own NCCL communicator at world size 1: its bootstrap, the device-memory agreement
    check, the paired schedule's kernels, futures and error feedback, against the CPU codecs."""
    group = dist.distributed_c10d._get_default_group()
    same = {}
    try:  # an NCCL group has no CPU backend: refused with a reason, and nothing else changes
        gradsync.all_reduce(torch.ones(4))
        same["cpu tensor refused"] = False
    except ValueError as error:
        same["cpu tensor refused"] = "backend is nccl" in str(error)
    for codec in gradsync.CODECS:
        x = rank_input(rank, 100003, torch.float32, seed=8)
        expected = gradsync.decompress(gradsync.compress(x, codec), codec, x.numel())
        on_gpu = x.cuda()
        gradsync.all_reduce(on_gpu, codec=codec)
        same[codec] = torch.equal(on_gpu.cpu().view(torch.uint8), expected.view(torch.uint8))
    future = gradsync.all_reduce(x.cuda(), codec="fp16", async_op=True).get_future()
    same["future"] = torch.equal(future.wait().cpu(), gradsync.decompress(gradsync.compress(x, "fp16"), "fp16", x.numel()))
    residual = torch.zeros(x.numel(), device="cuda")
    gradsync.all_reduce(x.cuda(), codec="fp8_e4m3", residual=residual)
    same["feedback"] = bool(residual.abs().max() > 0)
    same["nccl"] = gradsync.distributed._engines[group].nccl_device == 0
    y = torch.randn(64, device="cuda")
    try:  # refused before anything is queued; the capture itself ends cleanly (empty)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            gradsync.all_reduce(y, codec="fp16")
        same["capture refused"] = False
    except RuntimeError as error:
        same["capture refused"] = "cannot be captured in a CUDA graph" in str(error)
    gradsync.all_reduce(y, codec="fp16")  # the group still works
    same["after the capture"] = bool(torch.isfinite(y).all())
    return same


@pytest.mark.cuda
def test_nccl_transport_at_world_size_one():
    world = World(1, backend="nccl")
    try:
        same = world.run(nccl_world_of_one)[0]
    finally:
        world.close()
    assert all(same.values()), [case for case, ok in same.items() if not ok]


def nccl_join_without_the_peer(rank, size):
    """Rank 0 joins a two-rank NCCL communicator that rank 1 never joins, as if it had died after
    the unique id went out."""
    if rank != 0:
        return None
    engine = gradsync.distributed._C.RingEngine(dist.group.WORLD)
    start = time.monotonic()
    try:
        engine.attach_nccl(gradsync.distributed._C.nccl_unique_id(), 0, 3.0)
    except RuntimeError as error:
        return time.monotonic() - start, str(error), engine.nccl_device
    return time.monotonic() - start, "joined", engine.nccl_device


@pytest.mark.cuda
def test_nccl_join_times_out_when_a_peer_never_joins():
    world = World(2)
    try:
        elapsed, message, device = world.run(nccl_join_without_the_peer, timeout=90)[0]
    finally:
        world.close()
    assert "ncclCommInitRank did not complete within 3 s" in message
    assert 3 <= elapsed < 30
    assert device == -1


def nccl_matches_the_cpu_ring(rank, size):
    gloo = dist.new_group(backend="gloo")
    same = {}
    for codec in gradsync.CODECS:
        for dtype_name, dtype in DTYPES.items():
            x = rank_input(rank, 300007, dtype, seed=9)
            on_cpu, on_gpu = x.clone(), x.cuda()
            gradsync.all_reduce(on_cpu, codec=codec, group=gloo)
            gradsync.all_reduce(on_gpu, codec=codec)
            same[(codec, dtype_name)] = same_bits_up_to_nan_payload(on_gpu, on_cpu)
    return same, digest(on_gpu.cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_ring_matches_the_cpu_ring_bitwise():
    size = min(torch.cuda.device_count(), 4)
    world = World(size, backend="nccl")
    try:
        results = world.run(nccl_matches_the_cpu_ring)
    finally:
        world.close()
    for same, _ in results:
        assert all(same.values()), [case for case, ok in same.items() if not ok]
    assert len({d for _, d in results}) == 1
