"""The benchmark scripts run end to end on small cases and write the tables and JSON they promise.

bench_allreduce.py runs here on loopback (its arithmetic and errors) and in the emulated cluster's
tests (test_netem.py); the GPU suite runs these scripts again on a GPU, where a script that fails
would cost a scarce machine's time.
"""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch

import gradsync
from cli_harness import run_each

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def run(args, tmp_path, timeout=180):
    """The script's stdout; on a timeout its whole process group (torchrun's workers too) is killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.Popen([sys.executable, *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    return stdout


def run_ranks(ranks, script, args, tmp_path):
    """A benchmark on `ranks` local processes (torchrun picks a free port): its table and its JSON."""
    out = tmp_path / "report.json"
    table = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                 os.path.join(BENCH, script), *args, "--json", str(out)], tmp_path)
    return table, json.loads(out.read_text())


def test_the_kernel_benchmark_measures_every_op_of_a_case(tmp_path):
    out = tmp_path / "kernels.json"
    table = run([os.path.join(BENCH, "bench_kernels.py"), "--device", "cpu", "--cases", "resnet50", "buffer-4MB",
                 "--max-mb", "4", "--json", str(out)], tmp_path)
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["case"] for r in rows} == {"resnet50", "buffer-4MB"}
    assert f"CPU, {report['meta']['threads']} threads" in report["title"]  # gradsync.model labels its rows so
    ops = {r["op"] for r in rows if r["case"] == "resnet50"}
    assert {"torch cat+div+half", "gradsync flatten(fp16)", "gradsync unflatten(fp16)",
            "gradsync compress(fp8_e4m3)", "gradsync decompress(fp8_e4m3)"} <= ops
    for r in rows:
        assert r["time_ms"] > 0 and r["gbps"] > 0 and r["op"] in table, r
        assert abs(r["gbps"] - r["bytes_moved"] / (r["time_ms"] * 1e6)) < 1e-6 * r["gbps"], r
    flatten = next(r for r in rows if r["case"] == "resnet50" and r["op"] == "gradsync flatten(fp16)")
    assert flatten["tensors"] == 161 and flatten["bytes_moved"] == 6 * flatten["count"]  # fp32 in, fp16 out
    # fp16 of standard normal data: a relative L2 error near 2^-12 (a bug in the cast would show)
    assert 1e-4 < flatten["error"] < 4e-4, flatten
    # an error not measured is null in the JSON and "-" in the table; an exact result is 0, not "-"
    alloc = next(r for r in rows if r["case"] == "resnet50" and r["op"] == "gradsync flatten(fp16), alloc")
    assert alloc["error"] is None
    sys.path.insert(0, BENCH)
    try:
        import bench_allreduce
        import common
    finally:
        sys.path.remove(BENCH)
    assert (common.sci(None), common.sci(0.0), common.sci(2.5e-4)) == ("-", "0", "2.50e-04")
    assert [bench_allreduce.ninetieth_percentile(list(range(1, n + 1))) for n in (1, 9, 10, 11, 20, 30)] == \
        [1, 9, 9, 10, 18, 27]


def test_the_training_benchmark_hides_at_most_all_of_the_shorter_part():
    sys.path.insert(0, BENCH)
    try:
        import bench_ddp
    finally:
        sys.path.remove(BENCH)
    assert bench_ddp.overlap_hidden(4.0, 2.0, 5.0) == (0.5, "50% of the shorter one hidden")
    assert bench_ddp.overlap_hidden(4.0, 2.0, 4.0) == (1.0, "100% of the shorter one hidden")
    hidden, words = bench_ddp.overlap_hidden(0.644, 7.61, 6.84)  # communication measured apart took longer
    assert hidden == 1.0 and words.startswith("all of the shorter one hidden; the step is 0.77 ms shorter than "
                                              "communication alone"), words
    assert bench_ddp.overlap_hidden(4.0, 2.0, 7.0) == (-0.5, "nothing hidden: 1 ms more than the two apart")


def slowest_of_two(rank, size):
    """bench_allreduce's statistics of made-up calls: rank 0 steady at 2 ms; rank 1 at 1 ms with two
    of ten calls at 10 ms."""
    sys.path.insert(0, BENCH)
    try:
        import bench_allreduce
    finally:
        sys.path.remove(BENCH)
    samples = [0.002] * 10 if rank == 0 else [0.001] * 8 + [0.010] * 2
    return bench_allreduce.slowest_stats_ms(samples, torch.device("cpu"), None)


def test_the_all_reduce_benchmark_reports_every_statistic_of_one_rank(worlds):
    """The slowest rank is the one of the highest interquartile mean, and its median, 90th
    percentile and share of slow calls are reported with it, not each the highest of any rank."""
    expected = pytest.approx((2.0, 2.0, 2.0, 0.0))
    assert worlds(2).run(slowest_of_two) == [expected, expected]


def test_the_training_benchmark_times_every_mode_on_two_ranks(tmp_path):
    table, report = run_ranks(2, "bench_ddp.py", ["--params", "2e5", "--layers", "4", "--batch", "4", "--steps", "2"],
                              tmp_path)
    modes = {r["mode"] for r in report["rows"]}
    assert {"DDP default (fp32)", "torch fp16 hook", "gradsync fp16 hook", "compute only (no_sync)",
            "communication only (gradsync fp16)"} <= modes
    assert {"gradsync.DataParallel fp16", "gradsync.DataParallel fp16, compiled",
            "gradsync.DataParallel fp16, compiled, one graph"} <= modes
    assert report["meta"]["ranks"] == 2 and abs(report["meta"]["params"] - 2e5) < 0.1 * 2e5
    for r in report["rows"]:
        assert r["step_ms"] > 0 and r["mode"] in table, r
        # the compute-only and communication-only rows are parts of a step: no step speedup
        assert (r["speedup"] is None) == ("only" in r["mode"]) and (r["vs_torch_fp16"] is None) == ("only" in r["mode"])
    assert "overlap timeline" in table
    hidden = report["meta"]["overlap_hidden"]  # the line says what the JSON holds, a step slower than its parts too
    noise = "(all of the shorter one hidden; " in table  # a part measured apart took longer than the whole step
    assert (hidden == 1.0 if noise else f"({100 * hidden:.0f}% of the shorter one hidden)" in table if hidden >= 0
            else "(nothing hidden: " in table), table
    # and its sums add up (whole milliseconds did not, on steps of a few)
    line = next(line for line in table.splitlines() if line.startswith("compute ") and " + communication " in line)
    compute, comm, both, hook, *more = map(float, re.findall(r"(-?[\d.]+(?:e[+-]\d+)?) ms", line))
    assert compute + comm == pytest.approx(both, rel=0.01, abs=0.01), line
    assert not more or (more[0] > 0 and (hook + more[0] == pytest.approx(max(compute, comm), rel=0.01, abs=0.01)
                                         if noise else both + more[0] == pytest.approx(hook, rel=0.01, abs=0.01))), line
    # "communication only" sends the buckets the hook sent, one call each, all the parameters
    buckets = report["meta"]["communication_only_buckets"]
    assert len(buckets) == report["meta"]["timeline"][1] and sum(buckets) == report["meta"]["params"]


def test_the_all_reduce_benchmark_reports_consistent_rows(tmp_path):
    table, report = run_ranks(3, "bench_allreduce.py", ["--min-bytes", "4K", "--max-bytes", "256K", "--step", "8",
                                                        "--max-iters", "4", "--feedback"], tmp_path)
    assert report["meta"]["ranks"] == 3
    rows = {(r["bytes"], r["impl"]): r for r in report["rows"]}
    assert {size for size, _ in rows} == {4096, 32768, 262144}
    codecs = [f"gradsync {c}" for c in gradsync.CODECS]
    # the wire bytes per element of each implementation, and its relative error vs fp64 at most
    expected = {"torch fp32": (4, 2e-7), "torch fp16 hook path": (2, 1e-3), "gradsync none": (4, 2e-7),
                "gradsync fp16": (2, 1e-3), "gradsync bf16": (2, 5e-3), "gradsync fp8_e4m3": (1 + 4 / 128, 0.05),
                "gradsync fp8_e5m2": (1 + 4 / 128, 0.1), "gradsync fp16 ring": (2, 1e-3),
                "gradsync fp16 unchecked": (2, 1e-3)}  # the last two: small buffers, beside the direct exchange
    assert set(codecs) <= set(expected)
    # nccl-tests' units in the printed table: bytes, elements, us, GB/s
    assert "size(B)      count  type   redop" in table and "time(us)  algbw(GB/s)  busbw(GB/s)" in table, table
    lines = table.splitlines()
    for (size, impl), r in rows.items():
        assert any(line.startswith(f"{size:>12}{size // 4:>11}  float  avg    {impl} ") and
                   f" {r['time_ms'] * 1e3:.1f} " in line for line in lines), (size, impl, table)
        assert r["count"] == size // 4 and r["time_ms"] > 0
        assert abs(r["algbw"] - size / (r["time_ms"] * 1e6)) <= 1e-9 * r["algbw"], r
        assert abs(r["busbw"] - r["algbw"] * 4 / 3) <= 1e-9 * r["busbw"], r  # 2(n-1)/n
        if impl.endswith("+ef"):  # its first call, which the column would show, is the codec's own
            assert r["error"] is None and r["wire_bytes"] == rows[(size, impl[:-3])]["wire_bytes"], r
        if impl in expected:
            wire, bound = expected[impl]
            assert r["wire_bytes"] == int(r["count"] * wire), r
            assert 0 < r["error"] <= bound, r  # every sum rounds somewhere
        if impl != "torch fp32":
            assert abs(r["speedup"] - rows[(size, "torch fp32")]["time_ms"] / r["time_ms"]) <= 1e-9 * r["speedup"], r
    assert {impl for _, impl in rows} >= set(expected) | {f"{c}+ef" for c in codecs if c != "gradsync none"}


def failed_run(ranks, args, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), os.path.join(BENCH, "bench_allreduce.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


def test_the_all_reduce_benchmark_refuses_what_the_world_cannot_measure(tmp_path):
    assert "--accuracy compares groups of 2, 4 and 8 ranks: start at least 2" in failed_run(1, ["--accuracy"], tmp_path)
    # the rows beside the direct exchange exist only where it is taken (not at one rank, nor at 1 MiB)
    assert "--impls ring: no such row at 1 ranks from 4.0 KiB to 16.0 KiB" in \
        failed_run(1, ["--impls", "ring", "--min-bytes", "4K", "--max-bytes", "16K"], tmp_path)


def test_a_cut_short_all_reduce_benchmark_keeps_the_sizes_it_measured(tmp_path):
    out = tmp_path / "cut.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             os.path.join(BENCH, "bench_allreduce.py"), "--min-bytes", "4K", "--max-bytes", "1G",
                             "--impls", "fp16", "--json", str(out)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        timer = threading.Timer(120, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        for line in proc.stderr:  # the JSON is written before a size is reported done
            if line.startswith("# done: 16.0 KiB"):
                break
        timer.cancel()
    finally:
        # torchrun's workers run in sessions of their own, holding stderr open: SIGTERM makes torchrun
        # stop them (a SIGKILL of its group alone left them measuring up to 1 GiB, a test of two minutes)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    rows = json.loads(out.read_text())["rows"]
    assert {r["bytes"] for r in rows} >= {4096, 16384}, rows
    assert {r["impl"] for r in rows if r["bytes"] == 4096} >= {"torch fp32", "gradsync fp16"}


BAD_ARGUMENTS = [
    ("bench_kernels.py", ["--device", "foo"], "--device"),
    ("bench_kernels.py", ["--device", "cuda:0"] if not torch.cuda.is_available() else ["--max-mb", "2"],
     "--device cuda: torch sees no GPU" if not torch.cuda.is_available() else "--max-mb"),
    ("bench_ddp.py", ["--layers", "0"], "--layers and --batch must be at least 1"),
    ("bench_ddp.py", ["--params", "nan"], "--params must be at least --layers"),
    ("bench_ddp.py", ["--params", "inf"], "--params must be at least --layers (12) and finite"),
    # started without torchrun (these tests run the scripts without it): a usage error, not torch's traceback
    ("bench_ddp.py", ["--steps", "2"], "start it with torchrun"),
    ("bench_allreduce.py", ["--max-bytes", "4K"], "start it with torchrun"),
    ("bench_kernels.py", ["--cases", "gpt2", "--plot", "k.png"], "--plot draws the single buffers"),
    (os.path.join("netem", "report.py"), ["--out", "r", "run.json"], "run.sh names its runs rate-<rate>.json"),
    (os.path.join("netem", "report.py"), ["--out", "r", "rate-1Gbit.json"], "bad rate '1Gbit'"),
    (os.path.join("netem", "report.py"), ["--out", "r", "rate-1gbit.json"], "rate-1gbit.json does not exist"),
    (os.path.join("netem", "report.py"), ["--out", "r", "a/rate-1gbit.json", "rate-1000mbit.json"],
     "a/rate-1gbit.json and rate-1000mbit.json are runs of one rate"),
    ("bench_allreduce.py", ["--rounds", "0"], "--rounds must be at least 1"),
    ("bench_allreduce.py", ["--min-bytes", ""], "--min-bytes"),
    ("bench_allreduce.py", ["--min-bytes", "infK"], "--min-bytes: invalid parse_bytes value"),
    ("bench_allreduce.py", ["--max-bytes=-1K"], "--max-bytes: invalid parse_bytes value"),
    ("bench_allreduce.py", ["--min-bytes", "4" + "0" * 400], "--min-bytes must be a positive multiple of 4 bytes"),
    ("bench_allreduce.py", ["--device", "cuda"] if not torch.cuda.is_available() else ["--step", "1"],
     "--device cuda: torch sees no GPU" if not torch.cuda.is_available() else "--step"),
    ("bench_allreduce.py", ["--accuracy", "--impls", "fp16"], "--impls selects timed rows"),
    # an output file in a folder that is not there: refused before the run, not written after it
    ("bench_kernels.py", ["--cases", "gpt2", "--plot", "missing/k.png"], "--plot missing/k.png: the folder"),
    ("bench_allreduce.py", ["--json", "missing/a.json"], "--json missing/a.json: the folder"),
    pytest.param("bench_allreduce.py", ["--plot", "a.txt"], "--plot a.txt: give an image file name ending in one of",
                 marks=pytest.mark.skipif(not importlib.util.find_spec("matplotlib"), reason="nothing is plotted")),
    ("bench_ddp.py", ["--json", "missing/d.json"], "--json missing/d.json: the folder"),
    ("bench_ddp.py", ["--json", "/proc/d.json"], "--json /proc/d.json: cannot write in the folder /proc"),
    ("bench_nccl_hop.py", ["--json", "missing/h.json"], "--json missing/h.json: the folder"),
    (os.path.join("netem", "report.py"), ["--out", "missing/r", "rate-1gbit.json"], "--out missing/r: the folder"),
    # a folder where a file is meant: refused before the run, not a traceback after it (or hidden files)
    ("bench_allreduce.py", ["--json", "."], "--json .: a folder; give a file name in it (./results.json)"),
    ("bench_kernels.py", ["--json", "out/"], "--json out/: a folder"),
    ("bench_ddp.py", ["--json", os.sep], f"--json {os.sep}: a folder"),
    (os.path.join("netem", "report.py"), ["--out", "rep/", "rate-1gbit.json"],
     "--out rep/: a folder; give the start of a file name in it (rep/results)"),
    ("bench_allreduce.py", ["--gloo-loop-nice", "100"], "a niceness is -20 to 19, got 100"),
    ("bench_allreduce.py", ["--accuracy", "--feedback", "--max-bytes", "4K"],
     "--max-bytes, --feedback shape the timed table only"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Each case of BAD_ARGUMENTS run, all in one process: {(script, args): Done}."""
    cases = [case.values if hasattr(case, "values") else case for case in BAD_ARGUMENTS]
    done = run_each([[os.path.join(BENCH, script), *args] for script, args, _ in cases],
                    cwd=tmp_path_factory.mktemp("refusals"))
    return {(script, tuple(args)): d for (script, args, _), d in zip(cases, done)}


@pytest.mark.parametrize("script, args, message", BAD_ARGUMENTS)
def test_the_benchmarks_refuse_bad_arguments_before_they_start(script, args, message, refusals):
    done = refusals[(script, tuple(args))]
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_the_kernel_benchmark_gives_set_device_an_index(monkeypatch):
    """torch.cuda.set_device refuses a device without an index, and "--device cuda" has none."""
    sys.path.insert(0, BENCH)
    try:
        import bench_kernels
    finally:
        sys.path.remove(BENCH)

    class Selected(Exception):
        pass

    def set_device(device):
        torch.cuda._utils._get_device_index(device)  # torch's own check: raises without an index
        raise Selected(device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--device", "cuda"])
    with pytest.raises(Selected) as selected:
        bench_kernels.main()
    assert selected.value.args[0] == torch.device("cuda", 0)


def test_a_cupy_that_cannot_run_leaves_out_its_row_only(monkeypatch, capsys):
    """A cupy built for another CUDA runtime imports, then fails at its first call."""
    sys.path.insert(0, BENCH)
    try:
        import bench_kernels
    finally:
        sys.path.remove(BENCH)

    class Device:
        def __init__(self, index):
            raise RuntimeError("cudaErrorInsufficientDriver")
    broken = type(sys)("cupy")
    broken.cuda = type(sys)("cupy.cuda")
    broken.cuda.Device = Device
    monkeypatch.setitem(sys.modules, "cupy", broken)
    assert bench_kernels.cupy_flatten([torch.randn(3)]) is None
    assert "cupy row left out: RuntimeError: cudaErrorInsufficientDriver" in capsys.readouterr().out
