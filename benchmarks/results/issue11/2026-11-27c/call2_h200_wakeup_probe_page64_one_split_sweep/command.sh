set -u
R=/tmp/r2; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
timeout 90 python3 benchmarks/probe_wakeup.py --pings 1500 --gaps 0,300,1000 --out $R 2>&1 | tee $R/wakeup.log
T="python3 benchmarks/tune_decode_gpu.py --sweep configs --blocks 32,64 --warps 2,4 --stages 2,3,4 --splits 0"
timeout 240 $T --page 64 --shapes 64x8192,56x8192,48x8192 --out $R/p64 2>&1 | grep -v Warn | tee $R/p64.log
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
