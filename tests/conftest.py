import pytest
import torch
from hypothesis import settings

from distributed_harness import World
from gradsync import _C

# Property tests draw the same examples on every run: a failure here is reproducible, never flaky.
settings.register_profile("gradsync", derandomize=True, database=None, deadline=None)
settings.load_profile("gradsync")

CPU_ISAS = ["scalar"] + (["avx2"] if _C.cpu_isa() == "avx2" else [])
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and _C.build_info()["cuda"]:
        return
    reason = "needs a CUDA GPU and a CUDA build of gradsync"
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def worlds():
    """worlds(n): a World of n gloo ranks, started once per test module."""
    made = {}

    def get(size):
        if size not in made:
            made[size] = World(size)
        return made[size]
    yield get
    for world in made.values():
        world.close()


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Runs a CPU test once per instruction set the CPU kernels can use here."""
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def random_floats(n, *, generator=None, low_exp=-40, high_exp=40, signed=True):
    """float32 values whose magnitudes are spread log-uniformly over 10^low_exp .. 10^high_exp."""
    g = generator or torch.Generator().manual_seed(0)
    exps = torch.empty(n, dtype=torch.float64).uniform_(low_exp, high_exp, generator=g)
    mant = torch.empty(n, dtype=torch.float64).uniform_(1, 10, generator=g)
    x = (mant * torch.pow(10.0, exps)).float()
    if signed:
        x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    return x


def random_bits_floats(n, *, generator=None):
    """Finite float32 values drawn uniformly over bit patterns: every exponent, subnormals, ties."""
    g = generator or torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    x = bits.view(torch.float32)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def float_bits(*patterns):
    """float32 values with the given bit patterns (unsigned 32-bit integers)."""
    return torch.tensor([b - 2**32 if b >= 2**31 else b for b in patterns], dtype=torch.int32).view(torch.float32)


def same_bits(a, b):
    """Bitwise equality of two tensors of one dtype (NaN payloads included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(int_type), b.contiguous().view(int_type))
