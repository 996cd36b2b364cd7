R=/tmp/r5; source benchmarks/device_env.sh
AB_VAR=ATTENTION_LEAN_LAUNCH AB_VALUES="0 1" AB_ROUNDS=2 timeout 400 bash benchmarks/gpu_checks.sh $R batching-placed > $R/stage.log 2>&1; echo "stage rc=$?"
cat $R/batching-placed/summary.txt
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
