R=/tmp/r4; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
# run NAME SIDE I LOADCPUS|- VERIFY CLIENTS SERVER-FLAGS...
run() {
  name=$1; side=$2; i=$3; lcpu=$4; verify=$5; clients=$6; shift 6; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  python3 -m attention_service --host 127.0.0.1 --port $port --metrics-port $mport --log-level INFO --$side "$@" > $R/server_${name}_${side}_$i.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  pre=""; [ "$lcpu" != "-" ] && pre="taskset -c $lcpu"
  timeout 80 $pre python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients $clients --duration 8 --warmup 2 --prime 3 --max-len 256 --verify $verify --out $R/svc_${name}_${side}_$i > $R/svc_${name}_${side}_$i.log 2>&1
  echo "$name $side $i [$(grep -o 'polling [0-9]* us, [^)]*' $R/server_${name}_${side}_$i.log | head -1)] $(grep -iE 'verif' $R/svc_${name}_${side}_$i.log | head -1 | cut -c1-60)"
  grep -E 'clients +1:' $R/svc_${name}_${side}_$i.log | cut -c1-60
  echo "  $(grep -E 'clients +64:' $R/svc_${name}_${side}_$i.log | sed -E 's/ p50 ([0-9.]+) +p99 ([0-9.]+) ms +batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+), engine ([0-9.]+), launch issue ([0-9.]+)\) +kernel busy ([0-9.]+%).*/ p50 \1 p99 \2 batch \3 queue \4 mean \5 server \6 engine \7 issue \8 busy \9/')"
  for c in $(cat /proc/$sp/task/*/children); do grep Cpus_allowed_list /proc/$c/status; break; done > $R/fe_cpus_${name}_${side}_$i.txt
  grep Cpus_allowed_list /proc/$sp/status >> $R/fe_cpus_${name}_${side}_$i.txt
  kill -TERM $sp; wait $sp; echo "  exit $?"
}
run auto batching 1 - 16 1,64
run none batching 1 - 0 1,64 --engine-cpus none
run auto no-batching 1 - 0 64
run none no-batching 1 - 0 64 --engine-cpus none
run split batching 1 11-15 0 64 --frontend-cpus 3-10
run split no-batching 1 11-15 0 64 --frontend-cpus 3-10
run auto batching 2 - 0 1,64
run none batching 2 - 0 1,64 --engine-cpus none
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
