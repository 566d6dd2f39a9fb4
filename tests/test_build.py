"""The build: flavour-tagged version, the report command, and the torch-mismatch check."""
import importlib.metadata
import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradsync
from gradsync import _build_info, _extension


def run_python(code, cwd):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def run_without_site(args, cwd):
    """``python -S args`` with site-packages on the path but none of its .pth hooks (an editable install's
    finder would supply the missing modules of a package copy from the source folder)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(site.getsitepackages()))
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_version_carries_the_build_flavour():
    major, minor = torch.__version__.split(".")[:2]
    requires = [r for r in importlib.metadata.requires("gradsync") if "extra ==" not in r]
    if getattr(_build_info, "from_sdist", False):  # a build keeps its sdist's version, which has no flavour
        assert re.fullmatch(r"\d+\.\d+\.\d+", gradsync.__version__)
        assert requires == ["torch"]  # pip reuses it under another torch, which a pin would make pip replace
    else:
        assert re.fullmatch(r"\d+\.\d+\.\d+\+(cpu|cu\d+)torch\d+\.\d+", gradsync.__version__)
        assert gradsync.__version__.endswith(f"{_build_info.flavour}torch{major}.{minor}")
        assert requires == [f"torch=={major}.{minor}.*"]
    assert (_build_info.flavour == "cpu") == (gradsync._C.build_info()["cuda"] is None)


def test_report_names_versions_and_devices(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gradsync.report"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    for words in (gradsync.__version__, "build flavour", "CUDA compiled for", "NCCL linked", "torch built against",
                  "torch running", torch.__version__, "GPUs"):
        assert words in result.stdout
    result = subprocess.run([sys.executable, "-m", "gradsync.report", "--bogus"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)  # it takes no options: a usage error, not the report
    assert result.returncode == 2 and "unrecognized arguments: --bogus" in result.stderr, result.stderr


def test_cpu_kernels_use_torchs_intra_op_threads():
    # at::parallel_for is inline: an extension compiled without torch's OpenMP runs it on one thread
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert gradsync._C.cpu_kernel_threads() == n
    finally:
        torch.set_num_threads(threads)


def test_the_nccl_hop_benchmark_needs_a_cuda_build():
    if gradsync._C.build_info()["cuda"] is None:
        with pytest.raises(RuntimeError, match="built without CUDA"):
            gradsync._C._nccl_hop_cost(0, 10, [4096])
    else:  # measured by tests/test_cuda.py on a GPU
        assert callable(gradsync._C._nccl_hop_cost)


def test_the_process_loads_one_nccl_torchs():
    if gradsync._C.build_info()["cuda"] is None:
        pytest.skip("a CPU build links no NCCL")
    assert re.fullmatch(r"\d+\.\d+\.\d+", gradsync._C.nccl_runtime_version())  # ncclGetVersion needs no GPU
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps to list the loaded libraries")
    with open("/proc/self/maps") as f:
        mapped = {os.path.realpath(line.split()[-1]) for line in f if "libnccl.so" in line}
    assert len(mapped) == 1, mapped
    beside_torch = Path(torch.__file__).resolve().parents[1] / "nvidia" / "nccl"
    if beside_torch.is_dir():  # torch's own wheel dependency
        assert Path(next(iter(mapped))).is_relative_to(beside_torch.resolve()), mapped


def test_incompatibility_reasons():
    assert _extension.incompatibility("2.14.1+cu130", "13.0", "2.14.0+cu130", "13.0") is None
    assert "built for torch 2.14.1+cu130 but torch 2.13.0+cpu" in _extension.incompatibility(
        "2.14.1+cu130", "13.0", "2.13.0+cpu", None)
    assert "is a CPU build" in _extension.incompatibility("2.14.1+cu130", "13.0", "2.14.1+cpu", None)
    assert _extension.incompatibility("2.14.1+cpu", None, "2.14.1+cu130", "13.0") is None
    assert "built for CUDA 13.0 but torch 2.14.1+cu126 runs CUDA 12.6" in _extension.incompatibility(
        "2.14.1+cu130", "13.0", "2.14.1+cu126", "12.6")
    assert _extension.incompatibility("2.14.1+cu130", "13.0", "2.14.1+cu131", "13.1") is None


def test_import_under_another_torch_names_the_torch_it_needs(tmp_path):
    # Pretend this build was made for another torch: import must fail with a readable ImportError
    # before the extension is loaded.
    code = (
        "import sys, types, gradsync._extension as e\n"
        "fake = types.ModuleType('gradsync._build_info')\n"
        "fake.version = '0.1.0+cu130torch9.9'; fake.torch_version = '9.9.0+cu130'; fake.cuda_version = '13.0'\n"
        "fake.flavour = 'cu130'; fake.cuda_arch_list = '8.0;9.0'\n"
        "sys.modules['gradsync._build_info'] = fake\n"
        "try:\n"
        "    e.load()\n"
        "except ImportError as err:\n"
        "    print('IMPORTERROR', err)\n"
    )
    # gradsync/__init__ would run load() first; import the loader module without the package init.
    code = "import importlib.util, sys, os\n" \
           "spec = importlib.util.find_spec('gradsync')\n" \
           "pkg = os.path.dirname(spec.origin)\n" \
           "import types; p = types.ModuleType('gradsync'); p.__path__ = [pkg]; sys.modules['gradsync'] = p\n" + code
    result = run_python(code, tmp_path)
    assert "IMPORTERROR" in result.stdout, result.stdout + result.stderr
    assert "built for torch 9.9.0+cu130" in result.stdout and torch.__version__ in result.stdout
    package_dir = os.path.dirname(gradsync.__file__)
    assert f"at {package_dir} cannot be loaded" in result.stdout
    if (Path(package_dir).parent / "csrc").is_dir():  # an editable install: rebuild the source folder's build
        assert f"pip install --no-build-isolation --no-deps -e {Path(package_dir).parent}" in result.stdout
    else:  # not the wheel pip cached for another torch
        assert "pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir gradsync" in result.stdout


def test_an_sdist_and_a_build_in_one_setup_call_are_refused(tmp_path):
    # the sdist's setup() builds nothing: a wheel made beside it would hold no extension
    setup_py = Path(__file__).resolve().parents[1] / "setup.py"
    for commands in (["sdist", "bdist_wheel"], ["bdist_wheel", "-d", "dist", "sdist"], ["-q", "build", "sdist"]):
        result = subprocess.run([sys.executable, str(setup_py), "--dry-run", *commands], capture_output=True,
                                text=True, timeout=120, cwd=tmp_path)
        assert result.returncode != 0 and "make the sdist and build in two commands" in result.stderr, result.stderr


def run_setup_version(cwd, patch, **env):
    """`setup.py --version` in a process whose torch is patched first (``patch``: Python statements)."""
    setup_py = Path(__file__).resolve().parents[1] / "setup.py"
    code = (f"import runpy, sys, torch; {patch}; sys.argv = ['setup.py', '--version']; "
            f"runpy.run_path({str(setup_py)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


def test_a_torch_older_than_the_oldest_checked_is_refused(tmp_path):
    result = run_setup_version(tmp_path, "torch.__version__ = '2.10.0+cu128'")
    assert result.returncode != 0, result
    assert "gradsync needs torch 2.11 or later (the oldest it is checked against), found 2.10.0+cu128" in result.stderr


@pytest.mark.parametrize("forced", ["", "1", "0"])
def test_a_toolkit_of_another_cuda_major_than_torchs_is_refused_by_name(tmp_path, forced):
    # torch's own check would stop the build with a tuple for a message
    toolkit = tmp_path / "cuda-12.8"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "include").mkdir()
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  12080\n")
    result = run_setup_version(tmp_path, "torch.version.cuda = '13.0'", CUDA_HOME=str(toolkit), GRADSYNC_CUDA=forced)
    if forced == "0":  # a CPU build: no "+cu" (CI also runs this in an unpacked sdist, whose version is plain)
        assert result.returncode == 0 and "+cu" not in result.stdout, result
        return
    assert result.returncode != 0, result
    assert (f"the CUDA toolkit at {toolkit} is CUDA 12, but torch {torch.__version__} was built with CUDA 13.0 "
            "and builds extensions only with a toolkit of that major version: set CUDA_HOME to a CUDA 13 toolkit, "
            "or GRADSYNC_CUDA=0 for a CPU build") in result.stderr, result.stderr


@pytest.mark.parametrize("forced", ["", "1", "0"])
@pytest.mark.parametrize("var", ["CUDA_HOME", "CUDA_PATH"])
def test_a_cuda_home_that_holds_no_toolkit_is_an_error_naming_it_beside_a_cuda_torch(tmp_path, var, forced):
    # a quiet CPU build would show only at run time: pip shows a build's output only when it fails
    empty = tmp_path / "not-a-toolkit"
    empty.mkdir()
    env = {"CUDA_HOME": "", "CUDA_PATH": "", var: str(empty), "GRADSYNC_CUDA": forced}
    result = run_setup_version(tmp_path, "torch.version.cuda = '13.0'", **env)
    if forced == "0":  # the CPU flavour, as asked
        assert result.returncode == 0 and "+cu" not in result.stdout, result
        return
    assert result.returncode != 0, result
    message = (f"{var}={empty} holds no bin/nvcc and include/cuda_runtime.h: set it to a CUDA toolkit's folder or "
               "unset it")
    assert message + ("" if forced else ", or set GRADSYNC_CUDA=0 for a CPU build") + "\n" in result.stderr, result


def test_cuda_home_is_read_before_cuda_path_as_torch_reads_them(tmp_path):
    empty = tmp_path / "not-a-toolkit"
    empty.mkdir()
    result = run_setup_version(tmp_path, "torch.version.cuda = '13.0'", CUDA_HOME=str(empty),
                               CUDA_PATH="/usr/local/cuda", GRADSYNC_CUDA="")
    assert result.returncode != 0 and f"CUDA_HOME={empty} holds no" in result.stderr, result


def test_a_bad_gradsync_cuda_is_named_before_the_toolkit_is_looked_for(tmp_path):
    result = run_setup_version(tmp_path, "torch.version.cuda = '13.0'", CUDA_HOME=str(tmp_path), GRADSYNC_CUDA="off")
    assert result.returncode != 0 and "GRADSYNC_CUDA must be 0 or 1, got 'off'" in result.stderr, result


def test_a_cuda_home_that_holds_no_toolkit_is_no_matter_beside_a_cpu_torch(tmp_path):
    result = run_setup_version(tmp_path, "torch.version.cuda = None", CUDA_HOME=str(tmp_path), CUDA_PATH="",
                               GRADSYNC_CUDA="")
    assert result.returncode == 0 and "+cu" not in result.stdout, result
    assert f"CUDA_HOME={tmp_path} holds no bin/nvcc and include/cuda_runtime.h, so no CUDA toolkit is used" in \
        result.stderr, result


def test_the_library_carries_no_debug_info():
    # Python's CFLAGS say -g: with it the library was 23 MB, 97 % of it DWARF
    with open(gradsync._C.__file__, "rb") as library:
        assert b".debug_info" not in library.read()


def test_tests_use_the_installed_package():
    # The package under test is the one pip installed: the source tree only for an editable install,
    # and it carries its compiled module.
    # the copy an installer put there, not the metadata a build leaves in the source tree
    installed = next(d for d in importlib.metadata.distributions()
                     if d.metadata["Name"] == "gradsync" and d.read_text("INSTALLER"))
    editable = json.loads(installed.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable", False)
    source_tree = Path(__file__).resolve().parents[1] / "gradsync"
    assert (Path(gradsync.__file__).resolve().parent == source_tree) == editable, (gradsync.__file__, editable)
    assert os.path.exists(gradsync._C.__file__)


def package_copy(tmp_path, build_info=None, without_c=False):
    """A copy of the installed gradsync under tmp_path (first on the path of a process run there)."""
    copy = tmp_path / "gradsync"
    shutil.copytree(os.path.dirname(gradsync.__file__), copy, ignore=shutil.ignore_patterns("__pycache__"))
    if build_info is not None:
        (copy / "_build_info.py").write_text(build_info)
    if without_c:
        for c in copy.glob("_C.*"):
            c.unlink()
    return copy


def record(torch_version=_build_info.torch_version, cuda_version=_build_info.cuda_version):
    return (f"version = '0.1.0+test'\nfrom_sdist = False\nflavour = {_build_info.flavour!r}\n"
            f"torch_version = {torch_version!r}\ncuda_version = {cuda_version!r}\n"
            f"cuda_arch_list = {_build_info.cuda_arch_list!r}\n")


@pytest.mark.parametrize("damage, why", [
    ("version = '0.1.0'\ntorch_version = '2.13.0+cpu\n", "SyntaxError"),
    ("version = '0.1.0'\n", "flavour is 'missing'"),
    (record().replace(f"torch_version = {_build_info.torch_version!r}", "torch_version = None"),
     "torch_version is None"),
])
def test_a_damaged_build_record_is_an_import_error_that_says_so(tmp_path, damage, why):
    copy = package_copy(tmp_path, build_info=damage)
    result = run_python("import gradsync", tmp_path)
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"ImportError: gradsync's build record {copy / '_build_info.py'} is damaged"), result.stderr
    assert why in result.stderr and "reinstall it:" in result.stderr


def test_the_advice_for_a_compiled_module_that_fails_to_load_names_its_cause(tmp_path):
    package_dir = str(tmp_path / "site-packages" / "gradsync")

    def advice(error):
        return _extension.load_failure(error, _build_info, package_dir)

    missing = ModuleNotFoundError("No module named 'gradsync._C'", name="gradsync._C")
    assert "has no compiled module gradsync._C" in advice(missing)
    symbol = ImportError("_C.so: undefined symbol: _ZN3c106detail14torchCheckFailEPKcS2_jRKSs")
    assert "compiled against another build of that torch" in advice(symbol)
    assert "reinstall it against the running torch" in advice(symbol)
    nccl = ImportError("libnccl.so.2: cannot open shared object file: No such file or directory")
    assert "nvidia-nccl-cu" in advice(nccl) and "LD_LIBRARY_PATH" in advice(nccl)
    cudart = ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")
    assert "a library it links is not on the loader's path" in advice(cudart)
    old_nccl = ImportError("_C.so: undefined symbol: ncclCommInitRankScalable")
    assert "libnccl.so.2 this process loaded is older than the NCCL it was compiled against" in advice(old_nccl)
    old_cudart = ImportError("_C.so: undefined symbol: cudaGetDriverEntryPointByVersion, version libcudart.so.13")
    assert "a library it links is older than the one it was compiled against" in advice(old_cudart)
    for error in (missing, nccl, cudart, old_nccl, old_cudart, ImportError("_C.so: file too short")):  # not torch
        assert "against the running torch" not in advice(error)
        assert ("reinstall it:" in advice(error)) == (error is not nccl)
        assert f"at {package_dir} (built for torch {_build_info.torch_version})" in advice(error)
    os.makedirs(package_dir)  # a module for another Python beside it
    open(os.path.join(package_dir, "_C.cpython-39-x86_64-linux-gnu.so"), "w").close()
    assert (f"has no compiled module that this Python ({sys.implementation.cache_tag} on {platform.machine()}) "
            "can load, only _C.cpython-39-x86_64-linux-gnu.so: it was built for another Python") in advice(missing)


def test_the_report_runs_when_the_extension_cannot_load(tmp_path):
    package_copy(tmp_path, build_info=record(torch_version="9.9.0+cpu"))
    (tmp_path / "user").mkdir()  # a program run as python -m user, with arguments that look like the report's
    (tmp_path / "user" / "__main__.py").write_text("import gradsync\n")
    for args in (["-c", "import gradsync"], ["-m", "gradsync.demo", "--help"], ["-m", "user", "-m", "gradsync.report"]):
        result = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert "ImportError: gradsync 0.1.0+test" in result.stderr, (args, result.stderr)  # an import still fails
        assert "built for torch 9.9.0+cpu" in result.stderr
    # run from a program: the report, and then the reason wherever the program reaches for the API
    code = ("import runpy, sys\ntry:\n    runpy.run_module('gradsync.report', run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code)\nfrom gradsync import DataParallel\n")
    result = run_python(code, tmp_path)
    assert "NOT LOADED:" in result.stdout and "exit 1" in result.stdout, result.stdout + result.stderr
    assert "ImportError: gradsync.DataParallel: gradsync 0.1.0+test" in result.stderr, result.stderr
    for args in (["-m", "gradsync.report"], ["-mgradsync.report"], ["-Bm", "gradsync.report"],
                 ["-m", "cProfile", "-m", "gradsync.report"]):
        result = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert result.returncode == (0 if "cProfile" in args else 1), (args, result.stderr)  # cProfile takes exits
        rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in result.stdout.splitlines()
                    if re.match(r"[a-zA-Z]\S*( \S+)*\s{2,}\S", line))
        assert rows["gradsync"] == "0.1.0+test" and rows["torch built against"] == "9.9.0+cpu", (args, result.stdout)
        assert rows["torch running"].startswith(torch.__version__) and "GPUs" in rows
        assert rows["extension"].startswith("NOT LOADED:") and "built for torch 9.9.0+cpu" in rows["extension"]

    shutil.rmtree(tmp_path / "gradsync")
    package_copy(tmp_path, without_c=True)
    result = run_without_site(["-m", "gradsync.report"], tmp_path)
    assert result.returncode == 1 and "has no compiled module gradsync._C" in result.stdout, result.stdout
