R=/tmp/r1; source benchmarks/device_env.sh
AB_VAR=ATTENTION_LAUNCH_GATE AB_VALUES="off readers all" AB_ROUNDS=2 timeout 570 bash benchmarks/gpu_checks.sh $R batching-placed > $R/stage.log 2>&1; echo "stage rc=$?"
tail -5 $R/stage.log
cat $R/batching-placed/summary.txt
echo "at $(( $(date +%s) - S )) s"
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
