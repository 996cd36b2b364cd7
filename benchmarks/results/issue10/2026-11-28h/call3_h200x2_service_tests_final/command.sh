R=/tmp/r3; source benchmarks/device_env.sh
timeout 560 bash benchmarks/gpu_checks.sh $R service-tests > $R/stage.log 2>&1; echo "rc=$?"
tail -5 $R/stage.log; ls $R; tail -3 $R/*service*tests*.log 2>/dev/null
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
