"""Builds gradsync._C against the torch already installed (pip install --no-build-isolation .).

Flavour: CUDA when torch is a CUDA build and a CUDA toolkit is found (one of another major version
than torch's is an error), CPU otherwise; GRADSYNC_CUDA=1/0 forces it. The version carries the
flavour, e.g. 0.1.0+cu130torch2.14, except in an sdist and what is built from one: the sdist cannot
know the flavour its builds will have, and pip, installing from an index, requires a build to keep
its sdist's version (the flavour is in gradsync.report).
"""
import os
import re
import shutil
import sys
from pathlib import Path

import setuptools
from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
BASE_VERSION = "0.1.0"
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"
MIN_TORCH = (2, 11)


def fail(message):
    sys.exit(f"gradsync build error: {message}")


# pyproject.toml's SPDX license string is read by setuptools 77 and later; older ones reject it
if int(setuptools.__version__.split(".")[0]) < 77:
    fail(f"setuptools 77 or later is needed, found {setuptools.__version__}: pip install -U setuptools")

# `setup.py sdist` (also what `python -m build --sdist` runs) only packs the sources: no torch needed
BUILDS = {"build", "build_ext", "build_py", "bdist", "bdist_wheel", "bdist_egg", "install", "develop", "editable_wheel"}
VALUED = {"-d", "--dist-dir", "--formats", "-t", "--template", "-m", "--manifest", "-u", "--owner", "-g", "--group",
          "-e", "--egg-base", "-b", "--bdist-dir", "--tag-build", "-p", "--plat-name", "--python-tag",
          "--build-number", "--output-dir", "--mode"}
COMMANDS = [a for before, a in zip(sys.argv, sys.argv[1:]) if not a.startswith("-") and before not in VALUED]
MAKING_SDIST = "sdist" in COMMANDS  # in any place: `bdist_wheel sdist` must not stamp a flavour on the sdist
if MAKING_SDIST and BUILDS.intersection(COMMANDS):
    # the sdist's setup() has no extension to build
    fail("make the sdist and build in two commands (setup.py sdist; pip wheel --no-build-isolation --no-deps . -w "
         "dist)")
FROM_SDIST = (ROOT / "PKG-INFO").exists()  # an unpacked sdist: no .git, and setuptools wrote PKG-INFO

if not MAKING_SDIST:
    try:
        import torch
    except ImportError:
        fail("torch must be installed before gradsync, which builds against it: "
             "pip install torch, then pip install --no-build-isolation .")


def read_sources():
    sources = {"core": [], "cuda": [], "nccl": [], "bindings": []}
    for line in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            kind, path = line.split()
            sources[kind].append(path)
    return sources


def is_toolkit(home):
    return home is not None and (Path(home) / "bin" / "nvcc").exists() and \
        (Path(home) / "include" / "cuda_runtime.h").exists()


def forced_cuda():
    """GRADSYNC_CUDA: "1" or "0" forces the flavour, "" (or unset) lets the toolkit decide."""
    forced = os.environ.get("GRADSYNC_CUDA", "")
    if forced not in ("", "0", "1"):
        fail(f"GRADSYNC_CUDA must be 0 or 1, got {forced!r}")
    return forced


def find_cuda_home(forced):
    """The CUDA toolkit root. torch guesses it from the folder of `nvcc`, which is wrong when nvcc
    is a wrapper script outside the toolkit, so look for a folder that really holds one."""
    for var in ("CUDA_HOME", "CUDA_PATH"):  # in torch's order
        if os.environ.get(var):
            if is_toolkit(os.environ[var]):
                return os.environ[var]
            problem = f"{var}={os.environ[var]} holds no bin/nvcc and include/cuda_runtime.h"
            # an error beside a CUDA torch, not a quiet CPU build: pip shows a build's output only when it fails
            if torch.version.cuda is not None and forced != "0":
                fail(f"{problem}: set it to a CUDA toolkit's folder or unset it"
                     + ("" if forced else ", or set GRADSYNC_CUDA=0 for a CPU build"))
            print(f"gradsync build: {problem}, so no CUDA toolkit is used", file=sys.stderr)
            return None
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    candidates += sorted(Path("/usr/local").glob("cuda-*"), reverse=True)
    return next((str(c) for c in candidates if is_toolkit(c)), None)


def toolkit_cuda_major(home):
    """The CUDA major version of the toolkit at ``home`` (its cuda_runtime_api.h), None if unread."""
    try:
        header = (Path(home) / "include" / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header)
    return int(found.group(1)) // 1000 if found else None


def want_cuda(cuda_home, forced):
    if forced == "0":
        return False
    if forced == "1":
        if torch.version.cuda is None:
            fail(f"GRADSYNC_CUDA=1 but the installed torch {torch.__version__} is a CPU build")
        if cuda_home is None:
            fail("GRADSYNC_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME to the folder that holds "
                 "bin/nvcc and include/cuda_runtime.h")
    if torch.version.cuda is None or cuda_home is None:
        return False
    # torch builds extensions only with a toolkit of its own CUDA major version. An error, not a
    # quiet CPU build: pip shows a build's output only when it fails.
    major, torch_major = toolkit_cuda_major(cuda_home), int(torch.version.cuda.split(".")[0])
    if major is not None and major != torch_major:
        fail(f"the CUDA toolkit at {cuda_home} is CUDA {major}, but torch {torch.__version__} was built with CUDA "
             f"{torch.version.cuda} and builds extensions only with a toolkit of that major version: set CUDA_HOME to "
             f"a CUDA {torch_major} toolkit, or GRADSYNC_CUDA=0 for a CPU build")
    return True


def find_nccl():
    """(include dir, lib dir) of the NCCL that torch itself loads: the nvidia-nccl wheel beside torch,
    else NCCL_HOME, else an nvidia-nccl wheel elsewhere on the path, else a system NCCL. At run time
    the process has one libnccl.so.2, torch's: headers of another NCCL could name what it lacks."""
    roots = [Path(torch.__file__).resolve().parents[1] / "nvidia" / "nccl"]
    if os.environ.get("NCCL_HOME"):  # before other packages' copies: a torch built against this NCCL
        roots.append(Path(os.environ["NCCL_HOME"]))
    roots += [Path(p) / "nvidia" / "nccl" for p in sys.path if p]
    roots += [Path("/usr"), Path("/usr/local")]
    for root in roots:
        include = root / "include"
        for lib in (root / "lib", root / "lib64", root / "lib" / "x86_64-linux-gnu"):
            if (include / "nccl.h").exists() and (lib / "libnccl.so.2").exists():
                print(f"gradsync build: NCCL from {root}", file=sys.stderr)
                return str(include), str(lib)
    fail("NCCL not found: install the nvidia-nccl package that torch uses (e.g. pip install nvidia-nccl-cu13) "
         "or set NCCL_HOME to a folder with include/nccl.h and lib/libnccl.so.2")


def torch_release():
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_tag():
    major, minor = torch_release()
    return f"torch{major}.{minor}", f"{major}.{minor}"


def write_build_info(package_dir, version, flavour, arch_list):
    text = (
        "# Written by setup.py at build time.\n"
        f"version = {version!r}\n"
        f"from_sdist = {FROM_SDIST!r}\n"
        f"flavour = {flavour!r}\n"
        f"torch_version = {torch.__version__!r}\n"
        f"cuda_version = {torch.version.cuda if flavour != 'cpu' else None!r}\n"
        f"cuda_arch_list = {arch_list!r}\n"
    )
    (Path(package_dir) / "_build_info.py").write_text(text)


def sdist_version():
    """The version an unpacked sdist was made with (its PKG-INFO)."""
    for line in (ROOT / "PKG-INFO").read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    fail("PKG-INFO names no version")


def main():
    packages = find_packages(include=["gradsync", "gradsync.*"])
    if MAKING_SDIST:
        setup(name="gradsync", version=BASE_VERSION, packages=packages, install_requires=["torch"])
        return
    if torch_release() < MIN_TORCH:
        fail(f"gradsync needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or later (the oldest it is checked against), "
             f"found {torch.__version__}")
    forced = forced_cuda()
    cuda_home = find_cuda_home(forced)
    with_cuda = want_cuda(cuda_home, forced)
    if with_cuda:
        os.environ["CUDA_HOME"] = cuda_home  # must be set before cpp_extension is imported
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):  # empty as unset: torch would guess from the GPUs seen
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    sources = read_sources()
    tag, torch_minor = torch_tag()
    # torch picks the C++ standard it needs. No fused multiply-add contraction: the CPU (scalar and
    # AVX2) and CUDA kernels must round every product and sum the same way to stay bitwise twins.
    # -g0 overrides the -g of Python's own CFLAGS: debug info made the library 23 MB, not 0.9 MB
    cxx_flags = ["-O3", "-g0", "-fvisibility=hidden", "-ffp-contract=off"]
    # at::parallel_for is inline: without -fopenmp it runs every CPU kernel on one thread. Linked as
    # libgomp.so.1, which resolves to the copy torch has already loaded: one OpenMP thread pool.
    # (GCC's flag; torch's macOS wheels bring an OpenMP that needs others)
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() and sys.platform.startswith("linux") else []
    cxx_flags += openmp
    include_dirs = [str(ROOT / "csrc")]
    if with_cuda:
        flavour = "cu" + torch.version.cuda.replace(".", "")
        nccl_include, nccl_lib = find_nccl()
        arch_list = os.environ["TORCH_CUDA_ARCH_LIST"]
        ext = CUDAExtension(
            "gradsync._C",
            sources=sources["core"] + sources["cuda"] + sources["nccl"] + sources["bindings"],
            include_dirs=include_dirs + [nccl_include],
            define_macros=[("GRADSYNC_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo", "--fmad=false"]},
            extra_link_args=[f"-L{nccl_lib}", "-l:libnccl.so.2",
                             "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib", f"-Wl,-rpath,{nccl_lib}"] + openmp,
        )
    else:
        flavour, arch_list = "cpu", None
        ext = CppExtension("gradsync._C", sources=sources["core"] + sources["bindings"],
                           include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags}, extra_link_args=openmp)

    class BuildExt(BuildExtension.with_options(use_ninja=True)):
        """Always runs the build. torch forces it when it builds with ninja (which recompiles only
        what changed); without ninja setuptools would skip an extension whose library is newer than
        its .cpp and .cu files, though its headers, the torch it builds against or the flavour changed."""

        def finalize_options(self):
            super().finalize_options()
            self.force = True

        def run(self):
            super().run()
            # only once the build succeeded, beside the library it describes: a failed or other
            # flavour's build leaves an editable install's description alone
            inplace = self.inplace or getattr(self, "editable_mode", False)
            package_dir = ROOT / "gradsync" if inplace else Path(self.build_lib) / "gradsync"
            package_dir.mkdir(parents=True, exist_ok=True)
            write_build_info(package_dir, version, flavour, arch_list)

    version = sdist_version() if FROM_SDIST else f"{BASE_VERSION}+{flavour}{tag}"
    setup(
        name="gradsync",
        version=version,
        packages=packages,
        ext_modules=[ext],
        cmdclass={"build_ext": BuildExt},
        # built from an sdist, pip caches the wheel by the sdist alone and installs it again under
        # another torch: a pin would make pip replace that torch, where gradsync's import says what to do
        install_requires=["torch" if FROM_SDIST else f"torch=={torch_minor}.*"],
    )


main()
