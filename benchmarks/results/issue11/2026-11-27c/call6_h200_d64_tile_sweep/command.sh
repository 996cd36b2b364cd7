set -u
R=/tmp/r6; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
T="python3 benchmarks/tune_decode_gpu.py --sweep configs --head-dim 64 --blocks 64,128 --warps 2,4 --stages 2,3,4 --splits 0,4,8"
timeout 200 $T --shapes 8x8192,16x8192 --out $R/d64contig 2>&1 | grep -v Warn | grep -E "^B=|0\.9[0-9]x|1\.[0-9]+x" | tee $R/d64contig.log
timeout 200 $T --page 64 --shapes 8x8192,16x8192 --out $R/d64p64 2>&1 | grep -v Warn | grep -E "^B=|1\.[0-9]+x" | tee $R/d64p64.log
cp benchmarks/_call6.sh $R/command.sh
tar czf $OUT/r6.tgz -C /tmp r6
