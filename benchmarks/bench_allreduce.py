"""All-reduce benchmark: gradsync's ring with each codec vs torch.distributed on the same group.

    torchrun --nproc-per-node 4 benchmarks/bench_allreduce.py [--max-bytes 256M] [--json out.json] [--plot out.png]
    torchrun --nproc-per-node 8 benchmarks/bench_allreduce.py --accuracy      # error table at n = 2, 4, 8

gloo on CPU, NCCL for CUDA (--device cuda). Sizes are those of the fp32 gradient buffer. Columns as in
nccl-tests: algbw = S / t and busbw = algbw * 2(n-1)/n, both in fp32 bytes, so that a compressed
wire shows up as a higher bandwidth; error is the relative L2 error of the averaged result against
an fp64 all-reduce of the same inputs. Rows of one size are measured in one run, interleaved: the
implementations take turns in --rounds rounds, and each row is the interquartile mean of all its calls
on the slowest rank.
"""
import argparse
import functools
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import gradsync  # noqa: E402
from gradsync import hooks  # noqa: E402
from gradsync import model  # noqa: E402

# nccl-tests' columns and units (size in bytes, count in elements, time in us, bandwidths in GB/s),
# then gradsync's: the implementation, the bytes each rank's buffer takes on the wire, the speedup
COLUMNS = [("size(B)", "bytes", 12, common.fixed(0)), ("count", "count", 11, common.fixed(0)), ("type", "type", 7, str),
           ("redop", "redop", 7, str), ("impl", "impl", 26, str),
           ("time(us)", "time_ms", 12, lambda ms: f"{ms * 1e3:.1f}"), ("algbw(GB/s)", "algbw", 13, common.fixed(3)),
           ("busbw(GB/s)", "busbw", 13, common.fixed(3)), ("wire", "wire_bytes", 11, common.format_bytes),
           ("vs fp32", "speedup", 9, common.ratio), ("error", "error", 10, common.sci)]


ACCURACY_COLUMNS = [("ranks", "ranks", 6, common.fixed(0)), ("impl", "impl", 44, str),
                    ("rel L2 error", "error", 14, common.sci)]


def parse_bytes(text):
    """"64M", "4K", "1G" or a number of bytes (argparse turns the ValueError into a usage error)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if not text:
        raise ValueError("empty size")
    value = float(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)
    if not value < math.inf or value < 0:  # a comparison: math.isfinite overflows on a huge integer
        raise ValueError(f"not a size: {text}")
    return int(value)


def gradient_like(numel, rank, device, seed=0):
    """Per-rank data with magnitudes over four decades, varying along the buffer like real gradients."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g) * torch.pow(10.0, torch.empty(numel).uniform_(-3, 1, generator=g))
    return x.to(device)


def with_feedback(codec, group):
    """gradsync's all-reduce with error feedback: one fp32 residual per buffer size, kept across calls."""
    residuals = {}

    def run(x):
        if x.numel() not in residuals:
            residuals[x.numel()] = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        gradsync.all_reduce(x, codec=codec, group=group, residual=residuals[x.numel()])
    return run


def implementations(n, group, feedback=False, numel=None, device=None):
    """{name: (fn, the codec its wire carries, as gradsync.payload_nbytes names it)}; with a numel and
    CPU tensors that take gradsync's direct exchange, also gradsync fp16 through the ring ("gradsync
    fp16 ring") and without the agreement check ("gradsync fp16 unchecked"), side by side."""
    def torch_fp32(x):
        dist.all_reduce(x, group=group)
        x.div_(n)

    def torch_fp16_hook(x):  # what torch's fp16_compress_hook does to a bucket
        t = x.to(torch.float16).div_(n)
        dist.all_reduce(t, group=group)
        x.copy_(t)

    def through_the_ring(x):  # what small buffers take without the direct exchange
        saved = gradsync.distributed.DIRECT_BYTES
        gradsync.distributed.DIRECT_BYTES = 0
        try:
            gradsync.all_reduce(x, codec="fp16", group=group)
        finally:
            gradsync.distributed.DIRECT_BYTES = saved

    impls = {"torch fp32": (torch_fp32, "none"), "torch fp16 hook path": (torch_fp16_hook, "fp16")}
    for codec in gradsync.CODECS:
        impls[f"gradsync {codec}"] = (lambda x, c=codec: gradsync.all_reduce(x, codec=c, group=group), codec)
        if feedback and codec != "none":
            impls[f"gradsync {codec}+ef"] = (with_feedback(codec, group), codec)
    if numel and device is not None and device.type == "cpu" and \
            model.takes_direct_exchange(numel, n, "fp16", gradsync.distributed.DIRECT_BYTES):
        impls["gradsync fp16 ring"] = (through_the_ring, "fp16")
        # as the hooks and DataParallel call it after a bucket's first step
        unchecked = functools.partial(gradsync.all_reduce, codec="fp16", group=group, check_call=False)
        impls["gradsync fp16 unchecked"] = (unchecked, "fp16")
    return impls


def time_calls(fn, x, original, device, iters, group):
    """Seconds of `iters` calls, each on a fresh copy of the input, started together on every rank."""
    samples = []
    for _ in range(iters):
        x.copy_(original)
        common.sync(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn(x)
        common.sync(device)
        samples.append(time.perf_counter() - t0)
    return samples


def interquartile_mean(samples):
    """The mean of the middle half: blind to the rare call that waited for a core far longer (as a
    mean is not), and steady where calls fall into two modes of about equal weight (as a median is
    not: small all-reduces of four ranks on two cores do, and their medians jumped between the modes).
    Of fewer than 4 calls, the mean of them all."""
    s = sorted(samples)
    k = len(s) // 4
    middle = s[k:len(s) - k]
    return sum(middle) / len(middle)


def ninetieth_percentile(s):
    """The nearest-rank 90th percentile of sorted ``s``: the 9th of 10 calls, not the slowest."""
    return s[(9 * len(s) + 9) // 10 - 1]


def slowest_stats_ms(samples, device, group):
    """(interquartile mean, median, 90th percentile) in ms and the fraction of calls slower than twice
    the median, all four of the slowest rank (the one of the highest interquartile mean; the first
    of those, in a tie)."""
    s = sorted(samples)
    median = statistics.median(s)
    stats = [interquartile_mean(s), median, ninetieth_percentile(s),
             sum(t > 2 * median for t in s) / len(s)]
    t = torch.tensor(stats, dtype=torch.float64, device=device)  # NCCL moves CUDA tensors only
    every = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, t, group=group)
    iqm, p50, p90, slow = max((e.tolist() for e in every), key=lambda rank_stats: rank_stats[0])
    return iqm * 1e3, p50 * 1e3, p90 * 1e3, slow


def round_sizes(iters, rounds=None):
    """`iters` calls cut into `rounds` (at most `iters`, by default `iters`) nearly equal rounds."""
    rounds = iters if rounds is None else max(1, min(rounds, iters))
    return [iters // rounds + (r < iters % rounds) for r in range(rounds)]


def p2p_latency(device, iters=200):
    """Seconds one way for a 4-byte message between ranks 0 and 1 while the others wait: the median
    of `iters` ping-pongs, halved. (An all-reduce's small-message latency also holds every rank
    waking at once; this is the hop alone.)"""
    x, rank, samples = torch.zeros(1, device=device), dist.get_rank(), []
    dist.barrier()
    for _ in range(iters):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        common.sync(device)
        samples.append(time.perf_counter() - t0)
    dist.barrier()
    return statistics.median(samples) / 2


def nice_gloo_loops(niceness):
    """Runs this process's gloo TCP event-loop threads at `niceness`; returns how many there were.

    A loop thread polls epoll, which is level-triggered, and skips a pair whose lock another thread
    holds (one posting a send or a receive, or writing a payload), so it spins until that thread lets
    go (pytorch/gloo#246).
    Where ranks share cores, as the emulated hosts do, the spin takes a core from the ranks that
    would let go; a diagnostic, to tell that cost from the rest."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "gloo_tcp_loop":
                    continue
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
            count += 1
        except (FileNotFoundError, ProcessLookupError):  # a thread that has just ended
            pass
        except PermissionError:
            sys.exit(f"--gloo-loop-nice {niceness}: lowering a thread's niceness below its process's needs root "
                     "(CAP_SYS_NICE)")
    return count


def niceness(text):
    value = int(text)
    if not -20 <= value <= 19:  # the kernel would clamp it silently, and the JSON record the wrong one
        raise argparse.ArgumentTypeError(f"a niceness is -20 to 19, got {value}")
    return value


def relative_error(x, reference, group=None):
    err = torch.tensor([float((x.double() - reference).norm() ** 2), float(reference.norm() ** 2)], dtype=torch.float64,
                       device=x.device)
    dist.all_reduce(err, group=group)  # every rank holds the same result; summing keeps the ratio
    return float((err[0] / err[1]).sqrt()) if err[1] > 0 else 0.0


def bench(args, device, size_done):
    """The timed rows; `size_done(rows)` runs after each size with the rows so far."""
    n = dist.get_world_size()
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        numel = size // 4
        original = gradient_like(numel, dist.get_rank(), device)
        reference = original.double()
        dist.all_reduce(reference)
        reference /= n
        x = torch.empty_like(original)
        iters = min(args.max_iters, max(3, int(args.budget_bytes // max(size, 1))))  # --max-iters below 3 too
        impls = {name: impl for name, impl in implementations(n, None, args.feedback, numel, device).items()
                 if not args.impls or name == "torch fp32" or any(s in name for s in args.impls)}
        errors, samples = {}, {name: [] for name in impls}
        for name, (fn, _) in impls.items():
            x.copy_(original)
            fn(x)  # warm-up: workspaces, connections
            # error feedback pays over steps, not in one call: its first call is the codec's own ("-")
            errors[name] = None if name.endswith("+ef") else relative_error(x, reference)
        # The implementations take turns round by round, so that a slow spell of the machine (here a
        # second or so in which a rank waits for a core more than usual) falls on all of them.
        for calls in round_sizes(iters, args.rounds):
            for name, (fn, _) in impls.items():
                samples[name] += time_calls(fn, x, original, device, calls, None)
        base_ms = None
        for name, (_, wire_codec) in impls.items():
            ms, p50, p90, slow = slowest_stats_ms(samples[name], device, None)
            base_ms = ms if name == "torch fp32" else base_ms
            algbw = size / ms / 1e6
            rows.append({"bytes": size, "count": numel, "type": "float", "redop": "avg", "impl": name,
                         "time_ms": ms, "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n,
                         "wire_bytes": gradsync.payload_nbytes(wire_codec, numel),
                         "speedup": base_ms / ms if base_ms and name != "torch fp32" else 0.0, "error": errors[name],
                         "p50_ms": p50, "p90_ms": p90, "slow_calls": slow})
        size_done(rows)
        if dist.get_rank() == 0:
            print(f"# done: {common.format_bytes(size)}", file=sys.stderr, flush=True)
        size *= args.step
    return rows


def accuracy(device, numel=1 << 20):
    """Relative L2 error vs fp64 per codec in groups of 2, 4, 8 ranks (as many as the world has), and
    of the hierarchical average with nodes of 2 and 4 ranks."""
    world = dist.get_world_size()
    rows = []
    for n in (2, 4, 8):
        if n > world:
            break
        group = dist.new_group(list(range(n)))
        layouts = {per_node: node_groups(n, per_node) for per_node in (2, 4) if per_node < n}
        if dist.get_rank() >= n:
            continue
        original = gradient_like(numel, dist.get_rank(), device, seed=1)
        reference = original.double()
        dist.all_reduce(reference, group=group)
        reference /= n
        for name, (fn, _) in implementations(n, group).items():
            x = original.clone()
            fn(x)
            rows.append({"ranks": n, "impl": name, "error": relative_error(x, reference, group)})
        chunk, r = numel // n, dist.get_rank(group)
        mine = reference[r * chunk:(r + 1) * chunk]
        for name, fn in scatter_implementations(n, group).items():
            rows.append({"ranks": n, "impl": name, "error": relative_error(fn(original[:chunk * n]), mine, group)})
        for per_node, (local, cross) in layouts.items():
            for codec in ("fp16", "bf16", "fp8_e4m3"):
                x = original.clone()
                hooks.hierarchical_average(x, local, cross, codec).wait()
                rows.append({"ranks": n, "impl": f"hierarchical {n // per_node}x{per_node}: gradsync {codec}",
                             "error": relative_error(x, reference, group)})
    return rows


def node_groups(n, per_node):
    """(this rank's node group, its group across the nodes) among ranks 0..n-1, nodes of per_node
    consecutive ranks; made by every rank of the world, each rank's pair returned (None past n)."""
    rank = dist.get_rank()
    local = [dist.new_group(list(range(s, s + per_node))) for s in range(0, n, per_node)]
    cross = [dist.new_group(list(range(p, n, per_node))) for p in range(per_node)]
    return (local[rank // per_node], cross[rank % per_node]) if rank < n else (None, None)


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13


def scatter_implementations(n, group):
    """Reduce-scatters of fp32 gradients into a fresh shard (FSDP2's gradient reduction): torch's in a
    16-bit reduce_dtype (the cast, a sum in that dtype at every hop, the division in it) and gradsync's
    rings with 16- and 8-bit wires (fp32 sums)."""
    def torch_in(dtype):
        def run(x):
            out = torch.empty(x.numel() // n, dtype=dtype, device=x.device)
            _reduce_scatter(out, x.to(dtype), group=group)
            return out.div_(n).float()
        return run

    def gradsync_on(codec):
        def run(x):
            out = torch.empty(x.numel() // n, device=x.device)
            gradsync.reduce_scatter(out, x, codec=codec, group=group)
            return out
        return run
    impls = {"reduce-scatter: torch bf16": torch_in(torch.bfloat16), "reduce-scatter: torch fp16": torch_in(torch.float16)}
    for codec in ("none", "bf16", "fp16", "fp8_e4m3"):
        impls[f"reduce-scatter: gradsync {codec}"] = gradsync_on(codec)
    return impls


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1K"))
    parser.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("256M"))
    parser.add_argument("--step", type=int, default=4, help="size multiplier between rows")
    parser.add_argument("--budget-bytes", type=parse_bytes, default=parse_bytes("1G"),
                        help="iterations per row: about this many bytes, at least 3 (or --max-iters if fewer), "
                        "at most --max-iters")
    parser.add_argument("--max-iters", type=int, default=200,
                        help="small messages are latency-bound and their times scatter (a rank waits for a core "
                             "now and then): a row of fewer than ~200 calls moved by +-30 %% between runs")
    parser.add_argument("--rounds", type=int, default=None,
                        help="the implementations take turns in this many rounds of each size's iterations (default: "
                             "one call each per round; 1: each runs all its calls at once, which lets a slow spell of "
                             "the machine fall on one row: rows of 256 KB or less then moved by up to 56 %% between "
                             "runs, against 18-22 %% interleaved: results/2026-12-01-netem-interleaving.json)")
    parser.add_argument("--impls", nargs="*",
                        help="only implementations whose name contains one of these (and torch fp32, the baseline)")
    parser.add_argument("--feedback", action="store_true",
                        help="also time every compressing codec with error feedback (+ef: a residual kept across calls)")
    parser.add_argument("--accuracy", action="store_true", help="print the accuracy table at n = 2, 4, 8 instead")
    parser.add_argument("--gloo-loop-nice", type=niceness, default=None, metavar="N",
                        help="run gloo's TCP event-loop threads at niceness N, -20 to 19 (a diagnostic: see "
                             "nice_gloo_loops)")
    parser.add_argument("--json", help="write the rows as JSON here (rank 0)")
    parser.add_argument("--plot", help="write a PNG of busbw vs size here (rank 0)")
    args = parser.parse_args()
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.max_iters < 1:
        parser.error(f"--max-iters must be at least 1, got {args.max_iters}")
    if args.step < 2:
        parser.error(f"--step must be at least 2, got {args.step}")
    if args.min_bytes < 4 or args.min_bytes % 4 or args.max_bytes < args.min_bytes:
        parser.error(f"--min-bytes must be a positive multiple of 4 bytes (fp32 elements) and at most --max-bytes, "
                     f"got {args.min_bytes} and {args.max_bytes}")
    if args.impls and args.accuracy:
        parser.error("--impls selects timed rows; --accuracy measures every implementation")
    timed_only = [option for option in ("min_bytes", "max_bytes", "step", "budget_bytes", "max_iters", "rounds",
                                        "feedback", "gloo_loop_nice")
                  if getattr(args, option) != parser.get_default(option)]
    if args.accuracy and timed_only:
        parser.error(f"--accuracy measures 1M elements per rank, every codec once; "
                     f"{', '.join('--' + o.replace('_', '-') for o in timed_only)} shape the timed table only")
    if args.impls:
        names = list(implementations(2, None, args.feedback, 1, torch.device(args.device)))  # every name there is
        if not any(s in name for name in names for s in args.impls):
            parser.error(f"--impls {' '.join(args.impls)} matches none of: {', '.join(names)}")
    if args.accuracy and args.plot:
        parser.error("--plot draws the timed table; --accuracy has none")
    common.check_output_folders(parser, args, "--json", "--plot")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no GPU")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    common.check_launched(parser)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    if args.accuracy and n < 2:
        sys.exit("--accuracy compares groups of 2, 4 and 8 ranks: start at least 2 (torchrun --nproc-per-node 2)")
    if args.impls and not args.accuracy:  # rows that exist only at some sizes ("ring", "unchecked")
        names, size = set(), args.min_bytes
        while size <= args.max_bytes:
            names |= set(implementations(n, None, args.feedback, size // 4, device))
            size *= args.step
        if not any(s in name for name in names for s in args.impls):
            sys.exit(f"--impls {' '.join(args.impls)}: no such row at {n} ranks from "
                     f"{common.format_bytes(args.min_bytes)} to {common.format_bytes(args.max_bytes)} (the ring and "
                     f"unchecked rows exist for CPU buffers that take gradsync's direct exchange: at most "
                     f"{model.DIRECT_EXCHANGE_RANKS} ranks, at most "
                     f"{common.format_bytes(gradsync.distributed.DIRECT_BYTES)} per rank on the wire)")
    if args.gloo_loop_nice is not None:
        dist.barrier()  # the default group's pairs and their loop threads exist
        if nice_gloo_loops(args.gloo_loop_nice) == 0:
            sys.exit("--gloo-loop-nice: this process has no thread named gloo_tcp_loop (the gloo of torch 2.12 "
                     "and earlier leaves its event-loop thread unnamed, that of 2.13 names it)")
    title = (f"all-reduce, {n} ranks, {dist.get_backend()} on {common.machine_description(device)}; "
             f"gradsync {gradsync.__version__}")
    meta = {"ranks": n, "backend": dist.get_backend(), "gradsync": gradsync.__version__, "torch": torch.__version__,
            "master_addr": os.environ.get("MASTER_ADDR")}  # a loopback address, or a network's (netem/run.sh)
    if args.accuracy:
        rows = accuracy(device)
        columns = ACCURACY_COLUMNS
    else:
        latency = p2p_latency(device) if n > 1 else None
        meta.update({"direct_bytes": gradsync.distributed.DIRECT_BYTES if device.type == "cpu" else 0,
                     "statistic": "interquartile mean of the calls (their mean, below 4 calls), slowest rank",
                     "rounds": args.rounds,
                     "spread": "p50_ms, p90_ms: median and 90th percentile of the calls; slow_calls: the fraction "
                               "slower than twice the median; each of the slowest rank (of the highest "
                               "interquartile mean)",
                     "gloo_loop_nice": args.gloo_loop_nice, "p2p_latency_us": None if latency is None else latency * 1e6})

        def size_done(rows):  # a run stopped at its time limit keeps the sizes it measured
            if rank == 0 and args.json:
                common.write_json(args.json, title, rows, meta)
        rows = bench(args, device, size_done)
        columns = COLUMNS
    if rank == 0:
        common.print_table(title, rows, columns)
        if not args.accuracy and latency is not None:
            print(f"# point-to-point latency, rank 0 <-> 1, 4 bytes: {latency * 1e6:.0f} us one way")
        if args.json and args.accuracy:  # the timed rows were written after each size
            common.write_json(args.json, title, rows, meta)
        if args.plot and not args.accuracy:
            common.plot(args.plot, title, rows, x="bytes", y="busbw", group="impl",
                        xlabel="fp32 gradient bytes", ylabel="busbw (GB/s of fp32 data)")
    gradsync.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
