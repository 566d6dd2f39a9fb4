import pytest
import torch
from hypothesis import given, settings, strategies as st

import gradsync
from conftest import FLOAT_DTYPES, random_floats, same_bits


def reference_flatten(tensors, dtype, scale):
    return torch.cat([(t.float() * scale).to(dtype).flatten() for t in tensors])


def gradient_like_list(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 10, generator=g)
    return [
        torch.randn(3, 4, generator=g),
        torch.randn(17, generator=g).half(),
        torch.randn(5, 7, generator=g).bfloat16().t(),        # transposed
        torch.empty(0),                                         # zero elements
        base[:, ::3],                                           # sliced with a step
        torch.randn(2, 3, 4, generator=g).permute(2, 0, 1),     # permuted 3-d
        torch.tensor(2.5),                                      # 0-d
        torch.randn(1, 9, 1, generator=g).half(),
        torch.randn(4, 1, generator=g).expand(4, 6),            # stride-0 view (read only)
        random_floats(1000, generator=g),
        torch.randn(200, 999, generator=g)[:, ::3],             # strided, past a chunk, rows of 333
    ]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.125, 1 / 3, 7.5e-4])
def test_flatten_equals_cat_of_scaled_cast(cpu_isa, dtype, scale):
    tensors = gradient_like_list()
    flat = gradsync.flatten(tensors, dtype=dtype, scale=scale)
    assert flat.dtype == dtype and flat.dim() == 1 and flat.is_contiguous()
    assert same_bits(flat, reference_flatten(tensors, dtype, scale))


def test_flatten_default_dtype_is_promoted():
    assert gradsync.flatten([torch.randn(3).half()]).dtype == torch.float16
    assert gradsync.flatten([torch.randn(3).half(), torch.randn(2).bfloat16()]).dtype == torch.float32
    assert gradsync.flatten([torch.randn(3).half(), torch.randn(2)]).dtype == torch.float32


def test_flatten_into_out_reuses_buffer(cpu_isa):
    tensors = gradient_like_list(1)
    out = torch.empty(sum(t.numel() for t in tensors), dtype=torch.bfloat16)
    result = gradsync.flatten(tensors, scale=0.5, out=out)
    assert result.data_ptr() == out.data_ptr() and result.dtype == torch.bfloat16
    assert same_bits(out, reference_flatten(tensors, torch.bfloat16, 0.5))


def test_flatten_of_empty_list_with_out():
    out = torch.empty(0)
    assert gradsync.flatten([], out=out).numel() == 0


def test_flatten_more_dims_than_the_kernel_describes():
    x = torch.randn([2] * 8).permute(7, 6, 5, 4, 3, 2, 1, 0)  # 8 non-mergeable strided dims
    assert same_bits(gradsync.flatten([x], scale=3.0), reference_flatten([x], torch.float32, 3.0))


@pytest.mark.parametrize("flat_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_unflatten_writes_scaled_cast_segments(cpu_isa, flat_dtype, scale):
    g = torch.Generator().manual_seed(2)
    targets = [t.clone() for t in gradient_like_list(2) if t.stride() == () or 0 not in t.stride()]
    # non-contiguous targets: views into bigger storage
    big = torch.zeros(8, 12, dtype=torch.float16)
    targets += [big[:, ::2], torch.zeros(5, 3, dtype=torch.bfloat16).t()]
    numel = sum(t.numel() for t in targets)
    flat = random_floats(numel + 5, generator=g, low_exp=-3, high_exp=3).to(flat_dtype)  # tail is ignored
    gradsync.unflatten(flat, targets, scale=scale)
    offset = 0
    for t in targets:
        seg = flat[offset:offset + t.numel()]
        assert same_bits(t, (seg.float() * scale).to(t.dtype).view(t.shape))
        offset += t.numel()
    assert big[:, 1::2].count_nonzero() == 0  # untouched between the strided elements


def test_unflatten_more_dims_than_the_kernel_describes():
    base = torch.zeros([2] * 8)
    target = base.permute(7, 6, 5, 4, 3, 2, 1, 0)
    flat = torch.arange(256, dtype=torch.float32)
    gradsync.unflatten(flat, [target])
    assert torch.equal(target.flatten(), flat)


def test_flatten_unflatten_roundtrip_is_exact_in_fp32(cpu_isa):
    tensors = [t.float().clone() for t in gradient_like_list(3)[:8]]
    copies = [torch.full_like(t, float("nan")) for t in tensors]
    gradsync.unflatten(gradsync.flatten(tensors), copies)
    for a, b in zip(tensors, copies):
        assert same_bits(a.contiguous(), b.contiguous())


def test_large_list_spans_many_chunks(cpu_isa):
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(int(n), generator=g) for n in torch.randint(0, 70000, (40,), generator=g)]
    flat = gradsync.flatten(tensors, dtype=torch.float16, scale=0.01)
    assert same_bits(flat, reference_flatten(tensors, torch.float16, 0.01))


def strided_past_a_chunk(g):
    """Views longer than a kernel chunk (32768 elements on CPU, 16384 on CUDA) whose rows divide
    neither, so that chunks start and end mid-row: slices (inner stride 1) and a transpose (not)."""
    return [torch.randn(300, 301, generator=g)[:, :300], torch.randn(257, 300, generator=g).t().half(),
            torch.randn(200, 333, generator=g).bfloat16()[:, :-1]]


@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_strided_tensors_past_a_chunk(cpu_isa, scale):
    tensors = strided_past_a_chunk(torch.Generator().manual_seed(5))
    assert all(not t.is_contiguous() and t.numel() > 32768 for t in tensors)
    for dtype in FLOAT_DTYPES:
        assert same_bits(gradsync.flatten(tensors, dtype=dtype, scale=scale), reference_flatten(tensors, dtype, scale))
    bases = [torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype) for t in tensors]
    targets = [b.as_strided(t.shape, t.stride(), t.storage_offset()) for b, t in zip(bases, tensors)]
    flat = random_floats(sum(t.numel() for t in targets), low_exp=-5, high_exp=5)
    gradsync.unflatten(flat, targets, scale=scale)
    at = 0
    for base, t in zip(bases, targets):
        expected = (flat[at:at + t.numel()] * scale).to(t.dtype).view(t.shape)
        assert same_bits(t.contiguous(), expected)
        at += t.numel()
        t.zero_()
        assert not base.any()  # what lies between the rows stays


def test_scalar_and_vector_paths_agree_bitwise():
    from gradsync import _C
    if _C.cpu_isa() != "avx2":
        pytest.skip("no AVX2 on this CPU")
    x = torch.randint(-2**31, 2**31, (100003,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    results = {}
    for isa in ("scalar", "avx2"):
        _C.set_cpu_isa(isa)
        results[isa] = [gradsync.flatten([x], dtype=d, scale=s) for d in FLOAT_DTYPES for s in (1.0, 0.3)]
    _C.set_cpu_isa("auto")
    for a, b in zip(results["scalar"], results["avx2"]):
        finite = torch.isfinite(a.float())
        assert torch.equal(torch.isfinite(b.float()), finite)
        assert same_bits(a[finite], b[finite])
        assert torch.isnan(b.float()[~finite]).eq(torch.isnan(a.float()[~finite])).all()


shapes = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, in_dtypes=st.lists(st.sampled_from(FLOAT_DTYPES), min_size=12, max_size=12),
       out_dtype=st.sampled_from(FLOAT_DTYPES), scale=st.floats(1e-6, 1e6), transpose=st.booleans(),
       seed=st.integers(0, 2**31))
def test_flatten_unflatten_property(shapes, in_dtypes, out_dtype, scale, transpose, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for shape, dtype in zip(shapes, in_dtypes):
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
        tensors.append(t.t() if transpose and t.dim() == 2 else t)
    flat = gradsync.flatten(tensors, dtype=out_dtype, scale=scale)
    assert same_bits(flat, reference_flatten(tensors, out_dtype, scale))
    targets = [torch.empty_like(t) for t in tensors]
    gradsync.unflatten(flat, targets, scale=1 / scale)
    offset = 0
    for t in targets:
        seg = flat[offset:offset + t.numel()]
        assert same_bits(t, (seg.float() * (1 / scale)).to(t.dtype).view(t.shape))
        offset += t.numel()
