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
    build_info, ext = gradsync._build_info, gradsync._C
    info = ext.build_info() if ext is not None else None
    rows = [("gradsync", gradsync.__version__)]
    if build_info is not None:
        cuda = info["cuda"] if info is not None else build_info.cuda_version
        nccl = f"{ext.nccl_runtime_version()} (headers {info['nccl_compiled']})" if info is not None else \
            "unknown: the extension did not load"
        compiled_for = f"{cuda} (arch list {build_info.cuda_arch_list})" if cuda else "none (CPU build)"
        rows += [("build flavour", build_info.flavour),
                 ("CUDA compiled for", compiled_for),
                 ("NCCL linked", nccl if cuda else "none (CPU build)"),
                 ("torch built against", build_info.torch_version)]
    rows.append(("torch running", f"{torch.__version__} (CUDA {torch.version.cuda})" if torch.version.cuda
                 else torch.__version__))
    if info is not None:
        rows += [("CPU kernels", f"{ext.cpu_isa()} on {platform.machine()}, {ext.cpu_kernel_threads()} threads"),
                 ("fp8 block size", str(info["fp8_block_size"]))]
    rows += [("GPUs" if i == 0 else "", g) for i, g in enumerate(gpus())]
    if ext is None:
        rows.append(("extension", f"NOT LOADED: {gradsync._load_error}"))
    return table(rows)


def table(rows):
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


if __name__ == "__main__":
    argparse.ArgumentParser(prog="python -m gradsync.report", description=__doc__.partition(": ")[2]).parse_args()
    print(report())
    sys.exit(1 if gradsync._C is None else 0)
