R=/tmp/r5; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
# The server given CPUs 0-10 of its own (taskset: a cpuset narrower than the host), the load on 11-15.
run() {
  name=$1; side=$2; i=$3; shift 3; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  taskset -c 0-10 python3 -m attention_service --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --frontends 8 --$side "$@" > $R/server_${name}_${side}_$i.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  timeout 60 taskset -c 11-15 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_${name}_${side}_$i > $R/svc_${name}_${side}_$i.log 2>&1
  echo "$name $side $i [$(grep Cpus_allowed_list /proc/$sp/status | cut -f2) / $(for c in $(cat /proc/$sp/task/*/children); do grep Cpus_allowed_list /proc/$c/status | cut -f2; break; done)] $(grep -E 'clients +64:' $R/svc_${name}_${side}_$i.log | sed -E 's/ p50 ([0-9.]+) +p99 ([0-9.]+) ms +batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+), engine ([0-9.]+), launch issue ([0-9.]+)\) +kernel busy ([0-9.]+%).*/ p50 \1 p99 \2 batch \3 queue \4 mean \5 server \6 engine \7 issue \8 busy \9/')"
  kill -TERM $sp; wait $sp
}
run auto batching 1
run auto no-batching 1
run none batching 1 --engine-cpus none
run none no-batching 1 --engine-cpus none
run auto batching 2
run auto no-batching 2
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
