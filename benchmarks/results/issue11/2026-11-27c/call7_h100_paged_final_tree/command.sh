set -u
R=/tmp/r7; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
timeout 220 python3 benchmarks/bench_paged.py --only decode --page-tokens 64,16 --out $R > $R/paged.log 2>&1; echo "paged rc=$?"
grep -E "^decode" $R/paged.log | sed -E 's/.*(B=[0-9]+ +ctx=[0-9]+ +D=[0-9]+ +page=[0-9]+).*GPU time \(graph\) us (.*)/\1 \2/'
cp benchmarks/_call7.sh $R/command.sh
tar czf $OUT/r7.tgz -C /tmp r7
