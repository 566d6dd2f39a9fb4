import pytest
import torch
from hypothesis import given, settings, strategies as st

import gradsync
from conftest import CPU_ISAS, FLOAT_DTYPES, float_bits, random_bits_floats, random_floats, same_bits

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Per-element error bound of the block-scaled fp8 codecs, for a block with decode scale d = 2^-k:
#   |decoded - x| <= max(REL * |x|, SUB * d)
# REL: half an ulp relative to the value (2^-(mantissa bits + 1)); SUB: half the subnormal spacing
# of the format in scaled units. Since the block absmax a satisfies a/d in (FMAX/2, FMAX],
# SUB * d < 2 * SUB * a / FMAX: tiny elements of a block have an error relative to its largest.
FP8_BOUND = {"fp8_e4m3": (2.0**-4, 2.0**-10, 448.0), "fp8_e5m2": (2.0**-3, 2.0**-17, 57344.0)}


def fp8_parts(payload, n):
    codes = payload[:n]
    scales_at = -(-n // 16) * 16
    return codes, payload[scales_at:].view(torch.float32), payload[n:scales_at]


@pytest.mark.parametrize("codec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_cast_codecs_are_bitwise_torch_casts(cpu_isa, codec, dtype, scale):
    x = random_bits_floats(200003)
    payload = gradsync.compress(x, codec, scale=scale)
    assert payload.dtype == dtype
    ref = (x * scale).to(dtype)
    finite = torch.isfinite(ref)
    assert same_bits(payload[finite], ref[finite])
    assert torch.equal(torch.isinf(payload), torch.isinf(ref))
    decoded = gradsync.decompress(payload, codec, x.numel(), scale=2.0)
    assert same_bits(decoded, payload.float() * 2.0)


@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES)
def test_none_codec_keeps_input_dtype(cpu_isa, in_dtype):
    x = torch.randn(33, 3).to(in_dtype).t()
    payload = gradsync.compress(x, "none", scale=0.5)
    assert payload.dtype == in_dtype and payload.shape == (99,)
    assert same_bits(payload, (x.float() * 0.5).to(in_dtype).flatten())
    out = gradsync.decompress(payload, "none", 99, dtype=torch.bfloat16, scale=4.0)
    assert same_bits(out, (payload.float() * 4.0).bfloat16())


@pytest.mark.parametrize("codec", FP8)
def test_fp8_decodes_every_code_like_torch(cpu_isa, codec):
    codes = torch.arange(256, dtype=torch.uint8)
    for block_scale in (1.0, 2.0**-100, 2.0**100):
        scales = torch.full((2,), block_scale, dtype=torch.float32)
        payload = torch.cat([codes, scales.view(torch.uint8)])
        decoded = gradsync.decompress(payload, codec, 256)
        ref = codes.view(FP8[codec]).float() * block_scale
        assert torch.equal(torch.isnan(decoded), torch.isnan(ref))
        ok = ~torch.isnan(ref)
        assert same_bits(decoded[ok], ref[ok])


@pytest.mark.parametrize("codec", FP8)
def test_fp8_codes_are_torch_casts_of_the_scaled_block(cpu_isa, codec):
    x = random_floats(128 * 500 + 77, low_exp=-30, high_exp=30)
    n = x.numel()
    payload = gradsync.compress(x, codec, scale=0.75)
    codes, scales, padding = fp8_parts(payload, n)
    assert scales.numel() == -(-n // 128)
    assert torch.all(padding == 0)
    # scales are powers of two
    mant, _ = torch.frexp(scales)
    assert torch.all(mant == 0.5)
    v = x * 0.75
    blocks = torch.nn.functional.pad(v, (0, scales.numel() * 128 - n)).view(-1, 128)
    absmax = blocks.abs().amax(dim=1)
    fmax = FP8_BOUND[codec][2]
    # full range used: absmax / d in (fmax/2, fmax]
    assert torch.all(absmax / scales <= fmax) and torch.all(absmax / scales > fmax / 2)
    ref = (blocks / scales[:, None]).to(FP8[codec]).view(torch.uint8).flatten()[:n]
    assert torch.equal(codes, ref)


@pytest.mark.parametrize("codec", FP8)
def test_fp8_error_bound_over_many_orders_of_magnitude(cpu_isa, codec):
    g = torch.Generator().manual_seed(5)
    blocks = 400
    # each block at its own magnitude (1e-35 .. 1e35) and spanning 6 decades inside
    centre = torch.empty(blocks, 1).uniform_(-35, 35, generator=g)
    spread = torch.empty(blocks, 128).uniform_(-3, 3, generator=g)
    sign = torch.where(torch.rand(blocks, 128, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * torch.pow(10.0, (centre + spread).double())).float().flatten()
    payload = gradsync.compress(x, codec)
    decoded = gradsync.decompress(payload, codec, x.numel())
    _, scales, _ = fp8_parts(payload, x.numel())
    rel, sub, _ = FP8_BOUND[codec]
    bound = torch.maximum(rel * x.abs(), sub * scales.repeat_interleave(128))
    err = (decoded.double() - x.double()).abs()
    assert torch.all(err <= bound.double()), (err / bound).max()
    assert torch.all(torch.isfinite(decoded))
    # relative precision holds for every element within 2^8 of its block's max
    big = x.abs() >= x.view(-1, 128).abs().amax(dim=1).repeat_interleave(128) / 256
    assert torch.all(err[big] <= rel * x.abs()[big].double())


@pytest.mark.parametrize("codec", list(FP8) + ["fp16", "bf16", "none"])
def test_inf_and_nan_stay_non_finite(cpu_isa, codec):
    x = torch.randn(1000)
    x[[3, 500, 999]] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    decoded = gradsync.decompress(gradsync.compress(x, codec), codec, x.numel())
    assert torch.equal(torch.isfinite(decoded), torch.isfinite(x))
    assert torch.isnan(decoded[999])
    if codec != "fp8_e4m3":  # e4m3 has no infinity: NaN stands for it
        assert decoded[3] == float("inf") and decoded[500] == float("-inf")
    # the other elements of the blocks that hold Inf/NaN are still accurate
    finite = torch.isfinite(x)
    rtol = 0.13 if codec == "fp8_e5m2" else 0.07
    assert torch.allclose(decoded[finite], x[finite], rtol=rtol, atol=1e-3)


@pytest.mark.parametrize("codec", FP8)
def test_fp8_nan_is_one_code_whatever_its_sign(cpu_isa, codec):
    # a GPU multiply returns a positive NaN where x86 keeps the operand's sign: the code must not
    # depend on it, or the same gradients would encode to different bytes on CPU and GPU
    nans = float_bits(0x7fc00000, 0xffc00000, 0x7f800001, 0xffffffff, 0xff800001, 0x7fffffff)
    x = torch.randn(3 * 128 + 17)
    at = torch.arange(0, x.numel(), 23)[:len(nans) * 3]  # in whole blocks and in the tail
    assert at[-1] >= 3 * 128
    x[at] = nans.repeat(3)[:len(at)]
    x[[1, 2]] = torch.tensor([float("inf"), float("-inf")])
    for scale in (1.0, 0.3):
        codes = gradsync.compress(x, codec, scale=scale)[:x.numel()]
        assert torch.all(codes[at] == 0x7f), codes[at]
        assert codes[1] == 0x7f if codec == "fp8_e4m3" else codes[1] == 0x7c
        assert codes[2] == 0xff if codec == "fp8_e4m3" else codes[2] == 0xfc


@pytest.mark.parametrize("codec", FP8)
def test_fp8_never_overflows_finite_input(codec):
    x = torch.tensor([3.0e38, -3.4e38, 1.0, 1e-38] * 64)
    decoded = gradsync.decompress(gradsync.compress(x, codec), codec, x.numel())
    assert torch.all(torch.isfinite(decoded))
    assert torch.allclose(decoded[:2], x[:2], rtol=0.13)


@pytest.mark.parametrize("codec", FP8)
def test_fp8_zero_blocks_and_odd_lengths(codec):
    for n in (0, 1, 15, 16, 17, 127, 128, 129, 1000):
        x = torch.zeros(n)
        x[n // 2:] = torch.linspace(-1, 1, n - n // 2)
        payload = gradsync.compress(x, codec)
        assert payload.numel() == gradsync.payload_nbytes(codec, n)
        decoded = gradsync.decompress(payload, codec, n)
        assert torch.allclose(decoded, x, rtol=0.13, atol=0)


@pytest.mark.parametrize("codec", FP8)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fp8_from_and_to_half_types(cpu_isa, codec, dtype):
    x = torch.randn(5000).to(dtype)
    payload = torch.empty(gradsync.payload_nbytes(codec, 5000), dtype=torch.uint8)
    assert gradsync.compress(x, codec, scale=2.0, out=payload).data_ptr() == payload.data_ptr()
    assert torch.equal(payload, gradsync.compress(x.float(), codec, scale=2.0))
    out = torch.empty(5000, dtype=dtype)
    result = gradsync.decompress(payload, codec, 5000, dtype=dtype, scale=0.5, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert same_bits(out, gradsync.decompress(payload, codec, 5000, scale=0.5).to(dtype))


def test_fp8_scalar_and_vector_paths_agree_bitwise():
    from gradsync import _C
    if _C.cpu_isa() != "avx2":
        pytest.skip("no AVX2 on this CPU")
    x = random_bits_floats(128 * 3000 + 5)
    x[::1001] = float("inf")
    x[::997] = float("nan")
    x[::991] = float_bits(0xffc00000)
    for codec in FP8:
        _C.set_cpu_isa("scalar")
        a = gradsync.compress(x, codec, scale=0.3)
        _C.set_cpu_isa("avx2")
        b = gradsync.compress(x, codec, scale=0.3)
        assert torch.equal(a, b), codec
        decoded = []
        for isa in ("scalar", "avx2"):  # most blocks without a special code: the vector path for finite blocks
            _C.set_cpu_isa(isa)
            decoded.append(gradsync.decompress(a, codec, x.numel(), scale=0.7).view(torch.int32))
        assert torch.equal(*decoded), codec
        # every code, NaN bits included, at ordinary, tiny (subnormal results) and huge block scales
        codes = torch.arange(256, dtype=torch.uint8).repeat(3)
        scales = torch.tensor([2.0**-3, 1.0, 2.0**-126, 2.0**-120, 2.0**100, 2.0**126], dtype=torch.float32)
        payload = torch.cat([codes, scales.view(torch.uint8)])
        decoded = []
        for isa in ("scalar", "avx2"):
            _C.set_cpu_isa(isa)
            decoded.append(gradsync.decompress(payload, codec, codes.numel()).view(torch.int32))
        assert torch.equal(*decoded), codec
    _C.set_cpu_isa("auto")


@pytest.mark.parametrize("codec", FP8)
def test_fp8_paths_agree_with_denormals_flushed(codec):
    # torch.set_flush_denormal(True) flushes subnormal operands to zero: no path may rely on one,
    # as the vector encode's multiplier for e4m3 blocks near FLT_MAX once did (every code zero)
    from gradsync import _C
    g = torch.Generator().manual_seed(3)
    # absmax 2e38: in (2^127, 1.75 * 2^127], where e4m3's multiplier on fp16's scale is 2^-127
    x = torch.cat([torch.linspace(-1, 1, 128) * 2e38, torch.randn(128, generator=g) * 1e-30,
                   torch.randn(128, generator=g)])
    expected = gradsync.compress(x, codec)  # no input is subnormal: flushing must change no code
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for isa in CPU_ISAS:
            _C.set_cpu_isa(isa)
            assert torch.equal(gradsync.compress(x, codec), expected), (codec, isa)
    finally:
        torch.set_flush_denormal(False)
        _C.set_cpu_isa("auto")


def test_fp8_blocks_without_a_finite_non_zero_value_have_scale_one():
    # the layout's rule in README ("The fp8 payload"): such a block's scale is 1
    x = torch.zeros(384)
    x[128:256], x[256:] = float("inf"), float("nan")
    for codec in FP8:
        payload = gradsync.compress(x, codec)
        scales = payload[gradsync.payload_nbytes(codec, 384) - 12:].view(torch.float32)
        assert scales.tolist() == [1.0, 1.0, 1.0], (codec, scales)


def results_at_every_alignment(n, dtype, write):
    """For each offset of a result of n `dtype` elements from 32-byte alignment: what `write(out)`
    leaves in `out` under the scalar and under the AVX2 kernels, which must agree bitwise."""
    from gradsync import _C
    if _C.cpu_isa() != "avx2":
        pytest.skip("no AVX2 on this CPU")
    per_vector = 32 // torch.empty(0, dtype=dtype).element_size()
    buffer = torch.empty(n + per_vector, dtype=dtype)
    for offset in range(per_vector):
        out = buffer[offset:offset + n]
        results = []
        for isa in ("scalar", "avx2"):
            _C.set_cpu_isa(isa)
            out.fill_(7.0)
            write(out)
            results.append(out.clone())
        _C.set_cpu_isa("auto")
        assert same_bits(*results), (dtype, offset)
        yield results[1]


@pytest.mark.parametrize("codec", ["fp16", "bf16"] + list(FP8))
def test_large_fp32_results_at_any_alignment_match_the_scalar_path(codec):
    # fp32 results this large leave through non-temporal stores, aligned or not
    n = 128 * 800 + 5
    x = random_bits_floats(n)
    x[::1001] = float("nan")
    payload = gradsync.compress(x, codec)
    expected = gradsync.decompress(payload, codec, n).mul_(0.75)
    for result in results_at_every_alignment(n, torch.float32,
                                             lambda out: gradsync.decompress(payload, codec, n, scale=0.75, out=out)):
        assert same_bits(result, expected), codec


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_16_bit_results_at_any_alignment_match_the_scalar_path(dtype):
    # flattened results this large leave through non-temporal stores too, 32 bytes at a time
    n = 100005
    x = random_bits_floats(n)
    x[::1001] = float("nan")
    nan = torch.isnan(x)
    for result in results_at_every_alignment(n, dtype, lambda out: gradsync.flatten([x], dtype=dtype, scale=0.75, out=out)):
        assert torch.equal(torch.isnan(result), nan), dtype
        assert same_bits(result[~nan], (x[~nan] * 0.75).to(dtype)), dtype  # torch's NaN bits are its own


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), codec=st.sampled_from(gradsync.CODECS), dtype=st.sampled_from(FLOAT_DTYPES),
       log_mag=st.floats(-30, 30), scale=st.sampled_from([1.0, 0.5, 1 / 7, 1024.0]), seed=st.integers(0, 2**31))
def test_codec_roundtrip_property(n, codec, dtype, log_mag, scale, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype != torch.float32:
        log_mag = max(min(log_mag, 1.0), -3.0)  # x * 1024 stays inside fp16's range
    x = (torch.randn(n, generator=g) * 10.0**log_mag).to(dtype)
    payload = gradsync.compress(x, codec, scale=scale)
    assert payload.numel() * payload.element_size() == gradsync.payload_nbytes(codec, n, dtype)
    decoded = gradsync.decompress(payload, codec, n, scale=1 / scale)
    ref = x.double().flatten()
    if codec in FP8:
        rel, sub, _ = FP8_BOUND[codec]
        _, scales, _ = fp8_parts(payload, n)
        d = scales.double().repeat_interleave(128)[:n]
        bound = (rel * ref.abs() * scale + sub * d) / scale * (1 + 1e-6) + 1e-45
        assert torch.all((decoded.double() - ref).abs() <= bound)
    elif codec == "none" or codec == {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype):
        # the only rounding is that of x * scale to x's own dtype
        tol = {torch.float32: 2e-7, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
        subnormal = 2.0**-23 / scale if dtype == torch.float16 else 0.0  # fp16 subnormal spacing, rescaled
        assert torch.allclose(decoded.double(), ref, rtol=tol, atol=1e-4 * 10.0**log_mag + subnormal)
    else:  # a 16-bit wire of another dtype: torch's cast of x * scale in fp32, decoded times 1/scale in fp32
        wire = (x.float() * scale).to({"fp16": torch.float16, "bf16": torch.bfloat16}[codec])
        expected = wire.float() * (1 / scale)
        assert torch.equal(decoded.isnan(), expected.isnan())
        assert same_bits(decoded[~decoded.isnan()], expected[~expected.isnan()])
