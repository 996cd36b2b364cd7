set -u
R=/tmp/r1; rm -rf $R; mkdir -p $R
(timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
# 0: glibc defaults everywhere; 1: server and load clients tuned
timeout 380 bash benchmarks/ab_env.sh $R/ab ATTENTION_MALLOC_TUNING "0 1" 2 benchmarks/bench_service.py \
  --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256 > $R/ab.txt 2>&1
echo rc=$?
for f in $R/ab/*.log; do echo "== $f"; grep -E "clients +64:|^ +64 " $f; done
cp benchmarks/_tmp_malloc_ab.sh $R/command.sh
tar czf $OUT/r1.tgz -C /tmp r1
