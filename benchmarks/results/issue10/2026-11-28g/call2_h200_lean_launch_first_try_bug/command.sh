R=/tmp/r2; source benchmarks/device_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/kernels/test_device_array.py tests/kernels/test_copy_segments.py tests/kernels/test_launch_reuse.py > $R/kernel_tests.log 2>&1; echo "kernel tests rc=$?"; tail -3 $R/kernel_tests.log
timeout 120 python3 benchmarks/probe_issue.py --lean on,off --busy-procs 0 --batches 1,16 --seconds 2 > $R/probe_issue_lean.txt 2>&1; echo "probe rc=$?"; cut -c1-300 $R/probe_issue_lean.txt
echo "at $(( $(date +%s) - S )) s"
timeout 330 bash benchmarks/gpu_checks.sh $R service-tests > $R/stage.log 2>&1; echo "service-tests rc=$?"; grep -E "passed|failed|error" $R/stage.log | tail -5
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
