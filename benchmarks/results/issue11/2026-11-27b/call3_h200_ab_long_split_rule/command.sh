set -u
R=/tmp/r3; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
T="python3 benchmarks/tune_decode_gpu.py --sweep ab --base-configs benchmarks/_base_configs.py --rounds 3"
timeout 200 $T --page 64 --shapes 8x8192,1x32768,1x16384,4x4096,16x4096,16x32768,1x65536,2x16384,128x2048,64x8192,1x4096,1x8192,32x2048 --out $R/ab64 2>&1 | grep -v Warn | tee $R/ab64.log
timeout 90 $T --page 64 --head-dim 64 --shapes 8x8192,2x8192,16x8192,4x32768,1x32768 --out $R/ab64d64 2>&1 | grep -v Warn | tee $R/ab64d64.log
timeout 90 $T --page 16 --shapes 8x8192,1x32768,1x16384,16x4096,128x2048 --out $R/ab16 2>&1 | grep -v Warn | tee $R/ab16.log
cp benchmarks/_call3.sh $R/command.sh
tar czf $OUT/r3.tgz -C /tmp r3
