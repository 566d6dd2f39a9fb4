"""Kernel benchmark: gradsync's fused flatten+scale+cast and codecs vs torch's op sequences.

    python benchmarks/bench_kernels.py [--device cuda] [--max-mb 256] [--json out.json] [--plot out.png]

Cases: the parameter sets of GPT-2 124M (148 tensors) and ResNet-50 (161 tensors), and single
buffers of 4 MiB and up (buffer-4MB, buffer-16MB, ...: MB in a case's name counts 2^20 bytes).
GB/s counts the bytes the fused op must read and write: for the flatten and unflatten rows fp32 in,
16-bit out (6 bytes per element) whatever the op, so their GB/s ratios are time ratios; for the
codec rows fp32 in and the payload out. %copy compares with a device-to-device copy of a fp32
buffer of the case's size, measured in the same run (a small case fits in cache, so it is compared
with a copy that fits there too).
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import shapes  # noqa: E402

import gradsync  # noqa: E402

WORLD = 8  # the divisor of the simulated pre-division (1 / world size)


def make_tensors(shape_list, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(s, generator=g).to(device) for s in shape_list]


def copy_gbps(numel, device):
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = common.time_op(lambda: dst.copy_(src), device)
    return 8 * numel / ms / 1e6


def cupy_flatten(tensors):
    """A cupy ElementwiseKernel per tensor writing into one flat fp16 buffer (None without cupy, or
    with a cupy that cannot run here: its row is left out, the others are measured)."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        run = _cupy_flatten(cupy, tensors)
        run()  # compiles the kernel
        return run
    except Exception as error:  # noqa: BLE001 - e.g. a cupy built for another CUDA runtime
        print(f"# cupy row left out: {type(error).__name__}: {error}", flush=True)
        return None


def _cupy_flatten(cupy, tensors):
    cupy.cuda.Device(tensors[0].device.index).use()
    kernel = cupy.ElementwiseKernel("float32 x, float32 s", "float16 y", "y = (float16)(x * s)", "scale_cast")
    # the arrays are made once, as gradsync's row writes into a buffer it keeps: the timed calls are
    # the kernels alone
    out = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float16, device=tensors[0].device)
    flat = cupy.from_dlpack(out)
    pairs, offset = [], 0
    for t in tensors:
        pairs.append((cupy.from_dlpack(t.reshape(-1)), flat[offset:offset + t.numel()]))
        offset += t.numel()
    scale = cupy.float32(1.0 / WORLD)

    def run():
        for x, y in pairs:
            kernel(x, scale, y)
        return out
    return run


def bench_case(name, tensors, device, copy_rate):
    """The case's rows; %copy against `copy_rate`, a copy of the case's size."""
    n = sum(t.numel() for t in tensors)
    rows = []
    fused_bytes = 6 * n

    def add(op, fn, bytes_moved, baseline_ms=None, error=None):
        ms = common.time_op(fn, device)
        gbps = bytes_moved / ms / 1e6
        rows.append(common.Row(name, op, n, len(tensors), bytes_moved, ms, gbps, 100 * gbps / copy_rate,
                               baseline_ms / ms if baseline_ms else 0.0, error))
        return ms

    # the reference for the error column (relative L2 error): fp64 flatten + divide
    ref = torch.cat([t.double().flatten() for t in tensors]) / WORLD

    def rel_err(y):  # relative L2 error
        return float((y.double() - ref).norm() / ref.norm())

    # torch's sequence; _flatten_dense_tensors of a single tensor is a view, so copy explicitly
    # (as torch.cat does for many) rather than divide the caller's gradient in place
    torch_seq = lambda: torch.cat([t.view(-1) for t in tensors]).div_(WORLD).half()  # noqa: E731
    torch_ms = add("torch cat+div+half", torch_seq, fused_bytes, error=rel_err(torch_seq()))
    # gradsync writes into a buffer it keeps (as DataParallel's buckets and the ring's workspaces are);
    # torch's sequence allocates its results, as the fp16 hook does. The second row allocates too.
    out = torch.empty(n, dtype=torch.float16, device=device)
    fused = lambda: gradsync.flatten(tensors, dtype=torch.float16, scale=1.0 / WORLD, out=out)  # noqa: E731
    add("gradsync flatten(fp16)", fused, fused_bytes, torch_ms, rel_err(fused()))
    add("gradsync flatten(fp16), alloc",
        lambda: gradsync.flatten(tensors, dtype=torch.float16, scale=1.0 / WORLD), fused_bytes, torch_ms)
    cupy_run = cupy_flatten(tensors) if device.type == "cuda" else None
    if cupy_run is not None:
        add("cupy elementwise(fp16)", cupy_run, fused_bytes, torch_ms, rel_err(cupy_run()))

    # unflatten: fp16 flat -> fp32 tensors, times world (6 bytes per element)
    targets = [torch.empty_like(t) for t in tensors]

    def torch_unflatten():
        full = out.float().mul_(WORLD)
        offset = 0
        for t in targets:
            t.copy_(full[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    torch_un_ms = add("torch float+mul+copy back", torch_unflatten, fused_bytes)
    add("gradsync unflatten(fp16)", lambda: gradsync.unflatten(out, targets, scale=float(WORLD)), fused_bytes,
        torch_un_ms)

    # codecs on the flat fp32 gradient buffer
    flat32 = torch.cat([t.flatten() for t in tensors])
    for codec in ("fp16", "fp8_e4m3"):
        wire = gradsync.payload_nbytes(codec, n)
        payload = gradsync.compress(flat32, codec)
        decoded = gradsync.decompress(payload, codec, n, dtype=torch.float32)
        err = float(((decoded.double() - flat32.double()).norm() / flat32.double().norm()))
        add(f"gradsync compress({codec})", lambda c=codec, p=payload: gradsync.compress(flat32, c, out=p),
            4 * n + wire, error=err)
        add(f"gradsync decompress({codec})",
            lambda c=codec, p=payload: gradsync.decompress(p, c, n, out=decoded), 4 * n + wire)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-mb", type=int, default=None,
                        help="largest single buffer in MiB of fp32 (default: 1024 on CUDA, 256 on CPU)")
    parser.add_argument("--sets-only", action="store_true", help="only the GPT-2 and ResNet-50 parameter sets")
    parser.add_argument("--cases", nargs="*", help="only cases whose name contains one of these (gpt2, resnet50, "
                        "buffer-64MB, ...)")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--plot", help="write a PNG of GB/s vs size of the single buffers here")
    args = parser.parse_args()
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device: {error}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda[:index], got {args.device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no GPU")
        if device.index is None:  # set_device refuses a device without an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # torch's and cupy's kernels on that GPU, not the first one
    if args.max_mb is not None and args.max_mb < 4:
        parser.error(f"--max-mb must be at least 4 (the smallest single buffer), got {args.max_mb}")
    max_mb = args.max_mb or (1024 if device.type == "cuda" else 256)
    common.check_output_folders(parser, args, "--json", "--plot")
    cases = [("gpt2-124M", shapes.gpt2_small()), ("resnet50", shapes.resnet50())]
    if not args.sets_only:
        mb = 4
        while mb <= max_mb:
            cases.append((f"buffer-{mb}MB", [(mb * 2**20 // 4,)]))
            mb *= 4
    if args.cases:
        cases = [(name, shapes_) for name, shapes_ in cases if any(c in name for c in args.cases)]
        if not cases:
            parser.error(f"no case matches --cases {' '.join(args.cases)}")
    if args.plot and not any(name.startswith("buffer") for name, _ in cases):
        parser.error("--plot draws the single buffers (buffer-4MB, ...), and none is selected: leave out --sets-only, "
                     "or add one to --cases")
    largest = max(sum(math.prod(s) for s in shape_list) for _, shape_list in cases)
    copy_rate = copy_gbps(largest, device)  # what gradsync.model reads: a copy too large for any cache
    title = (f"gradsync kernels on {common.machine_description(device)}; CPU kernels: {gradsync._C.cpu_isa()}; "
             f"copy of the largest case {copy_rate:.1f} GB/s")
    rows = []
    for name, shape_list in cases:
        tensors = make_tensors(shape_list, device)
        n = sum(t.numel() for t in tensors)
        rows += bench_case(name, tensors, device, copy_rate if n == largest else copy_gbps(n, device))
        del tensors
        print(f"# done: {name}", file=sys.stderr, flush=True)
        if args.json:  # after every case: a run stopped at its time limit keeps what it measured
            common.write_json(args.json, title, rows, {"device": str(device), "copy_gbps": copy_rate,
                                                       "threads": torch.get_num_threads(),
                                                       "gradsync": gradsync.__version__, "torch": torch.__version__})
    common.print_table(title, rows, common.KERNEL_COLUMNS)
    if args.plot:
        common.plot(args.plot, title, [r for r in rows if r.case.startswith("buffer")], xlabel="bytes read + written",
                    ylabel="GB/s")


if __name__ == "__main__":
    main()
