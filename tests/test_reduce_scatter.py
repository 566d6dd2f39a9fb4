"""gradsync.reduce_scatter on gloo ranks against fp64, and as FSDP2's gradient reduce-scatter."""
import itertools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradsync
from distributed_harness import World
from gradsync.distributed import resolve_scales
from test_allreduce import DTYPES, digest, error_ratio, rank_input, same_bits_up_to_nan_payload


def scatter_cases(rank, size, cases):
    """{case: (error ratio of this rank's chunk, digest)}; each case also in place, into the input's
    own chunk, which must give the same bits, and the input must stay as it was otherwise."""
    out = {}
    for chunk, codec, dtype_name, op in cases:
        dtype = DTYPES[dtype_name]
        inputs = [rank_input(r, chunk * size, dtype, seed=chunk) for r in range(size)]
        x = inputs[rank].clone()
        result = torch.full((chunk,), float("nan"), dtype=dtype)
        gradsync.reduce_scatter(result, x, op=op, codec=codec)
        assert torch.equal(x.view(torch.uint8), inputs[rank].view(torch.uint8)), "input changed"
        mine = slice(rank * chunk, (rank + 1) * chunk)
        gradsync.reduce_scatter(x[mine], x, op=getattr(dist.ReduceOp, op.upper()), codec=codec)
        assert torch.equal(x[mine].view(torch.uint8), result.view(torch.uint8)), "in place differs"
        x[mine] = inputs[rank][mine]
        assert torch.equal(x.view(torch.uint8), inputs[rank].view(torch.uint8)), "in place wrote outside its chunk"
        ratio = error_ratio(result, [i[mine] for i in inputs], codec, op, dtype_name, size, encodes=size - 1)
        out[(chunk, codec, dtype_name, op)] = (ratio, digest(result))
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_reduce_scatter_matches_fp64_for_every_codec_dtype_and_op(worlds, size):
    chunks = [0, 1, 127, 1009, 2**16 + 3]
    cases = [(c, codec, dtype, op) for c in chunks for dtype in DTYPES for codec in gradsync.CODECS
             for op in ("avg", "sum") if c < 2**16 or dtype == "float32"]
    for case, (ratio, _) in ((case, v) for r in worlds(size).run(scatter_cases, cases) for case, v in r.items()):
        assert ratio <= 1.0, f"{case}: error {ratio:.3g} x the bound"


def last_hop_sums(rank, size):
    """Per case, whether this rank's result has exactly the bits of its chunk's sum in fp32, with
    only the peers' hops rounded to the codec: two ranks, so the peer's encoded part plus this
    rank's, scaled and cast to the dtype once; one rank, the input scaled. With error feedback the
    sum takes each rank's residual, and this rank's residual over its own chunk, which it never
    encodes, becomes 0, or for a 16-bit dtype what storing the sum lost (in fp32, bit for bit)."""
    chunk, peer = 3 * 2048 + 77, 1 - rank
    exact = {}
    # the whole factor before the sum, or a postscale too (what the rounding lost is then divided by it)
    for codec, dtype_name, split, feedback in itertools.product(gradsync.CODECS, DTYPES, ("prescale", "both"),
                                                                (False, True)):
        dtype = DTYPES[dtype_name]
        prescale, postscale = resolve_scales("avg", size, prescale=None if split == "prescale" else 3.0)
        xs = [rank_input(r, chunk * size, dtype, seed=21) for r in range(size)]
        res = [rank_input(r, chunk * size, torch.float32, seed=22) * 1e-3 for r in range(size)]
        mine = slice(rank * chunk, (rank + 1) * chunk)
        residual = res[rank].clone() if feedback else None
        out = torch.empty(chunk, dtype=dtype)
        gradsync.reduce_scatter(out, xs[rank], codec=codec, residual=residual, prescale=prescale, postscale=postscale)
        total = xs[rank][mine].float() * prescale
        if size == 2:
            sent = xs[peer][mine].float() * prescale
            if feedback:
                sent = sent + res[peer][mine]
            payload = gradsync.compress(sent.to(dtype) if codec == "none" else sent, codec)  # "none": the dtype
            total = gradsync.decompress(payload, codec, chunk) + total
        if feedback:
            total = total + res[rank][mine]
        expected = (total * postscale).to(dtype)
        ok = same_bits_up_to_nan_payload(out, expected)
        if feedback:
            lost = total - expected.float() / postscale
            lost[~lost.isfinite()] = 0.0
            ok = ok and torch.equal(residual[mine], torch.zeros_like(lost) if dtype_name == "float32" else lost)
        exact[(codec, dtype_name, split, feedback)] = ok
    return exact


@pytest.mark.parametrize("size", [1, 2])
def test_reduce_scatter_rounds_only_the_hops_to_its_peers(worlds, size):
    for exact in worlds(size).run(last_hop_sums):
        assert all(exact.values()), [case for case, ok in exact.items() if not ok]


def in_flight_and_subgroups(rank, size):
    """Two async reduce-scatters and an all-reduce in flight at once, then a subgroup of ranks 1..3."""
    chunk = 5000
    xs = [rank_input(rank, chunk * size, torch.float32, seed=s) for s in range(3)]
    outs = [torch.empty(chunk) for _ in range(2)]
    works = [gradsync.reduce_scatter(outs[i], xs[i], codec="fp16", async_op=True) for i in range(2)]
    reduced = xs[2].clone()
    works.append(gradsync.all_reduce(reduced, codec="none", async_op=True))
    for w in works:
        w.wait()
    refs = [torch.stack([rank_input(r, chunk * size, torch.float32, seed=i) for r in range(size)]).double().mean(0)
            for i in range(3)]
    for i in range(2):
        assert (outs[i].double() - refs[i][rank * chunk:(rank + 1) * chunk]).abs().max() < 1e-2 * refs[i].abs().max()
    assert (reduced.double() - refs[2]).abs().max() < 1e-6 * refs[2].abs().max()  # codec "none": fp32 rounding only
    sub = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    out = torch.empty(7)
    x = torch.arange(21, dtype=torch.float32) * rank
    gradsync.reduce_scatter(out, x, op="sum", group=sub)
    return out.tolist()


def test_reduce_scatter_in_flight_with_others_and_on_a_subgroup(worlds):
    results = worlds(4).run(in_flight_and_subgroups)
    expected = (torch.arange(21, dtype=torch.float32) * 6).view(3, 7)
    for sub_rank, result in enumerate(results[1:]):
        assert result == expected[sub_rank].tolist()


def disagreeing(rank, size):
    out, x = torch.empty(4), torch.randn(4 * size)
    messages = []
    for call in ("numel", "operation", "dtype", "codec"):
        mine_out, mine_x, codec = out, x, "fp16"
        if call == "numel" and rank == 1:
            mine_out, mine_x = torch.empty(5), torch.randn(5 * size)
        elif call == "dtype" and rank == size - 1:
            mine_out, mine_x = out.bfloat16(), x.bfloat16()
        elif call == "codec" and rank == 0:
            codec = "fp8_e4m3"
        mine_out.fill_(7.0)
        start = time.monotonic()
        try:
            if call == "operation" and rank == 1:
                gradsync.all_reduce(torch.randn(4 * size))
            else:
                gradsync.reduce_scatter(mine_out, mine_x, codec=codec)
        except ValueError as e:
            assert time.monotonic() - start < 10, f"{call}: raised after {time.monotonic() - start:.1f} s"
            assert torch.all(mine_out == 7.0), f"{call}: a failed call wrote into the output"
            messages.append(str(e))
            own = "all_reduce" if call == "operation" and rank == 1 else "reduce_scatter"
            assert str(e).startswith(f"gradsync.{own}: the ranks disagree"), str(e)
    gradsync.reduce_scatter(out, x)  # the group is still usable
    return messages


def test_ranks_that_disagree_raise_everywhere(worlds):
    for messages in worlds(3).run(disagreeing):
        assert len(messages) == 4, messages
        numel, operation, dtype, codec = messages
        assert "numel 12" in numel and "numel 15" in numel
        assert "operation all_reduce" in operation and "operation reduce_scatter" in operation
        assert "dtype bfloat16" in dtype and "dtype float32" in dtype
        assert "codec fp8_e4m3" in codec and "codec fp16" in codec


def bad_calls(rank, size):
    x, both = torch.randn(4 * size), torch.zeros(3 + 4 * size)  # both: an output and a residual overlapping it
    cases = [
        (lambda: gradsync.reduce_scatter(torch.empty(3), x), ValueError, f"input must hold {size} chunks"),
        (lambda: gradsync.reduce_scatter(torch.empty(4, dtype=torch.float16), x), ValueError, "one dtype and device"),
        (lambda: gradsync.reduce_scatter(torch.empty(4, dtype=torch.int32), x), TypeError, "output has dtype"),
        (lambda: gradsync.reduce_scatter(x[1:5], x), ValueError, "overlaps input"),
        (lambda: gradsync.reduce_scatter(torch.empty(4), x, codec="fp4"), ValueError, "unknown codec"),
        (lambda: gradsync.reduce_scatter(torch.empty(4), x, residual=torch.zeros(4)), ValueError, "residual"),
        (lambda: gradsync.reduce_scatter(torch.empty(4), x, residual=x), ValueError, "residual shares memory"),
        (lambda: gradsync.reduce_scatter(both[:4], x, residual=both[3:]), ValueError, "residual shares memory"),
        (lambda: gradsync.reduce_scatter(torch.empty(8)[::2], x), ValueError, "output must be contiguous"),
        (lambda: gradsync.reduce_scatter(torch.empty(4), x.to_sparse()), ValueError, "input is a torch.sparse_coo"),
        (lambda: gradsync.reduce_scatter(torch.empty(4), x, async_op=1.5), TypeError, "async_op must be True or False"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
    return True


def test_bad_input_raises_naming_the_argument(worlds):
    assert all(worlds(2).run(bad_calls))


def feedback_steps(rank, size, steps):
    """Max error of the mean over `steps` fp8 reduce-scatters of one input, with and without error
    feedback, relative to the largest reduced value."""
    chunk = 4096
    x = rank_input(rank, chunk * size, torch.float32, seed=7)
    ref = torch.stack([rank_input(r, chunk * size, torch.float32, seed=7) for r in range(size)]).double()
    ref = ref.mean(0)[rank * chunk:(rank + 1) * chunk]
    errors = {}
    for feedback in (False, True):
        residual = torch.zeros(chunk * size) if feedback else None
        total = torch.zeros(chunk, dtype=torch.float64)
        for _ in range(steps):
            out = torch.empty(chunk)
            gradsync.reduce_scatter(out, x, codec="fp8_e4m3", residual=residual)
            total += out.double()
        errors[feedback] = float((total / steps - ref).abs().max() / ref.abs().max())
    return errors


def test_error_feedback_cancels_the_fp8_error_over_steps(worlds):
    for errors in worlds(3).run(feedback_steps, 16):
        assert errors[True] < errors[False] / 4, errors


def scatter_cuda_matches_cpu(rank, size):
    """CUDA tensors (over gloo, through pinned host memory) against CPU ones: the same plan and twin
    kernels, so the same bits; a chunk that is no multiple of the fp8 block, and error feedback."""
    torch.cuda.set_device(0)  # all ranks share one GPU
    same, chunk = {}, 33337
    for codec in gradsync.CODECS:
        for dtype_name, dtype in DTYPES.items():
            x = rank_input(rank, chunk * size, dtype, seed=11)
            on_cpu, on_gpu = torch.empty(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype, device="cuda")
            gradsync.reduce_scatter(on_cpu, x, codec=codec)
            gradsync.reduce_scatter(on_gpu, x.cuda(), codec=codec)
            same[(codec, dtype_name)] = same_bits_up_to_nan_payload(on_gpu, on_cpu)
        # a 16-bit output's rounding goes into the residual, divided by the postscale
        for dtype, prescale in itertools.product(DTYPES.values(), (None, 3.0)):
            x = rank_input(rank, chunk * size, dtype, seed=12)
            residual = rank_input(rank, x.numel(), torch.float32, seed=13) * 1e-3
            cpu_residual, gpu_residual = residual.clone(), residual.cuda()
            on_cpu, on_gpu = torch.empty(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype, device="cuda")
            gradsync.reduce_scatter(on_cpu, x, codec=codec, residual=cpu_residual, prescale=prescale)
            gradsync.reduce_scatter(on_gpu, x.cuda(), codec=codec, residual=gpu_residual, prescale=prescale)
            same[(codec, "feedback", str(dtype), prescale)] = (
                same_bits_up_to_nan_payload(on_gpu, on_cpu) and same_bits_up_to_nan_payload(gpu_residual, cpu_residual))
    return same


@pytest.mark.cuda
@pytest.mark.parametrize("size", [1, 3])
def test_reduce_scatter_on_one_gpu_matches_the_cpu_ring_bitwise(worlds, size):
    for same in worlds(size).run(scatter_cuda_matches_cpu):
        assert all(same.values()), [case for case, ok in same.items() if not ok]


def nccl_scatter_of_one(rank, size):
    """At world size one nothing goes on a wire, so the result is the input, and a residual is paid
    in whole."""
    same = {}
    for codec in gradsync.CODECS:
        x = rank_input(rank, 100003, torch.float32, seed=14)
        out = torch.empty(x.numel(), device="cuda")
        gradsync.reduce_scatter(out, x.cuda(), codec=codec)
        same[codec] = torch.equal(out.cpu().view(torch.uint8), x.view(torch.uint8))
        residual = torch.full_like(x, 0.25).cuda()
        gradsync.reduce_scatter(out, x.cuda(), codec=codec, residual=residual)
        same[codec + "+ef"] = torch.equal(out.cpu(), x + 0.25) and not residual.any()
    same["nccl"] = gradsync.distributed._engines[dist.distributed_c10d._get_default_group()].nccl_device == 0
    return same


@pytest.mark.cuda
def test_reduce_scatter_over_nccl_at_world_size_one():
    world = World(1, backend="nccl")
    try:
        same = world.run(nccl_scatter_of_one)[0]
    finally:
        world.close()
    assert all(same.values()), [case for case, ok in same.items() if not ok]


# --- FSDP2 -------------------------------------------------------------------------------------------

class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 37), torch.nn.Linear(37, 64), torch.nn.Linear(64, 1)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def fsdp_train(rank, size, modes, steps, divide_factor=None, lr=0.1, hybrid=False, replica_op="avg"):
    """Per mode, the full parameters after `steps` SGD steps of an FSDP2 model on this rank's batches;
    `divide_factor`: every FSDP module's set_gradient_divide_factor. `hybrid`: two replicas, each
    sharded over half the ranks, and gradsync's modes all-reduce across them with `replica_op` (the
    reduce-scatter stays FSDP2's, but for a divide factor, which gloo cannot apply)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    if hybrid:
        mesh_2d = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
        mesh = mesh_2d["shard"]
    else:
        mesh = init_device_mesh("cpu", (size,))
    out = {}
    for mode in modes:
        torch.manual_seed(0)
        model = Mlp()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if mode != "torch":
            codec, _, ef = mode.partition("+")
            if hybrid:
                replicas = mesh_2d["replicate"].get_group()
                found = fsdp.compress_replica_all_reduce(model, replicas, codec, op=replica_op, error_feedback=bool(ef))
                if divide_factor is not None:  # gloo has no PREMUL_SUM: gradsync reduce-scatters in the pairs too
                    assert fsdp.compress_reduce_scatter(model, "none") == found
            else:
                found = fsdp.compress_reduce_scatter(model, codec, error_feedback=bool(ef))
            assert found == 3  # the layers; the root holds no parameters of its own
        if divide_factor is not None:
            for module in [*model.layers, model]:
                module.set_gradient_divide_factor(divide_factor)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(16, 16, generator=g)
            opt.zero_grad()
            F.mse_loss(model(x), torch.sin(x[:, :1])).backward()
            opt.step()
        out[mode] = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    return out


FSDP_MODES = {"none": 1e-6, "fp16": 1e-4, "bf16": 1e-3, "fp8_e4m3+ef": 5e-3, "fp8_e4m3": 5e-3}  # 5-50x the CPU's


def fsdp2_has_error_feedback():
    """gradsync's FSDP2 hooks keep residuals only where FSDP2 can reduce-scatter every parameter in
    every step (FSDPModule.set_reduce_scatter_unused_params; the FSDP2 of torch 2.12 and earlier lacks it)."""
    from torch.distributed.fsdp import FSDPModule
    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def fsdp2_modes():
    """FSDP_MODES that this torch's FSDP2 runs."""
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    return {mode: bound for mode, bound in FSDP_MODES.items() if "+ef" not in mode or fsdp2_has_error_feedback()}


def skip_without_fsdp2_error_feedback():
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    if not fsdp2_has_error_feedback():
        pytest.skip("this torch's FSDP2 has no FSDPModule.set_reduce_scatter_unused_params, which error feedback needs")


def distances(results, reference):
    """Per mode, the relative distance of rank 0's parameters from `reference`; fp8 with error
    feedback must land nearer than without (CPU: 2.5e-4 against 8e-4)."""
    out = {mode: float((results[0][mode] - reference).norm() / reference.norm()) for mode in results[0]}
    if "fp8_e4m3+ef" in out:
        assert out["fp8_e4m3+ef"] < 0.6 * out["fp8_e4m3"], out
    return out


def test_fsdp2_trains_with_gradsync_reduce_scatters_as_with_its_own(worlds):
    modes = fsdp2_modes()
    results = worlds(3).run(fsdp_train, ["torch", *modes], 8)
    for mode in results[0]:
        assert all(torch.equal(r[mode], results[0][mode]) for r in results), f"{mode}: ranks differ"
    measured = distances(results, results[0]["torch"])
    for mode, tolerance in modes.items():
        assert measured[mode] < tolerance, (mode, measured[mode])


def test_fsdp2_gradient_divide_factor_is_a_premultiplied_sum(worlds):
    """After set_gradient_divide_factor(2n) FSDP2 asks for ReduceOp.PREMUL_SUM(1 / 2n): gradients of
    half the average, so twice the learning rate must give the average's parameters, bit for bit
    (the factors differ by a power of two). torch's own reduce-scatter over gloo has no such op."""
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    modes = ["none", "bf16"]
    halved = worlds(3).run(fsdp_train, modes, 4, 6.0, 0.2)
    averaged = worlds(3).run(fsdp_train, modes, 4)
    for mode in modes:
        assert torch.equal(halved[0][mode], averaged[0][mode]), mode


def test_fsdp2_replicas_all_reduce_through_gradsync(worlds):
    """Hybrid sharding by hand: FSDP2 over each pair of ranks, gradsync's all-reduce (FSDP2's
    all-reduce hook) across the two pairs, against FSDP2 sharded over all four ranks; every rank
    ends with the same parameters."""
    modes = fsdp2_modes()
    reference = worlds(4).run(fsdp_train, ["torch"], 8)[0]["torch"]
    results = worlds(4).run(fsdp_train, list(modes), 8, None, 0.1, True)
    measured = distances(results, reference)
    for mode, tolerance in modes.items():
        assert all(torch.equal(r[mode], results[0][mode]) for r in results), f"{mode}: ranks differ"
        assert measured[mode] < tolerance, (mode, measured[mode])


def test_fsdp2_replicas_sum_after_a_divide_factor_of_every_rank(worlds):
    """As FSDP2's own hybrid sharding: set_gradient_divide_factor(4) divides by every rank in the
    reduce-scatter over each pair (gradsync's, "none"), and op="sum" across the pairs completes the
    average."""
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    reference = worlds(4).run(fsdp_train, ["torch"], 8)[0]["torch"]
    results = worlds(4).run(fsdp_train, ["none", "fp16"], 8, 4.0, 0.1, True, "sum")
    for mode in ("none", "fp16"):
        assert all(torch.equal(r[mode], results[0][mode]) for r in results), f"{mode}: ranks differ"
        distance = float((results[0][mode] - reference).norm() / reference.norm())
        assert distance < FSDP_MODES[mode], (mode, distance)


def fsdp_checks(rank, size):
    """The check_call of every call fsdp.ReduceScatter and ReplicaAllReduce make."""
    from gradsync import fsdp

    calls = []
    real = fsdp._reduce_scatter, fsdp._all_reduce

    def recorded(kind, fn):
        def call(*args, **kwargs):
            calls.append((kind, kwargs["check_call"]))
            return fn(*args, **kwargs)
        return call
    fsdp._reduce_scatter, fsdp._all_reduce = recorded("rs", real[0]), recorded("ar", real[1])
    try:
        group, avg = dist.group.WORLD, dist.ReduceOp.AVG
        scatter, replicas = fsdp.ReduceScatter("fp16"), fsdp.ReplicaAllReduce(group, "fp16")
        x, y = torch.randn(4 * size), torch.randn(8 * size)
        scatter(torch.empty(8), y, group, avg, async_op=True).wait()  # an async call's success is known later
        for _ in range(2):
            scatter(torch.empty(4), x, group, avg)
            scatter(torch.empty(8), y, group, avg)
        separate = dist.new_group(list(range(size)))  # FSDP2's set_separate_reduce_scatter_group
        for _ in range(2):
            scatter(torch.empty(4), x, separate, avg)
        for _ in range(2):
            replicas(torch.randn(5))
    finally:
        fsdp._reduce_scatter, fsdp._all_reduce = real
    return calls


def test_fsdp2_hooks_check_a_layout_until_a_call_of_it_succeeds_and_every_call_once_there_are_several(worlds):
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    expected = [("rs", True), ("rs", True), ("rs", True), ("rs", True), ("rs", True), ("rs", True), ("rs", False),
                ("ar", True), ("ar", False)]
    assert worlds(2).run(fsdp_checks) == [expected, expected]


def hybrid_misuse(rank, size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(Mlp(), mesh=mesh)  # FSDP2's own hybrid sharding
    with pytest.raises(ValueError, match="sharded over a 2-D mesh"):
        fsdp.compress_replica_all_reduce(model, mesh["replicate"].get_group())
    with pytest.raises(ValueError, match="no FSDP2 module"):
        fsdp.compress_replica_all_reduce(torch.nn.Linear(2, 2), mesh["replicate"].get_group())
    with pytest.raises(TypeError, match="compress_reduce_scatter: module must be a torch.nn.Module, got str"):
        fsdp.compress_reduce_scatter("model")
    with pytest.raises(TypeError, match="compress_replica_all_reduce: module must be a torch.nn.Module, got dict"):
        fsdp.compress_replica_all_reduce({}, mesh["replicate"].get_group())
    with pytest.raises(ValueError, match="unknown codec"):
        fsdp.ReplicaAllReduce(mesh["replicate"].get_group(), "int4")
    return True


def test_fsdp2_replica_all_reduce_refuses_what_it_cannot_take(worlds):
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    assert all(worlds(4).run(hybrid_misuse))


class TwoExperts(torch.nn.Module):
    """Two layers of one shape, one of them used per step, as the experts of a mixture."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)

    def forward(self, x, use):
        return self.a(x) + self.b(x) if use == "both" else (self.a if use == "a" else self.b)(x)


def expert_steps(rank, size, switch, hook):
    """b's gradient in a step that uses only b, after one that used only a (with a gradient 10^6
    times larger): (reference, fp8 with error feedback). switch: "forward" uses one of the two;
    "freeze" freezes the other (a fine-tuning schedule). hook: gradsync's reduce-scatter, or its
    all-reduce across replicas (each rank a replica of one shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    mesh = init_device_mesh("cpu", (size,)) if hook == "scatter" else \
        init_device_mesh("cpu", (size, 1), mesh_dim_names=("replicate", "shard"))
    out = []
    for codec in ("none", "fp8_e4m3"):
        torch.manual_seed(0)
        model = fully_shard(TwoExperts(), mesh=mesh if hook == "scatter" else mesh["shard"])
        if hook == "scatter":
            fsdp.compress_reduce_scatter(model, codec, error_feedback=codec != "none")
        else:
            fsdp.compress_replica_all_reduce(model, mesh["replicate"].get_group(), codec,
                                             error_feedback=codec != "none")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        if switch == "freeze":
            model.b.weight.requires_grad_(False)
        model(x, "a" if switch == "forward" else "both").pow(2).sum().mul(1e3).backward()
        model.zero_grad(set_to_none=True)
        if switch == "freeze":
            model.a.weight.requires_grad_(False)
            model.b.weight.requires_grad_(True)
        model(x, "b" if switch == "forward" else "both").pow(2).sum().mul(1e-3).backward()
        grad = model.b.weight.grad
        out.append((grad.full_tensor() if hook == "scatter" else grad.to_local()).clone())
    # a layout checked across the ranks per set of parameters reduced (under error feedback those
    # that require gradients), and a residual per set
    group = model._get_fsdp_state()._fsdp_param_group
    ours = group._reduce_scatter_comm if hook == "scatter" else group._all_reduce_hook
    layouts = list(ours._layouts.values())[0] if hook == "scatter" else ours._layouts
    sets = 2 if switch == "freeze" else 1
    assert len(layouts._seen) == sets and len(ours._residuals) == sets
    return out


@pytest.mark.parametrize("switch, hook", [("forward", "scatter"), ("freeze", "scatter"), ("freeze", "replicas")])
def test_fsdp2_error_feedback_keeps_each_residual_with_its_parameter(worlds, switch, hook):
    # FSDP2 reduce-scatters only the parameters that got a gradient and those not frozen: a's
    # residual, in a layout of b's size, must not be added to b's gradient (it was, 10^4 times b's
    # size: by the forward's choice before the layouts became every parameter, by freezing until
    # they were told by the parameters that require gradients)
    skip_without_fsdp2_error_feedback()
    for reference, got in worlds(2).run(expert_steps, switch, hook):
        assert float((got - reference).norm() / reference.norm()) < 0.1


def changing_divide_factor(rank, size, steps):
    """The mean over `steps` steps of one batch's gradients (times factor / size, the average's
    units) with a divide factor that changes every step, as a token count would, per codec; and
    how many layouts and residuals each module's reduce-scatter kept."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    mesh = init_device_mesh("cpu", (size,))
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(rank))
    means, kept = {}, {}
    for mode in ("none", "fp8_e4m3", "fp8_e4m3+ef"):
        torch.manual_seed(0)
        model = Mlp()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        codec, _, ef = mode.partition("+")
        fsdp.compress_reduce_scatter(model, codec, error_feedback=bool(ef))
        total = 0
        for step in range(steps):
            factor = size * (1.0 + step / 1024)
            for module in [*model.layers, model]:
                module.set_gradient_divide_factor(factor)
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x), torch.sin(x[:, :1])).backward()
            total = total + torch.cat([p.grad.full_tensor().double().flatten() for p in model.parameters()]) * (
                factor / size)
        means[mode] = total / steps
        comms = [layer._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm for layer in model.layers]
        kept[mode] = {(len(layouts._seen), len(c._residuals)) for c in comms for layouts in c._layouts.values()}
    error = {mode: float((means[mode] - means["none"]).norm() / means["none"].norm()) for mode in means}
    return error, kept


def test_fsdp2_divide_factor_changing_every_step_keeps_one_layout_and_residual(worlds):
    # before, the factor was part of a layout: a new layout (checked on every call once there were
    # two) and a new zeroed residual the size of the module's gradients per step, kept for good,
    # and error feedback that never paid anything back (the error of fp8 without it)
    skip_without_fsdp2_error_feedback()
    for error, kept in worlds(2).run(changing_divide_factor, 16):
        assert kept == {"none": {(1, 0)}, "fp8_e4m3": {(1, 0)}, "fp8_e4m3+ef": {(1, 1)}}, kept
        assert error["fp8_e4m3+ef"] < error["fp8_e4m3"] / 4, error  # 12x here


def routed_experts(rank, size, hook):
    """Without error feedback FSDP2 reduce-scatters only the parameters that got a gradient: after a
    step with both experts and one with expert a everywhere, rank 0 routes to a alone and rank 1 to
    b alone, buffers of one size holding different parameters. Each rank's error (or "no error")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    mesh = init_device_mesh("cpu", (size,)) if hook == "scatter" else \
        init_device_mesh("cpu", (size, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fully_shard(TwoExperts(), mesh=mesh if hook == "scatter" else mesh["shard"])
    if hook == "scatter":
        fsdp.compress_reduce_scatter(model, "fp16")
    else:
        fsdp.compress_replica_all_reduce(model, mesh["replicate"].get_group(), "fp16")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for use in ("both", "a", "a" if rank == 0 else "b"):
        model.zero_grad(set_to_none=True)
        try:
            model(x, use).pow(2).sum().backward()
        except ValueError as e:
            return str(e)
    return "no error"


@pytest.mark.parametrize("hook", ["scatter", "replicas"])
def test_fsdp2_ranks_that_reduce_different_parameters_of_one_size_raise(worlds, hook):
    # before, the check compared sizes only: rank 0's a and rank 1's b were averaged into each other
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    for message in worlds(2).run(routed_experts, hook):
        assert "the ranks disagree on the call" in message and "(which tensors the buffer holds" in message, message


def replica_group_misuse(rank, size):
    """compress_replica_all_reduce on 2 replicas of 2 shards, given groups that are not the replicas'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
    errors = []
    for group in (None, mesh["shard"].get_group(), dist.group.WORLD):
        model = fully_shard(Mlp(), mesh=mesh["shard"])
        try:
            fsdp.compress_replica_all_reduce(model, group, "none")
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    model = fully_shard(Mlp(), mesh=mesh["shard"])
    assert fsdp.compress_replica_all_reduce(model, mesh["replicate"].get_group(), "none") == 1
    with pytest.raises(TypeError, match="the replicas' ProcessGroup"):
        fsdp.ReplicaAllReduce(None)
    return errors


def test_fsdp2_replica_all_reduce_refuses_a_group_that_is_not_the_replicas(worlds):
    pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api")
    for none, shard, world in worlds(4).run(replica_group_misuse):
        assert "group must be the replicas' ProcessGroup" in none, none
        for message in (shard, world):
            assert message and "must hold the same shard, one per replica" in message, message


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, both):
        return self.a(x) + (self.b(x) if both else 0)


def fsdp_setup_corners(rank, size):
    """Layouts that depend on the batch; arguments refused before they change anything; error
    feedback's setting given back; a replica group of one rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    model = fully_shard(TwoHeads(), mesh=mesh)
    fsdp.compress_reduce_scatter(model, "bf16")  # without error feedback: b is left out of a step without it
    steps = []
    for both in (True, False, rank == 0):  # two layouts known everywhere, then one on each rank
        model.zero_grad()
        try:
            model(torch.randn(2, 4), both).sum().backward()
            steps.append("ok")
        except (RuntimeError, ValueError) as e:
            steps.append(str(e))

    model = fully_shard(TwoHeads(), mesh=mesh)
    group = model._get_fsdp_state()._fsdp_param_group
    native = group._reduce_scatter_comm
    with pytest.raises(ValueError, match="unknown codec"):
        fsdp.compress_reduce_scatter(model, "fp4", error_feedback=True)
    with pytest.raises(TypeError, match="error_feedback"):
        fsdp.compress_reduce_scatter(model, "bf16", error_feedback="yes")
    assert not group.reduce_scatter_unused_params and group._reduce_scatter_comm is native
    # a float64 model: refused here, naming FSDP2's reduce dtype, rather than at the first backward
    # as an "output" the caller never passed; with reduce_dtype float32 it trains
    from torch.distributed.fsdp import MixedPrecisionPolicy
    wide = fully_shard(TwoHeads().double(), mesh=mesh)
    with pytest.raises(TypeError, match="FSDP2 reduces this module's gradients in torch.float64.*reduce_dtype"):
        fsdp.compress_reduce_scatter(wide, "bf16")
    with pytest.raises(TypeError, match="ReduceScatter: FSDP2 reduces this module's gradients in torch.float64"):
        fsdp.ReduceScatter("bf16")(torch.empty(2, dtype=torch.float64), torch.empty(2 * size, dtype=torch.float64),
                                   dist.group.WORLD, "avg")
    wide = fully_shard(TwoHeads().double(), mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    fsdp.compress_reduce_scatter(wide, "bf16")
    wide(torch.randn(2, 4, dtype=torch.float64), True).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in wide.parameters())
    fsdp.compress_reduce_scatter(model, "bf16", error_feedback=True)
    assert group.reduce_scatter_unused_params
    fsdp.compress_reduce_scatter(model, "bf16")
    assert not group.reduce_scatter_unused_params and not group._reduce_scatter_comm.error_feedback
    model.set_reduce_scatter_unused_params(True)  # the user's own setting stays
    fsdp.compress_reduce_scatter(model, "bf16", error_feedback=True)
    fsdp.compress_reduce_scatter(model, "bf16")
    assert group.reduce_scatter_unused_params

    replicas = init_device_mesh("cpu", (size, 1), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(TwoHeads(), mesh=replicas["shard"])
    group = model._get_fsdp_state()._fsdp_param_group
    fsdp.compress_reduce_scatter(model, "bf16", error_feedback=True)
    fsdp.compress_replica_all_reduce(model, replicas["replicate"].get_group(), "bf16")
    assert group.reduce_scatter_unused_params  # the reduce-scatter's residual still needs it
    fsdp.compress_reduce_scatter(model, "bf16")
    assert not group.reduce_scatter_unused_params
    with pytest.warns(UserWarning, match="the group has one rank, so nothing is all-reduced across replicas"):
        fsdp.compress_replica_all_reduce(model, replicas["shard"].get_group())

    try:  # a per-parameter mesh: the biases on a mesh of their own, a second parameter group
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    except ImportError:
        return steps
    from torch.distributed.tensor import Shard
    own = FSDPMeshInfo(replicas, shard_mesh_dim=1)
    model = torch.nn.Sequential(TwoHeads())
    fully_shard(model[0], mesh=mesh,
                shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), own) if p.ndim == 1 else None)
    fully_shard(model, mesh=mesh)
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in m._get_fsdp_state()._fsdp_param_groups]
    before = [(g.reduce_scatter_unused_params, g._reduce_scatter_comm, g._all_reduce_hook) for g in groups]
    for compress in (lambda: fsdp.compress_reduce_scatter(model, "bf16", error_feedback=True),
                     lambda: fsdp.compress_replica_all_reduce(model, replicas["replicate"].get_group(),
                                                              error_feedback=True)):
        with pytest.raises(ValueError, match="FSDP module '0' has 2 parameter groups"):
            compress()
    assert len(groups) == 2 and before == [(g.reduce_scatter_unused_params, g._reduce_scatter_comm, g._all_reduce_hook)
                                           for g in groups], "a refused call changed the model"
    return steps


def test_fsdp2_setup_corners(worlds):
    skip_without_fsdp2_error_feedback()
    for steps in worlds(2).run(fsdp_setup_corners):
        assert steps[:2] == ["ok", "ok"] and "the ranks disagree on the call" in steps[2], steps


def fsdp_setups_without_a_reduce_dtype(rank, size):
    """Models whose gradients FSDP2 reduces in float64 or not, depending on torch: a float64 model
    under param_dtype=float32 (torch 2.14 and before reduce in float32, later releases bring the
    gradients back to float64 first), and parameters whose grad_dtype differs from their dtype
    (which torch 2.15 reduces in, and earlier releases ignore). Per setup: what the setup's check
    says, and what the first backward does, through gradsync if the check let it, else through a
    reduce-scatter set without the check."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gradsync import fsdp

    outcomes = []
    for dtype, param_dtype, grad_dtype in ((torch.float64, torch.float32, None),
                                           (torch.float32, None, torch.float64),
                                           (torch.float64, None, torch.float32)):
        module = TwoHeads().to(dtype)
        if grad_dtype is not None:
            for p in module.parameters():
                p.grad_dtype = grad_dtype
        model = fully_shard(module, mesh=init_device_mesh("cpu", (size,)),
                            mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
        try:
            fsdp.compress_reduce_scatter(model, "bf16")
            refused = None
        except TypeError as e:
            refused = str(e)
            model.set_custom_reduce_scatter(fsdp.ReduceScatter("bf16"))
        try:
            model(torch.randn(2, 4, dtype=dtype), True).sum().backward()
            outcomes.append((refused, None))
        except TypeError as e:
            outcomes.append((refused, str(e)))
    return outcomes


def test_fsdp2_setup_refuses_what_the_backward_would_reduce_in_float64(worlds):
    for outcomes in worlds(2).run(fsdp_setups_without_a_reduce_dtype):
        for refused, backward in outcomes:
            if refused is None:
                assert backward is None, backward
            else:
                assert "FSDP2 reduces this module's gradients in torch.float64" in refused, refused
                assert backward and "ReduceScatter: FSDP2 reduces this module's gradients in torch.float64" in backward, \
                    (refused, backward)


def fsdp_loaded(rank, size):
    """Parameters after 3 steps from one checkpoint with fp8 error feedback: of a model whose
    residuals two backwards had filled before it loaded the checkpoint in place, of one that loaded
    it with assign=True (new parameters), of one whose layers sit in activation checkpointing's
    wrapper (which renames their state dict keys) that did too, of one that did under torch's
    swap_tensors mode (the parameters keep their objects, the versions start again), of one that ran
    a forward without gradients first (which leaves the root's parameters unsharded), and of a new one."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    mesh = init_device_mesh("cpu", (size,))
    out = []
    cases = [(2, False, ""), (2, True, ""), (2, True, "wrapped"), (2, True, "swap"), (2, False, "eval"), (0, False, "")]
    for warm_steps, assign, how in cases:
        torch.manual_seed(0)
        model = Mlp()
        if how == "wrapped":
            model.layers = torch.nn.ModuleList([checkpoint_wrapper(layer) for layer in model.layers])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        checkpoint = {k: v.detach().clone() for k, v in model.state_dict().items()}
        fsdp.compress_reduce_scatter(model, "fp8_e4m3", error_feedback=True)
        for step in range(warm_steps):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1000 + 100 * step + rank))
            F.mse_loss(model(x), torch.sin(x[:, :1])).backward()
            model.zero_grad()
        if how == "eval":
            with torch.no_grad():
                model(torch.randn(4, 16))
        swapping = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(how == "swap")
        try:
            model.load_state_dict(checkpoint, assign=assign)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swapping)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad()
            F.mse_loss(model(x), torch.sin(x[:, :1])).backward()
            opt.step()
        out.append(torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()]))
    return out


def test_fsdp2_error_feedback_restarts_from_zeros_when_a_checkpoint_is_loaded(worlds):
    skip_without_fsdp2_error_feedback()
    for *loaded, fresh in worlds(2).run(fsdp_loaded):
        for how, params in zip(["in place", "assign=True", "assign=True, wrapped layers", "assign=True, swapped",
                                "in place after a forward without gradients"], loaded):
            assert torch.equal(params, fresh), (how, (params - fresh).abs().max())


class MlpWithLateAndSpare(Mlp):
    """Mlp whose root also holds `late`, used in a step's last micro-batch alone (or, scaled by
    `late_scale`, in every one), and `spare`, used in none."""

    def __init__(self):
        super().__init__()
        self.late, self.spare = torch.nn.Linear(16, 1), torch.nn.Linear(16, 5)

    def forward(self, x, late_scale=1.0):
        out = super().forward(x)
        return out if late_scale is None else out + late_scale * self.late(x)


def fsdp_partial_loads(rank, size):
    """How many residuals the root's and the first layer's reduce-scatters keep after each load (made
    after a forward without gradients), and whether a mark of gradsync's is left on a parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp

    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    model = MlpWithLateAndSpare()
    for layer in model.layers[:-1]:  # the root holds the last layer, `late` and `spare`
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp.compress_reduce_scatter(model, "fp8_e4m3", error_feedback=True)
    comms = [m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm for m in (model, model.layers[0])]
    checkpoint = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kept = []
    for keys, assign in [("layers.0.", True), ("nothing", True), ("bad shape", True), ("late.", True),
                         ("layers.0.", False), ("late.", False), ("layers.0.", True)]:
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(rank))
        F.mse_loss(model(x), torch.sin(x[:, :1])).backward()  # a residual each
        model.zero_grad()
        with torch.no_grad():  # leaves the root's parameters unsharded, until a load or forward reshards them
            model(x)
        if keys == "bad shape":
            with pytest.raises(RuntimeError, match="size mismatch"):
                model.load_state_dict({"late.weight": torch.zeros(3)}, strict=False, assign=True)
        else:
            model.load_state_dict({k: v for k, v in checkpoint.items() if k.startswith(keys)}, strict=False,
                                  assign=assign)
        kept.append([len(c._residuals) for c in comms])
    assert not any("_gradsync_loading" in p.__dict__ for p in model.parameters())
    return kept


def test_fsdp2_a_load_restarts_the_residuals_of_the_modules_whose_parameters_it_writes(worlds):
    """A load of the first layer's parameters restarts its module's residuals, not the root's; one of
    the root's `late` restarts the root's alone; one that writes nothing (no key, or a size
    mismatch) none; with assign=True (new parameters) and in place."""
    skip_without_fsdp2_error_feedback()
    expected = [[1, 0], [1, 1], [1, 1], [0, 1], [1, 0], [0, 1], [1, 0]]
    assert worlds(2).run(fsdp_partial_loads) == [expected, expected]


def fsdp_accumulating(rank, size):
    """Per (policy, setup, mode), the full parameters after 2 steps of 2 micro-batches each, the first
    without gradient sync, under mixed precision: FSDP2 accumulates the first micro-batch's
    gradients in the reduce dtype, while `late` (first used in the last micro-batch) and `spare`
    (reduce-scattered as zeros under error feedback) have theirs in the parameter's. "torch" (the
    reference, FSDP2 over all ranks) uses `late` with a factor 0 in the first micro-batch: the
    same sums, without a parameter whose gradient starts late, which its FSDP2 cannot reduce.
    Setups: gradsync's reduce-scatter over all ranks, or FSDP2's over each pair and gradsync's
    all-reduce across the pairs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gradsync import fsdp

    flat = init_device_mesh("cpu", (size,))
    hybrid = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
    policies = {"param bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "reduce bf16": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}
    out = {}
    setups = [("torch", ["torch"]), ("scatter", ["none", "none+ef"]), ("replicas", ["none", "none+ef"])]
    for (policy_name, policy), (setup, modes) in itertools.product(policies.items(), setups):
        for mode in modes:
            torch.manual_seed(0)
            model = MlpWithLateAndSpare()
            mesh = hybrid["shard"] if setup == "replicas" else flat
            for layer in model.layers[:-1]:  # the root holds the last layer, `late` and `spare`
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            if setup == "scatter":
                fsdp.compress_reduce_scatter(model, "none", error_feedback=mode == "none+ef")
            elif setup == "replicas":
                fsdp.compress_replica_all_reduce(model, hybrid["replicate"].get_group(), "none",
                                                 error_feedback=mode == "none+ef")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2):
                opt.zero_grad()
                for micro in range(2):
                    model.set_requires_gradient_sync(micro == 1)
                    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                    late_scale = 1.0 if micro == 1 else (0.0 if setup == "torch" else None)
                    F.mse_loss(model(x, late_scale).float(), torch.sin(x[:, :1])).backward()
                opt.step()
            out[policy_name, setup, mode] = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    return out


def test_fsdp2_accumulates_mixed_precision_gradients_that_start_late_or_never(worlds):
    """FSDP2 asserts that one post_backward's gradients share a dtype; gradsync's hooks make those
    that start in the last micro-batch, and the zeros of unused parameters that error feedback
    makes it reduce-scatter, accumulate in the reduce dtype as the others do."""
    skip_without_fsdp2_error_feedback()
    results = worlds(4).run(fsdp_accumulating)
    for key in results[0]:
        assert all(torch.equal(r[key], results[0][key]) for r in results), f"{key}: ranks differ"
    for (policy, setup, mode), params in results[0].items():
        reference = results[0][policy, "torch", "torch"]
        distance = float((params - reference).norm() / reference.norm())
        assert distance < (1e-6 if policy == "param bf16" else 1e-3), (policy, setup, mode, distance)  # 0, 1.6e-4 here
