R=/tmp/r2; source benchmarks/device_env.sh
timeout 100 python3 benchmarks/profile_group.py --out $R/prof --path grpc --batching on --frontends 0 --load-arg=--max-len=256 > $R/prof.log 2>&1; echo "prof rc=$?"
head -12 $R/prof/profile_cpu_*.txt
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run_variant() {
  name=$1; sw=$2; inf=$3; i=$4; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  VARIANT_SWITCH_US=$sw VARIANT_INFLIGHT=$inf python3 benchmarks/_variant_server.py --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --batching > $R/server_${name}_$i.log 2>&1 &
  sp=$!
  for t in $(seq 1 90); do healthy $port && break; sleep 1; done
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_${name}_$i > $R/svc_${name}_$i.log 2>&1
  echo "$name $i: $(grep -E 'clients +64:' $R/svc_${name}_$i.log | sed -E 's/ p50 ([0-9.]+).*batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+)\).*/ p50 \1 batch \2 queue \3 mean \4 server \5/')"
  kill -TERM $sp; wait $sp
}
for i in 1 2; do
  run_variant base "" "" $i
  run_variant switch500 500 "" $i
  run_variant inflight4 "" 4 $i
  run_variant both 500 4 $i
  echo "at $(( $(date +%s) - S )) s"
done
cp benchmarks/_call2.sh $R/command.sh; cp benchmarks/_variant_server.py $R/variant_server.py.txt
tar czf $OUT/r2.tgz -C /tmp r2
