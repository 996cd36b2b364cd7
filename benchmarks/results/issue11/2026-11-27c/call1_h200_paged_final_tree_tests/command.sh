set -u
R=/tmp/r1; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
timeout 200 python3 benchmarks/bench_paged.py --only decode --page-tokens 64,16 --out $R > $R/paged.log 2>&1; echo "paged rc=$?"
grep -E "^decode|^\|" $R/paged.log | cut -c1-230 | head -40
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 300 tests/kernels/test_paged.py tests/kernels/test_decode.py tests/kernels/test_warmup.py > $R/tests.log 2>&1; echo "tests rc=$?"; tail -3 $R/tests.log
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
