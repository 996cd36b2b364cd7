R=/tmp/r1; source benchmarks/device_env.sh
for side in on off; do
  timeout 150 python3 benchmarks/profile_group.py --out $R/prof --path grpc --batching $side --load-arg=--max-len=256 > $R/prof_$side.log 2>&1; echo "profile $side rc=$?"
  head -1 $R/prof/pyspy_engine_service_64_${side}_summary.txt; grep -E "clients +64:" $R/prof/profile_load_service_64_${side}.log | cut -c1-120
  echo "at $(( $(date +%s) - S )) s"
done
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run() {
  name=$1; nice=$2; side=$3; i=$4; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  python3 -m attention_service --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --$side > $R/server_${name}_${side}_$i.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  if [ "$nice" != 0 ]; then n=0; for c in $(cat /proc/$sp/task/*/children); do for t in /proc/$c/task/*; do renice -n $nice -p ${t##*/} > /dev/null && n=$((n+1)); done; done; echo "reniced $n threads"; fi
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_${name}_${side}_$i > $R/svc_${name}_${side}_$i.log 2>&1
  echo "$name $side $i: $(grep -E 'clients +64:' $R/svc_${name}_${side}_$i.log | sed -E 's/ p50 ([0-9.]+).*batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+)\).*/ p50 \1 batch \2 queue \3 mean \4 server \5/')"
  kill -TERM $sp; wait $sp
}
run base 0 batching 1
run nice5 5 batching 1
run base 0 no-batching 1
run nice5 5 no-batching 1
run base 0 batching 2
run nice5 5 batching 2
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
