R=/tmp/r5; source benchmarks/device_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 140 tests/service/test_pack_kernel_gpu.py tests/kernels/test_copy_segments.py > $R/pack_tests.log 2>&1; echo "pack tests rc=$?"; tail -2 $R/pack_tests.log
echo "at $(( $(date +%s) - S )) s"
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run_variant() {
  name=$1; old=$2; i=$3; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  VARIANT_OLD_TYPED=$old python3 benchmarks/_variant_server.py --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --batching > $R/server_${name}_$i.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 16 --out $R/svc_${name}_$i > $R/svc_${name}_$i.log 2>&1
  echo "$name $i: $(grep -E 'verify' $R/svc_${name}_$i.log | cut -c1-60) | $(grep -E 'clients +64:' $R/svc_${name}_$i.log | sed -E 's/ p50 ([0-9.]+).*batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+)\).*/ p50 \1 batch \2 queue \3 mean \4 server \5/')"
  kill -TERM $sp; wait $sp
}
run_variant old 1 1
run_variant new "" 1
run_variant old 1 2
run_variant new "" 2
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call5.sh $R/command.sh; cp benchmarks/_variant_server.py $R/variant_server.py.txt
tar czf $OUT/r5.tgz -C /tmp r5
