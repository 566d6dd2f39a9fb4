"""Loads the compiled module gradsync._C after checking that it was built for the running torch.

A C++ extension is bound to the torch it was compiled against; under another torch it fails with an
undefined-symbol trace, so the mismatch is reported in terms a user can act on instead.
"""
import glob
import importlib
import os
import platform
import re
import sys

import torch


def rebuild_hint(package_dir, for_torch=True):
    """What rebuilds the gradsync at ``package_dir`` (for the running torch)."""
    root = os.path.dirname(package_dir)
    if os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc")):
        # a source folder's own build (pip install -e) comes first on the path there, whatever is installed
        return (f"this is the build inside the source folder {root}, which shadows any installed gradsync there: "
                f"rebuild it with pip install --no-build-isolation --no-deps -e {root}, or import gradsync from "
                "another folder")
    return (f"reinstall it{' against the running torch' if for_torch else ''}: pip install --no-build-isolation "
            "--no-deps --force-reinstall --no-cache-dir gradsync (or . in its source folder; pip's cache may hold a "
            "wheel built for another torch)")


def _minor(version):
    return ".".join(version.split("+")[0].split(".")[:2])


def incompatibility(built_torch, built_cuda, running_torch, running_cuda):
    """Why an extension built for (built_torch, built_cuda) cannot load under the running torch, or None."""
    if _minor(built_torch) != _minor(running_torch):
        return f"it was built for torch {built_torch} but torch {running_torch} is installed"
    if built_cuda is not None and running_cuda is None:
        return f"it was built for the CUDA {built_cuda} build of torch {built_torch} but torch {running_torch} is a CPU build"
    if built_cuda is not None and built_cuda.split(".")[0] != running_cuda.split(".")[0]:  # another CUDA runtime
        return f"it was built for CUDA {built_cuda} but torch {running_torch} runs CUDA {running_cuda}"
    return None


def load_failure(error, build_info, package_dir):
    """What to tell a user whose gradsync._C, built for the running torch, failed to import with ``error``."""
    text = str(error)
    where = f"gradsync {build_info.version} at {package_dir} (built for torch {build_info.torch_version})"
    reinstall = rebuild_hint(package_dir, for_torch=False)
    if "gradsync._C" in text and isinstance(error, ModuleNotFoundError):
        others = [os.path.basename(f) for f in glob.glob(os.path.join(package_dir, "_C.*"))
                  if f.endswith((".so", ".pyd"))]
        if others:
            return (f"{where} has no compiled module that this Python ({sys.implementation.cache_tag} on "
                    f"{platform.machine()}) can load, only {', '.join(others)}: it was built for another Python or "
                    f"machine; {reinstall}")
        return (f"{where} has no compiled module gradsync._C beside its build record: the build or install was "
                f"interrupted; {reinstall}")
    symbol = re.search(r"undefined symbol: (\S+)", text)
    if symbol and symbol.group(1).startswith("nccl"):
        return (f"{where} failed to load: {text}; the libnccl.so.2 this process loaded is older than the NCCL it "
                "was compiled against: take out of LD_LIBRARY_PATH an NCCL other than the nvidia-nccl package "
                f"torch depends on, or {reinstall}")
    if symbol and symbol.group(1).startswith("_Z"):  # a C++ symbol: the ABI of another torch build of that version
        return (f"{where} failed to load under torch {torch.__version__}: {text}; it was compiled against another "
                f"build of that torch: {rebuild_hint(package_dir)}")
    if symbol:
        return (f"{where} failed to load: {text}; a library it links is older than the one it was compiled "
                f"against: update that library, or {reinstall}")
    missing = re.search(r"(lib[\w.+-]*\.so[\w.]*): cannot open shared object file", text)
    if missing and missing.group(1).startswith("libnccl"):
        major = (build_info.cuda_version or "13").split(".")[0]
        return (f"{where} failed to load: {text}; this CUDA build runs the NCCL torch loads, from the nvidia-nccl "
                f"package beside torch (pip install nvidia-nccl-cu{major}) or a libnccl.so.2 on LD_LIBRARY_PATH")
    if missing:
        return (f"{where} failed to load: {text}; a library it links is not on the loader's path (LD_LIBRARY_PATH), "
                f"or install it; else {reinstall}")
    return f"{where} failed to load: {text}; {reinstall}"


def read_build_info():
    """gradsync._build_info, the record setup.py writes of what this gradsync was built for."""
    try:
        build_info = importlib.import_module("gradsync._build_info")
    except ModuleNotFoundError as e:
        if e.name != "gradsync._build_info":
            raise
        raise ImportError("gradsync is not built: install it with pip install --no-build-isolation . "
                          "(or import it from outside its source folder)") from None
    except Exception as e:  # a file damaged on disk or by hand is a reinstall, not a traceback into it
        raise _damaged(e) from e
    kinds = {"version": str, "flavour": str, "torch_version": str, "cuda_version": (str, type(None)),
             "cuda_arch_list": (str, type(None))}
    for name, kind in kinds.items():
        if not isinstance(getattr(build_info, name, None), kind):
            raise _damaged(f"{name} is {getattr(build_info, name, 'missing')!r}")
    return build_info


def _damaged(why):
    package_dir = os.path.dirname(os.path.abspath(__file__))
    return ImportError(f"gradsync's build record {os.path.join(package_dir, '_build_info.py')} is damaged ({why}); "
                       f"{rebuild_hint(package_dir, for_torch=False)}")


def load():
    build_info = read_build_info()
    package_dir = os.path.dirname(os.path.abspath(__file__))  # its _build_info and _C beside it
    reason = incompatibility(build_info.torch_version, build_info.cuda_version, torch.__version__, torch.version.cuda)
    if reason:
        raise ImportError(f"gradsync {build_info.version} at {package_dir} cannot be loaded: {reason}; "
                          f"{rebuild_hint(package_dir)}")
    try:
        return build_info, importlib.import_module("gradsync._C")
    except ImportError as e:
        raise ImportError(load_failure(e, build_info, package_dir)) from e


def diagnosing():
    """Whether gradsync is being imported so that runpy can run gradsync.report as a script
    (``python -m gradsync.report``, also under pdb or cProfile), which must run when the extension cannot load."""
    # runpy imports a module's packages while it looks for the module: its innermost frame names that module
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "runpy" and "mod_name" in frame.f_code.co_varnames:
            return frame.f_locals.get("mod_name") == "gradsync.report"
        frame = frame.f_back
    return False
