R=/tmp/r3; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
# pin: "-" none; else "ENGINE FRONTENDS LOAD" cpu lists
run() {
  name=$1; side=$2; i=$3; ecpu=$4; fcpu=$5; lcpu=$6; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  python3 -m attention_service --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --$side > $R/server_${name}_${side}_$i.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  pre=""
  if [ "$ecpu" != "-" ]; then
    taskset -a -p -c $ecpu $sp > /dev/null
    for c in $(cat /proc/$sp/task/*/children); do taskset -a -p -c $fcpu $c > /dev/null; done
    pre="taskset -c $lcpu"
  fi
  timeout 60 $pre python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_${name}_${side}_$i > $R/svc_${name}_${side}_$i.log 2>&1
  echo "$name $side $i: $(grep -E 'clients +64:' $R/svc_${name}_${side}_$i.log | sed -E 's/ p50 ([0-9.]+) +p99 ([0-9.]+) ms +batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+), engine ([0-9.]+), launch issue ([0-9.]+)\) +kernel busy ([0-9.]+%).*/ p50 \1 p99 \2 batch \3 queue \4 mean \5 server \6 engine \7 issue \8 busy \9/')"
  kill -TERM $sp; wait $sp
}
run base batching 1 - - -
run e2 batching 1 0-1 2-9 10-15
run e3 batching 1 0-2 3-10 11-15
run base no-batching 1 - - -
run e2 no-batching 1 0-1 2-9 10-15
run base batching 2 - - -
run e2 batching 2 0-1 2-9 10-15
run e3 batching 2 0-2 3-10 11-15
run e3 no-batching 1 0-2 3-10 11-15
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
