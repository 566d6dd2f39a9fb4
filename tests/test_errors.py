"""Every bad input raises a TypeError/ValueError that names the offending argument."""
import math
import random

import pytest
import torch

import gradsync

x = torch.randn(10)


@pytest.mark.parametrize("call,error,words", [
    (lambda: gradsync.flatten(x), TypeError, "tensors must be a list"),
    (lambda: gradsync.flatten([x, "a"]), TypeError, "tensors[1]"),
    (lambda: gradsync.flatten([x, torch.arange(3)]), TypeError, "tensors[1] has dtype torch.int64"),
    (lambda: gradsync.flatten([x.to(torch.float64)]), TypeError, "tensors[0] has dtype torch.float64"),
    (lambda: gradsync.flatten([x, x.to("meta")]), ValueError, "tensors[1] is on meta"),
    (lambda: gradsync.flatten([x], dtype=torch.int32), TypeError, "dtype must be"),
    (lambda: gradsync.flatten([x], scale="2"), TypeError, "scale must be a real number"),
    (lambda: gradsync.flatten([x], scale=float("inf")), ValueError, "scale must be finite"),
    (lambda: gradsync.flatten([x], scale=1e39), ValueError, "scale must be finite in float32"),
    (lambda: gradsync.compress(x, "fp16", scale=10**400), ValueError, "scale must be finite in float32"),
    (lambda: gradsync.decompress(x.half(), "fp16", 10, scale=-1e39), ValueError, "scale must be finite in float32"),
    (lambda: gradsync.flatten([]), ValueError, "tensors is empty: pass out="),
    (lambda: gradsync.flatten([], dtype=torch.float16), ValueError, "tensors is empty: pass out="),
    (lambda: gradsync.flatten([x], out=torch.empty(9)), ValueError, "out has shape (9,)"),
    (lambda: gradsync.flatten([x], out=torch.empty(2, 5)), ValueError, "out has shape (2, 5)"),
    (lambda: gradsync.flatten([x], dtype=torch.float16, out=torch.empty(10)), ValueError, "out has dtype torch.float32"),
    (lambda: gradsync.flatten([x], out=torch.empty(10, dtype=torch.int32)), TypeError, "out's dtype must be"),
    (lambda: gradsync.flatten([x], out=torch.empty(10, dtype=torch.float64)), TypeError, "out's dtype must be"),
    (lambda: gradsync.flatten([x], out=torch.empty(10, device="meta")), ValueError, "out is on meta"),
    (lambda: gradsync.flatten([x], out=torch.empty(20)[::2]), ValueError, "out must be contiguous"),
    (lambda: gradsync.flatten([x], out=[0.0] * 10), TypeError, "out must be a torch.Tensor"),
    (lambda: gradsync.unflatten(torch.empty(9), [x]), ValueError, "flat has 9 elements but the tensors need 10"),
    (lambda: gradsync.unflatten(torch.empty(10).long(), [x]), TypeError, "flat has dtype torch.int64"),
    (lambda: gradsync.unflatten(torch.empty(2, 5), [x]), ValueError, "flat must be a contiguous 1-D tensor"),
    (lambda: gradsync.unflatten(torch.empty(10), [x.to("meta")]), ValueError, "tensors[0] is on meta"),
    (lambda: gradsync.unflatten(torch.empty(10), [torch.zeros(2, 1).expand(2, 5)]), ValueError, "expanded"),
    (lambda: gradsync.unflatten(torch.empty(10), x), TypeError, "tensors must be a list"),
    (lambda: gradsync.compress(x, "int4"), ValueError, "unknown codec 'int4'"),
    (lambda: gradsync.compress(x.long(), "fp16"), TypeError, "x has dtype torch.int64"),
    (lambda: gradsync.compress([1.0], "fp16"), TypeError, "x must be a torch.Tensor"),
    (lambda: gradsync.compress(x, "fp8_e4m3", scale=None), TypeError, "scale must be a real number"),
    (lambda: gradsync.compress(x, "fp16", out=torch.empty(10)), ValueError, "out has dtype torch.float32, expected torch.float16"),
    (lambda: gradsync.compress(x, "fp8_e4m3", out=torch.empty(21, dtype=torch.uint8)), ValueError, "expected a 1-D tensor of 20"),
    (lambda: gradsync.compress(x, "none", out=torch.empty(10, device="meta")), ValueError, "out is on meta"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "fp16", 11), ValueError, "payload holds 10 elements but numel is 11"),
    (lambda: gradsync.decompress(torch.empty(10), "fp16", 10), ValueError, "a fp16 payload has dtype torch.float16"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "bf16", 10), ValueError, "a bf16 payload has dtype torch.bfloat16"),
    (lambda: gradsync.decompress(torch.empty(10).long(), "none", 10), TypeError, "payload has dtype torch.int64"),
    (lambda: gradsync.decompress(torch.empty(100, dtype=torch.uint8), "fp8_e4m3", 10), ValueError,
     "payload has 100 bytes but a fp8_e4m3 payload of 10 elements has 20"),
    (lambda: gradsync.decompress(torch.empty(20), "fp8_e5m2", 10), ValueError, "a fp8_e5m2 payload has dtype torch.uint8"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "fp16", -1), ValueError, "numel must be >= 0"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "fp16", 10.0), TypeError, "numel must be an int"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "zstd", 10), ValueError, "unknown codec 'zstd'"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "fp16", 10, dtype=torch.int8), TypeError, "dtype must be"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "fp16", 10, out=torch.empty(11)), ValueError, "out has shape (11,)"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "fp16", 10, out=torch.empty(10).half()), ValueError,
     "out has dtype torch.float16, expected torch.float32"),
    (lambda: gradsync.decompress(torch.empty(10).half(), "fp16", 10, out=torch.empty(10, device="meta")), ValueError,
     "out is on meta"),
    (lambda: gradsync.decompress(torch.empty(20).half()[::2], "fp16", 10), ValueError, "payload must be contiguous"),
    (lambda: gradsync.decompress("payload", "fp16", 10), TypeError, "payload must be a torch.Tensor"),
    (lambda: gradsync.payload_nbytes("fp9", 10), ValueError, "unknown codec 'fp9'"),
    (lambda: gradsync.payload_nbytes("fp16", -1), ValueError, "numel must be >= 0"),
    (lambda: gradsync.payload_nbytes("fp8_e4m3", 2.5), TypeError, "numel must be an int"),
    (lambda: gradsync.payload_nbytes("none", 10, torch.int64), TypeError, "dtype must be"),
    # tensors whose data the kernels cannot read (all on one device, so no mismatch is reported first)
    (lambda: gradsync.flatten([x.to("meta")]), ValueError, "tensors[0] is on meta"),
    (lambda: gradsync.flatten([torch.eye(3).to_sparse()]), ValueError, "tensors[0] has layout torch.sparse_coo"),
    (lambda: gradsync.unflatten(torch.empty(10, device="meta"), [x.to("meta")]), ValueError, "flat is on meta"),
    (lambda: gradsync.compress(x.to("meta"), "fp8_e4m3"), ValueError, "x is on meta"),
    (lambda: gradsync.decompress(torch.empty(20, dtype=torch.uint8, device="meta"), "fp8_e4m3", 10), ValueError,
     "payload is on meta"),
])
def test_bad_input_names_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


def _shrunk_views():
    """Views into storages shrunk after the view was made (FSDP frees unsharded parameters so): a
    kernel would read or write past the allocation."""
    def view(numel=64, offset=8):
        base = torch.randn(numel)
        v = base[offset:]
        base.untyped_storage().resize_(16)
        return v

    def freed():
        t = torch.randn(10)
        t.untyped_storage().resize_(0)
        return t
    return [
        (lambda: gradsync.flatten([view()]), r"tensors\[0\] reaches past the end of its storage"),
        (lambda: gradsync.flatten([x], out=view(18, 8)), "out reaches past the end of its storage"),
        (lambda: gradsync.unflatten(torch.zeros(56), [view()]), r"tensors\[0\] reaches past the end of its storage"),
        (lambda: gradsync.compress(view(), "fp8_e4m3"), "x reaches past the end of its storage"),
        (lambda: gradsync.compress(view(), "fp16"), "reaches past the end of its storage"),
        # the storage freed under a tensor of its own: no address left, but not a wrapper subclass
        (lambda: gradsync.flatten([freed()]), r"tensors\[0\] reaches past the end of its storage"),
        (lambda: gradsync.decompress(freed(), "none", 10), "payload reaches past the end of its storage"),
        (lambda: gradsync.flatten([torch.randn(64)[8:]]), None),  # a control: the same view, its storage whole
    ]


@pytest.mark.parametrize("case", range(len(_shrunk_views())))
def test_views_past_the_end_of_a_shrunk_storage_are_refused(case):
    call, words = _shrunk_views()[case]
    if words is None:
        call()
        return
    with pytest.raises(ValueError, match=words):
        call()


def test_scales_round_once_to_float32_as_torch_rounds_them():
    v = torch.tensor([1.0, -3.0, 0.5])
    # 3.4028235e38 is beyond float32's largest value in float64 but rounds to it; an integer past
    # 2^53 rounds once to 24 bits, not to float64 first
    for scale in (3.4028235e38, 2**53 + 2**29 + 1, -(2**60 + 2**36 + 5), 2**24 + 3):
        assert torch.equal(gradsync.flatten([v], scale=scale), v * scale), scale
        assert torch.equal(gradsync.compress(v, "fp16", scale=scale), (v * scale).half()), scale
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        gradsync.flatten([v], scale=3.4028236e38)  # rounds to infinity


def test_the_operators_guard_the_kernels_too():
    from gradsync import _C
    kernels = torch.ops.gradsync
    with pytest.raises(RuntimeError, match="flat buffer holds 5 elements"):
        kernels.flatten_into([x], torch.empty(5), 1.0)
    # expanded views whose elements add up past int64 (before, the count wrapped to a small number,
    # which the buffer passed, and the kernel wrote past it)
    huge = torch.zeros(1).expand(2**62)
    for tail in ([], [torch.ones(8)]):
        with pytest.raises(RuntimeError,
                           match="flat buffer holds 8 elements, fewer than the tensors up to tensors\\[1\\]"):
            kernels.flatten_into([torch.ones(8), huge, huge, huge, huge, *tail], torch.empty(8), 1.0)
        assert _C.plain_numel([huge] * 4 + tail, None, False) == -1
        for out in (None, torch.empty(8)):
            with pytest.raises(ValueError, match=f"tensors hold {2**64 + len(tail) * 8} elements together, more "
                                                 "than a tensor can"):
                gradsync.flatten([huge] * 4 + tail, out=out)
    with pytest.raises(RuntimeError, match="fp8 payload of 10 elements is 20"):
        kernels.fp8_encode(x, torch.empty(3, dtype=torch.uint8), 3, 1.0)
    with pytest.raises(RuntimeError, match="not an fp8 codec id"):
        kernels.fp8_encode(x, torch.empty(32, dtype=torch.uint8), 1, 1.0)
    for scale in (float("inf"), float("nan")):  # what torch.compile traces is checked here only
        with pytest.raises(RuntimeError, match="scale must be finite"):
            kernels.flatten_into([x], torch.empty(10), scale)
        with pytest.raises(RuntimeError, match="scale must be finite"):
            kernels.fp8_decode(torch.zeros(20, dtype=torch.uint8), torch.empty(10), 3, scale)
    rounds_to_inf = 2.0**128 - 2.0**103  # float32's largest value plus half an ulp: the ties go up
    kernels.flatten_into([x], torch.empty(10), math.nextafter(rounds_to_inf, 0))  # rounds to the largest value
    for scale in (rounds_to_inf, -rounds_to_inf, 2.0**200):
        with pytest.raises(RuntimeError, match="scale must be finite"):
            kernels.flatten_into([x], torch.empty(10), scale)
    for scale in (True, 1j):
        with pytest.raises(TypeError, match="scale must be a real number"):
            kernels.fp8_encode(x, torch.empty(20, dtype=torch.uint8), 3, scale)
    with pytest.raises(NotImplementedError, match="SparseCPU"):  # registered for dense CPU and CUDA only
        kernels.flatten_into([x.to_sparse()], torch.empty(10), 1.0)
    with pytest.raises(RuntimeError, match="instruction set 'sse9'"):
        _C.set_cpu_isa("sse9")


def _overlapping_calls():
    a = torch.arange(10.0)
    b = torch.arange(20.0)
    h = torch.arange(10.0).half()
    u8 = torch.zeros(64, dtype=torch.uint8)
    m = torch.zeros(5, 2)
    return [
        (lambda: gradsync.flatten([a[:4], a[4:8]], out=a[2:10]), "tensors[0] shares memory with out"),
        (lambda: gradsync.flatten([a[4:8], a[:4]], out=a[:8]), "tensors[0] shares memory with out"),
        (lambda: gradsync.flatten([a[::2]], out=a[:5]), "tensors[0] shares memory with out"),
        # views of one storage that meet but share no byte, in other dtypes too
        (lambda: gradsync.flatten([a[:2]], dtype=torch.float16, out=a[2:3].view(torch.float16)), None),
        (lambda: gradsync.flatten([a[:2]], dtype=torch.float16, out=a[1:2].view(torch.float16)),
         "tensors[0] shares memory with out"),
        (lambda: gradsync.unflatten(a, [a[1:6]]), "tensors[0] shares memory with flat"),
        (lambda: gradsync.unflatten(h, [h[:5].float()[:0], a[:5]]), None),
        (lambda: gradsync.unflatten(torch.randn(8), [a[:4], a[2:6]]), "tensors[0] and tensors[1] share memory"),
        (lambda: gradsync.unflatten(torch.randn(20), [a, a]), "tensors[0] and tensors[1] share memory"),
        (lambda: gradsync.compress(a[1:], "none", out=a[:9]), "x shares memory with out"),
        (lambda: gradsync.compress(a[:8], "fp8_e4m3", out=a.view(torch.uint8)[:20]),
         "x shares memory with out: the result"),  # a payload and its values never share a dtype: no own segment
        (lambda: gradsync.decompress(h[:5], "fp16", 5, dtype=torch.float16, out=h[5:]), None),
        (lambda: gradsync.decompress(u8[:20], "fp8_e4m3", 10, out=u8[4:44].view(torch.float32)),
         "payload shares memory with out: the result"),
        (lambda: gradsync.decompress(h[:4], "fp16", 4, out=h[:8].view(torch.float32)), "payload shares memory with out"),
        # strided tensors whose address ranges meet are compared element by element
        (lambda: gradsync.unflatten(torch.randn(10), [m[:, 0], m[:, 1]]), None),
        (lambda: gradsync.unflatten(torch.randn(10), [m[:, 1], m.t()[1]]), "tensors[0] and tensors[1] share memory"),
        (lambda: gradsync.unflatten(torch.randn(13), [m[:, :1], m[1:, 1], m[1:, 0]]), "tensors[0] and tensors[2] share"),
        (lambda: gradsync.unflatten(torch.randn(8), [m[:2, 0], m[2:, :].t()]), None),
        (lambda: gradsync.flatten([a[1::4][:2]], out=a[2:4]), None),
        (lambda: gradsync.flatten([a[1::4][:2]], out=a[4:6]), "tensors[0] shares memory with out"),
        (lambda: gradsync.compress(b[0:9:2], "none", out=b[9:14]), None),
        (lambda: gradsync.compress(b[1:10:2], "none", out=b[9:14]), "x shares memory with out"),
        # a destination holding one address twice
        (lambda: gradsync.unflatten(torch.randn(4), [torch.zeros(3).as_strided((2, 2), (1, 1))]),
         "tensors[0] overlaps itself"),
        (lambda: gradsync.unflatten(torch.randn(4), [torch.zeros(5).as_strided((2, 2), (1, 3))]), None),
    ]


@pytest.mark.parametrize("case", range(len(_overlapping_calls())))
def test_partial_overlap_raises_like_torch_cat(case):
    call, words = _overlapping_calls()[case]
    if words is None:
        call()  # memory of its own: no error
        return
    with pytest.raises(ValueError) as info:
        call()
    assert words in str(info.value)


def test_tensors_without_plain_memory_raise():
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"tensors\[0\] is a nested tensor"):
        gradsync.flatten([nested])
    with pytest.raises(ValueError, match=r"tensors\[1\] is a negative view .*resolve_neg"):
        gradsync.unflatten(torch.ones(4), [torch.zeros(2), torch._neg_view(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"x is a negative view"):
        gradsync.compress(torch._neg_view(torch.ones(2)), "fp16")
    assert torch.equal(gradsync.flatten([torch._neg_view(torch.ones(2)).resolve_neg()]), -torch.ones(2))
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    wrapper = two_tensor.TwoTensor(torch.randn(3), torch.randn(3))  # a subclass without storage of its own
    with pytest.raises(ValueError, match=r"tensors\[0\] has no memory of its own"):
        gradsync.flatten([wrapper])
    # a storage of 1,200 bytes, never allocated: torch's dispatch reads it as an expanded zero, whose
    # errors named another cause, and the collectives read address 0
    zero = torch._efficientzerotensor(300)
    payload = torch._efficientzerotensor(316, dtype=torch.uint8)
    for call, name in ((lambda: gradsync.compress(zero, "fp8_e4m3"), "x"),
                       (lambda: gradsync.flatten([zero]), r"tensors\[0\]"),
                       (lambda: gradsync.unflatten(zero, [torch.ones(300)]), "flat"),
                       (lambda: gradsync.unflatten(torch.ones(600), [zero, zero]), r"tensors\[0\]"),
                       (lambda: gradsync.decompress(payload, "fp8_e4m3", 300), "payload"),
                       (lambda: gradsync.decompress(gradsync.compress(torch.ones(300), "fp16"), "fp16", 300, out=zero),
                        "out")):
        with pytest.raises(ValueError, match=name + r" is a ZeroTensor \(torch._efficientzerotensor\)"):
            call()


def test_strided_destinations_that_interleave_are_written_in_one_call(monkeypatch):
    torch.manual_seed(0)
    flat, m = torch.randn(12), torch.zeros(4, 3)
    gradsync.unflatten(flat, [m[:, 0], m[:, 2], m[:, 1]], scale=2.0)
    assert torch.equal(m, torch.stack([flat[:4], flat[8:], flat[4:8]], dim=1) * 2)
    assert torch.equal(gradsync.flatten([m[:, 0], m[:, 2], m[:, 1]], scale=0.5), flat)
    monkeypatch.setattr(gradsync.ops, "_EXACT_CHECK_LIMIT", 7)  # the 8 elements would be compared one by one
    with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] are strided tensors whose address ranges "
                                         "meet, too large \\(8 words\\).*separate calls"):
        gradsync.unflatten(flat, [m[:, 0], m[:, 2]])
    gradsync.unflatten(flat, [m[:, 0], m[:, 2].clone()])


def _random_view(g, storage):
    """One of the tensors a user might pass: a view of ``storage`` (slices, strides, transposes,
    columns, another dtype, an expanded element, odd strides on size-1 dims, layouts that overlap
    themselves) or memory of its own (one requiring grad)."""
    a, r, c = g.randrange(24), g.randrange(1, 4), g.randrange(1, 4)
    return g.choice([
        lambda: storage[a:a + g.randrange(9)],
        lambda: storage[a:a + 12:g.randrange(1, 4)],
        lambda: storage[a:a + r * c].view(r, c).t(),
        lambda: storage[a:a + r * c].view(r, c)[:, g.randrange(c)],
        lambda: storage.view(torch.bfloat16)[2 * a:2 * a + g.randrange(1, 9)],
        lambda: storage[a:a + 1].expand(g.randrange(1, 3)),
        lambda: storage[a:].as_strided((r, 1, c), (c, g.choice([0, 5, 99]), 1)),
        lambda: storage[a:].as_strided((r, c), (g.randrange(4), g.randrange(1, 3))),
        lambda: torch.randn(g.randrange(4), generator=torch.Generator().manual_seed(a)),
        lambda: torch.randn(3, generator=torch.Generator().manual_seed(a)).requires_grad_(),
    ])()


def _call(seed):
    """(the error, or None, and every tensor's bits afterwards) of a random flatten/unflatten."""
    g = random.Random(seed)
    storage = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    tensors = [_random_view(g, storage) for _ in range(g.randrange(1, 7))]
    numel = sum(t.numel() for t in tensors) + g.choice([0, 0, 3])  # unflatten ignores a longer flat's tail
    dtype = g.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    a = g.randrange(64 - numel) if numel < 64 else 0
    buf = storage[a:a + numel] if g.random() < 0.5 and numel < 64 else torch.arange(numel, dtype=torch.float32)
    buf = buf.view(dtype)[:numel] if dtype != torch.float32 and g.random() < 0.5 else buf.to(dtype)
    written = [storage, buf, *tensors]
    try:
        if g.random() < 0.5:
            n = sum(t.numel() for t in tensors)
            written.append(gradsync.flatten(tensors, out=buf[:n], scale=0.5) if g.random() < 0.7
                           else gradsync.flatten(tensors, dtype=dtype, scale=0.5))
        else:
            gradsync.unflatten(buf, tensors, scale=2.0)
        error = None
    except (ValueError, TypeError) as e:
        error = str(e)
    return error, [torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).view(torch.uint8) for t in written]


def test_the_fast_checks_of_long_lists_agree_with_the_python_checks(monkeypatch):
    fast = [_call(seed) for seed in range(2000)]
    monkeypatch.setattr(gradsync.ops, "_plain_numel", lambda tensors, buf, written: -1)
    outcomes = {"raised": 0, "ran": 0}
    for seed, (error, bits) in enumerate(fast):
        slow_error, slow_bits = _call(seed)
        assert error == slow_error, (seed, error, slow_error)
        assert all(torch.equal(x, y) for x, y in zip(bits, slow_bits)), seed
        outcomes["raised" if error else "ran"] += 1
    assert min(outcomes.values()) > 300, outcomes  # both kinds of outcome, many times


def test_exact_in_place_segments_stay_allowed():
    torch.manual_seed(0)
    buf = torch.randn(12)
    before = buf.clone()
    gradsync.flatten([buf[:5], buf[5:12].view(7)], out=buf, scale=2.0)  # each input is its own segment
    assert torch.equal(buf, before * 2)
    gradsync.unflatten(buf, [buf[:5], buf[5:]], scale=0.5)
    assert torch.equal(buf, before)
    half = before.half()
    gradsync.compress(half, "fp16", out=half)
    gradsync.decompress(half, "fp16", 12, dtype=torch.float16, out=half)
    assert torch.equal(half, before.half())


def test_writes_bump_autograd_versions_and_refuse_tracked_tensors():
    w = torch.randn(6, requires_grad=True)
    y = w.detach().clone()
    saved = y.clone().requires_grad_()
    z = saved * 1.0
    loss = (z * z).sum()  # saves z for backward
    before = z._version
    with torch.no_grad():
        gradsync.unflatten(torch.randn(6), [z])
    assert z._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    out = torch.empty(6)
    v = out._version
    gradsync.flatten([y], out=out)
    gradsync.decompress(gradsync.compress(y, "fp16"), "fp16", 6, out=out)
    assert out._version >= v + 2
    with pytest.raises(ValueError, match="tensors\\[0\\] requires grad"):
        gradsync.unflatten(torch.randn(6), [w])
    with pytest.raises(ValueError, match="out requires grad"):
        gradsync.flatten([y], out=torch.empty(6, requires_grad=True))
    with pytest.raises(ValueError, match="out requires grad"):
        gradsync.decompress(torch.randn(6).half(), "fp16", 6, out=torch.empty(6, requires_grad=True))
    with torch.no_grad():
        gradsync.unflatten(torch.randn(6), [w])  # as torch allows in-place writes to leaves under no_grad


def test_inference_tensors_are_written_only_in_inference_mode():
    with torch.inference_mode():
        made = torch.zeros(6)
        gradsync.unflatten(torch.ones(6), [made])  # as torch's in-place ops may
    assert made.tolist() == [1.0] * 6
    for write in (lambda: gradsync.unflatten(torch.ones(6), [made]),
                  lambda: gradsync.flatten([torch.ones(6)], out=made),
                  lambda: gradsync.decompress(torch.ones(6).half(), "fp16", 6, out=made)):
        with pytest.raises(ValueError, match="inference tensor, which can be written only inside"):
            write()
    assert made.tolist() == [1.0] * 6
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        made.copy_(torch.zeros(6))  # torch's own rule


def test_codec_and_flags_are_type_checked():
    with pytest.raises(TypeError, match="codec must be a str"):
        gradsync.compress(x, ["fp16"])
    with pytest.raises(TypeError, match="codec must be a str"):
        gradsync.payload_nbytes(None, 3)
