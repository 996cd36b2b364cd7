R=/tmp/r2; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run() {
  gate=$1; side=$2; i=$3; name=gate_${gate}_${side}_$i; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  ATTENTION_LAUNCH_GATE=$gate python3 -m attention_service --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --$side > $R/server_$name.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 16 --out $R/svc_$name > $R/svc_$name.log 2>&1
  echo "$name: $(grep -E 'verif' $R/svc_$name.log | cut -c1-50) | $(grep -E 'clients +64:' $R/svc_$name.log | sed -E 's/ p50 ([0-9.]+).*p99 ([0-9.]+) ms +batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+)\).*/ p50 \1 p99 \2 batch \3 queue \4 mean \5 server \6/')"
  kill -TERM $sp; wait $sp
}
for g in 0 readers all; do run $g batching 1; done
for g in 0 readers all; do run $g no-batching 1; done
for g in all readers 0; do run $g batching 2; done
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
