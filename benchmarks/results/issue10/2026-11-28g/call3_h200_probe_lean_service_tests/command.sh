R=/tmp/r3; source benchmarks/device_env.sh
timeout 100 python3 benchmarks/probe_issue.py --lean on,off --busy-procs 0 --batches 1,16 --seconds 2 > $R/probe_issue_lean.txt 2>&1; echo "probe rc=$?"; cut -c1-250 $R/probe_issue_lean.txt
echo "at $(( $(date +%s) - S )) s"
timeout 400 bash benchmarks/gpu_checks.sh $R service-tests > $R/stage.log 2>&1; echo "service-tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" $R/stage.log | tail -12
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
