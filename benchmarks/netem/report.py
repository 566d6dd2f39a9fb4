"""Combines the per-rate JSON of an emulated-cluster run (run.sh) into one JSON, a Markdown table and a PNG.

    python benchmarks/netem/report.py --out PREFIX DIR/rate-500mbit.json DIR/rate-1gbit.json ...

Each row gains the link rate, the effective algbw in fp32 bytes (S_fp32 / t) and the link-limited
lower bound of a ring all-reduce, t >= (2(n-1)/n * S_wire - burst) / rate, with the fraction of it
achieved. The shaper's bucket (tbf_burst_bytes) refills between calls and lets its burst pass at
once, so the bound takes it off (before 2026-12-05 it did not: "% of bound" read high by up to a
tenth at 4-16 MB, by 1-3 % at 64 MB), and is None where the bucket holds more than BUCKET_SHARE of a
host's traffic.
The targets of the emulated-cluster issue are checked at 1 Gbit/s on the largest size.
"""
import argparse
import datetime
import json
import os
import platform
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

from gradsync.model import tbf_burst_bytes  # noqa: E402  (the bucket run.sh gives tbf)

CPU_BOUND_ABOVE_BPS = 2e9
"""Above ~2 Gbit/s per host this 2-core machine, not the shaped link, limits the run."""

TARGETS = [  # (description, check(rows by impl) -> (measured text, met))
    ("gradsync fp16 >= 1.8x torch fp32", lambda r: _speedup(r, "gradsync fp16", 1.8)),
    ("gradsync fp8_e4m3 >= 3.3x torch fp32", lambda r: _speedup(r, "gradsync fp8_e4m3", 3.3)),
    ("gradsync fp8_e5m2 >= 3.3x torch fp32", lambda r: _speedup(r, "gradsync fp8_e5m2", 3.3)),
    ("gradsync none within 10 % of torch fp32",
     lambda r: (f"{r['gradsync none']['time_ms'] / r['torch fp32']['time_ms']:.3f}x the time",
                r["gradsync none"]["time_ms"] <= 1.10 * r["torch fp32"]["time_ms"])),
    ("every gradsync codec >= 85 % of its link bound", lambda r: _bound_target(r, 85)),
]


TARGET_IMPLS = ["torch fp32"] + [f"gradsync {c}" for c in ("none", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")]


def _bound_target(rows, pct):
    """Met, not met, or None where the size is too small for a bound (the shaper's bucket holds it)."""
    mine = {k.split()[1]: v["pct_bound"] for k, v in rows.items() if k.startswith("gradsync")}
    text = ", ".join(f"{codec} {_or_dash(p, '{:.1f} %')}" for codec, p in mine.items())  # 84.9 is not 85
    return text, None if None in mine.values() else all(p >= pct for p in mine.values())


def _speedup(rows, impl, target):
    return f"{rows[impl]['speedup']:.2f}x", rows[impl]["speedup"] >= target


def rate_bps(text):
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)(kbit|mbit|gbit)", text)
    bps = float(m[1]) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m[2]] if m else 0.0
    if bps < 1e3:
        raise ValueError(f"bad rate {text!r}: a number and kbit, mbit or gbit, at least 1kbit")
    return bps


BUCKET_SHARE = 0.1


def link_bound_s(n, wire_bytes, bps, burst_bytes=0):
    """The ring's link-limited lower bound: every host sends 2(n-1)/n of the wire bytes, less what
    the shaper's bucket (refilled between calls) lets through at once."""
    return max(0.0, 2 * (n - 1) / n * wire_bytes - burst_bytes) * 8 / bps


def check_run(path, run, ranks):
    """A run's rows as this report reads them: every one of its world size and measured, once each."""
    n = run["meta"]["ranks"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"{path}: meta.ranks is {n!r}, not a number of hosts of at least 2")
    if n != ranks:
        raise ValueError(f"{path} has {n} ranks where the runs before it have {ranks}: one cluster per report")
    if not run["rows"]:
        raise ValueError(f"{path} has no rows")
    seen = set()
    for r in run["rows"]:
        for key in ("bytes", "wire_bytes", "time_ms", "speedup"):  # torch fp32's own speedup is written as 0
            if isinstance(r[key], bool) or not isinstance(r[key], (int, float)) or \
                    not (0 < r[key] < float("inf") or key == "speedup" and r[key] == 0):
                raise ValueError(f"{path}: row {r['impl']} of {r['bytes']} bytes has {key} {r[key]!r}, not a "
                                 "positive number")
        if (r["impl"], r["bytes"]) in seen:
            raise ValueError(f"{path} has two rows of {r['impl']} at {r['bytes']} bytes (runs merged into one file?)")
        seen.add((r["impl"], r["bytes"]))


def load(paths):
    rows, meta = [], None
    for path in paths:
        rate = re.fullmatch(r"rate-(.+)\.json", os.path.basename(path))[1]
        with open(path) as f:
            run = json.load(f)
        check_run(path, run, meta["ranks"] if meta else run["meta"]["ranks"])
        meta = meta or dict(run["meta"], title=run["title"], p2p_latency_us={})
        meta["p2p_latency_us"][rate] = run["meta"].get("p2p_latency_us")
        n, bps = run["meta"]["ranks"], rate_bps(rate)
        for r in run["rows"]:
            bound = None
            if tbf_burst_bytes(bps) <= BUCKET_SHARE * 2 * (n - 1) / n * r["wire_bytes"]:
                bound = link_bound_s(n, r["wire_bytes"], bps, tbf_burst_bytes(bps)) * 1e3
            rows.append(dict(r, rate=rate, rate_gbit=bps / 1e9, algbw_gbit=r["bytes"] * 8 / r["time_ms"] / 1e6,
                             bound_ms=bound, pct_bound=bound and 100 * bound / r["time_ms"],
                             cpu_bound=bps > CPU_BOUND_ABOVE_BPS))
    return rows, meta


def check_targets(rows):
    at = [r for r in rows if r["rate_gbit"] == 1.0]
    if not at:
        return []
    largest = max(r["bytes"] for r in at)
    by_impl = {r["impl"]: r for r in at if r["bytes"] == largest}
    if not all(impl in by_impl for impl in TARGET_IMPLS):
        return []
    return [dict(zip(("target", "measured", "met"), (name, *check(by_impl)))) for name, check in TARGETS]


def _or_dash(value, fmt):
    return "–" if value is None else fmt.format(value)


def markdown(rows, meta, targets):
    largest = max(r["bytes"] for r in rows)
    lines = [f"# Emulated cluster: {meta['ranks']} hosts, {common.format_bytes(largest)} of fp32 gradients", "",
             f"{meta['date']}, {meta['machine']}; {meta['shaper']}. {meta['title']}", "",
             "| link | impl | time (ms) | algbw (Gbit/s of fp32) | vs torch fp32 | wire | link bound (ms) | % of bound |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["bytes"] == largest:
            lines.append(f"| {r['rate']}{' (CPU-bound)' if r['cpu_bound'] else ''} | {r['impl']} | {r['time_ms']:.0f} | "
                         f"{r['algbw_gbit']:.2f} | {common.ratio(r['speedup'])} | {common.format_bytes(r['wire_bytes'])} | "
                         f"{_or_dash(r['bound_ms'], '{:.0f}')} | {_or_dash(r['pct_bound'], '{:.0f} %')} |")
    if targets:
        lines += ["", "Targets at 1 Gbit/s:", "", "| target | measured | met |", "| --- | --- | --- |"]
        lines += [f"| {t['target']} | {t['measured']} | {'n/a' if t['met'] is None else 'yes' if t['met'] else 'no'} |" for t in targets]
    lines += ["", f"Above {CPU_BOUND_ABOVE_BPS / 1e9:.0f} Gbit/s per host this machine's CPUs, not the shaped link, "
              "limit the run: such rows are marked CPU-bound and are not link numbers."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="writes PREFIX.json, PREFIX.md and PREFIX.png")
    parser.add_argument("runs", nargs="+", help="rate-<rate>.json files written by run.sh")
    args = parser.parse_args()
    common.check_output_folders(parser, args, "--out", prefix=True)
    seen = {}  # bits/s -> the run of that rate
    for path in args.runs:
        name = re.fullmatch(r"rate-(.+)\.json", os.path.basename(path))
        if not name:
            parser.error(f"{path}: run.sh names its runs rate-<rate>.json (rate-1gbit.json), whose rate this reads")
        try:
            bps = rate_bps(name[1])
        except ValueError as error:
            parser.error(f"{path}: {error}")
        if bps in seen:
            parser.error(f"{seen[bps]} and {path} are runs of one rate: give one run per rate")
        seen[bps] = path
    for path in args.runs:
        if not os.path.isfile(path):
            parser.error(f"{path} does not exist")
    try:
        rows, meta = load(args.runs)
    except (ValueError, KeyError, TypeError) as error:  # json's errors are ValueErrors
        parser.error(f"cannot read the runs as bench_allreduce.py JSON written by run.sh: "
                     f"{type(error).__name__}: {error}")
    targets = check_targets(rows)
    meta = dict(meta, date=datetime.date.today().isoformat(), machine=f"{platform.machine()}, {os.cpu_count()} cores",
                shaper="tc tbf on each host's egress, one Linux bridge")
    with open(args.out + ".json", "w") as f:
        json.dump({"title": meta["title"], "meta": meta, "targets": targets, "rows": rows}, f, indent=1)
    text = markdown(rows, meta, targets)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    largest = max(r["bytes"] for r in rows)
    common.plot(args.out + ".png", f"{meta['ranks']} hosts, {common.format_bytes(largest)} fp32, emulated links",
                [r for r in rows if r["bytes"] == largest], x="rate_gbit", y="algbw_gbit", group="impl",
                xlabel="link rate per host (Gbit/s)", ylabel="algbw (Gbit/s of fp32 gradients)",
                shade_above=(CPU_BOUND_ABOVE_BPS / 1e9, "CPU-bound, not link numbers")
                if any(r["cpu_bound"] for r in rows) else None)
    print(text)


if __name__ == "__main__":
    main()
