"""What one hop of gradsync's GPU ring costs the host, and how long it takes, over NCCL.

    python benchmarks/bench_nccl_hop.py [--json out.json]

A one-rank NCCL communicator sends to itself, so one GPU suffices: each hop is issued as the ring
issues it (events, a group of one send and one receive, the fp16 reduce kernel). "issue" is the
host's time per hop, "complete" the time per hop until the GPU has run them all. gradsync's
communicator is non-blocking (abortable); the same hops on a blocking one (NCCL_COMM_BLOCKING=1, in
a second process) show what that costs. gradsync.model assumes 40 us of host per hop (GPU_HOP_HOST).
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

SIZES = [4 << 10, 256 << 10, 4 << 20]


def measure(device, hops, repeats):
    rows = []
    for size in SIZES:
        samples = [_C._nccl_hop_cost(device, hops, size) for _ in range(repeats)]
        rows.append({"bytes": size, "hops": hops,
                     "issue_us": statistics.median(s["issue_s"] for s in samples) * 1e6,
                     "complete_us": statistics.median(s["complete_s"] for s in samples) * 1e6})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--hops", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # the blocking run's child
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_nccl_hop.py needs a GPU")
    rows = measure(args.device, args.hops, args.repeats)
    if args.rows_only:
        print(json.dumps(rows))
        return
    mode = "blocking" if os.environ.get("NCCL_COMM_BLOCKING", "").strip() == "1" else "non-blocking"
    for r in rows:
        r["communicator"] = mode
    child = subprocess.run([sys.executable, __file__, "--rows-only", "--device", str(args.device), "--hops",
                            str(args.hops), "--repeats", str(args.repeats)],
                           env={**os.environ, "NCCL_COMM_BLOCKING": "1"}, capture_output=True, text=True, timeout=300)
    if child.returncode == 0:
        rows += [{**r, "communicator": "blocking"} for r in json.loads(child.stdout.strip().splitlines()[-1])]
    else:
        print(f"# the blocking run failed:\n{child.stderr[-2000:]}", file=sys.stderr)
    print(f"# {torch.cuda.get_device_name(args.device)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} "
          f"(torch's), gradsync {gradsync.__version__}; {args.hops} hops, median of {args.repeats}")
    print(f"{'payload':>10} {'communicator':>14} {'issue (us/hop)':>15} {'complete (us/hop)':>18}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['communicator']:>14} {r['issue_us']:>15.1f} {r['complete_us']:>18.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(args.device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
