set -u
R=/tmp/r2; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
timeout 240 python3 benchmarks/bench_paged.py --only decode --page-tokens 64,16 --page-order shuffled,sequential,runs --shapes 1:4096:128,1:32768:128,8:8192:128,64:8192:128 --out $R > $R/paged.log 2>&1
echo "paged rc=$?"
grep -E "^decode" $R/paged.log | sed -E 's/\| paged\/cudnn.*GPU time/| GPU/' | cut -c1-240
timeout 320 bash benchmarks/gpu_checks.sh $R service-tests > $R/stages.log 2>&1
echo "service-tests rc=$?"; grep -E "passed|failed" $R/service-tests.log | tail -3
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
