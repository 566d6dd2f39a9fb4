"""What one hop of gradsync's GPU ring costs the host, and how long it takes, over NCCL.

    python benchmarks/bench_nccl_hop.py [--json out.json]

A one-rank NCCL communicator sends to itself, so one GPU suffices. Each hop is issued as the ring
issues it (events, a group of one send and one receive, the fp16 reduce kernel): "issue" is the
host's time per hop issuing many back to back, "pipelined" the time per hop until the GPU has run
them all, "alone" one hop issued and waited for. A send to itself needs no NCCL proxy thread, so
these are lower bounds for a hop between two GPUs. gradsync's communicator is non-blocking (so that
it can be aborted); the same hops on a blocking one (NCCL_COMM_BLOCKING=1, a second process) show
what that costs. gradsync.model assumes 40 us of host per hop (GPU_HOP_HOST).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

import gradsync
from gradsync import _C

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SIZES = [4 << 10, 256 << 10, 4 << 20]
FIELDS = ("issue", "pipelined", "alone")


def measure(device, hops, repeats, communicator):
    samples = _C._nccl_hop_cost(device, hops, SIZES, repeats)
    rows = []
    for size in SIZES:
        mine = [s for s in samples if s["bytes"] == size]
        row = {"bytes": size, "hops": hops, "repeats": repeats, "communicator": communicator}
        row.update({f"{f}_us": statistics.median(s[f"{f}_s"] for s in mine) * 1e6 for f in FIELDS})
        rows.append(row)
    return rows


def print_rows(rows):
    for r in rows:
        print(f"{r['bytes']:>10} {r['communicator']:>14}" + "".join(f"{r[f + '_us']:>16.1f}" for f in FIELDS), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--hops", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--blocking-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    common.check_output_folders(parser, args, "--json")
    if not torch.cuda.is_available():
        sys.exit("bench_nccl_hop.py needs a GPU")
    if args.blocking_child:
        print(json.dumps(measure(args.device, args.hops, args.repeats, "blocking")))
        return
    meta = {"device": torch.cuda.get_device_name(args.device), "gradsync": gradsync.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    print(f"# {meta['device']}, NCCL {meta['nccl']} (torch's), gradsync {meta['gradsync']}; "
          f"{args.hops} hops, median of {args.repeats}; microseconds per hop")
    print(f"{'payload':>10} {'communicator':>14}" + "".join(f"{f:>16}" for f in FIELDS))
    rows = measure(args.device, args.hops, args.repeats, "non-blocking")
    print_rows(rows)

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    save()
    try:
        child = subprocess.run([sys.executable, __file__, "--blocking-child", "--device", str(args.device), "--hops",
                                str(args.hops), "--repeats", str(args.repeats)],
                               env={**os.environ, "NCCL_COMM_BLOCKING": "1"}, capture_output=True, text=True,
                               timeout=25)
    except subprocess.TimeoutExpired:
        sys.exit("# the blocking run did not finish within 25 s")
    if child.returncode != 0:
        sys.exit(f"# the blocking run failed:\n{child.stderr[-2000:]}")
    # the rows are the last line that is a JSON list: NCCL's own warnings may follow on stdout
    lists = [line for line in child.stdout.splitlines() if line.startswith("[{")]
    if not lists:
        sys.exit(f"# the blocking run printed no rows:\n{child.stdout[-2000:]}")
    blocking = json.loads(lists[-1])
    print_rows(blocking)
    rows += blocking
    save()


if __name__ == "__main__":
    main()
