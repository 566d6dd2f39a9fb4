#!/usr/bin/env bash
# An emulated cluster on one machine: K network namespaces ("hosts") on a Linux bridge that lives in
# a namespace of its own, each host's egress shaped by tc tbf to the link rate. At each rate it runs
# benchmarks/bench_allreduce.py with one process per host over gloo (TCP), then removes everything,
# on failure and Ctrl-C too. Nothing but the namespaces <prefix>sw and <prefix>h<i> is ever touched,
# and they have no route out. Needs root and iproute2; --dry-run prints the commands and runs none.
#
#   benchmarks/netem/run.sh [--hosts 4] [--rate 500mbit,1gbit,2gbit] [--out DIR] [--prefix gsnet-]
#                           [--timeout SECONDS] [--dry-run] [-- bench_allreduce.py arguments]
#
# Arguments after -- replace the defaults given to bench_allreduce.py (BENCH_ARGS below).
#
# Writes DIR/rate-<rate>.json (bench_allreduce.py's rows), DIR/rank<i>-<rate>.log and, through
# report.py, DIR/netem.{json,md,png}; without --out, DIR is a new private folder under $TMPDIR (or
# /tmp), named at the start. One run at a time per prefix. PYTHON selects the interpreter (default
# python3).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BENCH=$(dirname "$HERE")/bench_allreduce.py
HOSTS=4 RATES=500mbit,1gbit,2gbit OUT= PREFIX=gsnet- TIMEOUT=900 DRY=
PYTHON=${PYTHON:-python3}
BENCH_ARGS=(--min-bytes 1K --max-bytes 64M --step 4 --budget-bytes 512M)
MASTER_PORT=29500  # the namespaces are private, so a fixed port cannot collide

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while (($#)); do
  case $1 in
    --hosts | --rate | --out | --prefix | --timeout)
      (($# >= 2)) || { echo "run.sh: $1 needs a value" >&2; exit 2; } ;;&
    --hosts) HOSTS=$2; shift 2 ;;
    --rate) RATES=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) usage ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "run.sh: unknown argument $1" >&2; usage 2 ;;
  esac
done
[[ $HOSTS =~ ^[1-9][0-9]{0,2}$ ]] && ((HOSTS >= 2 && HOSTS <= 200)) || { echo "run.sh: --hosts must be 2..200" >&2; exit 2; }
[[ $TIMEOUT =~ ^[1-9][0-9]{0,6}$ ]] || { echo "run.sh: --timeout must be a whole number of seconds" >&2; exit 2; }
[[ $PREFIX =~ ^[a-z0-9-]{1,12}$ ]] || { echo "run.sh: --prefix must be 1-12 of [a-z0-9-]" >&2; exit 2; }
[[ -n $DRY || $EUID == 0 ]] || { echo "run.sh: needs root (network namespaces, tc); --dry-run needs none" >&2; exit 2; }

SW=${PREFIX}sw
host() { echo "${PREFIX}h$1"; }
addr() { echo "10.77.0.$(($1 + 1))"; }

# Prints a command exactly (shell-quoted), then runs it unless this is a dry run.
run() {
  local line
  line=$(printf '%q ' "$@")
  echo "${line% }"
  [[ -n $DRY ]] || "$@"
}

rate_bps() {
  awk -v r="$1" 'BEGIN {
    if (!match(r, /^[0-9]*\.?[0-9]+/)) exit 1
    v = substr(r, 1, RLENGTH) + 0; u = substr(r, RLENGTH + 1)
    m = u == "kbit" ? 1e3 : u == "mbit" ? 1e6 : u == "gbit" ? 1e9 : 0
    if (m == 0 || v * m < 1000) exit 1
    printf "%.0f", v * m }' || { echo "run.sh: bad rate '$1' (e.g. 500mbit, 1gbit)" >&2; exit 2; }
}

IFS=, read -ra RATE_LIST <<<"$RATES"
((${#RATE_LIST[@]})) || { echo "run.sh: --rate needs at least one rate (e.g. 500mbit,1gbit)" >&2; exit 2; }
# a rate given twice (1gbit,1000mbit) would run twice and be reported twice, or write one JSON twice
declare -A SEEN_BPS=()
for rate in "${RATE_LIST[@]}"; do
  bps=$(rate_bps "$rate")
  [[ -z ${SEEN_BPS[$bps]:-} ]] || { echo "run.sh: --rate gives $rate and ${SEEN_BPS[$bps]}, one rate twice" >&2; exit 2; }
  SEEN_BPS[$bps]=$rate
done

# tbf needs a bucket of at least ~4 ms of traffic (and 256 KB), or TCP throughput collapses; the
# queue holds 100 ms so that the shaper delays packets rather than dropping them.
shape() {
  local bps burst limit i
  bps=$(rate_bps "$1")
  burst=$((bps / 2000 > 262144 ? bps / 2000 : 262144))
  limit=$((bps / 80 > 2 * burst ? bps / 80 : 2 * burst))
  for ((i = 0; i < HOSTS; i++)); do
    run tc -n "$(host $i)" qdisc replace dev eth0 root tbf rate "$1" burst "$burst" limit "$limit"
  done
}

# Removes our namespaces, leftovers of a killed run included: their processes first, then the
# namespaces themselves, which takes their veths and the bridge along. One that cannot be removed
# does not stop the others; the teardown then fails.
teardown() {
  local ns pid status=0
  if [[ -n $DRY ]]; then
    echo "# every namespace that exists named ${PREFIX}sw or ${PREFIX}h<number> (an earlier run's included):"
    echo "# its processes killed (kill -9 \$(ip netns pids NS)), then it is removed, as these are:"
    for ((i = 0; i < HOSTS; i++)); do run ip netns del "$(host $i)"; done
    run ip netns del "$SW"
    return
  fi
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^${PREFIX}(sw|h[0-9]+)\$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" || { echo "run.sh: could not remove the namespace $ns" >&2; status=1; }
  done
  return "$status"
}

cleanup() {
  local status=$?
  # a second Ctrl-C (or TERM) must not cut the teardown short and leave the ranks running
  trap '' INT TERM HUP
  trap - EXIT
  # a reader of the output that is gone (Ctrl-C on `run.sh | tee log`) must not end the teardown
  trap '' PIPE
  teardown || ((status)) || status=1  # the ranks too: they are the namespaces' processes
  wait 2>/dev/null || true
  echo "# torn down" >&2 || true
  exit "$status"
}
# A second run with this prefix would tear down this one's namespaces as leftovers. The lock lives
# in root's own /run, where no other user can plant a link, and goes with this shell however it
# ends (the ranks do not hold it: a killed run's ranks are leftovers for the next run to kill). It
# is taken before the exit trap is set, which would tear down the running one's namespaces.
if [[ -z $DRY ]]; then
  for tool in ip tc flock timeout; do
    command -v "$tool" >/dev/null || { echo "run.sh: needs $tool (iproute2, util-linux, coreutils)" >&2; exit 2; }
  done
  exec {lock}>>"/run/gradsync-netem-$PREFIX.lock" ||
    { echo "run.sh: cannot create /run/gradsync-netem-$PREFIX.lock" >&2; exit 2; }
  flock -n "$lock" ||
    { echo "run.sh: another run with prefix $PREFIX is in progress (give this one another --prefix)" >&2; exit 2; }
fi
# each signal's trap ignores the next ones first: one landing before cleanup ignores them would
# exit from inside the trap, the teardown never run
if [[ -z $DRY ]]; then
  trap cleanup EXIT
  trap "trap '' INT TERM HUP; exit 130" INT
  trap "trap '' INT TERM HUP; exit 143" TERM
fi

setup() {
  local i h
  run ip netns add "$SW"
  run ip -n "$SW" link add br0 type bridge
  run ip -n "$SW" link set br0 up
  for ((i = 0; i < HOSTS; i++)); do
    h=$(host $i)
    run ip netns add "$h"
    run ip -n "$SW" link add "p$i" type veth peer name eth0 netns "$h"
    run ip -n "$SW" link set "p$i" master br0 up
    run ip -n "$h" addr add "$(addr $i)/24" dev eth0
    run ip -n "$h" link set eth0 up
    run ip -n "$h" link set lo up
  done
}

# One process per host; rank 0 writes the JSON. Any rank failing or timing out fails the run.
bench() {
  local rate=$1 i failed=0 cmd log pids=()
  run rm -f "$OUT/rate-$rate.json"  # an earlier run's, which must never pass for this one's
  for ((i = 0; i < HOSTS; i++)); do
    cmd=(ip netns exec "$(host $i)" env RANK=$i WORLD_SIZE=$HOSTS LOCAL_RANK=0 LOCAL_WORLD_SIZE=1
      MASTER_ADDR="$(addr 0)" MASTER_PORT=$MASTER_PORT GLOO_SOCKET_IFNAME=eth0
      timeout "$TIMEOUT" "$PYTHON" "$BENCH" "${BENCH_ARGS[@]}")
    ((i == 0)) && cmd+=(--json "$OUT/rate-$rate.json")
    log=$OUT/rank$i-$rate.log
    if [[ -n $DRY ]]; then
      echo "$(printf '%q ' "${cmd[@]}")>$(printf '%q' "$log") 2>&1 &"
      continue
    fi
    "${cmd[@]}" >"$log" 2>&1 {lock}>&- &
    pids+=($!)
  done
  [[ -z $DRY ]] || echo wait
  # the first rank to fail ends the run at once (the exit trap kills the others), rather than
  # after the others time out waiting for it
  for ((i = 0; i < ${#pids[@]}; i++)); do wait -n "${pids[@]}" 2>/dev/null || { failed=1; break; }; done
  if ((failed)); then
    echo "run.sh: a rank failed or timed out at $rate; logs in $OUT" >&2
    tail -n 20 "$OUT"/rank*-"$rate".log >&2
    exit 1
  fi
  run cat "$OUT/rank0-$rate.log"
  if [[ -z $DRY && ! -s $OUT/rate-$rate.json ]]; then
    echo "run.sh: rank 0 wrote no $OUT/rate-$rate.json at $rate (did the arguments after -- stop the benchmark?)" >&2
    exit 1
  fi
}

# The default folder is a new one (mktemp -d: mode 0700), never a fixed name in a shared /tmp that
# another user could have made first, or filled with links, for root to write through.
if [[ -z $OUT ]]; then
  if [[ -n $DRY ]]; then
    OUT=${TMPDIR:-/tmp}/gsnet-out.XXXXXX
    echo "mktemp -d $(printf '%q' "$OUT")"
  else
    OUT=$(mktemp -d "${TMPDIR:-/tmp}/gsnet-out.XXXXXX")
  fi
else
  run mkdir -p "$OUT"
fi
echo "# output: $OUT"
echo "# cleanup of leftovers"
teardown
echo "# setup: $HOSTS hosts on a bridge"
setup
for rate in "${RATE_LIST[@]}"; do
  echo "# rate $rate"
  shape "$rate"
  bench "$rate"
done
echo "# report"
JSONS=()
for rate in "${RATE_LIST[@]}"; do JSONS+=("$OUT/rate-$rate.json"); done
run "$PYTHON" "$HERE/report.py" --out "$OUT/netem" "${JSONS[@]}"
if [[ -n $DRY ]]; then  # what the exit trap runs
  echo "# teardown"
  teardown
fi
