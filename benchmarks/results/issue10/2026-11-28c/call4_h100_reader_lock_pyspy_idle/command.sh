R=/tmp/r4; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run_variant() {
  name=$1; lock=$2; side=$3; i=$4; spy=$5; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  VARIANT_READER_LOCK=$lock python3 benchmarks/_variant_server.py --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --$side > $R/server_${name}_$i.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  if [ -n "$spy" ]; then (sleep 8; timeout 20 /tmp/site/bin/py-spy record -p $sp -d 5 -r 200 --idle --threads -f raw -o $R/pyspy_idle_$name.txt --nonblocking > /dev/null 2>&1) & fi
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_${name}_$i > $R/svc_${name}_$i.log 2>&1
  echo "$name $side $i: $(grep -E 'clients +64:' $R/svc_${name}_$i.log | sed -E 's/ p50 ([0-9.]+).*batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+)\).*/ p50 \1 batch \2 queue \3 mean \4 server \5/')"
  kill -TERM $sp; wait $sp; wait
}
run_variant base "" batching 1 spy
run_variant lock 1 batching 1 spy
run_variant base "" batching 2
run_variant lock 1 batching 2
run_variant base "" no-batching 1
run_variant lock 1 no-batching 1
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call4.sh $R/command.sh; cp benchmarks/_variant_server.py $R/variant_server.py.txt
tar czf $OUT/r4.tgz -C /tmp r4
