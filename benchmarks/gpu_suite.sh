#!/usr/bin/env bash
# The GPU suite: on a GPU machine with torch, nvcc, ninja and cupy preinstalled (no network needed),
# builds gradsync, runs every CUDA test, the kernel benchmarks, a one-rank all-reduce over the NCCL
# transport and the cost of one ring hop over NCCL, and writes into OUTDIR seven files:
#   setup.log        the machine, the toolkit, the end of the build's log and gradsync.report
#   tests_cuda.log   the CUDA tests (and the build tests that need a CUDA build)
#   bench.log        every benchmark's table and the cost model's projections from them
#   bench_kernels_cuda.json, bench_kernels_cuda.png, bench_allreduce_cuda_1rank.json, bench_nccl_hop.json
# Each file is written as its step runs, so a run cut short keeps what it measured. Target:
# about 6 minutes on one H200 (the build included); every step has a time limit, and a step that
# would end past BUDGET seconds (default 540) is skipped, so that one run stays within a 10-minute
# command (lower BUDGET to leave time for a second run). The CPU tests are left to CI.
#
#   benchmarks/gpu_suite.sh OUTDIR
set -uo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the script works from the repository's root
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
budget=${BUDGET:-540}
started=$SECONDS
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1  # no network: pip must not wait for an index
export PIP_BREAK_SYSTEM_PACKAGES=1  # an image's system Python marked externally managed (PEP 668) still takes the build
inherited_arch=${TORCH_CUDA_ARCH_LIST:-}
# this GPU's architecture alone (GPU_SUITE_ARCH overrides): a list from the image would multiply the build
export TORCH_CUDA_ARCH_LIST=${GPU_SUITE_ARCH:-$(timeout 60 $python -c \
  "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}.{p[1]}')" 2>/dev/null || echo 9.0)}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # an NCCL failure explains itself in the logs
export GRADSYNC_CUDA=${GRADSYNC_CUDA:-1}  # no silent CPU-only build when the toolkit is not found
status=0

# run LOG SECONDS COMMAND...: the command under a time limit, its output appended to LOG (not piped
# through tee: a process it leaves behind, such as a rank in another session, would hold the pipe and
# the run), then the part it wrote shown here (with what such a process wrote meanwhile). Fails as
# the command does, and says so in LOG.
run() {
  local log=$1 limit=$2 start
  shift 2
  start=$(stat -c %s "$log" 2>/dev/null || echo 0)
  timeout -s INT -k 10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "== exit $rc$( ((rc == 124 || rc == 137)) && echo " (past its limit of ${limit}s)"): $*" >> "$log"
  fi
  tail -c +$((start + 1)) "$log" | tail -n 80
  return $rc
}

# Whether a step of at most $1 seconds ends within the budget; otherwise it is skipped, and said so.
fits() {
  if ((SECONDS - started + $1 > budget)); then
    echo "== skipped (it would end past the budget of ${budget}s): $2" | tee -a "$out/bench.log"
    status=1
    return 1
  fi
}

# every probe has a time limit: a sick GPU must not hold the run before it has written anything
{ date -u; timeout 30 nvidia-smi; timeout 30 nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv
  which nvcc; nvcc --version; echo "CUDA_HOME=${CUDA_HOME:-}"; $python --version
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST (inherited: '${inherited_arch}') MAX_JOBS=$MAX_JOBS"
  timeout 60 $python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  timeout 60 $python -c "import glob, nvidia.nccl as m; d = list(m.__path__)[0]  # a namespace package: no __file__
print('nvidia-nccl:', glob.glob(d + '/include/nccl.h'), glob.glob(d + '/lib/libnccl.so*'))"
  timeout 60 $python -c "import pytest, hypothesis, numpy; print('pytest', pytest.__version__)"
  timeout 60 $python -c "import matplotlib; print('matplotlib', matplotlib.__version__)"  # the PNG plots
  timeout 60 $python -m pip --version  # the editable build needs setuptools >= 64 (PEP 660)
  timeout 60 $python -c "import setuptools; print('setuptools', setuptools.__version__)"
} > "$out/setup.log" 2>&1
cat "$out/setup.log"
# exclusive modes allow one process per GPU: the multi-process CUDA tests would fail as "busy" or unavailable
mode=$(timeout 30 nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)
if [ -n "$mode" ] && [ "$mode" != "Default" ]; then
  echo "== warning: compute mode $mode: the tests that put two processes on this GPU will fail" | tee -a "$out/setup.log"
fi
if ! timeout 60 $python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== stopped: torch sees no GPU (every CUDA test would skip, and pass)" | tee -a "$out/setup.log"
  exit 1
fi

echo "== build (arch $TORCH_CUDA_ARCH_LIST)" | tee -a "$out/setup.log"
build_log=$(mktemp)
timeout -s INT -k 10 300 $python -m pip install --no-build-isolation --no-deps -e . > "$build_log" 2>&1
build=$?
tail -60 "$build_log" >> "$out/setup.log"
if [ "$build" -ne 0 ]; then  # the compiler's error sits above pip's traceback and advice
  { echo "== the build's errors:"; grep -n -B2 -A12 -E 'error|FAILED' "$build_log" | head -200; } |
    tee -a "$out/setup.log"
  echo "== build failed ($build) after $((SECONDS - started))s" | tee -a "$out/setup.log"
  exit 1
fi
echo "== built in $((SECONDS - started))s" | tee -a "$out/setup.log"
run "$out/setup.log" 60 $python -m gradsync.report || status=1

echo "== CUDA tests [$((SECONDS - started))s]"  # first, so that nothing slower can crowd them out
# the join-timeout test waits out an NCCL bootstrap by design: it runs on its own, at the end
# one hung test must not take the step: a limit per test where pytest-timeout is there
# (a thread, which also ends a test stuck in C code, such as a CUDA or NCCL wait)
per_test=$(timeout 60 $python -c "import pytest_timeout" 2>/dev/null && echo "--timeout 90 --timeout-method=thread")
if fits 235 "CUDA tests"; then
  run "$out/tests_cuda.log" 220 $python -m pytest tests -m cuda -q -rs -p no:cacheprovider $per_test \
    --deselect tests/test_allreduce.py::test_nccl_join_times_out_when_a_peer_never_joins || status=1
fi
if fits 50 "build tests under this torch's NCCL"; then
  run "$out/tests_cuda.log" 40 $python -m pytest tests/test_build.py -q -rs -p no:cacheprovider \
    -k "nccl or report or version_carries" || status=1
fi

echo "== kernel benchmarks [$((SECONDS - started))s]" | tee -a "$out/bench.log"
if fits 120 "kernel benchmarks"; then
  run "$out/bench.log" 110 $python benchmarks/bench_kernels.py --device cuda --json "$out/bench_kernels_cuda.json" \
    --plot "$out/bench_kernels_cuda.png" || status=1
fi

echo "== all-reduce through the NCCL transport, world size 1 (the ring's kernels; no wire) [$((SECONDS - started))s]" \
  | tee -a "$out/bench.log"
if fits 95 "one-rank all-reduce"; then
  # the one rank started as torchrun would start it, but as timeout's own child, so that the limit reaches it
  port=$(timeout 5 $python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${port:-29531} \
    run "$out/bench.log" 80 $python benchmarks/bench_allreduce.py --device cuda --max-bytes 256M \
    --json "$out/bench_allreduce_cuda_1rank.json" || status=1
fi

echo "== one ring hop over NCCL: host cost and latency, non-blocking vs blocking communicator [$((SECONDS - started))s]" \
  | tee -a "$out/bench.log"
if fits 55 "NCCL hop"; then
  run "$out/bench.log" 45 $python benchmarks/bench_nccl_hop.py --json "$out/bench_nccl_hop.json" || status=1
fi

echo "== the cost model's projections with the measured kernels and hop [$((SECONDS - started))s]" | tee -a "$out/bench.log"
if [ -f "$out/bench_kernels_cuda.json" ] && [ -f "$out/bench_nccl_hop.json" ] && fits 30 "projections"; then
  projections=$(mktemp)
  timeout 30 $python -m gradsync.model --gpu-kernels "$out/bench_kernels_cuda.json" --nccl-hop "$out/bench_nccl_hop.json" \
    > "$projections" 2>&1 || status=1
  cat "$projections" >> "$out/bench.log"
  head -30 "$projections"
fi

# last: it waits out an NCCL bootstrap by design, and the measurements above matter more
echo "== the NCCL join timeout test [$((SECONDS - started))s]"
if fits 70 "NCCL join timeout test"; then
  run "$out/tests_cuda.log" 60 $python -m pytest \
    tests/test_allreduce.py::test_nccl_join_times_out_when_a_peer_never_joins -q -rs -p no:cacheprovider || status=1
fi

echo "== done in $((SECONDS - started))s, status $status" | tee -a "$out/bench.log"
exit $status
