"""A cost model of gradient all-reduce: gradsync's compressed ring and the plain fp32 ring of torch.

    python -m gradsync.model [--kernels KERNELS.json] [--validate NETEM.json]

The ring is modelled as gradsync implements it (csrc/ring/ring_allreduce.cpp): the buffer is cut
into n chunks and each chunk into m slices of 256 KiB to 1 MiB on the wire (32 to 128 MiB over NCCL); a reduce-scatter of n-1 steps
(every hop one fused decode + add + encode, ``reduce_encode``) then an all-gather of n-1 steps (every
hop forwards, then decodes). Per hop a slice of b wire bytes costs the link ``alpha + b / B``
(alpha-beta); slices of one step stream back to back, so a step lasts the longer of its link time
``m * b / B`` and its dependency chain ``alpha + b / B + compute``, and a phase can never be shorter
than the kernels its rank must run one after another. torch's all_reduce (gloo or NCCL) is the same
ring with fp32 on the wire and an fp32 add per hop. Small host buffers take gradsync's direct
exchange instead (``direct_time``: the check and one exchange of every rank with every other). Not modelled: congestion, stragglers, overlap
with the backward pass, and the many-level rings and trees NCCL builds on real clusters.

The emulated cluster (benchmarks/netem) adds what a real one lacks and the model then describes:
a token bucket, which each call finds as the calls before it left it, and ranks that share two
cores, so that a hop's latency is mostly waiting for a core (less when fewer ranks move data at
once) and a rank's transfers and kernels take turns. There the hop latencies are measured: gloo's
all_reduce and gradsync's ring from small all-reduces, a quiet hop from a ping-pong.

Kernel costs come in seconds per fp32 element. For CPUs they are measured (``bench_kernels.py``
JSON). No GPU kernel has been timed yet: the GPU figures are an *assumption*, a memory-bound
estimate at the HBM bandwidth of an H200 (4.8 TB/s) for the bytes each kernel reads and writes,
and so is the host's cost of issuing each hop of the GPU ring (``GPU_HOP_HOST``), which the GPU
cannot outrun: NCCL's own all-reduce is one kernel, gradsync's ring 2(n-1)m host-issued hops.
Link latencies of the real topologies are assumed typical values, not measurements.

Pure Python: the model's file imports nothing but the standard library (``python -m gradsync.model``
loads the gradsync package, and so torch, first).
"""
import argparse
import ipaddress
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, replace

SLICE_BYTES = 1 << 20  # gradsync.distributed.SLICE_BYTES
DIRECT_BYTES = 64 << 10  # gradsync.distributed.DIRECT_BYTES
CACHE_SAFE_BYTES = 64 << 20  # a measured buffer smaller than this may sit in a cache
TCP_COST_MIN_BYTES = 16 << 20  # the smallest loopback row whose time the wire, not latency, sets
NCCL_SLICE_BYTES = 128 << 20  # gradsync.distributed.NCCL_SLICE_BYTES
DIRECT_EXCHANGE_RANKS = 8  # kDirectExchangeRanks in csrc/ring/ring_allreduce.h
ALIGN = 128            # elements; chunks and slices are multiples of the fp8 block
WIRE_BYTES = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8_e4m3": 1 + 4 / 128, "fp8_e5m2": 1 + 4 / 128}
CODECS = tuple(WIRE_BYTES)
TORCH = "torch fp32"
IMPLS = (TORCH,) + tuple(f"gradsync {c}" for c in CODECS)
# bench_allreduce.py's rows beside the direct exchange of small buffers: gradsync fp16 through the
# ring, and without the agreement check (as the hooks call it after a bucket's first step)
RING_FP16, UNCHECKED_FP16 = "gradsync fp16 ring", "gradsync fp16 unchecked"
VALIDATED_IMPLS = IMPLS + (RING_FP16, UNCHECKED_FP16)


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s each rank sends (and receives) on its ring hop
    latency: float    # alpha: seconds per hop for a message, software included
    bucket: float = 0.0  # an emulated link's token bucket, in seconds at line rate: idle time it gives back
    bucket_start: float = None  # what the bucket holds as the call starts, seconds at line rate (None: full)
    quiet_latency: float = None  # a hop's latency while the other ranks idle, where that is less (ranks sharing cores)
    shared_cores: bool = False  # the ranks take turns on one host's cores (an emulated cluster)
    direct_latency: float = None  # an exchange of every rank with every other, where it differs from a hop
    direct_check_latency: float = None  # the agreement check before such an exchange, where it differs

    def step_latency(self, active, n):
        """A ring step's hop latency with `active` of the n ranks moving data at once. `latency` holds
        every rank active; where ranks share cores part of it is waiting for one, and that part
        shrinks with the share of ranks that are active."""
        if self.quiet_latency is None:
            return self.latency
        return self.quiet_latency + (self.latency - self.quiet_latency) * active / n

    def tokens(self):
        """Seconds of traffic the bucket lets through at once as the call starts."""
        return self.bucket if self.bucket_start is None else min(self.bucket, self.bucket_start)


@dataclass(frozen=True)
class Kernels:
    """Seconds per fp32 element for each ring kernel and codec (the add of a plain fp32 ring under "add"),
    and `network`: seconds of the rank's own processor per wire byte it sends and receives (a host TCP
    stack; 0 where the NIC moves the data by DMA). Where a host drives a device, `hop` is the host's
    seconds to issue one hop (a transfer and its kernel), which the device cannot outrun, and
    `slice_bytes` the transport's slice cap (gradsync.distributed). `direct_bytes`: payloads up to
    this size take the direct exchange instead of the ring (host kernels only; 0 on a GPU)."""
    name: str
    encode: dict
    reduce_encode: dict
    decode: dict
    add: float
    network: float = 0.0
    hop: float = 0.0
    slice_bytes: int = SLICE_BYTES
    direct_bytes: int = 0
    threads: int = 0  # of a measured host run; 0 where not recorded
    measured_bytes: int = 0  # of the buffer the measured costs come from; 0 where assumed

    def scaled(self, factor, name=None):
        """The same kernels run `factor` times slower (e.g. ranks sharing a core)."""
        scale = lambda d: {k: v * factor for k, v in d.items()}  # noqa: E731
        return replace(self, name=name or f"{self.name} x{factor:g}", encode=scale(self.encode),
                       reduce_encode=scale(self.reduce_encode), decode=scale(self.decode), add=self.add * factor,
                       network=self.network * factor, hop=self.hop * factor)


def memory_bound_kernels(bandwidth, name, hop=0.0, slice_bytes=SLICE_BYTES):
    """Kernels that run at `bandwidth` bytes/s over the bytes they read and write (fp32 in, w bytes per element out)."""
    enc = {c: (4 + w) / bandwidth for c, w in WIRE_BYTES.items()}
    red = {c: (4 + 2 * w) / bandwidth for c, w in WIRE_BYTES.items()}
    dec = {c: (4 + w) / bandwidth for c, w in WIRE_BYTES.items()}  # "none" too: CUDA tensors are copied out
    return Kernels(name, enc, red, dec, 12 / bandwidth, hop=hop, slice_bytes=slice_bytes)


H200_HBM = 4.8e12
# A hop over NCCL costs the host: a group on a non-blocking communicator, which NCCL (2.23 and later)
# settles on a thread it starts for it (a thread start and join: 36-48 us measured on the 2-core
# build machine), two event records and waits, and the kernel's launch.
GPU_HOP_HOST = 40e-6
GPU_ASSUMED = memory_bound_kernels(H200_HBM, "ASSUMED GPU kernels: memory-bound at H200 HBM 4.8 TB/s, "
                                   f"{GPU_HOP_HOST * 1e6:.0f} us of host per hop (not measured)",
                                   hop=GPU_HOP_HOST, slice_bytes=NCCL_SLICE_BYTES)


def _check_positive(value, what):
    """A measurement the model divides by or adds up: a finite number above 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return value


def cpu_kernels(path, device="cpu"):
    """Single-thread kernel costs from a bench_kernels.py JSON of ``device`` ("cpu" or "cuda"): the
    largest single-buffer case.

    bf16 and fp8_e5m2 were not timed and take the costs of fp16 and fp8_e4m3 (the same loops). The
    fused reduce_encode is not timed either: it is taken as a decode plus an encode. "none" and the
    plain ring's add move 8 and 12 bytes per element at the measured copy bandwidth.
    """
    with open(path) as f:
        run = json.load(f)
    measured_on = str(run["meta"]["device"])
    if measured_on.split(":")[0] != device:
        raise ValueError(f"{path} was measured on {measured_on}; this reads the kernel costs of a {device} run")
    single = [r for r in run["rows"] if r["tensors"] == 1]
    if not single:
        raise ValueError(f"{path} has no single-buffer case (bench_kernels.py without --sets-only writes them)")
    largest = max(r["count"] for r in single)
    cases = sorted({r["case"] for r in single if r["count"] == largest})
    if len(cases) > 1:
        raise ValueError(f"{path}: the single-buffer cases {cases} are all of the largest size: which one to read?")
    case = cases[0]
    rows = [r for r in run["rows"] if r["case"] == case]
    ops = [r["op"] for r in rows]
    if len(set(ops)) < len(ops):
        raise ValueError(f"{path}: case {case} has rows of one op twice: "
                         f"{sorted({op for op in ops if ops.count(op) > 1})} (runs merged into one file?)")
    for r in rows:
        _check_positive(r["time_ms"], f"{path}: time_ms of '{r['op']}'")
        _check_positive(r["count"], f"{path}: count of '{r['op']}'")
    per_elem = {r["op"]: r["time_ms"] * 1e-3 / r["count"] for r in rows}
    copy = _check_positive(run["meta"]["copy_gbps"], f"{path}: meta.copy_gbps") * 1e9
    enc = {"none": 8 / copy}
    dec = {"none": 0.0}
    for codec, measured in (("fp16", "fp16"), ("bf16", "fp16"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e4m3")):
        for op, costs in ((f"gradsync compress({measured})", enc), (f"gradsync decompress({measured})", dec)):
            if op not in per_elem:
                raise ValueError(f"{path}: case {case} has no row '{op}'")
            costs[codec] = per_elem[op]
    red = {c: enc[c] + dec[c] for c in CODECS}
    red["none"] = 12 / copy
    threads = run["meta"].get("threads") or re.search(r"CPU, (\d+) threads", str(run.get("title", "")))
    threads = int(threads.group(1)) if isinstance(threads, re.Match) else threads or 0
    return Kernels(f"CPU kernels measured ({path.rsplit('/', 1)[-1]}, {case})", enc, red, dec, 12 / copy,
                   direct_bytes=DIRECT_BYTES, threads=threads, measured_bytes=4 * max(r["count"] for r in rows))


def gpu_kernels(kernels_path, hop_path=None):
    """Measured GPU kernels for the projections: per-element costs from a CUDA bench_kernels.py JSON
    (the GPU suite's bench_kernels_cuda.json, read as `cpu_kernels` reads a host one) and the host's
    cost of issuing one ring hop, the median "issue" time of bench_nccl_hop.py's non-blocking
    communicator (GPU_HOP_HOST, assumed, without it)."""
    measured = cpu_kernels(kernels_path, device="cuda")
    # the CUDA ring receives the all-gather in its workspace and copies it out, also with codec
    # "none": a copy, as its encode is
    measured = replace(measured, decode=dict(measured.decode, none=measured.encode["none"]))
    hop, how = GPU_HOP_HOST, "ASSUMED"
    if hop_path:
        with open(hop_path) as f:
            issue = [r["issue_us"] for r in json.load(f)["rows"] if r["communicator"] == "non-blocking"]
        if not issue:
            raise ValueError(f"{hop_path} has no row of the non-blocking communicator")
        for value in issue:
            _check_positive(value, f"{hop_path}: issue_us")
        hop, how = statistics.median(issue) * 1e-6, "measured"
    name = f"GPU kernels measured ({os.path.basename(kernels_path)}), {hop * 1e6:.0f} us of host per hop ({how})"
    return replace(measured, name=name, hop=hop, slice_bytes=NCCL_SLICE_BYTES, direct_bytes=0)


def _round_up(x, k=ALIGN):
    return -(-x // k) * k


def _slice_elems(numel, n, wire_size, max_bytes):  # ring_slice_elems in csrc/ring/ring_plan.h
    chunk_bytes, max_bytes = -(-numel // n) * wire_size, max(1, max_bytes)
    return max(1, min(max(chunk_bytes // 8, max(1, max_bytes // 4)), max_bytes) // wire_size)


def _exposed(wire, compute):
    """Where ranks take turns on shared cores, a rank that waits for the link gives its core away and
    waits for its turn to get it back, so each step part of one slice's transfer or processing is
    not hidden behind the other: none of it when one is far longer, the whole shorter one when they
    are equal. The share, shorter / longer, interpolates between the two; it is fitted to the
    emulated runs (2 Gbit/s, where link and processor are close), not derived."""
    lo, hi = sorted((wire, compute))
    return lo * lo / hi if hi > 0 else 0.0


def payload_bytes(numel, codec):
    """Bytes on the wire for `numel` fp32 elements (gradsync.payload_nbytes)."""
    if codec.startswith("fp8"):
        return _round_up(numel, 16) + 4 * -(-numel // 128)
    return numel * int(WIRE_BYTES[codec])


def takes_direct_exchange(numel, n, codec, direct_bytes):
    """Whether gradsync skips the ring for this buffer (csrc/engine.cpp)."""
    return 1 < n <= DIRECT_EXCHANGE_RANKS and 0 < payload_bytes(numel, codec) <= direct_bytes


def direct_time(numel, n, link, kernels, codec, check_call=True):
    """Seconds for gradsync's direct exchange of a small buffer: the agreement check and the exchange,
    each every rank with every other at once (a latency each), then n-1 payloads out of and into
    each rank; the rank encodes its contribution and decodes all n. The token bucket lets the
    payloads through at once, up to what it holds."""
    a = link.latency if link.direct_latency is None else link.direct_latency
    check = a if link.direct_check_latency is None else link.direct_check_latency
    out = (n - 1) * numel * WIRE_BYTES[codec]
    wire = max(0.0, out / link.bandwidth - link.tokens())
    compute = numel * (kernels.encode[codec] + n * kernels.decode[codec]) + out * kernels.network  # sent and received
    return (check if check_call else 0.0) + a + wire + compute


def check_time(n, link, kernels):
    """Seconds for gradsync's agreement check: one hop of small messages, every rank with every other
    up to DIRECT_EXCHANGE_RANKS ranks; beyond, and over NCCL (a host issuing hops), around the ring."""
    return link.latency if n <= DIRECT_EXCHANGE_RANKS and not kernels.hop else (n - 1) * max(link.latency, kernels.hop)


def ring_time(numel, n, link, kernels, codec="none", *, plain=False, slice_bytes=None, check_call=True):
    """Seconds for one all-reduce of `numel` fp32 elements over a ring of `n` ranks.

    `plain`: torch's ring (fp32 wire, one add per hop, no encode or decode, no agreement check).
    `check_call`: gradsync's agreement check before the data: one hop of small messages up to
    DIRECT_EXCHANGE_RANKS ranks, n-1 hops around the ring beyond and over NCCL.
    `slice_bytes`: the slice cap; by default the kernels' transport's.
    """
    if n == 1 or numel == 0:
        return 0.0
    if not plain and takes_direct_exchange(numel, n, codec, kernels.direct_bytes):
        return direct_time(numel, n, link, kernels, codec, check_call)
    w = 4.0 if plain else WIRE_BYTES[codec]
    chunk = _round_up(-(-numel // n))
    active = n if plain else min(n, -(-numel // chunk))  # chunks with data: slices that move in each step
    if slice_bytes is None:  # NCCL's own ring pipelines inside one kernel, in slices of about this size
        slice_bytes = SLICE_BYTES if plain else kernels.slice_bytes
    slice_elems = _round_up(_slice_elems(numel, n, 1 if w < 2 else int(w), slice_bytes))
    m = -(-chunk // slice_elems)
    elems = chunk / m                                # per slice, slices taken as equal
    wire = elems * w / link.bandwidth               # wire time of one slice
    a = link.step_latency(active, n)
    c_enc = 0.0 if plain else elems * kernels.encode[codec]
    c_red = elems * (kernels.add if plain else kernels.reduce_encode[codec])
    c_dec = 0.0 if plain else elems * kernels.decode[codec]
    c_net = elems * w * kernels.network              # host stack: one slice sent and one received
    g = max(wire, c_net)                             # ... which runs while the slice is on the wire

    def chain(c):  # from a slice leaving to the same slice of the next step leaving; a shaper's bucket
        return a + c + max(0.0, g - min(a + c, link.bucket))  # refills while the link waits, and catches up

    def last_step(c):  # the final step: its slices stream out, the last one arrives and is processed
        return (m - 1) * max(g, c) + a + g + c
    # reduce-scatter: steps pipelined slice by slice; or the rank's processor busy throughout, if longer
    rs_wire = c_enc + (n - 2) * max(m * g, chain(c_red)) + last_step(c_red)
    rs = max(rs_wire, m * c_enc + (n - 1) * m * (c_red + c_net) + a + g)
    # all-gather: a hop forwards before it decodes, so decoding leaves the chain; n chunks to decode
    ag_wire = (n - 2) * max(m * g, chain(0.0)) + last_step(c_dec)
    ag = max(ag_wire, n * m * c_dec + (n - 1) * m * c_net + a + g)
    if link.shared_cores:
        rs += (n - 1) * _exposed(wire, c_red + c_net)
        ag += (n - 1) * _exposed(wire, c_dec + c_net)
    check = check_time(n, link, kernels) if check_call and not plain else 0.0
    total = check + rs + ag
    if kernels.hop and not plain:  # the host issues 2(n-1)m hops; the last one's transfer and kernel follow
        total = max(total, check + 2 * (n - 1) * m * kernels.hop + a + g + c_dec)
    if link.bucket and link.bandwidth != float("inf"):
        # The token bucket refills while the link idles and lets what it holds leave at once: the
        # call banks what it found plus the refill over its idle time, up to the bucket's size, down
        # to the time it would take on an unshaped link. (No single step can bank it; the call can.)
        unshaped = ring_time(numel, n, replace(link, bandwidth=float("inf"), bucket=0.0), kernels, codec,
                             plain=plain, slice_bytes=slice_bytes, check_call=check_call)
        idle = max(0.0, total - 2 * (n - 1) * m * wire)
        total = max(unshaped, total - min(link.bucket, link.tokens() + idle))
    return total


def allreduce_time(numel, n, link, kernels, impl, check_call=True):
    """`impl`: "torch fp32" (plain ring, then the division by n the benchmark does), "gradsync <codec>",
    RING_FP16 (gradsync fp16 without the direct exchange), UNCHECKED_FP16 (without the check) or
    "hierarchical gradsync <codec>" (:func:`hierarchical_time`, nodes of GPUS_PER_NODE), or
    NCCL_FP32 (torch's, a ring per NIC across nodes: :func:`nccl_link`)."""
    if impl == TORCH:
        return ring_time(numel, n, link, kernels, plain=True) + numel * kernels.encode["none"]
    if impl == NCCL_FP32:
        return ring_time(numel, n, nccl_link(link, n), kernels, plain=True) + numel * kernels.encode["none"]
    if impl.startswith(HIERARCHICAL):  # nodes of GPUS_PER_NODE on NODE_LINK, `link` between them
        return hierarchical_time(numel, n, GPUS_PER_NODE, NODE_LINK, link, kernels, impl.split()[-1], check_call)
    if impl == RING_FP16:
        kernels = replace(kernels, direct_bytes=0)
    return ring_time(numel, n, link, kernels, impl.split()[1], check_call=check_call and impl != UNCHECKED_FP16)


GPUS_PER_NODE = 8
NODE_LINK = Link("NVLink 450 GB/s", 450e9, 3e-6)  # inside a node (ASSUMED latency, as in TOPOLOGIES)
HIERARCHICAL = "hierarchical "  # allreduce_time's impl prefix: "hierarchical gradsync <codec>"


NCCL_FP32 = "NCCL fp32"  # allreduce_time's impl: torch's all_reduce on GPUs, as NCCL runs it on a cluster


def hierarchical_time(numel, n, per_node, node_link, link, kernels, codec, check_call=False):
    """hooks.hierarchical_hook on one bucket: gradsync's reduce-scatter inside the node (codec
    "none": half its ring), the all-reduce of each rank's 1/per_node shard across the n/per_node
    nodes on `codec` (every rank on its own `link`), and the node's all-gather with gradsync's ring
    (codec "none", the other half), one after another. `check_call`: the agreement checks of a
    bucket's first step."""
    if n % per_node:
        raise ValueError(f"{per_node} ranks per node do not divide {n}")
    # the node's two halves never take the direct exchange, and each checks its call
    node = replace(kernels, direct_bytes=0)
    node_ring = ring_time(numel, per_node, node_link, node, "none", check_call=check_call)
    if check_call and per_node > 1:
        node_ring += check_time(per_node, node_link, node)
    across = ring_time(-(-numel // per_node), n // per_node, link, kernels, codec, check_call=check_call)
    return node_ring + across


def nccl_link(link, n):
    """The link NCCL's ring sees across nodes of GPUS_PER_NODE GPUs, each GPU with a NIC `link`: it
    runs a ring per NIC (channels), so every NIC of a node carries its share at once, where one
    ring through the nodes (gradsync's flat ring) crosses each node boundary on one NIC."""
    if n <= GPUS_PER_NODE:
        return link
    return replace(link, name=f"{link.name} x{GPUS_PER_NODE} NICs", bandwidth=link.bandwidth * GPUS_PER_NODE)


def link_bound(numel, n, link, codec):
    """The bandwidth-only lower bound 2(n-1)/n * S_wire / B."""
    return 2 * (n - 1) / n * numel * WIRE_BYTES[codec] / link.bandwidth


# --- validation against the emulated cluster -----------------------------------------------------------

EMULATED_CORES = 2  # the machine of the committed runs; a run's report says its own ("<arch>, N cores")
TCP_GOODPUT = 1448 / 1514  # TCP payload per Ethernet frame (MTU 1500, timestamps): tbf counts whole frames
LATENCY_BOUND_BYTES = 64 << 10  # all-reduces this small measure hop latencies: the shaper's bucket passes them


def tbf_burst_bytes(bps):
    """The bucket benchmarks/netem/run.sh gives tbf: 4 ms of traffic, at least 256 KB."""
    return max(262144, bps // 2000)


def host_network_cost(loopback, kernels, cores=EMULATED_CORES):
    """Seconds of processor per wire byte for the TCP stack, from an unshaped loopback run of
    bench_allreduce.py (JSON): what gradsync "none" at the largest size took beyond its kernels."""
    n = loopback["meta"]["ranks"]
    row = max((r for r in loopback["rows"] if r["impl"] == "gradsync none"), key=lambda r: r["bytes"])
    if row["bytes"] < TCP_COST_MIN_BYTES:
        raise ValueError(f"the loopback run's largest 'gradsync none' row is {row['bytes']} bytes; the TCP stack's "
                         f"cost is read from one of at least {TCP_COST_MIN_BYTES >> 20} MB, where latency does not "
                         "set the time (bench_allreduce.py's default sizes reach 256 MB)")
    share = max(1.0, n / cores)
    numel = row["bytes"] // 4
    kernels_only = ring_time(numel, n, Link("loopback", float("inf"), 0.0), kernels.scaled(share))
    cost = (row["time_ms"] * 1e-3 - kernels_only) / (share * 2 * (n - 1) / n * row["bytes"])
    if cost <= 0:
        raise ValueError(f"the loopback run's 'gradsync none' row of {row['bytes']} bytes took {row['time_ms']} ms, "
                         f"no more than its kernels alone ({kernels_only * 1e3:.3g} ms by the kernel costs): the "
                         "kernels and the loopback run are not of the same machine, or the row is wrong")
    return cost


def latency_hops(n, impl):
    """Hop latencies on one all-reduce's ring: 2(n-1), plus the agreement check's for gradsync's
    checked calls."""
    if impl in (TORCH, UNCHECKED_FP16):
        return 2 * (n - 1)
    return 2 * (n - 1) + (1 if n <= DIRECT_EXCHANGE_RANKS else n - 1)


def measured_latencies(netem):
    """Seconds per hop, from the latency-bound rows of a netem run (messages too small for the shaper
    to engage), per implementation: gloo's all_reduce, gradsync's ring and gradsync's direct exchange
    are different software. The median over every such row and rate, as single rows here move by
    +-30 % between runs. For the direct exchange, "direct" is one exchange (the rows without the
    agreement check) and "direct check" what the check adds before it: where ranks share cores, a
    second exchange right after a first costs more than the first (it waits for the last rank to
    finish the first), so the two are measured apart."""
    n, direct_bytes = netem["meta"]["ranks"], netem["meta"].get("direct_bytes", 0)
    per_hop = {TORCH: [], "gradsync": [], "direct": [], "direct checked": []}
    for r in netem["rows"]:
        if r["bytes"] > LATENCY_BOUND_BYTES or r["impl"] not in VALIDATED_IMPLS:
            continue
        seconds = r["time_ms"] * 1e-3
        if r["impl"] == TORCH:
            per_hop[TORCH].append(seconds / latency_hops(n, TORCH))
        elif r["impl"] != RING_FP16 and takes_direct_exchange(r["bytes"] // 4, n, r["impl"].split()[1], direct_bytes):
            per_hop["direct" if r["impl"] == UNCHECKED_FP16 else "direct checked"].append(seconds)
        else:
            per_hop["gradsync"].append(seconds / latency_hops(n, r["impl"]))
    latencies = {k: statistics.median(v) if v else None for k, v in per_hop.items()}
    checked = latencies.pop("direct checked")
    if latencies["direct"] is None:  # no unchecked rows: the check taken as a second exchange alike
        latencies["direct"] = checked / 2 if checked else None
    latencies["direct check"] = checked - latencies["direct"] if checked else None
    quiet = [v for v in netem["meta"].get("p2p_latency_us", {}).values() if v]
    latencies["quiet"] = statistics.median(quiet) * 1e-6 if quiet else None
    return latencies


def run_cores(meta):
    """The cores of the machine a netem report ran on, as report.py records them."""
    found = re.search(r"(\d+) cores", str(meta.get("machine", "")))
    return int(found.group(1)) if found else EMULATED_CORES


def emulated_setup(netem, kernels_path, loopback_path, latencies_from=None):
    """(latencies, kernels) for a run of benchmarks/netem/run.sh on the cores its report names.

    The latencies are measured (`measured_latencies`) in the run itself or, held out, in the run
    `latencies_from`. The ranks share the cores, so the kernels and the TCP stack (measured on
    loopback) run n / cores times slower.
    """
    n = netem["meta"]["ranks"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"the netem report's meta.ranks must be a number of hosts of at least 2, got {n!r}")
    kernels = cpu_kernels(kernels_path)
    with open(loopback_path) as f:
        kernels = replace(kernels, network=host_network_cost(json.load(f), kernels))
    kernels = replace(kernels, direct_bytes=netem["meta"].get("direct_bytes", 0))  # 0: runs before it existed
    cores = run_cores(netem["meta"])
    name = f"{kernels.name}, TCP stack {kernels.network * 1e9:.2f} ns/B (loopback run), {n} ranks on {cores} cores"
    return measured_latencies(latencies_from or netem), kernels.scaled(max(1.0, n / cores), name)


def host_traffic_bytes(numel, n, impl, wire_bytes, direct_bytes):
    """Bytes each host sends in one call: n-1 payloads in the direct exchange, 2(n-1)/n of one
    around a ring (gloo's all_reduce too)."""
    codec = impl.split()[1].split("+")[0] if impl.startswith("gradsync") else None
    if codec in WIRE_BYTES and impl != RING_FP16 and takes_direct_exchange(numel, n, codec, direct_bytes):
        return (n - 1) * wire_bytes
    return 2 * (n - 1) / n * wire_bytes


def settled_bucket(calls, capacity, passes=4):
    """Seconds per call of a benchmark that repeats `calls` in order, round after round, through a
    token bucket of `capacity` seconds at line rate. A call is (seconds(tokens), traffic, gap):
    its time given what the bucket holds as it starts, the seconds at line rate it sends, and the
    idle time after it, in which the bucket refills. Over a call the bucket gains its duration and
    loses its traffic. Starts full; `passes` rounds settle it."""
    tokens, times = capacity, []
    for _ in range(passes):
        times = []
        for seconds, traffic, gap in calls:
            t = seconds(tokens)
            times.append(t)
            tokens = min(capacity, max(0.0, tokens + t - traffic) + gap)
    return times


def takes_turns(meta):
    """Whether a bench_allreduce.py run had its implementations take turns call by call: "rounds"
    null in its meta, or, in runs from before it recorded them, "direct_bytes" there (the two came
    in together). Otherwise each ran its calls back to back, and a call mostly follows its own kind."""
    return meta.get("rounds", None if "direct_bytes" in meta else 1) is None


def validate(netem, kernels_path, loopback_path, min_bytes=0, latencies_from=None):
    """Measured against predicted for every modelled row of a netem report JSON: a list of dicts.
    The hop latencies come from the run's own latency-bound rows (LATENCY_BOUND_BYTES or less), whose
    predictions are so partly fitted to them; `latencies_from`: another run of the same hosts whose
    latency-bound rows give them instead, so that no row's own time enters its prediction.

    Each host's token bucket is followed across the calls as the benchmark made them (`takes_turns`,
    `settled_bucket`): a call finds in it what the call before left, plus the refill during the
    benchmark's barrier (a round trip of the quiet latency) and copy of the input. The calls of an
    implementation the model does not price (torch's fp16 hook path) take their measured time."""
    latencies, kernels = emulated_setup(netem, kernels_path, loopback_path, latencies_from)
    n = netem["meta"]["ranks"]
    barrier = 2 * (latencies["quiet"] or latencies[TORCH])
    groups = {}
    for r in netem["rows"]:
        groups.setdefault((r["rate"], r["bytes"]), []).append(r)
    out = []
    for (rate, nbytes), rows in groups.items():
        bps = _check_positive(rows[0]["rate_gbit"], "the netem report's rate_gbit") * 1e9
        numel, bucket = nbytes // 4, tbf_burst_bytes(bps) * 8 / bps
        calls = []
        for r in rows:
            latency = latencies[TORCH if r["impl"] == TORCH else "gradsync"]
            link = Link(rate, bps / 8 * TCP_GOODPUT, latency, bucket=bucket,
                        quiet_latency=min(latencies["quiet"], latency) if latencies["quiet"] else None,
                        shared_cores=True, direct_latency=latencies["direct"],
                        direct_check_latency=latencies["direct check"])
            if r["impl"] in VALIDATED_IMPLS:
                seconds = (lambda tokens, link=link, impl=r["impl"]:
                           allreduce_time(numel, n, replace(link, bucket_start=tokens), kernels, impl))
            else:
                seconds = lambda tokens, t=r["time_ms"] * 1e-3: t  # noqa: E731
            traffic = host_traffic_bytes(numel, n, r["impl"], r["wire_bytes"], kernels.direct_bytes) / link.bandwidth
            calls.append((seconds, traffic, barrier + numel * kernels.encode["none"]))
        if takes_turns(netem["meta"]):
            times = settled_bucket(calls, bucket)
        else:
            times = [settled_bucket([call], bucket)[0] for call in calls]
        for r, t in zip(rows, times):
            if r["impl"] not in VALIDATED_IMPLS or r["bytes"] < min_bytes:
                continue
            out.append({"rate": r["rate"], "bytes": r["bytes"], "impl": r["impl"], "measured_ms": r["time_ms"],
                        "predicted_ms": t * 1e3, "error": t * 1e3 / r["time_ms"] - 1})
    return out


# --- projections to real clusters ----------------------------------------------------------------------

TOPOLOGIES = [  # (ranks, link); latencies are ASSUMED typical per-hop values
    (8, Link("NVLink 450 GB/s", 450e9, 3e-6)),
    (64, Link("IB 400 Gbit/s", 50e9, 5e-6)),
    (512, Link("IB 400 Gbit/s", 50e9, 5e-6)),
    (1024, Link("IB 400 Gbit/s", 50e9, 5e-6)),
    (64, Link("Ethernet 100 Gbit/s", 12.5e9, 15e-6)),
    (512, Link("Ethernet 100 Gbit/s", 12.5e9, 15e-6)),
    (1024, Link("Ethernet 100 Gbit/s", 12.5e9, 15e-6)),
]
MODELS = [("GPT-2 124M", 124_439_808), ("1.3B", 1_300_000_000), ("7B", 6_740_000_000)]
BUCKETS_MB = [1, 4, 16, 25, 64, 256, 1024, 4096]


def step_time(params, n, link, kernels, impl, bucket_bytes):
    """One step's gradient sync: the fp32 gradients in buckets, all-reduced one after another, without
    the agreement check (the hooks and DataParallel check a bucket at its first all-reduce only)."""
    if params == 0:
        return 0.0
    bucket = max(1, min(params, bucket_bytes // 4))  # a bucket holds one element at least
    full, rest = divmod(params, bucket)
    t = full * allreduce_time(bucket, n, link, kernels, impl, check_call=False)
    return t + (allreduce_time(rest, n, link, kernels, impl, check_call=False) if rest else 0.0)


def knee_bucket(params, n, link, kernels, impl, within=0.10):
    """The smallest bucket (MB) whose step time is within `within` of one all-reduce of everything:
    smaller buckets overlap better with the backward pass, larger ones pay less latency."""
    whole = allreduce_time(params, n, link, kernels, impl, check_call=False)
    for mb in BUCKETS_MB:
        if step_time(params, n, link, kernels, impl, mb * 2**20) <= (1 + within) * whole:
            return mb
    return None


def latency_crossover(bucket_bytes, link, codec, hop=0.0, nics=1):
    """The ring size beyond which the latency term 2(n-1)alpha exceeds the bandwidth term
    2(n-1)/n S_wire/B for one bucket: n = S_wire / (B alpha). `hop`: a host's cost of issuing a hop,
    which acts as the latency where it is the larger. `nics`: rings running at once, one per NIC,
    which share the bucket between them (B times nics)."""
    return bucket_bytes / 4 * WIRE_BYTES[codec] / (nics * link.bandwidth * max(link.latency, hop))


def nccl_crossover(bucket_bytes, link, across_nodes):
    """latency_crossover for NCCL's fp32 ring (`nccl_link`): one ring inside a node, a ring per NIC
    once it spans nodes, so that a crossover beyond one node is GPUS_PER_NODE times nearer (and no
    nearer than the first node boundary)."""
    n = latency_crossover(bucket_bytes, link, "none")
    if not across_nodes or n <= GPUS_PER_NODE:
        return n
    return max(GPUS_PER_NODE, latency_crossover(bucket_bytes, link, "none", nics=GPUS_PER_NODE))


def spans_nodes(link):
    """Whether the projections run `link` between nodes (beyond GPUS_PER_NODE ranks)."""
    return any(n > GPUS_PER_NODE for n, other in TOPOLOGIES if other == link)


SLICE_CAPS = [1 << k for k in range(20, 31)]  # 1 MB .. 1 GB
REGRET_BUCKETS_MB = (1, 4, 16, 25, 64, 256, 1024)


def slice_regrets(kernels=GPU_ASSUMED, hops=(15e-6, 40e-6, 80e-6), codecs=("none", "fp16", "fp8_e4m3")):
    """For each slice cap of SLICE_CAPS, how much slower the ring is with it than with the best cap for
    each case, at worst, over the projected topologies, buckets of 1 MB to 1 GB, `codecs` and host costs
    per hop `hops` (the assumed one and 2x either side): {cap: (ratio, (hop, n, link, MB, codec))}.
    The smallest cap with the least worst ratio is gradsync.distributed.NCCL_SLICE_BYTES (larger ones
    tie or lose, and pipeline less)."""
    worst = {cap: (1.0, None) for cap in SLICE_CAPS}
    for hop in hops:
        ks = replace(kernels, hop=hop)
        for n, link in TOPOLOGIES:
            for mb in REGRET_BUCKETS_MB:
                for codec in codecs:
                    times = {c: ring_time(mb * 2**20 // 4, n, link, ks, codec, slice_bytes=c, check_call=False)
                             for c in SLICE_CAPS}
                    best = min(times.values())
                    for cap, t in times.items():
                        if t / best > worst[cap][0]:
                            worst[cap] = (t / best, (hop, n, link.name, mb, codec))
    return worst


def _ms_and_ratio(seconds, ratio):
    return f"{seconds * 1e3:.1f} ({ratio:.1f}x)"


def projection_tables(kernels=GPU_ASSUMED, bucket_mbs=(25, 256), cpu=None):
    """The printed projections; `cpu`: measured CPU kernels, to show where a host-side codec stops paying."""
    lines = [f"# Gradient sync per step, flat ring, fp32 gradients in buckets; {kernels.name}",
             "# link latencies ASSUMED: NVLink 3 us, InfiniBand 5 us, Ethernet 15 us per hop; beyond 8 ranks, nodes of",
             "# 8 GPUs with a NIC each. torch fp32 is NCCL's ring, one kernel for the whole all-reduce, a ring per NIC",
             "# across nodes (NCCL's trees, which cut its latency at hundreds of ranks, are not modelled); gradsync's",
             "# host issues each hop of one ring, which crosses each node boundary on one NIC", ""]
    head = f"{'ranks':>5} {'link':<20} {'model':<11}" + "".join(f"{i.replace('gradsync ', ''):>15}" for i in IMPLS)
    for bucket_mb in bucket_mbs:
        for model, params in MODELS:
            lines += [f"## {model}: {params * 4 / 2**20:,.0f} MB of fp32 gradients in {bucket_mb:g} MB buckets "
                      "(MB: 2^20 bytes); ms per step (speedup vs torch fp32)", head]
            for n, link in TOPOLOGIES:
                times = {i: step_time(params, n, link, kernels, NCCL_FP32 if i == TORCH else i, int(bucket_mb * 2**20))
                         for i in IMPLS}
                cells = "".join(f" {_ms_and_ratio(times[i], times[TORCH] / times[i]):>14}" for i in IMPLS)
                lines.append(f"{n:>5} {link.name:<20} {model:<11}{cells}")
            lines.append("")
    hop_assumed = " (ASSUMED)" if "ASSUMED" in kernels.name else ""  # the kernels', or only the hop's
    lines += [f"gradsync's host spends {kernels.hop * 1e6:.0f} us{hop_assumed} issuing each of the ring's 2(n-1) hops, while a",
              "chunk of a 25 MB bucket crosses NVLink in a few: with DDP's 25 MB buckets the GPU ring is bound",
              "by its host. Buckets of 256 MB (bucket_cap_mb=256) make each hop long enough for compression to",
              "pay inside one node. Across nodes the flat ring crosses each node boundary on one NIC where NCCL",
              "runs a ring on each of the node's NICs, and every bucket pays 2(n-1) host hops: it loses to NCCL",
              "whatever the codec. Compression still beats the same ring in fp32 (\"none\") as long as the wire,",
              "not the host, sets the pace; across nodes, hierarchical sync (below) is what pays.", ""]
    lines += ["## Where compression pays: per element and hop, the slower of wire and kernel (ps)",
              "(a hop costs max(wire, kernel) when pipelined, once hops are long enough to hide the host's cost",
              "of issuing them. The codec's ring is compared with NCCL's fp32 ring, which across nodes runs a",
              f"ring per NIC ({GPUS_PER_NODE} per node), and with the same flat ring in fp32 on one NIC; the CPU",
              "rows put every kernel on the host, the fp32 rings' adds too, as with gloo)",
              f"{'link':<20} {'kernels':<26} {'codec':<9} {'NCCL fp32':>10} {'ring fp32':>10} {'codec wire':>11} "
              f"{'kernel':>8} {'pays vs NCCL':>13} {'vs ring':>8}"]
    kernel_sets = [(f"GPU, {'assumed' if kernels.name.startswith('ASSUMED') else 'measured'}", kernels)]
    kernel_sets += [(f"CPU, {_threads(cpu.threads)}measured", cpu)] if cpu else []
    for link in dict.fromkeys(link for _, link in TOPOLOGIES):
        nics = GPUS_PER_NODE if spans_nodes(link) else 1
        for label, ks in kernel_sets:
            # the fp32 rings add on the same processor as the codec: a host codec beside a host fp32 ring
            nccl, ring = max(4 / (nics * link.bandwidth), ks.add), max(4 / link.bandwidth, ks.add)
            for codec in ("fp16", "fp8_e4m3"):
                wire, kernel = WIRE_BYTES[codec] / link.bandwidth, ks.reduce_encode[codec]
                cost = max(wire, kernel)
                lines.append(f"{link.name:<20} {label:<26} {codec:<9} {nccl * 1e12:>10.1f} {ring * 1e12:>10.1f} "
                             f"{wire * 1e12:>11.1f} {kernel * 1e12:>8.1f} {'yes' if cost < nccl else 'no':>13} "
                             f"{'yes' if cost < ring else 'no':>8}")
    lines += ["", "## Best bucket: the smallest within 10 % of one all-reduce of the whole gradient (gradsync fp16)",
              "(smaller buckets start communicating earlier in backward, which is not modelled; \"one bucket\": no",
              "bucket smaller than the whole gradient comes within 10 %)",
              f"{'ranks':>5} {'link':<20}" + "".join(f"{m:>12}" for m, _ in MODELS)]
    for n, link in TOPOLOGIES:
        cells = []
        for _, params in MODELS:
            knee = knee_bucket(params, n, link, kernels, "gradsync fp16")
            cells.append(f"{knee} MB" if knee and knee * 2**20 < 4 * params else "one bucket")
        lines.append(f"{n:>5} {link.name:<20}" + "".join(f"{c:>12}" for c in cells))
    regrets = slice_regrets(kernels)
    regret, case = regrets[kernels.slice_bytes]
    where = "never slower" if case is None else \
        "{:.0f} us per hop, {} ranks, {}, {} MB, {}".format(case[0] * 1e6, *case[1:])
    lines += ["", f"## Slices over NCCL: {kernels.slice_bytes >> 20} MB at most (gradsync.distributed.NCCL_SLICE_BYTES)",
              "Each slice is a hop the host issues; slicing a chunk hides the per-hop kernel and latency behind",
              f"the other slices' transfers. This cap is at worst {regret:.2f}x slower than the best cap for each case",
              f"(there: {where}), over host costs of 15-80 us per hop,",
              "the topologies above and buckets of 1 MB to 1 GB; the 1 MB cap of the CPU ring would be up to",
              f"{regrets[SLICE_BYTES][0]:.0f}x slower."]
    lines += ["", "## Where the flat ring stops scaling",
              "The ring pays 2(n-1) hop latencies per all-reduce (3(n-1) with gradsync's agreement check over NCCL) while its",
              "bandwidth term stays near 2 S/B: past n = S_wire / (B alpha) latency dominates, and every bucket pays it.",
              "For gradsync's GPU ring alpha is at least the host's cost per hop. NCCL's fp32 ring runs a ring per",
              f"NIC across nodes, each with 1/{GPUS_PER_NODE} of the bucket, so its n is {GPUS_PER_NODE} times nearer there",
              "(\"< 2\": latency dominates from the smallest ring).",
              f"{'link':<20} {'bucket':>7}" + "".join(f"{c:>14}" for c in ("NCCL fp32", "gradsync fp16", "fp8"))]
    for link in dict.fromkeys(link for _, link in TOPOLOGIES):
        for mb in (25, 256):
            ns = [nccl_crossover(mb * 2**20, link, spans_nodes(link))]
            ns += [latency_crossover(mb * 2**20, link, c, kernels.hop) for c in ("fp16", "fp8_e4m3")]
            lines.append(f"{link.name:<20} {mb:>4} MB" + "".join(f"{x:>14.0f}" if x >= 2 else f"{'< 2':>14}" for x in ns))
    lines += ["Compression lowers S_wire and so lowers this n. That is the case for hierarchical sync (reduce",
              "inside the node over NVLink, gradsync's compressed ring across nodes with n/8 ranks)",
              "or larger buckets.", ""]
    lines += hierarchical_table(kernels, bucket_mb=max(bucket_mbs))
    return "\n".join(lines)


def hierarchical_table(kernels, bucket_mb):
    """hooks.hierarchical_hook against NCCL's fp32 all-reduce on the multi-node topologies."""
    impls = [NCCL_FP32, "gradsync fp8_e4m3", HIERARCHICAL + "gradsync fp16", HIERARCHICAL + "gradsync fp8_e4m3"]
    lines = [f"## Hierarchical sync (hooks.hierarchical_hook): nodes of {GPUS_PER_NODE} GPUs on {NODE_LINK.name}; "
             f"{bucket_mb} MB buckets; ms per step (speedup vs NCCL fp32)",
             "(the hook reduce-scatters inside the node with gradsync in fp32, all-reduces each 1/8 shard across the",
             "n/8 nodes on the codec, every GPU on its own NIC, and all-gathers inside the node with gradsync, one",
             "step after another. NCCL's fp32 ring runs a ring per NIC; gradsync's flat fp8 ring beside. At",
             "hundreds of GPUs the host issuing gradsync's hops across nodes sets its pace, not the codec, and",
             "NCCL's trees, not modelled, would cut NCCL's 2(n-1) link latencies)",
             f"{'ranks':>5} {'link':<20} {'model':<11}" + "".join(f"{c:>16}" for c in
                                                             ("NCCL fp32", "flat fp8", "hier. fp16", "hier. fp8"))]
    for n, link in TOPOLOGIES:
        if n <= GPUS_PER_NODE:
            continue
        for model, params in MODELS:
            times = [step_time(params, n, link, kernels, i, int(bucket_mb * 2**20)) for i in impls]
            lines.append(f"{n:>5} {link.name:<20} {model:<11}" +
                         "".join(f" {_ms_and_ratio(t, times[0] / t):>15}" for t in times))
    return lines


def _size(nbytes):
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024 or unit == "MiB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024


def validation_table(rows):
    width = max([4] + [len(r["impl"]) for r in rows])
    lines = [f"{'rate':<8} {'size':>8} {'impl':<{width}} {'measured':>10} {'predicted':>10} {'error':>7}"]
    for r in rows:
        lines.append(f"{r['rate']:<8} {_size(r['bytes']):>8} {r['impl']:<{width}} {r['measured_ms']:>8.1f}ms "
                     f"{r['predicted_ms']:>8.1f}ms {100 * r['error']:>+6.0f}%")
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines.append(f"worst: {100 * worst['error']:+.0f}% ({worst['impl']}, {worst['rate']}, {worst['bytes']} bytes)")
    return "\n".join(lines)


# the committed measurements, beside the package in a source checkout (a wheel carries none)
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")


def _threads(count):
    return "" if not count else "1 thread, " if count == 1 else f"{count} threads, "


def _cache_warning(option, kernels):
    """A line where the measured costs come from a buffer that a cache may hold, which flatters them."""
    if not kernels.measured_bytes or kernels.measured_bytes >= CACHE_SAFE_BYTES:
        return None
    return (f"# {option}: the costs come from a buffer of {kernels.measured_bytes / 2**20:g} MB, which a cache may "
            f"hold, so they may be too low; one of {CACHE_SAFE_BYTES >> 20} MB or more measures memory "
            "(bench_kernels.py's default cases include one)")


def _positive_mb(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of MB, got {text}")
    if value * 2**20 < 4:
        raise argparse.ArgumentTypeError(f"must hold one fp32 element (4 bytes, {4 / 2**20:.2g} MB), got {text}")
    return int(value) if value.is_integer() else value


def _load_json(path):
    with open(path) as f:
        return json.load(f)


# what each option reads: the file's producer, the keys of its meta and of every row, and the keys
# that show it is another kind (a netem report is a bench_allreduce.py run shaped by tc)
KINDS = {
    "--kernels": ("bench_kernels.py JSON", {"device", "copy_gbps"}, {"case", "op", "tensors", "count", "time_ms"}, ()),
    "--nccl-hop": ("bench_nccl_hop.py JSON", set(), {"communicator", "issue_us"}, ()),
    "--loopback": ("bench_allreduce.py JSON of an unshaped run", {"ranks"}, {"impl", "bytes", "time_ms"},
                   ("shaper", "rate")),
    "--validate": ("netem report JSON (benchmarks/netem/report.py)", {"ranks", "shaper"},
                   {"impl", "bytes", "time_ms", "rate"}, ()),
}
KINDS["--gpu-kernels"], KINDS["--latencies-from"] = KINDS["--kernels"], KINDS["--validate"]


def kind_problem(option, path):
    """Why the file at ``path`` is not what ``option`` reads, or None."""
    what, meta_keys, row_keys, other = KINDS[option]
    try:
        data = _load_json(path)
    except ValueError as error:
        return f"not JSON ({error}); it takes a {what}"
    meta, rows = (data.get("meta"), data.get("rows")) if isinstance(data, dict) else (None, None)
    if not isinstance(meta, dict) or not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return f"not a {what} (no meta and rows)"
    if not rows:
        return f"a {what} without rows"
    missing = sorted(meta_keys - meta.keys()) + sorted({k for r in rows for k in row_keys - r.keys()})
    if missing:
        return f"not a {what}: it lacks {', '.join(missing)}"
    found = [k for k in other if k in meta or any(k in r for r in rows)]
    if found:
        return f"not a {what}: it has {', '.join(found)} (a netem report?)"
    if option == "--loopback":  # a run of netem/run.sh is a bench_allreduce.py JSON too, over shaped links
        address = meta.get("master_addr")
        try:  # a host name (torchrun may write one) cannot tell
            over_a_network = not ipaddress.ip_address(address).is_loopback
        except ValueError:
            over_a_network = False
        if re.fullmatch(r"rate-.+\.json", os.path.basename(path)) or over_a_network:
            return (f"not a {what}: a run over a network (benchmarks/netem/run.sh's rate-<rate>.json, or MASTER_ADDR "
                    f"{address}); the TCP stack's cost is read from ranks on one host, over loopback")
    return None


def main():
    parser = argparse.ArgumentParser(prog="python -m gradsync.model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", help="bench_kernels.py JSON with the CPU kernel costs (for --validate, and the "
                        "CPU rows; default: the committed 2026-12-01-cpu-kernels-1thread.json where it is at hand)")
    parser.add_argument("--loopback", default=os.path.join(RESULTS, "2026-12-01-cpu-allreduce-4ranks-interleaved.json"),
                        help="bench_allreduce.py JSON of an unshaped loopback run: the TCP stack's cost (for --validate)")
    parser.add_argument("--validate", help="a netem report JSON (benchmarks/netem/report.py) to check the model against")
    parser.add_argument("--min-bytes", type=int, default=0, help="validate only rows of at least this size")
    parser.add_argument("--latencies-from", help="another netem report JSON whose latency-bound rows give the hop "
                        "latencies (held out: no row's own time in its prediction)")
    parser.add_argument("--bucket-mb", type=_positive_mb, nargs="+", default=[25, 256],
                        help="bucket sizes of the projections, in MB of 2^20 bytes (default: 25 256)")
    parser.add_argument("--gpu-kernels", help="a CUDA bench_kernels.py JSON (benchmarks/gpu_suite.sh writes one): "
                        "measured GPU kernel costs for the projections instead of the assumed ones")
    parser.add_argument("--nccl-hop", help="with --gpu-kernels, a bench_nccl_hop.py JSON: the measured host cost per hop")
    args = parser.parse_args()
    for option, value, needed, given in (("--nccl-hop", args.nccl_hop, "--gpu-kernels", args.gpu_kernels),
                                         ("--latencies-from", args.latencies_from, "--validate", args.validate),
                                         ("--min-bytes", args.min_bytes, "--validate", args.validate)):
        if value and not given:
            parser.error(f"{option} is read only with {needed}")
    kernels_given = args.kernels is not None
    if not kernels_given:
        args.kernels = os.path.join(RESULTS, "2026-12-01-cpu-kernels-1thread.json")
    read = {"--validate": args.validate, "--latencies-from": args.latencies_from,
            "--gpu-kernels": args.gpu_kernels, "--nccl-hop": args.nccl_hop}
    if kernels_given or args.validate:
        read["--kernels"] = args.kernels
    if args.validate:
        read["--loopback"] = args.loopback
    for option, path in read.items():
        if path and not os.path.isfile(path):
            parser.error(f"{option} {path} is not a file (pass the measurement JSON)")
        problem = kind_problem(option, path) if path else None
        if problem:
            parser.error(f"{option} {path}: {problem}")
    if args.latencies_from and os.path.samefile(args.latencies_from, args.validate):
        parser.error("--latencies-from names the --validate report itself, whose latencies would not be held out: "
                     "pass another run's report, or leave it out to take this run's own small rows")
    if args.validate:
        try:
            netem = _load_json(args.validate)
            held_out = _load_json(args.latencies_from) if args.latencies_from else None
            latencies, kernels = emulated_setup(netem, args.kernels, args.loopback, held_out)
            rows = validate(netem, args.kernels, args.loopback, args.min_bytes, held_out)
        except ZeroDivisionError as error:
            parser.error(f"a file holds 0 where a measurement the model divides by belongs (a link rate or a "
                         f"time): {error}")
        except (OSError, ValueError) as error:  # json's errors are ValueErrors
            parser.error(f"{type(error).__name__}: {error}")
        except (KeyError, TypeError, AttributeError) as error:  # a JSON of another kind
            parser.error("a file is not of the kind its option reads (--validate and --latencies-from: netem report "
                         "JSON, benchmarks/netem/report.py; --kernels: bench_kernels.py JSON; --loopback: "
                         f"bench_allreduce.py JSON): {type(error).__name__}: {error}")
        if not rows:
            parser.error(f"--min-bytes {args.min_bytes} leaves no row of {args.validate} to validate")
        source = f" in {os.path.basename(args.latencies_from)}" if held_out else \
            f" in this run's rows of {LATENCY_BOUND_BYTES >> 10} KB or less (so those rows are in-sample)"
        print(f"# model vs emulated cluster ({netem['meta']['ranks']} hosts); hop latency measured{source}: "
              + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in latencies.items() if v) + f"; {kernels.name}")
        print(validation_table(rows))
        print()
    try:
        cpu = cpu_kernels(args.kernels) if os.path.exists(args.kernels) else None
        gpu = gpu_kernels(args.gpu_kernels, args.nccl_hop) if args.gpu_kernels else GPU_ASSUMED
    except (OSError, ValueError) as error:  # json's errors are ValueErrors
        parser.error(f"{type(error).__name__}: {error}")
    except (KeyError, TypeError, AttributeError) as error:  # a JSON of another kind
        parser.error("a file is not of the kind its option reads (--kernels and --gpu-kernels: bench_kernels.py "
                     f"JSON; --nccl-hop: bench_nccl_hop.py JSON): {type(error).__name__}: {error}")
    if cpu is None:
        print(f"# no CPU kernel costs ({args.kernels} does not exist): the tables leave out the host codecs")
    for option, measured in (("--kernels", cpu if kernels_given else None), ("--gpu-kernels", gpu)):
        warning = _cache_warning(option, measured) if measured else None
        if warning:
            print(warning)
    print(projection_tables(gpu, bucket_mbs=args.bucket_mb, cpu=cpu))


if __name__ == "__main__":
    main()
