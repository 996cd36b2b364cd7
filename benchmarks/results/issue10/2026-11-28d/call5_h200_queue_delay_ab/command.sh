R=/tmp/r5; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run() {
  delay=$1; i=$2; name=delay${delay}_$i; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  python3 -m attention_service --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --batching --max-queue-delay-ms $delay > $R/server_$name.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_$name > $R/svc_$name.log 2>&1
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$mport/metrics').read().decode())" | grep -E "batch_requests_(bucket|count|sum)" > $R/metrics_batch_$name.txt
  echo "$name: $(grep -E 'clients +64:' $R/svc_$name.log | sed -E 's/ p50 ([0-9.]+).*p99 ([0-9.]+) ms +batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+)\).*/ p50 \1 p99 \2 batch \3 queue \4 mean \5 server \6/') | launches $(grep -E '_count' $R/metrics_batch_$name.txt | head -1 | awk '{print $2}') singles $(grep -E 'le="1.0"' $R/metrics_batch_$name.txt | head -1 | awk '{print $2}')"
  kill -TERM $sp; wait $sp
}
for i in 1 2; do run 0.5 $i; run 2 $i; run 5 $i; done
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
