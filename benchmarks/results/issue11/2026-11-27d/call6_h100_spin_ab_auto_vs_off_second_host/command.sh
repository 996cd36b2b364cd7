set -u
R=/tmp/r6; rm -rf $R; mkdir -p $R
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt; nproc >> $R/gpu.txt
timeout 420 bash benchmarks/ab_env.sh $R/ab ATTENTION_SPIN_US "-1 0" 3 benchmarks/bench_sessions.py --sides on --clients 1,8,64 --duration 5 --warmup 2
cp benchmarks/_call6.sh $R/command.sh
tar czf $OUT/r6.tgz -C /tmp r6
