#!/usr/bin/env bash
# A/B of one environment variable over fresh servers, interleaved (A B A B ...), so host drift
# and the slow first server of a run fall on both sides alike:
#
#   bash benchmarks/ab_env.sh OUT VAR "VALUE_A VALUE_B" ROUNDS SCRIPT [ARGS...]
#   e.g. bash benchmarks/ab_env.sh /tmp/ab ATTENTION_MAX_QUEUE_DELAY_MS "0.5 2" 3 \
#          benchmarks/bench_sessions.py --sides on --clients 1,64 --duration 6 --warmup 2
#
# (A code change is A/B'd the same way through a temporary switch it reads from the
# environment; issue11/2026-11-25c/ did so for the inline completion of decode steps.)
#
# Each run's log is OUT/<VAR>=<value>_<round>.log; the script starts its own server(s), which
# inherit the variable.
set -uo pipefail
OUT=${1:?usage: ab_env.sh OUT VAR "A B" ROUNDS SCRIPT [ARGS...]}
VAR=$2 VALUES=$3 ROUNDS=$4
shift 4
mkdir -p "$OUT"
status=0
for round in $(seq 1 "$ROUNDS"); do
  for value in $VALUES; do
    log="$OUT/${VAR}=${value}_${round}.log"
    echo "=== $VAR=$value round $round ($(date -u +%H:%M:%S))"
    env "$VAR=$value" python3 "$@" --out "$OUT/${VAR}=${value}_${round}" >"$log" 2>&1 \
      || { echo "run failed (see $log)"; status=1; }
    grep -E "^\| sessions|overhead over kernel at 1 client \(ms\)|bare gRPC echo" "$log"
  done
done
exit $status
