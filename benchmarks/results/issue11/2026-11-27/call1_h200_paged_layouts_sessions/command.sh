set -u
R=/tmp/r1; rm -rf $R; mkdir -p $R
(timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
git rev-parse HEAD > $R/tree.txt 2>/dev/null; git status --short >> $R/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
timeout 200 python3 benchmarks/bench_paged.py --only decode --page-tokens 64,16 --layouts token,head --out $R > $R/paged.log 2>&1
echo "paged rc=$?"
grep -E "^decode" $R/paged.log | sed -E 's/\| paged\/cudnn.*GPU time/| GPU/' | cut -c1-250
timeout 330 bash benchmarks/gpu_checks.sh $R sessions > $R/stages.log 2>&1
echo "sessions rc=$?"
grep -hE "^\| sessions|overhead over kernel at 1 client|bare gRPC echo|resend|on/off" $R/*.md $R/*.log 2>/dev/null | head -30
cp benchmarks/_call1.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
