"""gradsync.all_gather on gloo ranks: exact with "none", every rank the same bits, failures on every rank."""
import time

import pytest
import torch
import torch.distributed as dist

import gradsync
from distributed_harness import World
from test_allreduce import DTYPES, digest, in_a_callback_on_rank_0, rank_input, same_bits_up_to_nan_payload


def round_trip(x, codec):
    """What every rank holds of x after the wire: its encoding decoded once (x itself with "none")."""
    if codec == "none":
        return x
    return gradsync.decompress(gradsync.compress(x, codec), codec, x.numel(), dtype=x.dtype)


def gather_cases(rank, size, cases):
    """{case: (whether every chunk is its rank's input through the codec, digest)}; each case into
    memory of its own, and in place (the input being this rank's own chunk of the output), which must
    give the same bits."""
    out = {}
    for chunk, codec, dtype_name in cases:
        dtype = DTYPES[dtype_name]
        inputs = [rank_input(r, chunk, dtype, seed=chunk + 5) for r in range(size)]
        x = inputs[rank].clone()
        result = torch.full((chunk * size,), float("nan"), dtype=dtype)
        gradsync.all_gather(result, x, codec=codec)
        assert torch.equal(x.view(torch.uint8), inputs[rank].view(torch.uint8)), "input changed"
        in_place = torch.full((chunk * size,), float("nan"), dtype=dtype)
        in_place[rank * chunk:(rank + 1) * chunk] = x
        gradsync.all_gather(in_place, in_place[rank * chunk:(rank + 1) * chunk], codec=codec)
        assert torch.equal(in_place.view(torch.uint8), result.view(torch.uint8)), "in place differs"
        expected = torch.cat([round_trip(i, codec) for i in inputs])
        exact = same_bits_up_to_nan_payload(result, expected)
        out[(chunk, codec, dtype_name)] = (exact, digest(result))
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_all_gather_is_each_ranks_input_through_the_codec_and_the_same_everywhere(worlds, size):
    chunks = [0, 1, 127, 1009, 2**16 + 3]
    cases = [(c, codec, dtype) for c in chunks for dtype in DTYPES for codec in gradsync.CODECS
             if c < 2**16 or dtype == "float32"]
    results = worlds(size).run(gather_cases, cases)
    for case in cases:
        assert all(r[case][0] for r in results), f"{case}: not the inputs through the codec"
        assert len({r[case][1] for r in results}) == 1, f"{case}: the ranks differ"


def gather_with_others(rank, size):
    """An all-gather in flight between an all-reduce and a reduce-scatter, each with its own
    result, then one on a subgroup of ranks 1..3 while rank 0 goes on."""
    chunk = 3001
    x = rank_input(rank, chunk, torch.float32, seed=31)
    reduced = rank_input(rank, chunk * size, torch.float32, seed=32)
    scattered, scattered_from = torch.empty(chunk), reduced.clone()
    gathered = torch.empty(chunk * size)
    works = [gradsync.all_reduce(reduced, op="sum", async_op=True),
             gradsync.all_gather(gathered, x, async_op=True),
             gradsync.reduce_scatter(scattered, scattered_from, op="sum", async_op=True)]
    for w in works:
        w.wait()
    assert torch.equal(gathered, torch.cat([rank_input(r, chunk, torch.float32, seed=31) for r in range(size)]))
    mine = reduced[rank * chunk:(rank + 1) * chunk]  # the same sums, added in another order
    assert (scattered - mine).abs().max() <= 1e-6 * mine.abs().max()
    sub = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    out = torch.empty(9, dtype=torch.bfloat16)
    gradsync.all_gather(out, torch.full((3,), float(rank), dtype=torch.bfloat16), group=sub)
    return out.tolist()


def test_all_gather_in_flight_with_others_and_on_a_subgroup(worlds):
    results = worlds(4).run(gather_with_others)
    for result in results[1:]:
        assert result == [1.0] * 3 + [2.0] * 3 + [3.0] * 3


def disagreeing(rank, size):
    messages = []
    for call in ("numel", "operation", "dtype", "codec", "refused"):
        out, x, codec = torch.full((4 * size,), 7.0), torch.randn(4), "none"
        if call == "numel" and rank == 1:
            out, x = torch.full((5 * size,), 7.0), torch.randn(5)
        elif call == "dtype" and rank == size - 1:
            out, x = out.bfloat16(), x.bfloat16()
        elif call == "codec" and rank == 0:
            codec = "fp16"
        elif call == "refused" and rank == 1:
            out = torch.full((4 * size + 1,), 7.0)
        start = time.monotonic()
        try:
            if call == "operation" and rank == 1:
                gradsync.reduce_scatter(torch.empty(4), torch.randn(4 * size), op="sum")  # all but the op agree
            else:
                gradsync.all_gather(out, x, codec=codec)
        except ValueError as e:
            assert time.monotonic() - start < 10, f"{call}: raised after {time.monotonic() - start:.1f} s"
            if not (call == "operation" and rank == 1):
                own = out if call != "refused" or rank != 1 else out[:0]
                assert torch.all(own == 7.0), f"{call}: a failed call wrote into the output"
            messages.append(str(e))
    out = torch.empty(2 * size)
    gradsync.all_gather(out, torch.full((2,), float(rank)))  # the group is still usable
    assert out.tolist() == [float(r) for r in range(size) for _ in range(2)]
    return messages


def test_ranks_that_disagree_raise_everywhere(worlds):
    for rank, messages in enumerate(worlds(3).run(disagreeing)):
        assert len(messages) == 5, messages
        numel, operation, dtype, codec, refused = messages
        assert numel.startswith("gradsync.all_gather: the ranks disagree") and "numel 12" in numel \
            and "numel 15" in numel
        assert "operation all_gather" in operation and "operation reduce_scatter" in operation
        assert "dtype bfloat16" in dtype and "dtype float32" in dtype
        assert "codec fp16" in codec and "codec none" in codec
        if rank == 1:
            assert refused.startswith("output must hold 3 chunks"), refused
        else:
            assert "group rank(s) 1 could not prepare the call" in refused, refused


def bad_calls(rank, size):
    x = torch.randn(4)
    out = torch.empty(4 * size)
    cases = [
        (lambda: gradsync.all_gather(torch.empty(3), x), ValueError, f"output must hold {size} chunks"),
        (lambda: gradsync.all_gather(out.half(), x), ValueError, "one dtype and device"),
        (lambda: gradsync.all_gather(out.int(), x.int()), TypeError, "output has dtype"),
        (lambda: gradsync.all_gather(out, out[1:5]), ValueError, "input overlaps output"),
        (lambda: gradsync.all_gather(out, x, codec="fp4"), ValueError, "unknown codec"),
        (lambda: gradsync.all_gather(torch.empty(8 * size)[::2], x), ValueError, "output must be contiguous"),
        (lambda: gradsync.all_gather(out, torch.empty(8)[::2]), ValueError, "input must be contiguous"),
        (lambda: gradsync.all_gather(out, x, async_op=1.5), TypeError, "async_op must be True or False"),
        (lambda: gradsync.all_gather(out, [1.0]), TypeError, "input must be a torch.Tensor"),
        (lambda: gradsync.all_gather(out, x.view(1, 4).to_sparse_csr()), ValueError, "input is a torch.sparse_csr"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
    gradsync.all_gather(out, x)  # each refusal took its turn on every rank alike: the ring is in step
    assert torch.equal(out[rank * 4:(rank + 1) * 4], x)
    grid = torch.full((size, 3), -1.0)  # shapes of any kind: their elements make the chunks
    grid[rank] = rank
    gradsync.all_gather(grid, grid[rank])
    assert torch.equal(grid, torch.arange(size, dtype=torch.float32)[:, None].expand(size, 3))
    flat = torch.empty(6 * size)
    gradsync.all_gather(flat, torch.full((2, 3), float(rank)))
    return torch.equal(flat, torch.arange(size, dtype=torch.float32).repeat_interleave(6))


def test_bad_input_raises_naming_the_argument(worlds):
    assert all(worlds(2).run(bad_calls))


def autograd_cases(rank, size):
    """The collectives' writes as torch's in-place collectives make them: into a Parameter under
    no_grad, into an inference tensor in inference mode, from an input that requires grad without
    putting the output in a graph, each write bumping the written tensor's version; a write autograd
    would track is refused on one rank, its peer raising too, naming it, and the ring stays in step."""
    seen = {}
    weight = torch.nn.Parameter(torch.zeros(3 * size))
    shard = torch.full((3,), rank + 1.0)
    with torch.no_grad():
        gradsync.all_gather(weight, shard)
    seen["parameter"] = (weight.tolist(), weight.requires_grad)
    with torch.inference_mode():
        frozen = torch.empty(3 * size)
        gradsync.all_gather(frozen, shard)
    seen["inference"] = frozen.tolist()
    tracked, out = torch.nn.Parameter(shard.clone()), torch.zeros(3 * size)
    with torch.no_grad():
        gradsync.all_gather(out, tracked)
    out_grad_enabled = torch.zeros(3 * size)
    gradsync.all_gather(out_grad_enabled, tracked)
    seen["tracked input"] = (out.requires_grad, out.grad_fn, out_grad_enabled.requires_grad, out.tolist())
    # a tensor saved for backward, then overwritten by each collective: backward raises, as after torch's
    w = torch.ones(3 * size, requires_grad=True)
    versions = []
    for write in (lambda t: gradsync.all_gather(t, t[3 * rank:3 * rank + 3]),
                  lambda t: gradsync.all_gather(t, shard),
                  lambda t: gradsync.all_reduce(t, codec="fp16"),
                  lambda t: gradsync.all_reduce(t, residual=residual),
                  lambda t: gradsync.reduce_scatter(t[:3], torch.ones(3 * size))):
        saved, residual = torch.rand(3 * size), torch.zeros(3 * size)
        y, before = (w * saved).sum(), (saved._version, residual._version)
        write(saved)
        versions.append((saved._version > before[0], residual._version - before[1]))
        try:
            y.backward()
            versions.append("backward used the overwritten tensor")
        except RuntimeError as e:
            versions.append("modified by an inplace operation" in str(e))
    seen["versions"] = versions
    refusals = []
    for kind in ("requires grad", "inference"):
        out = torch.empty(3 * size)
        try:
            if rank == 0 and kind == "requires grad":
                gradsync.all_gather(out.requires_grad_(), shard)
            elif rank == 0:
                with torch.inference_mode():
                    frozen = torch.empty(3 * size)
                gradsync.all_gather(frozen, shard)
            else:
                gradsync.all_gather(out, shard)
            refusals.append("no error")
        except ValueError as e:
            refusals.append(str(e))
    in_step = torch.empty(3 * size)
    gradsync.all_gather(in_step, shard)
    seen["refusals"], seen["in step"] = refusals, in_step.tolist()
    return seen


def test_the_collectives_write_as_torchs_in_place_collectives_do(worlds):
    results = worlds(2).run(autograd_cases)
    gathered = [1.0] * 3 + [2.0] * 3
    for rank, seen in enumerate(results):
        assert seen["parameter"] == (gathered, True) and seen["inference"] == gathered, seen
        assert seen["tracked input"] == (False, None, False, gathered), seen
        bumped = [(True, 0), True] * 3 + [(True, 1), True, (True, 0), True]
        assert seen["versions"] == bumped, seen["versions"]
        assert seen["in step"] == gathered, seen
        if rank == 0:
            assert seen["refusals"] == [
                "output requires grad, and gradsync's kernels are not differentiable: write into it under "
                "torch.no_grad() (or pass its .detach())",
                "output is an inference tensor, which can be written only inside torch.inference_mode()"], seen
        else:
            assert all("rank(s) 0 could not prepare the call" in r for r in seen["refusals"]), seen["refusals"]


def into_views_made_under_no_grad(rank, size):
    """Gathers into a view of a Parameter made under no_grad (a flat view of a weight), as into the
    Parameter itself; then a call in step."""
    weight = torch.nn.Parameter(torch.zeros(size, 3))
    with torch.no_grad():
        flat = weight.view(-1)
        gradsync.all_gather(flat, torch.full((3,), float(rank + 1)))
        rows = weight[rank:]  # this rank's own chunk is the input: nothing to copy
        gradsync.all_gather(weight.view(-1), rows[0].clone())
    after = torch.empty(3 * size)
    gradsync.all_gather(after, torch.ones(3))
    return weight.detach().flatten().tolist(), after.tolist()


def test_all_gather_writes_into_a_view_made_under_no_grad(worlds):
    # the copy of the rank's own input ran on gradsync's thread, where grad mode is on: it raised, and
    # the group's ring was unusable from then on
    for gathered, after in worlds(2).run(into_views_made_under_no_grad):
        assert gathered == [1.0] * 3 + [2.0] * 3 and after == [1.0] * 6


def waited_in_another_groups_callback(rank, size):
    """A synchronous call in a callback on another group's thread is refused where the group has an
    engine (calls of two groups may wait for each other, as hierarchical_average's do); the peer
    raises too, naming rank 0."""
    other, seen = dist.new_group(list(range(size))), []
    gradsync.all_gather(torch.empty(2 * size), torch.ones(2), group=other)  # its engine, with nothing queued now
    in_a_callback_on_rank_0(rank, seen, lambda: gradsync.all_gather(torch.empty(2 * size), torch.ones(2), group=other))
    if rank == 1:
        try:  # pairs with rank 0's refused call, which took its turn
            gradsync.all_gather(torch.empty(2 * size), torch.ones(2), group=other)
            seen.append("no error")
        except ValueError as e:
            seen.append(str(e))
    out = torch.empty(2 * size)
    gradsync.all_gather(out, torch.ones(2), group=other)  # in step
    return seen, out.tolist()


def test_a_call_waited_for_in_another_groups_callback_is_refused(worlds):
    for rank, (seen, out) in enumerate(worlds(2).run(waited_in_another_groups_callback)):
        words = "communication thread of another group" if rank == 0 else "0 could not prepare the call"
        assert len(seen) == 1 and words in seen[0], seen
        assert out == [1.0] * 4


def gather_cuda_matches_cpu(rank, size):
    """CUDA tensors (over gloo, through pinned host memory) against CPU ones: the same bits."""
    torch.cuda.set_device(0)  # all ranks share one GPU
    same, chunk = {}, 33337
    for codec in gradsync.CODECS:
        for dtype_name, dtype in DTYPES.items():
            x = rank_input(rank, chunk, dtype, seed=41)
            on_cpu = torch.empty(chunk * size, dtype=dtype)
            on_gpu = torch.empty(chunk * size, dtype=dtype, device="cuda")
            gradsync.all_gather(on_cpu, x, codec=codec)
            gradsync.all_gather(on_gpu, x.cuda(), codec=codec)
            same[(codec, dtype_name)] = same_bits_up_to_nan_payload(on_gpu, on_cpu)
    return same


@pytest.mark.cuda
@pytest.mark.parametrize("size", [1, 3])
def test_all_gather_on_one_gpu_matches_the_cpu_ring_bitwise(worlds, size):
    for same in worlds(size).run(gather_cuda_matches_cpu):
        assert all(same.values()), [case for case, ok in same.items() if not ok]


def nccl_gather_of_one(rank, size):
    """At world size one the output is the input through the codec, on gradsync's NCCL communicator."""
    same = {}
    for codec in gradsync.CODECS:
        x = rank_input(rank, 100003, torch.float32, seed=42)
        out = torch.empty(x.numel(), device="cuda")
        gradsync.all_gather(out, x.cuda(), codec=codec)
        same[codec] = same_bits_up_to_nan_payload(out, round_trip(x, codec))
    same["nccl"] = gradsync.distributed._engines[dist.distributed_c10d._get_default_group()].nccl_device == 0
    return same


@pytest.mark.cuda
def test_all_gather_over_nccl_at_world_size_one():
    world = World(1, backend="nccl")
    try:
        same = world.run(nccl_gather_of_one)[0]
    finally:
        world.close()
    assert all(same.values()), [case for case, ok in same.items() if not ok]
