"""Uneven inputs: gradsync.DataParallel.join() and gradsync's DDP hooks under DDP.join(), against DDP."""
import contextlib
import re

import pytest
import torch
import torch.nn.functional as F

from distributed_harness import World
from test_hooks import Segments, batch, make_net, params_of, relative, wrap


class BatchNormNet(torch.nn.Module):
    """Buffers that change every training forward, so that their broadcasts are shadowed too."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, 1))

    def forward(self, x):
        return self.body(x)


def state_of(model):
    return torch.cat([t.detach().double().flatten() for t in list(model.parameters()) + list(model.buffers())])


def train_uneven(rank, size, modes, counts, micro, divide, device="cpu"):
    """Per mode, the parameters and buffers after rank r trained on counts[r] batches, each step
    accumulating `micro` micro-batches (all but the last under no_sync()), inside join()."""
    out = {}
    for mode in modes:
        torch.manual_seed(0)
        model = wrap(BatchNormNet().to(device), mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join(divide_by_initial_world_size=divide):
            for step in range(counts[rank]):
                opt.zero_grad()
                for m in range(micro):
                    x, y = (t.to(device) for t in batch(rank, step * micro + m))
                    with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                        F.mse_loss(model(x), y).backward()
                opt.step()
        out[mode] = state_of(model).cpu()
    return out


# relative distance from DDP's state (DDP's own join() with its fp32 all-reduce)
MODES = {"hook:none": 1e-6, "dp:none": 1e-6, "dpv:none": 1e-6, "dpf:fp16": 1e-3, "hook:fp16": 1e-3,
         "dp:fp8_e4m3+ef": 2e-2}


@pytest.mark.parametrize("counts,micro,divide", [((3, 6, 4), 1, True), ((5, 2, 4), 2, True), ((3, 6, 4), 1, False)],
                         ids=["uneven", "uneven_accumulating", "divide_by_ranks_training"])
def test_join_trains_on_uneven_inputs_as_ddp_does(worlds, counts, micro, divide):
    # DDP's hooks divide by the group's size whatever join() is told; DataParallel does as DDP
    modes = [m for m in MODES if divide or m.startswith("dp")]
    results = worlds(3).run(train_uneven, ["ddp", *modes], counts, micro, divide)
    for mode in results[0]:
        for rank in (1, 2):  # every rank takes the last one's model
            assert torch.equal(results[rank][mode], results[0][mode]), f"{mode}: rank {rank} differs"
    for mode in modes:
        assert relative(results[0][mode], results[0]["ddp"]) < MODES[mode], mode


@pytest.mark.cuda
def test_join_on_cuda(worlds):
    # two ranks share the GPU over gloo: gradsync stages CUDA tensors through pinned host memory
    results = worlds(2).run(train_uneven, ["ddp", "dp:none", "dpv:none", "hook:fp16"], (2, 4), 2, True, "cuda")
    for mode in results[0]:
        assert torch.equal(results[1][mode], results[0][mode]), f"{mode}: ranks differ"
    for mode in ("dp:none", "dpv:none", "hook:fp16"):
        assert relative(results[0][mode], results[0]["ddp"]) < MODES[mode], mode


def masked_or_joined(rank, size, modes, counts, joined):
    """Per mode, the parameters after training make_net() inside join() on counts[rank] batches, or
    (joined=False) without join() on max(counts) batches, those past counts[rank] with a zero loss."""
    out = {}
    for mode in modes:
        model = wrap(make_net(), mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join() if joined else contextlib.nullcontext():
            for step in range(counts[rank] if joined else max(counts)):
                opt.zero_grad()
                x, y = batch(rank, step)
                (F.mse_loss(model(x), y) * (1.0 if step < counts[rank] else 0.0)).backward()
                opt.step()
        out[mode] = params_of(model)
    return out


def test_a_rank_that_ran_out_contributes_exactly_zeros(worlds):
    # rank 0 has no batch at all: it shadows every step from the first, the bucket check included
    modes, counts = ["dp:none", "dpv:none", "dpf:fp16", "dp:bf16"], (0, 4, 2)
    joined = worlds(3).run(masked_or_joined, modes, counts, True)
    masked = worlds(3).run(masked_or_joined, modes, counts, False)
    for mode in modes:
        assert all(torch.equal(r[mode], joined[0][mode]) for r in joined), mode
        assert torch.equal(joined[0][mode], masked[0][mode]), mode


def terminate_early(rank, size):
    model = wrap(BatchNormNet(), "dp:fp16")
    steps = 0
    try:
        with model.join(throw_on_early_termination=True):
            for step in range(2 + rank):
                F.mse_loss(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
                steps += 1
    except RuntimeError as e:
        return steps, str(e)
    return steps, None


def epochs_after_an_uneven_one(rank, size):
    """An epoch in which rank 1 runs out inside an accumulation (its last forward in no_sync()),
    an even one after it, a forward that raises on every rank (caught), and an evaluation on rank 0
    alone once the context is over: every rank must come through and agree."""
    model = wrap(BatchNormNet(), "dp:fp16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plans = ([(0, 1), (2, 3), (4,)], [(0, 1), (2, None)])  # micro-batches per step; None: out of data
    for epoch, steps in enumerate((plans[rank] if rank < 2 else plans[0], [(5,), (6,)])):
        with model.join():
            for step in steps:
                opt.zero_grad()
                for i, m in enumerate(step):
                    if m is None:
                        break
                    x, y = batch(rank, 10 * epoch + m)
                    with model.no_sync() if i < len(step) - 1 else contextlib.nullcontext():
                        F.mse_loss(model(x), y).backward()
                opt.step()
            if epoch == 1:  # every rank alike, none joined: these are harmless
                with pytest.raises(RuntimeError, match="shape"):
                    model(torch.ones(4, 3))
                F.mse_loss(model(batch(rank, 99)[0]), batch(rank, 99)[1]).backward()
                model(batch(rank, 98)[0])  # a forward without its backward
                F.mse_loss(model(batch(rank, 97)[0]), batch(rank, 97)[1]).backward()
    joined = state_of(model)
    if rank == 0:
        with torch.no_grad():
            model.eval()(batch(0, 0)[0])  # no collective after the context
        model.train()
    F.mse_loss(model(batch(rank, 7)[0]), batch(rank, 7)[1]).backward()
    return joined, torch.cat([p.grad.flatten() for p in model.parameters()])


def test_epochs_after_an_uneven_one(worlds):
    results = worlds(3).run(epochs_after_an_uneven_one)
    for joined, grads in results:
        assert torch.equal(joined, results[0][0]) and torch.equal(grads, results[0][1])


def misuse_with_a_joined_rank(rank, size, case):
    """Rank 0 has no batch; rank 1 breaks the one-backward-per-forward rule. Returns what each raised."""
    model = wrap(Segments(case == "reentrant"), "dp:none")
    x = batch(rank, 0)[0].requires_grad_()
    try:
        with model.join():
            if rank == 1:
                if case == "two_forwards":
                    model(x)
                model(x)["loss"].backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", ["two_forwards", "reentrant"])
def test_misuse_under_join_raises_where_it_happens_and_times_out_elsewhere(case):
    world = World(2, group_timeout_s=5)  # the joined rank waits out the group's timeout
    try:
        errors = world.run(misuse_with_a_joined_rank, case, timeout=120)
    finally:
        world.close()
    words = "followed another whose backward did not run" if case == "two_forwards" else "second synchronized backward"
    assert words in errors[1]
    assert errors[0] is not None and re.search(r"Timed out waiting \d+ms", errors[0]), errors[0]  # gloo's words


def join_flags_refused(rank, size):
    model = wrap(BatchNormNet(), "dp:none")
    refused = []
    for flag in ("enable", "throw_on_early_termination", "divide_by_initial_world_size"):
        with pytest.raises(TypeError) as info:
            model.join(**{flag: "no"})  # a truthy string would turn on what it names
        refused.append(str(info.value))
    return refused


def test_join_flags_must_be_true_or_false(worlds):
    [refused] = worlds(1).run(join_flags_refused)
    assert refused == [f"{flag} must be True or False, got 'no'"
                       for flag in ("enable", "throw_on_early_termination", "divide_by_initial_world_size")]


def test_join_raising(worlds):
    results = worlds(3).run(terminate_early)
    assert [steps for steps, _ in results] == [2, 2, 2]
    assert "exhausted all inputs" in results[0][1]
    assert all("exhausted inputs" in message for _, message in results[1:])
    results = worlds(3).run(train_uneven, ["dp:none"], (2, 2, 2), 1, True)  # the group is still in step
    assert all(torch.equal(r["dp:none"], results[0]["dp:none"]) for r in results)
