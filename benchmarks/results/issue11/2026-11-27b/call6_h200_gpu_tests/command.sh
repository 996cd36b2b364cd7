set -u
R=/tmp/r6; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 6 --timeout 200 -rA tests/kernels/test_warmup.py tests/kernels/test_paged.py -k "warm or long_paged or short_paged or split_count or many" > $R/tests.log 2>&1; echo "tests rc=$?"; grep -E "passed|failed|PASSED|FAILED|ERROR" $R/tests.log | tail -40
cp benchmarks/_call6.sh $R/command.sh
tar czf $OUT/r6.tgz -C /tmp r6
