#!/usr/bin/env bash
# Batching on vs off under 64 clients of small causal prefills (issue 10's >= 3x), with the
# server in a cpuset of its own and the load on the other CPUs, fresh servers interleaved, and
# batching on once per value of an environment variable (an A/B of an engine switch in the
# same rounds):
#
#   bash benchmarks/ab_batching_placed.sh OUT [ROUNDS] [VAR "VALUES"]
#   e.g. bash benchmarks/ab_batching_placed.sh /tmp/ab 2 ATTENTION_PACK_KERNEL "1 0"
#
# Server CPUs SERVER_CPUS (default 0-10; the engine places itself, --engine-cpus auto), load
# CPUS LOAD_CPUS (default 11-15), --frontends FRONTENDS (8). Expects the tree installed as
# gpu_checks.sh installs it (source benchmarks/device_env.sh first). Each run's server log and
# bench_service.py output go to OUT; one summary line per run on stdout and in OUT/summary.txt.
set -uo pipefail
OUT=${1:?usage: ab_batching_placed.sh OUT [ROUNDS] [VAR "VALUES"]}
ROUNDS=${2:-2}
VAR=${3:-}
VALUES=${4:-}
SERVER_CPUS=${SERVER_CPUS:-0-10}
LOAD_CPUS=${LOAD_CPUS:-11-15}
FRONTENDS=${FRONTENDS:-8}
mkdir -p "$OUT"
status=0

healthy() {
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; \
sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null
}

run() {  # run NAME SIDE ROUND [VAR=VALUE]
  local name=$1 side=$2 round=$3 setting=${4:-}
  local port=$((50100 + 2 * (RANDOM % 1000))) tag="${name}_${side}_${round}"
  local mport=$((port + 1))
  env $setting taskset -c "$SERVER_CPUS" python3 -m attention_service --host 127.0.0.1 \
    --port $port --metrics-port $mport --log-level WARNING --frontends "$FRONTENDS" \
    "--$side" > "$OUT/server_$tag.log" 2>&1 &
  local sp=$!
  for _ in $(seq 1 150); do healthy $port && break; sleep 1; done
  timeout 90 taskset -c "$LOAD_CPUS" python3 benchmarks/bench_service.py \
    --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 \
    --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out "$OUT/svc_$tag" \
    > "$OUT/svc_$tag.log" 2>&1 || { echo "$tag: bench_service failed"; status=1; }
  local line
  line=$(grep -E 'clients +64:' "$OUT/svc_$tag.log" | sed -E 's/ +/ /g')
  echo "$tag ${setting:-default}: $line" | tee -a "$OUT/summary.txt"
  kill -TERM $sp
  wait $sp || { echo "$tag: server exit code $?"; status=1; }
}

for round in $(seq 1 "$ROUNDS"); do
  if [ -n "$VAR" ]; then
    for value in $VALUES; do
      run "$VAR=$value" batching "$round" "$VAR=$value"
    done
  else
    run default batching "$round"
  fi
  run default no-batching "$round"
done
exit $status
