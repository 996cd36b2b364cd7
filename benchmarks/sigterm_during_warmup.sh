#!/usr/bin/env bash
# SIGTERM during warm-up (a pod stopped while it starts): the process group and the single
# process must exit 0, promptly. Warm-up compiles from an empty Triton cache, so it is still
# running 5 s after the engine made its KV pool.  Usage: sigterm_during_warmup.sh OUT
set -u
OUT=${1:?usage: sigterm_during_warmup.sh OUT}
export TRITON_CACHE_DIR=$(mktemp -d)
for fe in 0 1; do
  log=$OUT/sigterm_warmup_frontends$fe.log
  python3 -m attention_service --host 127.0.0.1 --port 0 --device cuda --metrics-port -1 \
    --grace-seconds 1 --frontends $fe > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do grep -q "kv cache pool" "$log" && break; sleep 0.5; done
  sleep 5
  warm=$(grep -c "warm-up on" "$log")
  t0=$(date +%s.%N); kill -TERM $pid; wait $pid; rc=$?; t1=$(date +%s.%N)
  echo "frontends=$fe rc=$rc warm_before_signal=$warm seconds_to_exit=$(python3 -c "print(round($t1 - $t0, 2))")" \
    | tee -a "$OUT/sigterm_warmup.txt"
done
rm -rf "$TRITON_CACHE_DIR"
