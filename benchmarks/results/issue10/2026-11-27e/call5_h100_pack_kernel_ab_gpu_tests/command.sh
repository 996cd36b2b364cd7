set -u
R=/tmp/r5; rm -rf $R; mkdir -p $R
(timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_copy_segments.py tests/service/test_pack_kernel_gpu.py > $R/tests.log 2>&1; echo "tests rc=$?"; tail -3 $R/tests.log
B="benchmarks/bench_service.py --duration 8 --warmup 2 --prime 3 --clients 64 --max-len 256"
timeout 60 python3 $B --batching on --duration 3 --prime 1 --out $R/settle > $R/settle.log 2>&1
for round in 1 2 3; do
  for v in 0 1; do
    ATTENTION_PACK_KERNEL=$v timeout 100 python3 $B --batching on --out $R/pack${v}_$round > $R/pack${v}_$round.log 2>&1
    echo "pack=$v round $round rc=$?: $(grep -E 'clients +64:' $R/pack${v}_$round.log)"
  done
done
timeout 100 python3 $B --batching off --out $R/off > $R/off.log 2>&1; echo "off: $(grep -E 'clients +64:' $R/off.log)"
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
