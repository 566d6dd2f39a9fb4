"""The kernels as torch operators: their schemas and fake implementations (torch.library.opcheck),
and the public functions inside torch.compile, bit for bit against eager."""
import contextlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync import hooks
from conftest import same_bits

KERNELS = torch.ops.gradsync
FP8_IDS = {codec: gradsync.ops._CODEC_IDS[codec] for codec in ("fp8_e4m3", "fp8_e5m2")}  # the operators' codec ids


def mixed_list(g):
    """Fresh random gradients of every float dtype, a strided view and an empty tensor among them."""
    return [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).half(), torch.randn(0, 4, generator=g),
            torch.randn(6, 4, generator=g).bfloat16().t(), torch.randn(300, generator=g)]


def opcheck(op, args):
    # every check but autograd's registration, which holds for differentiable operators only
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_operator_schemas_and_fake_implementations():
    g = torch.Generator().manual_seed(11)
    tensors = mixed_list(g)
    numel = sum(t.numel() for t in tensors)
    for dtype in (torch.float32, torch.bfloat16):
        opcheck(KERNELS.flatten_into.default, (tensors, torch.empty(numel + 3, dtype=dtype), 0.25))
    opcheck(KERNELS.unflatten_from.default, (torch.randn(numel + 3, generator=g), mixed_list(g), 3.0))
    x = torch.randn(300, generator=g)
    payload = gradsync.compress(x, "fp8_e4m3")
    for codec, codec_id in FP8_IDS.items():
        opcheck(KERNELS.fp8_encode.default, (x, torch.empty_like(payload), codec_id, 0.5))
        opcheck(KERNELS.fp8_decode.default, (gradsync.compress(x, codec), torch.empty(300).bfloat16(), codec_id, 2.0))


def test_the_operators_write_what_they_are_given_and_return_nothing():
    g = torch.Generator().manual_seed(12)
    tensors = mixed_list(g)
    out = torch.empty(sum(t.numel() for t in tensors))
    assert KERNELS.flatten_into(tensors, out, 1.0) is None
    assert same_bits(out, gradsync.flatten(tensors, dtype=torch.float32))
    meta = torch.empty(10, device="meta")  # fake tensors' shapes only: nothing is read or written
    assert KERNELS.flatten_into([meta], meta, 1.0) is None


@pytest.mark.parametrize("op", ["flatten_into", "unflatten_from", "fp8_encode", "fp8_decode"])
def test_the_operators_keep_autograds_books_as_in_place_ops_do(op):
    # called directly, as well as through gradsync's functions: before, a write neither bumped the
    # version of what it wrote (a tensor saved for backward and then overwritten gave a wrong
    # gradient, silently) nor refused a leaf that requires grad
    def call(target, scale=1.0):
        x = torch.randn(300)
        args = {"flatten_into": ([x], target, scale), "unflatten_from": (x, [target], scale),
                "fp8_encode": (x, target, FP8_IDS["fp8_e4m3"], scale),
                "fp8_decode": (gradsync.compress(x, "fp8_e4m3"), target, FP8_IDS["fp8_e4m3"], scale)}[op]
        getattr(KERNELS, op)(*args)

    shape = gradsync.compress(torch.randn(300), "fp8_e4m3").shape if op == "fp8_encode" else (300,)
    dtype = torch.uint8 if op == "fp8_encode" else torch.float32
    target = torch.zeros(shape, dtype=dtype)
    call(target)
    assert target._version == 1
    if op != "fp8_encode":  # a float target: saved for backward, overwritten, and backward refuses
        a = torch.rand(300, requires_grad=True)
        b = a * 1
        loss = (b * b).sum()  # saves b
        with torch.no_grad():
            call(b)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        leaf = torch.zeros(300, requires_grad=True)
        with pytest.raises(ValueError, match=f"gradsync::{op}: .* requires grad, and gradsync's kernels are not "
                                               "differentiable"):
            call(leaf)
        with torch.no_grad():
            call(leaf, 2.0)
        assert leaf._version == 1 and leaf.requires_grad
    with torch.inference_mode():
        call(torch.zeros(shape, dtype=dtype))  # no versions there


def test_eager_use_leaves_torch_compile_unloaded(tmp_path):
    # torch._dynamo takes about a second to import, and gradsync's eager calls never need it
    code = ("import sys, torch, gradsync\n"
            "gradsync.decompress(gradsync.compress(torch.randn(300), 'fp8_e4m3'), 'fp8_e4m3', 300)\n"
            "print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_only_the_multi_tensor_operators_are_kept_out_of_cuda_graphs():
    # their CUDA path copies a table from host memory, which a CUDA graph cannot capture
    for op in (KERNELS.flatten_into, KERNELS.unflatten_from):
        assert torch.Tag.cudagraph_unsafe in op.default.tags
    for op in (KERNELS.fp8_encode, KERNELS.fp8_decode):
        assert torch.Tag.cudagraph_unsafe not in op.default.tags


def sync_round_trip(grads, codec):
    """What a compressed gradient exchange does to this rank's gradients, without the exchange: flatten
    and average over 4, encode, decode, write back."""
    flat = gradsync.flatten(grads, scale=0.25)  # promoted: float32
    payload = gradsync.compress(flat, codec)
    restored = gradsync.decompress(payload, codec, flat.numel(), scale=4.0)
    gradsync.unflatten(restored, grads)
    return payload


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_functions_match_eager_bit_for_bit(backend):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(13)
    compiled = torch.compile(sync_round_trip, backend=backend, fullgraph=True)
    for codec in gradsync.CODECS:
        grads = mixed_list(g)
        eager_grads = [t.clone() for t in grads]
        payload = compiled(grads, codec)
        assert same_bits(payload, sync_round_trip(eager_grads, codec)), codec
        for a, b in zip(grads, eager_grads):  # the graph's inputs were written in place
            assert same_bits(a, b), codec


def test_compiled_out_arguments_write_the_callers_tensors():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(14)
    tensors = mixed_list(g)
    numel = sum(t.numel() for t in tensors)

    @torch.compile(backend="aot_eager", fullgraph=True, dynamic=True)
    def pack(tensors, flat, payload):
        gradsync.flatten(tensors, scale=0.5, out=flat)
        gradsync.compress(flat, "fp8_e5m2", out=payload)

    for extra in (0, 129):  # a second size, traced once with dynamic shapes
        tensors.append(torch.randn(extra, generator=g))
        numel += extra
        flat = torch.empty(numel)
        payload = torch.empty(gradsync.payload_nbytes("fp8_e5m2", numel), dtype=torch.uint8)
        pack(tensors, flat, payload)
        assert same_bits(flat, gradsync.flatten(tensors, dtype=torch.float32, scale=0.5))
        assert same_bits(payload, gradsync.compress(flat, "fp8_e5m2"))


def test_fresh_outputs_of_a_traced_frame_are_copied_back_where_the_copy_runs_eagerly(monkeypatch):
    """Where a compiled function's copy back runs eagerly (a resume frame Dynamo skips), the tensors
    written under tracing still reach the caller's."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(16)
    tensors = mixed_list(g)
    flat = torch.randn(sum(t.numel() for t in tensors), generator=g)
    monkeypatch.setattr(gradsync.ops, "_copy_back", torch.compiler.disable(gradsync.ops._copy_back))
    outs = [torch.zeros_like(t) for t in tensors]
    try:
        torch.compile(lambda: gradsync.unflatten(flat, outs, scale=2.0), backend="eager")()
    finally:
        torch._dynamo.reset()
    expected = [torch.zeros_like(t) for t in tensors]
    gradsync.unflatten(flat, expected, scale=2.0)
    assert all(same_bits(out, e) for out, e in zip(outs, expected))


def test_a_scale_computed_in_compiled_code_is_traced_once_not_once_per_value():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(15)
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=count_graphs, fullgraph=True, dynamic=True)
    def average(tensors, tokens, codec):
        flat = gradsync.flatten(tensors, dtype=torch.float32, scale=1.0 / tokens)
        payload = gradsync.compress(flat, codec, scale=2.0 / tokens)
        restored = gradsync.decompress(payload, codec, flat.numel(), scale=tokens / 2.0)
        gradsync.unflatten(restored, tensors, scale=tokens / 3.0)
        return payload

    for codec in ("fp16", "fp8_e4m3"):
        for tokens in range(100, 112):
            tensors = mixed_list(g)
            expected = [t.clone() for t in tensors]
            payload = average(tensors, tokens, codec)
            flat = gradsync.flatten(expected, dtype=torch.float32, scale=1.0 / tokens)
            assert same_bits(payload, gradsync.compress(flat, codec, scale=2.0 / tokens))
            gradsync.unflatten(gradsync.decompress(payload, codec, flat.numel(), scale=tokens / 2.0), expected,
                               scale=tokens / 3.0)
            assert all(same_bits(a, b) for a, b in zip(tensors, expected)), (codec, tokens)
    assert len(graphs) <= 4, f"{len(graphs)} graphs for 2 codecs and 12 scales each"


def test_compiled_integer_scales_round_once_as_in_eager():
    torch._dynamo.reset()
    x = torch.randn(64, generator=torch.Generator().manual_seed(16))
    # beyond int64, and beyond 2^53 where float64 would round first
    for scale in (2**70 + 2**46 + 1, 2**53 + 1, 2**24 + 3, -(2**60 + 2**36 + 1), 3):
        compiled = torch.compile(lambda t, s=scale: gradsync.flatten([t], scale=s), backend="aot_eager", fullgraph=True)
        assert same_bits(compiled(x), gradsync.flatten([x], scale=scale)), scale


def test_compiled_unflatten_into_strided_tensors_with_dynamic_shapes():
    # the overlap check of a strided destination compares its symbolic strides (sorting them failed)
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True, dynamic=True)
    def scatter(flat, a, b):
        gradsync.unflatten(flat, [a, b], scale=2.0)

    g = torch.Generator().manual_seed(15)
    for rows in (4, 6, 9):
        flat = torch.randn(3 * rows + 10, generator=g)
        compiled, eager = [(torch.zeros(rows, 3).t(), torch.zeros(5, 4)[:, ::2]) for _ in range(2)]
        scatter(flat, *compiled)
        gradsync.unflatten(flat, list(eager), scale=2.0)
        assert all(same_bits(c, e) for c, e in zip(compiled, eager)), rows


def read_before_written(buf, payload, out, codec):
    """Values computed from each written tensor before the write, read again after it."""
    y = buf * 2
    gradsync.flatten([y], out=buf)
    z = buf * 3
    gradsync.unflatten(z, [buf])
    w = buf + 1
    gradsync.compress(w, codec, out=payload)
    v = out * 5
    gradsync.decompress(payload, codec, out.numel(), out=out)
    return y + buf, z - buf, w + buf, v + out


@pytest.mark.parametrize("codec", ["none", "fp8_e4m3"])
def test_compiled_writes_come_after_the_reads_made_before_them(codec):
    # Inductor reorders reads made before a custom operator's write of a tensor to after it (y read
    # the new buf); gradsync writes fresh tensors under torch.compile and copies them in
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(15)
    args = [torch.randn(300, generator=g), None, torch.randn(300, generator=g)]
    args[1] = gradsync.compress(torch.randn(300, generator=g), codec)
    eager_args = [t.clone() for t in args]
    compiled = torch.compile(read_before_written, backend="inductor", fullgraph=True)
    for got, expected in zip(compiled(*args, codec), read_before_written(*eager_args, codec)):
        assert same_bits(got, expected), codec
    for a, b in zip(args, eager_args):
        assert same_bits(a, b), codec


def test_compiled_calls_resolve_negative_views():
    # eager refuses them (the kernels would drop the sign); torch.compile hands the kernels plain tensors
    torch._dynamo.reset()
    x = torch.randn(300)
    negative = torch._neg_view(x)
    compiled = torch.compile(lambda t: (gradsync.flatten([t]), gradsync.compress(t, "fp8_e4m3")),
                             backend="aot_eager", fullgraph=True)
    flat, payload = compiled(negative)
    assert same_bits(flat, -x) and torch.equal(payload, gradsync.compress(-x, "fp8_e4m3"))


def test_compiled_calls_keep_the_checks_that_need_no_address():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown codec 'fp4'"):
        torch.compile(lambda x: gradsync.compress(x, "fp4"), backend="aot_eager", fullgraph=True)(torch.randn(8))
    with pytest.raises(Exception, match="gradsync takes float32, float16 or bfloat16"):
        torch.compile(lambda x: gradsync.flatten([x]), backend="aot_eager", fullgraph=True)(torch.ones(4, dtype=torch.int32))
    # a scale the trace cannot check: the operator refuses what float32 cannot hold
    with pytest.raises(Exception, match="scale must be finite in float32"):
        torch.compile(lambda x, s: gradsync.compress(x, "fp16", scale=s), backend="aot_eager", fullgraph=True)(
            torch.randn(8), 1e39)
    for scale in (10**400, -(2**128)):  # an integer beyond float32's range, as eager refuses it
        with pytest.raises(Exception, match="scale must be finite in float32"):
            torch.compile(lambda x, s=scale: gradsync.flatten([x], scale=s), backend="aot_eager", fullgraph=True)(
                torch.randn(8))
    overlapping = torch.zeros(16).as_strided((4, 4), (2, 1))  # elements that share addresses
    with pytest.raises(Exception, match="cannot be checked under torch.compile"):
        torch.compile(lambda f, t: gradsync.unflatten(f, [t]), backend="aot_eager", fullgraph=True)(torch.randn(16),
                                                                                                   overlapping)


def compiled_around_gradsync(counters):
    """Whether torch.compile compiled every frame whole and broke its graphs only where gradsync
    leaves a call out of them (torch.compiler.disable), never inside gradsync's own code: its locks,
    engine and helpers would break the graphs again and again."""
    return counters["frames"]["ok"] == counters["frames"]["total"] > 0 and \
        all("torch.compiler.disable" in reason or "function `disable`" in reason or "runs eagerly, between compiled "
            "graphs" in reason for reason in counters["graph_break"])


def fullgraph_collectives(rank, size):
    """A collective in a compiled function that must be one graph: the error names gradsync's call."""
    singles = [dist.new_group([r]) for r in range(size)]  # every rank makes every group
    for call in (lambda x: gradsync.all_reduce(x), lambda x: gradsync.all_gather(torch.empty(2 * size), x),
                 lambda x: hooks.hierarchical_average(x, dist.group.WORLD, singles[rank], "none").wait()):
        with pytest.raises(Exception, match="gradsync: (all_reduce|all_gather|hierarchical_average) runs eagerly, "
                                            "between compiled graphs"):
            torch.compile(lambda x: call(x * 2), backend="aot_eager", fullgraph=True)(torch.ones(2))
    return True


def test_collectives_under_fullgraph_raise_naming_gradsync(worlds):
    torch._dynamo.reset()
    assert all(worlds(2).run(fullgraph_collectives))


def compiled_collectives(rank, size):
    """A compiled step that calls the collectives: they run eagerly between the graphs, with the same
    bits as the same step uncompiled."""
    def step(x, codec):
        y = x * 3
        gradsync.all_reduce(y, codec=codec)
        shard = torch.empty(y.numel() // size)
        gradsync.reduce_scatter(shard, y + 1, op="sum", codec=codec)
        return shard - 1

    from torch._dynamo.utils import counters
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager")
    g = torch.Generator().manual_seed(rank)
    for codec in ("none", "fp8_e4m3"):
        x = torch.randn(1000 * size, generator=g)
        assert same_bits(compiled(x, codec), step(x, codec)), codec
    assert counters["graph_break"] and compiled_around_gradsync(counters)
    return True


def test_compiled_code_may_call_the_collectives(worlds):
    torch._dynamo.reset()
    assert all(worlds(2).run(compiled_collectives))


class PartlyUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                        torch.nn.Linear(32, 4))
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


def compiled_data_parallel(rank, size):
    """torch.compile(DataParallel(net)), as users compile DDP: the module compiled, the wrapper's
    bookkeeping (buffer broadcasts, the walk for unused parameters, the buckets' hooks) eager around
    it; the same parameters and buffers as uncompiled, over a no_sync() step."""
    from torch._dynamo.utils import counters
    states = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        net = PartlyUsed()
        model = gradsync.DataParallel(net, codec="fp16", bucket_cap_mb=0.002, find_unused_parameters=True,
                                      gradient_as_bucket_view=True)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for step in range(4):
            with model.no_sync() if step == 1 else contextlib.nullcontext():
                run(torch.randn(8, 16, generator=g)).square().mean().backward()
            if step != 1:
                opt.step()
                opt.zero_grad()
        states.append([t.detach().clone() for t in net.state_dict().values()])
    assert all(same_bits(a, b) for a, b in zip(*states))
    assert compiled_around_gradsync(counters)
    return True


def test_a_compiled_data_parallel_trains_as_the_uncompiled_one(worlds):
    assert all(worlds(2).run(compiled_data_parallel))


def refused_under_compiled_autograd(rank, size):
    """Compiled autograd would trace the gradient hooks into its backward graph, which cannot hold
    gradsync's thread nor the step's end callback: every rank refuses it in its first hook, before
    anything is sent, and the wrapper then averages an eager backward as usual."""
    from torch._dynamo import compiled_autograd
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = gradsync.DataParallel(net, codec="none")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss = model(x).square().sum()
        with pytest.raises(RuntimeError, match="does not run under compiled autograd"):
            loss.backward()
    net.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    mine = torch.func.grad(lambda p: torch.func.functional_call(net, p, (x,)).square().sum())(
        {k: v.detach() for k, v in net.named_parameters()})
    for name, p in net.named_parameters():
        expected = mine[name].clone()
        dist.all_reduce(expected)
        torch.testing.assert_close(p.grad, expected / size, rtol=1e-6, atol=1e-6)
    return True


def test_compiled_autograd_is_refused_with_a_clear_error(worlds):
    assert all(worlds(2).run(refused_under_compiled_autograd))


def bucket_by_bucket(rank, size):
    """Dynamo's DDPOptimizer splits a compiled forward under the wrapper at bucket boundaries, as it
    does DDP's, so that buckets go out while the compiled backward still runs: for
    torch.compile(DataParallel(net)) and for DataParallel(torch.compile(net)); the same bits as
    uncompiled."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    events = []

    def backward_compiler(gm, example_inputs):
        run = make_boxed_func(gm.forward)

        def logged(args):
            events.append("backward")
            return run(args)
        logged._boxed_call = True
        return logged

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward_compiler)
    issue = gradsync.data_parallel._issue

    def logged_issue(*args):
        events.append("bucket")
        return issue(*args)

    gradsync.data_parallel._issue = logged_issue
    states = []
    try:
        for how in ("eager", "wrapper compiled", "module compiled"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])  # 2 MiB
            inner = torch.compile(net, backend=backend) if how == "module compiled" else net
            # fp32 on the wire: the compiled backward delivers gradients in another order, which the
            # buckets follow from the second step on, and a 16-bit wire rounds by position (which rank
            # owns an element's chunk)
            model = gradsync.DataParallel(inner, codec="none", bucket_cap_mb=1)
            run = torch.compile(model, backend=backend) if how == "wrapper compiled" else model
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(rank)
            for _ in range(2):
                events.clear()
                run(torch.randn(8, 256, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if how != "eager":
                    last_backward = max(i for i, event in enumerate(events) if event == "backward")
                    assert events.index("bucket") < last_backward, (how, events)
            states.append([p.detach().clone() for p in net.parameters()])
    finally:
        gradsync.data_parallel._issue = issue
    assert all(same_bits(a, b) for a, b in zip(states[0], states[1])), "wrapper compiled"
    assert all(same_bits(a, b) for a, b in zip(states[0], states[2])), "module compiled"
    # the hint Dynamo reads is there during the wrapped forward only, also after one that raised
    from torch.nn.parallel import DistributedDataParallel as DDP
    assert DDP._active_ddp_module is None
    model = gradsync.DataParallel(torch.nn.Linear(4, 4))
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 3))
    assert DDP._active_ddp_module is None
    model(torch.randn(2, 4))
    assert DDP._active_ddp_module is None
    return True


def test_a_compiled_data_parallel_sends_buckets_while_its_backward_runs(worlds):
    assert all(worlds(2).run(bucket_by_bucket))


class TwoLayers(torch.nn.Module):
    """A model of the user's own class: Dynamo skips the frames of torch's modules (nn.Sequential) once
    DDP's forward, which it cannot trace whole, has broken the graph."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def compiled_ddp_with_a_hook(rank, size):
    """torch.compile(DDP(net)) with gradsync's fp8 hook and error feedback: DDP's reducer calls the
    hook as it does uncompiled, with the same bits."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    graphs = []

    def counting_aot_eager(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    states = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = TwoLayers()
        model = DDP(net)
        model.register_comm_hook(gradsync.hooks.GradSyncState(error_feedback=True), gradsync.hooks.fp8_compress_hook)
        run = torch.compile(model, backend=counting_aot_eager) if compiled else model
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            run(torch.randn(8, 16, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        states.append([p.detach().clone() for p in net.parameters()])
    assert graphs, "nothing was compiled"
    assert all(same_bits(a, b) for a, b in zip(*states))
    return True


def test_the_hooks_under_a_compiled_ddp(worlds):
    assert all(worlds(2).run(compiled_ddp_with_a_hook))


def compiled_fsdp_blocks(rank, size):
    """FSDP2 with each block compiled (`block.compile()`, as FSDP2's users do) and gradsync's bf16
    reduce-scatter: the same parameters as with the blocks uncompiled."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync import fsdp
    from test_reduce_scatter import Mlp

    mesh = init_device_mesh("cpu", (size,))
    params = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Mlp()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
            if compiled:
                layer.compile(backend="aot_eager")
        fully_shard(model, mesh=mesh)
        assert fsdp.compress_reduce_scatter(model, "bf16") == 3
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(16, 16, generator=g)
            opt.zero_grad()
            F.mse_loss(model(x), torch.sin(x[:, :1])).backward()
            opt.step()
        params.append(torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()]))
    assert same_bits(*params)
    return True


def test_fsdp2_with_compiled_blocks(worlds):
    assert all(worlds(2).run(compiled_fsdp_blocks))
