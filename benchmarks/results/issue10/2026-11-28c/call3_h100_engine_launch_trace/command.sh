R=/tmp/r3; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run_traced() {
  side=$1; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  VARIANT_TRACE=$R/trace_$side.log python3 benchmarks/_variant_server.py --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --$2 > $R/server_$side.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  echo "healthy after $t s"
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_$side > $R/svc_$side.log 2>&1
  grep -E 'clients +64:' $R/svc_$side.log | cut -c1-200
  kill -TERM $sp; wait $sp
  python3 benchmarks/_trace_analyze.py $R/trace_$side.log 8 | tee $R/analysis_$side.txt
}
run_traced on batching
run_traced off no-batching
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call3.sh $R/command.sh; cp benchmarks/_variant_server.py $R/variant_server.py.txt; cp benchmarks/_trace_analyze.py $R/trace_analyze.py.txt
gzip $R/trace_*.log
tar czf $OUT/r3.tgz -C /tmp r3
