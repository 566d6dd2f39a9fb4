"""The benchmark harness: timing, the nccl-tests-style table, JSON and PNG output.

Each benchmark supplies cases and ops; this module owns how they are timed and reported.
"""
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from gradsync.demo import plot_path_problem, unwritable_folder_problem


@dataclass
class Row:
    case: str
    op: str
    count: int          # elements
    tensors: int
    bytes_moved: int    # bytes read + written: what the fused op must move (see each benchmark)
    time_ms: float
    gbps: float = 0.0
    pct_copy: float = 0.0
    speedup: float = 0.0  # vs the case's baseline op (torch), same run
    error: Optional[float] = None  # relative L2 error vs an fp64 reference, where measured
    extra: dict = field(default_factory=dict)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, device, *, warmup=2, repeats=7, min_time_s=0.2):
    """Median wall time of fn() in milliseconds; CUDA ops are timed with events."""
    for _ in range(warmup):
        fn()
    sync(device)
    # enough inner iterations that one sample lasts at least min_time_s / repeats
    t0 = time.perf_counter()
    fn()
    sync(device)
    single = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, int(min_time_s / repeats / single))
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            # on the device's stream, where the ops run (not the current device's, if another)
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(inner):
                fn()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples)


def machine_description(device):
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def format_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def print_table(title, records, columns):
    """nccl-tests-style fixed-width table. columns: (header, key, width, format) per column; records:
    dataclasses or dicts."""
    def value(r, key):
        return r[key] if isinstance(r, dict) else getattr(r, key)
    def cell(i, text, width, fmt):  # text columns flush left, numbers flush right
        if fmt is not str:
            return f"{text:>{width}}"
        return f"{text:<{width}}" if i == 0 else f"  {text:<{width - 2}}"
    print(f"# {title}")
    print("".join(cell(i, h, w, fmt) for i, (h, _, w, fmt) in enumerate(columns)))
    for r in records:
        print("".join(cell(i, fmt(value(r, key)), width, fmt) for i, (_, key, width, fmt) in enumerate(columns)))


def fixed(digits):
    return lambda v: f"{v:.{digits}f}"


def ratio(v):
    return f"{v:.2f}x" if v else "-"


def sci(v):  # "-": not measured; an exact result prints 0
    return "-" if v is None else "0" if v == 0 else f"{v:.2e}"


KERNEL_COLUMNS = [("case", "case", 14, str), ("op", "op", 32, str), ("count", "count", 12, fixed(0)),
                  ("tensors", "tensors", 8, fixed(0)), ("moved", "bytes_moved", 10, format_bytes),
                  ("time(ms)", "time_ms", 11, fixed(3)), ("GB/s", "gbps", 9, fixed(1)), ("%copy", "pct_copy", 7, fixed(0)),
                  ("speedup", "speedup", 9, ratio), ("error", "error", 10, sci)]


def check_output_folders(parser, args, *options, prefix=False):
    """A usage error now, not after the run: each output given names a file (``prefix``: the start of
    the files' names) in a folder that exists."""
    for option in options:
        path = getattr(args, option.lstrip("-").replace("-", "_"))
        if path and (path.endswith(os.sep) or (os.path.isdir(path) and not prefix)):
            parser.error(f"{option} {path}: a folder; give {'the start of a file name' if prefix else 'a file name'} "
                         f"in it ({os.path.join(path, 'results')}{'' if prefix else '.json'})")
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            parser.error(f"{option} {path}: the folder {folder} does not exist")
        problem = None if not path else plot_path_problem(path) if option == "--plot" else \
            unwritable_folder_problem(folder)
        if problem:
            parser.error(f"{option} {path}: {problem}")


def check_launched(parser):
    """A usage error, not torch's traceback, for a script started without torchrun (which sets the
    variables a process group starts from)."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        parser.error(f"start it with torchrun (torchrun --nproc-per-node N {parser.prog} ...): "
                     f"{', '.join(missing)} not set")


def write_json(path, title, rows, meta):
    """Writes whole or not at all: a run stopped while writing leaves the last complete file."""
    with open(f"{path}.partial", "w") as f:
        json.dump({"title": title, "meta": meta, "rows": [r if isinstance(r, dict) else asdict(r) for r in rows]}, f,
                  indent=1)
    os.replace(f"{path}.partial", path)


def plot(path, title, rows, *, x="bytes_moved", y="gbps", group="op", xlabel=None, ylabel=None, shade_above=None):
    """A line per ``group``; ``shade_above=(x0, label)`` greys the points past x0 and says why."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"# matplotlib is not installed: no plot written to {path}")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    get = lambda r, k: r[k] if isinstance(r, dict) else getattr(r, k)  # noqa: E731
    for name in dict.fromkeys(get(r, group) for r in rows):
        pts = sorted((get(r, x), get(r, y)) for r in rows if get(r, group) == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log")
    if shade_above is not None:
        lo, hi = ax.get_xlim()
        ax.axvspan(shade_above[0], hi, color="grey", alpha=0.2, label=shade_above[1])
        ax.set_xlim(lo, hi)
    ax.set_xlabel(xlabel or x.replace("_", " "))
    ax.set_ylabel(ylabel or y)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
