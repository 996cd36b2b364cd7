R=/tmp/r1; source benchmarks/device_env.sh
python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/service/test_regions_gpu.py > $R/regions_gpu.log 2>&1; echo "regions_gpu rc=$?" | tee -a $R/regions_gpu.log
tail -30 $R/regions_gpu.log
bash benchmarks/gpu_checks.sh $R service-tests > $R/service_tests.log 2>&1; echo "service-tests rc=$?"
tail -8 $R/service_tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call1.sh $R/command.sh; tar czf $OUT/r1.tgz -C /tmp r1
