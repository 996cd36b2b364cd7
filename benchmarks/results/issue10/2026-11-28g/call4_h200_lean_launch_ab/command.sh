R=/tmp/r4; source benchmarks/device_env.sh
AB_VAR=ATTENTION_LEAN_LAUNCH AB_VALUES="1 0" AB_ROUNDS=2 timeout 400 bash benchmarks/gpu_checks.sh $R batching-placed > $R/stage.log 2>&1; echo "stage rc=$?"
cat $R/batching-placed/summary.txt
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
