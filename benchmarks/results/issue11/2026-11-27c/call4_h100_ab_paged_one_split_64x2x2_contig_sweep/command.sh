set -u
R=/tmp/r4; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
T="python3 benchmarks/tune_decode_gpu.py --sweep ab --base-configs benchmarks/_base_configs.py --rounds 3"
timeout 150 $T --page 64 --shapes 64x8192,56x8192,52x8192 --out $R/ab64 2>&1 | grep -v Warn | tee $R/ab64.log
if [ "${CONTIG:-1}" = 1 ]; then
timeout 150 python3 benchmarks/tune_decode_gpu.py --sweep configs --blocks 32,64 --warps 2,4 --stages 2,3,4 --splits 0 --shapes 64x8192,56x8192 --out $R/contig 2>&1 | grep -v Warn | tee $R/contig.log
fi
timeout 100 python3 benchmarks/tune_decode_gpu.py --sweep configs --blocks 32,64 --warps 2,4 --stages 2,3,4 --splits 0 --page 64 --shapes 64x8192 --out $R/p64 2>&1 | grep -v Warn | tee $R/p64.log
cp benchmarks/_call4.sh $R/command.sh
tar czf $OUT/r4.tgz -C /tmp r4
