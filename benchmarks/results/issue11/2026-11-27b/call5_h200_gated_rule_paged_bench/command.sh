set -u
R=/tmp/r5; rm -rf $R; mkdir -p $R
rm -rf /tmp/app; (timeout 200 bash benchmarks/gpu_checks.sh $R >$R/install.log 2>&1)
export PYTHONPATH=/tmp/app:/tmp/site PATH=/tmp/app/bin:$PATH PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
python3 -c "from attention_kernels.configs import dram_gbps, num_sms; print('dram GB/s', dram_gbps(0), 'SMs', num_sms(0), 'GB/s per SM', dram_gbps(0) / num_sms(0))" 2>&1 | tee $R/device.txt
T="python3 benchmarks/tune_decode_gpu.py --sweep ab --base-configs benchmarks/_base_configs.py --rounds 3"
timeout 100 $T --page 64 --shapes 8x8192,1x32768,16x4096,128x2048,1x4096 --out $R/ab64 2>&1 | grep -v Warn | tee $R/ab64.log
timeout 50 $T --page 64 --head-dim 64 --shapes 8x8192 --out $R/ab64d64 2>&1 | grep -v Warn | tee $R/ab64d64.log
timeout 180 python3 benchmarks/bench_paged.py --only decode --page-tokens 64,16 --out $R > $R/paged.log 2>&1; echo "paged rc=$?"
grep -E "^decode" $R/paged.log | cut -c1-230
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 6 --timeout 300 tests/kernels/test_paged.py tests/kernels/test_decode.py tests/kernels/test_warmup.py > $R/tests.log 2>&1; echo "tests rc=$?"; tail -3 $R/tests.log
cp benchmarks/_call5.sh $R/command.sh
tar czf $OUT/r5.tgz -C /tmp r5
