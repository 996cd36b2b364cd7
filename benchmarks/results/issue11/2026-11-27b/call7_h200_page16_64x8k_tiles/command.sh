set -u
R=/tmp/r7; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
T="python3 benchmarks/tune_decode_gpu.py --sweep configs --page 16 --shapes 64x8192"
timeout 60 $T --blocks 16,32,64 --warps 2,4 --stages 2,3 --splits 0 --out $R/span 2>&1 | grep -v Warn | tee $R/span.log
timeout 50 $T --page-span 0 --blocks 16,32,64 --warps 2,4 --stages 2,3 --splits 0 --out $R/nospan 2>&1 | grep -v Warn | tee $R/nospan.log
cp benchmarks/_call7.sh $R/command.sh
tar czf $OUT/r7.tgz -C /tmp r7
