"""gradsync's DDP hooks and gradsync.DataParallel training real models on gloo ranks, against fp32 DDP."""
import contextlib
import copy
import datetime
import functools
import gc
import hashlib
import io
import os
import pickle
import sys
import tempfile
import time
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from distributed_harness import World, run_processes
from gradsync import hooks

BUCKET_MB = 0.01  # several buckets even for these small models


class Net(torch.nn.Module):
    """A small MLP; ``unused`` adds a branch that forward never touches."""

    def __init__(self, unused=False):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                        torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.spare = torch.nn.Linear(64, 64) if unused else None

    def forward(self, x):
        return self.body(x)


def make_net(unused=False, dtype=torch.float32):
    torch.manual_seed(0)
    return Net(unused).to(dtype)


def batch(rank, step, rows=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(rows, 16, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.5 * x[:, 4:5]
    return x.to(dtype), y.to(dtype)


EVAL = batch(999, 999, rows=512)


def initial_loss(dtype=torch.float32):
    with torch.no_grad():
        return float(F.mse_loss(make_net(dtype=dtype)(EVAL[0].to(dtype)).float(), EVAL[1]))


def params_of(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def digest(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def wrap(model, mode, **ddp_options):
    kind, _, detail = mode.partition(":")
    if kind in ("dp", "dpv", "dpf"):  # dpv: gradients as bucket views; dpf: finding unused parameters
        codec, _, ef = detail.partition("+")
        return gradsync.DataParallel(model, codec=codec, bucket_cap_mb=BUCKET_MB, error_feedback=bool(ef),
                                     gradient_as_bucket_view=kind == "dpv", find_unused_parameters=kind == "dpf")
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB, **ddp_options)
    if kind == "hier":  # nodes of two ranks
        codec, _, ef = detail.partition("+")
        ddp.register_comm_hook(hooks.HierarchicalState(2, codec, bool(ef)), hooks.hierarchical_hook)
    if kind == "hook":
        state, hook = {
            "none": (hooks.GradSyncState(codec="none"), hooks.allreduce_hook),
            "fp16": (None, hooks.fp16_compress_hook),
            "bf16": (dist.group.WORLD, hooks.bf16_compress_hook),
            "fp8": (hooks.GradSyncState(), hooks.fp8_compress_hook),
            "fp8+ef": (hooks.GradSyncState(error_feedback=True), hooks.fp8_compress_hook),
            "fp8_e5m2+ef": (hooks.GradSyncState(codec="fp8_e5m2", error_feedback=True), hooks.allreduce_hook),
        }[detail]
        ddp.register_comm_hook(state, hook)
    return ddp


def train(rank, size, mode, steps, lr=0.1, dtype=torch.float32, **ddp_options):
    """(per-step parameter digests, final parameters, final loss on a fixed evaluation batch)."""
    model = wrap(make_net(ddp_options.pop("unused", False), dtype), mode, **ddp_options)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    digests = []
    for step in range(steps):
        x, y = batch(rank, step, dtype=dtype)
        opt.zero_grad()
        F.mse_loss(model(x).float(), y.float()).backward()
        opt.step()
        digests.append(digest(params_of(model)))
    with torch.no_grad():
        loss = float(F.mse_loss(model(EVAL[0].to(dtype)).float(), EVAL[1]))
    return digests, params_of(model), loss


def train_modes(rank, size, modes, steps, options=None):
    return {mode: train(rank, size, mode, steps, **dict(options or {})) for mode in modes}


def check_ranks_agree(results):
    for mode in results[0]:
        for step, digests in enumerate(zip(*(r[mode][0] for r in results))):
            assert len(set(digests)) == 1, f"{mode}: ranks differ after step {step + 1}"


def relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_codec_none_trains_like_ddp_and_ranks_agree_bitwise(worlds):
    modes = ["ddp", "hook:none", "dp:none", "dpv:none"]
    results = worlds(3).run(train_modes, modes, 20)
    check_ranks_agree(results)
    reference = results[0]["ddp"][1]
    for mode in modes[1:]:
        assert relative(results[0][mode][1], reference) < 1e-6, mode


def saved_and_loaded(state):
    buffer = io.BytesIO()
    torch.save({"hook_state": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)["hook_state"]


def ef_steps(rank, state, model, steps, first_step=0):
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(state, hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(first_step, first_step + steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return ddp.module


def checkpointed_states(rank, size):
    state = hooks.GradSyncState(codec="fp8_e4m3", error_feedback=True, prescale=0.5, postscale=2 / size)
    model = ef_steps(rank, state, make_net(), 3)
    residuals = {key: entry[0].clone() for key, entry in state._residuals.items()}
    assert residuals and all(r.abs().max() > 0 for r in residuals.values())
    loaded = saved_and_loaded(state)
    # saving left the state as it was; what was loaded is its settings alone
    assert all(torch.equal(state._residuals[key][0], r) for key, r in residuals.items()) and state._checked
    assert (loaded.process_group, loaded.codec, loaded.error_feedback, loaded.prescale, loaded.postscale) == \
        (None, "fp8_e4m3", True, 0.5, 2 / size)
    assert loaded._residuals == {} and loaded._checked == {}
    # ... and trains on as a new state with those settings does, from zero residuals and checking its buckets
    resumed = {}
    for name, again in [("loaded", loaded), ("new", hooks.GradSyncState(codec="fp8_e4m3", error_feedback=True,
                                                                          prescale=0.5, postscale=2 / size))]:
        copy = make_net()
        copy.load_state_dict(model.state_dict())
        resumed[name] = digest(params_of(ef_steps(rank, again, copy, 2, first_step=3)))
    assert resumed["loaded"] == resumed["new"]

    # a state of another group loads without it, and says so when its hook runs
    group = dist.new_group(list(range(size)))
    sub = saved_and_loaded(hooks.GradSyncState(group, codec="fp16"))
    with pytest.raises(RuntimeError, match="set state.process_group to that group"):
        ef_steps(rank, sub, make_net(), 1)
    sub.process_group = group
    trained = ef_steps(rank, sub, make_net(), 1)
    # a bucket agreed on one group is checked again on another: set to another, or, as here, the
    # default group (the same holds for the default group made again after destroy_process_group)
    checks, issue = [], hooks.all_reduce

    def recording(*args, **kwargs):
        checks.append(kwargs["check_call"])
        return issue(*args, **kwargs)
    hooks.all_reduce = recording
    try:
        for again in (group, None, None):
            sub.process_group = again
            ef_steps(rank, sub, trained, 1)
            checks.append("step")
    finally:
        hooks.all_reduce = issue
    steps = "".join("s" if c == "step" else "c" if c else "-" for c in checks).split("s")[:3]
    assert steps[0] and set(steps[0]) == {"-"} and set(steps[1]) == {"c"} and set(steps[2]) == {"-"}, steps
    assert saved_and_loaded(hooks.GradSyncState(dist.group.WORLD))._group_not_loaded is False
    with pytest.raises(TypeError, match="holds process groups, which cannot be saved"):
        pickle.dumps(hooks.HierarchicalState(local_size=size))
    return resumed["loaded"]


def default_group_made_again(rank, size):
    """A state of the default group (None) checks its buckets again once that group is made anew:
    a restarted peer's fresh state checks them, so the others' must too, or they pair its check with
    their sum."""
    state, checks, issue = hooks.GradSyncState(codec="fp16"), [], hooks.all_reduce

    def recording(*args, **kwargs):
        checks.append(kwargs["check_call"])
        return issue(*args, **kwargs)
    hooks.all_reduce = recording
    try:
        model = ef_steps(rank, state, make_net(), 3)  # checked, checked after DDP's rebuild, then not
        checks.append("made again")
        dist.destroy_process_group()
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        ef_steps(rank, state, model, 1)
    finally:
        hooks.all_reduce = issue
    return checks


def test_a_state_checks_its_buckets_again_on_a_default_group_made_anew(worlds):
    (checks,) = worlds(1).run(default_group_made_again)
    before, after = checks[:checks.index("made again")], checks[checks.index("made again") + 1:]
    assert True in before and before[-1] is False and after and all(after), checks


def test_hook_states_save_their_settings_with_a_checkpoint(worlds):
    results = worlds(2).run(checkpointed_states)
    assert len(set(results)) == 1


class SharedBuffers(torch.nn.Module):
    """Buffers that are views of one tensor, as a model's rotary tables often are."""

    def __init__(self, rank):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        table = torch.randn(16, 4, 2, generator=torch.Generator().manual_seed(rank))
        self.register_buffer("cos", table[..., 0])
        self.register_buffer("sin", table[..., 1])
        stats = torch.full((2, 4), float(rank))
        self.register_buffer("stats", stats)
        self.register_buffer("mean", stats[0])

    def forward(self, x):
        return self.lin(x * self.cos[0] + self.sin[1] + self.mean)


def shared_buffers(rank, size):
    model = gradsync.DataParallel(SharedBuffers(rank))
    F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 4)).backward()
    inner = model.module
    assert inner.mean.data_ptr() == inner.stats.data_ptr()  # still views of one tensor
    return [digest(b) for b in inner.buffers()]


def test_data_parallel_broadcasts_buffers_that_share_memory(worlds):
    results = worlds(2).run(shared_buffers)
    assert results[0] == results[1]


def test_compressed_final_loss_is_within_the_codec_budget(worlds):
    modes = ["ddp", "hook:fp16", "hook:bf16", "hook:fp8+ef", "hook:fp8_e5m2+ef", "dp:fp16", "dp:fp8_e4m3+ef"]
    results = worlds(2).run(train_modes, modes, 150)
    check_ranks_agree(results)
    losses = {mode: results[0][mode][2] for mode in modes}
    fp32 = losses["ddp"]
    assert fp32 < 0.5 * initial_loss()
    for mode, budget in [("hook:fp16", 0.005), ("dp:fp16", 0.005), ("hook:bf16", 0.02), ("hook:fp8+ef", 0.02),
                         ("hook:fp8_e5m2+ef", 0.02), ("dp:fp8_e4m3+ef", 0.02)]:
        assert abs(losses[mode] - fp32) <= budget * fp32, (mode, losses[mode], fp32)


def test_hierarchical_hook_trains_like_ddp_and_ranks_agree_bitwise(worlds):
    """Two nodes of two ranks: reduce-scatter in the node, gradsync across the nodes, all-gather;
    buckets whose numel the node's two ranks do not divide included (5313 parameters)."""
    modes = ["ddp", "hier:none", "hier:fp16", "hier:fp8_e4m3+ef", "hier:fp8_e4m3"]
    results = worlds(4).run(train_modes, modes, 20)
    check_ranks_agree(results)
    reference = results[0]["ddp"][1]
    for mode, tolerance in [("hier:none", 1e-6), ("hier:fp16", 2e-4), ("hier:fp8_e4m3+ef", 5e-3)]:
        assert relative(results[0][mode][1], reference) < tolerance, (mode, relative(results[0][mode][1], reference))
    # error feedback through the hook lands nearer than without (fp8 alone is within 5e-3 too)
    with_ef, without = (relative(results[0][mode][1], reference) for mode in ("hier:fp8_e4m3+ef", "hier:fp8_e4m3"))
    assert with_ef < 0.6 * without, (with_ef, without)


def hierarchical_misuse(rank, size):
    with pytest.raises(ValueError, match="local_size 3 does not divide the world size 4"):
        hooks.HierarchicalState(3)
    # ranks that disagree on the node size raise on every rank, rather than make groups that never meet
    with pytest.raises(ValueError, match=r"the ranks disagree on local_size \(ranks per node\), rank by rank "
                                         r"\[2, 2, 1, 1\]"):
        hooks.HierarchicalState(2 if rank < 2 else 1)
    with pytest.raises(ValueError, match=r"disagree on local_size .* \[2, 2, 2, 'x'\]"):
        hooks.HierarchicalState("x" if rank == 3 else 2)
    previous = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "1" if rank < 2 else "2"  # torchrun on nodes of 1, 1 and 2 ranks
    try:
        with pytest.raises(ValueError, match=r"disagree on LOCAL_WORLD_SIZE .* \['1', '1', '2', '2'\]"):
            hooks.HierarchicalState()
    finally:
        if previous is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = previous
    # groups given by hand for nodes of 3 ranks and 1: the ranks whose cross group is themselves alone
    # raise too (they passed their check, and their peers waited for them at the first step)
    nodes = [dist.new_group([0, 1, 2]), dist.new_group([3])]
    places = [dist.new_group([0, 3]), dist.new_group([1]), dist.new_group([2])]
    with pytest.raises(ValueError, match="same place in nodes of one size|same number of nodes"):
        hooks.HierarchicalState(local_group=nodes[rank // 3], cross_group=places[rank % 3])
    # the groups made here time out as the default group does (the groups' own default is 30 minutes)
    state = hooks.HierarchicalState(2)
    timeouts = {hooks._timeout_of(g) for g in (dist.group.WORLD, state.local_group, state.cross_group)}
    assert timeouts == {datetime.timedelta(seconds=60)}, timeouts
    hooks.HierarchicalState("2" if rank == 0 else 2)  # one value, however it is written
    # a codec refused on one rank is refused on every rank before any group is made
    with pytest.raises(ValueError, match="rank 3 refused its arguments .*'fp9'" if rank != 3 else "'fp9'"):
        hooks.HierarchicalState(2, "fp9" if rank == 3 else "fp16")
    with pytest.raises(TypeError, match="rank 3 refused its arguments .*error_feedback" if rank != 3 else
                       "error_feedback"):
        hooks.HierarchicalState(2, error_feedback="yes" if rank == 3 else False)
    with pytest.raises(ValueError, match="local_size 3 contradicts local_group, whose node has 2 ranks"):
        hooks.HierarchicalState(3, local_group=state.local_group, cross_group=state.cross_group)
    assert hooks.HierarchicalState(2, local_group=state.local_group, cross_group=state.cross_group).local_group \
        is state.local_group
    with pytest.raises(ValueError, match="pass both local_group and cross_group"):
        hooks.HierarchicalState(local_group=dist.group.WORLD)
    ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(hooks.GradSyncState(), hooks.hierarchical_hook)
    x, y = batch(rank, 0)
    with pytest.raises(Exception, match="hierarchical_hook takes a gradsync.hooks.HierarchicalState"):
        F.mse_loss(ddp(x), y).backward()
    ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)  # its process group is the one across nodes only
    ddp.register_comm_hook(hooks.HierarchicalState(2), hooks.fp16_compress_hook)
    with pytest.raises(Exception, match="the state of hierarchical_hook alone"):
        F.mse_loss(ddp(x), y).backward()
    # groups given by hand: a cross group whose ranks hold different places in their nodes
    _, cross = hooks._node_groups(2)
    everyone = dist.new_group(list(range(size)))  # every rank makes it
    with pytest.raises(ValueError, match="same place in nodes of one size"):
        hooks.HierarchicalState(local_group=everyone, cross_group=cross)
    # the nodes disagree on the codec: every rank's backward raises (none waits for a failed step),
    # and the state stays unusable
    ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(hooks.HierarchicalState(2, "fp16" if rank >= 2 else "fp8_e4m3"), hooks.hierarchical_hook)
    with pytest.raises(Exception, match="the ranks disagree on the call"):
        F.mse_loss(ddp(x), y).backward()
    with pytest.raises(Exception, match="an earlier step failed"):
        F.mse_loss(ddp(x), y).backward()
    # so do the ranks of a node (each cross group then agrees within itself)
    ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(hooks.HierarchicalState(2, "fp16" if rank % 2 else "fp8_e4m3"), hooks.hierarchical_hook)
    with pytest.raises(Exception, match="hooks.hierarchical_average: and use one codec across the nodes"):
        F.mse_loss(ddp(x), y).backward()
    return True


def hierarchical_wrong_on_one_rank(rank, size):
    """One node of two ranks. Rank 0 alone gives wrong groups or a tensor it cannot write, or the
    two ranks give different codecs: every rank raises at once, the tensor is left as it was, and
    the next call is right (rank 0's turns in the node's calls are refused, not skipped)."""
    state = hooks.HierarchicalState(2)
    wrong = [("groups", state.local_group, "none"), ("groups", "across", "none"), ("tensor", None, "none"),
             ("codec", None, "fp16" if rank else "fp8_e4m3")]
    outcomes = []
    for what, cross, codec in wrong:
        x = torch.full((8,), float(rank), requires_grad=what == "tensor" and rank == 0)
        start = time.monotonic()
        with pytest.raises((ValueError, TypeError, RuntimeError)) as error:  # a future's callback: RuntimeError
            hooks.hierarchical_average(x, state.local_group, cross if what == "groups" and rank == 0 else
                                       state.cross_group, codec).wait()
        assert time.monotonic() - start < 10, what
        assert torch.equal(x, torch.full((8,), float(rank))), what
        outcomes.append(str(error.value))
    x = torch.full((8,), 100.0 + rank)
    hooks.hierarchical_average(x, state.local_group, state.cross_group, "none").wait()
    assert torch.equal(x, torch.full((8,), 100.5))
    return outcomes


def hierarchical_in_the_callers_modes(rank, size):
    """hierarchical_average of tensors it may write only in the caller's mode: Parameters under
    no_grad (contiguous, strided, a numel the node does not divide), inference tensors inside
    inference_mode, and a strided tensor there. Each average, then a call in step."""
    state = hooks.HierarchicalState(size)
    averages = []
    for numel, strided in ((4, False), (5, False), (4, True)):
        weight = torch.nn.Parameter(torch.full((numel, 2), float(rank)))
        with torch.no_grad():
            hooks.hierarchical_average(weight.t() if strided else weight, state.local_group, state.cross_group,
                                       "none").wait()
        averages.append(weight.detach().unique().tolist())
    for numel in (4, 5):
        with torch.inference_mode():
            x = torch.full((numel,), float(rank))
            hooks.hierarchical_average(x, state.local_group, state.cross_group, "none").wait()
        averages.append(x.unique().tolist())
    x = torch.full((5, 3), float(rank)).t()  # a normal tensor, strided, whose copies are inference tensors
    with torch.inference_mode():
        hooks.hierarchical_average(x, state.local_group, state.cross_group, "none").wait()
    averages.append(x.unique().tolist())
    x = torch.full((8,), float(rank))
    hooks.hierarchical_average(x, state.local_group, state.cross_group, "none").wait()
    return averages, x.unique().tolist()


def test_hierarchical_average_writes_in_the_callers_modes(worlds):
    # the copy back into the tensor ran on gradsync's thread, outside the caller's no_grad or
    # inference mode, and raised (the groups then unusable)
    for averages, after in worlds(2).run(hierarchical_in_the_callers_modes):
        assert averages == [[0.5]] * 6 and after == [0.5]


def hierarchical_one_node(rank, size):
    """One node of every rank: nothing crosses a node, so the codec rounds nothing, and an error
    feedback residual stays zero."""
    state = hooks.HierarchicalState(size)
    xs = [torch.randn(1001, generator=torch.Generator().manual_seed(r)) * torch.logspace(-6, 6, 1001)
          for r in range(size)]
    x = xs[rank]
    averages = []
    for codec in ("none", "fp8_e4m3", "fp16"):
        y, residual = x.clone(), torch.zeros(-(-x.numel() // size))
        hooks.hierarchical_average(y, state.local_group, state.cross_group, codec, residual=residual).wait()
        assert not residual.any(), codec
        averages.append(y)
    reference = torch.stack(xs).double().mean(0)  # fp32 sums: a few roundings of 2^-24
    assert torch.allclose(averages[0].double(), reference, rtol=size * 2.0**-23, atol=0), "not the average"
    return all(torch.equal(y, averages[0]) for y in averages)


def test_hierarchical_sync_on_one_node_rounds_nothing(worlds):
    assert all(worlds(2).run(hierarchical_one_node))


def test_hierarchical_average_fails_on_every_rank_where_one_is_wrong(worlds):
    here, peer = worlds(2).run(hierarchical_wrong_on_one_rank)
    assert "must be two groups" in here[0] and "cross_group must be a torch.distributed ProcessGroup" in here[1]
    assert here[2].startswith("tensor requires grad"), here
    assert all("group rank(s) 0 could not prepare" in m for m in peer[:3]), peer
    assert all("use one codec across the nodes" in m for m in (here[3], peer[3])), (here, peer)


def hierarchical_on_ddps_group(rank, size):
    """One node of every rank whose group is the default group, which DDP runs on with
    find_unused_parameters=True: DDP's own all-reduce of the used parameters runs there while the
    hook's steps do, and every step travels through gradsync's own messages, so nothing interleaves.
    Parameters as DDP's own average gives them, and the same bits on every rank."""
    singles = [dist.new_group([r]) for r in range(size)]
    params = {}
    for mode in ("ddp", "hier"):
        ddp = DDP(make_net(unused=True), bucket_cap_mb=BUCKET_MB, find_unused_parameters=True)
        if mode == "hier":
            ddp.register_comm_hook(hooks.HierarchicalState(codec="none", local_group=dist.group.WORLD,
                                                           cross_group=singles[rank]), hooks.hierarchical_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(6):
            x, y = batch(rank, step)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
        params[mode] = params_of(ddp.module)
    return relative(params["hier"], params["ddp"]), digest(params["hier"])


def test_hierarchical_hook_runs_on_the_group_ddp_runs_on(worlds):
    results = worlds(4).run(hierarchical_on_ddps_group)
    assert all(distance < 1e-6 for distance, _ in results), results
    assert len({d for _, d in results}) == 1


def hierarchical_failures(rank, size):
    """With its calls checked, a step that fails on some ranks fails on every rank within seconds:
    a node whose ranks disagree (its reduce-scatter), nodes that disagree (the all-reduce across
    them, after which every all-gather depends on a failed call), a rank whose arguments are wrong
    (refused before anything is issued). The tensor stays as it was, and the groups serve the next
    call."""
    state = hooks.HierarchicalState(2)
    outcomes = []
    for case in ("node disagrees", "nodes disagree", "refused here"):
        numel = 1001 if case == "node disagrees" and rank == 1 else 1000
        residual = torch.zeros(7 if case == "refused here" and rank == 3 else -(-numel // 2))
        codec = "fp8_e4m3" if case == "nodes disagree" and rank >= 2 else "fp16"
        x = torch.full((numel,), float(rank))
        start = time.monotonic()
        with pytest.raises((ValueError, RuntimeError)) as error:
            hooks.hierarchical_average(x, state.local_group, state.cross_group, codec, residual=residual).wait()
        assert time.monotonic() - start < 10, (case, time.monotonic() - start)
        assert torch.equal(x, torch.full((numel,), float(rank))), f"{case}: the failed step wrote into the tensor"
        outcomes.append(str(error.value))
    x = torch.full((1000,), float(rank))
    hooks.hierarchical_average(x, state.local_group, state.cross_group, "none").wait()
    assert torch.equal(x, torch.full((1000,), (size - 1) / 2))
    return outcomes


def test_a_failed_hierarchical_step_fails_on_every_rank(worlds):
    results = worlds(4).run(hierarchical_failures)
    disagree, across, refused = zip(*results)
    assert all("gradsync.reduce_scatter: the ranks disagree" in m for m in disagree[:2]), disagree
    assert all("gradsync.all_reduce: group rank(s) " in m and "could not prepare" in m for m in disagree[2:]), disagree
    assert all("gradsync.all_reduce: the ranks disagree" in m and "codec fp8_e4m3" in m for m in across), across
    assert refused[3].startswith("residual must hold ceil(tensor.numel() / local_group.size())"), refused
    assert all("group rank(s) " in m and "could not prepare" in m for m in refused[:3]), refused


def hook_failing_on_one_rank(rank, size):
    """Rank 1 cannot allocate its residual in the hook (out of memory, say): it still takes its turn
    in the call, so rank 0's backward raises at once, naming it, rather than at the group's timeout."""
    state = hooks.GradSyncState(codec="fp8_e4m3", error_feedback=True)
    if rank == 1:
        def out_of_memory(bucket):
            raise MemoryError("no memory for the residual")
        state.residual = out_of_memory
    ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(state, hooks.fp8_compress_hook)
    x, y = batch(rank, 0)
    start = time.monotonic()
    with pytest.raises(Exception) as error:
        F.mse_loss(ddp(x), y).backward()
    return str(error.value), time.monotonic() - start


def test_a_hook_that_fails_on_one_rank_fails_on_every_rank_at_once(worlds):
    (peer, peer_took), (failed, failed_took) = worlds(2).run(hook_failing_on_one_rank)
    assert "no memory for the residual" in failed, failed
    assert "group rank(s) 1 could not prepare the call" in peer, peer
    assert peer_took < 10 and failed_took < 10, (peer_took, failed_took)


def test_hooks_refuse_what_is_not_a_bucket():
    # torch.compile's optimize_ddp="python_reducer" calls a hook with one (grad, param) tuple
    grad, param = torch.randn(3), torch.nn.Parameter(torch.randn(3))
    for hook, state in ((hooks.fp16_compress_hook, hooks.GradSyncState()),
                        (hooks.allreduce_hook, hooks.GradSyncState()),
                        (hooks.hierarchical_hook, object.__new__(hooks.HierarchicalState))):
        with pytest.raises(TypeError, match="hooks take DDP's GradBucket, got tuple: torch.compile with "
                                            "torch._dynamo.config.optimize_ddp='python_reducer'"):
            hook(state, (grad, param))


def shard_residuals_on_rebuild(rank, size):
    """DDP rebuilds its buckets after the first step: a parameter's old shard residual goes with its
    old bucket, and the residuals of buckets untouched stay."""
    state = hooks.HierarchicalState(2, error_feedback=True)
    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    first, kept = state.shard_residual(FakeBucket([a, b]), 3, "cpu"), state.shard_residual(FakeBucket([c]), 2, "cpu")
    first += 1
    rebuilt = state.shard_residual(FakeBucket([b, a]), 3, "cpu")
    assert len(state._shard_residuals) == 2 and not rebuilt.any()
    assert state.shard_residual(FakeBucket([c]), 2, "cpu") is kept
    return dropped_state_frees(lambda: hooks.HierarchicalState(2, error_feedback=True), "_shard_residuals",
                               lambda fresh: fresh.shard_residual(FakeBucket([a, b]), 3, "cpu"))


def test_hierarchical_shard_residuals_are_dropped_with_rebuilt_buckets(worlds):
    assert all(worlds(4).run(shard_residuals_on_rebuild))


def hierarchical_feedback(rank, size):
    """hierarchical_average's residual is that of its all-reduce across the nodes: the same steps by
    hand (the node's reduce-scatter, gradsync's fp8 all-reduce of the shard with a residual, the
    node's all-gather) give the same bits, residual included, two calls in a row."""
    state = hooks.HierarchicalState(2)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1001, generator=g) * 10 ** torch.randint(-3, 3, (1001,), generator=g)  # numel odd: padded
    shard_numel = 501
    residual, by_hand = torch.zeros(shard_numel), torch.zeros(shard_numel)
    for _ in range(2):
        ours = x.clone()
        hooks.hierarchical_average(ours, state.local_group, state.cross_group, "fp8_e4m3", residual=residual).wait()
        padded, shard = torch.cat([x, x.new_zeros(1)]), x.new_empty(shard_numel)
        gradsync.reduce_scatter(shard, padded, codec="none", group=state.local_group)
        gradsync.all_reduce(shard, codec="fp8_e4m3", group=state.cross_group, residual=by_hand)
        dist.all_gather_into_tensor(padded, shard, group=state.local_group)
        assert torch.equal(ours, padded[:1001]) and torch.equal(residual, by_hand) and residual.any()
    return True


def test_hierarchical_error_feedback_is_that_of_the_all_reduce_across_nodes(worlds):
    assert all(worlds(4).run(hierarchical_feedback))


def test_hierarchical_hook_refuses_what_it_cannot_take(worlds):
    assert all(worlds(4).run(hierarchical_misuse))


def groups_and_states_misuse(rank, size):
    """What a state or hierarchical_average is given: a group this rank is outside of, one group for
    both, groups that cover part of the world, sparse gradients, a flag set after construction; and
    tensors of any shape averaged across nodes, copies that keep their group."""
    pair = dist.new_group([0, 1])  # every rank makes every group, in the same order
    singles = [dist.new_group([r]) for r in range(size)]
    state = hooks.HierarchicalState(2)
    if rank >= 2:
        with pytest.raises(ValueError, match="process_group: this rank is not a member of the group"):
            hooks.GradSyncState(process_group=pair)
        with pytest.raises(ValueError, match="local_group: this rank is not a member of the group"):
            hooks.HierarchicalState(local_group=pair, cross_group=pair)
        with pytest.raises(ValueError, match="process_group: this rank is not a member of the group"):
            gradsync.DataParallel(make_net(), process_group=pair)  # refused before any collective
    else:
        kept = copy.copy(hooks.GradSyncState(process_group=pair, codec="bf16"))
        assert kept.process_group is pair and kept.codec == "bf16"
    with pytest.raises(ValueError, match="must be two groups"):
        hooks.hierarchical_average(torch.ones(4), dist.group.WORLD, dist.group.WORLD, "fp16")
    with torch.inference_mode():
        inference = torch.ones(4)
    # written in place: as the collectives, refused before anything is issued
    for tensor, words in [(torch.ones(1).expand(4), "tensor is an expanded view"),
                          (torch.ones(5, requires_grad=True), "tensor requires grad"),
                          (inference, "tensor is an inference tensor"),
                          (torch.ones(4).to_sparse(), "tensor is a torch.sparse_coo tensor"),
                          (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
                           "tensor is a nested tensor")]:
        with pytest.raises(ValueError, match=words):
            hooks.hierarchical_average(tensor, state.local_group, state.cross_group, "none")
    with pytest.raises(ValueError, match=r"residual must hold ceil\(tensor.numel\(\) / local_group.size\(\)\) = "
                                         r"ceil\(5 / 2\) = 3 elements, got 5"):
        hooks.hierarchical_average(torch.ones(5), state.local_group, state.cross_group, "fp8_e4m3",
                                   residual=torch.zeros(5))
    # one group of this rank alone for both: the all-reduce across "nodes" would run from a callback
    # of that group's own future (on its thread, unless the reduce-scatter was done in time)
    with pytest.raises(ValueError, match="must be two groups"):
        hooks.HierarchicalState(local_group=singles[rank], cross_group=singles[rank])
    # one-rank "nodes" whose cross group is the node of two: half the world each
    with pytest.warns(UserWarning, match=r"average over 1 x 2 = 2 ranks, and the default group has 4"):
        hooks.HierarchicalState(local_group=singles[rank], cross_group=state.local_group)
    for shape in [(2, 3), (3, 1), (), (5,)]:  # the shards are chunks of the elements, whatever the shape
        x = torch.full(shape, float(rank))
        hooks.hierarchical_average(x, state.local_group, state.cross_group, "none").wait()
        assert x.shape == shape and torch.equal(x, torch.full(shape, (size - 1) / 2)), (shape, x)
    base = torch.arange(40.0).view(10, 4)  # strided views too, in place (a 1-D stride, a transpose)
    for view in (lambda t: t[:, 1], lambda t: t[:3].t()):
        x = base + rank
        hooks.hierarchical_average(view(x), state.local_group, state.cross_group, "none").wait()
        expected = base + rank  # the elements outside the view untouched
        view(expected).copy_(view(base + (size - 1) / 2))
        assert torch.equal(x, expected), (x, expected)

    x, y = batch(rank, 0)
    ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    late = hooks.GradSyncState()
    late.error_feedback = "yes"
    ddp.register_comm_hook(late, hooks.allreduce_hook)
    with pytest.raises(Exception, match="state.error_feedback must be True or False, got 'yes'"):
        F.mse_loss(ddp(x), y).backward()
    embedding = DDP(torch.nn.Embedding(10, 4, sparse=True))
    embedding.register_comm_hook(None, hooks.fp16_compress_hook)
    with pytest.raises(Exception, match="dense gradients only, and this bucket is torch.sparse_coo"):
        embedding(torch.tensor([rank, 5])).sum().backward()
    return True


def test_states_and_groups_that_cannot_work_are_refused_or_warned_about(worlds):
    assert all(worlds(4).run(groups_and_states_misuse))


def train_on(rank, size, device, modes, steps, unused=False):
    """Per mode, the parameters after `steps` SGD steps of make_net(unused) on `device` (DDP told to
    find unused parameters where there are some)."""
    out = {}
    for mode in modes:
        model = wrap(make_net(unused).to(device), mode, **({"find_unused_parameters": True} if unused else {}))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            x, y = (t.to(device) for t in batch(rank, step))
            opt.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(model(x), y).backward()
            opt.step()
        out[mode] = params_of(model).cpu()
    return out


# relative distance from DDP's parameters after 10 steps; measured on the CPU, where these small
# buckets take the direct exchange (CUDA tensors take the ring; both round twice): 0 for "none", 7e-6
# for fp16, 5e-5 for bf16, 2.5e-4 for fp8 with error feedback and 8.5e-4 without
DEVICE_MODES = {"hook:none": 1e-6, "dp:none": 1e-6, "dpv:none": 1e-6, "hook:fp16": 1e-4, "hook:bf16": 1e-3,
                "dp:fp16": 1e-4, "dpf:fp16": 1e-4, "dpv:fp8_e4m3+ef": 5e-3, "hook:fp8+ef": 5e-3,
                "dpv:fp8_e4m3": 5e-3, "hook:fp8": 5e-3}


def assert_error_feedback_helps(params, reference):
    """fp8 with error feedback lands nearer the reference than without (a residual lost, or added
    to the wrong parameter, would not)."""
    for with_ef, without in [("dpv:fp8_e4m3+ef", "dpv:fp8_e4m3"), ("hook:fp8+ef", "hook:fp8")]:
        assert relative(params[with_ef], reference) < 0.6 * relative(params[without], reference), with_ef


@pytest.mark.parametrize("unused", [False, True], ids=["all_used", "one_layer_unused"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_hooks_and_data_parallel_train_like_ddp_on(worlds, device, unused):
    # on one GPU two ranks share it over gloo: gradsync stages CUDA tensors through pinned host memory
    results = worlds(2).run(train_on, device, ["ddp", *DEVICE_MODES], 10, unused)
    for mode in results[0]:
        assert torch.equal(results[0][mode], results[1][mode]), f"{mode}: ranks differ"
    for mode, tolerance in DEVICE_MODES.items():
        assert relative(results[0][mode], results[0]["ddp"]) < tolerance, mode
    assert_error_feedback_helps(results[0], results[0]["ddp"])


@pytest.mark.cuda
def test_hooks_and_data_parallel_over_nccl_at_world_size_one():
    world = World(1, backend="nccl")  # gradsync's own NCCL communicator under DDP's hooks and DataParallel
    try:
        out = world.run(train_on, "cuda", ["ddp", *DEVICE_MODES], 10)[0]
    finally:
        world.close()
    for mode, tolerance in DEVICE_MODES.items():
        assert relative(out[mode], out["ddp"]) < tolerance, mode
    assert_error_feedback_helps(out, out["ddp"])


class KeywordNet(torch.nn.Module):
    """make_net() behind a forward that takes its tensors nested and by keyword."""

    def __init__(self):
        super().__init__()
        self.net = make_net()

    def forward(self, inputs, *, target):
        return F.mse_loss(self.net(inputs["x"][0]), target)


def train_with_device_ids(rank, size):
    """(whether training with DDP's device_ids=[local_rank] and inputs on the host matches training with
    inputs moved by hand, bitwise; a copy's device_ids)."""
    device = torch.device("cuda", torch.cuda.current_device())
    params = []
    for given in (True, False):
        ids = {"device_ids": [device.index], "output_device": device} if given else {}
        model = gradsync.DataParallel(KeywordNet().to(device), codec="fp16", bucket_cap_mb=BUCKET_MB, **ids)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(rank, step)
            if not given:
                x, y = x.to(device), y.to(device)
            loss = model({"x": [x]}, target=y)
            assert loss.device == device
            loss.backward()
            opt.step()
            opt.zero_grad()
        params.append(params_of(model).cpu())
        if given:
            copied = copy.deepcopy(model).device_ids
    return torch.equal(*params), copied


@pytest.mark.cuda
def test_data_parallel_takes_ddps_device_ids_and_moves_inputs_to_the_module(worlds):
    for same, copied in worlds(2).run(train_with_device_ids):
        assert same and copied == [torch.cuda.current_device()]


@pytest.mark.parametrize("device_ids,output_device,error,words", [
    ([1], None, None, None), (("cuda:1",), "cuda:1", None, None), ([torch.device("cuda", 1)], 1, None, None),
    ([0], None, ValueError, "device_ids names cuda:0, but the module's parameters are on cuda:1"),
    ([1], 0, ValueError, "output_device names cuda:0, but the output stays where the module puts it"),
    ([True], None, TypeError, "device_ids[0] must be a device index, a device name or a torch.device, got bool"),
    (["gpu:1"], None, ValueError, "device_ids[0]: Expected one of"),
    ([-1], None, ValueError, "device_ids[0]: Device index must not be negative"),
])
def test_data_parallel_checks_device_ids_against_the_modules_gpu(device_ids, output_device, error, words):
    # DDP would move the inputs to device_ids[0] whatever device the module is on
    from gradsync.data_parallel import _check_device_ids
    if error is None:
        assert _check_device_ids(device_ids, output_device, torch.device("cuda", 1)) == ([1], 1)
        return
    with pytest.raises(error) as info:
        _check_device_ids(device_ids, output_device, torch.device("cuda", 1))
    assert words in str(info.value)


def accumulate(rank, size, mode, micro):
    """One step from `micro` accumulated micro-batches vs one step on their concatenation."""
    rows = 12
    parts = [batch(rank, i, rows=rows) for i in range(micro)]
    models = []
    for accumulated in (True, False):
        model = wrap(make_net(), mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if accumulated:
            for i, (x, y) in enumerate(parts):
                last = i == micro - 1
                with (model.no_sync() if not last else contextlib.nullcontext()):
                    (F.mse_loss(model(x), y, reduction="sum") / (rows * micro)).backward()
        else:
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            F.mse_loss(model(x), y).backward()
        opt.step()
        models.append(params_of(model))
    return relative(models[0], models[1])


class Branch(torch.nn.Module):
    """A first layer that a batch may skip (a data-dependent branch, an expert)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x, through_a):
        return self.b(torch.tanh(self.a(x)) if through_a else x.new_ones(len(x), 16))


def frozen_inside_an_accumulation(rank, size):
    """A layer frozen after the no_sync() micro-batch of a step and before its synchronized one (a
    freezing schedule reached mid-step), with and without bucket views: its gradient is averaged
    all the same (an optimizer steps every parameter whose .grad is set), on every rank, where every
    rank ("both") or one alone ("one") gave it a gradient; where the gradients were dropped with the
    freeze ("dropped"), they stay None. Per case and views: (a's gradients, the mean of the local
    ones, b's gradients)."""
    out = {}
    for case in ("both", "one", "dropped"):
        for views in (False, True):
            torch.manual_seed(0)
            net = Branch()
            model = gradsync.DataParallel(net, codec="none", gradient_as_bucket_view=views)
            g = torch.Generator().manual_seed(rank)
            with model.no_sync():
                model(torch.randn(8, 8, generator=g), case != "one" or rank == 0).square().mean().backward()
            local = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.a.parameters()]
            net.a.requires_grad_(False)
            if case == "dropped":
                net.a.zero_grad(set_to_none=True)
            model(torch.randn(8, 8, generator=g), True).square().mean().backward()
            for t in local:
                dist.all_reduce(t)
            out[case, views] = ([None if p.grad is None else p.grad.clone() for p in net.a.parameters()],
                                [t / size for t in local], [p.grad.clone() for p in net.b.parameters()])
    return out


def test_a_layer_frozen_inside_an_accumulation_gets_its_average(worlds):
    results = worlds(2).run(frozen_inside_an_accumulation)
    for key in results[0]:
        (a0, mean, b0), (a1, _, b1) = results[0][key], results[1][key]
        assert all(torch.equal(x, y) for x, y in zip(b0, b1)), key
        if key[0] == "dropped":
            assert a0 == a1 == [None, None], key
            continue
        assert all(torch.equal(x, y) for x, y in zip(a0, a1)), key
        for got, expected in zip(a0, mean):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["hook:none", "dp:none", "dpv:none", "hook:fp16"])
def test_no_sync_accumulation_equals_one_large_batch_step(worlds, mode):
    tolerance = 1e-6 if mode.endswith("none") else 1e-4
    assert max(worlds(2).run(accumulate, mode, 3)) < tolerance


@pytest.mark.parametrize("options", [{"static_graph": True}, {"find_unused_parameters": True, "unused": True},
                                     {"gradient_as_bucket_view": True}],
                         ids=["static_graph", "find_unused_parameters", "gradient_as_bucket_view"])
def test_ddp_options_with_the_fp16_hook(worlds, options):
    results = worlds(2).run(train_modes, ["ddp", "hook:fp16"], 10, options)
    check_ranks_agree(results)
    assert relative(results[0]["hook:fp16"][1], results[0]["ddp"][1]) < 1e-3


def float64_models(rank, size):
    results = train_modes(rank, size, ["ddp", "hook:fp16", "hook:fp8+ef", "hier:bf16"], 8, {"dtype": torch.float64})
    model = wrap(make_net(dtype=torch.float64), "hook:none")
    x, y = batch(rank, 0, dtype=torch.float64)
    with pytest.raises(Exception, match="the bucket is float64, and codec 'none' would reduce it in fp32"):
        F.mse_loss(model(x), y).backward()
    return results


def test_hooks_reduce_a_float64_model_through_fp32_copies_and_refuse_codec_none_for_it(worlds):
    """torch's fp16 hook takes float64 buckets too; gradsync's compressing hooks reduce an fp32 copy
    and write it back, and codec "none" refuses rather than sum a float64 model in fp32."""
    results = worlds(4).run(float64_models)
    check_ranks_agree(results)
    reference = results[0]["ddp"][1]
    for mode, tolerance in [("hook:fp16", 1e-4), ("hook:fp8+ef", 5e-3), ("hier:bf16", 1e-3)]:
        assert relative(results[0][mode][1], reference) < tolerance, mode


def unused_parameter(rank, size, dtype_name):
    dtype = getattr(torch, dtype_name)
    model = gradsync.DataParallel(make_net(unused=True, dtype=dtype), codec="fp16", bucket_cap_mb=BUCKET_MB)
    x, y = batch(rank, 0, dtype=dtype)
    F.mse_loss(model(x).float(), y.float()).backward()
    grad = model.module.body[0].weight.grad
    return model.module.spare.weight.grad is None and grad.dtype == dtype, digest(grad)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_data_parallel_leaves_parameters_no_rank_used_without_gradient(worlds, dtype_name):
    results = worlds(2).run(unused_parameter, dtype_name)
    assert all(ok for ok, _ in results) and len({d for _, d in results}) == 1


class Branches(torch.nn.Module):
    """``extra`` joins the output only when asked, ``never`` never; of the 150 ``many`` (more flags
    than one fp8 block holds, all in the first bucket), rank r uses those i with i % 4 == r."""

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(16, 8), torch.nn.Linear(8, 1)
        self.extra, self.never = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
        self.many = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3)) for _ in range(150))

    def forward(self, x, use_extra, rank):
        h = torch.tanh(self.body(x))
        out = self.head(h) + sum(p.sum() for p in self.many[rank::4]) * h.mean()
        return out + self.extra(h) if use_extra else out


# the steps: who uses `extra`; who uses it in a backward inside no_sync() just before; when the
# gradients are set to None: before both, between the two, or never. DDP takes the last step for
# a bug of its own ("Encountered gradient which is undefined, but still allreduced"): gradsync alone.
UNUSED_STEPS = [([0], [], "before"), ([], [], "before"), ([], [1], "before"), ([], [], "never"), ([], [2], "between")]


def unused_like_ddp(rank, size, modes):
    """Per mode, per step of UNUSED_STEPS, every parameter's gradient (None or a copy); per mode with
    error feedback, whether the residual of the parameter no rank uses survived step 4."""
    out = {"extra residual": {}}
    for mode in modes:
        torch.manual_seed(0)
        net = Branches()
        if mode == "ddp":
            model = DDP(net, bucket_cap_mb=UNUSED_BUCKET_MB, find_unused_parameters=True)
        else:
            # "find" walks the forward's graph for unused parameters, "view" makes gradients bucket views
            how, _, codec = mode.rpartition(":")
            codec, _, ef = codec.partition("+")
            model = gradsync.DataParallel(net, codec=codec, bucket_cap_mb=UNUSED_BUCKET_MB, error_feedback=bool(ef),
                                          find_unused_parameters="find" in how, gradient_as_bucket_view="view" in how)
            # unused parameters in several buckets, so that their flags are read at several offsets
            buckets = {id(model._bucket_of[id(p)]) for p in (net.never.weight, net.extra.weight, net.many[3], net.many[147])}
            assert len(buckets) >= 2
        out[mode] = []
        for step, (users, sync_free_users, to_none) in enumerate(UNUSED_STEPS[:-1] if mode == "ddp" else UNUSED_STEPS):
            if to_none == "before":
                model.zero_grad(set_to_none=True)
            x, y = batch(rank, step)
            if sync_free_users:
                with model.no_sync():
                    F.mse_loss(model(x, rank in sync_free_users, rank), y).backward()
            if to_none == "between":
                model.zero_grad(set_to_none=True)
            residual = extra_residual(model, net) if "+ef" in mode else None
            F.mse_loss(model(x, rank in users, rank), y).backward()
            out[mode].append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
            if residual is not None and step == 3:  # no rank uses `extra`: its residual outlives the step unpaid
                out["extra residual"][mode] = (bool(residual.any()), torch.equal(residual, extra_residual(model, net)))
    return out


def extra_residual(model, net):
    bucket = model._bucket_of[id(net.extra.weight)]
    j = next(j for j, p in enumerate(bucket.params) if p is net.extra.weight)
    return bucket.segment(j, bucket.residual).clone()


UNUSED_BUCKET_MB = 0.001  # 262 fp32 values: two buckets

UNUSED_MODES = {"none": 1e-6, "fp16": 5e-3, "bf16": 2e-2, "fp8_e5m2": 0.25, "fp8_e4m3+ef": 0.1,
                "find:none": 1e-6, "find:fp8_e4m3+ef": 0.1, "view:none": 1e-6, "view:fp8_e4m3+ef": 0.1,
                "find,view:fp16": 5e-3}


def test_data_parallel_treats_unused_parameters_as_ddp_does(worlds):
    # DDP(find_unused_parameters=True): a parameter some rank used since the last synchronized step
    # (no_sync() included) holds the average on every rank, even where its gradient was set to None;
    # one no rank used keeps the gradient it had, None or old
    results = worlds(3).run(unused_like_ddp, ["ddp", *UNUSED_MODES])
    for mode in (m for m in UNUSED_MODES if "+ef" in m):
        kept = [r["extra residual"][mode] for r in results]
        assert all(same for _, same in kept) and any(nonzero for nonzero, _ in kept), mode
    for rank, result in enumerate(results):
        ddp = result["ddp"]
        for mode, tolerance in UNUSED_MODES.items():
            for step, (theirs, ours) in enumerate(zip(ddp, result[mode])):
                where = f"{mode}: rank {rank}, step {step + 1}"
                assert [a is None for a in theirs] == [b is None for b in ours], where
                # fp8's error is relative to its block's largest value: the step's gradients together
                a, b = (torch.cat([g.flatten() for g in grads if g is not None]) for grads in (theirs, ours))
                assert relative(b, a) < tolerance, where
    extra, never, unused_many = 4, 6, 8 + 3  # the first weight of each; many[3] no rank uses
    ddp = results[0]["ddp"]  # what was compared
    assert ddp[0][extra] is not None and ddp[1][extra] is None and ddp[2][extra] is not None
    assert torch.equal(ddp[3][extra], ddp[2][extra])
    for mode in UNUSED_MODES:  # kept bitwise, not sent through the codec again
        assert all(torch.equal(r[mode][3][extra], r[mode][2][extra]) for r in results), mode
    assert all(step[never] is None and step[unused_many] is None for step in ddp)
    # used inside no_sync() by rank 2 only, then set to None: the same on every rank (zeros, but for
    # what error feedback pays back), not None on some
    for mode in UNUSED_MODES:
        last = [r[mode][4][extra] for r in results]
        assert all(g is not None and torch.equal(g, last[0]) for g in last), mode
        assert "+ef" in mode or not last[0].any(), mode


def issued_when_the_first_layer_is_done(rank, size, find):
    """How many buckets had gone out when the first layer's weight got its gradient, per step, and the
    gradients; ``spare``, which no rank uses, sits in the first bucket."""
    model = gradsync.DataParallel(make_net(unused=True), codec="fp16", bucket_cap_mb=BUCKET_MB,
                                  find_unused_parameters=find)
    net = model.module
    assert [id(p) for p in model.buckets[0]] == [id(net.spare.bias), id(net.spare.weight)] and len(model.buckets) == 3
    issued = []
    on_grad = model._on_grad

    def after_gradsyncs_hook(param):
        on_grad(param)
        if param is net.body[0].weight:
            issued.append(model._next)
    model._on_grad = after_gradsyncs_hook
    for step in range(3):
        model.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        F.mse_loss(model(x), y).backward()
    assert net.spare.weight.grad is None and net.spare.bias.grad is None
    return issued, digest(torch.cat([p.grad.flatten() for p in net.body.parameters()]))


def test_data_parallel_finding_unused_parameters_lets_their_bucket_go_out_during_backward(worlds):
    results = {find: worlds(2).run(issued_when_the_first_layer_is_done, find) for find in (False, True)}
    # spare's bucket waited for the end, until the buckets were rebuilt in the order of the first
    # step's gradients, which puts spare last
    assert all(issued[0] == 0 and min(issued[1:]) >= 1 for issued, _ in results[False])
    assert all(min(issued) >= 2 for issued, _ in results[True])  # only the first layer's own bucket left
    assert len({grads for r in results.values() for _, grads in r}) == 1  # the same averages


class OutOfOrder(torch.nn.Module):
    """Layers registered in another order than the forward runs them (``stem`` runs first)."""

    def __init__(self, registered=("head", "mid", "stem"), mid_dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        layers = {"stem": torch.nn.Linear(16, 64), "mid": torch.nn.Linear(64, 64).to(mid_dtype),
                  "head": torch.nn.Linear(64, 1)}
        for name in registered:
            setattr(self, name, layers[name])

    def forward(self, x):
        hidden = torch.tanh(self.stem(x)).to(self.mid.weight.dtype)
        return self.head(torch.tanh(self.mid(hidden)).float())


def rebuilt_buckets(rank, size, codec):
    """Buckets rebuilt in the order of the first step's gradients: the head's bucket goes out before
    the stem's gradient arrives from the second step on; gradients (bucket views) and residuals move
    with their parameters; the averages are those of a model registered in the order it runs."""
    moved = {}
    rebuild = gradsync.DataParallel._rebuild_buckets

    def snapshot(model):
        return {id(p): (p.grad.clone(), b.segment(j, b.residual if b.residual is not None else b.buffer).clone())
                for b in model._buckets for j, p in enumerate(b.params)}

    def checked_rebuild(model):
        before = snapshot(model)
        rebuild(model)
        after = snapshot(model)
        moved["same"] = moved.get("same", True) and all(
            torch.equal(before[k][0], after[k][0]) and torch.equal(before[k][1], after[k][1]) for k in before)
        moved["views"] = moved.get("views", True) and all(b.holds(j) for b in model._buckets
                                                          for j in range(len(b.params)))

    grads, issued = {}, []
    for registered in (("head", "mid", "stem"), ("stem", "mid", "head")):
        net, wrapper = OutOfOrder(registered), []
        if registered[0] == "head":  # before gradsync's: the buckets gone out before the stem's weight arrived
            net.stem.weight.register_post_accumulate_grad_hook(lambda p: issued.append(wrapper[0]._next))
        model = gradsync.DataParallel(net, codec=codec, bucket_cap_mb=BUCKET_MB, error_feedback=codec != "none",
                                      gradient_as_bucket_view=True)
        wrapper.append(model)
        model._rebuild_buckets = functools.partial(checked_rebuild, model)
        if registered[0] == "head":
            assert model.buckets[0][:2] == [net.stem.bias, net.stem.weight]
        grads[registered] = []
        for step in range(3):
            model.zero_grad()
            x, y = batch(rank, step)
            F.mse_loss(model(x), y).backward()
            grads[registered].append(torch.cat([p.grad.flatten() for p in (net.stem.weight, net.head.weight)]))
        if registered[0] == "head":
            assert model.buckets[0][:2] == [net.head.bias, net.head.weight] or \
                model.buckets[0][:2] == [net.head.weight, net.head.bias], model.buckets
    same_as_in_order = all(torch.equal(a, b) for a, b in zip(*grads.values()))
    return issued, moved, same_as_in_order, [digest(g) for g in grads[("head", "mid", "stem")]]


@pytest.mark.parametrize("codec", ["none", "fp8_e4m3"])
def test_data_parallel_rebuilds_its_buckets_in_the_order_gradients_arrive(worlds, codec):
    results = worlds(2).run(rebuilt_buckets, codec)
    for issued, moved, same_as_in_order, _ in results:
        assert issued[0] == 0 and min(issued[1:]) >= 1, issued  # before the rebuild, every bucket waits for the stem
        assert moved == {"same": True, "views": True}
        assert same_as_in_order or codec != "none"  # a 16-bit or fp8 wire rounds by position
    assert results[0][3] == results[1][3]


def rebuilt_into_copies(rank, size):
    """The head's gradients, views of an all-fp32 bucket, move by the rebuild into one that holds
    the bf16 layer and keeps copies: they take memory of their own, so the old bucket goes."""
    net = OutOfOrder(mid_dtype=torch.bfloat16)
    model = gradsync.DataParallel(net, codec="none", bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
    assert model.buckets[-1] == [net.head.bias, net.head.weight] and model._buckets[-1].views is not None
    old = weakref.ref(model._buckets[-1].buffer)
    grads, gone = [], []
    for step in range(2):
        model.zero_grad(set_to_none=False)
        x, y = batch(rank, step)
        F.mse_loss(model(x), y).backward()
        grads.append(net.head.weight.grad.clone())
        gc.collect()
        gone.append(old() is None)
    assert model.buckets[0][:2] in ([net.head.bias, net.head.weight], [net.head.weight, net.head.bias])
    assert model._bucket_of[id(net.head.weight)].views is None and net.head.weight.grad._base is None
    return all(gone), [digest(g) for g in grads]


def test_data_parallel_rebuild_leaves_no_gradient_in_an_old_bucket(worlds):
    results = worlds(2).run(rebuilt_into_copies)
    assert all(gone for gone, _ in results) and results[0][1] == results[1][1]


def gradient_the_walk_missed(rank, size):
    """The errors of two steps whose loss adds a penalty on `spare`, outside the forward: its gradient
    comes last (the penalty built before the forward) or first (after it), with its bucket gone out
    or not; then the gradients of a step that starts afresh."""
    model = gradsync.DataParallel(make_net(unused=True), codec="fp16", bucket_cap_mb=BUCKET_MB,
                                  find_unused_parameters=True)
    x, y = batch(rank, 0)
    errors = []
    for before in (True, False):
        model.zero_grad(set_to_none=True)
        penalty = model.module.spare.weight.square().sum() if before else None
        loss = F.mse_loss(model(x), y)
        penalty = model.module.spare.weight.square().sum() if not before else penalty
        with pytest.raises(RuntimeError) as error:
            (loss + penalty).backward()
        errors.append(str(error.value))
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    return errors, digest(torch.cat([p.grad.flatten() for p in model.module.body.parameters()]))


def test_data_parallel_raises_for_a_parameter_the_walk_missed_that_gets_a_gradient(worlds):
    results = worlds(2).run(gradient_the_walk_missed)
    for errors, _ in results:
        assert len(errors) == 2 and all("'spare.weight'" in e and "find_unused_parameters" in e for e in errors)
    assert results[0][1] == results[1][1]


class Mixed(torch.nn.Module):
    """fp32 layers and a bf16 head: the first bucket (head, mid) mixes dtypes, the last (body) is fp32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.mid = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 1).to(torch.bfloat16)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.body(x)))).bfloat16()).float()


def views_like_copies(rank, size):
    """Per way of keeping gradients, each step's gradients and which of them were bucket views."""
    out = {}
    for views in (False, True):
        net = Mixed()
        model = gradsync.DataParallel(net, codec="fp16", bucket_cap_mb=BUCKET_MB, error_feedback=True,
                                      gradient_as_bucket_view=views)
        assert [len(b) for b in model.buckets] == [4, 2]
        steps = []
        for step in range(4):
            model.zero_grad(set_to_none=step == 0)
            x, y = batch(rank, step)
            if step == 1:  # one micro-batch accumulated without communication first
                with model.no_sync():
                    F.mse_loss(model(x[:8]), y[:8]).backward()
            net.body.bias.requires_grad_(step != 2)  # frozen after wrapping: its gradient is not written
            F.mse_loss(model(x), y).backward()
            buffers = {model._bucket_of[id(p)].buffer.untyped_storage().data_ptr() for p in net.parameters()}
            steps.append(([p.grad.clone() for p in net.parameters()],
                          [p.grad.untyped_storage().data_ptr() in buffers for p in net.parameters()]))
        out[views] = steps
    return out


class Convolutional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).mean((2, 3)))


class Opaque:
    """An output the graph walk cannot look into."""

    def __init__(self, value):
        self.value = value


class OpaqueOutput(Net):
    def forward(self, x):
        return Opaque(self.body(x))


def views_at_the_edges(rank, size):
    out = {}
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(rank)).to(memory_format=torch.channels_last)
    for views in (False, True):  # channels_last: views in the parameter's layout, the same averages
        net = Convolutional().to(memory_format=torch.channels_last)
        model = gradsync.DataParallel(net, codec="fp16", bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=views)
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
        out[f"channels_last {views}"] = [p.grad.clone() for p in net.parameters()]
        out[f"layouts {views}"] = [p.grad.stride() == p.stride() for p in net.parameters()]

    x, y = batch(rank, 0)
    averages = []
    for graph in (False, True):
        model = gradsync.DataParallel(make_net(), codec="none", bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
        torch.autograd.backward(F.mse_loss(model(x), y), create_graph=graph)  # the buckets stay out of the graph
        averages.append([p.grad.detach().clone() for p in model.parameters()])
    # ... and the gradients keep theirs, the averages written into them, as without views (before,
    # the views replaced them: a gradient penalty through them came out 0, silently)
    penalty = torch.autograd.grad(sum(p.grad.square().sum() for p in model.parameters()), list(model.parameters()))
    out["create_graph"] = (not any(b.buffer.requires_grad for b in model._buckets),
                           all(torch.equal(a, b) for a, b in zip(*averages))
                           and all(g.abs().sum() > 0 for g in penalty))
    model.zero_grad(set_to_none=False)

    segments = Segments(False)  # a backward that raises once the buckets of layers 3 to 1 went out
    model = gradsync.DataParallel(segments, codec="none", bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    assert len(model.buckets) == 4
    model(x)["loss"].backward()
    segments.fail = True
    with pytest.raises(RuntimeError, match="backward failed"):
        model(x)["loss"].backward()
    went_out = [b.work is not None for b in model._buckets]
    segments.fail = False
    loss = model(x)["loss"]  # waits for their calls, and zeroes their gradients; layer 0 keeps its own
    out["abandoned"] = (went_out == [True, True, True, False],
                        [any(p.grad.any() for p in b.params) for b in model._buckets] == [False, False, False, True])
    loss.backward()
    out["after"] = digest(torch.cat([p.grad.flatten() for p in segments.parameters()]))
    model.module.half()
    with pytest.raises(RuntimeError, match="changed its dtype after wrapping"):
        model(x.half())
    model = gradsync.DataParallel(make_net(), codec="none", bucket_cap_mb=BUCKET_MB)  # gradients copied
    F.mse_loss(model(x), y).backward()
    model.module.double()
    with torch.no_grad():
        model(x.double())  # a forward that trains nothing
    with pytest.raises(RuntimeError, match="'body.0.weight' became torch.float64 after the module was wrapped"):
        model(x.double())

    x4 = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(rank))
    for views in (False, True):  # module.to() after a step rebinds the data of the gradients, views included
        net = Convolutional()
        model = gradsync.DataParallel(net, codec="fp16", bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=views)
        model(x4).square().mean().backward()
        model.to(memory_format=torch.channels_last)
        model.zero_grad(set_to_none=False)
        model(x4).square().mean().backward()
        out[f"rebound {views}"] = [p.grad.clone() for p in net.parameters()]
        if views:
            storage = model._buckets[0].buffer.untyped_storage().data_ptr()
            out["rebound views"] = [p.grad.untyped_storage().data_ptr() == storage and p.grad.stride() == p.stride()
                                    for p in net.parameters()]

    class Reordered(Net):  # lists its parameters its own way: the per-forward check takes that list
        def parameters(self, recurse=True):
            return reversed(list(super().parameters(recurse)))
    model = gradsync.DataParallel(Reordered(), codec="none", bucket_cap_mb=BUCKET_MB)
    F.mse_loss(model(x), y).backward()
    out["own parameters()"] = not model._walk_members

    model = gradsync.DataParallel(OpaqueOutput(), codec="none", bucket_cap_mb=BUCKET_MB, find_unused_parameters=True)
    with pytest.warns(UserWarning, match=r"output \(Opaque\) reaches no trainable parameter") as record:
        F.mse_loss(model(x).value, y).backward()  # every bucket waits, as without the walk
    assert record[0].filename == __file__, (record[0].filename, record[0].lineno)  # the forward's caller
    out["opaque"] = digest(torch.cat([p.grad.flatten() for p in model.module.body.parameters()]))
    return out


def test_gradients_as_bucket_views_at_the_edges(worlds):
    results = worlds(2).run(views_at_the_edges)
    for out in results:
        assert all(torch.equal(a, b) for a, b in zip(out["channels_last False"], out["channels_last True"]))
        assert all(out["layouts True"]) and out["layouts False"] == out["layouts True"]
        assert out["create_graph"] == (True, True)
        assert out["abandoned"] == (True, True)
        assert all(torch.equal(a, b) for a, b in zip(out["rebound False"], out["rebound True"]))
        assert all(out["rebound views"]) and out["own parameters()"]
    assert results[0]["after"] == results[1]["after"] and results[0]["opaque"] == results[1]["opaque"]


def test_gradients_as_bucket_views_average_as_copies_do(worlds):
    results = worlds(2).run(views_like_copies)
    for result in results:
        for step, ((copies, in_copy_buckets), (views, in_buckets)) in enumerate(zip(result[False], result[True])):
            assert all(torch.equal(a, b) for a, b in zip(copies, views)), f"step {step + 1}"
            assert not any(in_copy_buckets)
            # body (the fp32 bucket) as views, but its bias in the step it was frozen; mid and head copied
            assert in_buckets == [True, step != 2, False, False, False, False], f"step {step + 1}"
    assert all(torch.equal(a, b) for a, b in zip(results[0][True][-1][0], results[1][True][-1][0]))


def buffer_broadcasts(rank, size):
    """Each rank's buffers, as set per rank, after: wrapping; an eval forward; a training forward
    (BatchNorm with momentum 0 leaves its running statistics as they are), with and without
    broadcast_buffers. Each rank also counts its own batches (int64)."""
    out = {}
    for broadcast in (True, False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3, momentum=0.0))
        bn = net[1]
        bn.running_var.fill_(1.0 + rank)
        model = gradsync.DataParallel(net, codec="none", broadcast_buffers=broadcast)
        out[broadcast] = [bn.running_var.tolist()]
        bn.running_mean.fill_(float(rank))
        bn.num_batches_tracked.fill_(10 * rank)
        model.eval()
        model(torch.randn(8, 4))
        out[broadcast].append((bn.running_mean.tolist(), int(bn.num_batches_tracked)))
        model.train()
        model(torch.randn(8, 4))  # broadcast first, then counted here
        out[broadcast].append((bn.running_mean.tolist(), int(bn.num_batches_tracked)))
        # the module put back in training mode through itself, not through the wrapper: it trains,
        # so its buffers are broadcast as before any training forward
        bn.running_mean.fill_(float(rank))
        model.eval()
        net.train()
        model(torch.randn(8, 4))
        out[broadcast].append((bn.running_mean.tolist(), int(bn.num_batches_tracked)))
    return out


def test_data_parallel_broadcasts_buffers_at_wrapping_and_before_training_forwards(worlds):
    results = worlds(2).run(buffer_broadcasts)
    for rank, out in enumerate(results):
        for broadcast in (True, False):
            assert out[broadcast][0] == [1.0] * 3  # rank 0's, at wrapping
            assert out[broadcast][1] == ([float(rank)] * 3, 10 * rank)  # no broadcast before an eval forward
        assert out[True][2] == ([0.0] * 3, 1)
        assert out[False][2] == ([float(rank)] * 3, 10 * rank + 1)
        assert out[True][3] == ([0.0] * 3, 2)
        assert out[False][3] == ([float(rank)] * 3, 10 * rank + 2)


class ManyBuffers(torch.nn.Module):
    """Three BatchNorms (float and int64 buffers), a bool mask, a table and a view of it, and a cache
    that grows with the input on demand."""

    def __init__(self):
        super().__init__()
        self.norms = torch.nn.Sequential(*[torch.nn.BatchNorm1d(4, momentum=0.0) for _ in range(3)])
        self.register_buffer("mask", torch.zeros(4, dtype=torch.bool))
        self.register_buffer("table", torch.zeros(2, 4))
        self.register_buffer("row", self.table[1])
        self.register_buffer("cache", torch.zeros(4))

    def forward(self, x):
        if len(x) > len(self.cache):
            self.register_buffer("cache", torch.arange(float(len(x))))
        return self.norms(x) * self.cache[:len(x), None]


def buffers_of_many_kinds(rank, size):
    """The dtypes broadcast before a training forward, and the buffers, set per rank, after it."""
    net = ManyBuffers()
    model = gradsync.DataParallel(net, codec="none")
    for name, b in net.named_buffers():
        if name != "row":
            b.fill_(rank + 1 if b.dtype != torch.bool else rank == 0)
    calls = []
    broadcast = dist.broadcast
    def counted(tensor, *args, **kwargs):
        calls.append(str(tensor.dtype))
        return broadcast(tensor, *args, **kwargs)
    dist.broadcast = counted
    try:
        model(torch.randn(4, 4))
    finally:
        dist.broadcast = broadcast
    return sorted(calls), {name: b.tolist() for name, b in net.named_buffers()}


def a_buffer_grown_after_wrapping(rank, size):
    model = gradsync.DataParallel(ManyBuffers(), codec="none")
    model(torch.randn(8, 4))  # grows the cache, after the broadcast
    with pytest.raises(RuntimeError, match=r"buffer 'cache' is \(8,\) torch.float32 but was \(4,\) torch.float32 "
                                           r"when it was wrapped.*broadcast_buffers=False"):
        model(torch.randn(8, 4))


def test_data_parallel_broadcasts_buffers_one_dtype_at_a_time_and_refuses_a_grown_one(worlds):
    for calls, values in worlds(2).run(buffers_of_many_kinds):
        # float32 (BatchNorms' statistics, the cache), int64 (their counts), bool (the mask), and the
        # table and its view, which share memory, one at a time
        assert calls == ["torch.bool", "torch.float32", "torch.float32", "torch.float32", "torch.int64"]
        assert values["mask"] == [True] * 4 and values["norms.0.num_batches_tracked"] == 2  # counted after it
        assert values["norms.2.running_var"] == values["cache"] == values["table"][0] == [1.0] * 4
    worlds(1).run(a_buffer_grown_after_wrapping)  # alone: no peer is left waiting in the broadcast


def buffers_around_no_sync(rank, size):
    """Each rank's BatchNorm running mean, set to the rank before every step (momentum 0 keeps it),
    after steps whose forward and backward run: synchronized; inside no_sync(); synchronized twice;
    under DDP and under DataParallel."""
    out = {}
    for kind in ("ddp", "dp"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3, momentum=0.0))
        model = DDP(net) if kind == "ddp" else gradsync.DataParallel(net, codec="none")
        out[kind] = []
        for inside in (False, True, False, False):
            net[1].running_mean.fill_(float(rank))
            with model.no_sync() if inside else contextlib.nullcontext():
                model(torch.randn(8, 4)).sum().backward()
            out[kind].append(net[1].running_mean.tolist())
    return out


def test_data_parallel_skips_the_buffer_broadcast_after_a_no_sync_forward_as_ddp_does(worlds):
    results = worlds(2).run(buffers_around_no_sync)
    assert results[1]["ddp"] == [[0.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3]  # what DDP does
    assert all(r["dp"] == r["ddp"] for r in results)


def two_forwards_then_one_backward(rank, size):
    """A siamese step (SimCLR, a GAN's discriminator): two training forwards of one BatchNorm model,
    then one backward; the broadcast before the second forward rewrites buffers the first one saved
    for backward. Per wrapper: the gradients and the running statistics, or the error raised."""
    out = {}
    for kind in ("ddp", "dp"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 4))
        model = DDP(net) if kind == "ddp" else gradsync.DataParallel(net, codec="none")
        g = torch.Generator().manual_seed(rank)
        try:
            for _ in range(2):
                z1, z2 = model(torch.randn(6, 8, generator=g)), model(torch.randn(6, 8, generator=g))
                (z1 - z2).pow(2).mean().backward()
        except RuntimeError as error:
            out[kind] = str(error)
        else:
            out[kind] = [p.grad.clone() for p in net.parameters()] + [b.clone() for b in net.buffers()]
    return out


def test_data_parallel_takes_two_forwards_before_one_backward_as_ddp_does(worlds):
    for out in worlds(2).run(two_forwards_then_one_backward):
        assert not isinstance(out["dp"], str), out["dp"]
        assert len(out["dp"]) == 9  # six gradients, three buffers
        if isinstance(out["ddp"], str) and "modified by an inplace operation" in out["ddp"]:
            pytest.skip(f"torch {torch.__version__}'s DDP raises here itself (newer releases do not): {out['ddp']}")
        assert len(out["ddp"]) == 9
        for dp, ddp in zip(out["dp"], out["ddp"]):
            torch.testing.assert_close(dp, ddp, rtol=1e-6, atol=1e-7)


def warnings_of_create_graph(rank, size):
    model = gradsync.DataParallel(torch.nn.Linear(3, 2), codec="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(4, 3)).square().sum().backward(create_graph=True)
    for p in model.parameters():
        p.grad = None  # the graph the gradients hold refers to them
    return [str(w.message) for w in caught if "gradsync" in str(w.message)]


def test_data_parallel_warns_once_that_create_graph_differentiates_the_local_gradient(worlds):
    (caught,) = worlds(1).run(warnings_of_create_graph)
    assert len(caught) == 1 and "create_graph=True" in caught[0] and "not the average" in caught[0]


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x, branch):
        return (self.a if branch == "a" else self.b)(x)


def no_sync_forward_in_a_synced_backward(rank, size):
    """A forward under no_sync() (branch a), a synchronized one (branch b), one backward of both: the
    walk of find_unused_parameters=True sees the second alone."""
    torch.manual_seed(0)
    model = gradsync.DataParallel(TwoBranches(), codec="none", find_unused_parameters=True)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    with model.no_sync():
        first = model(x, "a").sum()
    try:
        (first + model(x, "b").sum()).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_data_parallel_names_a_no_sync_forward_that_a_synced_backward_runs_through(worlds):
    for error in worlds(2).run(no_sync_forward_in_a_synced_backward):
        assert error is not None and "parameter 'a." in error and "in a forward under no_sync() made before the " \
            "step's synchronized forward" in error, error


def rank_0_evaluates_alone(rank, size):
    """Rank 0 alone runs forwards in eval mode and without gradients after a synchronized step (DDP
    would broadcast buffers there, and wait for the others); then both ranks train a step."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model = gradsync.DataParallel(net, codec="none")
    model(torch.randn(8, 4)).sum().backward()
    if rank == 0:
        model.eval()
        model(torch.randn(8, 4))
        model.train()
        with torch.no_grad():
            model(torch.randn(8, 4))
    model.train()
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    return [p.grad for p in net.parameters()]


def test_data_parallel_lets_one_rank_evaluate_alone(worlds):
    results = worlds(2).run(rank_0_evaluates_alone)
    assert all(torch.equal(a, b) for a, b in zip(*results))


class TwoLayers(torch.nn.Module):
    """Two linear layers; ``fail`` makes the first layer's output raise once in backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.fail = False

    def forward(self, x):
        h = self.a(x)
        if self.fail:
            def once(grad):
                if self.fail:
                    self.fail = False
                    raise ValueError("backward failed")
            h.register_hook(once)
        return h, self.b(torch.tanh(h))


def forwards_and_backwards_around_no_sync(rank, size):
    """Gradients where forwards made outside and inside no_sync() interleave before their backward
    passes, and where a second backward of a forward follows one that raised: each against this
    rank's own gradients (a plain copy of the module) and their average over the ranks."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    def expected(run):
        plain = TwoLayers()
        run(plain, contextlib.nullcontext)
        local = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in plain.parameters()]
        average = [g.clone() for g in local]
        for g in average:
            dist.all_reduce(g)
            g /= size
        return local, average

    def grads(kind, run):
        net = TwoLayers()
        wrap = DDP if kind == "ddp" else functools.partial(gradsync.DataParallel, codec="none", bucket_cap_mb=1e-5)
        model = wrap(net)
        run(model, model.no_sync)
        return [p.grad.clone() for p in net.parameters()]

    def outside_then_inside(model, no_sync):  # both backward in one pass: it communicates
        first = model(x)[1]
        with no_sync():
            second = model(x)[1]
        (first.sum() + second.sum()).backward()

    def inside_then_outside(model, no_sync):  # the first backward communicates, and so does the second
        with no_sync():
            first = model(x)[1]
        second = model(x)[1]
        first.sum().backward()
        second.sum().backward()

    def accumulated(model, no_sync):
        with no_sync():
            model(x)[1].sum().backward()
        model(2 * x)[1].sum().backward()

    def inside_after_a_step_that_filled_no_grad(model, no_sync):  # that step has not run: it communicates
        inputs = x.clone().requires_grad_()
        torch.autograd.grad(model(inputs)[1].sum(), inputs)
        with no_sync():
            model(x)[1].sum().backward()

    out = {}
    cases = [("outside then inside", outside_then_inside), ("inside then outside", inside_then_outside),
             ("accumulated", accumulated), ("inside after autograd.grad", inside_after_a_step_that_filled_no_grad)]
    for name, run in cases:
        local, average = expected(run)
        out[name] = {}
        for kind in (["ddp", "dp"] if name != "inside then outside" else ["dp"]):
            got = grads(kind, run)
            out[name][kind] = (all(torch.allclose(g, a, atol=1e-6) for g, a in zip(got, average)),
                               all(torch.equal(g, l) for g, l in zip(got, local)))

    _, first_layer = expected(lambda plain, _: plain(x)[0].sum().backward())
    _, both_layers = expected(lambda plain, _: plain(x)[1].sum().backward())
    for views in (False, True):  # with views the gradients are the buckets, which the abandon zeroes
        net = TwoLayers()
        model = gradsync.DataParallel(net, codec="none", bucket_cap_mb=1e-5, gradient_as_bucket_view=views)
        model(x)[1].sum().backward()  # a first step: the gradients are views from now on
        net.fail = True
        h, y = model(x)
        with pytest.raises(ValueError, match="backward failed"):
            y.sum().backward(retain_graph=True)  # after the second layer's buckets went out
        model.zero_grad(set_to_none=not views)
        # no forward between: this backward abandons the failed one, then communicates. With views,
        # it reaches first the second layer, whose gradients' buckets the abandon zeroes
        (y if views else h).sum().backward()
        again = zip(net.parameters(), both_layers) if views else zip(net.a.parameters(), first_layer[:2])
        out[f"again after a failure, views {views}"] = all(torch.allclose(p.grad, a, atol=1e-6) for p, a in again)
        out[f"b untouched, views {views}"] = views or all(p.grad is None for p in net.b.parameters())
        model.zero_grad()
        model(x)[1].sum().backward()  # and the next step is a step like any other
        out[f"next step, views {views}"] = all(torch.allclose(p.grad, a, atol=1e-6)
                                               for p, a in zip(net.parameters(), both_layers))

    net = TwoLayers()  # a forward that raised (a batch skipped) leaves no backward communicating
    model = gradsync.DataParallel(net, codec="none")
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 5))  # the wrong width
    with model.no_sync():
        model(x)[1].sum().backward()
    out["no_sync after a forward that raised"] = all(torch.equal(p.grad, g) for p, g in zip(
        net.parameters(), expected(lambda plain, _: plain(x)[1].sum().backward())[0]))
    return out


def test_data_parallel_forwards_decide_whether_backward_communicates_and_a_retried_backward_does(worlds):
    results = worlds(2).run(forwards_and_backwards_around_no_sync)
    names = ("outside then inside", "inside then outside", "accumulated", "inside after autograd.grad")
    for out in results:
        for name in names:
            assert all(averaged and not local for averaged, local in out[name].values()), (name, out[name])
        assert all(v for k, v in out.items() if k not in names), out


def wrap_again(rank, size):
    net = make_net()
    model = gradsync.DataParallel(net, codec="fp16", bucket_cap_mb=BUCKET_MB)
    x, y = batch(rank, 0)
    F.mse_loss(model(x), y).backward()
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in net.parameters())
    if rank == 0:  # the bare module's backward communicates nothing
        F.mse_loss(net(x), y).backward()
    net.zero_grad()
    model = gradsync.DataParallel(net, codec="none", bucket_cap_mb=BUCKET_MB)
    F.mse_loss(model(x), y).backward()
    return digest(params_of(net)), digest(torch.cat([p.grad.flatten() for p in net.parameters()]))


def test_a_wrapper_that_is_gone_leaves_no_hooks(worlds):
    # as with DDP, whose hooks go with its reducer: keep the wrapper while it trains
    results = worlds(2).run(wrap_again)
    assert len(set(results)) == 1  # one average, every rank


class Grid(torch.nn.Module):
    def __init__(self, shape, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(shape, dtype=dtype))
        self.conv = torch.nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return self.conv(x).mean() * self.weight.float().sum()


def different_models(rank, size):
    """Ranks whose models or settings differ raise at wrapping, naming what differs, before any
    broadcast could pour one rank's values into another's shapes."""
    cases = {
        "shape": (Grid((4, 6) if rank == 0 else (6, 4)), {}),
        "dtype": (Grid((4, 6), torch.float32 if rank == 0 else torch.bfloat16), {}),
        "memory order": (Grid((4, 6)).to(memory_format=torch.channels_last) if rank else Grid((4, 6)),
                         {"gradient_as_bucket_view": True}),
        "codec": (Grid((4, 6)), {"codec": "fp16" if rank == 0 else "bf16"}),
        "bucket size": (Grid((4, 6)), {"bucket_cap_mb": 1 + rank}),
        "error feedback": (Grid((4, 6)), {"codec": "fp8_e4m3", "error_feedback": rank == 0}),
        "unused parameters": (Grid((4, 6)), {"find_unused_parameters": rank == 1}),
        "parameter count": (Grid((4, 6)), {}),
        "buffer count": (Grid((4, 6)), {}),
    }
    if rank == 1:  # one more layer, or one more buffer, than rank 0
        cases["parameter count"][0].extra = torch.nn.Linear(2, 2)
        cases["buffer count"][0].register_buffer("steps", torch.zeros(1))
    messages = {}
    for case, (net, options) in cases.items():
        with pytest.raises(ValueError) as error:
            gradsync.DataParallel(net, **options)
        messages[case] = str(error.value)
    # a memory order the gradients' copies do not depend on is no difference
    net = Grid((4, 6)).to(memory_format=torch.channels_last) if rank else Grid((4, 6))
    model = gradsync.DataParallel(net, codec="none")
    model(torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(rank))).backward()
    return messages, digest(torch.cat([p.grad.flatten() for p in net.parameters()]))


def test_data_parallel_refuses_ranks_that_wrap_different_models(worlds):
    results = worlds(2).run(different_models)
    for messages, _ in results:
        for case in ("shape", "dtype", "memory order"):
            assert "the ranks wrap different models: parameter 'weight' differs" in messages[case] or \
                "parameter 'conv.weight' differs" in messages[case], (case, messages[case])
        assert "the wrapper's settings differ" in messages["codec"] and "codec=" in messages["codec"]
        assert "the wrapper's settings differ" in messages["bucket size"]
        assert "the wrapper's settings differ" in messages["error feedback"] and "error_feedback=" in \
            messages["error feedback"]
        assert "find_unused_parameters=" in messages["unused parameters"]
        assert "the number of parameters differs across ranks (here " in messages["parameter count"]
        assert "between 3 and 5" in messages["parameter count"]
        assert "the number of buffers differs" in messages["buffer count"]
    assert results[0][1] == results[1][1]


def wrapped_twice(rank, size):
    """A module wrapped again while the older wrapper lives (``model = DataParallel(net)`` in a loop):
    the newer one averages, the older one's hooks stop, and its forward raises."""
    grads = []
    for twice in (False, True):
        net = make_net()
        older = gradsync.DataParallel(net, codec="fp16", bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
        model = gradsync.DataParallel(net, codec="fp16", bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True) \
            if twice else older
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(rank, step)
            F.mse_loss(model(x), y).backward()
            grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
            opt.step()
            opt.zero_grad()
        if twice:
            with pytest.raises(RuntimeError, match="the module was wrapped again"):
                older(x)
    once, again = grads[:3], grads[3:]
    same = all(torch.equal(a, b) for a, b in zip(once, again))
    # wrapped again after a layer was frozen (fine-tuning): the older one retires all the same
    net = make_net()
    older = gradsync.DataParallel(net, codec="none")
    net.body[0].requires_grad_(False)
    gradsync.DataParallel(net, codec="none")(x).sum().backward()
    with pytest.raises(RuntimeError, match="the module was wrapped again"):
        older(x)
    # a wrapper that only shares a tied parameter with a newer one, or runs inside it, keeps training
    tied = torch.nn.Linear(4, 4)
    first = gradsync.DataParallel(torch.nn.Sequential(tied, torch.nn.Linear(4, 4)), codec="none")
    second = gradsync.DataParallel(torch.nn.Sequential(tied, torch.nn.Linear(4, 2)), codec="none")
    outer = gradsync.DataParallel(torch.nn.Sequential(second, torch.nn.Linear(2, 1)), codec="none")
    for model in (first, second, outer):
        model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(TypeError, match="use copy.deepcopy"):
        copy.copy(first)
    return same and not any(m._retired for m in (first, second, outer))


def test_a_module_wrapped_again_is_averaged_by_the_newer_wrapper_only(worlds):
    assert all(worlds(2).run(wrapped_twice))


def nested_views(rank, size):
    """gradient_as_bucket_view with a wrapper running inside another: both average the inner
    layer's gradients, as two DDPs would, and the result is DDP's. Neither makes those gradients
    views of its bucket (the outer hook would copy a view the inner call was still writing, and the
    later end of step would leave .grad a view of its own bucket); the outer wrapper's other buckets
    keep theirs, as do both wrappers of a tied parameter for the parameters they do not share."""
    grads = {}
    for kind in ("ddp", "nested"):
        net = make_net()
        if kind == "ddp":
            model = DDP(net)
        else:
            net.body[2] = inner = gradsync.DataParallel(net.body[2], codec="none", gradient_as_bucket_view=True)
            model = gradsync.DataParallel(net, codec="none", bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(6):
            x, y = batch(rank, step)
            F.mse_loss(model(x), y).backward()
            grads.setdefault(kind, []).append(torch.cat([p.grad.flatten() for p in net.parameters()]))
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
    shared = {id(p) for p in inner.parameters()}
    holds_shared = [any(id(p) in shared for p in b.params) for b in model._buckets]
    views = [b.views is not None for b in model._buckets]
    assert all(b.views is None for b in inner._buckets) and views == [not s for s in holds_shared], views
    tied = torch.nn.Linear(4, 4)

    def shares_tied(wrapper):  # its buckets holding the tied layer keep copies, the others views
        return [b.views is None for b in wrapper._buckets] == [any(p is tied.weight or p is tied.bias for p in b.params)
                                                               for b in wrapper._buckets]
    first = gradsync.DataParallel(torch.nn.Sequential(tied, torch.nn.Linear(4, 4)), codec="none",
                                  bucket_cap_mb=1e-5, gradient_as_bucket_view=True)
    second = gradsync.DataParallel(torch.nn.Sequential(tied, torch.nn.Linear(4, 2)), codec="none",
                                   bucket_cap_mb=1e-5, gradient_as_bucket_view=True)
    tied_buckets = {"first": shares_tied(first), "second": shares_tied(second)}
    # second wrapped again: it retires, and the newer wrapper shares the tied layer with first still
    again = gradsync.DataParallel(second.module, codec="none", bucket_cap_mb=1e-5, gradient_as_bucket_view=True)
    tied_buckets["wrapped again"] = shares_tied(again)
    del again, second  # the newest wrapper of the tied layer gone, a later one shares it with first still
    gc.collect()
    third = gradsync.DataParallel(torch.nn.Sequential(tied, torch.nn.Linear(4, 3)), codec="none",
                                  bucket_cap_mb=1e-5, gradient_as_bucket_view=True)
    tied_buckets["after the newest went"] = shares_tied(third) and shares_tied(first)
    assert all(tied_buckets.values()), tied_buckets
    return [digest(g) for g in grads["nested"]], all(torch.equal(a, b) for a, b in zip(grads["ddp"], grads["nested"]))


def test_nested_wrappers_with_gradient_views_average_as_ddp(worlds):
    results = worlds(2).run(nested_views)
    assert all(same for _, same in results) and results[0][0] == results[1][0]


def loaded_in_place(rank, size):
    """Parameters after 3 steps from one checkpoint with fp8 error feedback: of a wrapper whose
    residuals two backwards had filled before its module loaded the checkpoint, and of a new one."""
    out = []
    for warm_steps in (2, 0):
        torch.manual_seed(0)
        model = wrap(make_net(), "dp:fp8_e4m3+ef")
        checkpoint = copy.deepcopy(model.module.state_dict())
        for step in range(warm_steps):
            x, y = batch(rank, 50 + step)
            F.mse_loss(model(x), y).backward()
            model.zero_grad()
        assert all(b.residual.any() for b in model._buckets) == bool(warm_steps), "the residuals to forget"
        model.module.load_state_dict(checkpoint)
        assert not any(b.residual.any() for b in model._buckets)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(rank, step)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        out.append(params_of(model))
    return out


def test_error_feedback_restarts_from_zeros_when_a_checkpoint_is_loaded(worlds):
    for loaded, fresh in worlds(2).run(loaded_in_place):
        assert torch.equal(loaded, fresh), (loaded - fresh).abs().max()


def partial_loads(rank, size):
    """A load restarts the residuals of the parameters it wrote only (an adapter's, say)."""
    model = wrap(make_net(), "dp:fp8_e4m3+ef")
    x, y = batch(rank, 0)
    F.mse_loss(model(x), y).backward()
    named = dict(model.module.named_parameters())

    def residuals():
        segments = {id(p): b.segment(j, b.residual).clone() for b in model._buckets for j, p in enumerate(b.params)}
        return {name: segments[id(p)] for name, p in named.items()}

    before = residuals()
    assert all(r.abs().sum() > 0 for r in before.values())
    model.module.load_state_dict({}, strict=False)  # writes nothing
    first = next(iter(named))
    with pytest.raises(RuntimeError, match="size mismatch"):  # fails before it writes
        model.module.load_state_dict({first: torch.zeros(1)}, strict=False)
    assert all(torch.equal(before[n], r) for n, r in residuals().items())
    model.module.load_state_dict({first: named[first].detach().clone()}, strict=False)
    after = residuals()
    assert not after[first].any() and all(torch.equal(before[n], after[n]) for n in named if n != first)
    # a load that raises before its end (a submodule's own pre-hook) leaves gradsync's marks on the
    # parameters until the next load, which takes them all away
    module = next(m for m in model.module.modules() if any(True for _ in m.parameters(recurse=False)))

    def refuse(*args):
        raise RuntimeError("checkpoint refused")

    handle = module.register_load_state_dict_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="checkpoint refused"):
        model.module.load_state_dict({})
    handle.remove()
    model.module.load_state_dict({}, strict=False)
    assert not any("_gradsync_loading" in p.__dict__ for p in model.module.parameters())
    return True


def test_a_load_restarts_the_residuals_of_the_parameters_it_wrote_only(worlds):
    assert all(worlds(2).run(partial_loads))


def swapped_parameters(rank, size):
    """load_state_dict under torch's swap_tensors mode keeps each parameter's Python object but not
    the tensor that holds gradsync's gradient hook."""
    model = gradsync.DataParallel(torch.nn.Linear(4, 1))
    checkpoint = copy.deepcopy(model.module.state_dict())
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for _ in range(8):  # each swap frees the tensor swapped out before: none may take the hooked one's place
            model.module.load_state_dict(checkpoint)
            with pytest.raises(RuntimeError, match="parameter 'weight' was swapped for another tensor, which has none "
                                                   "of gradsync's gradient hooks"):
                model(torch.ones(2, 4))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)
    with torch.no_grad():  # a forward that trains nothing may run on swapped parameters
        model(torch.ones(2, 4))
    return True


def test_parameters_swapped_after_wrapping_are_refused_not_left_unaveraged(worlds):
    assert all(worlds(2).run(swapped_parameters))


def copies(rank, size):
    """copy.deepcopy, torch.save/torch.load and AveragedModel of a DataParallel, as of a DDP: the copy
    wraps a copy of the module with the same settings and trains as the original does."""
    net = make_net()
    model = gradsync.DataParallel(net, codec="bf16", bucket_cap_mb=BUCKET_MB, error_feedback=True,
                                  gradient_as_bucket_view=True)
    x, y = batch(rank, 0)
    F.mse_loss(model(x), y).backward()
    net.body[1].eval()  # a submodule's own mode (a frozen BatchNorm, say) goes with the copies
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    averaged = torch.optim.swa_utils.AveragedModel(model)
    averaged.update_parameters(model)
    for bucket in model._buckets:  # the copies' residuals start from zeros
        bucket.residual.zero_()
    out = []
    for replica in [model] + copies:
        assert isinstance(replica, gradsync.DataParallel) and replica.codec == "bf16"
        assert replica.training and not replica.module.body[1].training and replica.module.body[0].training
        assert replica.buckets and all(b.residual is not None and b.views is not None for b in replica._buckets)
        assert replica is model or not any(p is q for p, q in zip(replica.parameters(), net.parameters()))
        replica.zero_grad()
        x, y = batch(rank, 1)
        F.mse_loss(replica(x), y).backward()
        out.append(torch.cat([p.grad.flatten() for p in replica.parameters()]))
    with pytest.raises(TypeError, match="other than the default one cannot be copied"):
        copy.deepcopy(gradsync.DataParallel(make_net(), process_group=dist.new_group(list(range(size)))))
    return [digest(g) for g in out]


def test_data_parallel_copies_wrap_a_copy_of_the_module(worlds):
    for digests in worlds(2).run(copies):
        assert len(set(digests)) == 1  # the copies average as the original does


class Fails(torch.autograd.Function):
    """Identity whose backward raises, as an out-of-memory error or a user hook would."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed")


class Segments(torch.nn.Module):
    """Layers that can run under reentrant activation checkpointing; outputs in a dict, as
    Hugging Face models return them."""

    def __init__(self, checkpointed):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(4)])
        self.checkpointed, self.fail = checkpointed, False

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if self.fail and i == 1:
                x = Fails.apply(x)
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(lambda y, f=layer: torch.tanh(f(y)), x, use_reentrant=True)
            else:
                x = torch.tanh(layer(x))
        return {"loss": x.square().mean(), "hidden": [x.detach()]}


def data_parallel_steps(rank, size):
    """Steps at the edges: (case, outcome) pairs, with the all-reduces each case issued counted."""
    calls = []
    issue = gradsync.data_parallel._issue
    gradsync.data_parallel._issue = lambda *a, **k: calls.append(1) or issue(*a, **k)
    out = {}

    def grads(model):
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    try:
        plain, checkpointed = (gradsync.DataParallel(Segments(c), codec="none", bucket_cap_mb=BUCKET_MB / 4)
                               for c in (False, True))
        x = batch(rank, 0)[0]
        for name, model in (("plain", plain), ("checkpointed", checkpointed)):
            calls.clear()
            model(x.requires_grad_(name == "checkpointed"))["loss"].backward()
            out[name] = (len(calls), digest(grads(model)))
        out["buckets"] = len(plain.buckets)

        plain.module.fail = True  # a backward that raises, then steps that must still average
        plain.zero_grad()
        with pytest.raises(RuntimeError, match="backward failed"):
            plain(x.detach())["loss"].backward()
        plain.module.fail = False
        for step in range(2):
            plain.zero_grad()
            calls.clear()
            plain(batch(rank, 1 + step)[0])["loss"].backward()
            out[f"after failure {step}"] = (len(calls), digest(grads(plain)))

        for inside in ("forward", "backward"):  # as with DDP, the forward decides
            plain.zero_grad()
            calls.clear()
            with plain.no_sync() if inside == "forward" else contextlib.nullcontext():
                loss = plain(x.detach())["loss"]
            with plain.no_sync() if inside == "backward" else contextlib.nullcontext():
                loss.backward()
            out[f"no_sync around the {inside}"] = len(calls)

        calls.clear()
        x = x.detach().requires_grad_()
        torch.autograd.grad(plain(x)["loss"], x)  # fills no .grad: nothing to average
        out["autograd.grad calls"] = len(calls)

        plain.zero_grad()  # a parameter frozen after wrapping is given no gradient
        plain.module.layers[0].weight.requires_grad_(False)
        plain(x.detach())["loss"].backward()
        out["frozen"] = (plain.module.layers[0].weight.grad is None, digest(grads(plain.module.layers[1])))
        plain.module.layers[0].weight.requires_grad_(True)

        plain.zero_grad()  # ... and does not hold back its bucket, the first (layers 3 to 1)
        plain.module.layers[3].weight.requires_grad_(False)
        issued = []
        handle = plain.module.layers[0].bias.register_post_accumulate_grad_hook(lambda p: issued.append(len(calls)))
        calls.clear()
        plain(x.detach())["loss"].backward()
        handle.remove()
        plain.module.layers[3].weight.requires_grad_(True)
        out["frozen, first bucket issued in backward"] = issued == [1] and plain.module.layers[3].weight.grad is None

        for change, words in (("unfrozen", "parameter 'layers.0.bias' was unfrozen"),
                              ("moved", "parameter 'layers.0.weight' is on meta, its bucket on cpu"),
                              ("replaced", "parameter 'layers.1.bias' was replaced"),
                              ("added", "parameter 'scale' was added")):
            module = Segments(False)
            module.layers[0].bias.requires_grad_(False)
            model = gradsync.DataParallel(module, codec="none", bucket_cap_mb=BUCKET_MB)
            if change == "unfrozen":
                module.layers[0].bias.requires_grad_(True)
            elif change == "moved":
                model.to("meta")  # replaces the parameters
            elif change == "replaced":
                module.layers[1].bias = torch.nn.Parameter(module.layers[1].bias.detach().clone())
            else:
                module.scale = torch.nn.Parameter(torch.ones(()))
            with pytest.raises(RuntimeError, match=words):
                model(x.detach())
            out[change] = "refused"
    finally:
        gradsync.data_parallel._issue = issue
    return out


class SharedSegments(torch.nn.Module):
    """One layer used in three reentrant checkpoints, between an input layer and a head outside them
    (ALBERT's shared layers, in small): its gradient arrives once per nested backward pass."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.shared, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 64)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        for _ in range(3):
            x = torch.utils.checkpoint.checkpoint(lambda y: torch.tanh(self.shared(y)), x, use_reentrant=True)
        return self.head(x).square().mean()


def shared_layer_steps(rank, size):
    """(gradients of a step whose shared layer shares a bucket with the input layer, the same
    averaged by torch, the error of a step whose shared layer has a bucket of its own)."""
    x = batch(rank, 0)[0]
    reference = SharedSegments()
    reference(x).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    dist.all_reduce(expected)
    expected /= size

    together = SharedSegments()  # buckets (head), (shared, first): the second waits for the input layer
    model = gradsync.DataParallel(together, codec="none", bucket_cap_mb=0.003)
    assert [len(b) for b in model.buckets] == [2, 4]
    model(x).backward()
    got = torch.cat([p.grad.flatten() for p in together.parameters()])

    apart = gradsync.DataParallel(SharedSegments(), codec="none", bucket_cap_mb=0.001)
    assert len(apart.buckets) == 3  # (head), (shared), (first): the shared layer's goes out too early
    try:
        apart(x).backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    apart(x.detach())  # the next forward abandons the failed step
    return got, expected, error


def sparse_gradient_step(rank, size):
    model = gradsync.DataParallel(torch.nn.Embedding(8, 4, sparse=True), codec="none")
    try:
        model(torch.tensor([rank, 3])).sum().backward()
    except RuntimeError as e:
        return str(e)
    return ""


def test_data_parallel_refuses_sparse_gradients_by_name(worlds):
    for message in worlds(2).run(sparse_gradient_step):
        assert "parameter 'weight' has a torch.sparse_coo gradient" in message, message


def test_data_parallel_averages_a_layer_shared_by_reentrant_checkpoints_or_raises(worlds):
    for got, expected, error in worlds(2).run(shared_layer_steps):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7), (got - expected).abs().max()
        assert error is not None and "'shared." in error and "use_reentrant=False" in error, error


def a_backward_that_raises_on_one_rank(rank, size, first):
    """Rank 1's backward raises after some buckets went out (in the step that checks each bucket's
    call, or in a later one), and it trains on; rank 0's backward completes."""
    segments = Segments(False)
    model = gradsync.DataParallel(segments, codec="none", bucket_cap_mb=0.001)
    assert len(model.buckets) == 4
    out = []
    for step in range(3 if first else 4):
        segments.fail = rank == 1 and step == (0 if first else 1)
        model.zero_grad()
        try:
            model(batch(rank, step)[0])["loss"].backward()
            out.append(digest(torch.cat([p.grad.flatten() for p in segments.parameters()])))
        except Exception as error:  # noqa: B902 - what each step ended with
            out.append(f"{type(error).__name__}: {error}")
        if first:  # a call of the training loop's own between steps (a flag, a metric)
            flag = torch.tensor([rank + 1.0])
            gradsync.all_reduce(flag, op="sum")
            out.append(flag.item())
    return out


@pytest.mark.parametrize("first", [True, False], ids=["checked_step", "later_step"])
def test_a_backward_that_raises_on_one_rank_takes_its_buckets_turns(first):
    # the buckets rank 1 did not send take their turn as refused calls: at a checked step rank 0 raises
    # naming rank 1, and both then train on; later, rank 0 fails at the group's timeout, and rank 1's
    # next step raises; before, rank 1's next step was summed with rank 0's failed one, silently
    world = World(2, group_timeout_s=5)
    try:
        (zero, one) = world.run(a_backward_that_raises_on_one_rank, first)
    finally:
        world.close()
    if first:
        assert "group rank(s) 1 could not prepare the call" in zero[0], zero
        assert "backward failed" in one[0], one
        assert zero[1::2] == one[1::2] == [3.0] * 3, (zero, one)  # the flags, summed right
        assert zero[2::2] == one[2::2] and not any(s.startswith(("RuntimeError", "ValueError")) for s in zero[2::2])
    else:
        assert zero[0] == one[0] and "backward failed" in one[1], (zero, one)
        assert all(s.startswith(("RuntimeError", "ValueError")) for s in zero[1:] + one[2:]), (zero, one)


CRASHING_RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
import gradsync
rank, init, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
model = gradsync.DataParallel(net, codec="fp8_e4m3", error_feedback=True, bucket_cap_mb=0.01)
assert len(model.buckets) > 1
for step in range(4):
    if step == 2 and rank == 1:  # in the middle of the backward, the last layer's buckets sent
        net[1].weight.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory, say")))
    model.zero_grad()
    try:
        model(torch.randn(8, 64)).square().mean().backward()
    except RuntimeError:
        if mode == "exits":
            raise
        sys.exit(1)  # the error logged, say
    print("step", step, "done", flush=True)
print("exits at", time.monotonic(), flush=True)
"""


@pytest.mark.parametrize("mode", ["exits", "sys_exit"], ids=["uncaught", "sys_exit"])
def test_a_rank_whose_backward_raises_exits_at_once_and_its_peer_fails(mode, tmp_path):
    # the buckets rank 1 did not send are refused; a refusal waits for the peers' checks, which
    # rank 0, in an unchecked call, never sends: the exit waited for it until the group's
    # timeout (2 minutes here, 30 by default), and rank 0 with it
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_RANK)
    init = tmp_path / "rendezvous"
    start = time.monotonic()
    (code0, out0, _), (code1, out1, err1) = run_processes(
        [[sys.executable, str(script), str(rank), str(init), mode] for rank in range(2)], tmp_path)
    took = time.monotonic() - start
    assert "out of memory, say" in err1 or mode == "sys_exit", err1[-2000:]
    assert code1 == 1 and "step 1 done" in out1 and "step 2 done" not in out1
    assert code0 != 0 and "step 2 done" not in out0, out0  # it failed, not summed alone
    assert took < 60, f"the ranks took {took:.0f} s to end"


def backwards_on_some_ranks(rank, size, device, codec, error_feedback):
    """Rank 0 makes a backward the others do not: each rank's outcome, per step, until it raises
    (on the CPU at the step's end, on a GPU at the next step), then the gradients of a step that
    every rank makes again."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Linear(300, 300), torch.nn.Linear(300, 4))
    # a bucket per parameter: the large weight's takes the ring, the others the direct exchange
    model = gradsync.DataParallel(net.to(device), codec=codec, error_feedback=error_feedback, bucket_cap_mb=1e-4)
    generator = torch.Generator().manual_seed(rank + 1)
    batch = lambda: torch.randn(16, 8, generator=generator).to(device)  # noqa: E731
    outcomes = []

    def step(name, run):
        model.zero_grad(set_to_none=True)
        try:
            run()
            outcomes.append((name, "ok"))
        except RuntimeError as e:
            outcomes.append((name, "paired different backward passes" in str(e) or str(e)))

    def twice():  # every rank: a second backward of one forward
        loss = model(batch()).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()

    step("twice", twice)
    step("direct", lambda: model.module(batch()).sum().backward())  # every rank: the wrapped module called directly
    step("plain", lambda: model(batch()).sum().backward())
    if rank == 0:  # a diagnostic backward on rank 0 alone: its calls pair with the others' next step
        step("diagnostic", lambda: model.module(batch()).sum().backward())
    while outcomes[-1][1] is not True and len(outcomes) < 7:
        step("next", lambda: model(batch()).sum().backward())
    step("again", lambda: model(batch()).sum().backward())
    return outcomes, [p.grad.cpu() for p in model.parameters()]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("codec,error_feedback", [("none", False), ("fp8_e4m3", True)], ids=["none", "fp8_ef"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_backward_made_on_some_ranks_only_raises_on_every_rank(worlds, device, size, codec, error_feedback):
    # its calls paired with the others' next step: a wrong average, then every later step one call
    # out of step, with no error at all (each pair agreed in size)
    results = worlds(size).run(backwards_on_some_ranks, device, codec, error_feedback)
    alike = [("twice", "ok"), ("direct", "ok"), ("plain", "ok")]
    if device == "cuda":  # the marks are read at the next step
        first, peers = [("diagnostic", "ok"), ("next", True)], [("next", "ok"), ("next", True)]
    else:
        first, peers = [("diagnostic", True)], [("next", True)]
    assert results[0][0] == alike + first + [("again", "ok")], results[0][0]
    for outcomes, _ in results[1:]:
        assert outcomes == alike + peers + [("again", "ok")], outcomes
    for rank in range(1, size):  # paired again, the ranks' next step sums alike
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[rank][1]))


def test_data_parallel_at_the_edges_of_a_step(worlds):
    results = worlds(2).run(data_parallel_steps)
    for case in results[0]:
        assert results[0][case] == results[1][case], f"{case}: ranks differ"
    out = results[0]
    buckets = out["buckets"]
    assert buckets > 1 and out["plain"][0] == buckets
    assert out["checkpointed"][1] == out["plain"][1]  # reentrant checkpointing: more calls, the same bits
    assert out["after failure 0"][0] == out["after failure 1"][0] == buckets
    assert out["autograd.grad calls"] == 0
    assert out["no_sync around the forward"] == 0 and out["no_sync around the backward"] == buckets
    assert out["frozen"][0]
    assert out["frozen, first bucket issued in backward"]
    assert all(out[change] == "refused" for change in ("unfrozen", "moved", "replaced", "added"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16_model", "fp16_model"])
def test_half_precision_models(worlds, dtype):
    # the parameters land where DDP's do (measured: bit for bit but for the bf16 wire under an fp16
    # model, 3e-4); gradients summed instead of averaged would land 2e-2 away
    results = worlds(2).run(train_modes, ["ddp", "hook:bf16", "hook:fp16", "dp:fp16"], 30, {"dtype": dtype, "lr": 0.05})
    check_ranks_agree(results)
    reference = results[0]["ddp"][1].float()
    for mode, (_, params, loss) in results[0].items():
        assert loss < 0.8 * initial_loss(dtype), (mode, loss)
        assert relative(params.float(), reference) < 2e-3, mode


def compiled_steps(rank, size):
    """DataParallel of a torch.compile'd module (AOTAutograd's backward node between the output and
    the parameters) against the same module eager, finding unused parameters through that node."""
    grads = {}
    for compiled in (False, True):
        net = make_net(unused=True)
        model = gradsync.DataParallel(torch.compile(net, backend="aot_eager") if compiled else net, codec="none",
                                      bucket_cap_mb=BUCKET_MB, find_unused_parameters=True)
        for step in range(3):
            model.zero_grad(set_to_none=True)
            x, y = batch(rank, step)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="gradsync")  # a walk that reached nothing warns
                F.mse_loss(model(x), y).backward()
        assert net.spare.weight.grad is None
        grads[compiled] = torch.cat([p.grad.flatten() for p in net.body.parameters()])
    return relative(grads[True], grads[False]), digest(grads[True])


def test_data_parallel_of_a_compiled_module(worlds):
    results = worlds(2).run(compiled_steps)
    assert all(error < 1e-6 for error, _ in results) and results[0][1] == results[1][1]


def scaler_skips(rank, size, mode):
    model = wrap(make_net(), mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    skipped = []
    for step in range(3):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if step == 1 and rank == size - 1:
            loss = loss * float("inf")  # an overflow on one rank only
        before = params_of(model)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(torch.equal(before, params_of(model)) and scaler.get_scale() < scale)
    return skipped


@pytest.mark.parametrize("mode", ["hook:fp16", "hook:bf16", "hook:fp8+ef", "dp:fp8_e4m3"])
def test_grad_scaler_sees_an_overflow_on_any_rank_and_skips_the_step(worlds, mode):
    assert worlds(2).run(scaler_skips, mode) == [[False, True, False]] * 2


def test_bf16_hook_registers_without_cuda_or_nccl():
    assert hooks.bf16_compress_hook.__name__ != "bf16_compress_hook"


class AParameterSubclass(torch.nn.Parameter):
    pass


def a_linear_of_parameter_subclasses(device):
    linear = torch.nn.Linear(2, 2, device=device)
    linear.weight, linear.bias = (AParameterSubclass(p.detach()) for p in (linear.weight, linear.bias))
    return linear


def a_linear_of_two_tensors():
    from torch.testing._internal.two_tensor import TwoTensor
    linear = torch.nn.Linear(2, 2)
    linear.weight = torch.nn.Parameter(TwoTensor(torch.randn(2, 2), torch.randn(2, 2)))
    return linear


@pytest.mark.parametrize("call,error,words", [
    (lambda: hooks.fp16_compress_hook("world", None), TypeError, "hook state must be None, a torch.distributed"),
    (lambda: hooks.GradSyncState(codec="int8"), ValueError, "unknown codec 'int8'"),
    (lambda: hooks.GradSyncState(process_group=3), TypeError, "process_group must be"),
    (lambda: hooks.GradSyncState(error_feedback="no"), TypeError, "error_feedback must be True or False"),
    (lambda: hooks.GradSyncState(prescale=0.0), ValueError, "prescale must be a finite, non-zero number"),
    (lambda: hooks.GradSyncState(postscale="2"), ValueError, "postscale must be a finite, non-zero number"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), error_feedback=None), TypeError, "error_feedback must be"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), broadcast_buffers="yes"), TypeError, "broadcast_buffers must"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), find_unused_parameters="no"), TypeError,
     "find_unused_parameters must"),
    (lambda: gradsync.DataParallel(torch.nn.ReLU()), ValueError, "no parameters that require gradients"),
    (lambda: gradsync.DataParallel(torch.nn.LazyLinear(2)), ValueError,
     "'weight' is not initialized yet (a lazy module); run a forward pass"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), codec="int8"), ValueError, "unknown codec 'int8'"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=float("inf")), ValueError,
     "bucket_cap_mb must be positive and finite, got inf"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), bucket_cap_mb="25"), TypeError,
     "bucket_cap_mb must be a number of MiB, got str"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=True), TypeError,
     "bucket_cap_mb must be a number of MiB, got bool"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2).double()), TypeError, "parameter 'weight' is torch.float64"),
    (lambda: gradsync.DataParallel(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")])),
     ValueError, "on several devices (cpu, meta)"),
    (torch.inference_mode()(lambda: gradsync.DataParallel(torch.nn.Linear(2, 2))), RuntimeError,
     "gradsync.DataParallel cannot be made inside torch.inference_mode(): its buckets would be inference tensors"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2, device="meta")), ValueError,
     "the module is on the meta device (its parameters hold no values)"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2)), RuntimeError, "torch.distributed to be initialized"),
    # gradient_as_bucket_view=True kept the average of one half of it, silently
    (lambda: gradsync.DataParallel(a_linear_of_two_tensors(), gradient_as_bucket_view=True), TypeError,
     "parameter 'weight' is a TwoTensor, a tensor subclass whose values live in the tensors it wraps"),
    # a Parameter subclass on the meta device (as accelerate's init_empty_weights keeps it) is on the meta device
    (lambda: gradsync.DataParallel(a_linear_of_parameter_subclasses("meta")), ValueError,
     "the module is on the meta device (its parameters hold no values)"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), device_ids=[0]), ValueError,
     "device_ids and output_device are for a module on one GPU; this one is on cpu (device_ids=[0])"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), device_ids=0), TypeError,
     "device_ids must be None or a list of one device, got int"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), device_ids=[0, 1]), ValueError,
     "device_ids can only be None or hold a single device (one process per device), got [0, 1]"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), output_device=0), ValueError,
     "output_device=0 needs device_ids"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), device_ids=[]), RuntimeError,  # DDP's None
     "torch.distributed to be initialized"),
    (lambda: gradsync.DataParallel(torch.nn.Linear(2, 2), dim=1), TypeError, "unexpected keyword argument 'dim'"),
])
def test_bad_input(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


class FakeBucket:
    """What GradSyncState.residual reads of a dist.GradBucket."""

    def __init__(self, params):
        self._params = params
        self._buffer = torch.zeros(sum(p.numel() for p in params))

    def parameters(self):
        return self._params

    def buffer(self):
        return self._buffer


def test_error_feedback_residuals_follow_their_parameters_into_rebuilt_buckets():
    a, b, c = torch.zeros(3), torch.zeros(5), torch.zeros(2)
    state = hooks.GradSyncState(codec="fp8_e4m3", error_feedback=True)
    first, second = state.residual(FakeBucket([a, b])), state.residual(FakeBucket([c]))
    first.copy_(torch.arange(8.0))
    second.copy_(torch.tensor([8.0, 9.0]))
    assert state.residual(FakeBucket([a, b])) is first  # the same bucket keeps its residual
    rebuilt = state.residual(FakeBucket([b, c]))  # DDP's rebuild: b moves next to c
    assert rebuilt.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    alone = state.residual(FakeBucket([a]))
    assert alone.tolist() == [0.0, 1.0, 2.0]
    assert len(state._residuals) == 2  # the replaced buckets are gone
    del a, b, c, first, second, rebuilt, alone
    assert len(state._residuals) == 0  # and the rest go with their parameters


def test_a_state_dropped_before_its_model_frees_its_residuals():
    # a model outlives the states of several runs (a new DDP and state each): the residuals, an fp32
    # copy of the gradients each, go with their state
    # (HierarchicalState's shard residuals: shard_residuals_on_rebuild)
    params = [torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(24))]
    finalizers = len(weakref.finalize._registry)
    assert all(dropped_state_frees(lambda: hooks.GradSyncState(codec="fp8_e4m3", error_feedback=True), "_residuals",
                                   lambda state: state.residual(FakeBucket(params))) for _ in range(3))
    assert len(weakref.finalize._registry) == finalizers  # nor what drops a residual with its parameters

    class Compared(hooks.GradSyncState):  # a subclass that compares by value, so unhashable
        def __eq__(self, other):
            return isinstance(other, Compared)
    assert dropped_state_frees(lambda: Compared(codec="fp8_e4m3", error_feedback=True), "_residuals",
                               lambda state: state.residual(FakeBucket(params)))
    del params  # the finalizers of states that are gone do nothing


def dropped_state_frees(make, table, get):
    """Whether the residual `get` makes in a state of `make` goes with the state, its model alive."""
    state = make()
    residual = weakref.ref(get(state))
    assert len(getattr(state, table)) == 1
    del state
    gc.collect()
    return residual() is None


def copied_hook_states(rank, size):
    """copy.deepcopy of a DDP model with gradsync hooks (AveragedModel makes one): the copy of each
    state shares its groups, and its residuals start afresh."""
    results = []
    for state, hook in [(hooks.GradSyncState(dist.new_group(list(range(size))), error_feedback=True),
                         hooks.allreduce_hook),
                        (hooks.HierarchicalState(2, error_feedback=True), hooks.hierarchical_hook)]:
        ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
        ddp.register_comm_hook(state, hook)
        x, y = batch(rank, 0)
        F.mse_loss(ddp(x), y).backward()
        torch.optim.swa_utils.AveragedModel(ddp)
        (_, copied), = copy.deepcopy(ddp)._comm_hooks
        groups = [g for g in ("process_group", "local_group", "cross_group") if hasattr(state, g)]
        results.append((copied is not state, type(copied) is type(state),
                        all(getattr(copied, g) is getattr(state, g) for g in groups),
                        not copied._residuals and not getattr(copied, "_shard_residuals", {}),
                        bool(state._residuals or getattr(state, "_shard_residuals", {}))))
    return results


def test_a_copied_ddp_model_shares_its_hook_states_groups(worlds):
    # per state: a new object, of its type, with the same groups, no residuals, where the original has some
    for results in worlds(2).run(copied_hook_states):
        assert results == [(True,) * 5] * 2, results


def default_states_follow_their_groups(rank, size):
    """The state made for hooks registered with a group (or None) goes with its group."""
    sub = dist.new_group([0, 1])
    ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(sub, hooks.fp16_compress_hook)
    x, y = batch(rank, 0)
    F.mse_loss(ddp(x), y).backward()
    same = hooks._resolve_state(None)[1] is hooks._resolve_state(dist.group.WORLD)[1]  # one group, one state
    state = weakref.ref(hooks._resolve_state(sub)[1])
    del ddp
    gradsync.shutdown()  # its engines hold their groups
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    return same, state() is None


def test_the_state_of_a_group_goes_with_the_group(worlds):
    assert all(all(r) for r in worlds(2).run(default_states_follow_their_groups))


def mismatched_hooks(rank, size):
    """fp16 on one rank, bf16 on the other: the same bytes on the wire, so only the check can tell.
    Three steps (DDP rebuilds its buckets after the first): a failed check proves nothing, so every
    later step checks again."""
    model = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    model.register_comm_hook(None, hooks.fp16_compress_hook if rank == 0 else hooks.bf16_compress_hook)
    messages = []
    for step in range(3):
        x, y = batch(rank, step)
        try:
            F.mse_loss(model(x), y).backward()
            messages.append("")
        except Exception as error:  # noqa: B902 - DDP re-raises the hook's error as it was raised
            messages.append(str(error))
    return messages


def test_ranks_with_different_codecs_fail_on_the_first_step_and_the_next(worlds):
    for messages in worlds(2).run(mismatched_hooks):
        for message in messages:
            assert "the ranks disagree on the call" in message, message


def test_a_bucket_counts_as_agreed_on_only_once_its_checked_call_succeeded():
    a, b = torch.zeros(3), torch.zeros(5)
    state, bucket = hooks.GradSyncState(), FakeBucket([a, b])
    assert state.needs_check(bucket, "fp16") and state.needs_check(bucket, "fp16")  # asking records nothing
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    state._value_once_agreed(bucket, "fp16")(done)
    assert not state.needs_check(bucket, "fp16")
    assert state.needs_check(bucket, "bf16") and state.needs_check(FakeBucket([b, a]), "fp16")
    del a, bucket
    assert not state._checked  # dropped with the bucket's first parameter


def clip_in_place(p):
    p.grad.clamp_(-0.1, 0.1)


def hooks_on_parameters_and_swapped_weights(rank, size):
    """Hooks a user registers on the parameters after wrapping (per-rank clipping) run before gradsync
    reads the gradient, as before DDP's reducer: the average is that of the clipped gradients, with
    one bucket or several, with copies or bucket views. A forward under no_grad may run on weights
    swapped in by torch.func.functional_call (an EMA's); with grad enabled that is refused."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    for views in (False, True):
        for bucket_mb in (25, 1e-4):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
            ref = copy.deepcopy(net)
            model = gradsync.DataParallel(net, codec="none", bucket_cap_mb=bucket_mb, gradient_as_bucket_view=views)
            for p in net.parameters():
                p.register_post_accumulate_grad_hook(clip_in_place)
            for step in range(2):
                net.zero_grad()
                ref.zero_grad()
                model(x + step).pow(2).sum().backward()
                ref(x + step).pow(2).sum().backward()
                for p, q in zip(net.parameters(), ref.parameters()):
                    expected = q.grad.clamp(-0.1, 0.1)
                    dist.all_reduce(expected)
                    torch.testing.assert_close(p.grad, expected / size, rtol=1e-6, atol=1e-7)
    ema = {name: p.detach() * 0.5 for name, p in model.named_parameters()}
    with torch.no_grad():
        swapped = torch.func.functional_call(model, ema, (x,))
    plain = {name.removeprefix("module."): p for name, p in ema.items()}
    assert torch.equal(swapped, torch.func.functional_call(net, plain, (x,)))
    with pytest.raises(RuntimeError, match=r"parameter .* was replaced .*functional_call swaps parameters too"):
        torch.func.functional_call(model, ema, (x,))
    model(x).pow(2).sum().backward()  # the wrapper is intact
    return True


def test_parameter_hooks_run_first_and_no_grad_forwards_may_swap_weights(worlds):
    assert all(worlds(2).run(hooks_on_parameters_and_swapped_weights))
