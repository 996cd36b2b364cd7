R=/tmp/r2; source benchmarks/device_env.sh
healthy() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_service import _healthy; sys.exit(0 if _healthy('127.0.0.1:$1') else 1)" 2>/dev/null; }
run() {
  name=$1; side=$2; i=$3; shift 3; port=$((50100 + 2 * RANDOM % 1000)); mport=$((port + 1))
  env "$@" python3 -m attention_service --host 127.0.0.1 --port $port --metrics-port $mport --log-level WARNING --$side > $R/server_${name}_${side}_$i.log 2>&1 &
  sp=$!
  for t in $(seq 1 150); do healthy $port && break; sleep 1; done
  timeout 60 python3 benchmarks/bench_service.py --target 127.0.0.1:$port --metrics-url http://127.0.0.1:$mport/metrics --clients 64 --duration 8 --warmup 2 --prime 3 --max-len 256 --verify 0 --out $R/svc_${name}_${side}_$i > $R/svc_${name}_${side}_$i.log 2>&1
  echo "$name $side $i: $(grep -E 'clients +64:' $R/svc_${name}_${side}_$i.log | sed -E 's/ p50 ([0-9.]+) +p99 ([0-9.]+) ms +batch ([0-9.]+) +queue ([0-9.]+) ms +mean ([0-9.]+) ms \(server ([0-9.]+), engine ([0-9.]+), launch issue ([0-9.]+)\) +kernel busy ([0-9.]+%).*/ p50 \1 p99 \2 batch \3 queue \4 mean \5 server \6 engine \7 issue \8 busy \9/')"
  kill -TERM $sp; wait $sp
}
run base batching 1 X=1
timeout 120 python3 benchmarks/probe_issue.py > $R/probe_issue.txt 2>&1; echo "probe rc=$?"; cat $R/probe_issue.txt | cut -c1-400
timeout 120 python3 benchmarks/probe_issue.py --switch-interval 0.0002 > $R/probe_issue_si200.txt 2>&1; echo "probe si rc=$?"; grep -v "C calls" $R/probe_issue_si200.txt
echo "at $(( $(date +%s) - S )) s"
run base batching 1 X=1
run si200 batching 1 ATTENTION_SWITCH_INTERVAL=0.0002
run base no-batching 1 X=1
run si200 no-batching 1 ATTENTION_SWITCH_INTERVAL=0.0002
run si200 batching 2 ATTENTION_SWITCH_INTERVAL=0.0002
run base batching 2 X=1
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
