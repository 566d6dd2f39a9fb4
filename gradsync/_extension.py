"""Loads the compiled module gradsync._C after checking that it was built for the running torch.

A C++ extension is bound to the torch it was compiled against; under another torch it fails with an
undefined-symbol trace, so the mismatch is reported in terms a user can act on instead.
"""
import importlib
import os

import torch


def rebuild_hint(package_dir):
    """What rebuilds the gradsync at ``package_dir`` for the running torch."""
    root = os.path.dirname(package_dir)
    if os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc")):
        # a source folder's own build (pip install -e) comes first on the path there, whatever is installed
        return (f"this is the build inside the source folder {root}, which shadows any installed gradsync there: "
                f"rebuild it with pip install --no-build-isolation --no-deps -e {root}, or import gradsync from "
                "another folder")
    return ("reinstall it against the running torch: pip install --no-build-isolation --no-deps --force-reinstall "
            "--no-cache-dir gradsync (or . in its source folder; pip's cache may hold a wheel built for another "
            "torch)")


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


def load():
    try:
        build_info = importlib.import_module("gradsync._build_info")
    except ImportError:
        raise ImportError("gradsync is not built: install it with pip install --no-build-isolation . "
                          "(or import it from outside its source folder)") from None
    package_dir = os.path.dirname(os.path.abspath(__file__))  # its _build_info and _C beside it
    reason = incompatibility(build_info.torch_version, build_info.cuda_version, torch.__version__, torch.version.cuda)
    if reason:
        raise ImportError(f"gradsync {build_info.version} at {package_dir} cannot be loaded: {reason}; "
                          f"{rebuild_hint(package_dir)}")
    try:
        return build_info, importlib.import_module("gradsync._C")
    except ImportError as e:
        raise ImportError(f"gradsync {build_info.version} at {package_dir} (built for torch "
                          f"{build_info.torch_version}) failed to load under torch {torch.__version__}: {e}; "
                          f"{rebuild_hint(package_dir)}") from e
