R=/tmp/r3; source benchmarks/device_env.sh
python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/service/test_regions_gpu.py tests/service/test_process_group_gpu.py > $R/new_gpu_tests.log 2>&1; echo "new gpu tests rc=$?" | tee -a $R/new_gpu_tests.log
tail -30 $R/new_gpu_tests.log | grep -E "passed|failed|^E " | head -30
bash benchmarks/gpu_checks.sh $R service-tests > $R/service_tests.log 2>&1; echo "service-tests rc=$?"
tail -4 $R/service_tests.log
echo "total $(( $(date +%s) - S )) s"
cp benchmarks/_call3.sh $R/command.sh; tar czf $OUT/r3.tgz -C /tmp r3
