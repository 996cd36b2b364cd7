set -u
R=/tmp/r4; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt; nproc >> $R/gpu.txt
timeout 100 python3 benchmarks/bench_sessions.py --duration 2 --warmup 1 --clients 1 --sides on --out $R/settle > $R/settle.log 2>&1; grep 'overhead over kernel at 1' $R/settle.log
timeout 480 bash benchmarks/ab_env.sh $R/ab ATTENTION_SPIN_US "0 -1" 3 benchmarks/bench_sessions.py --sides on --clients 1,8,64 --duration 5 --warmup 2
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
