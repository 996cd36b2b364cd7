set -u
R=/tmp/r2; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
T="python3 benchmarks/tune_decode_gpu.py --sweep configs --page 64"
timeout 130 $T --shapes 8x8192 --blocks 32,64 --warps 4,8 --stages 2,3,4,5 --splits 0,1,2,3,4 --out $R/s8x8k 2>&1 | grep -v Warn | tee $R/s8x8k.log
timeout 110 $T --shapes 1x32768 --blocks 32,64 --warps 4,8 --stages 3,4,5 --splits 0,16,24,32 --out $R/s1x32k 2>&1 | grep -v Warn | tee $R/s1x32k.log
timeout 90 $T --shapes 128x2048 --blocks 32,64 --warps 2,4,8 --stages 2,3,4 --splits 0,1 --out $R/s128x2k 2>&1 | grep -v Warn | tee $R/s128x2k.log
timeout 90 $T --head-dim 64 --shapes 8x8192 --blocks 64,128 --warps 4,8 --stages 2,3,4,5 --splits 0,2,4 --out $R/d64 2>&1 | grep -v Warn | tee $R/d64.log
cp benchmarks/_call2.sh $R/command.sh
tar czf $OUT/r2.tgz -C /tmp r2
