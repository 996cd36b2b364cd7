R=$OUT/r6; source benchmarks/device_env.sh
timeout 265 bash benchmarks/gpu_checks.sh $R service-tests > $R/stage.log 2>&1; echo "service-tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" $R/stage.log | tail -12
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call6.sh $R/command.sh
