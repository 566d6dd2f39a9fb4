#!/usr/bin/env bash
# The GPU suite: on a GPU machine with torch, nvcc, ninja and cupy preinstalled (no network needed),
# builds gradsync, runs every CUDA test, the kernel benchmarks, a one-rank
# all-reduce over the NCCL transport and the cost of one ring hop over NCCL, and writes
# logs and JSON into OUTDIR, with the cost model's projections from those measurements. Target:
# about 6 minutes on one H200 (the build included), so that a second run still fits a 15-minute
# lease; every step has a time limit, together 485 s beside the build, so that one run stays within a
# 10-minute command. The CPU tests are left to CI.
#
#   benchmarks/gpu_suite.sh OUTDIR
#   benchmarks/gpu_suite.sh /tmp/suite; tar czf RESULTS.tgz -C /tmp suite   # its dozen files as one
set -uo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the script works from the repository's root
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1  # no network: pip must not wait for an index
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($python -c \
  "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}.{p[1]}')" 2>/dev/null || echo 9.0)}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # an NCCL failure explains itself in the logs
export GRADSYNC_CUDA=${GRADSYNC_CUDA:-1}  # no silent CPU-only build when the toolkit is not found
started=$SECONDS
status=0

{ date -u; nvidia-smi; nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv  # ranks share the GPU
  which nvcc; nvcc --version; echo "CUDA_HOME=${CUDA_HOME:-}"; $python --version
  $python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  $python -c "import glob, nvidia.nccl as m; d = list(m.__path__)[0]  # a namespace package: no __file__
print('nvidia-nccl:', glob.glob(d + '/include/nccl.h'), glob.glob(d + '/lib/libnccl.so*'))"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
if ! $python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no GPU')"; then
  exit 1  # every CUDA test would skip, and pass
fi

echo "== build (arch $TORCH_CUDA_ARCH_LIST)"
if ! $python -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
$python -m gradsync.report | tee "$out/report.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== CUDA tests [$((SECONDS - started))s]"  # first, so that nothing slower can crowd them out
$python -c "import pytest, hypothesis, numpy" 2>&1 | tee "$out/tests_cuda.log" || status=1
# the join-timeout test waits out an NCCL bootstrap by design: on its own, so that it cannot crowd out the others
timeout -s INT -k 15 160 $python -m pytest tests -m cuda -q -rs -p no:cacheprovider \
  --deselect tests/test_allreduce.py::test_nccl_join_times_out_when_a_peer_never_joins 2>&1 | tee -a "$out/tests_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout -s INT -k 10 60 $python -m pytest tests/test_allreduce.py::test_nccl_join_times_out_when_a_peer_never_joins \
  -q -rs -p no:cacheprovider 2>&1 | tee -a "$out/tests_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kernel benchmarks [$((SECONDS - started))s]"
timeout -s INT -k 10 110 $python benchmarks/bench_kernels.py --device cuda --json "$out/bench_kernels_cuda.json" \
  --plot "$out/bench_kernels_cuda.png" 2>&1 | tee "$out/bench_kernels_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== all-reduce through the NCCL transport, world size 1 (the ring's kernels; no wire) [$((SECONDS - started))s]"
timeout -s INT -k 10 80 $python -m torch.distributed.run --nproc-per-node 1 benchmarks/bench_allreduce.py --device cuda \
  --max-bytes 256M --json "$out/bench_allreduce_cuda_1rank.json" 2>&1 | tee "$out/bench_allreduce_cuda_1rank.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== one ring hop over NCCL: host cost and latency, non-blocking vs blocking communicator [$((SECONDS - started))s]"
timeout -s INT -k 10 45 $python benchmarks/bench_nccl_hop.py --json "$out/bench_nccl_hop.json" 2>&1 | tee "$out/bench_nccl_hop.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== the cost model's projections with the measured kernels and hop [$((SECONDS - started))s]"
timeout 30 $python -m gradsync.model --gpu-kernels "$out/bench_kernels_cuda.json" --nccl-hop "$out/bench_nccl_hop.json" \
  > "$out/model_projections.txt" 2>&1 || status=1
head -30 "$out/model_projections.txt"

echo "== done in $((SECONDS - started))s, status $status"
exit $status
