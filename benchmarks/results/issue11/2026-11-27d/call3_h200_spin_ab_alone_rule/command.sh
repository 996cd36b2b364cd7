set -u
R=/tmp/r3; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt; nproc >> $R/gpu.txt
true
export ATTENTION_SPIN_US=2000
timeout 480 bash benchmarks/ab_env.sh $R/ab ATTENTION_SPIN_AB "off both" 3 benchmarks/bench_sessions.py --sides on --clients 1,8,64 --duration 5 --warmup 2
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
