"""gradsync's demo: one small transformer trained under fp32 DDP, torch's fp16 hook, gradsync's hooks
and gradsync.DataParallel, side by side.

    python -m gradsync.demo                       # 2 local processes: NCCL across the GPUs if there
                                                  # are enough, else gloo on CPU
    python -m gradsync.demo --steps 100 --plot losses.png
    torchrun --nproc-per-node 4 -m gradsync.demo

Every mode starts from the same weights and sees the same batches, so the last column (largest
parameter difference from fp32 DDP) shows what each wire format costs. Bytes per step are what one
rank sends in a ring all-reduce of all gradients: 2(n-1)/n times the encoded gradient size.
"""
import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync import hooks

VOCAB, SEQ, WIDTH, LAYERS, HEADS = 24, 32, 64, 2, 4

# mode: (how to wrap the model, wire bytes per gradient element)
MODES = {
    "fp32 DDP": ("ddp", 4),
    "torch fp16 hook": ("torch_fp16", 2),
    "gradsync fp16 hook": ("gs_fp16", 2),
    "gradsync bf16 hook": ("gs_bf16", 2),
    "gradsync fp8+EF hook": ("gs_fp8_ef", 1 + 4 / 128),
    "gradsync.DataParallel fp16": ("dp_fp16", 2),
}


class TinyLM(torch.nn.Module):
    """A two-layer causal transformer language model."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens):
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


class Language:
    """A fixed random second-order Markov source: each pair of tokens allows a few successors."""

    def __init__(self, seed=1234, branching=2):
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, VOCAB, (VOCAB, VOCAB, branching), generator=g)
        self.entropy = math.log(branching)

    def batch(self, rows, generator):
        seq = torch.empty(rows, SEQ + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(0, VOCAB, (rows, 2), generator=generator)
        choice = torch.randint(0, self.successors.shape[2], (rows, SEQ + 1), generator=generator)
        for t in range(2, SEQ + 1):
            seq[:, t] = self.successors[seq[:, t - 2], seq[:, t - 1], choice[:, t]]
        return seq[:, :-1], seq[:, 1:]


def wrap(model, kind, device):
    ids = [device.index] if device.type == "cuda" else None
    if kind == "dp_fp16":
        return gradsync.DataParallel(model, codec="fp16")
    ddp = DDP(model, device_ids=ids)
    state_and_hook = {
        "torch_fp16": (None, default_hooks.fp16_compress_hook),
        "gs_fp16": (None, hooks.fp16_compress_hook),
        "gs_bf16": (None, hooks.bf16_compress_hook),
        "gs_fp8_ef": (hooks.GradSyncState(error_feedback=True), hooks.fp8_compress_hook),
    }.get(kind)
    if state_and_hook:
        ddp.register_comm_hook(*state_and_hook)
    return ddp


def train(kind, args, rank, world, device, language, log):
    torch.manual_seed(0)
    model = wrap(TinyLM().to(device), kind, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1 + rank)
    eval_tokens, eval_targets = language.batch(256, torch.Generator().manual_seed(99))
    losses, times = [], []
    for step in range(args.steps):
        tokens, targets = (t.to(device) for t in language.batch(args.batch, data))
        start = time.perf_counter()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if (step + 1) % max(1, args.steps // 4) == 0:
            log(f"  {step + 1:4d}/{args.steps} steps, loss {statistics.fmean(losses[-20:]):.3f}")
    model.eval()
    with torch.no_grad():
        final = float(F.cross_entropy(model(eval_tokens.to(device)).flatten(0, 1), eval_targets.to(device).flatten()))
    params = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
    return {"losses": losses, "step_ms": 1e3 * statistics.median(times[len(times) // 5:]), "final_loss": final,
            "params": params}


def run(args, rank, world):
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    log = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    language = Language()
    numel = sum(p.numel() for p in TinyLM().parameters())
    log(f"gradsync {gradsync.__version__} demo: {world} ranks on {device.type} ({dist.get_backend()}), "
        f"a {numel / 1e3:.0f}k-parameter "
        f"transformer, {args.steps} steps per mode")
    results = {}
    for mode in args.modes:
        kind, wire = MODES[mode]
        log(f"{mode}:")
        results[mode] = train(kind, args, rank, world, device, language, log)
        results[mode]["bytes"] = 2 * (world - 1) / world * wire * numel
    gradsync.shutdown()
    if rank == 0:
        report(results, args, language)


def report(results, args, language):
    name = "fp32 DDP" if "fp32 DDP" in results else next(iter(results))
    reference, header = results[name]["params"], f"max |dp| vs {name}"
    width = max(22, len(header) + 2)
    print(f"\n{'mode':<28}{'step (ms)':>10}{'bytes/step':>12}{'final loss':>12}{header:>{width}}")
    for mode, r in results.items():
        diff = float((r["params"] - reference).abs().max())
        print(f"{mode:<28}{r['step_ms']:>10.1f}{r['bytes'] / 1e6:>10.2f}MB{r['final_loss']:>12.4f}{diff:>{width}.2e}")
    print(f"(uniform guessing: loss {math.log(VOCAB):.3f}; the source's entropy: {language.entropy:.3f})")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = 10
    for mode, r in results.items():
        smooth = [statistics.fmean(r["losses"][max(0, i - window + 1): i + 1]) for i in range(len(r["losses"]))]
        ax.plot(smooth, label=mode, linewidth=1.2)
    ax.set(xlabel="step", ylabel="training loss (moving average)", title="gradsync demo: loss per wire format")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"loss curves: {args.plot}")


def backend_for(device):
    return "nccl" if device == "cuda" else "gloo"


def worker(rank, world, init_file, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")  # loopback
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend_for(args.device), init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        run(args, rank, world)
    finally:
        dist.destroy_process_group()


def plot_path_problem(path):
    """Why matplotlib's savefig would fail on `path` (in a folder that exists) or write elsewhere (it adds
    an extension to a name without one), if it would; None without matplotlib, when no plot is drawn."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.endswith(("/", os.sep)) or os.path.isdir(path) or \
            os.path.splitext(path)[1].lower().lstrip(".") not in formats:
        return f"give an image file name ending in one of {', '.join('.' + f for f in sorted(formats))}"
    return unwritable_folder_problem(os.path.dirname(os.path.abspath(path)))


def unwritable_folder_problem(folder):
    """Why no file can be written in `folder`, or None; tried, not read from permission bits (root passes
    those, and a read-only or pseudo file system does not show in them)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return f"cannot write in the folder {folder} ({e.strerror or e})"


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m gradsync.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="local processes to start (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cuda: one GPU per rank over NCCL (the default when every rank can have its own GPU); "
                        "cpu: gloo")
    p.add_argument("--plot", default="gradsync-demo.png", help="where to save the loss curves")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--nproc", args.nproc), ("--batch", args.batch)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if not 0 < args.lr < math.inf:
        p.error(f"--lr must be a positive number, got {args.lr}")
    folder = os.path.dirname(os.path.abspath(args.plot))
    if not os.path.isdir(folder):  # refused now, not after the training
        p.error(f"--plot {args.plot}: the folder {folder} does not exist")
    problem = plot_path_problem(args.plot)
    if problem:
        p.error(f"--plot {args.plot}: {problem}")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", args.nproc)))  # on this node
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device is None:  # the GPUs of this node, one per local rank
        args.device = "cuda" if gpus >= ranks else "cpu"
    elif args.device == "cuda" and gpus < ranks:  # NCCL refuses two ranks on one GPU
        p.error(f"--device cuda runs one rank per GPU over NCCL: {ranks} ranks on this node, {gpus} GPU(s) seen")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        p.error(f"{f'unknown mode(s) {unknown}' if unknown else 'no mode given'}; choose from: {', '.join(MODES)}")
    return args


def main(argv=None):
    args = parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend_for(args.device))
        try:
            run(args, dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory(prefix="gradsync-demo-") as folder:
        torch.multiprocessing.spawn(worker, args=(args.nproc, os.path.join(folder, "rendezvous"), args),
                                    nprocs=args.nproc, join=True)


if __name__ == "__main__":
    sys.exit(main())
