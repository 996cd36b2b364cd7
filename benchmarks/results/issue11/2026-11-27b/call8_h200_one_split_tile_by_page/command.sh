set -u
R=/tmp/r8; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
T="python3 benchmarks/tune_decode_gpu.py --sweep configs --blocks 32,64 --warps 4 --stages 2 --splits 0"
timeout 45 $T --page 64 --shapes 64x8192,48x8192 --out $R/p64 2>&1 | grep -v Warn | tee $R/p64.log
timeout 45 $T --page 16 --shapes 48x8192,16x32768 --out $R/p16 2>&1 | grep -v Warn | tee $R/p16.log
cp benchmarks/_call8.sh $R/command.sh
tar czf $OUT/r8.tgz -C /tmp r8
