R=/tmp/r3; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run() {
  side=$1; i=$2; name=${side}_$i; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  python3 -m attention_service --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --$side > $R/server_$name.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  (sleep 8; timeout 40 /tmp/site/bin/py-spy record -p $sp -d 5 -r 97 --native --idle --threads -f raw -o $R/native_$name.txt > $R/pyspy_$name.log 2>&1) & spy=$!
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_$name > $R/svc_$name.log 2>&1
  echo "$name: $(grep -E 'clients +64:' $R/svc_$name.log | cut -c1-100)"
  wait $spy; sleep 1
  kill -TERM $sp; wait $sp
}
run batching 1
run no-batching 1
ls -la $R; tail -3 $R/pyspy_*.log
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
