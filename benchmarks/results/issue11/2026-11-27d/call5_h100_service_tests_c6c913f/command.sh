set -u
R=/tmp/r5; rm -rf $R; mkdir -p $R
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt; nproc >> $R/gpu.txt
timeout 240 bash benchmarks/ab_env.sh $R/ab ATTENTION_SPIN_US "-1 0" 2 benchmarks/bench_sessions.py --sides on --clients 1,64 --duration 5 --warmup 2
timeout 330 bash benchmarks/gpu_checks.sh $R service-tests > $R/stage.log 2>&1; echo "stage rc=$?"; tail -3 $R/stage.log
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
