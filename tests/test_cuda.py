"""CUDA kernels: bitwise equal to their CPU twins, one launch per multi-tensor call, codec bounds."""
import pytest
import torch

import gradsync
from conftest import FLOAT_DTYPES, float_bits, random_bits_floats, random_floats, same_bits
from test_flatten import gradient_like_list, strided_past_a_chunk

pytestmark = pytest.mark.cuda
CODECS = gradsync.CODECS


def to_cuda(tensors):
    """The same tensors on the device, each with its layout: strides, storage offset, and expanded
    (zero-stride) dimensions, which a copy into them could not write."""
    out = []
    for t in tensors:
        storage = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).cuda()
        out.append(storage.as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.125, 1 / 3])
def test_flatten_matches_cpu_bitwise(dtype, scale):
    cpu = gradient_like_list(7)
    gpu = to_cuda(cpu)
    assert same_bits(gradsync.flatten(gpu, dtype=dtype, scale=scale).cpu(),
                     gradsync.flatten(cpu, dtype=dtype, scale=scale))


@pytest.mark.parametrize("flat_dtype", FLOAT_DTYPES)
def test_unflatten_matches_cpu_bitwise(flat_dtype):
    shapes_dtypes = [((3, 4), torch.float32), ((17,), torch.float16), ((0,), torch.float32), ((5, 7), torch.bfloat16),
                     ((70001,), torch.float32), ((2, 3, 4), torch.float16)]
    cpu = [torch.zeros(s, dtype=d) for s, d in shapes_dtypes]
    cpu.append(torch.zeros(6, 4).t())  # strided target
    n = sum(t.numel() for t in cpu)
    flat = random_floats(n, low_exp=-5, high_exp=5).to(flat_dtype)
    gpu = to_cuda(cpu)
    gradsync.unflatten(flat, cpu, scale=0.7)
    gradsync.unflatten(flat.cuda(), gpu, scale=0.7)
    for a, b in zip(cpu, gpu):
        assert same_bits(a, b.cpu())


def test_strided_tensors_past_a_chunk_match_cpu_bitwise():
    cpu = strided_past_a_chunk(torch.Generator().manual_seed(6))
    gpu = to_cuda(cpu)
    for dtype in FLOAT_DTYPES:
        assert same_bits(gradsync.flatten(gpu, dtype=dtype, scale=1 / 3).cpu(), gradsync.flatten(cpu, dtype=dtype, scale=1 / 3))
    flat = random_floats(sum(t.numel() for t in cpu), low_exp=-5, high_exp=5)
    gradsync.unflatten(flat, cpu, scale=0.7)
    gradsync.unflatten(flat.cuda(), gpu, scale=0.7)
    for a, b in zip(cpu, gpu):  # the whole storage: what lies between the rows included
        assert same_bits(torch.empty(0, dtype=a.dtype).set_(a.untyped_storage()),
                         torch.empty(0, dtype=b.dtype).set_(b.untyped_storage().cpu()))


def test_misaligned_offsets_take_the_scalar_path_correctly():
    # odd sizes shift every later segment off 16-byte alignment in the flat buffer
    g = torch.Generator().manual_seed(1)
    cpu = [torch.randn(int(n), generator=g) for n in torch.randint(1, 5000, (50,), generator=g)]
    base = torch.randn(10001, device="cuda")
    gpu = to_cuda(cpu) + [base[1:]]  # a tensor whose own start is misaligned
    cpu = cpu + [base[1:].cpu()]
    assert same_bits(gradsync.flatten(gpu, dtype=torch.float16).cpu(), gradsync.flatten(cpu, dtype=torch.float16))


def test_flatten_is_one_kernel_launch_for_many_tensors():
    tensors = [torch.randn(int(n), device="cuda") for n in torch.randint(1, 100000, (300,))]
    out = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float16, device="cuda")
    gradsync.flatten(tensors, out=out)  # warm up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gradsync.flatten(tensors, out=out)
        gradsync.unflatten(out, tensors)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "multi_tensor_copy_kernel" in e.name]
    assert len(kernels) == 2, kernels


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES)
def test_codecs_match_cpu_bitwise(codec, in_dtype):
    x = random_floats(128 * 1000 + 33, low_exp=-20, high_exp=20)
    if in_dtype != torch.float32:
        x = torch.randn(x.numel()).to(in_dtype)
    nans = float_bits(0x7fc00000, 0xffc00000)  # both signs
    x[[5, 9000, 70000, 70001, 128 * 1000 + 7]] = torch.cat([torch.tensor([float("inf"), float("-inf")]), nans,
                                                            nans[1:]]).to(in_dtype)
    cpu_payload = gradsync.compress(x, codec, scale=0.3)
    gpu_payload = gradsync.compress(x.cuda(), codec, scale=0.3)
    finite = torch.isfinite(cpu_payload.float()) if cpu_payload.is_floating_point() else None
    if finite is None:
        assert torch.equal(gpu_payload.cpu(), cpu_payload)
    else:  # NaN payload bits may differ between F16C and CUDA conversions
        assert same_bits(gpu_payload.cpu()[finite], cpu_payload[finite])
        assert torch.equal(torch.isfinite(gpu_payload.cpu().float()), finite)
    for out_dtype in FLOAT_DTYPES:
        a = gradsync.decompress(cpu_payload, codec, x.numel(), dtype=out_dtype, scale=2.0)
        b = gradsync.decompress(cpu_payload.cuda(), codec, x.numel(), dtype=out_dtype, scale=2.0).cpu()
        ok = torch.isfinite(a.float())
        assert same_bits(a[ok], b[ok]) and torch.equal(torch.isfinite(b.float()), ok)


def test_random_bit_patterns_match_cpu():
    x = random_bits_floats(1 << 20)
    for codec in CODECS:
        a = gradsync.compress(x, codec)
        b = gradsync.compress(x.cuda(), codec).cpu()
        if a.is_floating_point():
            ok = torch.isfinite(a.float())
            assert same_bits(a[ok], b[ok]) and torch.equal(torch.isfinite(b.float()), ok), codec
        else:
            assert torch.equal(a, b), codec


@pytest.mark.parametrize("codec", CODECS)
def test_codecs_match_cpu_bitwise_at_edge_sizes(codec):
    # empty, one element, around one fp8 block, and more elements than one pass of the largest grid
    for n in (0, 1, 127, 128, 129, (1 << 22) + 129):
        x = random_floats(n, low_exp=-20, high_exp=20)  # finite, some beyond fp16's range
        a = gradsync.compress(x, codec, scale=0.3)
        b = gradsync.compress(x.cuda(), codec, scale=0.3).cpu()
        assert same_bits(a, b), (codec, n)
        c = gradsync.decompress(a, codec, n, scale=2.0)
        d = gradsync.decompress(a.cuda(), codec, n, scale=2.0).cpu()
        assert same_bits(c, d), (codec, n)


def test_big_buffer_and_current_stream():
    """The ops run on the current stream: on a side stream that sleeps before it writes the input, a
    kernel launched on any other stream would read the zeros there before."""
    src = torch.randn(64 * 2**20 + 5, device="cuda")
    x = torch.zeros_like(src)
    # each call made once before, at this size: a first launch may load its kernel, which can wait for every stream
    gradsync.unflatten(gradsync.flatten([src], dtype=torch.bfloat16, scale=0.5), [torch.empty_like(src)], scale=2.0)
    gradsync.decompress(gradsync.compress(src, "fp8_e4m3"), "fp8_e4m3", src.numel())
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    copied = torch.cuda.Event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000_000)  # clock cycles: about half a second
        x.copy_(src)
        copied.record()
        y = gradsync.flatten([x], dtype=torch.bfloat16, scale=0.5)
        z = gradsync.decompress(gradsync.compress(x, "fp8_e4m3"), "fp8_e4m3", x.numel())
        back = torch.empty_like(x)
        gradsync.unflatten(y, [back], scale=2.0)
    # every launch came before the input was written (the host never waited for the side stream)
    assert not copied.query(), "a launch waited for the stream: the test cannot see a kernel on another one"
    stream.synchronize()
    cpu = src.cpu()
    assert same_bits(y.cpu(), (cpu * 0.5).bfloat16())
    assert same_bits(z.cpu(), gradsync.decompress(gradsync.compress(cpu, "fp8_e4m3"), "fp8_e4m3", cpu.numel()))
    assert same_bits(back.cpu(), (cpu * 0.5).bfloat16().float() * 2.0)


def test_fp8_payload_on_cuda_must_be_aligned_for_its_scales():
    x = torch.randn(300, device="cuda")
    n = gradsync.payload_nbytes("fp8_e4m3", x.numel())
    buf = torch.empty(n + 4, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="out: an fp8 payload on CUDA must start at a 4-byte aligned"):
        gradsync.compress(x, "fp8_e4m3", out=buf[1:1 + n])
    buf[1:1 + n] = gradsync.compress(x, "fp8_e4m3")
    with pytest.raises(ValueError, match="payload: an fp8 payload on CUDA must start at a 4-byte aligned"):
        gradsync.decompress(buf[1:1 + n], "fp8_e4m3", x.numel())
    assert same_bits(gradsync.decompress(buf[1:1 + n].clone(), "fp8_e4m3", x.numel()),
                     gradsync.decompress(gradsync.compress(x, "fp8_e4m3"), "fp8_e4m3", x.numel()))


def test_cuda_bad_input():
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cpu"):
        gradsync.flatten([torch.randn(3, device="cuda"), torch.randn(3)])
    with pytest.raises(ValueError, match="out is on cpu"):
        gradsync.compress(torch.randn(3, device="cuda"), "fp16", out=torch.empty(3, dtype=torch.float16))


def test_operators_and_compiled_functions_on_cuda():
    from test_compile import FP8_IDS, mixed_list, opcheck, sync_round_trip
    g = torch.Generator().manual_seed(15)
    x = torch.randn(300, generator=g).cuda()
    payload = gradsync.compress(x, "fp8_e4m3")
    opcheck(torch.ops.gradsync.flatten_into.default, ([t.cuda() for t in mixed_list(g)], torch.empty(1000, device="cuda"), 0.5))
    opcheck(torch.ops.gradsync.fp8_encode.default, (x, torch.empty_like(payload), FP8_IDS["fp8_e4m3"], 0.5))
    opcheck(torch.ops.gradsync.fp8_decode.default, (payload, torch.empty_like(x), FP8_IDS["fp8_e4m3"], 2.0))
    torch._dynamo.reset()
    compiled = torch.compile(sync_round_trip, backend="aot_eager", fullgraph=True)
    for codec in CODECS:
        grads = [t.cuda() for t in mixed_list(g)]
        eager_grads = [t.clone() for t in grads]
        assert same_bits(compiled(grads, codec).cpu(), sync_round_trip(eager_grads, codec).cpu()), codec
        for a, b in zip(grads, eager_grads):
            assert same_bits(a.cpu(), b.cpu()), codec


def test_cuda_graphs_capture_the_codecs_and_refuse_the_multi_tensor_copies():
    x = torch.randn(5000, device="cuda")
    payload = gradsync.compress(x, "fp8_e4m3")
    decoded = gradsync.decompress(payload, "fp8_e4m3", x.numel())  # both kernels loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gradsync.compress(x, "fp8_e4m3", scale=0.5, out=payload)
        gradsync.decompress(payload, "fp8_e4m3", x.numel(), scale=2.0, out=decoded)
    x.copy_(torch.randn(5000, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    expected = gradsync.compress(x, "fp8_e4m3", scale=0.5)
    assert torch.equal(payload, expected)
    assert same_bits(decoded, gradsync.decompress(expected, "fp8_e4m3", x.numel(), scale=2.0))
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            gradsync.flatten([x], dtype=torch.float16)
    assert same_bits(gradsync.flatten([x], dtype=torch.float16), x.half())  # the device is fine afterwards


def test_a_nccl_hop_is_measured_on_one_gpu():
    device = torch.cuda.current_device()
    rows = gradsync._C._nccl_hop_cost(device, 20, [4096, 65536], 2)
    assert [r["bytes"] for r in rows] == [4096, 4096, 65536, 65536]
    for r in rows:
        assert all(0 < r[k] < 1.0 for k in ("issue_s", "pipelined_s", "alone_s")), r
    assert torch.cuda.current_device() == device
    with pytest.raises(ValueError, match="hops"):
        gradsync._C._nccl_hop_cost(device, 0, [4096])
    with pytest.raises(ValueError, match="sizes"):
        gradsync._C._nccl_hop_cost(device, 10, [4095])
