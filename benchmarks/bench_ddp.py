"""Training-step benchmark: DDP's default all-reduce, torch's fp16 hook, gradsync's hooks and
gradsync.DataParallel on a model of GPT-2 small's parameter count.

    torchrun --nproc-per-node 2 benchmarks/bench_ddp.py [--params 124e6] [--layers 12] [--json out.json]

The model is a deep MLP (GPT-2 small's 124M parameters in 12 square layers) so that a CPU step is
dominated by gradient traffic as in real data parallelism, not by attention kernels. Rows are
measured in one run, the modes taking turns over two passes. Two extra rows show the overlap:
"compute only" (backward under no_sync, no communication) and "communication only" (gradsync fp16
all-reduces of the same buckets with no backward). When the gradsync fp16 hook's step is shorter than their sum,
communication ran while backward computed. The compiled rows run torch.compile(DataParallel(net))
(backend aot_eager), with its forward split at bucket boundaries, as DDP's is, and in one graph.
With many small layers (``--params 2e6 --layers 500``: 1,000 parameter tensors) the step measures
each wrapper's cost per parameter instead.
"""
import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import gradsync  # noqa: E402
from gradsync import hooks  # noqa: E402

COLUMNS = [("mode", "mode", 48, str), ("step(ms)", "step_ms", 10, common.fixed(1)),
           ("wire/step", "wire_bytes", 11, common.format_bytes), ("vs DDP", "speedup", 8, common.ratio),
           ("vs torch fp16", "vs_torch_fp16", 14, common.ratio)]


def deep_mlp(params, layers=12, device="cpu"):
    width = int((params / layers) ** 0.5)
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device), width


class Timeline:
    """Wraps a hook to record, per bucket, when its all-reduce was issued, when it completed, and its numel."""

    def __init__(self, hook):
        self.hook, self.events = hook, []
        self.__name__ = self.__qualname__ = "timeline_" + hook.__name__

    def __call__(self, state, bucket):
        issued, numel = time.perf_counter(), bucket.buffer().numel()

        def done(fut):
            self.events.append((issued, time.perf_counter(), numel))
            return fut.value()
        return self.hook(state, bucket).then(done)


TIMELINE = Timeline(hooks.fp16_compress_hook)


def overlap_hidden(compute, comm, hook):
    """The share of the shorter of compute and communication that the hook's step hid behind the other
    (at most 1), and its words. Measured apart, a part can come out longer than the whole step (noise,
    contention): that says all of it was hidden, and by how much the measurement disagrees."""
    hidden = (compute + comm - hook) / min(compute, comm)
    if hidden < 0:
        return hidden, f"nothing hidden: {_ms(hook - compute - comm)} ms more than the two apart"
    if hook < max(compute, comm):
        longer = "communication" if comm > compute else "compute"
        return 1.0, (f"all of the shorter one hidden; the step is {_ms(max(compute, comm) - hook)} ms shorter than "
                     f"{longer} alone, which was measured apart (noise or contention)")
    return hidden, f"{100 * hidden:.0f}% of the shorter one hidden"


def overlap(model, step, timeline):
    """(buckets done before the last one was issued, their count, ms of communication inside backward)."""
    timeline.events.clear()
    step(model)
    last_issue = max(issued for issued, _, _ in timeline.events)
    inside = sum(max(0.0, min(done, last_issue) - issued) for issued, done, _ in timeline.events)
    return sum(done <= last_issue for _, done, _ in timeline.events), len(timeline.events), 1e3 * inside


def wrapped(model, mode):
    if mode.startswith("gradsync.DataParallel fp16"):
        model = gradsync.DataParallel(model, codec="fp16", gradient_as_bucket_view=mode.endswith("bucket views"))
        if "compiled" in mode:
            torch._dynamo.reset()  # every instance compiles afresh, far from the recompile limit
            model = torch.compile(model, backend="aot_eager")
        return model
    ddp = DDP(model)
    hook = {"torch fp16 hook": (None, default_hooks.fp16_compress_hook),
            "gradsync fp16 hook": (None, TIMELINE),
            "gradsync bf16 hook": (None, hooks.bf16_compress_hook),
            "gradsync fp8 hook": (None, hooks.fp8_compress_hook),
            "gradsync fp8+EF hook": (hooks.GradSyncState(error_feedback=True), hooks.fp8_compress_hook)}.get(mode)
    if hook:
        ddp.register_comm_hook(*hook)
    return ddp


WIRE = {"DDP default (fp32)": 4, "torch fp16 hook": 2, "gradsync fp16 hook": 2, "gradsync bf16 hook": 2,
        "gradsync fp8 hook": 1 + 4 / 128, "gradsync fp8+EF hook": 1 + 4 / 128, "gradsync.DataParallel fp16": 2,
        "gradsync.DataParallel fp16, bucket views": 2, "gradsync.DataParallel fp16, compiled": 2,
        "gradsync.DataParallel fp16, compiled, one graph": 2}


def compiling(mode):
    """Where the first step compiles: a compiled DataParallel's forward is split at bucket boundaries
    (Dynamo's DDPOptimizer), but in the "one graph" mode."""
    if "compiled" not in mode:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(optimize_ddp=not mode.endswith("one graph"))


def _ms(value):
    """Three significant digits below 100 ms: whole milliseconds do not add up on steps of a few."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=124e6)
    parser.add_argument("--layers", type=int, default=12,
                        help="linear layers (two parameter tensors each); many small ones measure per-tensor overhead")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--json", help="write the rows as JSON here (rank 0)")
    args = parser.parse_args()
    if args.layers < 1 or args.batch < 1:
        parser.error(f"--layers and --batch must be at least 1, got {args.layers} and {args.batch}")
    if not args.layers <= args.params < math.inf:  # a layer of width w has about w * w parameters
        parser.error(f"--params must be at least --layers ({args.layers}) and finite, got {args.params}")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the modes alternate over two passes), got {args.steps}")
    common.check_output_folders(parser, args, "--json")
    common.check_launched(parser)

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cpu")
    mlp = functools.partial(deep_mlp, args.params, args.layers)
    meta, width = mlp(device="meta")
    numel = sum(p.numel() for p in meta.parameters())
    x = torch.randn(args.batch, width, generator=torch.Generator().manual_seed(rank))

    def step(model, sync=True):
        model.zero_grad(set_to_none=False)
        with (model.no_sync() if not sync else contextlib.nullcontext()):
            model(x).square().mean().backward()

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    # communication alone: gradsync fp16 all-reduces of the buckets the hook's last step sent, in its order
    buckets = []

    def communicate(check_call=False):  # as the hook calls it after a bucket's first step
        works = [gradsync.all_reduce(b, codec="fp16", async_op=True, check_call=check_call) for b in buckets]
        for w in works:
            w.wait()

    # One model at a time (memory); modes alternate over passes so that drifts hit all of them.
    samples = {mode: [] for mode in list(WIRE) + ["compute only (no_sync)", "communication only (gradsync fp16)"]}
    passes = 2
    for pass_ in range(passes):
        steps = args.steps // passes + (pass_ < args.steps % passes)
        for mode in WIRE:
            model = wrapped(mlp(device=device)[0], mode)
            with compiling(mode):
                step(model)  # warm-up (and compilation)
            samples[mode] += [timed(lambda: step(model)) for _ in range(steps)]
            if mode == "gradsync fp16 hook":
                timeline = overlap(model, step, TIMELINE)
            if mode == "DDP default (fp32)":
                samples["compute only (no_sync)"] += [timed(lambda: step(model, sync=False))
                                                      for _ in range(steps)]
            model = None  # one model in memory at a time
        if not buckets:
            buckets = [torch.randn(numel) for _, _, numel in sorted(TIMELINE.events)]
            communicate(check_call=True)  # warm-up: workspaces, connections, and the calls' agreement once
        samples["communication only (gradsync fp16)"] += [timed(communicate) for _ in range(steps)]
    # each mode's median step on the slowest rank
    slowest = torch.tensor([statistics.median(s) for s in samples.values()], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    medians = dict(zip(samples, slowest.tolist()))
    rows = []
    for mode, ms in medians.items():
        wire = 2 * (n - 1) / n * WIRE.get(mode, 2 if "communication" in mode else 0) * numel
        step = "only" not in mode  # the compute-only and communication-only rows are parts of a step
        rows.append({"mode": mode, "step_ms": ms, "wire_bytes": wire,
                     "speedup": medians["DDP default (fp32)"] / ms if step else None,
                     "vs_torch_fp16": medians["torch fp16 hook"] / ms if step else None})
    if rank == 0:
        title = (f"training step, {numel / 1e6:.3g}M-parameter MLP of {args.layers} layers ({args.batch} rows/rank), "
                 f"{n} ranks, gloo on "
                 f"{common.machine_description(device)}; gradsync {gradsync.__version__}")
        common.print_table(title, rows, COLUMNS)
        compute, comm = medians["compute only (no_sync)"], medians["communication only (gradsync fp16)"]
        hook = medians["gradsync fp16 hook"]
        hidden, hidden_text = overlap_hidden(compute, comm, hook)
        print(f"compute {_ms(compute)} ms + communication {_ms(comm)} ms = {_ms(compute + comm)} ms; gradsync fp16 "
              f"hook step {_ms(hook)} ms ({hidden_text})")
        print(f"overlap timeline (gradsync fp16 hook): {timeline[0]} of {timeline[1]} buckets finished their "
              f"all-reduce while backward was still computing; {timeline[2]:.0f} ms of communication ran during backward")
        if args.json:
            common.write_json(args.json, title, rows, {"ranks": n, "params": numel, "overlap_hidden": hidden,
                                                       "timeline": timeline,
                                                       "communication_only_buckets": [b.numel() for b in buckets],
                                                       "gradsync": gradsync.__version__, "torch": torch.__version__})
    gradsync.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
