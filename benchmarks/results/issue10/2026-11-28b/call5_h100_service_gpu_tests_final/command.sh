R=/tmp/r5; source benchmarks/device_env.sh
timeout 430 bash benchmarks/gpu_checks.sh $R service-tests > $R/stages.log 2>&1; echo "service-tests rc=$?"
tail -4 $R/service-tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
