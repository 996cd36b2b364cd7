# run as: bash benchmarks/_tmp_malloc_agg.sh (TUNING unset: 1)
set -u
R=/tmp/r2; rm -rf $R; mkdir -p $R
[ -d /tmp/app ] || (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
rm -rf /tmp/baseline-tree && mkdir -p /tmp/baseline-tree && git archive 8091d8f | tar x -C /tmp/baseline-tree
ATTENTION_MALLOC_TUNING=${TUNING:-1} timeout 540 python3 benchmarks/bench_roundtrip.py --tokens 8192 --heads 16 --head-dim 128 --frontends 8 --clients 8,16 --iters 5 --agg-seconds 6 --baseline-tree /tmp/baseline-tree --out $R > $R/roundtrip_baseline.log 2>&1
echo rc=$?
grep -iE "aggregate|baseline|GB/s|x |ceilings|kernel" $R/roundtrip_baseline.log | tail -40
cp benchmarks/_tmp_malloc_agg.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
