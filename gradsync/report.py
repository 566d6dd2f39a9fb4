"""python -m gradsync.report: what this gradsync was built with and what it runs on."""
import argparse
import platform
import sys

import torch

import gradsync


def gpus():
    if not torch.cuda.is_available():
        return ["none visible"]
    rows = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        rows.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)")
    return rows


def report():
    """The report's text; without the compiled module, what the build recorded and why it did not load."""
    _build_info, _C = gradsync._build_info, gradsync._C
    if _C is None:
        return unloaded_report(_build_info)
    info = _C.build_info()
    cuda = info["cuda"]
    rows = [
        ("gradsync", gradsync.__version__),
        ("build flavour", _build_info.flavour),
        ("CUDA compiled for", f"{cuda} (arch list {_build_info.cuda_arch_list})" if cuda else "none (CPU build)"),
        ("NCCL linked", f"{_C.nccl_runtime_version()} (headers {info['nccl_compiled']})" if cuda else "none (CPU build)"),
        ("torch built against", _build_info.torch_version),
        ("torch running", f"{torch.__version__} (CUDA {torch.version.cuda})" if torch.version.cuda else torch.__version__),
        ("CPU kernels", f"{_C.cpu_isa()} on {platform.machine()}, {_C.cpu_kernel_threads()} threads"),
        ("fp8 block size", str(info["fp8_block_size"])),
    ]
    return table(rows + [("GPUs" if i == 0 else "", g) for i, g in enumerate(gpus())])


def unloaded_report(build_info):
    rows = [("gradsync", gradsync.__version__)]
    if build_info is not None:
        cuda = build_info.cuda_version
        compiled_for = f"{cuda} (arch list {build_info.cuda_arch_list})" if cuda else "none (CPU build)"
        rows += [("build flavour", build_info.flavour),
                 ("CUDA compiled for", compiled_for),
                 ("NCCL linked", "unknown: the extension did not load" if cuda else "none (CPU build)"),
                 ("torch built against", build_info.torch_version)]
    rows += [("torch running", f"{torch.__version__} (CUDA {torch.version.cuda})" if torch.version.cuda
              else torch.__version__)]
    rows += [("GPUs" if i == 0 else "", g) for i, g in enumerate(gpus())]
    return table(rows + [("extension", f"NOT LOADED: {gradsync._load_error}")])


def table(rows):
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


if __name__ == "__main__":
    argparse.ArgumentParser(prog="python -m gradsync.report", description=__doc__.partition(": ")[2]).parse_args()
    print(report())
    sys.exit(1 if gradsync._C is None else 0)
